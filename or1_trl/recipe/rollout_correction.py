"""Rollout correction: how a completion sampled by vLLM is weighted when the trainer's log-probs of it differ from
the generator's (the train/inference mismatch), length-safe.

    r_t = π_trainer(y_t | y_<t) / π_vllm(y_t | y_<t)       per-token ratio (1 on padding; NaN log-probs count as 0)

`OR1Config.rollout_correction` (`c` = `rollout_correction_cap`):

The weight of token t of sequence i, by mode:

- `"off"`: 1, no correction toward the generator (the paper; Skywork's code recomputes the old log-probs with the
  trainer);
- `"token_truncate"`: min(r_t, c), per-token truncated importance sampling (TIS);
- `"geo_mask_token_truncate"`: min(r_t, c) if (Π_t r_t)^(1/n_i) ∈ [1/c, c], else 0: the sequence is kept iff the
  geometric mean of its ratios lies in [1/c, c] — independent of its length n_i — then per-token TIS;
- `"trl"`: TRL's `vllm_importance_sampling_*` as set (`trl_weights` mirrors them).

TRL's default (`sequence_mask`, clip_max 3): a sequence is kept iff exp(Σ_t log r_t) ∈ (0, 3]. The sum grows with
the length: a per-token gap of 7e-5 reaches ln 3 at 16K tokens, and zero-mean noise of spread σ gives the sum a
spread σ√n, so long completions leave the update more often the longer they are (`benchmarks/rollout_correction.py`).
The geometric mean's log is the mean log-ratio, whose spread shrinks as σ/√n.

Pure functions of `[B, T]` tensors (B rows, T completion positions, `mask` 1 on the tokens that count), testable
without a trainer; `RolloutCorrection` is the trainer's hook (`OR1Trainer._scored`): it replaces the batch's
`importance_sampling_ratio` that TRL computed, logs the diagnostics and warns once (`MismatchWatch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ROLLOUT_CORRECTIONS = ("off", "token_truncate", "geo_mask_token_truncate", "trl")
OUR_MODES = ("token_truncate", "geo_mask_token_truncate")  # computed here; TRL computes the log-probs they need
DEFAULT_ROLLOUT_CORRECTION = "geo_mask_token_truncate"
DEFAULT_CAP = 2.0
QUARTILES = 4
PREFIX = "rollout_correction"
TRL_RATIO_KEYS = tuple(f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max"))


def token_log_ratios(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` log r_t = log π_trainer − log π_vllm on the masked tokens, 0 elsewhere. A token the generator could not
    score (NaN) counts as 0 (ratio 1), as in TRL."""
    diff = (trainer_logps.float() - rollout_logps.float()) * mask  # [B, T]
    return torch.nan_to_num(diff, nan=0.0)


