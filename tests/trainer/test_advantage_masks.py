"""The paper's advantage masks for truncated responses (§3.2.3, `truncated_advantage_mask`) in a training run whose
completions are truncated or not, against a plain reference of its two formulas: Adv-Mask Before (truncated responses
leave the group statistics, advantage 0) and Adv-Mask After (they stay in them, advantage 0); with rejection sampling.
The pure pieces (`recipe/advantages.py`): `tests/recipe/test_advantages.py`."""

import math

import pytest
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import parity_reward, tagged_dataset

G = 4
EPS = 1e-4  # TRL's: advantages = (r - mean) / (std + 1e-4)


def reference_advantages(rewards: list[float], truncated: list[bool], group_size: int, mask: str) -> list[float]:
    """Â of every row, group by group, as the paper writes it (sample std, as TRL's `nanstd`)."""
    out = []
    for start in range(0, len(rewards), group_size):
        r, cut = rewards[start : start + group_size], truncated[start : start + group_size]
        members = [i for i in range(group_size) if not (mask == "before" and cut[i])]  # who the statistics see
        mean = sum(r[i] for i in members) / len(members) if members else math.nan
        std = (math.sqrt(sum((r[i] - mean) ** 2 for i in members) / (len(members) - 1))
               if len(members) > 1 else math.nan)
        for i in range(group_size):
            a = (r[i] - mean) / (std + EPS)
            out.append(0.0 if (mask != "none" and cut[i]) or math.isnan(a) else a)
    return out


def eos_biased_args(tmp_path, **overrides):
    """The tiny model ends about half its 6-token completions (EOS biased up at generation): a mix of truncated rows."""
    return OR1Config(**tiny_training_args(tmp_path, generation_kwargs={"sequence_bias": [[[0], 4.0]]},
                                          learning_rate=1e-3, **overrides))


def finished_reward(completions, completion_ids, **kwargs):
    """The paper's regime: a truncated response (no EOS) scores 0; a finished one 1 or 2 (its length's parity)."""
    return [0.0 if not ids or ids[-1] != 0 else 1.0 + len(text) % 2 for text, ids in zip(completions, completion_ids)]


def run_capturing(args, reward=parity_reward):
    """Train; record each rollout's (all-rank rewards, truncated flags, TRL+mask advantages) as `_scored` returns them."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    trainer = OR1Trainer(model, reward, args=args, train_dataset=tagged_dataset(["MIX"] * 16),
                         processing_class=tokenizer)
    seen, scored = [], trainer._scored

    def capture(inputs):
        batch, rollout = scored(inputs)
        seen.append((rollout.rewards.tolist(), rollout.rows[:, 1].bool().tolist(), batch["advantages"].tolist()))
        return batch, rollout

    trainer._scored = capture
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, seen, before


@pytest.mark.parametrize("mask", ["none", "after", "before"])
def test_trainer_advantages_equal_the_papers_formulas(tmp_path, mask):
    trainer, seen, before = run_capturing(eos_biased_args(tmp_path, truncated_advantage_mask=mask, max_steps=3,
                                                          rejection_sampling="off"))
    truncated_rows = sum(sum(cut) for _, cut, _ in seen)
    assert 0 < truncated_rows < sum(len(cut) for _, cut, _ in seen)  # the premise: some rows truncated, not all
    for rewards, cut, advantages in seen:
        assert advantages == pytest.approx(reference_advantages(rewards, cut, G, mask), abs=1e-5)
        if mask != "none":
            assert all(a == 0.0 for a, c in zip(advantages, cut) if c)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_masks_differ_from_each_other_on_the_same_rollout(tmp_path):
    """The three masks give three different advantage vectors on a rollout with truncated and finished rows (the
    first rollout of each run is the same: same seed, same weights)."""
    firsts = {mask: run_capturing(eos_biased_args(tmp_path / mask, truncated_advantage_mask=mask, max_steps=1,
                                                  rejection_sampling="off"))[1][0] for mask in ("none", "after", "before")}
    assert firsts["none"][:2] == firsts["after"][:2] == firsts["before"][:2]  # same rewards, same truncation
    advantages = [tuple(round(a, 6) for a in firsts[mask][2]) for mask in ("none", "after", "before")]
    assert len(set(advantages)) == 3


def test_before_with_compaction_keeps_the_groups_the_reference_keeps(tmp_path):
    """Rejection under "before": a group is kept iff its non-truncated rewards differ (some reference Â != 0) — fewer
    groups than without the mask, where a truncated 0 among finished 2s makes the group informative."""
    trainer, seen, _ = run_capturing(eos_biased_args(tmp_path, truncated_advantage_mask="before", max_steps=3),
                                     finished_reward)
    kept = [entry["rejection/kept_group_frac"] for entry in trainer.state.log_history if "rejection/kept_group_frac" in entry]
    assert kept == pytest.approx([kept_fraction(rewards, cut, "before") for rewards, cut, _ in seen])
    # the premise: the mask rejects groups that would be kept without it
    assert sum(kept_fraction(r, c, "none") for r, c, _ in seen) > sum(kept)


def kept_fraction(rewards, truncated, mask) -> float:
    """Fraction of groups with some reference Â != 0 (rejection keeps exactly these)."""
    reference = reference_advantages(rewards, truncated, G, mask)
    groups = [reference[i : i + G] for i in range(0, len(reference), G)]
    return sum(any(abs(a) > 0 for a in group) for group in groups) / len(groups)
