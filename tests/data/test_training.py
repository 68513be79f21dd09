"""What `or1-trl train` trains on (`or1_trl/data/training.py`): the dataset and its verifier rewards, or the prompt
column alone for reward functions without a verifier; string prompts as user turns. Through the command line:
tests/cli/test_commands.py (a missing column), tests/cli/test_console.py (`--chat_prompts`)."""

import json
import re

import pytest
from datasets import Dataset

from or1_trl.data.training import as_user_turns, training_data
from or1_trl.rewards import code_reward, math_reward

ROWS = [{"question": f"Q: {i}+1=? A:", "solution": str(i + 1), "ability": "math"} for i in range(3)]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


def test_verifier_rewards_come_with_the_converted_rows_and_what_was_kept(data_file):
    dataset, rewards, report = training_data(None, data_files=[data_file], prompt_column="question",
                                             answer_column="solution")
    assert rewards == [math_reward]
    assert list(dataset["prompt"]) == [row["question"] for row in ROWS]
    assert list(dataset["answer"]) == [row["solution"] for row in ROWS]
    assert report[-1] == "training on 3 rows: 3 math"
    with pytest.raises(ValueError, match=rf"^dataset {re.escape(repr(data_file))} has no column 'answer'"):
        training_data(None, data_files=data_file, prompt_column="question")  # a --config file's string


def test_without_a_verifier_only_the_prompt_column_is_kept_as_prompt(data_file):
    dataset, rewards, report = training_data(None, data_files=[data_file], reward=None, prompt_column="question")
    assert (rewards, report) == ([], [])
    assert dataset.column_names == ["prompt", "solution", "ability"]
    assert list(dataset["prompt"]) == [row["question"] for row in ROWS]
    with pytest.raises(ValueError, match=rf"^dataset {re.escape(repr(data_file))} has no column 'prompt' \(columns: "
                                         r"\['question', 'solution', 'ability'\]\); training generates from the "
                                         r"prompt in --prompt_column$"):
        training_data(None, data_files=[data_file], reward=None)


def test_a_code_dataset_gets_the_code_reward(tmp_path):
    path = tmp_path / "code.jsonl"
    tests = json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})
    path.write_text(json.dumps({"prompt": "Add one.", "tests": tests}) + "\n")
    dataset, rewards, _ = training_data(None, data_files=[str(path)], reward="code")
    assert rewards == [code_reward] and list(dataset["ability"]) == ["code"]


def test_string_prompts_become_one_user_turn_and_conversations_stay():
    plain = Dataset.from_dict({"prompt": ["Q: 1+1=? A:", "Q: 2+1=? A:"], "answer": ["2", "3"]})
    turns = as_user_turns(plain)
    assert turns["prompt"] == [[{"role": "user", "content": "Q: 1+1=? A:"}],
                               [{"role": "user", "content": "Q: 2+1=? A:"}]]
    assert turns["answer"] == ["2", "3"]
    assert as_user_turns(turns) is turns  # already conversations
    other = Dataset.from_dict({"question": ["Q: 1+1=? A:"]})
    assert as_user_turns(other) is other  # no prompt column: nothing to wrap
