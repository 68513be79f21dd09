"""The model card `OR1Trainer` writes with TRL's machinery (`model_card.py`), offline: the saved folder and the card's
content after a two-stage run, then `or1-trl eval` on the output dir refreshing the card's evaluation block; and
`push_to_hub` (TRL's / transformers' / huggingface_hub's own code) against a local stub of the Hub's HTTP API."""

import base64
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from or1_trl import OR1Config, OR1Trainer
from or1_trl.cli import main
from or1_trl.demos.tiny import addition_dataset
from or1_trl.eval.evaluation import SUMMARY_JSON, summarize
from or1_trl.eval.model_card import (EVAL_END, EVAL_START, SECTION_START, base_model_name, first_sentence,
                                     tidy_trl_card, trained_completion_length)
from or1_trl.rewards import MathReward
from or1_trl.testing import save_tiny_model, tiny_training_args

STAGES = [
    {"until_step": 1, "batch_size": 2, "mini_batch_size": 2, "max_completion_length": 6},
    {"until_step": 2, "batch_size": 2, "mini_batch_size": 2, "max_completion_length": 8},
]


def card_metadata(text: str) -> dict:
    return yaml.safe_load(text.split("---")[1])


def test_card_records_the_run_and_eval_results(tmp_path, capsys):
    base = save_tiny_model(tmp_path / "base")
    out = tmp_path / "run"
    data = addition_dataset(16, seed=0).remove_columns("completion")
    args = OR1Config(**tiny_training_args(out, stages=STAGES, max_steps=-1, save_strategy="steps", save_steps=100,
                                          entropy_preset="released", top_entropy_quantile=0.2))
    trainer = OR1Trainer(model=base, reward_funcs=MathReward(num_workers=0), args=args, train_dataset=data)
    # An earlier `or1-trl eval` of this output dir (written here by hand: 2 problems x 2 samples).
    os.makedirs(out / "eval")
    earlier = {"model": str(out), "settings": {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "seed": 0},
               "backend": "hf", "benchmarks": {"aime24": summarize([
                   {"correct": [True, False], "num_tokens": [3, 8], "truncated": [False, True]},
                   {"correct": [False, False], "num_tokens": [8, 8], "truncated": [True, True]}], resamples=200)}}
    (out / "eval" / SUMMARY_JSON).write_text(json.dumps(earlier))
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(model_name="tiny-or1", dataset_name="local/additions")

    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= set(os.listdir(out))
    card = (out / "README.md").read_text()
    meta = card_metadata(card)
    assert {"or1", "trl", "grpo"} <= set(meta["tags"]) and meta["datasets"] == "local/additions"
    assert card.count(SECTION_START) == 1 and card.index(SECTION_START) < card.index("### Framework versions")
    # The base model is a folder that records no name: the card omits it rather than print this machine's path.
    assert "Base model" not in card and "[None]" not in card and str(tmp_path) not in card and "licence" not in meta
    assert "This model was fine-tuned on the [local/additions](https://huggingface.co/datasets/local/additions)" in card
    assert 'pipeline("text-generation", model="run"' in card  # not pushed: the output dir's name, not "None"
    assert "- **Training data:** `local/additions`, 16 prompts" in card and "- **Steps:** 2 of 2" in card
    assert "| 0 | 0–1 | 6 | 2 | 2 | 4 | 1 | 1e-06 |" in card and "| 1 | 1–2 | 8 | 2 | 2 | 4 | 1 | 1e-06 |" in card
    assert trained_completion_length(str(out)) == 8  # the last stage's: what `or1-trl eval` samples a training file for
    assert "| learning rate | 1e-06 (constant) |" in card and "| rejection sampling (§3.1) | `compact` |" in card
    assert "preset `released`: target 0.2, Δ 0.0001, c ∈ [0, 0.005]" in card
    assert "| 80/20 rule | top 0.2 of tokens by entropy, normalised over `all` |" in card
    last = [entry for entry in trainer.state.log_history if "reward" in entry][-1]
    assert last["step"] == 2
    row = "| " + " | ".join("—" if last.get(k) is None else f"{last[k]:.4g}"
                            for k in ("reward", "entropy", "rejection/kept_group_frac", "pool/size", "entropy_coef")) + " |"
    assert "### Final training metrics (step 2)" in card and row in card
    # The eval summary with its intervals: avg@2 = 1/4, pass@2 = 1/2.
    assert re.search(r"\| aime24 \| 2 \| 25\.0 \[0\.0, 50\.0\] \| 25\.0 \[0\.0, 50\.0\] \| 50\.0 \[0\.0, 100\.0\] \|", card)
    for arxiv in ("2505.22312", "2506.01939", "2504.20571", "2402.03300"):  # the seed papers, then GRPO
        assert f"arXiv:{arxiv}" in card
    assert "a method introduced in [Skywork Open Reasoner 1 Technical Report](https://huggingface.co/papers/2505.22312)" in card

    # Written again (every save, push_to_hub): the section is replaced, not repeated.
    trainer.create_model_card(model_name="tiny-or1")
    again = (out / "README.md").read_text()
    assert again.count(SECTION_START) == 1 and "`local/additions`, 16 prompts" in again

    # `or1-trl eval` on the output dir: results under run/eval/, and the card's evaluation block shows them.
    problems = tmp_path / "add4.jsonl"
    problems.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n"
                                for p, a in zip(data["prompt"][:4], data["answer"][:4])))
    main(["eval", "--model", str(out), "--benchmarks", str(problems), "--n", "2", "--max_tokens", "4",
          "--batch_size", "8", "--resamples", "200"])
    assert f"Updated the evaluation section of {out / 'README.md'}" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    block = card[card.index(EVAL_START):card.index(EVAL_END)]
    assert "| add4 | 4 |" in block and "| aime24 | 2 |" not in block  # other settings: the earlier summary is replaced
    assert card.count(SECTION_START) == 1 and "### Final training metrics (step 2)" in card


