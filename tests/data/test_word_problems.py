"""The word-problem family (`or1_trl/data/word_problems.py`, issue 50): rows, the split, and how a completion is
judged, against hand-worked examples."""

import pytest

from or1_trl.data.word_problems import (ANSWER_TAG, INSTRUCTION, TEMPLATES, WORKED_SOLUTION, answer_number_span,
                                        answer_offset, format_reward, reasons_before_answer, tagged_answer,
                                        tagged_answer_reward, word_problem_split)


def test_rows_state_the_problem_and_its_hand_worked_answer():
    bags_eat = TEMPLATES["bags_eat"].row(3, 4, 5)  # 3 bags of 4, 5 given away: 12 - 5 = 7
    assert bags_eat["answer"] == "7" and bags_eat["rung"] == "bags_eat" and bags_eat["prompt_id"] == "bags_eat-3-4-5"
    question = bags_eat["prompt"][-1]["content"]
    assert "buys 3 bags with 4" in question and "gives 5 of them away" in question and question.endswith(INSTRUCTION)
    assert [turn["role"] for turn in bags_eat["prompt"]] == ["system", "user", "assistant", "user"]  # worked example
    assert bags_eat["prompt"][2]["content"] == WORKED_SOLUTION
    assert TEMPLATES["two_friends"].row(5, 2, 0)["answer"] == "12"  # 5 and 5 + 2: 12 together
    assert TEMPLATES["buy_give"].row(4, 3, 2)["answer"] == "5" and TEMPLATES["give"].row(9, 4, 0)["answer"] == "5"
    bare = TEMPLATES["buy"].row(6, 3, 0, worked_example=False, system=None)
    assert bare["answer"] == "9" and [turn["role"] for turn in bare["prompt"]] == ["user"]
    assert TEMPLATES["buy"].row(6, 3, 0) == TEMPLATES["buy"].row(6, 3, 0)  # the same row in every split
    for template in TEMPLATES.values():  # no count below zero, no empty rung, the steps a solution takes
        triples = template.triples()
        assert triples and all(template.answer(*t) >= 0 for t in triples), template.name
        assert template.steps in (1, 2)
    assert {t.steps for t in TEMPLATES.values()} == {1, 2}


def test_the_split_keeps_held_out_problems_out_of_training():
    train, held_out = word_problem_split(train=10, held_out=5, seed=3)
    assert len(held_out) == 5 * len(TEMPLATES) and len(train) == 10 * len(TEMPLATES)
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])
    assert len(set(train["prompt_id"])) == len(train)
    assert held_out["rung"] == [name for name in TEMPLATES for _ in range(5)]  # rung order
    again_train, again_held_out = word_problem_split(train=10, held_out=5, seed=3)
    assert again_train["prompt_id"] == train["prompt_id"] and again_held_out["prompt_id"] == held_out["prompt_id"]
    with pytest.raises(ValueError, match="unknown rung"):
        word_problem_split(rungs=["buy", "fly"])
    with pytest.raises(ValueError, match="leaves none to train on"):
        word_problem_split(held_out=10_000)


def test_a_completion_is_judged_by_its_tagged_answer_and_the_steps_before_it():
    worked = "3 bags of 4 pens: 3 × 4 = 12. Then 12 - 5 = 7.\nAnswer: 7"
    assert tagged_answer(worked) == "7" and reasons_before_answer(worked)
    assert answer_offset(worked) == worked.index(ANSWER_TAG)
    assert tagged_answer("Answer: 3\nWait, no.\nAnswer: 7") == "7"  # the last tag counts
    assert tagged_answer("The answer is 7.") is None and answer_offset("The answer is 7.") is None
    assert worked[slice(*answer_number_span(worked))] == "7"
    assert answer_number_span("Answer: 3\nWait.\nAnswer:  -12\n") == (25, 28)  # the last tag's number, its sign
    assert answer_number_span("The answer is 7.") is None and answer_number_span("Answer: seven") is None
    assert not reasons_before_answer("Answer: 7")  # tagged, but nothing worked out before it
    assert not reasons_before_answer("12 - 5 = 7, so 7.")  # worked, never tagged
    assert tagged_answer([{"role": "assistant", "content": "4 + 3 = 7\nAnswer: -7"}]) == "-7"  # a conversation
    completions = [worked, "Answer: 8", "7", "Answer:7.0"]
    assert tagged_answer_reward(completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 1.0]
