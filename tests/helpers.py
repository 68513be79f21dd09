"""What several test modules share (not installed with the package); a test module imports from here or takes a
`conftest.py` fixture, never from another test module. The tiny model and tokenizer are public API:
`or1_trl.testing`.

- The released data's layout: a local dataset exactly like `Skywork/Skywork-OR1-RL-Data` (its card's features and
  `math` / `code` splits), for tests that must not touch the network.
- Trainer runs: `tagged_dataset`, `ScriptedReward`, `parity_reward`, `logged`, group size `G`, the trainer's
  warnings with their steps (`TrainerLog`).
- Plain references written from the paper: eq. 3.1's log-probs/entropies on a fixed batch
  (`reference_logps_entropy`, `fixed_batch`), eq. 3.2 (`reference_eq_3_2`).
- The real vLLM CPU server: `server_args`, `tied_trainer`, `model_logprobs`/`server_logprobs` and their tolerance
  (`DIFF`, `TOL`), `two_trainer_processes`, `KillsTheServerMidStep`.
- Processes and the command line: `ROOT`, `free_port`, `ENV`, `RECIPES`, `TINY`, `exit_code`, `accelerate_launch`.
- Sharded runs (`tests/distributed/sharded_run.py`): `force_fsdp2` (accelerate's FSDP2 on CPUs), `gathered_state`
  (parameters, Adam's moments, step counts and learning rate, whole from ZeRO or FSDP shards).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys

import pytest
import requests
import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.cli import main
from or1_trl.generation.serve import API_KEY_ENV
from or1_trl.recipe.rejection import WEIGHT_KEY
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

# The released data's layout (`Skywork/Skywork-OR1-RL-Data`, README.md `dataset_info.features` and `configs`).
RELEASED_DIFFICULTY_KEYS = ("DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1-Distill-Qwen-32B", "DeepSeek-R1-Distill-Qwen-7B")
_RELEASED_CARD = """---
dataset_info:
  features:
  - name: data_source
    dtype: string
  - name: prompt
    list:
    - name: content
      dtype: string
    - name: role
      dtype: string
  - name: ability
    dtype: string
  - name: reward_model
    struct:
    - name: ground_truth
      dtype: string
    - name: style
      dtype: string
  - name: extra_info
    struct:
    - name: index
      dtype: int64
    - name: model_difficulty
      struct:
      - name: DeepSeek-R1-Distill-Qwen-1.5B
        dtype: int64
      - name: DeepSeek-R1-Distill-Qwen-32B
        dtype: int64
      - name: DeepSeek-R1-Distill-Qwen-7B
        dtype: int64
configs:
- config_name: default
  data_files:
  - split: math
    path: data/math-*
  - split: code
    path: data/code-*
