"""The paper's released data format (`Skywork/Skywork-OR1-RL-Data`), the offline difficulty filter, one verifier per
row, and bad input reported with counts before anything is loaded."""

import json
import math
import os
import re

import pytest
from datasets import Dataset, load_dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.cli import main
from or1_trl.data.released import (
    SKYWORK_IMPORT_PROMPT,
    InvalidRow,
    code_tests,
    filter_by_difficulty,
    math_golds,
    training_dataset,
)
from or1_trl.rewards import CodeReward, mixed_rewards
from or1_trl.rewards.sandbox import SandboxUnavailable
from or1_trl.testing import save_tiny_model, tiny_model_and_tokenizer, tiny_training_args
from tests.helpers import released_features, released_row, write_released_dataset

from ..helpers import ROOT

TINY_RECIPE = os.path.join(ROOT, "examples", "recipes",
                           "tiny_cpu.yaml")

# Code tests in the three layouts the released reward dispatches on (null keys as the released JSON carries them).
STDIO = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"], "fn_name": None, "import_prefix": None}
CALL = {"inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6"], "outputs": ["[0, 1]", "[1, 2]"], "fn_name": "twoSum"}
LEETCODE = {"import_prefix": "from typing import *\n", "entry_point": "Solution().total", "inputs": None,
            "test_code": "def check(candidate):\n    assert candidate(nums=[1, 2]) == 3\n\n"
                         "    assert candidate(nums=[5]) == 5\n"}

# (question, golds, 7B count) and (question, tests, 7B count): the filter keeps 1..15 and drops rows without a count.
MATH = [("What is 2+3?", ["5"], 0), ("What is 7*6?", ["42"], 1), ("Half of 9?", ["4.5", "\\frac{9}{2}"], 8),
        ("What is 2^10?", ["1024"], 15), ("What is 1+1?", ["2"], 16), ("What is 3-1?", ["2"], None)]
CODE = [("Print a+b.", STDIO, 4), ("Two sum.", CALL, 12), ("Sum the list.", LEETCODE, None)]


def released_rows(math_rows=MATH, code_rows=CODE):
    math_part = [released_row(q, golds, "math", i, "NuminaMath", {"7B": d, "1.5B": 3}) for i, (q, golds, d) in
                 enumerate(math_rows)]
    code_part = [released_row(q, tests, "code", i, "LeetCode", {"7B": d, "32B": 9}) for i, (q, tests, d) in
                 enumerate(code_rows)]
    return math_part, code_part


@pytest.fixture
def released(tmp_path):
    """A local dataset in the released layout, read as the Hub one is: splits `math` and `code`."""
    return write_released_dataset(tmp_path / "Skywork-OR1-RL-Data", *released_rows())


def test_fixture_has_the_released_schema_and_splits(released):
    both = load_dataset(released, split="math+code")
    assert both.features == released_features() and len(both) == len(MATH) + len(CODE)
    assert load_dataset(released, split="code+code+math")["ability"] == ["code"] * 6 + ["math"] * 6
    row = both[len(MATH) + 1]
    assert json.loads(row["reward_model"]["ground_truth"]) == CALL
    assert row["extra_info"]["model_difficulty"] == {"DeepSeek-R1-Distill-Qwen-1.5B": None,
                                                     "DeepSeek-R1-Distill-Qwen-32B": 9, "DeepSeek-R1-Distill-Qwen-7B": 12}


@pytest.mark.parametrize("ground_truth,golds", [
    ('["5"]', ["5"]), ('["4.5", "\\\\frac{9}{2}"]', ["4.5", "\\frac{9}{2}"]), ('"5"', ["5"]), ("5", ["5"]),
    ("x^2 + 1", ["x^2 + 1"]), ("[1, 2]", ["1", "2"]),
])
def test_math_ground_truth_to_golds(ground_truth, golds):
    assert math_golds(ground_truth) == golds


@pytest.mark.parametrize("ground_truth", ["[]", '["", " "]', "", None])
def test_math_ground_truth_without_an_answer(ground_truth):
    with pytest.raises(InvalidRow) as exc:
        math_golds(ground_truth)
    assert exc.value.reason == "no gold answer"


def test_code_ground_truth_to_our_spec():
    """Each released layout maps to our CodeReward spec as the released reward runs it: null keys dropped; the
    LeetCode layout is one test per line of test_code after its header line, each calling check(entry_point)."""
    assert code_tests(json.dumps(STDIO)) == {"inputs": STDIO["inputs"], "outputs": STDIO["outputs"]}
    assert code_tests(json.dumps(CALL)) == CALL
    assert code_tests(json.dumps(LEETCODE)) == {
        "asserts": ["def check(candidate):    assert candidate(nums=[1, 2]) == 3\ncheck(Solution().total)",
                    "def check(candidate):    assert candidate(nums=[5]) == 5\ncheck(Solution().total)"],
        "import_prefix": "from typing import *\n"}
    assert code_tests('{"assert_case": ["assert f(1) == 2"], "inputs": null}') == {
        "asserts": ["assert f(1) == 2"], "import_prefix": SKYWORK_IMPORT_PROMPT}


