"""Long-context memory: the log-prob/entropy head (naive logits, TRL's fused head, Liger), then one OR1 training step.

    python benchmarks/memory.py [--max-gb 20] [--lengths 1024,4096,16384] [--wide-length 1024]
                                [--step-layers 2] [--parts head wide smollm2 step] [--quick] [--markdown FILE] [--json FILE]

Part 1, the head: one forward+backward of the per-token log-probs and entropies of N completion tokens through a
random LM head with Qwen2.5-0.5B's vocabulary (V = 151,936) and hidden size (896), N = 1K..16K; and with the 7B
model's hidden size (3,584) at one length (`--wide-length`). The loss takes gradient through both outputs (α > 0,
the entropy bonus on):

- naive: `[N, V]` logits = hidden · Wᵀ, log-softmax, the label's log-prob and the entropy (GRPO before fused heads);
- trl: TRL 1.16's fused-head kernel `ChunkedLogProbFunction` (off CUDA: its PyTorch fold in [4096, 32768] tiles);
- liger: `or1_trl.trainer.logprobs.LigerLogProbFunction`, Liger's kernel exactly as `logprob_backend="liger"` calls it here.

Part 1b (`smollm2`), the real model's head: the same at SmolLM2-135M-Instruct's vocabulary (49,152) and hidden size
(576), N = 1K, 2K, 4K (`or1-trl model smollm2`; the head's shape is all that matters here, so random weights).

Part 2, the step: one OR1 training step (`OR1Trainer.train()` for one step: reward, the MAGIC loss, backward, AdamW)
of a random model with Qwen2.5-0.5B's shapes (vocabulary 151,936, hidden 896, 14 heads / 2 KV heads, MLP 4,864, tied
head) but `--step-layers` of its 24 layers (24 do not fit the time budget on 2 cores), fp32, gradient checkpointing
on. The micro-batch is one group of 2 completions of N/2 random tokens each (a `rollout_func` stands in for
sampling: generating 16K tokens on a CPU takes hours). Each backend runs at the longest N of part 1 it fitted, and at
shorter ones while the step does not fit. naive here is the trainer taking log-probs from the model's `[B, T, V]`
logits.

Every measurement runs in a fresh process (forked from this one after the imports, before any tensor work): its peak
RSS above its RSS once the inputs (or the trainer) are built, and its wall time. A process whose RSS rises more than
`--max-gb` above that baseline is stopped ("> cap"). naive's `[N, V]` logits grow linearly with N, so a length whose
naive peak, extrapolated linearly from its two previous lengths, would exceed the cap is not run ("predicted"); trl
and liger work in tiles of bounded size, their peaks level off (a line through two short lengths overshoots), so they
are run and left to the cap. Prints Markdown tables of peaks and ratios to naive.
`--quick` runs tiny shapes in seconds (for testing this script: its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import trl.trainer.utils as trl_utils
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging
from trl import GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.trainer.logprobs import LigerLogProbFunction
from or1_trl.testing import CPU_RUN, tiny_tokenizer

BACKENDS = ("naive", "trl", "liger")
TEMPERATURE = 1.0


@dataclass(frozen=True)
class Shapes:
    vocab: int
    hidden: int
    wide_hidden: int  # the 7B head's hidden size, measured at one length
    lengths: tuple[int, ...]  # completion tokens N
    wide_length: int
    step_layers: int
    intermediate: int
    heads: int
    kv_heads: int
    max_gb: float
    timeout_s: float  # per measurement
    real_vocab: int  # part 1b: SmolLM2-135M-Instruct's head
    real_hidden: int
    real_lengths: tuple[int, ...]


FULL = Shapes(vocab=151_936, hidden=896, wide_hidden=3_584, lengths=(1024, 4096, 16384), wide_length=1024,
              step_layers=2, intermediate=4_864, heads=14, kv_heads=2, max_gb=20.0, timeout_s=1800.0,
              real_vocab=49_152, real_hidden=576, real_lengths=(1024, 2048, 4096))
QUICK = Shapes(vocab=8_192, hidden=64, wide_hidden=256, lengths=(256, 512, 1024, 2048), wide_length=256, step_layers=1,
               intermediate=128, heads=2, kv_heads=1, max_gb=0.2, timeout_s=300.0, real_vocab=4_096, real_hidden=32,
               real_lengths=(256, 512))
PARTS = ("head", "wide", "smollm2", "step")


# ---------------------------------------------------------------------------------------------------------------
# The three heads: (hidden [N, H], weight [V, H], labels [N], τ) -> (log-probs [N], entropies [N])
# ---------------------------------------------------------------------------------------------------------------
def naive_logps_and_entropy(logits, labels, temperature):
    """From materialised logits `[..., V]`: log-softmax, the label's log-prob and the entropy."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [..., V]
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


