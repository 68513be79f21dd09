"""1-shot RLVR (Wang et al., "Reinforcement Learning for Reasoning in Large Language Models with One Training
Example", arXiv 2504.20571): choose the training example by its historical variance score, replicate it to fill a
batch, and train on it for many steps.

The historical variance score of a prompt is the standard deviation of its per-epoch training accuracy over a normal
run on the whole pool (the released `data/data_selection.py`: `np.std` of each example's accuracy list, population
standard deviation; the highest score is π₁):

    acc_e(x) = correct samples of x in epoch e / samples of x in epoch e
    score(x) = sqrt( mean_e (acc_e(x) - mean_e acc_e(x))² )        over the epochs e in which x was sampled

The accuracies come from `<output_dir>/prompt_stats.jsonl`, which `OR1Trainer` writes during any run: one record per
prompt and rollout step with its `stage`, `epoch` (the pass over the pool), `samples` and `correct`. An epoch here is
a (stage, epoch) pair, in order. Records of logs written before epochs were recorded count one epoch per record.

    or1-trl select-examples --stats outputs/pool-run/prompt_stats.jsonl --dataset_name <pool> --top 1 \\
        --replicate 128 --output_dir data/pi1_r128
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass


@dataclass
class RankedPrompt:
    """A prompt's place in the ranking: its id, historical variance score and per-epoch accuracies."""

    prompt_id: str
    score: float
    accuracies: list[float]


#: The fields `epoch_accuracies` reads from each record (`prompts.StatsLog`), and their types; `epoch` is absent in
#: logs written before epochs were recorded (then `step` counts one epoch per record).
STATS_FIELDS = {"prompt_id": str, "stage": int, "step": int, "samples": int, "correct": int}


def record_problem(record) -> str | None:
    """What keeps `record` (one parsed line of `prompt_stats.jsonl`) from being ranked, or `None`."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not a record {{prompt_id, stage, epoch, step, samples, correct}}"
    missing = [name for name in STATS_FIELDS if name not in record]
    if missing:
        return f"has no {', '.join(missing)} (fields: {sorted(record)}): not a prompt_stats.jsonl record"
    for name, kind in [*STATS_FIELDS.items(), *([("epoch", int)] if "epoch" in record else [])]:
        value = record[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"has {name}={value!r}, not {'an integer' if kind is int else 'a string'}"
    if not 0 <= record["correct"] <= record["samples"]:
        return f"has correct={record['correct']} outside [0, samples={record['samples']}]"
    return None


def read_stats(path: str) -> list[dict]:
    """The records of a `prompt_stats.jsonl`. A `ValueError` (one line) names the first line that is not JSON, not
    a record (`record_problem`), or whose schema differs from the first record's (with and without `epoch`: two
    runs' logs in one file, whose epochs count differently)."""
    if not os.path.exists(path):
        raise ValueError(f"no statistics at {path!r}: a training run writes <output_dir>/prompt_stats.jsonl")
    records, first = [], None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number} is not a JSON record ({exc})") from None
            problem = record_problem(record)
            if problem:
                raise ValueError(f"{path}:{number} {problem}")
            first = first or (number, "epoch" in record)
            if ("epoch" in record) != first[1]:
                raise ValueError(f"{path}:{number} {'has an' if first[1] is False else 'has no'} 'epoch' field, line "
                                 f"{first[0]} {'has one' if first[1] else 'none'}: the file mixes two logs' schemas, "
                                 "whose epochs count differently; rank one run's log")
            records.append(record)
    if not records:
        raise ValueError(f"{path!r} holds no records: the run it comes from trained no step")
    return records


def epoch_accuracies(records: list[dict]) -> dict[str, list[float]]:
    """Per prompt (in order of first appearance), its accuracy in each epoch it was sampled, epochs in order."""
    totals: dict[str, dict[tuple, list[int]]] = {}
    for record in records:
        epoch = (record["stage"], record["epoch"]) if "epoch" in record else (record["stage"], -1, record["step"])
        counts = totals.setdefault(record["prompt_id"], {}).setdefault(epoch, [0, 0])
        counts[0] += record["correct"]
        counts[1] += record["samples"]
    return {pid: [correct / samples for correct, samples in (per_epoch[e] for e in sorted(per_epoch)) if samples]
            for pid, per_epoch in totals.items()}


