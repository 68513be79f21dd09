"""Data preparation (paper §6.1): de-duplicate, drop problems with figures or URLs, decontaminate against the
evaluation sets, re-verify each math answer against a reference solution.

    or1-trl prepare --dataset_name my/math --split train --output_dir prepared --solution_column solution
    or1-trl train ... --dataset_name prepared --dataset_train_split train

Steps, in this order; each one sees only the rows the earlier ones kept, and the first reason removes a row:

1. `exact_duplicate` — the problem text equals an earlier row's (the first occurrence stays).
2. `normalized_duplicate` — equal after `normalize_problem`: Unicode NFKC, case-folded, LaTeX math delimiters
   (`$`, `\\(`, `\\)`, `\\[`, `\\]`), `\\left` / `\\right`, spacing commands (`\\,` `\\;` `\\!` `\\quad` `\\qquad`) and
   all whitespace removed, trailing full stops dropped. "What is $1+1$?" and "what is 1 + 1 ?" are duplicates; "1+1"
   and "1-1" are not.
3. `figure_or_url` — the problem points at something the model cannot see: a URL, an image (`\\includegraphics`,
   `<img`, Markdown `![`), Asymptote code (`[asy]`), or a figure / diagram named in the text ("the figure", "see
   diagram", "shown below", ...). `FIGURE_OR_URL` is the pattern.
4. `contamination` — the problem shares word n-grams (`n`, default 8; words are `\\w+` runs of the case-folded text)
   with an evaluation problem: removed when the shared n-grams are at least `threshold` (default 0.5) of the
   evaluation problem's n-grams (a problem shorter than `n` words is one n-gram). Every overlapping pair is reported
   with its fraction. Evaluation sets: AIME 2024, AIME 2025 and MATH-500 by default (`EVAL_SETS`, loaded from the
   Hub only when this step runs) or local files.
5. `answer_mismatch` — a math row with a reference solution whose final answer does not verify against the row's
   gold answer by the math reward's rule (Math-Verify, §7.1, in its worker processes). Rows without a reference
   solution, and solutions with no parsable answer, are kept and counted as not verifiable.

The per-row work (texts, hashes, figure search, n-gram overlaps) runs in `datasets.map` with `num_proc`
processes; verification runs in `MathReward`'s `num_proc` workers. The kept rows are written unchanged (same
columns, same layout — the released format stays the released format) to
`<output_dir>/data/<split>-00000-of-00001.parquet` (`datasets.load_dataset(output_dir, split=<split>)` reads it;
several splits can share one directory), the removed rows with their reason and detail to
`<output_dir>/removed-<split>.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

from .loading import save_split
from .released import InvalidRow, math_golds, prompt_text

#: `or1-trl prepare --eval_sets` names: (Hub id, split, problem column). Loaded only when decontamination runs.
EVAL_SETS = {
    "aime24": ("HuggingFaceH4/aime_2024", "train", "problem"),
    "aime25": ("yentinglin/aime_2025", "train", "problem"),
    "math500": ("HuggingFaceH4/MATH-500", "test", "problem"),
}
#: Columns tried, in order, for the problem text of an evaluation set that names none.
EVAL_PROBLEM_COLUMNS = ("problem", "question", "prompt", "Problem", "Question")
STEPS = ("exact_duplicate", "normalized_duplicate", "figure_or_url", "contamination", "answer_mismatch")
STEP_TITLES = {
    "exact_duplicate": "exact duplicates",
    "normalized_duplicate": "normalised duplicates",
    "figure_or_url": "figures or URLs",
    "contamination": "overlap with evaluation sets",
    "answer_mismatch": "answer disagrees with the solution",
}
#: Problems that refer to something outside their text (paper §6.1: figures and URLs).
FIGURE_OR_URL = re.compile(
    r"https?://|www\.\w|\\includegraphics|<img\b|!\[[^\]]*\]\(|\[asy\]"
    r"|\b(?:the|this|following|given|above|below|accompanying|adjacent)\s+(?:figure|diagram|picture|image|graph)s?\b"
    r"|\b(?:see|in)\s+(?:the\s+)?(?:figure|fig\.|diagram|picture|image)\b|\bshown\s+(?:below|above|in\s+the\s+figure)\b",
    re.IGNORECASE,
)
_LATEX_NOISE = re.compile(r"\\left\b|\\right\b|\\[,;!]|\\qquad\b|\\quad\b|\\[()\[\]]|\$")
_WORD = re.compile(r"\w+")


def normalize_problem(text: str) -> str:
    """The key of the normalised de-duplication (module docstring, step 2)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _LATEX_NOISE.sub("", text)
    return re.sub(r"\s+", "", text).rstrip(".")


