"""The regime probe of issue 50: does SmolLM2-135M-Instruct, on the word problems (`or1_trl.data.word_problems`),
sit where the recipe's claims can engage? Recorded and committed before any arm runs.

    python benchmarks/regime_probe.py [--prompts 8] [--samples 8] [--max-new-tokens 128] [--rungs buy bags_eat ...]
    python benchmarks/regime_probe.py --quick      # the tiny model, 2 prompts a rung, 8 tokens: tests this script

For `--prompts` held-out problems of each rung it samples `--samples` completions (HF `generate` on the CPU, fp32,
temperature 1, no top-k/top-p: the distribution the policy gradient sees), scores them with the family's judges, and
takes each sampled token's entropy from the same logits. What it reports, per rung and over all rungs, against the
issue's regime:

| figure | what it is | the issue's regime |
|---|---|---|
| informative groups | groups whose samples neither all score 1 nor all 0 | 30-60% |
| reasoning | completions with a worked step before the tagged answer (`reasons_before_answer`) | >= 50% |
| selected tokens before the answer (in those that stop at it) | of the top-20% entropy tokens of the tagged completions (one quantile over the probe's tokens, as TRL's `get_high_entropy_mask` takes it over a batch), the share before the "Answer:" tag | mostly (> 50%) |
| accuracy | tagged answer = gold (`tagged_answer_reward`) | low enough to leave room |
| continues after the answer | of the tagged completions, those that write on after their first tagged number | — |
| truncated | completions that reached `--max-new-tokens` without an end-of-sequence token | — |

The result goes to `benchmarks/results/regime_probe/<settings>.json` (every completion's text, reward, length,
answer position and its tokens' entropies stay in the JSON, so any other cut can be computed from it later).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from functools import partial

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from or1_trl.data.word_problems import (ANSWER_LINE, ANSWER_TAG, TEMPLATES, answer_offset, reasons_before_answer,
                                        tagged_answer, tagged_answer_reward, word_problem_split)
from or1_trl.generation.stop import StopAt

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "regime_probe")
TOP_QUANTILE = 0.2  # the 80/20 rule's share of tokens


def text_ends(tokenizer, ids: list[int]) -> list[int]:
    """Per token of `ids`, the length of the text decoded up to and including it (special tokens skipped)."""
    return [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]


def token_at(ends: list[int], offset: int) -> int:
    """The index of the token in which the character at `offset` lies (`len(ends)` past the text), from `text_ends`."""
    return next((k for k, end in enumerate(ends) if end > offset), len(ends))


def answer_token(tokenizer, ids: list[int], offset: int | None) -> int:
    """The index of the completion token in which the answer tag starts (`len(ids)` without a tag): the tokens
    before it are the reasoning."""
    return len(ids) if offset is None else token_at(text_ends(tokenizer, ids), offset)


def text_after_answer(text: str) -> str:
    """What the completion writes after the number of its first "Answer:" tag ("" when it stops there, or has no
    tag): a model that goes on past its answer spends tokens (and the 80/20 rule's selection) after it."""
    match = re.search(rf"{re.escape(ANSWER_TAG)}\s*-?\d+(?:\.\d+)?", text)
    return text[match.end():].strip() if match else ""


def sample_rung(model, tokenizer, rows: list[dict], samples: int, max_new_tokens: int, seed: int,
                stop: StopAt | None = None) -> list[dict]:
    """Every row's `samples` completions with their tokens' entropies, one `generate` call for the rung; with `stop`
    (`--stop-at-answer-line`), each cut as the trainer cuts it with `stop_pattern` (`StopAt.cut`)."""
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             num_return_sequences=samples, max_new_tokens=max_new_tokens, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    # The logits each token was sampled from, one position at a time ([R*G, V] each): the entropy of each.
    entropies = torch.stack([-(step.float().softmax(-1) * step.float().log_softmax(-1)).nan_to_num().sum(-1)
                             for step in out.scores], dim=1)  # [R*G, L]
    completions = out.sequences[:, batch["input_ids"].shape[1]:]  # [R*G, L]
    records = []
    for i, ids in enumerate(completions.tolist()):
        row = rows[i // samples]
        ended = tokenizer.eos_token_id in ids
        length = ids.index(tokenizer.eos_token_id) + 1 if ended else len(ids)
        ids = ids[:length]
        keep = stop.end(ids) if stop is not None else None
        if keep is not None:  # stopped at the pattern: the tokens after it leave the rollout
            ids, length = ids[:keep], keep
        text = tokenizer.decode(ids, skip_special_tokens=True)
        offset = answer_offset(text)
        records.append({
            "prompt_id": row["prompt_id"], "rung": row["rung"], "text": text, "length": length,
            "truncated": not ended and keep is None, "stopped": keep is not None,
            "reward": tagged_answer_reward([text], [row["answer"]])[0],
            "tagged": tagged_answer(text) is not None, "reasons": reasons_before_answer(text),
            "answer_token": answer_token(tokenizer, ids, offset), "entropies": entropies[i, :length].tolist(),
            "after_answer": text_after_answer(text),
        })
    return records


def summarise(records: list[dict], samples: int) -> dict:
    """The regime's figures over `records` (one rung's, or all)."""
    groups: dict[str, list[float]] = {}
    for r in records:
        groups.setdefault(r["prompt_id"], []).append(r["reward"])
    informative = [len(set(g)) > 1 for g in groups.values()]
    tagged = [r for r in records if r["tagged"]]
    all_entropies = [e for r in records for e in r["entropies"]]
    threshold = torch.tensor(all_entropies).quantile(1 - TOP_QUANTILE).item() if all_entropies else float("nan")
    selected = [(k < r["answer_token"]) for r in tagged for k, e in enumerate(r["entropies"]) if e >= threshold]
    # the same, over the tagged completions that stop at their answer: where the selection falls without the tails
    selected_stopped = [(k < r["answer_token"]) for r in tagged if not r.get("after_answer")
                        for k, e in enumerate(r["entropies"]) if e >= threshold]
    answer_selected = [r["entropies"][r["answer_token"]] >= threshold for r in tagged
                       if r["answer_token"] < len(r["entropies"])]
    mean = lambda values: statistics.mean(values) if values else float("nan")  # noqa: E731
    return {"completions": len(records), "groups": len(groups), "accuracy": mean([r["reward"] for r in records]),
            "informative_groups": mean(informative), "reasoning": mean([r["reasons"] for r in records]),
            "tagged": mean([r["tagged"] for r in records]),
            "continues_after_answer": mean([bool(r.get("after_answer")) for r in tagged]),
            "truncated": mean([r["truncated"] for r in records]),
            "stopped": mean([r.get("stopped", False) for r in records]),
            "mean_length": mean([r["length"] for r in records]), "entropy_threshold": threshold,
            "selected_before_answer": mean(selected), "selected_tokens": len(selected),
            "selected_before_answer_when_stopped": mean(selected_stopped),
            "answer_token_selected": mean(answer_selected)}


def markdown(result: dict) -> str:
    s = result["settings"]
    flag = " --stop-at-answer-line" if s.get("stop_pattern") else ""
    lines = [f"Regime probe, `python benchmarks/regime_probe.py{flag}` ({s['model']}; {s['prompts']} held-out "
             f"problems a rung × {s['samples']} samples, ≤ {s['max_new_tokens']} new tokens, temperature 1, HF "
             f"`generate` fp32 on CPU, seed {s['seed']}"
             + ("; each completion cut after its answer line, as `stop_pattern=ANSWER_LINE` cuts it"
                if s.get("stop_pattern") else "") + f"; {result['seconds']:.0f} s"
             + (f"; finished {result['finished']} on {result['device']}" if "finished" in result else "")
             + (f", 1-min load {result['load']:.1f} at the end" if "load" in result else "") + "):", "",
             "| rung | accuracy | informative groups | reasoning | tagged | goes on after the answer | truncated | "
             "mean length | top-20% tokens before the answer (in those that stop at it) | answer token selected |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, f in [*result["rungs"].items(), ("**all**", result["all"])]:
        lines.append(f"| {name} | {f['accuracy']:.2f} | {f['informative_groups']:.2f} | {f['reasoning']:.2f} | "
                     f"{f['tagged']:.2f} | {f['continues_after_answer']:.2f} | {f['truncated']:.2f} | "
                     f"{f['mean_length']:.0f} | "
                     f"{f['selected_before_answer']:.2f} ({f['selected_before_answer_when_stopped']:.2f}) | "
                     f"{f['answer_token_selected']:.2f} |")
    return "\n".join(lines) + "\n"


def finished_rungs(path: str, settings: dict) -> dict[str, dict]:
    """The rungs a stopped probe with the same `settings` finished (`{rung: entry}`, from its partial file)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return {entry["rung"]: entry for entry in entries if entry["settings"] == settings}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="held-out problems a rung (default 8)")
    parser.add_argument("--samples", type=int, default=8, help="completions a problem (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rungs", nargs="+", default=list(TEMPLATES), choices=list(TEMPLATES))
    parser.add_argument("--no-worked-example", action="store_true", help="the question alone, no solved example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-answer-line", action="store_true",
                        help="cut each completion after its answer line, as the trainer does with "
                             "`stop_pattern=word_problems.ANSWER_LINE` (the same draws, cut)")
    parser.add_argument("--model-dir", help="default: `or1-trl model smollm2`'s folder")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 problems, 2 samples, 8 tokens")
    parser.add_argument("--out", help="the JSON's path (default: under benchmarks/results/regime_probe/)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table to FILE (`update_readme.py`)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens, name = 2, 2, 8, "tiny"
    else:
        name = "SmolLM2-135M-Instruct"
    settings = {"model": name, "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                "rungs": args.rungs, "seed": args.seed, "worked_example": not args.no_worked_example,
                **({"stop_pattern": ANSWER_LINE} if args.stop_at_answer_line else {})}
    out = args.out or os.path.join(RESULTS, f"{name}-p{args.prompts}-g{args.samples}-t{args.max_new_tokens}"
                                   f"{'-bare' if args.no_worked_example else ''}"
                                   f"{'-stop' if args.stop_at_answer_line else ''}-seed{args.seed}.json")
    keep = not args.quick or args.out
    if keep and os.path.exists(out):  # a finished probe with these settings is reported, not sampled again
        with open(out) as f:
            result = json.load(f)
        if result["settings"] != settings:
            sys.exit(f"{out} holds a probe with other settings: pass another --out")
        records = result["records"]  # the figures again from the records: what `summarise` computes now
        result["rungs"] = {rung: summarise([r for r in records if r["rung"] == rung], args.samples)
                           for rung in args.rungs}
        result["all"] = summarise(records, args.samples)
        return report(result, args.markdown)
    if args.quick:
        from or1_trl.testing import tiny_model_and_tokenizer

        model, tokenizer = tiny_model_and_tokenizer(seed=0)
    else:
        from or1_trl.models import model_folder

        folder = args.model_dir or model_folder("smollm2")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    stop = (StopAt(ANSWER_LINE, decode=partial(tokenizer.decode, skip_special_tokens=True))
            if args.stop_at_answer_line else None)
    _, problems = word_problem_split(train=0, held_out=args.prompts, rungs=args.rungs, seed=args.seed,
                                     worked_example=not args.no_worked_example)
    done = finished_rungs(out + ".partial.jsonl", settings) if keep else {}
    seconds = sum(entry["seconds"] for entry in done.values())
    for index, rung in enumerate(args.rungs):
        if rung in done:
            print(f"{rung}: from {out}.partial.jsonl", flush=True)
            continue
        began = time.perf_counter()
        rows = [row for row in problems if row["rung"] == rung]
        records = sample_rung(model, tokenizer, rows, args.samples, args.max_new_tokens, seed=args.seed + index,
                              stop=stop)
        done[rung] = {"rung": rung, "settings": settings, "seconds": time.perf_counter() - began, "records": records}
        seconds += done[rung]["seconds"]
        if keep:  # each rung as it ends: a stopped probe resumes with the next rung
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out + ".partial.jsonl", "a") as f:
                f.write(json.dumps(done[rung]) + "\n")
        print(f"{rung}: {summarise(records, args.samples)}", flush=True)
    records = [record for rung in args.rungs for record in done[rung]["records"]]
    result = {"settings": settings,
              "rungs": {rung: summarise(done[rung]["records"], args.samples) for rung in args.rungs},
              "all": summarise(records, args.samples), "seconds": seconds,
              "finished": time.strftime("%Y-%m-%d %H:%M"),
              "device": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
              "load": os.getloadavg()[0], "records": records}
    if keep:
        with open(out, "w") as f:
            json.dump(result, f)
        os.remove(out + ".partial.jsonl")
    return report(result, args.markdown)


def report(result: dict, path: str | None) -> dict:
    """Print the probe's table (and write it to `path`); returns the result."""
    text = markdown(result)
    print(text, end="")
    if path:
        with open(path, "w") as f:
            f.write(text)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
