"""Training data in the paper's released format, its offline difficulty filter, and what `or1-trl train` trains on.

**The released format** (verl's, as `Skywork/Skywork-OR1-RL-Data` ships it; splits `math` and `code`):

    prompt                       [{"role": "user", "content": ...}]          (TRL's conversational prompt)
    data_source                  e.g. "NuminaMath-1.5", "LeetCode"
    ability                      "math" or "code": which verifier scores the row
    reward_model.ground_truth    a JSON string — math: the list of acceptable answers ('["12.8"]');
                                 code: an object whose non-null keys give the tests (below)
    reward_model.style           "rule"
    extra_info.index             int
    extra_info.model_difficulty  {"DeepSeek-R1-Distill-Qwen-1.5B" | "-7B" | "-32B": correct samples out of 16}

`training_dataset` turns it into the columns our rewards read — `answer` (list of golds), `tests` (our
`CodeReward` spec as JSON) and `ability` — and `mixed_rewards()` scores each row with its own verifier. The code
layouts are those the released reward (`verl/utils/reward_score/livecodebench/compute_score.py`) dispatches on, in
its order, after dropping null keys as the released data script does:

    {"inputs": [...], "outputs": [...], "fn_name": f?}   -> {"inputs", "outputs", "fn_name"?}  (stdin/stdout, or a call
                                                            with LiveCodeBench's JSON-lines encoding when fn_name is
                                                            set)
    {"import_prefix": p, "test_code": t, "entry_point": e} -> {"asserts": [t[0] + t[i] + "\ncheck(e)" for each
                                                            further non-empty line i of t], "import_prefix": p}
    {"assert_case": [a, ...]}                            -> {"asserts": [a, ...],
                                                            "import_prefix": the released IMPORT_PROMPT}

(`question_id`, LiveCodeBench tests read from separate files, is not supported: such rows are invalid.)

**The offline filter** (paper §6.2; `or1_scripts/data_preprocess/download_and_filter_data_7b.py`): keep the rows whose
`extra_info.model_difficulty[model]` lies in a range — the released scripts keep 1..15 of 16 and drop rows without
a count. `or1-trl difficulty` writes counts for any model in the same place. It stays with the format: it reads the
format's `extra_info`, and `training_dataset` applies it.

**Row checks** (`training_dataset`, with counts): prompts that are neither text nor conversations, rows without a
gold answer, malformed tests, unknown abilities or data sources. The gold readers (`check_math_gold`,
`check_tests`) are those `OR1Trainer`'s pre-flight applies to any dataset (`data/preflight.py`); loading files is
`data/loading.py`.
"""

from __future__ import annotations

import json
from collections import Counter

from ..rewards.columns import ABILITY_COLUMN, ANSWER_COLUMN, TESTS_COLUMN

# ---------------------------------------------------------------------------------------------------------------
# The released (verl) format
# ---------------------------------------------------------------------------------------------------------------

ABILITIES = ("math", "code")
#: Column of `or1-trl train`'s `--reward`: where each verifier reads its gold.
REWARD_COLUMNS = {"math": ANSWER_COLUMN, "code": TESTS_COLUMN}
#: `extra_info.model_difficulty` keys of the released data, by the short names `--difficulty_model` accepts.
DIFFICULTY_MODELS = {
    "1.5B": "DeepSeek-R1-Distill-Qwen-1.5B",
    "7B": "DeepSeek-R1-Distill-Qwen-7B",
    "32B": "DeepSeek-R1-Distill-Qwen-32B",
}
#: The released code reward's `IMPORT_PROMPT`, run before `assert_case` tests.
SKYWORK_IMPORT_PROMPT = (
    "from typing import *\n\nfrom functools import *\nfrom collections import *\nfrom itertools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom string import *\nfrom operator import *\nfrom math import *\n"
    "import math\nimport datetime\ninf = float('inf')\n\n"
)
#: verl's reward dispatch by `data_source` (`verl/utils/reward_score/__init__.py`), for rows without `ability`.
DATA_SOURCE_ABILITIES = {
    **dict.fromkeys(["openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "numina_aops_forum",
                     "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
                     "numina_olympiads"], "math"),
    **dict.fromkeys(["codecontests", "apps", "codeforces", "taco"], "code"),
}
_INVALID = "or1_invalid"  # map output: why a row cannot be scored (None: it can)