def naive_head(hidden, weight, labels, temperature):
    return naive_logps_and_entropy(hidden @ weight.T, labels, temperature)  # [N, V] logits


def trl_head(hidden, weight, labels, temperature):
    out = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, labels, temperature,
                                                  trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                                  ("log_probs", "entropy"))
    return out[0], out[1]


def liger_head(hidden, weight, labels, temperature):
    out = LigerLogProbFunction.apply(hidden, weight, None, labels, temperature, 0, None, 1.0, ("log_probs", "entropy"))
    return out[0], out[1]


HEADS = {"naive": naive_head, "trl": trl_head, "liger": liger_head}


def head_work(backend: str, tokens: int, hidden: int, vocab: int):
    """Build the inputs; return the measured work: one forward+backward of the head."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_()  # [V, H] the LM head
    states = torch.randn(tokens, hidden, generator=g).requires_grad_()  # [N, H] the backbone's last hidden states
    labels = torch.randint(0, vocab, (tokens,), generator=g)  # [N]

    def work():
        logps, entropies = HEADS[backend](states, weight, labels, TEMPERATURE)  # [N], [N]
        (logps.mean() + 0.01 * entropies.mean()).backward()

    return work


# ---------------------------------------------------------------------------------------------------------------
# One OR1 training step
# ---------------------------------------------------------------------------------------------------------------
def step_work(backend: str, tokens: int, shapes: Shapes, output_dir: str):
    """Build an OR1Trainer for one step on one group of 2 completions of tokens/2 random tokens; return `train`."""
    hf_logging.set_verbosity_error()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func
    tokenizer = tiny_tokenizer()
    completion_length = tokens // 2
    config = Qwen2Config(
        vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
        num_hidden_layers=shapes.step_layers, num_attention_heads=shapes.heads, num_key_value_heads=shapes.kv_heads,
        tie_word_embeddings=True, max_position_embeddings=completion_length + 64,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)

    def rollout(prompts, trainer):
        """Random completions of exactly `completion_length` tokens (no EOS) instead of sampling them."""
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(5, len(tokenizer), (len(prompts), completion_length), generator=g)
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": ids.tolist(),
                "logprobs": None}

    def one_right_one_wrong(completions, **kwargs):  # an informative group: rejection sampling keeps it
        return [float(i % 2 == 0) for i in range(len(completions))]

    args = OR1Config(**{
        **CPU_RUN, "output_dir": output_dir, "gradient_checkpointing": True, "per_device_train_batch_size": 2,
        "num_generations": 2, "max_completion_length": completion_length, "max_steps": 1, "learning_rate": 1e-6,
        "logprob_backend": "trl" if backend == "naive" else backend,
    })
    trainer_cls = NaiveLogitsOR1Trainer if backend == "naive" else OR1Trainer
    trainer = trainer_cls(model, one_right_one_wrong, args=args, processing_class=tokenizer, rollout_func=rollout,
                          train_dataset=Dataset.from_dict({"prompt": ["What is 1 + 1?"] * 4}))
    return trainer.train


class _NaiveLogitsHead(GRPOTrainer):
    """GRPOTrainer's log-prob pass taking log-probs and entropies from the model's `[B, T, V]` logits."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **_):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       logits_to_keep=logits_to_keep + 1).logits[:, :-1]  # [B, T, V]
        logps, entropies = naive_logps_and_entropy(logits, input_ids[:, -logits_to_keep:], self.temperature)
        return logps, (entropies if compute_entropy else None), None


