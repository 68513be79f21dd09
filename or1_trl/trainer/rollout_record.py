"""One rollout's side data: what `OR1Trainer`'s hooks learn about a generation batch and pass on to the next hook.

TRL's hooks run in this order for each generation batch: `_generate_and_score_completions` calls `_calculate_rewards`
(which sees the rewards of every function, over all ranks), returns the batch, which TRL splits into micro-steps,
each going through `training_step`. `_calculate_rewards` opens a `Rollout`; `_generate_and_score_completions` adds
the rejection verdicts and whether anything is trainable; `training_step` reads them on each micro-step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recipe.rejection import GroupOutcomes


@dataclass
class Rollout:
    """Side data of one rollout (one call of TRL's `_calculate_rewards`), over all ranks.

    Attributes:
        rewards: `[N]` each row's reward as TRL sums it (`scalar_rewards`).
        rows: `[N, 3]` per row: dataset index (-1 without a prompt pool), truncated, completion length (training
            only, else `None`).
        outcomes: the groups' rejection verdicts (with rejection sampling; `None` until known).
        skip_update: no trainable token on any rank: the optimizer step that consumes this rollout is skipped.
        group_rewards: `[N]` the rewards the group statistics and rejection see, when they differ from `rewards`
            (`truncated_advantage_mask="before"`: truncated rows NaN, `recipe/advantages.py`).
    """

    rewards: torch.Tensor
    rows: torch.Tensor | None = None
    outcomes: GroupOutcomes | None = None
    skip_update: bool = False
    group_rewards: torch.Tensor | None = None

    @property
    def judged_rewards(self) -> torch.Tensor:
        """`[N]` what rejection sampling judges the groups by: `group_rewards` if set, else `rewards`."""
        return self.rewards if self.group_rewards is None else self.group_rewards


def scalar_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[N]` reward of each row as TRL sums `rewards_per_func` `[N, F]` with `weights` `[F]` (NaN: every function
    abstained)."""
    rewards = (rewards_per_func * weights.to(rewards_per_func.device)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def row_facts(inputs: list[dict], completion_ids: list[list[int]], stop_ids: set[int], index_column: str,
              stopped: list[bool] | None = None) -> list:
    """Per local row: dataset index (`row[index_column]`, -1 without it), truncated (TRL's rule: the completion does
    not end with one of `stop_ids`, EOS or pad; and, with `stopped`, was not ended by `OR1Config.stop_pattern`),
    length."""
    stopped = stopped if stopped is not None else [False] * len(completion_ids)
    return [[row.get(index_column, -1), not ended and (not ids or ids[-1] not in stop_ids), len(ids)]
            for row, ids, ended in zip(inputs, completion_ids, stopped, strict=True)]