def trl_card(path, base_model, dataset_name, hub_model_id=None) -> str:
    """The card TRL's own `generate_model_card` writes (what `GRPOTrainer.create_model_card` saves), at `path`."""
    from trl.trainer.utils import generate_model_card

    card = generate_model_card(base_model=base_model, model_name="run", hub_model_id=hub_model_id,
                               dataset_name=dataset_name, tags=["or1"], wandb_url=None, trackio_url=None,
                               trainer_name="OR1", trainer_citation=None)
    card.save(path)
    return str(path)


def test_the_card_names_the_base_model_as_the_user_knows_it_and_never_a_machine_path(tmp_path):
    packaged = tmp_path / "models" / "smollm2-135m-instruct"  # a folder `or1-trl model smollm2` built
    packaged.mkdir(parents=True)
    (packaged / "or1_model.json").write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "files": {}}))
    earlier_run = tmp_path / "stage1"  # an earlier run's output dir: its card names that run's base model
    earlier_run.mkdir()
    trl_card(earlier_run / "README.md", "HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert base_model_name(str(packaged)) == "SmolLM2-135M-Instruct"
    assert base_model_name(str(earlier_run)) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # not a folder: a Hub id
    assert base_model_name(str(tmp_path)) is None and base_model_name(None) is None  # records nothing: unknown

    local_file = tmp_path / "mytrain.jsonl"
    local_file.write_text("{}\n")
    # TRL's card for a local base model (TRL passes None) and a local file, before the run is pushed:
    card_path = trl_card(tmp_path / "README.md", None, str(local_file))
    before = open(card_path).read()
    assert "[None](https://huggingface.co/None)" in before and "licence: license" in before  # what TRL writes
    assert f"https://huggingface.co/datasets/{local_file}" in before and 'model="None"' in before
    tidy_trl_card(card_path, base_model="SmolLM2-135M-Instruct", dataset_name=str(local_file), model_ref="outputs/run")
    after = open(card_path).read()
    meta = card_metadata(after)
    assert "This model is a fine-tuned version of SmolLM2-135M-Instruct on a local dataset (`mytrain.jsonl`)." in after
    assert "base_model" not in meta and "datasets" not in meta and "licence" not in meta  # not Hub ids: no metadata
    assert 'model="outputs/run"' in after and "None" not in after and str(tmp_path) not in after
    assert meta["library_name"] == "transformers" and "or1" in meta["tags"]  # the rest of TRL's metadata kept

    # A Hub base model and a Hub dataset, once pushed: linked, and in the metadata.
    card_path = trl_card(tmp_path / "hub.md", "Qwen/Qwen2.5-0.5B-Instruct", "my/math", hub_model_id="me/run")
    tidy_trl_card(card_path, base_model="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="my/math", model_ref="me/run")
    after = open(card_path).read()
    assert ("This model is a fine-tuned version of [Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/"
            "Qwen2.5-0.5B-Instruct) on the [my/math](https://huggingface.co/datasets/my/math) dataset.") in after
    meta = card_metadata(after)
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct" and meta["datasets"] == "my/math"
    assert 'model="me/run"' in after
    # Unknown base model, no dataset named.
    assert first_sentence(None, None) == "This model was fine-tuned."


# --------------------------------------------------------------------------------------------------------------
# push_to_hub against a local stub of the Hub
# --------------------------------------------------------------------------------------------------------------


class HubStub:
    """A local HTTP server answering the Hub endpoints `create_repo` and `upload_folder` call (huggingface_hub 1.x:
    `/api/repos/create`, `/api/validate-yaml`, `.../preupload/<rev>`, `.../commit/<rev>`), keeping every uploaded
    file in memory. It asks for every file in "regular" mode (inline base64), so no LFS or Xet storage is involved."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(404, {"error": f"{self.path} is not stubbed"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path, base = self.path.split("?")[0], f"http://{self.headers['Host']}"
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
                    stub.repos.setdefault(repo, {"visibility": request.get("visibility"), "files": {}, "commits": []})
                    return self.reply(200, {"url": f"{base}/{repo}", "name": repo})
                if path == "/api/validate-yaml":
                    return self.reply(200, {})
                _, _, _, namespace, name, operation, _ = path.split("/")  # /api/models/<namespace>/<name>/<op>/<rev>
                repo = stub.repos[f"{namespace}/{name}"]
                if operation == "preupload":
                    files = json.loads(body)["files"]
                    return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                      for f in files]})
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]  # commit: NDJSON
                repo["commits"].append(lines[0]["value"]["summary"])
                for line in lines[1:]:
                    repo["files"][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                number = len(repo["commits"])
                self.reply(200, {"commitUrl": f"{base}/{namespace}/{name}/commit/{number}", "commitOid": f"{number:040d}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def hub(monkeypatch):
    """The Hub client pointed at a `HubStub` (online mode for this test only: conftest sets HF_HUB_OFFLINE=1)."""
    import huggingface_hub.constants
    import transformers.utils.hub

    stub = HubStub()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub.url)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)  # transformers' shared HfApi, rebuilt on the stub
    monkeypatch.setenv("HF_TOKEN", "hf_stub")
    yield stub
    stub.server.shutdown()


def test_push_to_hub_uploads_the_folder_and_the_card_as_trl_does(hub, tmp_path):
    from or1_trl.testing import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer()
    out = tmp_path / "run"
    args = OR1Config(**tiny_training_args(out, push_to_hub=True, hub_model_id="me/tiny-or1", hub_private_repo=True,
                                          hub_strategy="every_save", save_strategy="steps", save_steps=1))
    trainer = OR1Trainer(model=model, reward_funcs=MathReward(num_workers=0), args=args, processing_class=tokenizer,
                         train_dataset=addition_dataset(16, seed=0).remove_columns("completion"))
    trainer.train()
    trainer.push_to_hub(dataset_name="local/additions")

    repo = hub.repos["me/tiny-or1"]
    assert repo["visibility"] == "private"  # hub_private_repo
    assert repo["commits"] == ["Training in progress, step 1", "Training in progress, step 2", "End of training"]  # every_save
    files = repo["files"]
    assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert not any(name.startswith("checkpoint-") for name in files)  # TRL/transformers keep checkpoints local
    card = files["README.md"].decode()
    assert card == (out / "README.md").read_text()
    assert "or1" in card_metadata(card)["tags"] and card_metadata(card)["datasets"] == "local/additions"
    assert card.count(SECTION_START) == 1 and "- **Steps:** 2 of 2" in card and "arXiv:2505.22312" in card
