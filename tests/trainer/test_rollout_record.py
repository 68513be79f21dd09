"""The rollout's record (`trainer/rollout_record.py`): the rewards rejection judges."""

import torch

from or1_trl.recipe.advantages import leave_group_statistics
from or1_trl.recipe.rejection import group_outcomes
from or1_trl.trainer.rollout_record import scalar_rewards

G = 4


def test_rejection_under_before_judges_the_non_truncated_rewards():
    """A group [1, 1, 1, 0 (truncated)]: informative with the truncated row counted, all-equal without it."""
    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.0], [1.0], [0.0], [1.0], [0.0]])  # [8, 1], two groups
    truncated = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1])
    weights = torch.ones(1)
    kept = group_outcomes(scalar_rewards(rewards, weights), G).keep.tolist()
    kept_before = group_outcomes(scalar_rewards(leave_group_statistics(rewards, truncated), weights), G).keep.tolist()
    assert kept == [True, True] and kept_before == [False, True]
