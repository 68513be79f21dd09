"""Step time: OR1Trainer's overhead over TRL's GRPOTrainer, what rejection saves in the update, where a step goes.

    python benchmarks/step_time.py [--reps 5] [--steps 10] [--warmup 2] [--quick] [--markdown FILE]

All runs use the offline demo's model (the tiny model after its SFT warm-up on the answer format, built once) and
the demo's shape: 16 prompts x 8 samples per step, completions of at most 8 tokens, learning rate 2e-4 (constant),
CPU. One repetition runs each of the four arms below for `--steps` optimizer steps; the repetitions interleave the
arms (the order rotates from one repetition to the next), so slow phases of a shared machine hit every arm alike.
Per run, the first `--warmup` steps are dropped and the median of the rest is taken; the ratios are formed within a
repetition, and the table gives their min / median / max over the repetitions.

| arm | trainer | reward |
|---|---|---|
| `trl` | `GRPOTrainer`, `GRPOConfig` | scripted: in every group exactly one sample is correct (nothing to reject) |
| `or1` | `OR1Trainer`, `OR1Config` (MAGIC defaults: compaction, adaptive entropy) | the same |
| `or1_half` | `OR1Trainer`, `OR1Config` | scripted: every other group constant (half the groups rejected) |
| `or1_demo` | `OR1Trainer`, `OR1Config` | `math_reward` (the demo itself) |

Measured:
(a) step time (wall clock from one `on_step_end` to the next: generation, reward, update, logging), `or1` / `trl`
    — goal ≤ 1.03x;
(b) update time (`time/update_s`, OR1Trainer's time split: forward, backward, optimizer step), `or1_half` / `or1`
    — goal ≤ 0.60x;
(c) share of the step outside rollout and update in `or1_demo` (`time/*`): `other` alone, and `reward` + `other`
    — goal ≤ 5%.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.demos.tiny import demo_model_and_data
from or1_trl.rewards import math_reward
from or1_trl.testing import CPU_RUN

GROUP = 8
ARMS = ("trl", "or1", "or1_half", "or1_demo")
GOALS = {"a": 1.03, "b": 0.60, "c": 0.05}


class StepClock(TrainerCallback):
    """Wall clock of each optimizer step: from the previous `on_step_end` (or the start of training) to this one."""

    def __init__(self):
        self.last, self.steps = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.steps.append(now - self.last)
        self.last = now


def scripted_reward(half_constant: bool):
    """Rewards by position in the batch (TRL's layout: the G samples of a group are consecutive): the first sample of
    each group is correct; with `half_constant`, every other group is all-correct or all-wrong instead."""

    def reward(completions, **kwargs):
        out = []
        for i in range(len(completions)):
            group = i // GROUP
            if half_constant and group % 2 == 0:
                out.append(float(group % 4 == 0))  # constant group: solve_all or solve_none
            else:
                out.append(float(i % GROUP == 0))
        return out

    reward.__name__ = "scripted_half" if half_constant else "scripted"
    return reward


def settings(output_dir: str, steps: int, prompts: int = 16) -> dict:
    """The demo's shape (`or1_trl.demos.tiny.demo_config`: 16 prompts per step), for either config class."""
    return dict(CPU_RUN, output_dir=output_dir, learning_rate=2e-4, lr_scheduler_type="constant",
                per_device_train_batch_size=prompts * GROUP, num_generations=GROUP, max_completion_length=8,
                max_steps=steps, log_level="warning")


def run_arm(arm: str, model_path: str, tokenizer, dataset, steps: int, workdir: str, prompts: int = 16) -> dict:
    """Train one arm for `steps` steps from the model saved at `model_path`; its per-step wall clock and logged
    metrics. (A fresh load, not `copy.deepcopy` of the SFT'd model: the SFT trainer leaves a patched `forward` whose
    closure calls the original's weights.)"""
    kwargs = settings(f"{workdir}/{arm}", steps, prompts)
    reward = {"trl": scripted_reward(False), "or1": scripted_reward(False), "or1_half": scripted_reward(True),
              "or1_demo": math_reward}[arm]
    trainer_cls, config = (GRPOTrainer, GRPOConfig(**kwargs)) if arm == "trl" else (OR1Trainer, OR1Config(**kwargs, overwrite_output_dir=True))  # one scratch dir per arm, reused by each rep
    clock = StepClock()
    trainer = trainer_cls(model=AutoModelForCausalLM.from_pretrained(model_path), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    return {"step_s": clock.steps, "log": logged}


def summarise(run: dict, warmup: int) -> dict:
    """Median step time, median update time and the time split's sums after the warm-up steps."""
    log = run["log"][warmup:]
    out = {"step_s": statistics.median(run["step_s"][warmup:])}
    if log and "time/step_s" in log[0]:
        out["update_s"] = statistics.median(e["time/update_s"] for e in log)
        total = sum(e["time/step_s"] for e in log)
        for phase in ("rollout", "reward", "update", "other"):
            out[f"{phase}_share"] = sum(e[f"time/{phase}_s"] for e in log) / total
        out["kept"] = statistics.mean(e.get("rejection/kept_group_frac", float("nan")) for e in log)
    return out


def spread(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def markdown(results: list[dict], args) -> str:
    ratio_a = [r["or1"]["step_s"] / r["trl"]["step_s"] for r in results]
    ratio_b = [r["or1_half"]["update_s"] / r["or1"]["update_s"] for r in results]
    other = [r["or1_demo"]["other_share"] for r in results]
    outside = [r["or1_demo"]["other_share"] + r["or1_demo"]["reward_share"] for r in results]

    def verdict(values, goal):
        return "met" if statistics.median(values) <= goal else "**missed**"

    flags = "".join(f" --{name} {value}" for name, value, default in
                    (("reps", args.reps, 5), ("steps", args.steps, 10), ("warmup", args.warmup, 2)) if value != default)
    lines = [
        f"Step time, `python benchmarks/step_time.py{' --quick' if args.quick else flags}`: the demo's model and shape "
        f"({'4 (quick)' if args.quick else 16} prompts × 8 samples, ≤ 8 tokens, CPU); {args.reps} interleaved "
        f"repetitions of {args.steps} steps per "
        f"arm, the first {args.warmup} dropped; min / median / max over the repetitions:",
        "",
        "| measure | min / median / max | goal (median) |",
        "|---|---:|---|",
        f"| (a) step time, `OR1Trainer` / `GRPOTrainer`, nothing rejected | {spread(ratio_a, '.3f')}× | "
        f"≤ {GOALS['a']:.2f}×: {verdict(ratio_a, GOALS['a'])} |",
        f"| (b) update time, half the groups rejected / none (`OR1Trainer`) | {spread(ratio_b, '.3f')}× | "
        f"≤ {GOALS['b']:.2f}×: {verdict(ratio_b, GOALS['b'])} |",
        f"| (c) share of the step outside rollout and update, demo (`math_reward`): `other` | {spread(other, '.1%')} | "
        f"≤ {GOALS['c']:.0%}: {verdict(other, GOALS['c'])} |",
        f"| (c) the same, `reward` + `other` | {spread(outside, '.1%')} | ≤ {GOALS['c']:.0%}: "
        f"{verdict(outside, GOALS['c'])} |",
        "",
        "| arm | step s (median) | update s (median) | rollout | reward | update | other | kept groups |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"trl": "`GRPOTrainer`, scripted reward", "or1": "`OR1Trainer`, scripted reward",
             "or1_half": "`OR1Trainer`, half the groups constant", "or1_demo": "`OR1Trainer`, `math_reward` (demo)"}
    for arm in ARMS:
        rows = [r[arm] for r in results]
        step = statistics.median(r["step_s"] for r in rows)
        if "update_s" in rows[0]:
            shares = " | ".join(f"{statistics.median(r[f'{p}_share'] for r in rows):.1%}"
                                for p in ("rollout", "reward", "update", "other"))
            lines.append(f"| {names[arm]} | {step:.3f} | {statistics.median(r['update_s'] for r in rows):.3f} | "
                         f"{shares} | {statistics.median(r['kept'] for r in rows):.2f} |")
        else:
            lines.append(f"| {names[arm]} | {step:.3f} | — | — | — | — | — | — |")
    lines += ["", "Shares are OR1Trainer's time split (`time/*`, host clocks); `GRPOTrainer` logs no split."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions of the four arms")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each run")
    parser.add_argument("--quick", action="store_true",
                        help="tests this script: 1 repetition of 3 steps (1 dropped) of 4 prompts, 4 SFT steps")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    args = parser.parse_args(argv)
    prompts = 16
    if args.quick:
        args.reps, args.steps, args.warmup, prompts = 1, 3, 1, 4
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    results = []
    with tempfile.TemporaryDirectory(prefix="or1-step-time-") as workdir:
        model, tokenizer, dataset = demo_model_and_data(f"{workdir}/sft", sft_steps=4 if args.quick else 60, seed=0)
        model_path = f"{workdir}/start"
        model.save_pretrained(model_path)
        for rep in range(args.reps):
            order = ARMS[rep % len(ARMS):] + ARMS[: rep % len(ARMS)]
            result = {}
            for arm in order:
                result[arm] = summarise(run_arm(arm, model_path, tokenizer, dataset, args.steps, workdir, prompts),
                                        args.warmup)
                print(f"rep {rep + 1}/{args.reps} {arm}: {result[arm]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
            results.append(result)
    block = markdown(results, args)
    print("\n" + block)
    if args.markdown:  # the README block (benchmarks/update_readme.py)
        pathlib.Path(args.markdown).write_text(block)


if __name__ == "__main__":
    main()