class NaiveLogitsOR1Trainer(OR1Trainer, _NaiveLogitsHead):
    """OR1Trainer taking log-probs and entropies from the model's `[B, T, V]` logits (GRPO before fused heads). The
    naive head sits below OR1Trainer in the method order, so OR1's own `_get_per_token_logps_and_entropies` (which
    keeps the policy pass for the entropy term) still wraps it."""


# ---------------------------------------------------------------------------------------------------------------
# Measuring in a fresh process
# ---------------------------------------------------------------------------------------------------------------
def _status_gb(field: str) -> float:
    """`VmRSS` (resident now) or `VmHWM` (peak resident) of this process, in GB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(work, max_gb: float, conn) -> dict:
    """Run `work()`; peak RSS above the RSS before it (the kernel's peak counter, reset first) and wall time. A
    watchdog thread ends the process as soon as RSS rises more than `max_gb` above the baseline."""
    gc.collect()
    baseline = _status_gb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM, the peak RSS, to the current RSS
    done, sent = threading.Event(), threading.Lock()

    def watchdog():
        while not done.wait(0.01):
            if _status_gb("VmRSS") - baseline > max_gb and sent.acquire(blocking=False):
                conn.send({"status": "over_cap", "peak_gb": _status_gb("VmHWM") - baseline, "baseline_gb": baseline})
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    done.set()
    sent.acquire()
    return {"status": "ok", "peak_gb": _status_gb("VmHWM") - baseline, "seconds": seconds, "baseline_gb": baseline}


def _child(make_work, max_gb: float, verbose: bool, conn) -> None:
    if not verbose:  # the trainer's logs and warnings would interleave with the progress bar
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        warnings.simplefilter("ignore")
    try:
        with tempfile.TemporaryDirectory(prefix="or1-memory-") as tmp:
            result = _measure(make_work(tmp), max_gb, conn)
    except Exception as e:  # reported in the table, not raised: the other measurements go on
        result = {"status": "error", "detail": f"{type(e).__name__}: {e}"[:300]}
    conn.send(result)
    conn.close()


def in_fresh_process(kind: str, spec: dict, max_gb: float, timeout_s: float, verbose: bool) -> dict:
    """Measure in a process forked from this one (its own memory; the imports shared, already done)."""
    return peak_in_fresh_process(
        lambda tmp: head_work(**spec) if kind == "head" else step_work(**spec, output_dir=tmp), max_gb, timeout_s, verbose)


def peak_in_fresh_process(make_work, max_gb: float, timeout_s: float, verbose: bool = False) -> dict:
    """Peak RSS and seconds of `make_work(tmp_dir)()` in a process forked from this one (the setup `make_work` does
    is not counted; other benchmarks use it too)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(make_work, max_gb, verbose, send))
    proc.start()
    send.close()
    answered = recv.poll(timeout_s)
    result = recv.recv() if answered else None
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        reason = f"exit code {proc.exitcode}" if answered else f"no result within {timeout_s:.0f} s"
        return {"status": "error", "detail": reason}
    return result


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------
def _predicted(points: list[tuple[int, float]], tokens: int) -> float | None:
    """Peak at `tokens`, extrapolated linearly from the last two (tokens, peak) points."""
    if len(points) < 2:
        return None
    (n0, p0), (n1, p1) = points[-2:]
    return p1 + (p1 - p0) * (tokens - n1) / (n1 - n0)