---
"""


def released_features():
    """`datasets.Features` of the released data (its card's `dataset_info.features`)."""
    from datasets import Features, List, Value

    return Features({
        "data_source": Value("string"),
        "prompt": List({"content": Value("string"), "role": Value("string")}),
        "ability": Value("string"),
        "reward_model": {"ground_truth": Value("string"), "style": Value("string")},
        "extra_info": {"index": Value("int64"),
                       "model_difficulty": {key: Value("int64") for key in RELEASED_DIFFICULTY_KEYS}},
    })


def released_row(question: str, ground_truth, ability: str = "math", index: int = 0, data_source: str = "fixture",
                 difficulty: dict | None = None) -> dict:
    """One row in the released layout. `ground_truth` is JSON-encoded (a list of answers for math, a test object for
    code); `difficulty` maps "1.5B" / "7B" / "32B" to counts out of 16 (missing: null)."""
    difficulty = difficulty or {}
    return {
        "data_source": data_source,
        "prompt": [{"content": question, "role": "user"}],
        "ability": ability,
        "reward_model": {"ground_truth": json.dumps(ground_truth), "style": "rule"},
        "extra_info": {"index": index, "model_difficulty": {
            key: difficulty.get(key.rsplit("-", 1)[1]) for key in RELEASED_DIFFICULTY_KEYS}},
    }


def write_released_dataset(path: str | os.PathLike, math_rows: list[dict], code_rows: list[dict]) -> str:
    """A local copy of the released layout at `path`: the card's README.md and `data/{math,code}-00000-of-00001.parquet`
    (`datasets.load_dataset(path, split="math+code")` reads it as it reads the Hub dataset)."""
    from datasets import Dataset

    os.makedirs(os.path.join(path, "data"), exist_ok=True)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(_RELEASED_CARD)
    for split, rows in (("math", math_rows), ("code", code_rows)):
        Dataset.from_list(rows, features=released_features()).to_parquet(
            os.path.join(path, "data", f"{split}-00000-of-00001.parquet"))
    return str(path)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def tagged_dataset(tags):
    return Dataset.from_dict({"prompt": [f"{tag}: {i}+{i}=? A:" for i, tag in enumerate(tags)]})


class ScriptedReward:
    """Reward decided by the prompt's tag: ALL -> every sample 1 (solve_all), NONE -> 0 (solve_none),
    MIX -> only the first sample of the group 1 (informative). Records, per call, how many rows are informative."""

    __name__ = "scripted"

    def __init__(self):
        self.informative_rows = []

    def __call__(self, prompts, completions, **kwargs):
        rewards = []
        for i, prompt in enumerate(prompts):
            tag = prompt.split(":")[0]
            rewards.append(1.0 if tag == "ALL" else 0.0 if tag == "NONE" else float(i % G == 0))
        self.informative_rows.append(sum(p.startswith("MIX") for p in prompts))
        return rewards


G = 4  # samples per prompt in tiny_training_args


def reference_logps_entropy(model, prompt_ids, completion_ids, completion_mask):
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, P - 1 : -1].float()  # [B, T, V]
    log_probs = torch.log_softmax(logits, -1)
    logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


B, P, T = 8, 5, 7  # the fixed batch's rows, prompt length, completion length


def fixed_batch(model, vocab):
    g = torch.Generator().manual_seed(1234)
    prompt_ids = torch.randint(5, vocab, (B, P), generator=g)
    completion_ids = torch.randint(5, vocab, (B, T), generator=g)
    lengths = torch.tensor([7, 3, 5, 7, 1, 6, 7, 4])
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # right padding
    weight = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float)  # rows 4-7: a rejected group
    advantages = torch.tensor([1.2, -0.4, 0.7, -1.5, 0.0, 0.0, 0.0, 0.0])
    with torch.no_grad():
        logps, _ = reference_logps_entropy(model, prompt_ids, completion_ids, completion_mask)
    old = logps + 0.3 * torch.randn(B, T, generator=g)  # ρ far from 1: clipping is exercised on both sides
    kept_tokens = (completion_mask * weight[:, None]).sum()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": kept_tokens,
        WEIGHT_KEY: weight,
    }


def two_trainer_processes(vllm_server, tmp_path, mode="sync") -> list[dict]:
    """`tests/distributed/vllm_server_2proc.py` under `accelerate launch` (2 processes, gloo): what each rank wrote."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        os.path.join(ROOT, "tests/distributed/vllm_server_2proc.py"), str(tmp_path), vllm_server.url, mode,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    assert env[API_KEY_ENV] == vllm_server.api_key
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"vllm_rank{r}.json").read_text()) for r in (0, 1)]


STAGES = [
    {"until_step": 2, "max_completion_length": 4, "batch_size": 2, "mini_batch_size": 2, "num_generations": 4},
    {"until_step": 4, "max_completion_length": 7, "batch_size": 2, "mini_batch_size": 2, "num_generations": 4},
]


def tied_trainer(server, output_dir, reward=None, dataset=None, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    return OR1Trainer(
        model, reward or ScriptedReward(), args=server_args(server, output_dir, **overrides),
        train_dataset=dataset or tagged_dataset(["MIX", "ALL", "MIX", "NONE"] * 4), processing_class=tokenizer,
    )


def server_args(server, output_dir, **overrides):
    settings = dict(
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_weight_sync="disk",
        vllm_server_api_key=server.api_key, learning_rate=1e-2, max_steps=3,
        generation_kwargs={"ignore_eos": True},  # every completion runs to the length limit
    )
    settings.update(overrides)
    return OR1Config(**tiny_training_args(output_dir, **settings))


def model_logprobs(model, token_ids):
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1)[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]


def server_logprobs(server, token_ids):
    """The server's log-prob of each token of `token_ids` given the ones before it."""
    response = requests.post(
        f"{server.url}/v1/completions",
        json={"model": server.model_path, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0},
        headers=server.headers,
    )
    response.raise_for_status()
    scored = response.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([scored[i][str(token_ids[i])]["logprob"] for i in range(1, len(token_ids))])