@pytest.mark.parametrize("ground_truth,reason", [
    ("not json", "malformed test JSON"), ('["a list"]', "malformed test JSON"),
    ('{"inputs": ["1"], "outputs": []}', "malformed test JSON"), ('{"fn_name": null}', "malformed test JSON"),
    ('{"import_prefix": "", "test_code": "def check(candidate):", "entry_point": "f"}', "malformed test JSON"),
    ('{"question_id": "abc123"}', "unsupported tests"),
])
def test_bad_code_ground_truth(ground_truth, reason):
    with pytest.raises(InvalidRow) as exc:
        code_tests(ground_truth)
    assert exc.value.reason == reason


def block(code):
    return f"<think>...</think>\n```python\n{code}\n```"


def test_mapped_tests_score_right_and_wrong_code_as_the_released_reward(sandbox_missing):
    """Through the real sandbox: a correct program passes every mapped layout, a wrong one fails it."""
    reward = CodeReward(timeout_per_test=5, num_workers=2, min_isolation="bwrap")
    try:
        reward.sandbox
    except SandboxUnavailable as exc:
        sandbox_missing(str(exc))
    right = [block("a, b = map(int, input().split())\nprint(a + b)"),
             block("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                   "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                   "                return [seen[target - x], i]\n            seen[x] = i"),
             block("class Solution:\n    def total(self, nums: List[int]) -> int:\n        return sum(nums)")]
    wrong = [block("a, b = map(int, input().split())\nprint(a - b)"),
             block("def twoSum(nums, target):\n    return [0, 1]"),
             block("class Solution:\n    def total(self, nums):\n        return nums[0]")]
    specs = [json.dumps(code_tests(json.dumps(t))) for t in (STDIO, CALL, LEETCODE)]
    assert reward(right + wrong, specs + specs) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_difficulty_filter_keeps_1_to_15_of_16_as_the_released_script(released):
    dataset = load_dataset(released, split="math+code")
    kept, counts = filter_by_difficulty(dataset, "7B", 1, 15)
    assert counts == {"kept": 5, "no_count": 2, "below": 1, "above": 1}
    assert [p[0]["content"] for p in kept["prompt"]] == ["What is 7*6?", "Half of 9?", "What is 2^10?", "Print a+b.",
                                                         "Two sum."]
    assert filter_by_difficulty(dataset, "7B", 8, 12)[1] == {"kept": 2, "no_count": 2, "below": 3, "above": 2}
    assert filter_by_difficulty(dataset, "DeepSeek-R1-Distill-Qwen-32B", 9, 9)[1]["kept"] == 3  # full key, code only
    with pytest.raises(ValueError, match=r"no row has a model_difficulty count for 'Qwen3-8B'.*"
                                         r"'DeepSeek-R1-Distill-Qwen-1.5B', 'DeepSeek-R1-Distill-Qwen-32B', 'De"):
        filter_by_difficulty(dataset, "Qwen3-8B", 1, 15)


def test_training_dataset_from_the_released_format(released):
    dataset, abilities, report = training_dataset(load_dataset(released, split="math+code"), difficulty_model="7B",
                                                  difficulty_range=(1, 15))
    assert abilities == ["math", "code"] and "reward_model" not in dataset.column_names
    assert dataset["answer"] == [["42"], ["4.5", "\\frac{9}{2}"], ["1024"], None, None]
    assert [json.loads(t) if t else None for t in dataset["tests"]] == [None] * 3 + [code_tests(STDIO),
                                                                                     code_tests(CALL)]
    assert report == ["9 rows in the released (verl) format",
                      "difficulty filter DeepSeek-R1-Distill-Qwen-7B in [1, 15]: kept 5 of 9 (2 without a count, "
                      "1 below, 1 above)",
                      "training on 5 rows: 3 math, 2 code"]


