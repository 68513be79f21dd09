"""The paper's advantage masks for truncated responses (§3.2.3, `truncated_advantage_mask`), their pure pieces: the
rows leaving the group statistics, the zeroed advantages, an unknown mask refused. In a training run, against a plain
reference of the paper's formulas: `tests/trainer/test_advantage_masks.py`."""

import pytest
import torch

from or1_trl import OR1Config
from or1_trl.recipe.advantages import leave_group_statistics, zero_truncated
from or1_trl.testing import tiny_training_args


def test_leave_group_statistics_and_zero_truncated():
    rewards_per_func = torch.tensor([[1.0, 0.5], [0.0, 0.5], [1.0, 1.0]])  # [N=3, F=2]
    truncated = torch.tensor([0, 1, 0])
    masked = leave_group_statistics(rewards_per_func, truncated)
    assert torch.isnan(masked[1]).all() and torch.equal(masked[[0, 2]], rewards_per_func[[0, 2]])
    assert not torch.isnan(rewards_per_func).any()  # a copy
    assert zero_truncated(torch.tensor([0.5, -1.0, 2.0]), truncated).tolist() == [0.5, 0.0, 2.0]


def test_unknown_mask_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="truncated_advantage_mask='sometimes' is not one of"):
        OR1Config(**tiny_training_args(tmp_path, truncated_advantage_mask="sometimes"))