TOL = 1e-4


DIFF = "sampling/sampling_logp_difference/max"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exit_code(capsys, *argv):
    """`main(argv)` in-process: its exit status and (stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


# Subprocesses import this checkout's or1_trl (not another installed copy), as the console script would.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


RECIPES = os.path.join(ROOT, "examples", "recipes")
TINY = os.path.join(RECIPES, "tiny_cpu.yaml")


def reference_eq_3_2(entropies, tgt, delta, c_min, c_max):
    """Plain transcription of eq. 3.2 with the documented one-step lag of the gate.

    Returns the list of (alpha applied at step k, c after the update at step k) for k = 0, 1, ...
    `None` in `entropies` is a step with no kept token: nothing measured, nothing changes.
    """
    c, last_e, out = 0.0, math.inf, []
    for e in entropies:
        alpha = c if last_e <= tgt else 0.0  # α_k = c_k · 1{e ≤ tgt}, gated by the last measured e
        if e is not None:
            if e < tgt:
                c = c + delta
            elif e > tgt:
                c = c - delta
            c = min(max(c, c_min), c_max)
            last_e = e
        out.append((alpha, c))
    return out


class KillsTheServerMidStep(ScriptedReward):
    """`ScriptedReward` (every group "MIX": informative) that, at its `at`-th call — a step's first rollout — calls
    `kill()` and scores that rollout all 0, so that rejection refills the step: the refill round generates on
    whatever server is there then."""

    def __init__(self, kill, at: int):
        super().__init__()
        self.kill, self.at, self.calls = kill, at, 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        rewards = super().__call__(prompts, completions, **kwargs)
        if self.calls != self.at:
            return rewards
        self.kill()
        return [0.0] * len(rewards)


class TrainerLog(logging.Handler):
    """The trainer's warnings, each with the optimizer steps completed when it was given."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.trainer, self.records = None, []

    def emit(self, record):
        step = self.trainer.state.global_step if self.trainer is not None else None
        self.records.append((step, record.getMessage()))

    def __enter__(self):
        logging.getLogger("or1_trl.trainer.or1_trainer").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("or1_trl.trainer.or1_trainer").removeHandler(self)

    def matching(self, text):
        return [(step, message) for step, message in self.records if text in message]