class InvalidRow(ValueError):
    """A row no verifier can score. `reason` is its category (rows are counted by it); the message adds detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason} ({detail})" if detail else reason)
        self.reason, self.detail = reason, detail


def is_verl_format(dataset) -> bool:
    """Whether `dataset` is in the released (verl) layout: the gold lives in `reward_model.ground_truth`."""
    return "reward_model" in (getattr(dataset, "column_names", None) or ())


def prompt_text(prompt) -> str:
    """The problem statement of a prompt: a string, or the last user message of a conversation (all of it if none)."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt or [])
    users = [m for m in messages if m.get("role") == "user"] or messages
    return str(users[-1].get("content", "")) if users else ""


def check_math_gold(answer) -> tuple[str, ...]:
    """The gold answers of one math row as `MathReward` reads them (`normalize_golds`), or `InvalidRow`.

    A gold is a string or a number, or a list of them (the acceptable answers). Anything else — a dict (e.g. a whole
    `reward_model` struct), a bool, a list holding dicts or lists — would reach Math-Verify as its Python text and
    never match: "wrong gold type". None, or only empty strings: "no gold answer".
    """
    from ..rewards.math import normalize_golds

    value = answer.tolist() if hasattr(answer, "tolist") and not isinstance(answer, (str, int, float)) else answer
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    wrong = next((item for item in items if isinstance(item, (dict, list, tuple, set, frozenset, bool, bytes))), None)
    if wrong is not None:
        inside = "" if wrong is value else f" holding a {type(wrong).__name__}"
        raise InvalidRow("wrong gold type", f"a {type(value).__name__}{inside}: {str(value)[:60]!r}")
    golds = tuple(g for g in normalize_golds(value) if g.strip())
    if not golds:
        raise InvalidRow("no gold answer")
    return golds


def check_tests(tests) -> None:
    """`InvalidRow` ("malformed test JSON") if `CodeReward` cannot run the test spec `tests` (`tests_problem`)."""
    problem = tests_problem(tests)
    if problem:
        raise InvalidRow("malformed test JSON", problem)


def math_golds(ground_truth) -> list[str]:
    """The gold answers of a released math row, from `reward_model.ground_truth`: a JSON list of strings (the
    released data), a JSON string, or a plain string. What `json.loads` cannot read, or reads as a number, stays the
    string it was (the released script keeps unreadable ones; a number would never match there). A JSON object is a
    "wrong gold type" (`check_math_gold`)."""
    value = ground_truth
    if isinstance(ground_truth, str):
        try:
            value = json.loads(ground_truth)
        except ValueError:
            value = ground_truth
        if not isinstance(value, (list, str, dict)):
            value = ground_truth
    try:
        return list(check_math_gold(value))
    except InvalidRow as exc:
        detail = f"ground_truth {str(ground_truth)[:60]!r}"
        raise InvalidRow(exc.reason, f"{detail}: {exc.detail}" if exc.detail else detail) from None


def code_tests(ground_truth) -> dict:
    """Our `CodeReward` spec for the tests of a released code row (the layouts of the module docstring)."""
    try:
        spec = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    except ValueError as exc:
        raise InvalidRow("malformed test JSON", str(exc)) from None
    if not isinstance(spec, dict):
        raise InvalidRow("malformed test JSON", f"a JSON object was expected, not {type(spec).__name__}")
    spec = {key: value for key, value in spec.items() if value is not None}  # as the released data script does
    if spec.get("question_id"):
        raise InvalidRow("unsupported tests", "LiveCodeBench question_id: the tests are in separate files")
    if "import_prefix" in spec:
        lines = [line for line in str(spec.get("test_code", "")).split("\n") if line != ""]
        if len(lines) < 2 or not spec.get("entry_point"):
            raise InvalidRow("malformed test JSON", "import_prefix tests need test_code (a header line, then one "
                             "test per line) and entry_point")
        entry = spec["entry_point"]
        tests = {"asserts": [lines[0] + line + f"\ncheck({entry})" for line in lines[1:]],
                 "import_prefix": str(spec["import_prefix"])}
    elif "inputs" in spec:
        tests = {"inputs": spec["inputs"], "outputs": spec.get("outputs")}
        if spec.get("fn_name"):
            tests["fn_name"] = spec["fn_name"]
    elif "assert_case" in spec:
        tests = {"asserts": spec["assert_case"], "import_prefix": SKYWORK_IMPORT_PROMPT}
    else:
        raise InvalidRow("malformed test JSON", f"no tests among the keys {sorted(spec)}")
    check_tests(tests)
    return tests