def test_bad_rows_are_counted_before_training(released):
    rows = released_rows()[0][:2] + [
        released_row("No answer", [], "math"), released_row("Empty answer", [""], "math"),
        released_row("Broken tests", {"inputs": ["1"], "outputs": []}, "code"),
        released_row("Chemistry", ["H2O"], "chemistry")]
    rows[-2]["reward_model"]["ground_truth"] = '{"inputs": ["1"'  # not JSON
    dataset = Dataset.from_list(rows, features=released_features())
    with pytest.raises(ValueError) as exc:
        training_dataset(dataset)
    message = str(exc.value)
    assert message.startswith("4 of 6 rows cannot be scored: 2 no gold answer (rows 2, 3; first: no gold answer "
                              "(ground_truth '[]')); 1 malformed test JSON (row 4; first: malformed test JSON")
    assert "1 unknown ability (row 5; first: unknown ability ('chemistry'; known: math, code))" in message
    assert message.endswith("pass --drop_invalid_rows to train without them.")
    kept, _, report = training_dataset(dataset, drop_invalid=True)
    assert len(kept) == 2 and report[1].startswith("dropped 4 rows that cannot be scored: 2 no gold answer")


def test_unknown_data_source_without_an_ability_column():
    rows = [released_row("q", ["1"], data_source=source) for source in ("openai/gsm8k", "mystery", "mystery")]
    dataset = Dataset.from_list(rows, features=released_features()).remove_columns("ability")
    with pytest.raises(ValueError, match=r"^2 of 3 rows cannot be scored: 2 unknown data_source \(rows 1, 2; first: "
                                         r"unknown data_source \('mystery' and no 'ability' column"):
        training_dataset(dataset)
    kept, abilities, _ = training_dataset(dataset, drop_invalid=True)
    assert abilities == ["math"] and kept["ability"] == ["math"]  # verl's own dispatch knows openai/gsm8k


def test_empty_result_says_what_removed_the_rows(released):
    with pytest.raises(ValueError, match=r"^no rows left to train on: 9 rows in the released \(verl\) format; "
                                         r"difficulty filter DeepSeek-R1-Distill-Qwen-7B in \[13, 14\]: kept 0 of 9 "
                                         r"\(2 without a count, 5 below, 2 above\)$"):
        training_dataset(load_dataset(released, split="math+code"), difficulty_model="7B", difficulty_range=(13, 14))


def test_plain_columns_are_checked_too():
    plain = Dataset.from_dict({"question": ["a", "b", "c"], "solution": ["1", "", None]})
    with pytest.raises(ValueError, match=r"^2 of 3 rows cannot be scored: 2 no gold answer \(rows 1, 2; "):
        training_dataset(plain, prompt_column="question", answer_column="solution")
    code = Dataset.from_dict({"prompt": ["a", "b"], "tests": [json.dumps(code_tests(STDIO)), '{"inputs": [1]}']})
    with pytest.raises(ValueError, match=r"1 malformed test JSON \(row 1; first: malformed test JSON \(inputs and "):
        training_dataset(code, reward="code")
    with pytest.raises(ValueError, match=r"^has no column 'answer'"):
        training_dataset(code)


def test_reward_math_on_mixed_data_is_an_error(released):
    with pytest.raises(ValueError, match=r"^3 rows are not math \(rows 6, 7, 8\) but --reward math scores math only"):
        training_dataset(load_dataset(released, split="math+code"), reward="math")


def test_cli_reports_bad_rows_before_loading_the_model(capsys, tmp_path):
    rows = released_rows()
    rows[1][0]["reward_model"]["ground_truth"] = "{broken"
    data = write_released_dataset(tmp_path / "data", *rows)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model_name_or_path", str(tmp_path / "model-never-loaded-is-a-dir"), "--dataset_name", data,
              "--dataset_train_split", "math+code", "--use_cpu", "true", "--bf16", "false"])
    assert exc.value.code == 2
    assert "model path" in capsys.readouterr().err  # the model path is checked first
    (tmp_path / "model-never-loaded-is-a-dir").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model_name_or_path", str(tmp_path / "model-never-loaded-is-a-dir"), "--dataset_name", data,
              "--dataset_train_split", "math+code", "--use_cpu", "true", "--bf16", "false"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"dataset {data!r} 1 of 9 rows cannot be scored: 1 malformed test JSON (row 6;" in err
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model_name_or_path", str(tmp_path / "model-never-loaded-is-a-dir"), "--dataset_name", data,
              "--difficulty_range", "15", "1", "--difficulty_model", "7B", "--use_cpu", "true", "--bf16", "false"])
    assert exc.value.code == 2 and "--difficulty_range takes LOW HIGH with LOW <= HIGH, got 15 1" in capsys.readouterr().err