def ngrams(text: str, n: int) -> set[str]:
    """Word n-grams of `text` (case-folded `\\w+` runs, joined by spaces); a text shorter than `n` words is one."""
    words = _WORD.findall(unicodedata.normalize("NFKC", text).casefold())
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Evaluation sets
# ---------------------------------------------------------------------------------------------------------------


def load_eval_sets(specs: list[str], column: str | None = None) -> dict[str, list[str]]:
    """`{name: problem texts}` for each spec: a name of `EVAL_SETS`, a local file or directory (`NAME=PATH` names it),
    or a Hub dataset id (its first split). The problem column is `column`, else the first of `EVAL_PROBLEM_COLUMNS`."""
    from .loading import load_data

    sets = {}
    for spec in specs:
        name, _, source = spec.partition("=") if "=" in spec else (spec, "", spec)
        split, col = None, column
        if source in EVAL_SETS:
            source, split, known = EVAL_SETS[source]
            col = col or known
        try:  # a local file or folder, or the Hub (offline and not cached: one line saying so)
            data = load_data(source, split=split)
        except ValueError as exc:
            raise ValueError(f"evaluation set {spec!r}: {exc}") from exc
        col = col or next((c for c in EVAL_PROBLEM_COLUMNS if c in data.column_names), None)
        if col is None or col not in data.column_names:
            raise ValueError(f"evaluation set {spec!r} has no problem column (columns: {data.column_names}); "
                             "name it with --eval_column")
        sets[name] = [prompt_text(p) for p in data[col]]
    return sets


class NgramIndex:
    """The n-grams of every evaluation problem, to find the training problems that overlap one."""

    def __init__(self, eval_sets: dict[str, list[str]], n: int):
        self.n = n
        self.problems = [(name, i) for name, texts in eval_sets.items() for i in range(len(texts))]
        self.sizes = []
        self.index: dict[str, list[int]] = {}
        for pid, (name, i) in enumerate(self.problems):
            grams = ngrams(eval_sets[name][i], n)
            self.sizes.append(len(grams))
            for gram in grams:
                self.index.setdefault(gram, []).append(pid)

    def overlaps(self, text: str, threshold: float) -> list[tuple[str, int, float]]:
        """`(eval set, eval row, fraction of that problem's n-grams in text)` for every evaluation problem at or
        above `threshold`, largest first."""
        hits = Counter(pid for gram in ngrams(text, self.n) for pid in self.index.get(gram, ()))
        found = [(*self.problems[pid], count / self.sizes[pid]) for pid, count in hits.items()
                 if count / self.sizes[pid] >= threshold]
        return sorted(found, key=lambda hit: -hit[2])