def geometric_keep(log_ratios: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """`[B, 1]` 1.0 where the geometric mean of the sequence's ratios lies in [1/cap, cap] (|mean log r_t| ≤ ln cap),
    else 0.0. A row without tokens is kept."""
    tokens = mask.float().sum(dim=1, keepdim=True)  # [B, 1]
    mean = log_ratios.sum(dim=1, keepdim=True) / tokens.clamp(min=1)  # [B, 1]
    return (mean.abs() <= math.log(cap)).float()


def correction_weights(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                       mode: str = DEFAULT_ROLLOUT_CORRECTION, cap: float = DEFAULT_CAP) -> torch.Tensor:
    """The weight of every token in the loss, `[B, T]`, for `mode` in `"off"`, `"token_truncate"`,
    `"geo_mask_token_truncate"` (the table in the module docstring; `"trl"`: `trl_weights`).

    Args:
        trainer_logps: `[B, T]` the trainer's log-probs of the sampled tokens (TRL's `old_per_token_logps`).
        rollout_logps: `[B, T]` the generator's (TRL's `sampling_per_token_logps`; NaN where it gave none).
        mask: `[B, T]` 1 on the completion tokens that count (TRL's `completion_mask · tool_mask`).
        cap: c > 1, the truncation cap and the geometric mask's bound [1/c, c].

    Returns:
        `[B, T]` float: 0 on every position of a masked sequence; padding of a kept one carries 1 (a zero log-ratio),
        as TRL's ratio does (its VESPO loss sums the log of the ratio over every position).
    """
    if mode == "off":
        return torch.ones_like(mask, dtype=torch.float32)
    if mode not in OUR_MODES:
        raise ValueError(f"correction_weights: mode={mode!r} is not one of {['off', *OUR_MODES]} ('trl': "
                         "trl_weights).")
    if not cap > 1.0:
        raise ValueError(f"correction_weights: cap={cap} must be > 1.")
    log_ratios = token_log_ratios(trainer_logps, rollout_logps, mask)  # [B, T]
    weights = torch.exp(log_ratios).clamp(max=cap)  # [B, T] per-token TIS
    if mode == "geo_mask_token_truncate":
        weights = weights * geometric_keep(log_ratios, mask, cap)  # [B, T] * [B, 1]
    return weights


def trl_weights(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                mode: str = "sequence_mask", clip_min: float | None = None,
                clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL 1.16's `importance_sampling_ratio` (`GRPOTrainer._generate_and_score_completions`), for the benchmark and
    the tests: `[B, 1]` for its `sequence_*` modes (one ratio exp(Σ_t log r_t) per sequence), `[B, T]` for `token_*`;
    `*_truncate` clamps to [clip_min, clip_max], `*_mask` sets a ratio outside them to 0. Defaults: TRL's."""
    log_ratios = token_log_ratios(trainer_logps, rollout_logps, mask)  # [B, T]
    if mode.startswith("sequence_"):
        log_ratios = log_ratios.sum(dim=-1, keepdim=True)  # [B, 1]
    ratio = torch.exp(log_ratios)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# --- Diagnostics -------------------------------------------------------------------------------------------------
ROW_STATS = ("tokens", "masked", "log_ratio_sum")


def row_stats(weights: torch.Tensor, log_ratios: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, 3]` per row (`ROW_STATS`): its tokens n_i, 1.0 if it has tokens and all of their weights are 0 (masked),
    and Σ_t log r_t. `weights` `[B, T]` or `[B, 1]` (TRL's sequence modes). Gather these over ranks, then
    `summarise`."""
    mask = mask.float()
    tokens = mask.sum(dim=1)  # [B]
    kept_mass = (weights.expand_as(mask).float() * mask).abs().sum(dim=1)  # [B]
    masked = ((tokens > 0) & (kept_mass == 0)).float()  # [B]
    return torch.stack([tokens, masked, (log_ratios * mask).sum(dim=1)], dim=1)


def summarise(rows: torch.Tensor) -> dict[str, float]:
    """The step's diagnostics from `row_stats` of every row (all ranks), `[N, 3]`.

    `rollout_correction/masked_frac`: the fraction of sequences (with tokens) whose weight is 0;
    `.../masked_frac_q1` … `_q4`: the same within each quarter of the rows sorted by completion length (q1 the
    shortest, q4 the longest; ties keep their order); `.../log_ratio`, `.../log_ratio_q1` … `_q4`: the mean per-token
    log-ratio log π_trainer − log π_vllm over the tokens of all rows / of each quarter. A quarter with no row (fewer
    than 4 rows) or no token logs NaN.
    """
    tokens, masked, log_sum = rows.float().unbind(dim=1)  # [N] each
    has_tokens = tokens > 0

    def fractions(index: torch.Tensor) -> tuple[float, float]:
        counted = has_tokens[index]
        frac = (masked[index].sum() / counted.sum()).item() if counted.any() else math.nan
        log_ratio = (log_sum[index].sum() / tokens[index].sum()).item() if tokens[index].sum() > 0 else math.nan
        return frac, log_ratio

    out = {}
    out[f"{PREFIX}/masked_frac"], out[f"{PREFIX}/log_ratio"] = fractions(torch.arange(len(tokens)))
    order = torch.sort(tokens, stable=True).indices  # [N] shortest first
    for q, index in enumerate(torch.tensor_split(order, QUARTILES), start=1):
        out[f"{PREFIX}/masked_frac_q{q}"], out[f"{PREFIX}/log_ratio_q{q}"] = fractions(index)
    return out


def ratio_summary(weights: torch.Tensor, mask: torch.Tensor, gather: Callable) -> dict[str, float]:
    """TRL's `sampling/importance_sampling_ratio/{min,mean,max}` for weights `[B, T]`, over the masked tokens of all
    ranks (`gather`: the all-gather), so that the keys TRL logs show the weights the loss uses."""
    values = weights.float()[mask.bool()]  # [K]
    local = torch.stack([values.min() if values.numel() else torch.tensor(math.inf, device=weights.device),
                         values.sum(), torch.tensor(float(values.numel()), device=weights.device),
                         values.max() if values.numel() else torch.tensor(-math.inf, device=weights.device)])
    low, total, count, high = gather(local.to(weights.device)).view(-1, 4).T
    if count.sum() == 0:
        return dict.fromkeys(TRL_RATIO_KEYS, 0.0)  # TRL's value for an empty batch
    return dict(zip(TRL_RATIO_KEYS, (low.min().item(), (total.sum() / count.sum()).item(), high.max().item())))


@dataclass
class MismatchWatch:
    """A warning, once per run, when the correction masks long completions more than short ones (q4's masked fraction
    above `ratio` × q1's) or many completions at all (overall above `overall`): the generator and the trainer disagree,
    and the update loses the responses it most needs. The message says by how much and what to do."""

    mode: str
    cap: float
    ratio: float = 3.0
    overall: float = 0.2
    settings: dict[str, object] = field(default_factory=dict)
    _warned: bool = False

    def observe(self, metrics: dict[str, float]) -> list[str]:
        """One rollout's `summarise` metrics. Returns the warning when it is due (at most once per run), else `[]`."""
        frac, q1, q4 = (metrics.get(f"{PREFIX}/masked_frac{s}", math.nan) for s in ("", "_q1", "_q4"))
        by_length = q4 > self.ratio * q1 and q4 > 0  # NaN compares False
        if self._warned or not (by_length or frac > self.overall):
            return []
        self._warned = True
        return [self._message(metrics, frac, q1, q4)]

    def _message(self, metrics, frac, q1, q4) -> str:
        gaps = ", ".join(f"{metrics.get(f'{PREFIX}/log_ratio_q{q}', math.nan):.2e}" for q in range(1, QUARTILES + 1))
        head = (f"Rollout correction: {frac:.0%} of this rollout's completions got weight 0 (shortest quarter "
                f"{q1:.0%}, longest {q4:.0%}); mean per-token log π_trainer − log π_vllm by length quarter: {gaps}. ")
        if self.mode == "trl":
            remedy = ("TRL's sequence modes compare exp(Σ_t log-ratio), a sum over the completion's tokens, with "
                      "their clip range, so long completions leave the update first: set rollout_correction="
                      "'geo_mask_token_truncate' (length-independent geometric mask, then per-token truncation) or "
                      "'token_truncate'. ")
        else:
            remedy = (f"With rollout_correction={self.mode!r} a sequence is masked only when the geometric mean of "
                      f"its ratios leaves [1/{self.cap:g}, {self.cap:g}]: the generator and the trainer disagree far "
                      "more than precision noise. ")
        return head + remedy + (
            "Check that both sides compute the same model: the server's dtype against the trainer's (or1-trl serve "
            "--dtype), that weight sync reaches the server each step, --logprobs-mode processed_logprobs, the same "
            "temperature; or raise rollout_correction_cap."
            + (f" This run: {', '.join(f'{k}={v!r}' for k, v in self.settings.items())}." if self.settings else ""))


class RolloutCorrection:
    """The trainer's hook: after TRL's `_generate_and_score_completions` (every rollout batch: refills too, before
    rejection sees it), replace TRL's `importance_sampling_ratio` by `correction_weights` (our modes), log the
    diagnostics and TRL's ratio keys for the weights used, and warn once (`MismatchWatch`).

    With `"off"` (TRL's correction off: the batch has no trainer log-probs of the rollout) and without vLLM nothing
    happens. With `"trl"` TRL's ratio stays and the diagnostics describe it."""

    def __init__(self, mode: str, cap: float, settings: dict[str, object] | None = None):
        self.mode, self.cap = mode, cap
        self.watch = MismatchWatch(mode, cap, settings=settings or {})

    @classmethod
    def for_config(cls, args, use_vllm: bool) -> "RolloutCorrection | None":
        """The correction of an `OR1Config`'s run; `None` unless the MAGIC recipe samples with vLLM (HF `generate`
        samples from the trainer's own weights: there is no generator to correct toward)."""
        if args.recipe != "magic" or not use_vllm:
            return None
        return cls(args.rollout_correction, args.rollout_correction_cap, settings={
            "rollout_correction": args.rollout_correction, "rollout_correction_cap": args.rollout_correction_cap,
            "vllm_importance_sampling_mode": args.vllm_importance_sampling_mode})

    def apply(self, batch: dict, gather: Callable, metrics: dict[str, list], training: bool = True) -> list[str]:
        """Correct `batch` (one rank's rollout batch, in place) and append to `metrics` (the trainer's per-mode lists);
        returns the warnings due. `gather`: the all-gather over ranks (every rank calls this)."""
        trainer_logps, rollout_logps = batch.get("old_per_token_logps"), batch.get("sampling_per_token_logps")
        if (self.mode == "off" or trainer_logps is None or rollout_logps is None
                or "importance_sampling_ratio" not in batch):
            return []
        mask = batch["completion_mask"].float()  # [b, T]
        if batch.get("tool_mask") is not None:
            mask = mask * batch["tool_mask"]
        log_ratios = token_log_ratios(trainer_logps, rollout_logps, mask)  # [b, T]
        if self.mode in OUR_MODES:
            weights = correction_weights(trainer_logps, rollout_logps, mask, self.mode, self.cap)  # [b, T]
            batch["importance_sampling_ratio"] = weights
            for key, value in ratio_summary(weights, mask, gather).items():
                if metrics[key]:  # TRL appended its own for this batch: ours replaces it
                    metrics[key][-1] = value
        summary = summarise(gather(row_stats(batch["importance_sampling_ratio"], log_ratios, mask)))
        for key, value in summary.items():
            metrics[key].append(value)
        return self.watch.observe(summary) if training else []