def test_mixed_rewards_score_each_row_with_its_own_verifier(sandbox_missing):
    math_reward, code_reward = mixed_rewards()
    try:
        code_reward.reward.sandbox
    except SandboxUnavailable as exc:
        sandbox_missing(str(exc))
    logged = {}
    completions = ["The answer is \\boxed{5}.", block("a, b = map(int, input().split())\nprint(a + b)"),
                   "The answer is \\boxed{6}.", block("print(0)")]
    columns = dict(ability=["math", "code", "math", "code"], answer=[["5"], None, ["5"], None],
                   tests=[None, json.dumps(code_tests(STDIO))] * 2, prompts=["p0", "p1", "p2", "p3"],
                   log_extra=lambda column, values: logged.setdefault(column, values))
    assert math_reward(completions=completions, **columns) == [1.0, None, 0.0, None]
    assert code_reward(completions=completions, **columns) == [None, 1.0, None, 0.0]
    assert logged == {"math_reward_status": ["string_match", None, "wrong", None],
                      "code_reward_status": [None, "pass", None, "wrong"]}
    assert math_reward.required_columns == ("answer", "ability") and code_reward.required_columns == ("tests", "ability")


def test_or1_trainer_trains_on_the_released_format_with_both_verifiers(released, tmp_path):
    """No reward given: each row gets its verifier; one step over math and code rows. TRL's table of the step holds
    each function's reward on its own rows only (NaN, i.e. None, on the others)."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    dataset = load_dataset(released, split="math+code")
    args = OR1Config(**tiny_training_args(tmp_path, max_steps=1, per_device_train_batch_size=12, num_generations=4))
    trainer = OR1Trainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)
    assert [r.__name__ for r in trainer.reward_funcs] == ["math_reward", "code_reward"]
    trainer.train()
    prompts = [p[-1]["content"] for p in trainer._logs["prompt"]]
    code_questions = {q for q, _, _ in CODE}
    is_code = [p in code_questions for p in prompts]
    assert 0 < sum(is_code) < len(prompts)  # the batch mixes both abilities
    for code_row, m, c in zip(is_code, trainer._logs["rewards"]["math_reward"], trainer._logs["rewards"]["code_reward"]):
        assert math.isnan(m) == code_row and math.isnan(c) != code_row
    statuses = trainer._logs["extra"]
    assert [s is None for s in statuses["math_reward_status"]] == is_code
    assert [s is None for s in statuses["code_reward_status"]] == [not c for c in is_code]
    assert all(s == "no_code" for s in statuses["code_reward_status"] if s is not None)


def test_or1_trainer_rejects_a_released_dataset_with_bad_rows_before_loading(tmp_path):
    rows = released_rows()[0]
    rows[0]["reward_model"]["ground_truth"] = "[]"
    with pytest.raises(ValueError, match=re.escape("dataset in the released (verl) format: 1 of 6 rows cannot be "
                                                   "scored: 1 no gold answer (row 0;")):
        OR1Trainer(str(tmp_path / "not-a-model"), args=OR1Config(**tiny_training_args(tmp_path)),
                   train_dataset=Dataset.from_list(rows, features=released_features()))


def test_train_cli_on_the_released_format_with_the_difficulty_filter(tmp_path, released, capsys):
    """`or1-trl train --dataset_name <released> --dataset_train_split math+code --difficulty_model 7B
    --difficulty_range 1 15`: the recipes' command, offline, two steps."""
    model = save_tiny_model(tmp_path / "model")
    main(["train", "--config", TINY_RECIPE, "--reward", "auto", "--model_name_or_path", model,
          "--dataset_name", released, "--dataset_train_split", "math+code", "--difficulty_model", "7B",
          "--difficulty_range", "1", "15", "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
          "--per_device_train_batch_size", "8", "--num_generations", "4"])
    out = capsys.readouterr().out
    assert "difficulty filter DeepSeek-R1-Distill-Qwen-7B in [1, 15]: kept 5 of 9 (2 without a count, 1 below, " \
           "1 above)\ntraining on 5 rows: 3 math, 2 code" in out
    records = [json.loads(line) for line in (tmp_path / "out" / "prompt_stats.jsonl").read_text().splitlines()]
    assert len(records) == 2 and (tmp_path / "out" / "model.safetensors").exists()


def test_released_math_row_with_a_test_object_is_a_wrong_gold_type():
    """A math row whose ground_truth is a JSON object (code tests filed as math) is counted as a wrong gold type,
    not kept as a string gold that never matches."""
    rows = released_rows()[0][:3]
    rows[1]["reward_model"]["ground_truth"] = json.dumps(STDIO)
    dataset = Dataset.from_list(rows, features=released_features())
    with pytest.raises(ValueError, match=re.escape("1 of 3 rows cannot be scored: 1 wrong gold type (row 1; first: "
                                                   "wrong gold type (ground_truth '{\"inputs\"")):
        training_dataset(dataset)
    kept, _, report = training_dataset(dataset, drop_invalid=True)
    assert kept["answer"] == [["5"], ["4.5", "\\frac{9}{2}"]] and report[1].startswith("dropped 1 rows")