# ---------------------------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PrepareResult:
    """What `prepare_dataset` kept and removed. `removed`: `{row index: (step, detail)}`."""

    rows_in: int
    kept: list[int]
    removed: dict[int, tuple[str, object]] = field(default_factory=dict)
    not_verifiable: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # step -> why it did not run

    def counts(self) -> dict[str, int]:
        counts = Counter(step for step, _ in self.removed.values())
        return {step: counts[step] for step in STEPS}

    def table(self) -> str:
        """The printed summary: rows in, rows removed by each step, rows out."""
        lines = [f"{'step':<36}{'removed':>9}{'rows left':>11}", f"{'rows in':<36}{'':>9}{self.rows_in:>11}"]
        left = self.rows_in
        for step, count in self.counts().items():
            left -= count
            note = f"  (skipped: {self.skipped[step]})" if step in self.skipped else ""
            lines.append(f"{STEP_TITLES[step]:<36}{count:>9}{left:>11}{note}")
        lines.append(f"{'rows out':<36}{'':>9}{len(self.kept):>11}")
        if self.not_verifiable:
            rows = "row" if self.not_verifiable == 1 else "rows"
            lines.append(f"({self.not_verifiable} math {rows} kept without verification: no reference solution, or "
                         "no answer found in it)")
        return "\n".join(lines)


def _features(row, problem_column, index, threshold):
    text = prompt_text(row[problem_column])
    figure = FIGURE_OR_URL.search(text)
    hits = index.overlaps(text, threshold) if index is not None else []
    return {"or1_exact": _digest(text), "or1_normalized": _digest(normalize_problem(text)),
            "or1_figure": figure.group(0) if figure else None,
            "or1_overlaps": json.dumps([[name, i, round(fraction, 4)] for name, i, fraction in hits])}


def _golds(row, answer_column):
    """Gold answers of a math row (either layout), or `None` if it has none."""
    from ..rewards.math import normalize_golds

    if "reward_model" in row:
        try:
            return math_golds((row["reward_model"] or {}).get("ground_truth"))
        except InvalidRow:
            return None
    return list(normalize_golds(row.get(answer_column))) or None


def prepare_dataset(dataset, problem_column: str = "prompt", answer_column: str = "answer",
                    solution_column: str | None = "solution", eval_sets: dict[str, list[str]] | None = None,
                    ngram: int = 8, threshold: float = 0.5, skip: tuple[str, ...] = (), num_proc: int | None = None,
                    math_reward=None) -> PrepareResult:
    """Run the steps of the module docstring on `dataset`; nothing is written. `skip` names steps not to run
    (`"dedup"` skips both de-duplications, `"figures"`, `"decontaminate"`, `"verify"`)."""
    from tqdm.auto import tqdm

    if problem_column not in dataset.column_names:
        raise ValueError(f"the dataset has no column {problem_column!r} (columns: {dataset.column_names}); name the "
                         "problem's column with --problem_column")
    if ngram < 1 or not 0.0 < threshold <= 1.0:
        raise ValueError(f"--ngram must be >= 1 and --overlap_threshold in (0, 1], got {ngram} and {threshold}")
    result = PrepareResult(rows_in=len(dataset), kept=[])
    decontaminate = "decontaminate" not in skip and bool(eval_sets)
    index = NgramIndex(eval_sets, ngram) if decontaminate else None
    features = dataset.map(_features, fn_kwargs={"problem_column": problem_column, "index": index,
                                                 "threshold": threshold},
                           remove_columns=dataset.column_names, num_proc=num_proc, desc="Reading problems")

    seen_exact, seen_normalized = {}, {}
    survivors = []
    for i, (exact, normalized, figure, overlaps) in enumerate(zip(
            features["or1_exact"], features["or1_normalized"], features["or1_figure"], features["or1_overlaps"])):
        if "dedup" not in skip and exact in seen_exact:
            result.removed[i] = ("exact_duplicate", {"duplicate_of": seen_exact[exact]})
        elif "dedup" not in skip and normalized in seen_normalized:
            result.removed[i] = ("normalized_duplicate", {"duplicate_of": seen_normalized[normalized]})
        elif "figures" not in skip and figure is not None:
            result.removed[i] = ("figure_or_url", {"match": figure})
        elif decontaminate and json.loads(overlaps):
            result.removed[i] = ("contamination", {"overlaps": [
                {"eval_set": name, "eval_row": row, "overlap": fraction}
                for name, row, fraction in json.loads(overlaps)]})
        else:
            survivors.append(i)
        seen_exact.setdefault(exact, i)
        seen_normalized.setdefault(normalized, i)
    for step, reason in (("exact_duplicate", "dedup" in skip), ("normalized_duplicate", "dedup" in skip),
                         ("figure_or_url", "figures" in skip)):
        if reason:
            result.skipped[step] = "--skip"
    if not decontaminate:
        result.skipped["contamination"] = "--skip" if "decontaminate" in skip else "no evaluation sets"

    if "verify" in skip or not solution_column or solution_column not in dataset.column_names:
        result.skipped["answer_mismatch"] = "--skip" if "verify" in skip else f"no column {solution_column!r}"
        result.kept = survivors
        return result
    from ..rewards import MathReward

    columns = [c for c in (answer_column, solution_column, "ability", "reward_model") if c in dataset.column_names]
    tasks = []  # (row, solution, golds) of the surviving math rows that can be verified
    for i, row in zip(survivors, dataset.select_columns(columns).select(survivors)):
        if row.get("ability", "math") != "math":
            continue
        golds, solution = _golds(row, answer_column), row.get(solution_column)
        if golds and isinstance(solution, str) and solution.strip():
            tasks.append((i, solution, golds))
        else:
            result.not_verifiable += 1
    reward = math_reward or MathReward(num_workers=num_proc or 1, warmup=False)
    outcome = {}
    chunk = 1000
    with tqdm(total=len(tasks), desc="Verifying answers", disable=None if tasks else True) as bar:  # a terminal only
        for start in range(0, len(tasks), chunk):
            part = tasks[start : start + chunk]
            for (i, _, golds), (score, status) in zip(part, reward.score_with_status(
                    [solution for _, solution, _ in part], [golds for _, _, golds in part])):
                outcome[i] = (score, status, golds)
            bar.update(len(part))
    if math_reward is None:
        reward.close()
    for i in survivors:
        score, status, golds = outcome.get(i, (None, None, None))
        if status == "wrong":
            result.removed[i] = ("answer_mismatch", {"golds": golds})
        else:
            if status is not None and score < 1.0:
                result.not_verifiable += 1
            result.kept.append(i)
    return result


