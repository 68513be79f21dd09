"""No silent nonsense: gold answers of the wrong type, empty datasets and over-long prompts stop the run before the
first step (Python API and CLI; over-long prompts in a trainer: `tests/trainer/test_inputs.py`). A non-finite reward:
`tests/trainer/test_reward_checks.py`; a run whose steps are all skipped: `tests/trainer/test_observability.py`."""

import re

import numpy as np
import pytest
from datasets import Dataset
from trl import GRPOConfig

from or1_trl import OR1Config, OR1Trainer
from or1_trl.data.preflight import check_prompt_lengths
from or1_trl.data.released import InvalidRow, check_math_gold, math_golds, training_dataset
from or1_trl.rewards import MathReward
from or1_trl.testing import tiny_tokenizer, tiny_training_args


NO_MODEL = "/nonexistent/model"  # the pre-flight fails before this is loaded


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


@pytest.fixture
def args(tmp_path):
    return OR1Config(**tiny_training_args(tmp_path))


# --- gold answers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer,golds", [
    ("5", ("5",)), (5, ("5",)), (4.5, ("4.5",)), (["5", "\\frac{10}{2}"], ("5", "\\frac{10}{2}")), ([1, None, 2], ("1", "2")),
    (np.array(["7", "8"]), ("7", "8")),
])
def test_math_golds_of_the_accepted_types(answer, golds):
    assert check_math_gold(answer) == golds


@pytest.mark.parametrize("answer,reason,detail", [
    ({"ground_truth": '["5"]', "style": "rule"}, "wrong gold type", "a dict: "),
    (True, "wrong gold type", "a bool: 'True'"),
    ([{"value": "5"}], "wrong gold type", "a list holding a dict: "),
    ([["5"]], "wrong gold type", "a list holding a list: "),
    (None, "no gold answer", ""), (["", "  "], "no gold answer", ""),
])
def test_math_golds_of_other_types_are_invalid(answer, reason, detail):
    with pytest.raises(InvalidRow) as exc:
        check_math_gold(answer)
    assert exc.value.reason == reason and exc.value.detail.startswith(detail)


def test_released_math_ground_truth_holding_an_object_is_a_wrong_type():
    with pytest.raises(InvalidRow) as exc:
        math_golds('{"inputs": ["1"], "outputs": ["2"]}')
    assert exc.value.reason == "wrong gold type"
    assert exc.value.detail.startswith("ground_truth '{\"inputs\"") and "a dict: " in exc.value.detail


def test_dict_golds_fail_the_python_api_before_the_model_loads(args):
    """The issue's case: an `answer` column of structs (here a whole reward_model struct) passed to OR1Trainer. Every
    bad row is counted, the first ones named, the column and the reward too."""
    answers = [{"ground_truth": str(i), "style": "rule"} for i in range(7)]
    data = Dataset.from_dict({"prompt": [f"Q{i}" for i in range(7)], "answer": answers})
    with pytest.raises(ValueError) as exc:
        OR1Trainer(NO_MODEL, MathReward(num_workers=0), args=args, train_dataset=data)
    message = str(exc.value)
    assert message.startswith("train_dataset column 'answer' (read by 'math_reward'): 7 of 7 rows cannot be scored: "
                              "7 wrong gold type (rows 0, 1, 2, 3, 4, …; first: wrong gold type (a dict: ")
    assert "pass the dataset with its reward_model column as it is" in message

    # Lists of structs, and rows without an answer: counted per reason, in the eval dataset too.
    mixed = Dataset.from_dict({"prompt": ["a", "b", "c", "d", "e"],
                               "answer": [[{"v": "1"}], None, [{"v": "2"}], [], [{"v": "3"}]]})
    good = Dataset.from_dict({"prompt": ["a"], "answer": ["1"]})
    with pytest.raises(ValueError, match=re.escape(
            "eval_dataset column 'answer' (read by 'math_reward'): 5 of 5 rows cannot be scored: 3 wrong gold type "
            "(rows 0, 2, 4; first: wrong gold type (a list holding a dict: ")) as exc:
        OR1Trainer(NO_MODEL, MathReward(num_workers=0), args=args, train_dataset=good, eval_dataset=mixed)
    assert "; 2 no gold answer (rows 1, 3; first: no gold answer)." in str(exc.value)