def tests_problem(tests) -> str | None:
    """Why a `CodeReward` test spec (a dict or its JSON string) cannot be run, or `None` if it can."""
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            return f"not JSON: {exc}"
    if not isinstance(tests, dict):
        return "not a JSON object"
    if tests.get("asserts") is not None:
        asserts = [tests["asserts"]] if isinstance(tests["asserts"], str) else tests["asserts"]
        if isinstance(asserts, list) and asserts and all(isinstance(a, str) for a in asserts):
            return None
        return "asserts must be a non-empty list of strings"
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        return "inputs and outputs must be lists"
    if not inputs or len(inputs) != len(outputs):
        return f"{len(inputs)} inputs for {len(outputs)} outputs"
    return None


def _row_ability(row: dict, verl: bool, default: str) -> str:
    ability = row.get(ABILITY_COLUMN)
    if ability:
        if ability not in ABILITIES:
            raise InvalidRow("unknown ability", f"{ability!r}; known: {', '.join(ABILITIES)}")
        return ability
    source = row.get("data_source")
    if source in DATA_SOURCE_ABILITIES:
        return DATA_SOURCE_ABILITIES[source]
    if verl:
        raise InvalidRow("unknown data_source", f"{source!r} and no 'ability' column saying math or code")
    return default


def _scorable_row(row: dict, verl: bool, default_ability: str) -> dict:
    """`datasets.map` function: the row's `ability`, and (released format) its `answer` and `tests` columns; or why
    it cannot be scored."""
    out = {ABILITY_COLUMN: None, _INVALID: None}
    if verl:
        out.update({ANSWER_COLUMN: None, TESTS_COLUMN: None})
    try:
        out[ABILITY_COLUMN] = ability = _row_ability(row, verl, default_ability)
        if verl:
            ground_truth = (row.get("reward_model") or {}).get("ground_truth")
            if ability == "math":
                out[ANSWER_COLUMN] = math_golds(ground_truth)
            else:
                out[TESTS_COLUMN] = json.dumps(code_tests(ground_truth))
        elif ability == "math":
            check_math_gold(row.get(ANSWER_COLUMN))
        else:
            check_tests(row.get(TESTS_COLUMN))
    except InvalidRow as exc:
        out[_INVALID] = f"{exc.reason}\t{exc}"
    return out


# ---------------------------------------------------------------------------------------------------------------
# The offline difficulty filter (§6.2)
# ---------------------------------------------------------------------------------------------------------------


def difficulty_key(model: str) -> str:
    """The `model_difficulty` key of `model`: `"7B"` → `"DeepSeek-R1-Distill-Qwen-7B"`; other names as given."""
    return DIFFICULTY_MODELS.get(model, model)


def model_difficulty(extra_info, key: str) -> int | None:
    """`extra_info["model_difficulty"][key]`, or `None` where the row has no count for that model."""
    counts = (extra_info or {}).get("model_difficulty") or {}
    return counts.get(key)


