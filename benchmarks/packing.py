"""Padded vs packed log-prob passes: time of the old-policy pass and of the policy forward+backward, side by side,
and the policy pass's peak memory.

    python benchmarks/packing.py [--caps 256 1024 2048] [--rows 16] [--repeats 3] [--markdown FILE] [--json FILE]
    python benchmarks/packing.py --quick      # seconds-scale smoke run (the tests use it)

One micro-batch of `--rows` rows, prompts of 32 tokens, completions drawn long-tailed as a truncating stage produces
them: 70% short (a tenth of the cap), 30% at the cap (mean length ≈ 0.37× the cap); and the demo's shape (little
padding: completions of 80–100% of a 32-token cap). Two models: the tiny one (`or1_trl.testing`, 2 layers, hidden
64) and a deeper one (8 layers, hidden 256, same vocabulary). Each pass runs through TRL's fused LM head
(`add_fused_lm_head`) exactly as `GRPOTrainer` runs it: padded (`[B, P+C]` with the attention mask, TRL's path) or
packed (`or1_trl/trainer/packing.py`: the rows' real tokens end to end in packed rows at most the longest sequence wide,
`position_ids` restarting per sequence), in one forward (no budget) or under a token budget of twice the longest
sequence (several forwards, all but the last activation-checkpointed: one more forward of their tokens). Padded and
packed alternate within each repeat, after one warm-up of each; the median of `--repeats` is reported. **fill** = real tokens / token slots
computed (TRL's `update/token_fill`).

Peak memory: the policy forward+backward of the deeper model at the largest cap, each in a fresh process forked
before any timing (peak RSS above the RSS before the pass, `benchmarks/memory.py`'s measurement), at `--rows` and twice as many rows: padded and
packed grow with the rows, packed under a budget stays at the budget's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import nullcontext

import torch
from trl.trainer.utils import add_fused_lm_head

from memory import peak_in_fresh_process
from or1_trl.trainer.packing import fused_head_forward, packed_logps_and_entropies
from or1_trl.testing import tiny_model_and_tokenizer

PROMPT = 32


def lengths(shape: str, rows: int, cap: int, rng: random.Random) -> list[int]:
    if shape == "long-tailed":
        return [cap if rng.random() < 0.3 else max(1, cap // 10) for _ in range(rows)]
    return [rng.randint(int(0.8 * cap), cap) for _ in range(rows)]  # the demo's: little padding


def batch(completion_lengths: list[int], vocab: int, rng: random.Random):
    """TRL's layout: prompts left-padded (all PROMPT here), completions right-padded to the longest."""
    width = max(completion_lengths)
    ids = torch.zeros(len(completion_lengths), PROMPT + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(completion_lengths):
        ids[row, : PROMPT + length] = torch.tensor([rng.randrange(1, vocab) for _ in range(PROMPT + length)])
        mask[row, : PROMPT + length] = 1
    return ids, mask, width


def model_for(name: str, longest: int):
    overrides = {} if name == "tiny" else dict(num_hidden_layers=8, hidden_size=256, intermediate_size=512,
                                                num_attention_heads=8, num_key_value_heads=4)
    model, _ = tiny_model_and_tokenizer(seed=0, max_position_embeddings=max(512, PROMPT + longest), **overrides)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    return model


def run_pass(model, ids, mask, width, mode: str):
    """Log-probs and entropies `[B, C]`: "padded" (TRL's pass), "packed" (one forward) or "budget" (2× the longest)."""
    if mode == "padded":
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-width] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -width:], out.entropy[:, -width:]
    budget = 2 * int(mask.sum(dim=1).max()) if mode == "budget" else None
    logps, entropies, _ = packed_logps_and_entropies(fused_head_forward(model, nullcontext), ids, mask, width, budget,
                                                     compute_entropy=True)
    return logps, entropies


def policy_pass(model, ids, mask, width, mode: str) -> None:
    logps, entropies = run_pass(model, ids, mask, width, mode)
    (logps.sum() + entropies.sum()).backward()
    model.zero_grad(set_to_none=True)


def passes(model, ids, mask, width, mode: str) -> tuple[float, float]:
    """Seconds of the old-policy pass (no grad) and of the policy pass's forward+backward."""
    start = time.perf_counter()
    with torch.no_grad():
        run_pass(model, ids, mask, width, mode)
    old = time.perf_counter() - start
    start = time.perf_counter()
    policy_pass(model, ids, mask, width, mode)
    return old, time.perf_counter() - start


MODES = ("padded", "packed", "budget")


def measure(name: str, shape: str, cap: int, rows: int, repeats: int) -> dict:
    rng = random.Random(cap)
    completion_lengths = lengths(shape, rows, cap, rng)
    model = model_for(name, cap)
    ids, mask, width = batch(completion_lengths, model.config.vocab_size, rng)
    times = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up, not counted
        passes(model, ids, mask, width, mode)
    for _ in range(repeats):
        for mode in MODES:  # alternating: the same load for all
            times[mode].append(passes(model, ids, mask, width, mode))
    median = {mode: tuple(statistics.median(t[i] for t in runs) for i in range(2)) for mode, runs in times.items()}
    return {"model": name, "shape": shape, "cap": cap, "mean_frac": statistics.mean(completion_lengths) / cap,
            "fill": float(mask.sum()) / mask.numel(), **median}


