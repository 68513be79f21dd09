"""The offline demo, measured: wall clock, peak memory and its `OR1 demo: reward A -> B` line, run as a reader runs it.

    python benchmarks/demo.py [--runs 2] [--processes 1|2] [--quick] [--markdown FILE]

Each run is `or1-trl demo` (the README's first command; 60 SFT steps + 150 OR1 steps) in a fresh subprocess, in a
temporary directory, with torch's default threads (one per core). `--processes 2` runs it as `accelerate launch
--config_file configs/accelerate/cpu_2proc.yaml examples/train_or1.py` (the demo on two ranks). One process is not
launched through `accelerate launch`: it sets OMP_NUM_THREADS=1, which on 2 cores took 87-98 s instead of 68-72
and summed in another order (`0.330 -> 0.684` where `or1-trl demo` prints `0.330 -> 0.683`; measured 2026-11-29).
`--quick` runs `or1-trl demo --max_steps 3 --sft_steps 2` instead (seconds; for testing this script, not a
figure). Reported per run: wall clock of the whole command (interpreter start,
imports, model build, both trainings), the peak resident memory of its largest process (`ru_maxrss` of the
process tree, from `wait4`), the summary line, and whether all runs printed the same per-step rewards.

The demo is deterministic on a given machine (fixed seeds, CPU), but not across machines: another CPU (other
vector kernels in torch/oneDNN) or another thread count sums the matmuls in another order, the float rounding
differs, some sampled tokens differ, and from there the runs diverge. Same machine, same result; another machine,
another (similar) result.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"^OR1 demo: reward (\d+\.\d{3}) -> (\d+\.\d{3}) in \S+$", re.M)
STEP = re.compile(r"^step +(\d+)(?:/\d+)? \| reward (\S+)", re.M)  # `step   3/150 | reward ...`


def command(processes: int, quick: bool) -> list[str]:
    """`or1-trl demo` (as `python -m or1_trl.cli demo`), or the demo on `processes` ranks (`accelerate launch`)."""
    if processes == 1:
        launch = [sys.executable]
    else:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  os.path.join(ROOT, "configs", "accelerate", "cpu_2proc.yaml"), "--num_processes", str(processes)]
    if quick:
        return launch + ["-m", "or1_trl.cli", "demo", "--max_steps", "3", "--sft_steps", "2"]
    if processes == 1:
        return launch + ["-m", "or1_trl.cli", "demo"]
    return launch + [os.path.join(ROOT, "examples", "train_or1.py")]


def run_once(argv: list[str]) -> dict:
    """Run `argv` in a temporary directory; wall clock, peak RSS of the largest process, summary, step rewards."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="or1-demo-bench-") as cwd, tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.DEVNULL, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # usage covers the process and its reaped descendants
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}:\n{stdout[-2000:]}")
    summaries = SUMMARY.findall(stdout)
    if len(summaries) != 1:
        raise SystemExit(f"expected one `OR1 demo:` line, got {len(summaries)}:\n{stdout[-2000:]}")
    return {
        "wall_s": wall,
        "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,  # Linux: KiB
        "first": float(summaries[0][0]),
        "last": float(summaries[0][1]),
        "steps": [(int(step), reward) for step, reward in STEP.findall(stdout)],
    }


def markdown(results: list[dict], processes: int, quick: bool) -> str:
    what = ("`or1-trl demo --max_steps 3 --sft_steps 2` (quick mode: not the demo's figures)" if quick else
            "`or1-trl demo` (60 SFT steps + 150 OR1 steps)" if processes == 1 else
            "`accelerate launch examples/train_or1.py` (60 SFT steps + 150 OR1 steps)")
    if processes > 1:
        what += f", {processes} processes (`configs/accelerate/cpu_2proc.yaml`)"
    steps = len(results[0]["steps"])
    same = all(r["steps"] == results[0]["steps"] for r in results)
    lines = [
        f"The offline demo, {what}; `python benchmarks/demo.py --runs {len(results)}"
        f"{f' --processes {processes}' if processes > 1 else ''}{' --quick' if quick else ''}`:",
        "",
        "| run | wall clock s | peak RSS GB (largest process) | reward: first 5 steps → last 5 steps |",
        "|---:|---:|---:|---|",
    ]
    for i, r in enumerate(results, 1):
        lines.append(f"| {i} | {r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['first']:.3f} → {r['last']:.3f} |")
    lines += [
        "",
        f"The {len(results)} runs printed {'the same' if same else 'different'} rewards at all {steps} steps"
        + (" (deterministic on this machine)." if same else "."),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="how many times to run the demo (default 2)")
    parser.add_argument("--processes", type=int, default=1, choices=[1, 2])
    parser.add_argument("--quick", action="store_true", help="3 OR1 steps after 2 SFT steps: tests this script")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    args = parser.parse_args(argv)
    argv_demo = command(args.processes, args.quick)
    results = []
    for i in range(args.runs):
        r = run_once(argv_demo)
        print(f"run {i + 1}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_gb']:.2f} GB, "
              f"OR1 demo: reward {r['first']:.3f} -> {r['last']:.3f}", flush=True)
        results.append(r)
    block = markdown(results, args.processes, args.quick)
    print("\n" + block, end="")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(block)
    return results


if __name__ == "__main__":
    main()
