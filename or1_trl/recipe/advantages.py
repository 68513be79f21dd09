"""The paper's advantage masks for truncated responses (Skywork-OR1 §3.2.3, Ablation Experiments 3).

A response cut off at the context limit scores 0 in Skywork's rewards, whatever it would have become. The report
ablates two ways of keeping that from pushing the policy:

- **Adv-Mask Before** (`"before"`): truncated responses leave the group's statistics — Â_ij = (r_ij − mean_j) / std_j
  with mean and std over the group's non-truncated responses only — and get advantage 0;
- **Adv-Mask After** (`"after"`): the group's statistics include them, as usual, then they get advantage 0;
- **no mask** (`"none"`, the paper's choice and this package's default): truncated responses keep their advantage.

Both masks reuse TRL's own advantage computation. TRL's group statistics are NaN-aware (`nanmean`, `nanstd`; a row
whose every reward function abstained is "unscorable": left out of its group's statistics, advantage 0), so "before"
marks the truncated rows' rewards NaN before TRL computes the advantages, and "after" zeroes the truncated rows'
advantages after it. Rejection sampling (`rejection.group_outcomes`) ignores NaN rewards too, so under "before" a group
whose non-truncated rewards are all equal is rejected: its kept responses have advantage 0.

The truncated responses' tokens stay in the batch: in T_k (eq. 3.1's normaliser) and in the entropy term. TRL's
`mask_truncated_completions=True` is a third, different mask: it removes truncated completions from the loss (their
tokens leave the completion mask, so T_k too) and leaves the rewards and the group statistics untouched, like "after"
for the advantages of the other responses.
"""

from __future__ import annotations

import torch

TRUNCATED_ADVANTAGE_MASKS = ("none", "before", "after")


def leave_group_statistics(rewards_per_func: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """"before": the truncated rows' rewards as NaN, so TRL's NaN-aware group statistics leave them out and their
    advantage is 0.

    Args:
        rewards_per_func: `[N, F]` every reward function's reward per row, all ranks (TRL's `_calculate_rewards`).
        truncated: `[N]` bool, the row's completion was cut off.
    Returns:
        `[N, F]`, a copy.
    """
    masked = rewards_per_func.clone()  # [N, F]
    masked[truncated.to(torch.bool)] = torch.nan
    return masked


def zero_truncated(advantages: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """"after" (and "before", where TRL has already zeroed them): advantage 0 for the truncated rows.

    Args:
        advantages: `[b]` this rank's advantages (TRL's batch).
        truncated: `[b]` bool, this rank's rows.
    Returns:
        `[b]`, a copy.
    """
    return advantages.masked_fill(truncated.to(device=advantages.device, dtype=torch.bool), 0.0)
