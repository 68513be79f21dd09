"""Evaluation with intervals (`or1-trl eval`): avg@n, unbiased pass@k, maj@n, bootstrap CIs over problems.

For P problems, each sampled n times, with c_i correct samples of problem i (correct: reward >= 1 by
`math_reward`, paper §7.1):

    avg@n   = (1/P) Σ_i c_i / n                            mean correctness over all (problem, sample) pairs
    pass@k  = (1/P) Σ_i [1 − C(n − c_i, k) / C(n, k)]      unbiased estimator (Chen et al. 2021), k <= n
    maj@n   = (1/P) Σ_i 1{the most frequent answer of problem i is correct}
    SE_samp(avg@n) = sqrt( Σ_i p̂_i (1 − p̂_i) / (n − 1) ) / P,   p̂_i = c_i / n

pass@1 equals avg@n. maj@n groups the samples of a problem by their parsed answer (Math-Verify's value, as sympy
prints it; samples without a parsable answer do not vote); a tie goes to the answer that appeared first; the
answer is correct if a sample giving it was scored correct.

Intervals: a percentile bootstrap over problems (resample the P problems with replacement, `resamples` times, with
a fixed seed; the same resamples for every metric) — it answers "how much would the score move on another draw of
problems like these". `SE_samp` is the other source of noise: how much avg@n would move if the same problems were
sampled again (it shrinks as 1/sqrt(n)). The paper reports avg@32 without either (§8.1).

Benchmarks: `aime24` (`HuggingFaceH4/aime_2024`), `aime25` (`yentinglin/aime_2025`), `math500`
(`HuggingFaceH4/MATH-500`) load from the Hub when asked; any local `.jsonl`/`.json`/`.parquet` file with a problem
and an answer column (names configurable) works offline.

Output (`output_dir`): `<benchmark>.jsonl` (one record per problem: the samples, their rewards, correctness,
parsed answers, token lengths and truncation — `or1_trl.generation.sampling`'s store, so an interrupted run resumes
without regenerating finished problems), `eval_summary.json` and `eval_summary.md` (the table).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The instruction appended to each problem (DeepSeek-R1's recommendation for math, the paper's base models).
DEFAULT_PROMPT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
#: The user turn of a training-format file's problem (`is_training_format`): its prompt as training saw it.
TRAINING_TEMPLATE = "{problem}"
#: Completion tokens (the paper's budget, §8.1).
DEFAULT_MAX_TOKENS = 32768
SUMMARY_JSON = "eval_summary.json"
SUMMARY_MD = "eval_summary.md"


# --------------------------------------------------------------------------------------------------------------
# Metrics (pure functions)
# --------------------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples: 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def default_ks(n: int) -> list[int]:
    """k in {1, 2, 4, …} up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_correct(keys: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most frequent answer (`keys`, None: no answer) is correct; ties go to the earliest answer."""
    votes: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            votes.setdefault(key, []).append(i)
    if not votes:
        return False
    winner = max(votes.values(), key=len)  # max keeps the first of equal counts: insertion order = first appearance
    return any(correct[i] for i in winner)


def check_ks(ks: Sequence[int], n: int) -> None:
    """pass@k needs 1 <= k <= n: a `ValueError` naming the bad k otherwise."""
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n: k={bad} with n={n} samples per problem (raise --n or lower --k)")


def per_problem_scores(correct: Sequence[Sequence[bool]], ks: Sequence[int],
                       keys: Sequence[Sequence[str | None]] | None = None) -> dict[str, np.ndarray]:
    """`{metric: [P] per-problem score}` for avg@n, pass@k (each k) and, with `keys`, maj@n. Every problem has n
    samples."""
    sizes = {len(c) for c in correct}
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples, got {sorted(sizes)}")
    n = sizes.pop()
    counts = [sum(map(bool, c)) for c in correct]
    scores = {f"avg@{n}": np.array([c / n for c in counts])}
    for k in ks:
        scores[f"pass@{k}"] = np.array([pass_at_k(n, c, k) for c in counts])
    if keys is not None:
        scores[f"maj@{n}"] = np.array([float(majority_correct(k, c)) for k, c in zip(keys, correct)])
    return scores


def group_pass_at_k(rewards: Sequence[float], group_size: int, ks: Sequence[int] | None = None,
                    threshold: float = 1.0) -> dict[str, list[float]]:
    """Per group of `group_size` consecutive samples (one prompt's), avg@n and pass@k (n = group_size; a sample is
    correct at reward >= `threshold`, NaN is not): `{"avg@n": [...], "pass@k": [...]}`, one value per group.

    What `OR1Trainer` logs during evaluation (TRL's layout: each eval prompt's samples are consecutive rows)."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    correct = [[r >= threshold for r in group] for group in groups]  # NaN >= threshold is False
    scores = per_problem_scores(correct, ks or default_ks(group_size))
    return {name: values.tolist() for name, values in scores.items()}


def bootstrap_intervals(scores: Mapping[str, np.ndarray], resamples: int = 10_000, confidence: float = 0.95,
                        seed: int = 0) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap interval of each metric's mean over problems (the same resamples for every metric)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    num_problems = len(next(iter(scores.values())))
    index = np.random.default_rng(seed).integers(0, num_problems, size=(resamples, num_problems))  # [B, P]
    tail = 100 * (1 - confidence) / 2
    out = {}
    for name, values in scores.items():
        means = values[index].mean(axis=1)  # [B]
        low, high = np.percentile(means, [tail, 100 - tail])
        out[name] = (float(low), float(high))
    return out


def sampling_standard_error(correct: Sequence[Sequence[bool]]) -> float | None:
    """SE of avg@n from sampling n completions per fixed problem: sqrt(Σ p̂(1 − p̂)/(n − 1)) / P (None if n = 1)."""
    n = len(correct[0])
    if n < 2:
        return None
    p = np.array([sum(map(bool, c)) / n for c in correct])
    return float(np.sqrt((p * (1 - p) / (n - 1)).sum()) / len(p))


def summarize(records: Sequence[Mapping], ks: Sequence[int] | None = None, resamples: int = 10_000,
              confidence: float = 0.95, seed: int = 0) -> dict:
    """The summary of one benchmark from its per-problem records (`correct`, `answer_keys`, `num_tokens`,
    `truncated`)."""
    correct = [r["correct"] for r in records]
    n = len(correct[0])
    ks = list(ks or default_ks(n))
    keys = [r["answer_keys"] for r in records] if all("answer_keys" in r for r in records) else None
    scores = per_problem_scores(correct, ks, keys)
    intervals = bootstrap_intervals(scores, resamples, confidence, seed)
    lengths = [t for r in records for t in r["num_tokens"] if t is not None]
    return {
        "problems": len(records),
        "n": n,
        "metrics": {name: {"value": float(v.mean()), "ci": list(intervals[name])} for name, v in scores.items()},
        "avg_sampling_se": sampling_standard_error(correct),
        "confidence": confidence,
        "bootstrap_resamples": resamples,
        "bootstrap_seed": seed,
        "truncated_frac": float(np.mean([t for r in records for t in r["truncated"]])),
        "mean_tokens": float(np.mean(lengths)) if lengths else None,
    }


def summary_markdown(summary: Mapping, name_model: bool = True) -> str:
    """The results table (percent, with the bootstrap interval), one row per benchmark; `name_model=False` (the
    model's own card) leaves out which model was evaluated (its name there is a path of the machine that ran it)."""
    benchmarks = summary["benchmarks"]
    if not benchmarks:
        return ""
    first = next(iter(benchmarks.values()))
    level = round(100 * first["confidence"])
    names = list(first["metrics"])
    header = ["benchmark", "problems", *[f"{m} [{level}% CI]" for m in names], "± SE (sampling)", "truncated",
              "mean tokens"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for name, b in benchmarks.items():
        cells = [name, str(b["problems"])]
        for metric in names:
            m = b["metrics"].get(metric)
            cells.append("—" if m is None
                         else f"{100 * m['value']:.1f} [{100 * m['ci'][0]:.1f}, {100 * m['ci'][1]:.1f}]")
        se = b["avg_sampling_se"]
        cells += ["—" if se is None else f"{100 * se:.1f}", f"{100 * b['truncated_frac']:.1f}%",
                  "—" if b["mean_tokens"] is None else f"{b['mean_tokens']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    s = summary["settings"]
    lines.append("")
    lines.append(
        (f"Model `{summary['model']}`; " if name_model else "")
        + f"n={s['n']} samples per problem, temperature {s['temperature']}, top-p "
        f"{s['top_p']}, max {s['max_tokens']} tokens, seed {s['seed']}; {level}% percentile-bootstrap intervals over "
        f"problems ({first['bootstrap_resamples']} resamples); ± SE: sampling standard error of avg@n."
    )
    return "\n".join(lines) + "\n"


def read_summary(folder: str) -> dict | None:
    """The `eval_summary.json` in `folder`, or None."""
    path = os.path.join(folder, SUMMARY_JSON)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a named benchmark lives on the Hub and which columns hold what."""

    hub_id: str
    split: str
    problem_column: str = "problem"
    answer_column: str = "answer"
    id_column: str | None = None  # row index when None or absent


BENCHMARKS = {
    "aime24": BenchmarkSpec("HuggingFaceH4/aime_2024", "train", id_column="id"),
    "aime25": BenchmarkSpec("yentinglin/aime_2025", "train"),
    "math500": BenchmarkSpec("HuggingFaceH4/MATH-500", "test", id_column="unique_id"),
}
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Problem:
    id: str
    problem: Any  # the problem text, or a conversation
    answer: Any  # gold answer(s)


def benchmark_name(spec: str) -> str:
    return spec if spec in BENCHMARKS else os.path.splitext(os.path.basename(spec))[0]


def check_benchmark_spec(spec: str) -> None:
    """A named benchmark or an existing local file (checked before any model loads)."""
    if spec in BENCHMARKS:
        return
    suffix = os.path.splitext(spec)[1]
    if suffix not in LOCAL_SUFFIXES:
        raise ValueError(
            f"unknown benchmark {spec!r}: use one of {sorted(BENCHMARKS)} or a local file ending in "
            f"{sorted(LOCAL_SUFFIXES)}"
        )
    if not os.path.isfile(spec):
        raise ValueError(f"benchmark file {spec!r} does not exist")


def _load_benchmark(spec: str):
    from ..data.loading import load_data

    check_benchmark_spec(spec)
    try:  # offline and not cached, an empty or unreadable file: one line naming the benchmark
        return load_data(BENCHMARKS[spec].hub_id if spec in BENCHMARKS else spec,
                         split=BENCHMARKS[spec].split if spec in BENCHMARKS else "train")
    except ValueError as exc:
        raise ValueError(f"benchmark {spec!r}: {exc}") from exc


def is_training_format(spec: str, problem_column: str | None = None) -> bool:
    """Whether `spec` is a local file in the format `or1-trl train` reads — a `prompt` column and no `problem` one
    (prompt/answer rows, or the released (verl) format with its gold in `reward_model.ground_truth`) — with no
    `problem_column` named: `load_problems` then takes the prompts as they are, and `or1-trl eval` adds no
    instruction to them (`TRAINING_TEMPLATE`)."""
    if spec in BENCHMARKS or problem_column is not None:
        return False
    columns = _load_benchmark(spec).column_names
    return "problem" not in columns and "prompt" in columns


def _golds(dataset, spec: str, answer_column: str | None):
    """The gold column of a training-format file: `answer_column`, else `answer`, else the released format's
    `reward_model.ground_truth` (math rows only: `or1-trl eval` scores with `math_reward`)."""
    from ..data.released import is_verl_format, math_golds

    if answer_column is not None or not is_verl_format(dataset):
        return answer_column or "answer"
    abilities = set(dataset["ability"]) if "ability" in dataset.column_names else {"math"}
    if abilities - {"math"}:
        raise ValueError(f"benchmark {spec!r} holds {sorted(abilities - {'math'})} rows besides math: or1-trl eval "
                         "scores math answers only (select the math split or rows)")
    return [math_golds(row["ground_truth"]) for row in dataset["reward_model"]]


def load_problems(spec: str, problem_column: str | None = None, answer_column: str | None = None,
                  id_column: str | None = None) -> list[Problem]:
    """The problems of a named benchmark (from the Hub) or of a local file; a training-format file
    (`is_training_format`) gives its prompts and its gold answers. Missing columns: a `ValueError` naming them."""
    training = is_training_format(spec, problem_column)
    dataset = _load_benchmark(spec)
    golds = None
    if spec in BENCHMARKS:
        hub = BENCHMARKS[spec]
        problem_column = problem_column or hub.problem_column
        answer_column = answer_column or hub.answer_column
        if id_column is None and hub.id_column in dataset.column_names:
            id_column = hub.id_column
    elif training:
        problem_column, answer_column = "prompt", _golds(dataset, spec, answer_column)
        if not isinstance(answer_column, str):
            golds, answer_column = answer_column, None
    else:
        problem_column, answer_column = problem_column or "problem", answer_column or "answer"
    missing = [c for c in (problem_column, answer_column, id_column) if c is not None
               and c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"benchmark {spec!r} has no column(s) {missing} (columns: {dataset.column_names}); name the problem, "
            "answer and id columns with --problem_column, --answer_column and --id_column"
        )
    if len(dataset) == 0:
        raise ValueError(f"benchmark {spec!r} has no rows")
    ids = [str(i) for i in (dataset[id_column] if id_column else range(len(dataset)))]
    if len(set(ids)) != len(ids):
        raise ValueError(f"benchmark {spec!r}: the ids in column {id_column!r} are not unique")
    golds = dataset[answer_column] if golds is None else golds
    return [Problem(pid, p, a) for pid, p, a in zip(ids, dataset[problem_column], golds)]


def build_prompt(problem: Any, template: str = DEFAULT_PROMPT_TEMPLATE, chat: bool = True):
    """A conversation with one user turn (`template` filled with the problem), or the filled text when `chat=False`.

    A problem that is already a conversation (a list of messages) is used as it is."""
    if isinstance(problem, list):
        return problem
    text = template.format(problem=problem)
    return [{"role": "user", "content": text}] if chat else text


# --------------------------------------------------------------------------------------------------------------
# Scoring the samples of a problem
# --------------------------------------------------------------------------------------------------------------


def answer_key(text: str, parsing_timeout: int | None = 5, max_chars: int = 8192) -> str | None:
    """The answer a completion gives, for majority voting: Math-Verify's parsed value of the final answer (the text
    after the last `</think>`), printed by sympy; None without a parsable answer."""
    import threading

    from math_verify import parse

    from ..rewards.math import extract_final_answer

    if threading.current_thread() is not threading.main_thread():
        parsing_timeout = None  # SIGALRM works in the main thread only
    try:
        parsed = parse(extract_final_answer(text)[-max_chars:], parsing_timeout=parsing_timeout)
    except Exception:  # noqa: BLE001 - an unparsable answer does not vote
        return None
    return str(parsed[0]) if len(parsed) >= 2 else None


def eval_scorer(reward_func, problems: Mapping[str, Problem]):
    """`score` for `or1_trl.generation.sampling.sample`: rewards, correctness (reward >= 1), parsed answers, the
    problem and gold."""
    from ..generation.sampling import reward_scorer

    golds = {pid: p.answer for pid, p in problems.items()}
    rewards = reward_scorer(reward_func, golds)

    def score(ids, completions):
        out = rewards(ids, completions)
        for pid, group, extra in zip(ids, completions, out):
            extra["correct"] = [r >= 1.0 for r in extra["rewards"]]
            extra["answer_keys"] = [answer_key(c.text) for c in group]
            extra["problem"] = problems[pid].problem
            extra["answer"] = problems[pid].answer
        return out

    return score


# --------------------------------------------------------------------------------------------------------------
# The whole evaluation
# --------------------------------------------------------------------------------------------------------------


def evaluate(backend, benchmarks: Mapping[str, Sequence[Problem]], settings, output_dir: str, model_name: str,
             ks: Sequence[int] | None = None, reward_func=None,
             template: str | Mapping[str, str] = DEFAULT_PROMPT_TEMPLATE, chat: bool = True, resamples: int = 10_000,
             confidence: float = 0.95, progress: bool = True) -> dict:
    """Sample, score and summarize every benchmark; writes `<name>.jsonl`, `eval_summary.json` and `.md` to
    `output_dir`.

    `template`: the user turn of every benchmark, or `{benchmark name: its template}`. Problems already in
    `<name>.jsonl` (same sampling settings) are not sampled again.
    """
    from ..files import write_json_atomic
    from ..generation.sampling import SampleStore, sample

    if reward_func is None:
        from ..rewards import math_reward as reward_func
    os.makedirs(output_dir, exist_ok=True)
    summary = {"model": model_name, "settings": settings.as_dict(), "backend": backend.name, "benchmarks": {}}
    earlier = read_summary(output_dir)
    if earlier and earlier.get("model") == model_name and earlier.get("settings") == summary["settings"]:
        summary["benchmarks"] = earlier["benchmarks"]  # benchmarks evaluated before with the same model and settings
    for name, problems in benchmarks.items():
        by_id = {p.id: p for p in problems}
        filled = template if isinstance(template, str) else template[name]
        prompts = {p.id: build_prompt(p.problem, filled, chat) for p in problems}
        with SampleStore(os.path.join(output_dir, f"{name}.jsonl"), settings) as store:
            records = sample(backend, prompts, settings, store=store, score=eval_scorer(reward_func, by_id), desc=name,
                             progress=progress)
        summary["benchmarks"][name] = {
            "samples_file": f"{name}.jsonl",
            **summarize(list(records.values()), ks, resamples, confidence, seed=settings.seed),
        }
        write_json_atomic(os.path.join(output_dir, SUMMARY_JSON), summary)  # after each benchmark: nothing lost
    table = summary_markdown(summary)
    tmp = os.path.join(output_dir, f"{SUMMARY_MD}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(table)
    os.replace(tmp, os.path.join(output_dir, SUMMARY_MD))
    return summary
