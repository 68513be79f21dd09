"""The arithmetic ladder (`or1_trl/demos/ladder.py`): its rungs' answers against plain arithmetic, the split's
sizes and disjointness, the prompts' shape, reproducibility, one-line refusals."""

import re

import pytest

from or1_trl.demos.ladder import INSTRUCTION, RUNGS, SYSTEM, ladder_split
from or1_trl.rewards import math_reward


def operands(row):
    return tuple(map(int, row["prompt_id"].split("-")[1:]))


PLAIN = {"add1": lambda a, b: a + b, "sub1": lambda a, b: a, "mul1": lambda a, b: a * b, "add21": lambda a, b: a + b,
         "add2": lambda a, b: a + b, "apples": lambda a, b: a + b}


def test_every_rungs_answer_is_the_plain_arithmetic_of_its_question():
    train, held_out = ladder_split(train=40, held_out=24)
    for row in [*train, *held_out]:
        a, b = operands(row)
        question = row["prompt"][-1]["content"]
        assert row["answer"] == str(PLAIN[row["rung"]](a, b))
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        if row["rung"] == "sub1":  # "What is c - b?": c - b is the answer
            assert numbers[0] - numbers[1] == int(row["answer"])
        elif row["rung"] == "mul1":
            assert numbers[0] * numbers[1] == int(row["answer"])
        else:
            assert sum(numbers) == int(row["answer"])
        assert question.endswith(INSTRUCTION)
        assert row["prompt"][0] == {"role": "system", "content": SYSTEM} and row["prompt"][1]["role"] == "user"
    assert math_reward(completions=[[{"role": "assistant", "content": "8"}]], answer=["8"]) == [1.0]


def test_the_split_is_disjoint_sized_per_rung_and_reproducible():
    train, held_out = ladder_split(train=40, held_out=24, seed=3)
    for name, rung in RUNGS.items():
        held = [r["prompt_id"] for r in held_out if r["rung"] == name]
        trained = [r["prompt_id"] for r in train if r["rung"] == name]
        assert len(held) == len(set(held)) == 24
        assert len(trained) == len(set(trained)) == min(40, len(rung.pairs()) - 24)
        assert not set(held) & set(trained)
    again = ladder_split(train=40, held_out=24, seed=3)
    assert again[0]["prompt_id"] == train["prompt_id"] and again[1]["prompt_id"] == held_out["prompt_id"]
    assert ladder_split(train=40, held_out=24, seed=4)[1]["prompt_id"] != held_out["prompt_id"]
    assert held_out["rung"] == sorted(held_out["rung"], key=list(RUNGS).index)  # held-out rows in rung order


def test_rungs_and_the_system_turn_can_be_chosen():
    train, held_out = ladder_split(train=5, held_out=2, rungs=["mul1"], system=None)
    assert set(train["rung"]) == set(held_out["rung"]) == {"mul1"} and len(train) == 5
    assert [m["role"] for m in train[0]["prompt"]] == ["user"]


@pytest.mark.parametrize("kwargs, message", [
    ({"rungs": ["add3"]}, "unknown rung"), ({"held_out": 0}, "held_out"), ({"train": -1}, "train"),
    ({"held_out": 64, "rungs": ["mul1"]}, "has 64 pairs"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ladder_split(**kwargs)