def peak_memory(cap: int, rows: int, mode: str) -> float:
    """GB of peak RSS above the baseline of one policy forward+backward of the deeper model, in a fresh process."""
    def make_work(_tmp):
        rng = random.Random(cap)
        model = model_for("deeper", cap)
        ids, mask, width = batch(lengths("long-tailed", rows, cap, rng), model.config.vocab_size, rng)
        return lambda: policy_pass(model, ids, mask, width, mode)

    result = peak_in_fresh_process(make_work, max_gb=16, timeout_s=1800)
    if result["status"] != "ok":
        raise RuntimeError(f"peak memory of {mode} at {rows} rows: {result}")
    return result["peak_gb"]


def table(results: list[dict]) -> list[str]:
    lines = ["| model | completions | cap | mean length / cap | fill, padded | old-policy pass: padded → packed | "
             "policy fwd+bwd: padded → packed | policy fwd+bwd, packed under a budget of 2× the longest |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        (old_pad, pol_pad), (old_pack, pol_pack), (_, pol_budget) = r["padded"], r["packed"], r["budget"]
        lines.append(f"| {r['model']} | {r['shape']} | {r['cap']:,} | {r['mean_frac']:.2f} | {r['fill']:.0%} | "
                     f"{old_pad:.3f} s → {old_pack:.3f} s (**{old_pack / old_pad:.2f}×**) | "
                     f"{pol_pad:.3f} s → {pol_pack:.3f} s (**{pol_pack / pol_pad:.2f}×**) | "
                     f"{pol_budget:.3f} s (**{pol_budget / pol_pad:.2f}×**) |")
    return lines


def memory_lines(cap: int, rows: int) -> tuple[list[str], dict]:
    """The memory table and its goal line, and the figures behind them unrounded (`--json`)."""
    peaks = {(mode, n): peak_memory(cap, n, mode) for n in (rows, 2 * rows) for mode in MODES}
    lines = [f"Peak memory of the policy forward+backward (deeper model, long-tailed, cap {cap:,}; peak RSS above the "
             "baseline, a fresh process each):", "",
             f"| rows | padded | packed, one forward | packed, budget 2× the longest ({2 * (PROMPT + cap):,} tokens) |",
             "|---:|---:|---:|---:|"]
    for n in (rows, 2 * rows):
        lines.append(f"| {n} | " + " | ".join(f"{peaks[(mode, n)]:.2f} GB" for mode in MODES) + " |")
    growth = {mode: peaks[(mode, 2 * rows)] / peaks[(mode, rows)] for mode in MODES}
    met = round(growth["budget"], 2) <= 1.2  # as printed
    lines += ["", f"Twice the rows: padded {growth['padded']:.2f}×, packed {growth['packed']:.2f}×, packed under the "
              f"budget {growth['budget']:.2f}× the peak. Goal: the budget, not rows × cap, sets the peak (≤ 1.2× at twice "
              f"the rows) — {'met' if met else 'missed'}."]
    figures = {"rows": [rows, 2 * rows], "peak_gb": {mode: [peaks[(mode, n)] for n in (rows, 2 * rows)] for mode in MODES},
               "growth": growth, "goal_met": met}
    return lines, figures


def goal_lines(results: list[dict]) -> list[str]:
    tail = [r for r in results if r["shape"] == "long-tailed" and r["mean_frac"] <= 0.4]
    demo = [r for r in results if r["shape"] != "long-tailed"]
    worst_tail = max(r["packed"][1] / r["padded"][1] for r in tail)
    worst_demo = max(max(r["packed"][i] / r["padded"][i] for i in range(2)) for r in demo)
    return [f"Goal packed ≤ 0.5× padded (policy fwd+bwd) where the mean length ≤ 0.4× the cap: worst "
            f"{worst_tail:.2f}× — {'met' if worst_tail <= 0.5 else 'missed'}. Goal not slower than 1.02× at the "
            f"demo's shape: worst {worst_demo:.2f}× — {'met' if worst_demo <= 1.02 else 'missed'}."]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny settings (seconds; the numbers mean little)")
    parser.add_argument("--markdown", help="write the README block here")
    parser.add_argument("--json", metavar="FILE", help="also write the block's figures, unrounded, to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.caps, args.rows, args.repeats = [64], 8, 1
    torch.manual_seed(0)
    memory, memory_figures = memory_lines(max(args.caps), args.rows)  # first: forked processes, before this one runs tensor work
    results = []
    for name in ("tiny", "deeper"):
        results.append(measure(name, "demo", 32, args.rows, args.repeats))
        for cap in args.caps:
            results.append(measure(name, "long-tailed", cap, args.rows, args.repeats))
            print(f"{name} cap {cap}: {results[-1]}", file=sys.stderr, flush=True)
    lines = [f"Padded vs packed log-prob passes, `python benchmarks/packing.py{' --quick' if args.quick else ''}` "
             f"({args.rows} rows, prompts of {PROMPT} tokens; long-tailed: 70% of the completions a tenth of the cap, "
             "30% at it; demo: 80–100% of a 32-token cap; median of "
             f"{args.repeats}; fill = real tokens / slots of the padded pass):", "",
             *table(results), "", *goal_lines(results), "", *memory]
    block = "\n".join(lines)
    print(block)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(block + "\n")
    if args.json:  # what the block was computed from (the tests read these, not the rounded text)
        with open(args.json, "w") as f:
            json.dump({"results": results, "memory": memory_figures}, f, indent=1)


if __name__ == "__main__":
    main()
