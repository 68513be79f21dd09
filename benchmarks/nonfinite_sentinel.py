"""The non-finite sentinel's cost on the real model's update (`or1_trl/trainer/nonfinite.py`, issue 47: under 2%).

    python benchmarks/nonfinite_sentinel.py [--reps 12] [--rows 32] [--tokens 72] [--json FILE]
    python benchmarks/nonfinite_sentinel.py --quick     # the tiny model, 3 repetitions: tests this script
    python benchmarks/nonfinite_sentinel.py --device cuda --architecture --rows 32 --tokens 704   # a GPU machine

What is timed: one optimizer step of SmolLM2-135M-Instruct (`or1-trl model smollm2`'s folder; fp32 weights and
AdamW, bf16 autocast as the real-model demo trains) on `--rows` rows of `--tokens` tokens (the demo's update: 32 rows
of a short prompt and up to 48 completion tokens): forward, the token-mean cross-entropy, backward, and the optimizer
step. Arm `off`: that alone. Arm `on`: the same with the sentinel as `OR1Trainer` runs it — after the backward
`count_loss` (the loss, and the L1 norm of every trainable parameter's gradient in one fused call), and at the step's
boundary `on_pre_optimizer_step` (the all-reduce of the marks through accelerate, one process here, and their one
read on the host). The arms alternate step by step from the same weights (each step's gradients and the optimizer's
update are real, the weights move in both), after 2 untimed steps of each; the figure is the median of each arm's step
times and their ratio, in the same run.

On a GPU machine (no model files there) `--architecture` builds SmolLM2-135M's architecture with random weights
(`benchmarks/sdpa_guard.py`'s `smollm2_architecture`), and on CUDA the `on` arm's first timed backward runs under
`torch.cuda.set_sync_debug_mode("error")`, `count_loss` included: a host synchronisation there would raise
(`sync_free_backward` in the result). The all-reduce and the marks' one read at the step's boundary do synchronise,
once per step, by design.

The update alone is the conservative denominator: a whole RL step adds the rollout (generation: most of a real-model
step, `docs/benchmarks.md`), which the sentinel does not touch, so its share of a whole step is smaller still.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from transformers import TrainerControl, TrainerState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # or1_trl from this checkout
from or1_trl.trainer.nonfinite import NonFiniteSentinel


def load_model(quick: bool, architecture: bool, device: str):
    if quick:
        from or1_trl.testing import tiny_model_and_tokenizer

        return tiny_model_and_tokenizer(seed=0)[0].to(device)
    if architecture:  # SmolLM2-135M's shape, random weights (a GPU machine has no model files)
        from sdpa_guard import SMOLLM2, smollm2_architecture

        return smollm2_architecture(SMOLLM2, device)
    from transformers import AutoModelForCausalLM

    from or1_trl.models import model_folder

    return AutoModelForCausalLM.from_pretrained(model_folder("smollm2"), dtype=torch.float32).to(device)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_step(model, optimizer, batch: torch.Tensor, sentinel: NonFiniteSentinel | None,
             sync_check: bool = False) -> float:
    """Seconds of one update of `model` on `batch` (`[rows, tokens]` token ids), with or without `sentinel`; with
    `sync_check` (CUDA) the backward runs where any host synchronisation raises."""
    device = batch.device.type
    synchronize(device)
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=batch, labels=batch).loss  # a token mean: what the update's loss is shaped like
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
        if sentinel is not None:
            sentinel.count_loss(loss)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
    if sentinel is not None:
        sentinel.on_pre_optimizer_step(None, SimpleNamespace(global_step=0), TrainerControl())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return time.perf_counter() - start


def sentinel_work(sentinel: NonFiniteSentinel, model, repeats: int) -> list[float]:
    """Seconds of the sentinel's own work on one step's gradients, `repeats` times: its look at every trainable
    parameter's gradient after the last backward (`count_loss`; a finite tensor of the parameter's shape and dtype in
    `.grad` stands for the gradient) and its step-boundary decision; the same code as in training, without the update
    around it (that one is `on_s` - `off_s`, noisier)."""
    sentinel.on_train_begin(None, TrainerState(), TrainerControl())
    for param in sentinel._params:
        param.grad = torch.randn_like(param)
    loss = torch.ones((), device=sentinel._params[0].device)
    seconds = []
    for _ in range(repeats):
        synchronize(loss.device.type)
        start = time.perf_counter()
        sentinel.count_loss(loss)
        sentinel.on_pre_optimizer_step(None, SimpleNamespace(global_step=0), TrainerControl())
        synchronize(loss.device.type)
        seconds.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=12, help="timed steps of each arm")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=72)
    parser.add_argument("--work-repeats", type=int, default=20, help="timings of the sentinel's own work alone")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 repetitions, 8 x 16 tokens")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--architecture", action="store_true",
                        help="SmolLM2-135M's architecture with random weights (no model files needed)")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.rows, args.tokens = 3, 8, 16
    torch.manual_seed(0)
    model = load_model(args.quick, architecture=args.architecture, device=args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = torch.randint(10, model.config.vocab_size, (args.rows, args.tokens), device=args.device)  # [rows, tokens]
    # What the sentinel reads of its trainer: the model, the accelerator (the all-reduce), the optimizer's skip flag.
    accelerator = Accelerator(cpu=args.device == "cpu")
    trainer = SimpleNamespace(model=model, accelerator=accelerator, optimizer=optimizer, update_skip=None)
    sentinel = NonFiniteSentinel(trainer, stop_after=3)
    sync_free = None  # CUDA: whether the backward and `count_loss` ran without a host synchronisation
    times = {"off": [], "on": []}
    for rep in range(args.reps + 2):
        for arm in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            if arm == "off":  # the same model without the sentinel
                seconds = one_step(model, optimizer, batch, sentinel=None)
            else:  # as at the start of training
                sentinel.on_train_begin(None, TrainerState(), TrainerControl())
                check = args.device == "cuda" and sync_free is None and rep == 2
                try:
                    seconds = one_step(model, optimizer, batch, sentinel=sentinel, sync_check=check)
                    sync_free = True if check else sync_free
                except RuntimeError as error:  # a synchronisation under the sync debug mode
                    if not check:
                        raise
                    sync_free, seconds = False, float("nan")
                    print(f"a host synchronisation in the backward or the sentinel's look at the gradients: {error}")
            if rep >= 2 and seconds == seconds:  # 2 untimed steps of each arm first (NaN: the sync check failed)
                times[arm].append(seconds)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    work = sentinel_work(sentinel, model, repeats=args.work_repeats)
    result = {
        "model": "tiny" if args.quick else ("SmolLM2-135M architecture, random weights" if args.architecture else
                                            "SmolLM2-135M-Instruct"), "rows": args.rows, "tokens": args.tokens,
        "reps": args.reps, "cpus": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "sync_free_backward": sync_free,
        "torch": torch.__version__, "off_s": times["off"], "on_s": times["on"], "median_off_s": off,
        "median_on_s": on, "ratio_on_off": on / off, "steps_counted_nonfinite": sentinel.steps,
        "sentinel_work_s": work, "median_work_s": statistics.median(work),
        "work_over_update": statistics.median(work) / off,
    }
    print(f"{result['model']} on {result['device']}, update of {args.rows} x {args.tokens} tokens (bf16 autocast, "
          f"AdamW), {args.reps} steps per arm, interleaved: median {off * 1e3:.1f} ms without the sentinel, "
          f"{on * 1e3:.1f} ms with it: ratio {on / off:.4f}; the sentinel's own work on a full set of gradients "
          f"{statistics.median(work) * 1e3:.1f} ms (median of {len(work)}): {statistics.median(work) / off:.4f} of "
          "the update")
    if args.json:  # every step's time, for the record
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