def write_prepared(dataset, result: PrepareResult, output_dir: str, split: str) -> tuple[str, str]:
    """Write the kept rows (unchanged) and the removed ones (with step and detail); returns both paths. Each file is
    written under a temporary name and renamed, so an interrupted run leaves no half-written file."""
    data_path = save_split(dataset.select(result.kept), output_dir, split)
    removed_path = os.path.join(output_dir, f"removed-{split}.jsonl")
    tmp = f"{removed_path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for i in sorted(result.removed):
            step, detail = result.removed[i]
            f.write(json.dumps({"index": i, "reason": step, "detail": detail, "row": dataset[i]}, default=str) + "\n")
    os.replace(tmp, removed_path)
    return data_path, removed_path


def overlap_report(result: PrepareResult, limit: int = 20) -> str:
    """The overlapping (training row, evaluation problem) pairs, largest overlap first."""
    pairs = [(hit["overlap"], i, hit["eval_set"], hit["eval_row"]) for i, (step, detail) in result.removed.items()
             if step == "contamination" for hit in detail["overlaps"]]
    pairs.sort(key=lambda p: (-p[0], p[1]))
    lines = [f"  row {i} ~ {name}[{row}]: {fraction:.2f} of its n-grams" for fraction, i, name, row in pairs[:limit]]
    if len(pairs) > limit:
        lines.append(f"  … {len(pairs) - limit} more in the removed-rows file")
    return "\n".join(lines)


__all__ = ["EVAL_SETS", "FIGURE_OR_URL", "NgramIndex", "PrepareResult", "load_eval_sets", "ngrams",
           "normalize_problem", "overlap_report", "prepare_dataset", "write_prepared"]
