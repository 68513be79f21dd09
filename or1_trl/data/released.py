"""Training data: the paper's released format, the offline difficulty filter, and checks before compute.

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
                                                            with LiveCodeBench's JSON-lines encoding when fn_name is set)
    {"import_prefix": p, "test_code": t, "entry_point": e} -> {"asserts": [t[0] + t[i] + "\ncheck(e)" for each
                                                            further non-empty line i of t], "import_prefix": p}
    {"assert_case": [a, ...]}                            -> {"asserts": [a, ...], "import_prefix": the released IMPORT_PROMPT}

(`question_id`, LiveCodeBench tests read from separate files, is not supported: such rows are invalid.)

**The offline filter** (paper §6.2; `or1_scripts/data_preprocess/download_and_filter_data_7b.py`): keep the rows whose
`extra_info.model_difficulty[model]` lies in a range — the released scripts keep 1..15 of 16 and drop rows without
a count. `or1-trl difficulty` writes counts for any model in the same place.

**Loading** (`load_data`): a Hub id, a local folder or a local `.jsonl`/`.json`/`.parquet`/`.csv` file, or TRL's
`--dataset_name json --data_files ...`; a missing, empty or unreadable file is a one-line error.

**Checks** run before a model is loaded: prompts that are neither text nor conversations, rows without a gold
answer, malformed tests, unknown abilities or data sources (`training_dataset`, with counts), and reward columns the
dataset lacks, empty datasets, and gold answers our verifiers cannot read — these when `OR1Trainer` is built, so
for the Python API too (`check_datasets`; each error names the dataset, the column, the count and the first rows).
TRL passes every dataset column to the reward functions as a keyword argument, so a missing gold column would
otherwise surface only after the first generation, deep inside the reward call, and a gold of the wrong type (a
dict) would be scored as its text: 0 for every sample, silently. Once the tokenizer is known,
`check_prompt_lengths` compares the prompts with the context (TRL 1.16 does not truncate prompts).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

from ..rewards.columns import ABILITY_COLUMN, ANSWER_COLUMN, TESTS_COLUMN, check_reward_columns

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


def _row_list(rows: list[int], limit: int = 5) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return f"row{'s' if len(rows) > 1 else ''} {shown}{', …' if len(rows) > limit else ''}"


def _invalid_rows(reasons: list[str | None]) -> tuple[int, str]:
    """`(count, details)` of the rows whose entry in `reasons` is `"<reason>\t<message>"` (None: a valid row):
    per reason its count, its first rows and the first one's message."""
    invalid: dict[str, list[int]] = {}
    for index, reason in enumerate(reasons):
        if reason is not None:
            invalid.setdefault(reason.split("\t")[0], []).append(index)
    details = "; ".join(f"{len(rows)} {reason} ({_row_list(rows)}; first: {reasons[rows[0]].split(chr(9))[1]})"
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
    report = [f"{total} rows in {'the released (verl) format' if verl else f'prompt/{REWARD_COLUMNS[default_ability]} columns'}"]

    count, details = _invalid_rows(dataset[_INVALID])
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
            raise ValueError(f"{len(other)} rows are not {reward} ({_row_list(other)}) but --reward {reward} scores "
                             f"{reward} only; use --reward auto to score each row by its ability")
    if difficulty_model is not None:
        low, high = difficulty_range if difficulty_range is not None else (1, 15)
        before = len(dataset)
        dataset, counts = filter_by_difficulty(dataset, difficulty_model, low, high)
        report.append(f"difficulty filter {difficulty_key(difficulty_model)} in [{low}, {high}]: kept {counts['kept']} "
                      f"of {before} ({counts['no_count']} without a count, {counts['below']} below, "
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


# ---------------------------------------------------------------------------------------------------------------
# OR1Trainer's pre-flight (the Python API and `or1-trl train` alike): before the model loads, and before any step
# ---------------------------------------------------------------------------------------------------------------

_GOLD_FIX = {
    ANSWER_COLUMN: "math_reward reads, per row, a string, a number or a list of them (the acceptable answers); a dict "
                   "is scored as its Python text and never matches. Store the answer itself (a released-format "
                   "struct: pass the dataset with its reward_model column as it is, OR1Trainer converts it)",
    TESTS_COLUMN: "code_reward reads, per row, a test spec (a dict or its JSON string) with inputs/outputs lists or "
                  "asserts (`or1_trl/rewards/code.py`)",
}


def _gold_checks(reward_func) -> list[tuple[str, Any, str | None, str | None]]:
    """`(gold column, check, ability, ability column)` for each gold column one of our verifiers reads (user rewards:
    none). `check(value)` raises `InvalidRow`; `ability` restricts it to the rows of that ability (`mixed_rewards`)."""
    from ..rewards.code import CodeReward
    from ..rewards.math import MathReward
    from ..rewards.mixed import AbilityReward

    ability = ability_column = None
    if isinstance(reward_func, AbilityReward):
        ability, ability_column, reward_func = reward_func.ability, reward_func.column, reward_func.reward
    if isinstance(reward_func, MathReward):
        return [(ANSWER_COLUMN, check_math_gold, ability, ability_column)]
    if isinstance(reward_func, CodeReward):
        return [(TESTS_COLUMN, check_tests, ability, ability_column)]
    return []


def check_golds(reward_funcs: Any, dataset: Any, dataset_name: str = "train_dataset") -> None:
    """Raise a `ValueError` if rows of `dataset` hold gold answers our verifiers cannot read: the column, the reward,
    the count, the first rows and what the first one holds (`check_math_gold`, `check_tests`)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None or not hasattr(dataset, "__len__"):
        return
    for func in reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]:
        for column, check, ability, ability_column in _gold_checks(func):
            if column not in columns or (ability is not None and ability_column not in columns):
                continue  # check_reward_columns names the missing column
            abilities = dataset[ability_column] if ability is not None else None
            reasons = []
            for index, value in enumerate(dataset[column]):
                reason = None
                if abilities is None or abilities[index] == ability:
                    try:
                        check(value)
                    except InvalidRow as exc:
                        reason = f"{exc.reason}\t{exc}"
                reasons.append(reason)
            count, details = _invalid_rows(reasons)
            if count:
                name = getattr(func, "__name__", type(func).__name__)
                raise ValueError(f"{dataset_name} column {column!r} (read by {name!r}): {count} of {len(dataset)} rows "
                                 f"cannot be scored: {details}. {_GOLD_FIX[column]}.")


def check_datasets(reward_funcs: Any, train_dataset: Any, eval_dataset: Any = None) -> None:
    """`OR1Trainer`'s pre-flight, before the model loads: for the train dataset and each eval dataset, the columns the
    rewards need (`check_reward_columns`), at least one row, and gold answers our verifiers can read (`check_golds`).
    Datasets without a length (streaming) are checked for columns only."""
    splits = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        splits += [(f"eval_dataset[{name!r}]", split) for name, split in eval_dataset.items()]
    else:
        splits.append(("eval_dataset", eval_dataset))
    for name, dataset in splits:
        if dataset is None:
            continue
        check_reward_columns(reward_funcs, dataset, name)
        if hasattr(dataset, "__len__") and len(dataset) == 0:
            raise ValueError(f"{name} has no rows: training would run 0 steps. Check the split and any filtering "
                             "(e.g. `or1-trl train`'s difficulty filter) that produced it.")
        check_golds(reward_funcs, dataset, name)


def prompt_lengths(prompts: list, tokenize, batch_size: int = 256) -> list[int]:
    """Token count of each prompt as generation sees it: `tokenize(batch)` returns the token ids of a batch of
    prompts (`OR1Trainer` passes TRL's own `_tokenize_prompts`: chat template, generation prompt, tools)."""
    lengths = []
    for start in range(0, len(prompts), batch_size):
        lengths.extend(len(ids) for ids in tokenize(list(prompts[start : start + batch_size])))
    return lengths


def check_prompt_lengths(lengths: list[int], context: int | None, completion_length: int,
                         max_prompt_length: int | None = None, dataset_name: str = "train_dataset",
                         context_source: str = "the context") -> str | None:
    """Prompts that do not fit: TRL 1.16 generates from the whole prompt (it has no `max_prompt_length`), so a prompt
    longer than `context - completion_length` runs past the model's context (transformers only prints a reminder).

    - `max_prompt_length=None`: such prompts are a `ValueError` (their count, the first rows, the longest, the limit).
    - `max_prompt_length=P`: prompts longer than P are cut to their last P tokens at generation (`OR1Trainer`); the
      warning returned says how many (None if none). `P + completion_length` must fit the context.

    `context=None` (unknown): only `max_prompt_length` is checked.
    """
    limit = None if context is None else context - completion_length
    if max_prompt_length is not None:
        if limit is not None and max_prompt_length > limit:
            raise ValueError(f"max_prompt_length={max_prompt_length} + max_completion_length={completion_length} "
                             f"exceed {context_source} ({context} tokens); set max_prompt_length <= {limit}.")
        long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
        if not long:
            return None
        return (f"{len(long)} of {len(lengths)} prompts of {dataset_name} are longer than max_prompt_length="
                f"{max_prompt_length} tokens ({_row_list(long)}; longest {max(lengths)}): generation sees only their "
                "last max_prompt_length tokens (the start of the problem is cut off).")
    if limit is None:
        return None
    long = [i for i, n in enumerate(lengths) if n > limit]
    if long:
        raise ValueError(
            f"{len(long)} of {len(lengths)} prompts of {dataset_name} are longer than {limit} tokens ({_row_list(long)}; "
            f"longest {max(lengths)}), the room {context_source} ({context} tokens) leaves after max_completion_length="
            f"{completion_length}. Drop them (`dataset.filter`), set max_prompt_length={limit} (OR1Config) to keep their last "
            f"{limit} tokens, or lower max_completion_length."
        )
    return None


def check_prompts_fit(train_dataset, eval_dataset, tokenize, text_config, completion_length: int,
                      max_prompt_length: int | None, vllm_max_model_length: int | None, strict: bool, warn,
                      is_vlm: bool = False, tokenised_elsewhere: bool = False) -> None:
    """`check_prompt_lengths` over the train and eval datasets (each of a dict of eval datasets) that are
    `datasets.Dataset`s with a `prompt` column, measured with `tokenize` (`prompt_lengths`; `OR1Trainer` passes TRL's
    own tokenisation). The context is `vllm_max_model_length` where set, else `text_config.max_position_embeddings`.
    Each warning goes to `warn(message)` as it is found; with `strict=False` (a plain `GRPOConfig`, which has no
    truncation to offer) the errors are warnings too.

    Not measured: a vision-language model (`is_vlm`: it would process every image; `max_prompt_length` is an error
    there, it would cut image tokens), or prompts tokenised elsewhere (a rollout function, environments).
    """
    from datasets import Dataset

    if is_vlm:
        if max_prompt_length is not None:
            raise ValueError("max_prompt_length cuts token ids, which would cut image tokens too: it supports "
                             "text-only models; unset it.")
        return
    if tokenised_elsewhere:
        return
    context = getattr(text_config, "max_position_embeddings", None)
    source = "the model's max_position_embeddings"
    if vllm_max_model_length:
        context, source = vllm_max_model_length, "vllm_max_model_length"
    datasets = {"train_dataset": train_dataset}
    evals = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    datasets.update({"eval_dataset" if k is None else f"eval_dataset[{k!r}]": v for k, v in evals.items()})
    for name, dataset in datasets.items():
        if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
            continue
        lengths = prompt_lengths(dataset["prompt"], tokenize)
        try:
            message = check_prompt_lengths(lengths, context, completion_length, max_prompt_length, name, source)
        except ValueError as exc:
            if strict:
                raise
            message = str(exc)
        if message:
            warn(message)


# Loading: a Hub id, a local folder or a local data file
# ---------------------------------------------------------------------------------------------------------------

#: `datasets` builders of local data files, by extension (`load_dataset` infers none from a single file's path).
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _is_local(path: str) -> bool:
    return "://" not in path and not any(c in path for c in "*?[")


def _data_source(name: str | None, data_files) -> tuple[str, Any]:
    """`(path, data_files)` for `datasets.load_dataset`, or a `ValueError` saying what is missing or unreadable."""
    import os

    files = [data_files] if isinstance(data_files, str) else list(data_files or [])
    if files and name is not None and name not in set(FILE_BUILDERS.values()) | {"text", "arrow"}:
        return name, files  # paths inside a folder or a Hub repository: `load_dataset` resolves them
    if files:
        for file in filter(_is_local, files):
            if not os.path.isfile(os.path.expanduser(file)):
                raise ValueError(f"data file {file!r} does not exist")
            if os.path.getsize(os.path.expanduser(file)) == 0:
                raise ValueError(f"data file {file!r} is empty")
        if name is None:
            name = FILE_BUILDERS.get(os.path.splitext(files[0])[1].lower())
            if name is None:
                raise ValueError(f"cannot tell the format of {files[0]!r}: name it with --dataset_name json, parquet "
                                 "or csv")
        return name, [os.path.expanduser(f) if _is_local(f) else f for f in files]
    if name is None:
        raise ValueError("no dataset: pass --dataset_name (a Hub id, a local folder or a .jsonl/.json/.parquet/.csv "
                         "file)")
    path = os.path.expanduser(name)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if suffix not in FILE_BUILDERS:
            raise ValueError(f"dataset file {name!r} is not {', '.join(FILE_BUILDERS)}; convert it, or name its "
                             "format: --dataset_name json --data_files FILE")
        if os.path.getsize(path) == 0:
            raise ValueError(f"dataset file {name!r} is empty")
        return FILE_BUILDERS[suffix], [path]
    if os.path.isdir(path):
        return path, None
    if suffix in FILE_BUILDERS or name.startswith(("/", "./", "../", "~")):
        raise ValueError(f"dataset {name!r} does not exist (resolved to {os.path.abspath(path)!r})")
    return name, None


def _load_failure(exc: BaseException) -> str:
    """What went wrong inside `datasets.load_dataset`, in words (its `DatasetGenerationError` says only "An error
    occurred while generating the dataset": the reason is the exception it was raised from)."""
    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
        if len(chain) > 20:
            break
    if any(isinstance(error, UnicodeDecodeError) for error in chain):
        return "not UTF-8 text (" + str(next(e for e in chain if isinstance(e, UnicodeDecodeError))) + ")"
    error = chain[1] if type(exc).__name__ == "DatasetGenerationError" and len(chain) > 1 else exc
    message = str(error)
    if "corresponds to no data" in message:
        return "no rows"
    if "Couldn't reach" in message:
        why = "HF_HUB_OFFLINE is set" if "OfflineModeIsEnabled" in message else "no network"
        return (f"it is not in the local cache and the Hub cannot be reached ({why}); load it once online, or pass a "
                "local .jsonl/.json/.parquet/.csv file or folder")
    return message or type(error).__name__


def load_data(name: str | None, config: str | None = None, split: str | None = "train", data_files=None):
    """`datasets.load_dataset` for what `--dataset_name` names: a Hub id, a local folder, a local `.jsonl` /
    `.json` / `.parquet` / `.csv` file, or (TRL's form) a builder with files, `name="json", data_files=[...]`
    (`name=None` with `data_files`: the builder their extension names). `split=None`: the first split.

    Everything that can be wrong with the source is a one-line `ValueError` naming it: a missing or empty file, text
    that is not UTF-8 or not JSON, a Hub dataset offline and not cached, a dataset without rows."""
    from datasets import load_dataset

    path, files = _data_source(name, data_files)
    shown = name if name is not None else ", ".join(files)
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_logger.level
    json_logger.setLevel(logging.CRITICAL)  # it logs "Failed to load JSON ..." before raising: our error says it
    try:
        loaded = load_dataset(path, config, split=split, data_files=files)
    except Exception as exc:  # the source's fault, or datasets' own errors (DatasetGenerationError: see its cause)
        ours = isinstance(exc, (ValueError, OSError, StopIteration, ImportError))
        if not ours and type(exc).__module__.split(".")[0] not in ("datasets", "pyarrow"):
            raise
        raise ValueError(f"cannot load dataset {shown!r}: {_load_failure(exc)}") from exc
    finally:
        json_logger.setLevel(level)
    dataset = loaded[next(iter(loaded))] if split is None else loaded
    try:  # Arrow's JSON reader keeps bytes that are not UTF-8 in string columns; they would fail at first use
        dataset.data.table.validate(full=True)
    except Exception as exc:  # pyarrow.ArrowInvalid
        raise ValueError(f"cannot load dataset {shown!r}: not UTF-8 text ({exc})") from exc
    if len(dataset) == 0:
        raise ValueError(f"dataset {shown!r} has no rows (split {split!r})")
    return dataset


def save_split(dataset, output_dir: str, split: str) -> str:
    """Write `dataset` as `<output_dir>/data/<split>-00000-of-00001.parquet` — what `datasets.load_dataset(output_dir,
    split=split)` reads, several splits side by side — under a temporary name first, so an interrupted write leaves
    no half-written file. Returns the path."""
    import os

    path = os.path.join(output_dir, "data", f"{split}-00000-of-00001.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    dataset.to_parquet(tmp)
    os.replace(tmp, path)
    return path