def historical_variance(accuracies: list[float]) -> float:
    """Population standard deviation of a prompt's per-epoch accuracies (0 for fewer than two epochs)."""
    if not accuracies:
        return 0.0
    mean = sum(accuracies) / len(accuracies)
    return math.sqrt(sum((a - mean) ** 2 for a in accuracies) / len(accuracies))


def rank_prompts(records: list[dict]) -> list[RankedPrompt]:
    """Every prompt of the log, highest historical variance score first (ties: first sampled first)."""
    ranked = [RankedPrompt(pid, historical_variance(acc), acc) for pid, acc in epoch_accuracies(records).items()]
    return sorted(ranked, key=lambda r: -r.score)  # stable: ties keep the order of first appearance


def replicate(dataset, rows: list[int], size: int):
    """`size` rows cycling through `rows` (`rows[0], rows[1], …, rows[0], …`): the 1-shot (few-shot) training set.

    A `prompt_id_column` holding the source rows' ids would repeat them, which `OR1Trainer` refuses: the caller
    renames it (`select_examples`)."""
    if not rows or size < 1:
        raise ValueError(f"nothing to replicate: {len(rows)} rows to a size of {size}")
    return dataset.select([rows[i % len(rows)] for i in range(size)])


def select_examples(dataset, ranking: list[RankedPrompt], top: int, size: int, prompt_id_column: str = "id"):
    """The `top` best-ranked prompts of `dataset`, replicated to `size` rows; `(dataset, chosen ranking entries)`.

    Prompt ids are computed as the trainer computes them (`prompts.prompt_ids`: the `prompt_id_column`, else a hash of
    the prompt), so `dataset` must be the one the ranked run trained on (same prompts). An id column is kept as
    `source_<column>`: the replicas share one prompt id (the content hash) in the 1-shot run's statistics."""
    from ..recipe.prompts import prompt_ids

    if not 1 <= top <= len(ranking):
        raise ValueError(f"--top {top}: the statistics rank {len(ranking)} prompts")
    ids = prompt_ids(dataset, prompt_id_column)
    row_of: dict[str, int] = {}
    for row, pid in enumerate(ids):
        row_of.setdefault(pid, row)
    chosen = ranking[:top]
    missing = [r.prompt_id for r in chosen if r.prompt_id not in row_of]
    if missing:
        raise ValueError(f"prompt id(s) {missing} of the statistics are not in the dataset: pass the dataset the "
                         f"ranked run trained on (ids from its {prompt_id_column!r} column, else from the prompt's "
                         "content)")
    out = replicate(dataset, [row_of[r.prompt_id] for r in chosen], size)
    if prompt_id_column in out.column_names:
        out = out.rename_column(prompt_id_column, f"source_{prompt_id_column}")
    return out, chosen


def ranking_table(ranking: list[RankedPrompt], limit: int, texts: dict[str, str] | None = None) -> str:
    """Printed ranking: rank, score, prompt id, per-epoch accuracies (and the problem's first words)."""
    lines = [f"{'rank':>4}  {'score':>6}  {'prompt id':<18} per-epoch accuracy"]
    for rank, r in enumerate(ranking[:limit], 1):
        accuracies = " ".join(f"{a:.2f}" for a in r.accuracies)
        text = f"  | {texts[r.prompt_id][:60]!r}" if texts and r.prompt_id in texts else ""
        lines.append(f"{rank:>4}  {r.score:>6.4f}  {r.prompt_id:<18} {accuracies}{text}")
    if len(ranking) > limit:
        lines.append(f"… {len(ranking) - limit} more prompts")
    return "\n".join(lines)


def write_selection(selected, chosen: list[RankedPrompt], output_dir: str, source: dict) -> str:
    """Write the replicated prompts as `<output_dir>/data/train-00000-of-00001.parquet` (`or1-trl train
    --dataset_name OUTPUT_DIR` reads it) and `<output_dir>/selection.json`: `source` (where the ranking and the
    prompts came from) and the chosen prompts with their rank, score and accuracies. Returns the dataset's path."""
    from ..files import write_json_atomic
    from .loading import save_split

    path = save_split(selected, output_dir, "train")
    write_json_atomic(os.path.join(output_dir, "selection.json"), {
        **source, "chosen": [{"rank": i + 1, "prompt_id": r.prompt_id, "score": r.score, "accuracies": r.accuracies}
                             for i, r in enumerate(chosen)]})
    return path