def test_dict_golds_fail_the_cli_data_path():
    data = Dataset.from_dict({"question": ["a", "b", "c"], "solution": [{"v": "1"}, {"v": "2"}, {"v": "3"}]})
    with pytest.raises(ValueError, match=r"^3 of 3 rows cannot be scored: 3 wrong gold type \(rows 0, 1, 2; first: "
                                         r"wrong gold type \(a dict: "):
        training_dataset(data, prompt_column="question", answer_column="solution")


# --- empty datasets -------------------------------------------------------------------------------------------------


def test_empty_datasets_fail_before_the_model_loads(args):
    empty = Dataset.from_dict({"prompt": [], "answer": []})
    with pytest.raises(ValueError, match=r"^train_dataset has no rows: training would run 0 steps"):
        OR1Trainer(NO_MODEL, MathReward(num_workers=0), args=args, train_dataset=empty)
    one = Dataset.from_dict({"prompt": ["q"], "answer": ["1"]})
    with pytest.raises(ValueError, match=r"^eval_dataset\['hard'\] has no rows"):
        OR1Trainer(NO_MODEL, MathReward(num_workers=0), args=args, train_dataset=one,
                   eval_dataset={"easy": one, "hard": empty})
    with pytest.raises(ValueError, match=r"^train_dataset has no rows"):  # TRL's own config too
        OR1Trainer(NO_MODEL, parity_reward, args=GRPOConfig(**tiny_training_args(args.output_dir)),
                   train_dataset=Dataset.from_dict({"prompt": []}))


# --- prompt lengths -------------------------------------------------------------------------------------------------


def test_prompt_length_rule():
    lengths = [10, 60, 59, 58, 100]
    with pytest.raises(ValueError, match=re.escape("3 of 5 prompts of train_dataset are longer than 58 tokens "
                                                   "(rows 1, 2, 4; longest 100), the room the context (64 tokens)")):
        check_prompt_lengths(lengths, context=64, completion_length=6)
    assert check_prompt_lengths(lengths, context=None, completion_length=6) is None
    assert check_prompt_lengths([58, 3], context=64, completion_length=6) is None
    assert check_prompt_lengths(lengths, 64, 6, max_prompt_length=58).startswith(
        "3 of 5 prompts of train_dataset are longer than max_prompt_length=58 tokens (rows 1, 2, 4; longest 100)")
    assert check_prompt_lengths(lengths, None, 6, max_prompt_length=100) is None
    with pytest.raises(ValueError, match=r"max_prompt_length=58 \+ max_completion_length=7 exceed the context \(64 "):
        check_prompt_lengths(lengths, 64, 7, max_prompt_length=58)


# --- non-finite rewards ---------------------------------------------------------------------------------------------


def test_string_prompts_against_a_chat_template_are_named_before_training():
    """TRL sends a string prompt as raw text: with a tokenizer that has a chat template, say so and offer the fix; a
    conversation, a tokenizer without a template, or a prompt that already holds the template's user turn is fine."""
    from or1_trl.data.preflight import plain_prompts_problem

    tokenizer = tiny_tokenizer()
    problem = plain_prompts_problem(Dataset.from_dict({"prompt": ["Q: 1+1=? A:"]}), tokenizer)
    assert problem.startswith("The prompts are plain strings (the first: 'Q: 1+1=? A:') and the tokenizer has a chat "
                              "template: TRL sends a string prompt as raw text")
    assert "`or1-trl train --chat_prompts true`" in problem and "[{'role': 'user', 'content': prompt}]" in problem
    conversation = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Q: 1+1=? A:"}]]})
    rendered = Dataset.from_dict({"prompt": ["<|im_start|>user\nQ: 1+1=? A:<|im_end|>\n<|im_start|>assistant\n"]})
    assert plain_prompts_problem(conversation, tokenizer) is None and plain_prompts_problem(rendered, tokenizer) is None
    tokenizer.chat_template = None  # a base model's tokenizer: raw text is its input
    assert plain_prompts_problem(Dataset.from_dict({"prompt": ["Q: 1+1=? A:"]}), tokenizer) is None
