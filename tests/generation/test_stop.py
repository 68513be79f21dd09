"""`generation/stop.py`, completions that end at a pattern (`OR1Config.stop_pattern`): the cut against a plain
token-by-token reference, the log-probs cut alike, the trainer's rollout (what the reward reads, what is truncated)
against the same seeded rollout uncut."""

import re

import pytest
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.data.word_problems import ANSWER_LINE
from or1_trl.generation.stop import StopAt
from or1_trl.testing import tiny_model_and_tokenizer, tiny_tokenizer, tiny_training_args
from or1_trl.trainer.rollout_record import row_facts

from ..helpers import tagged_dataset


def reference_end(decode, pattern: str, ids: list[int]) -> int | None:
    """The plain way: decode one more token at a time until the pattern is found."""
    for keep in range(1, len(ids) + 1):
        if re.search(pattern, decode(ids[:keep])):
            return keep
    return None


def test_a_completion_is_cut_after_the_token_that_completes_its_first_answer_line():
    tokenizer = tiny_tokenizer()
    decode = tokenizer.decode
    stop = StopAt(ANSWER_LINE, decode=decode)
    texts = ["so 3 + 4 = 7.\nAnswer: 7\nand then Answer: 8\nmore", "Answer: 12", "no tag at all\n", "Answer:\n"]
    rows = [tokenizer(text)["input_ids"] for text in texts]
    logprobs = [[-float(k) for k in range(len(ids))] for ids in rows]
    cut = stop.cut(rows, logprobs)
    for ids, lps, kept, kept_lps, stopped in zip(rows, logprobs, cut.completion_ids, cut.logprobs, cut.stopped):
        end = reference_end(decode, ANSWER_LINE, ids)
        assert stopped == (end is not None) and stop.stopped(kept) == stopped
        assert kept == (ids if end is None else ids[:end]) and kept_lps == (lps if end is None else lps[:end])
    assert decode(cut.completion_ids[0]).rstrip(" ") == "so 3 + 4 = 7.\nAnswer: 7\n"  # the first answer line only
    assert cut.stopped == [True, False, False, True]
    assert cut.completion_ids[1] is rows[1] and cut.logprobs[1] is logprobs[1]  # no match: left as it was
    again = stop.cut(cut.completion_ids, cut.logprobs)
    assert again.completion_ids == cut.completion_ids and again.stopped == cut.stopped  # idempotent
    assert stop.cut(rows, None).logprobs is None  # HF path: no generator log-probs
    for text, kept in zip(texts, cut.completion_ids):  # the text a judge reads of an uncut completion
        assert stop.text(text) == (decode(kept).rstrip(" ") if stop.matches(text) else text)


def test_bisection_finds_the_first_match_on_random_token_strings():
    tokenizer = tiny_tokenizer()
    generator = torch.Generator().manual_seed(0)
    for pattern in ("e", "th", r"\d", "[aeiou] [aeiou]"):
        stop = StopAt(pattern, decode=tokenizer.decode)
        for _ in range(30):
            ids = torch.randint(3, tokenizer.vocab_size, (int(torch.randint(1, 24, (1,), generator=generator)),),
                                generator=generator).tolist()
            assert stop.end(ids) == reference_end(tokenizer.decode, pattern, ids), (pattern, ids)


def test_a_stopped_completion_is_not_truncated():
    inputs = [{"i": 0}, {"i": 1}, {"i": 2}]
    ids = [[5, 6, 2], [5, 6, 7], [5, 6, 8]]  # 2 is EOS; the second was stopped, the third ran out of tokens
    facts = row_facts(inputs, ids, stop_ids={2}, index_column="i", stopped=[False, True, False])
    assert [truncated for _, truncated, _ in facts] == [False, False, True]
    assert row_facts(inputs, ids, stop_ids={2}, index_column="i") == [[0, False, 3], [1, True, 3], [2, True, 3]]


def test_stop_pattern_is_checked_before_training(tmp_path):
    with pytest.raises(ValueError, match="is not a regular expression"):
        OR1Config(**tiny_training_args(tmp_path, stop_pattern="Answer: ("))
    with pytest.raises(ValueError, match="matches the empty text"):
        OR1Config(**tiny_training_args(tmp_path, stop_pattern=r"\d*"))


class ReadsCompletions:
    """A reward that records what it is given: each completion's text and its ids."""

    __name__ = "reads"

    def __init__(self):
        self.texts, self.ids = [], []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.texts += completions
        self.ids += completion_ids
        return [float(i % 2) for i in range(len(completions))]


def _one_step(tmp_path, name, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    reward = ReadsCompletions()
    args = OR1Config(**tiny_training_args(tmp_path / name, rollout_seed=3, max_steps=1, logging_steps=1,
                                          max_completion_length=12, **overrides))
    trainer = OR1Trainer(model, reward, args=args, processing_class=tokenizer,
                         train_dataset=tagged_dataset(["MIX"] * 8))
    trainer.train()
    return trainer, reward, tokenizer


def test_the_trainer_rewards_and_trains_the_completions_up_to_the_pattern(tmp_path):
    """One seeded step with `stop_pattern` and the same step without: the same draws (one `rollout_seed`, the same
    starting weights); with it, what the reward reads is each uncut completion cut where the plain reference says,
    the lengths TRL logs are the cut ones, and the share stopped is logged."""
    pattern = "e"  # frequent in the tiny model's text: most completions stop, at different tokens
    plain_trainer, plain, tokenizer = _one_step(tmp_path, "plain")
    trainer, stopped_reward, _ = _one_step(tmp_path, "stopped", stop_pattern=pattern)
    decode = trainer.completion_stop.decode
    ends = [reference_end(decode, pattern, ids) for ids in plain.ids]
    assert stopped_reward.ids == [ids if end is None else ids[:end] for ids, end in zip(plain.ids, ends)]
    assert stopped_reward.texts == [decode(ids) for ids in stopped_reward.ids]
    stopped = [end is not None for end in ends]
    assert 0 < sum(stopped) < len(stopped)  # the test tells cut from uncut rows
    log = next(entry for entry in trainer.state.log_history if "completions/stopped_ratio" in entry)
    assert log["completions/stopped_ratio"] == pytest.approx(sum(stopped) / len(stopped))
    lengths = [len(ids) for ids in stopped_reward.ids]
    assert log["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert "completions/stopped_ratio" not in next(e for e in plain_trainer.state.log_history if "loss" in e)