# --- Sharded runs (`tests/distributed/sharded_run.py`, `tests/trainer/test_sharding.py`)
def force_fsdp2(args, trainer=None):
    """accelerate's FSDP2 on the CPU, forced: accelerate selects FSDP only for GPU-type process groups
    (`accelerate/state.py`, the `MULTI_GPU, ...` branch of `AcceleratorState.__init__`), so `fsdp2.yaml` on a CPU runs
    DDP (`OR1Trainer` refuses that downgrade unless told otherwise). Before the trainer exists: the process group
    (gloo) is reported as a GPU-type one, so the trainer's `Accelerator` selects FSDP from the launch config, as on
    GPUs. After: the shared state is checked to hold FSDP2. A test device, not a way to train: the process group stays
    gloo and the tensors on the CPU."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if trainer is None:
        assert args.world_size >= 1  # TrainingArguments set the process group up (gloo): it is reported as GPU-type
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        return
    state = AcceleratorState()
    assert state.distributed_type == DistributedType.FSDP and state.fsdp_plugin.fsdp_version == 2, state


def gathered_state(trainer) -> dict:
    """What a sharded run is compared by, whole on every rank (gathering ZeRO or FSDP shards: a collective): each
    trainable parameter and its Adam moments (`{name: tensor}`), Adam's step counts, the learning rate, and
    DeepSpeed's engine counters (`None` without DeepSpeed)."""
    from accelerate.utils import DistributedType

    kind = trainer.accelerator.distributed_type
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's wrapper, DeepSpeed's ZeRO optimizer, then torch's
        optimizer = optimizer.optimizer
    params, moments = {}, {"exp_avg": {}, "exp_avg_sq": {}}
    zero = trainer.model_wrapped.optimizer if kind == DistributedType.DEEPSPEED else None
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link each parameter to its Adam state after
        zero._hp_optimizer_states_linked = False  # the first group's first step, before the second group has any:
        zero._lazy_init_hp_params_optimizer_state()  # linked again, every group's state exists by now
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if kind == DistributedType.DEEPSPEED:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            params[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
            for key in moments:
                state = safe_get_full_optimizer_state(param, key)
                moments[key][name] = None if state is None else state.detach().cpu().clone()
            continue
        full = getattr(param, "full_tensor", None)  # FSDP2: a DTensor shard
        params[name] = (full() if full else param).detach().cpu().clone()
        state = optimizer.state.get(param, {})
        for key in moments:
            value = state.get(key)
            if value is not None and hasattr(value, "full_tensor"):
                value = value.full_tensor()
            moments[key][name] = None if value is None else value.detach().cpu().clone()
    engine = trainer.model_wrapped if kind == DistributedType.DEEPSPEED else None
    return {
        "params": params, **moments,
        "adam_steps": sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s}),
        "lr": [group["lr"] for group in optimizer.param_groups],
        "engine": None if engine is None else {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                                               "skipped_steps": engine.skipped_steps},
    }


def accelerate_launch(config: str, script: str, *arguments, options=(), timeout=600, log=None):
    """`accelerate launch --config_file configs/accelerate/<config> [options] <script> <arguments>` from the repository
    root (DeepSpeed config files are relative to it), 1 thread per process, this checkout's `or1_trl`: its
    `CompletedProcess`, or with `log` (a file path) the running `Popen`, its output going to that file (a pipe nobody
    reads would stall a run that logs much while another is waited for)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "configs", "accelerate", config), "--main_process_port", str(free_port()), *options,
               os.path.join(ROOT, script), *map(str, arguments)]
    env = {**os.environ, **{name: ENV[name] for name in ("HF_HUB_OFFLINE", "WANDB_MODE", "PYTHONPATH")},
           "OMP_NUM_THREADS": "1"}  # the environment now: a vLLM server fixture exports its key
    if log is not None:
        with open(log, "w") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


#: The API key of the server tests that need no server (`or1_vllm_auth`'s middleware, `or1_private`'s key files).
KEY = "k" * 64

#: Pass-through flags vLLM's parser reads as a flag `or1-trl serve` decides: abbreviations, `=` forms, `_` for `-`,
#: dotted keys. (`--host=X`, `--port=X`, `--api_key K` are `or1-trl serve`'s own flags, checked as `--host X` is.)
HIJACKS = [
    ["--ho=0.0.0.0"], ["--hos", "0.0.0.0"], ["--hos=0.0.0.0"], ["--host.x", "1"],
    ["--por=9000"], ["--ud", "/tmp/s"], ["--uds=/tmp/s"], ["--api-k=k"], ["--api-key.x", "k"],
    ["--middleware", "m.M"], ["--midd=m.M"], ["--worker_extension_cls", "x.Y"], ["--worker-ext=x.Y"],
]

#: Another user (`nobody`) for the ownership checks: the tests run as root, which may chown to it (`needs_root`).
NOBODY = 65534


def needs_root():
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")


def private(path):
    """`path` (a folder) with mode 0700."""
    os.chmod(path, 0o700)
    return str(path)
