"""The MAGIC objective (Skywork-OR1 eq. 3.1) on top of TRL's loss types. Pure functions; the trainer wires them.

    L(θ) = −(1/T_k) Σ_{i∈T~_k} Σ_j Σ_t [ min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A) + α_k H_ij^t(θ) ]
    ρ    = π_θ(a_t|s_t) / π_k(a_t|s_t)

TRL's `GRPOTrainer._compute_loss` computes the policy term per token (PPO-clip, or the per-token loss of another
`loss_type`, plus β·KL, the off-policy mask, GSPO's sequence ratio) and aggregates it with its loss type's
normaliser. The trainer runs it on the kept tokens only; this module holds what OR1 adds around it:

- the normaliser counts only the kept groups (T~_k): for `"dapo"` that is T_k (the trainer recounts
  `num_items_in_batch` over kept tokens); for the loss types that average over rows (`"grpo"`, `"dr_grpo"`, ...)
  the rows of the kept groups, which `Normaliser.trl_factor` rescales TRL's row count to;
- the entropy term α·H over every kept token, aggregated exactly like the policy term (`Normaliser.__call__`):
  eq. 3.1 puts both inside one sum, so with `loss_type="dapo"` it is α Σ H / T_k, with `"grpo"` a per-sequence
  mean, and so on.

Shapes: b rows (prompt × sample) in the micro-batch, T completion positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# TRL 1.16's loss types by what their normaliser counts (trl/trainer/grpo_trainer.py, `_compute_loss`).
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")  # every loss token of the generation batch, over all ranks (T_k)
ROW_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")  # a mean over the micro-batch's rows
TOKEN_MEAN_LOSSES = ("bnpo",)  # the loss tokens of the micro-batch
LOSS_TYPES = TOKEN_SUM_LOSSES + ROW_MEAN_LOSSES + TOKEN_MEAN_LOSSES


def share(total: torch.Tensor | float, num_processes: int, accumulation: float, steps_per_generation: float):
    """One micro-step's share of a count over the generation batch of all ranks (TRL's "dapo" rescaling): DDP
    averages over ranks and the `steps_per_generation` micro-steps of one rollout add up (`accumulation` per step)."""
    return total / num_processes * accumulation / steps_per_generation


def selected_normaliser(mask: torch.Tensor, high_entropy: torch.Tensor, kept_rows, reduce: Callable,
                        num_processes: int, accumulation: float, steps_per_generation: float) -> tuple:
    """The 80/20 rule's "selected" normaliser (the official code's) for `magic_loss`: the selected tokens of the kept
    ones, `mask` · `high_entropy` (`[b, T]`, TRL's own mask of the policy pass), instead of T_k; summed over ranks by
    `reduce`, with the rows holding a kept token and the kept rows' share (`kept_rows`, default: those rows)."""
    chosen = mask * high_entropy
    local = torch.stack([chosen.sum(), (mask.sum(dim=1) > 0).sum().float()]).detach()  # [2]
    chosen, with_tokens = reduce(local)
    kept = with_tokens if kept_rows is None else kept_rows
    return chosen, with_tokens, share(kept, num_processes, accumulation, steps_per_generation)


@dataclass
class Normaliser:
    """How one micro-step aggregates per-token values `[b, T]` into its share of the step's loss, for `loss_type`,
    counting only the kept groups.

    Attributes:
        loss_type: TRL's `loss_type`.
        tokens: T_k's share for this micro-step (`share(num_items_in_batch, ...)`; TRL's "dapo" normaliser).
        rows: the kept rows' share for this micro-step (`share(kept group rows, ...)`), or `num_rows × accumulation`
            (TRL's row mean, every row counts) when nothing was rejected.
        accumulation: gradient-accumulation steps of the optimizer step (1 in evaluation).
        max_completion_length: L_max of `"dr_grpo"`'s normaliser.
        num_rows: rows of the micro-batch (rejected and padding rows included).
    """

    loss_type: str
    tokens: torch.Tensor | float
    rows: torch.Tensor | float
    accumulation: float
    max_completion_length: int
    num_rows: int

    @classmethod
    def for_micro_step(cls, loss_type: str, num_items: torch.Tensor, kept_group_rows: torch.Tensor | None,
                       num_rows: int, num_processes: int, accumulation: float, steps_per_generation: float,
                       max_completion_length: int):
        """From the step's counts over all ranks: `num_items` kept tokens (T_k), `kept_group_rows` rows of kept groups
        (`None`: nothing was rejected, every row counts as in TRL). Empty counts are clamped to 1 (the loss is 0)."""
        tokens = share(num_items.clamp(min=1.0), num_processes, accumulation, steps_per_generation)
        if kept_group_rows is None:
            rows = num_rows * accumulation
        else:
            rows = share(kept_group_rows.clamp(min=1.0), num_processes, accumulation, steps_per_generation)
        return cls(loss_type, tokens, rows, accumulation, max_completion_length, num_rows)

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Σ over the micro-batch of `per_token` `[b, T]` on the tokens `mask` `[b, T]`, normalised as `loss_type`
        normalises its policy loss (with the kept-row count); a scalar whose sum over micro-steps and mean over ranks
        is the step's aggregate."""
        masked = per_token * mask  # [b, T]
        if self.loss_type in TOKEN_SUM_LOSSES:
            return masked.sum() / self.tokens
        if self.loss_type in TOKEN_MEAN_LOSSES:
            return masked.sum() / mask.sum().clamp(min=1.0) / self.accumulation
        if self.loss_type in ("grpo", "sapo"):
            per_row = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)  # [b] sequence means
        elif self.loss_type == "dr_grpo":
            per_row = masked.sum(-1) / self.max_completion_length  # [b]
        elif self.loss_type == "luspo":
            per_row = masked.sum(-1)  # [b] sequence sums
        else:
            raise ValueError(f"Unknown loss_type={self.loss_type!r}; TRL 1.16's are {list(LOSS_TYPES)}.")
        return per_row.sum() / self.rows

    def trl_factor(self) -> torch.Tensor | float:
        """The factor turning TRL's policy loss of this micro-batch (each of its `num_rows` rows counting in its row
        mean, rejected and padding rows included) into the mean over the kept rows; 1 for the token-normalised types
        (their normaliser already counts only kept tokens) and when nothing was rejected."""
        if self.loss_type in ROW_MEAN_LOSSES:
            return self.num_rows * self.accumulation / self.rows
        return 1.0

    def per_micro_batch(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` as TRL logs `policy_loss`: per micro-step for the token-sum types, per micro-batch mean otherwise."""
        return loss if self.loss_type in TOKEN_SUM_LOSSES else loss * self.accumulation


def selected_tokens_normaliser(selected: torch.Tensor, rows: torch.Tensor, kept_rows_share: torch.Tensor):
    """The 80/20 rule's `"selected"` normaliser of the policy term: the mean over the `selected` high-entropy tokens
    of the micro-batch (all ranks), weighted by the micro-batch's share of the step's kept rows — equal weights when
    micro-batches hold equal kept rows (the official code's average over micro-batches); a micro-batch of padding rows
    weighs 0 instead of diluting the others.

    Args:
        selected: selected tokens of the micro-batch over all ranks; rows: its rows with a kept token over all ranks;
        kept_rows_share: `share(rows with a kept token in the step, ...)`.
    """
    return selected.clamp(min=1.0) * kept_rows_share / rows.clamp(min=1.0)


def sampled_token_entropy(logps: torch.Tensor) -> torch.Tensor:
    """The released code's entropy estimate per token: −log π(a_t|s_t) of the sampled token, `[B, T]`."""
    return -logps


@dataclass
class MagicLoss:
    """One micro-step's eq. 3.1 (`magic_loss`).

    Attributes:
        loss: what backward runs on: the policy term over the kept groups, TRL's auxiliary loss, − α·H.
        policy_loss: the policy term alone, detached, as TRL logs `policy_loss` (`Normaliser.per_micro_batch`).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor


def magic_loss(trl_loss: torch.Tensor, aux_loss: torch.Tensor | float, entropies: torch.Tensor, mask: torch.Tensor,
               norm: Normaliser, alpha: float, selected: tuple | None = None) -> MagicLoss:
    """Eq. 3.1 for one micro-step from TRL's loss of it: OR1's normalisers and entropy term around TRL's policy term.

    Args:
        trl_loss: TRL's `_compute_loss` on the kept tokens (its policy term, with `aux_loss` added; its own entropy
            bonus off).
        aux_loss: the auxiliary (MoE router) loss TRL added, as it added it (0.0 without).
        entropies: `[b, T]` per-token entropies H of the policy pass.
        mask: `[b, T]` kept tokens (`rejection.loss_mask`).
        norm: the micro-step's `Normaliser` (kept groups only).
        alpha: α_k, the entropy coefficient (`AdaptiveEntropyController.coefficient`).
        selected: for the 80/20 rule's `"selected"` normaliser, `(selected tokens, rows with a kept token)` of the
            micro-batch over all ranks and the micro-step's `share` of the step's rows with a kept token
            (`selected_tokens_normaliser`); `None`: the loss type's own normaliser over the kept groups.

    The policy term is rescaled from TRL's row count to the kept groups' (`Normaliser.trl_factor`), or from T_k to
    the selected tokens; α·H is aggregated like the policy term (`Normaliser.__call__`) and left out at α = 0 (the
    controller's usual state), so that no entropy gradient is computed then.
    """
    scale = norm.trl_factor() if selected is None else norm.tokens / selected_tokens_normaliser(*selected)
    policy_loss = (trl_loss - aux_loss) * scale
    loss = policy_loss + aux_loss
    if alpha != 0.0:
        loss = loss - alpha * norm(entropies, mask)  # α·H over every kept token, normalised like the policy term
    return MagicLoss(loss, norm.per_micro_batch(policy_loss.detach()))