def sweep(backend: str, lengths, hidden: int, shapes: Shapes, run, bar) -> dict[int, dict]:
    """Part 1 for one backend and hidden size: lengths in increasing order until one does not fit (for naive: until
    one is predicted not to)."""
    results, points, stopped = {}, [], None
    for tokens in lengths:
        predicted = _predicted(points, tokens) if backend == "naive" else None
        if stopped == "predicted" or (stopped is None and predicted is not None and predicted > shapes.max_gb):
            results[tokens] = {"status": "predicted", "peak_gb": predicted}
            stopped = "predicted"
        elif stopped is not None:
            results[tokens] = {"status": stopped}
        else:
            bar.set_description(f"head {backend} N={tokens} H={hidden}")
            results[tokens] = run("head", {"backend": backend, "tokens": tokens, "hidden": hidden,
                                           "vocab": shapes.vocab})
            bar.write(f"head {backend:5s} N={tokens:6d} H={hidden}: {_describe(results[tokens])}", file=sys.stderr)
            if results[tokens]["status"] == "ok":
                points.append((tokens, results[tokens]["peak_gb"]))
            else:
                stopped = "after_cap" if results[tokens]["status"] == "over_cap" else "after_error"
        bar.update()
    return results


def step_at_longest(backend: str, head: dict[int, dict], shapes: Shapes, run, bar) -> dict:
    """Part 2 for one backend: the longest length whose head fitted, then shorter ones until the step fits."""
    tried = {}
    for tokens in sorted((n for n, r in head.items() if r["status"] == "ok"), reverse=True):
        bar.set_description(f"step {backend} N={tokens}")
        result = run("step", {"backend": backend, "tokens": tokens, "shapes": shapes})
        bar.write(f"step {backend:5s} N={tokens:6d}: {_describe(result)}", file=sys.stderr)
        tried[tokens] = result
        if result["status"] == "ok":
            return {"tokens": tokens, **result, "tried": tried}
    return {"tokens": None, "status": "none", "tried": tried}


def _describe(r: dict) -> str:
    if r["status"] == "ok":
        return f"+{r['peak_gb']:.2f} GB, {r['seconds']:.1f} s"
    return f"{r['status']} {r.get('detail', '')}".strip()


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------
def _cell(r: dict | None, max_gb: float) -> tuple[str, str]:
    """(peak GB, seconds) cells of one measurement."""
    if r is None:
        return "—", "—"
    if r["status"] == "ok":
        return f"{r['peak_gb']:.2f}", f"{r['seconds']:.1f}"
    if r["status"] == "over_cap":
        return f"> {max_gb:g} (stopped)", "—"
    if r["status"] == "predicted":
        return f"> {max_gb:g} (≈ {r['peak_gb']:.3g} predicted)", "—"
    if r["status"] == "after_cap":
        return f"> {max_gb:g} (not run)", "—"
    if r["status"] == "after_error":
        return "not run (error before)", "—"
    return f"error: {r.get('detail', '?')}", "—"


def _ratio(r: dict, base: dict) -> str:
    ok = r and base and r["status"] == base["status"] == "ok"
    return f"{r['peak_gb'] / base['peak_gb']:.2f}×" if ok else "—"


def head_table(head: dict, lengths, cap: float) -> list[str]:
    """Part 1's table: peak GB and seconds of each backend at each N, and the ratios to naive."""
    lines = ["| completion tokens N | naive GB | naive s | trl GB | trl s | liger GB | liger s | trl ÷ naive | liger ÷ naive |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tokens in lengths:
        cells = [c for backend in BACKENDS for c in _cell(head[backend].get(tokens), cap)]
        base = head["naive"][tokens]
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + f" | {_ratio(head['trl'][tokens], base)} | "
                     f"{_ratio(head['liger'][tokens], base)} |")
    return lines


