"""Rejection sampling, Skywork-OR1 §3.1 (DESIGN §3).

    T~_k = { i : some A_ij != 0 }      — keep only the groups whose rewards are not all equal

A group whose M rewards are all equal has zero advantage everywhere: it adds nothing to the policy gradient, but
its tokens would still count in the normaliser T_k and in the entropy term, inflating the relative weight of the
entropy loss. Such groups leave the update entirely.

Two ways to drop them (`OR1Config.rejection_sampling`):

- `"mask"` (Skywork's released code): the rows stay in the batch with weight 0;
- `"compact"` (ours, default): the rows are removed before the policy forward/backward, so they cost nothing.
  Every rank must still run the same number of forward/backward calls (DDP/ZeRO/FSDP synchronise inside
  backward), so the kept rows are padded with zero-weight rows to a multiple of the number of micro-steps —
  every micro-step gets at least one row, and a rank left with nothing runs a zero-weight step.

Both give the same gradient; `compact` runs fewer rows. `reject` runs the whole rejection step, refill rounds
included (DAPO's dynamic sampling: `more()` generates another rollout batch). Everything here is a function of
tensors and batch dicts, testable without a trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

WEIGHT_KEY = "or1_weight"  # per-row weight in the batch dict: 1.0 kept, 0.0 rejected / padding
KEPT_ROWS_KEY = "or1_kept_rows"  # rows with at least one trainable token, over all ranks (batch-level scalar)
KEPT_GROUP_ROWS_KEY = "or1_kept_group_rows"  # rows of kept groups, over all ranks (with rejection; batch-level scalar)


@dataclass
class GroupOutcomes:
    """Per-group verdicts for one generation batch (all ranks). Tensors are `[num_groups]` bools."""

    keep: torch.Tensor  # informative: rewards not all equal
    solve_none: torch.Tensor  # all rewards equal and ≤ 0 (every sample failed)
    solve_all: torch.Tensor  # all rewards equal and ≥ 1 (every sample solved it)

    @property
    def num_groups(self) -> int:
        return self.keep.numel()

    def fractions(self) -> dict[str, float]:
        n = max(self.num_groups, 1)
        return {
            "kept_group_frac": self.keep.sum().item() / n,
            "solve_none_frac": self.solve_none.sum().item() / n,
            "solve_all_frac": self.solve_all.sum().item() / n,
        }


def group_outcomes(rewards: torch.Tensor, group_size: int) -> GroupOutcomes:
    """Classify the groups of a flat reward vector.

    Args:
        rewards: `[B*G]` scalar rewards, groups contiguous (TRL's order). NaN (unscorable) entries are ignored;
            a group with fewer than two scored samples is uninformative.
        group_size: G, samples per prompt.
    """
    grouped = rewards.detach().float().view(-1, group_size)  # [B, G]
    scored = ~torch.isnan(grouped)
    hi = torch.where(scored, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)  # [B]
    lo = torch.where(scored, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)  # [B]
    informative = (scored.sum(dim=1) >= 2) & (hi > lo)
    constant = ~informative & (scored.sum(dim=1) > 0)
    return GroupOutcomes(keep=informative, solve_none=constant & (hi <= 0), solve_all=constant & (lo >= 1))


def _select(value: Any, index: torch.Tensor, num_rows: int, key: str) -> Any:
    if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return value  # scalars (e.g. num_items_in_batch) are batch-level
    if len(value) != num_rows:
        raise ValueError(
            f"Cannot compact batch entry {key!r}: its first dimension ({len(value)}) is not the number of rows "
            f"({num_rows}). Multimodal inputs (images are indexed per image, not per row) are not supported by "
            "rejection_sampling='compact'; use rejection_sampling='mask'."
        )
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    return [value[i] for i in index.tolist()]


def compact_batch(batch: dict[str, Any], keep_rows: torch.Tensor, multiple_of: int) -> dict[str, Any]:
    """Keep the rows of `batch` where `keep_rows`, padded with zero-weight rows to a multiple of `multiple_of`.

    The result has `max(multiple_of, ceil(kept / multiple_of) * multiple_of)` rows, so that TRL's equal split into
    `multiple_of` micro-steps drops nothing and gives every micro-step at least one row. Padding rows are copies
    of rejected rows where there are any (of row 0 otherwise) and carry `WEIGHT_KEY` = 0.

    Args:
        batch: TRL's per-rank generation batch (`completion_ids` `[b, T]` etc.).
        keep_rows: `[b]` bool.
        multiple_of: the number of micro-steps the batch will be split into (`steps_per_generation`).
    """
    num_rows = len(batch["completion_ids"])
    kept = keep_rows.nonzero(as_tuple=True)[0].cpu()  # [k]
    target = max(multiple_of, -(-kept.numel() // multiple_of) * multiple_of)
    donors = (~keep_rows).nonzero(as_tuple=True)[0].cpu()
    if donors.numel() == 0:
        donors = torch.zeros(1, dtype=torch.long)
    pad = donors[torch.arange(target - kept.numel()) % donors.numel()]  # [target - k]
    index = torch.cat([kept, pad])
    out = {key: _select(value, index, num_rows, key) for key, value in batch.items()}
    weight = torch.zeros(target, device=batch["completion_ids"].device)
    weight[: kept.numel()] = 1.0
    out[WEIGHT_KEY] = weight
    return out


def mask_batch(batch: dict[str, Any], keep_rows: torch.Tensor) -> dict[str, Any]:
    """Keep every row; rejected rows get `WEIGHT_KEY` = 0 (Skywork's released behaviour)."""
    return {**batch, WEIGHT_KEY: keep_rows.to(batch["completion_ids"].device, torch.float32)}


# Per-token batch entries and how a shorter one is padded when two rollout batches are joined (refill).
_LEFT_PADDED = ("prompt_ids", "prompt_mask")  # TRL left-pads prompts
_RIGHT_PADDED = (
    "completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps",
    "importance_sampling_ratio", "tool_mask",
)
_PER_ROW = ("advantages",)


def concat_batches(first: dict[str, Any], second: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """Join two of TRL's rollout batches row-wise (refill rounds): prompts left-padded, completions right-padded to
    the longer of the two. Batch-level scalars (`num_items_in_batch`) are left to the caller to recount."""
    out = {}
    # first's order: TRL sizes the batch by its first entry
    for key in [*first, *(k for k in second if k not in first)]:
        a, b = first.get(key), second.get(key)
        if a is None or b is None or (isinstance(a, torch.Tensor) and a.ndim == 0):
            out[key] = a if b is None or (isinstance(a, torch.Tensor) and a.ndim == 0) else b
            continue
        if key in _PER_ROW:
            out[key] = torch.cat([a, b])
        elif key in _LEFT_PADDED or key in _RIGHT_PADDED:
            width = max(a.size(1), b.size(1))
            value = pad_token_id if key in ("prompt_ids", "completion_ids") else 0
            left = key in _LEFT_PADDED

            def pad(t):
                extra = torch.full((t.size(0), width - t.size(1)), value, dtype=t.dtype, device=t.device)
                return torch.cat([extra, t] if left else [t, extra], dim=1)

            out[key] = torch.cat([pad(a), pad(b)])
        else:
            raise ValueError(
                f"Cannot join rollout batches with entry {key!r} (multimodal inputs): rejection_refill_rounds "
                "supports text-only batches."
            )
    return out


def cap_kept_groups(keep: torch.Tensor, max_groups: int) -> torch.Tensor:
    """`keep` with only its first `max_groups` True entries left True (rows beyond the batch are discarded)."""
    return keep & (keep.cumsum(0) <= max_groups)


def local_rows(keep_groups: torch.Tensor, num_generations: int, rank: int, num_local: int) -> torch.Tensor:
    """`[b]` rank `rank`'s rows of the groups `keep_groups` (`[B]` over all ranks; TRL's layout: each rank holds
    `num_local` consecutive rows of the groups, G consecutive rows per group)."""
    start = rank * num_local
    return keep_groups.repeat_interleave(num_generations)[start : start + num_local]


def loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """`[b, T]` weight of each completion token: padding, tool output and rejected rows are 0."""
    mask = inputs["completion_mask"].float()
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    if WEIGHT_KEY in inputs:
        mask = mask * inputs[WEIGHT_KEY].unsqueeze(1)
    return mask


def count_kept(batch: dict[str, Any], gather: Callable) -> torch.Tensor:
    """Over all ranks (`gather`: the all-gather), into `batch` (scalars): T_k, every trainable token of the kept
    groups (`num_items_in_batch`, eq. 3.1's normaliser); the rows holding one (`KEPT_ROWS_KEY`: the 80/20 "selected"
    normaliser weighs micro-steps by their share of these); with rejection the kept groups' rows
    (`KEPT_GROUP_ROWS_KEY`: what the row-mean loss types count, `loss.Normaliser`). Returns T_k."""
    mask = loss_mask(batch)  # [b, T]
    weight = batch.get(WEIGHT_KEY, torch.ones_like(mask[:, 0]))  # [b]
    local = torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().float(), weight.sum()])  # [3]
    kept_tokens, kept_rows, group_rows = gather(local).view(-1, 3).sum(dim=0)
    batch["num_items_in_batch"], batch[KEPT_ROWS_KEY] = kept_tokens, kept_rows
    if WEIGHT_KEY in batch:
        batch[KEPT_GROUP_ROWS_KEY] = group_rows
    return kept_tokens


@dataclass
class Rejection:
    """What `reject` did to one rollout: the batch to train on, the first rollout's group verdicts, and the metrics."""

    batch: dict[str, Any]
    outcomes: GroupOutcomes
    metrics: dict[str, float] = field(default_factory=dict)


def reject(batch: dict[str, Any], rewards: torch.Tensor, num_generations: int, mode: str, rank: int,
           steps_per_generation: int, pad_token_id: int, refill_rounds: int = 0,
           more: Callable[[], tuple[dict[str, Any], torch.Tensor]] | None = None) -> Rejection:
    """Rejection sampling of one rollout (T~_k), with DAPO's dynamic-sampling refill.

    Groups whose rewards are all equal leave the batch. While fewer than the batch's number of groups are kept and
    fewer than `refill_rounds` refills ran, `more()` generates another rollout batch (all ranks in lockstep) and
    returns this rank's part of it and its `[B*G]` rewards over all ranks; its informative groups fill the batch up
    (the first ones, up to the batch's size) and the rest of it is discarded. Then the rejected rows are removed
    (`mode="compact"`, padded for `steps_per_generation` micro-steps) or weighted 0 (`mode="mask"`).

    Args:
        batch: this rank's rollout batch (TRL's `_generate_and_score_completions` output).
        rewards: `[B*G]` scalar rewards over all ranks, groups contiguous.
        rank: this rank's index (its rows are the `rank`-th slice of the batch's rows over all ranks).

    Returns:
        a `Rejection`; its metrics: `rejection/{kept_group,solve_none,solve_all}_frac` of the first rollout and, with
        `refill_rounds`, `refill/rounds`, `refill/generated_rows` and `refill/batch_fill`.
    """
    num_local = len(batch["completion_ids"])
    outcomes = group_outcomes(rewards, num_generations)
    metrics = {f"rejection/{name}": value for name, value in outcomes.fractions().items()}
    keep, num_groups = outcomes.keep, outcomes.num_groups  # [B] over all ranks
    keep_rows = local_rows(keep, num_generations, rank, num_local)  # [b]
    rounds = 0
    while rounds < refill_rounds and int(keep.sum()) < num_groups:
        rounds += 1
        extra, extra_rewards = more()
        extra_keep = cap_kept_groups(group_outcomes(extra_rewards, num_generations).keep, num_groups - int(keep.sum()))
        batch = concat_batches(batch, extra, pad_token_id)
        keep = torch.cat([keep, extra_keep])
        keep_rows = torch.cat([keep_rows, local_rows(extra_keep, num_generations, rank, num_local)])
    if refill_rounds:
        metrics["refill/rounds"] = float(rounds)
        metrics["refill/generated_rows"] = float(rounds * num_groups * num_generations)
        metrics["refill/batch_fill"] = int(keep.sum()) / num_groups
    if mode == "compact":
        batch = compact_batch(batch, keep_rows.to(batch["completion_ids"].device), steps_per_generation)
    else:
        batch = mask_batch(batch, keep_rows)
    return Rejection(batch, outcomes, metrics)