def filter_by_difficulty(dataset, model: str, low: int, high: int):
    """Keep the rows whose `extra_info.model_difficulty[model]` lies in `[low, high]`; drop rows without a count.

    Returns `(dataset, counts)` with `counts = {"kept", "no_count", "below", "above"}`. The released scripts keep
    `1 <= DeepSeek-R1-Distill-Qwen-7B <= 15` (of 16 samples) for the 7B run, the same with 1.5B / 32B for the others.
    """
    key = difficulty_key(model)
    if "extra_info" not in dataset.column_names:
        raise ValueError(f"--difficulty_model {model}: the dataset has no extra_info column with model_difficulty "
                         "counts (the released data has them; `or1-trl difficulty` writes them)")
    counts = Counter()
    keep = []
    known = set()
    for index, extra_info in enumerate(dataset["extra_info"]):
        known.update(k for k, v in ((extra_info or {}).get("model_difficulty") or {}).items() if v is not None)
        value = model_difficulty(extra_info, key)
        verdict = "no_count" if value is None else "below" if value < low else "above" if value > high else "kept"
        counts[verdict] += 1
        if verdict == "kept":
            keep.append(index)
    if len(dataset) and not counts["kept"] and counts["no_count"] == len(dataset):
        raise ValueError(f"no row has a model_difficulty count for {key!r} (--difficulty_model {model}); the dataset "
                         f"has counts for: {sorted(known) or 'no model'}")
    return dataset.select(keep), {name: counts[name] for name in ("kept", "no_count", "below", "above")}


# ---------------------------------------------------------------------------------------------------------------
# What `or1-trl train` trains on
# ---------------------------------------------------------------------------------------------------------------


def prompt_feature_problem(feature) -> str | None:
    """Why a prompt column of this `datasets` feature type cannot be generated from, or `None`: prompts are text
    (`Value("string")`) or conversations (a list of `{"role", "content"}` messages), as TRL takes them."""
    from datasets import Value

    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        return None
    messages = getattr(feature, "feature", None)
    if isinstance(messages, dict) and {"role", "content"} <= set(messages):
        return None
    return (f"holds {feature} values, not prompts: a prompt is a string or a list of {{'role', 'content'}} messages "
            "(name the prompt's column with --prompt_column)")


def row_list(rows: list[int], limit: int = 5) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return f"row{'s' if len(rows) > 1 else ''} {shown}{', …' if len(rows) > limit else ''}"


def invalid_rows(reasons: list[str | None]) -> tuple[int, str]:
    """`(count, details)` of the rows whose entry in `reasons` is `"<reason>\t<message>"` (None: a valid row):
    per reason its count, its first rows and the first one's message."""
    invalid: dict[str, list[int]] = {}
    for index, reason in enumerate(reasons):
        if reason is not None:
            invalid.setdefault(reason.split("\t")[0], []).append(index)
    details = "; ".join(f"{len(rows)} {reason} ({row_list(rows)}; first: {reasons[rows[0]].split(chr(9))[1]})"
                        for reason, rows in invalid.items())
    return sum(len(rows) for rows in invalid.values()), details


