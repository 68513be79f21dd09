"""Does the real-model demo repeat? Two runs of `or1-trl demo --model smollm2` with one seed, compared step by step.

    python benchmarks/demo_repeat.py [--steps 9] [--held-out-per-rung 8] [--dtype float32] [--bf16 auto|on|off]

Each run is `real_model.run_real_demo` with its defaults (rollouts seeded by the demo's seed, its own vLLM CPU
server), shortened to `--steps` steps and `--held-out-per-rung` held-out prompts per rung, the server in `--dtype`
(`float32`: the demo's `SERVER_ARGS`; `bfloat16`: `BF16_SERVER_ARGS`). The result (`benchmarks/results/demo_repeat-cpu/
<dtype>.json`, each run written as it ends, a stopped comparison resumed with the second run) holds each run's
`rollout/completions_hash` per step, its held-out accuracy before and after, its step times and its wall clock;
`compare` says at which steps the two runs drew the same completions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "demo_repeat-cpu")


def compare(first: dict, second: dict) -> dict:
    """Which steps the two runs drew alike (equal completion hashes), and whether their held-out figures agree."""
    same = [a == b for a, b in zip(first["hashes"], second["hashes"], strict=True)]
    first_apart = same.index(False) + 1 if not all(same) else None
    return {"steps_alike": same, "all_alike": all(same), "first_apart": first_apart,
            "held_out_alike": (first["before"], first["after"]) == (second["before"], second["after"])}


def one_run(output_dir: str, steps: int, held_out_per_rung: int, server_args: list[str], bf16: bool | None) -> dict:
    from or1_trl.demos.real_model import run_real_demo

    overrides = {} if bf16 is None else {"bf16": bf16}
    began = time.monotonic()
    report = run_real_demo("smollm2", output_dir, max_steps=steps, generation="vllm",
                           held_out_per_rung=held_out_per_rung, server_args=server_args, **overrides)
    history = report["log_history"]
    return {"hashes": [log["rollout/completions_hash"] for log in history if "rollout/completions_hash" in log],
            "step_times": [log["step_time"] for log in history if "step_time" in log],
            "before": report["before"], "after": report["after"], "seconds": time.monotonic() - began}


def main(argv: list[str] | None = None) -> dict:
    from or1_trl.demos.real_model import BF16_SERVER_ARGS, SERVER_ARGS, bf16_is_fast

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--held-out-per-rung", type=int, default=8)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                        help="the trainer's autocast (auto: the demo's choice, `bf16_is_fast`)")
    parser.add_argument("--out", help=f"the result's path (default: {RESULTS}/<dtype>.json)")
    args = parser.parse_args(argv)
    bf16 = {"auto": None, "on": True, "off": False}[args.bf16]
    out = args.out or os.path.join(RESULTS, f"{args.dtype}.json")
    settings = {"steps": args.steps, "held_out_per_rung": args.held_out_per_rung, "dtype": args.dtype,
                "bf16": bf16_is_fast() if bf16 is None else bf16, "cpus": os.cpu_count()}
    result = {"settings": settings, "runs": {}}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
        if result["settings"] != settings:
            sys.exit(f"{out} holds runs with other settings ({result['settings']}): pass another --out")
    server_args = SERVER_ARGS if args.dtype == "float32" else BF16_SERVER_ARGS
    for name in ("a", "b"):
        if name in result["runs"]:
            continue
        result["runs"][name] = one_run(f"/tmp/or1-demo-repeat-{name}", args.steps, args.held_out_per_rung, server_args,
                                       bf16)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:  # each run as it ends
            json.dump(result, f, indent=1)
    result["comparison"] = compare(result["runs"]["a"], result["runs"]["b"])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["comparison"]))
    return result


if __name__ == "__main__":
    main()