def markdown(results: dict, shapes: Shapes, flags: str, quick: bool, wall_s: float) -> str:
    head, wide, steps, real = (results.get(part) for part in ("head", "wide", "step", "smollm2"))
    cap = shapes.max_gb
    what = "tiny shapes, `--quick`: the numbers mean nothing" if quick else ", ".join(
        name for part, name in (("head", "Qwen2.5-0.5B's head"), ("wide", "the 7B's"), ("smollm2", "SmolLM2-135M's"),
                                ("step", "a step")) if part in results)
    lines = [
        f"Long-context memory, `python benchmarks/memory.py{flags}` ({what}; fp32 on "
        f"CPU; every measurement in a fresh process, its peak RSS above its RSS before the measured work; cap "
        f"{cap:g} GB above that; {wall_s / 60:.1f} min in all).",
    ]
    if head:
        lines += ["", f"One forward+backward of the log-prob and entropy head, vocabulary {shapes.vocab:,}, hidden "
                  f"{shapes.hidden:,}:", "", *head_table(head, shapes.lengths, cap)]
    if wide:
        lines += [
            "",
            f"Hidden {shapes.wide_hidden:,} (the 7B head), N = {shapes.wide_length:,}:",
            "",
            "| backend | peak GB | s | ÷ naive |",
            "|---|---:|---:|---:|",
        ]
        for backend in BACKENDS:
            peak, seconds = _cell(wide[backend].get(shapes.wide_length), cap)
            lines.append(f"| {backend} | {peak} | {seconds} | "
                         f"{_ratio(wide[backend][shapes.wide_length], wide['naive'][shapes.wide_length])} |")
    if real:
        versus = ", ".join(f"{n:,}: {_ratio(real['liger'][n], real['trl'][n])}" for n in shapes.real_lengths)
        whose = "The real model's head, tiny in `--quick`" if quick else "SmolLM2-135M-Instruct's head"
        lines += ["", f"{whose} (vocabulary {shapes.real_vocab:,}, hidden {shapes.real_hidden:,}), the same "
                  "forward+backward:", "", *head_table(real, shapes.real_lengths, cap), "",
                  f"Liger's peak ÷ TRL's head's, by N: {versus}."]
    if steps:
        lines += [
            "",
            f"One OR1 training step (a random model with Qwen2.5-0.5B's shapes and {shapes.step_layers} of its 24 layers; "
            "one group of 2 completions of N/2 tokens; gradient checkpointing; AdamW), at the longest N each backend fits:",
            "",
            "| backend | longest N that fits | peak GB above the built trainer | process peak GB | step s | "
            "tried and not fitting |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for backend in BACKENDS:
            s = steps[backend]
            failed = ", ".join(f"{n:,} ({r['status']})" for n, r in s["tried"].items() if r["status"] != "ok") or "—"
            if s["status"] == "ok":
                lines.append(f"| {backend} | {s['tokens']:,} | {s['peak_gb']:.2f} | {s['peak_gb'] + s['baseline_gb']:.2f} | "
                             f"{s['seconds']:.1f} | {failed} |")
            else:
                lines.append(f"| {backend} | none | — | — | — | {failed} |")
        lines += ["", *summary(head, steps, shapes)]
    return "\n".join(lines) + "\n"


def summary(head: dict, steps: dict, shapes: Shapes) -> list[str]:
    """The two figures the issue sets goals for."""
    out = []
    fits = [n for n in shapes.lengths if head["naive"][n]["status"] == "ok"]
    if fits and head["liger"][fits[-1]]["status"] == "ok":
        n = fits[-1]
        trl = head["trl"][n]
        out.append(f"At the largest N where naive fits ({n:,}), liger peaks at "
                   f"{head['liger'][n]['peak_gb'] / head['naive'][n]['peak_gb']:.2f}× naive's (goal ≤ 0.15×)"
                   + (f", trl at {trl['peak_gb'] / head['naive'][n]['peak_gb']:.2f}×." if trl["status"] == "ok" else "."))
    longest = {b: steps[b]["tokens"] for b in BACKENDS}
    if longest["naive"] and longest["liger"]:
        named = ", ".join(f"{b} {f'{n:,}' if n else 'none'}" for b, n in longest.items())
        top = longest["liger"] == shapes.lengths[-1]
        out.append(f"Longest trainable N: {named}{' (the largest N tried)' if top else ''}: liger "
                   f"{'≥ ' if top else ''}{longest['liger'] / longest['naive']:g}× naive's (goal ≥ 4×).")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-gb", type=float, help="cap on a measurement's RSS above its baseline (default 20)")
    parser.add_argument("--lengths", help="completion tokens N, comma-separated (default 1024,4096,16384)")
    parser.add_argument("--wide-length", type=int, help="N for the 7B head's hidden size (default 1024)")
    parser.add_argument("--step-layers", type=int, help="layers of the 0.5B-shaped model in the step (default 2)")
    parser.add_argument("--timeout", type=float, help="seconds per measurement before it counts as an error")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which parts to run (default all; step needs head)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, seconds: tests this script")
    parser.add_argument("--verbose", action="store_true", help="show the measured processes' output")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the measurements, unrounded, to FILE")
    args = parser.parse_args(argv)
    if "step" in args.parts and "head" not in args.parts:
        parser.error("--parts step needs head (the step runs at the longest N whose head fitted)")
    shapes = QUICK if args.quick else FULL
    overrides = {"max_gb": args.max_gb, "wide_length": args.wide_length, "step_layers": args.step_layers,
                 "timeout_s": args.timeout,
                 "lengths": tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None}
    shapes = replace(shapes, **{k: v for k, v in overrides.items() if v is not None})
    if sorted(set(shapes.lengths)) != list(shapes.lengths) or min(shapes.lengths) < 2:
        parser.error(f"--lengths must increase and be >= 2, got {shapes.lengths}")
    if not os.path.exists("/proc/self/clear_refs"):
        parser.error("this benchmark reads and resets the peak RSS through /proc (Linux only)")
    flags = "".join(f" --{name.replace('_', '-')} {getattr(args, name)}" for name in
                    ("max_gb", "lengths", "wide_length", "step_layers") if getattr(args, name) is not None)
    if args.parts != list(PARTS):
        flags += " --parts " + " ".join(args.parts)
    flags += " --quick" if args.quick else ""

    import liger_kernel.ops  # noqa: F401 - imported once here, before the measured processes fork (Triton: seconds)

    def run(kind, spec):
        return in_fresh_process(kind, spec, shapes.max_gb, shapes.timeout_s, args.verbose)

    start = time.perf_counter()
    counts = {"head": len(shapes.lengths), "wide": 1, "smollm2": len(shapes.real_lengths), "step": 1}
    results = {part: {} for part in PARTS if part in args.parts}
    real_shapes = replace(shapes, vocab=shapes.real_vocab)
    with tqdm(total=len(BACKENDS) * sum(counts[p] for p in results), file=sys.stderr, dynamic_ncols=True) as bar:
        for backend in BACKENDS if "head" in results else ():
            results["head"][backend] = sweep(backend, shapes.lengths, shapes.hidden, shapes, run, bar)
        for backend in BACKENDS if "wide" in results else ():
            results["wide"][backend] = sweep(backend, (shapes.wide_length,), shapes.wide_hidden, shapes, run, bar)
        for backend in BACKENDS if "smollm2" in results else ():
            results["smollm2"][backend] = sweep(backend, shapes.real_lengths, shapes.real_hidden, real_shapes, run, bar)
        for backend in BACKENDS if "step" in results else ():
            results["step"][backend] = step_at_longest(backend, results["head"][backend], shapes, run, bar)
            bar.update()
    block = markdown(results, shapes, flags, args.quick, time.perf_counter() - start)
    if args.markdown:
        Path(args.markdown).write_text(block)
    if args.json:  # every measurement, unrounded (the tests read these)
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n" + block, end="")
    return results


if __name__ == "__main__":
    main()