def training_dataset(dataset, reward: str = "auto", prompt_column: str = "prompt", answer_column: str | None = None,
                     difficulty_model: str | None = None, difficulty_range: tuple[int, int] | None = None,
                     drop_invalid: bool = False, num_proc: int | None = None):
    """The dataset `or1-trl train` trains on: `(dataset, abilities, report)`.

    - The released format (`reward_model` column) gets `answer` / `tests` / `ability` columns (module docstring)
      and loses `reward_model`; a plain dataset has `prompt_column` and `answer_column` renamed to `prompt` and the
      reward's column (`answer` for math, `tests` for code) and gets an `ability` column (its own if it has one, else
      the reward's).
    - `reward`: `"auto"` scores each row by its `ability` (plain datasets without one: math); `"math"` or `"code"`
      requires every row to be of that ability.
    - Rows without a gold answer, with malformed tests or an unknown ability / data source raise a `ValueError`
      with their counts, or are dropped with `drop_invalid=True`. Then the difficulty filter
      (`filter_by_difficulty`), if `difficulty_model` is given. An empty result is an error saying what removed
      the rows.
    - `abilities`: those present, in `ABILITIES` order; `report`: lines saying how many rows each step kept.
    """
    from datasets import Features, List, Value

    verl = is_verl_format(dataset)
    if prompt_column not in dataset.column_names:
        raise ValueError(f"has no column {prompt_column!r} (columns: {dataset.column_names}); training generates "
                         "from the prompt in --prompt_column")
    problem = prompt_feature_problem(dataset.features[prompt_column])
    if problem:
        raise ValueError(f"column {prompt_column!r} {problem}")
    if prompt_column != "prompt":
        dataset = dataset.rename_column(prompt_column, "prompt")
    default_ability = "code" if reward == "code" else "math"
    if not verl:
        target = REWARD_COLUMNS[default_ability]
        source = answer_column or target
        if source not in dataset.column_names:
            raise ValueError(f"has no column {source!r} (columns: {dataset.column_names}); --reward {reward} reads "
                             "the gold from --answer_column")
        if source != target:
            dataset = dataset.rename_column(source, target)
    features = Features({**dataset.features, ABILITY_COLUMN: Value("string"), _INVALID: Value("string")})
    if verl:
        features[ANSWER_COLUMN], features[TESTS_COLUMN] = List(Value("string")), Value("string")
    dataset = dataset.map(_scorable_row, fn_kwargs={"verl": verl, "default_ability": default_ability},
                          features=features, num_proc=num_proc, desc="Checking rows")
    total = len(dataset)
    report = [f"{total} rows in "
              f"{'the released (verl) format' if verl else f'prompt/{REWARD_COLUMNS[default_ability]} columns'}"]

    count, details = invalid_rows(dataset[_INVALID])
    if count:
        if not drop_invalid:
            raise ValueError(f"{count} of {total} rows cannot be scored: {details}. Fix them, or pass "
                             "--drop_invalid_rows to train without them.")
        dataset = dataset.filter(lambda reason: reason is None, input_columns=[_INVALID], num_proc=num_proc)
        report.append(f"dropped {count} rows that cannot be scored: {details}")
    dataset = dataset.remove_columns([_INVALID, "reward_model"] if verl else [_INVALID])

    if reward in ABILITIES:
        other = [i for i, ability in enumerate(dataset[ABILITY_COLUMN]) if ability != reward]
        if other:
            raise ValueError(f"{len(other)} rows are not {reward} ({row_list(other)}) but --reward {reward} scores "
                             f"{reward} only; use --reward auto to score each row by its ability")
    if difficulty_model is not None:
        low, high = difficulty_range if difficulty_range is not None else (1, 15)
        before = len(dataset)
        dataset, counts = filter_by_difficulty(dataset, difficulty_model, low, high)
        report.append(f"difficulty filter {difficulty_key(difficulty_model)} in [{low}, {high}]: kept "
                      f"{counts['kept']} of {before} ({counts['no_count']} without a count, {counts['below']} below, "
                      f"{counts['above']} above)")
    if len(dataset) == 0:
        raise ValueError("no rows left to train on: " + "; ".join(report))
    present = Counter(dataset[ABILITY_COLUMN])
    abilities = [a for a in ABILITIES if present[a]]
    report.append(f"training on {len(dataset)} rows: " + ", ".join(f"{present[a]} {a}" for a in abilities))
    return dataset, abilities, report


def released_format_inputs(reward_funcs, train_dataset, eval_dataset):
    """What `OR1Trainer` does with datasets in the released (verl) format: each gets our columns (`training_dataset`:
    invalid rows are an error here, no difficulty filter), and `reward_funcs=None` becomes each row's verifier
    (`mixed_rewards`, or the one verifier of a single-ability dataset). Other inputs pass through unchanged."""

    def convert(dataset):
        if isinstance(dataset, dict):
            return {name: convert(split) for name, split in dataset.items()}
        if not is_verl_format(dataset) or not hasattr(dataset, "map"):
            return dataset, None
        try:
            converted, abilities, _ = training_dataset(dataset)
        except ValueError as exc:
            raise ValueError(f"dataset in the released (verl) format: {exc}") from None
        return converted, abilities

    train_dataset, abilities = convert(train_dataset)
    if isinstance(eval_dataset, dict):
        eval_dataset = {name: split for name, (split, _) in convert(eval_dataset).items()}
    else:
        eval_dataset, _ = convert(eval_dataset)
    if reward_funcs is None and abilities:
        from ..rewards import code_reward, math_reward, mixed_rewards

        single = {"math": math_reward, "code": code_reward}
        reward_funcs = single[abilities[0]] if len(abilities) == 1 else mixed_rewards(abilities)
    return reward_funcs, train_dataset, eval_dataset
