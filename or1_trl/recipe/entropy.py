"""Adaptive entropy control, Skywork-OR1 eq. 3.2.

    c_0     = 0
    c_{k+1} = c_k + Δ  if e_k < tgt ;  c_k − Δ  if e_k > tgt      (then clipped to [c_min, c_max])
    α_k     = c_k · 1{ e_k ≤ tgt }

`e_k` is the actor's entropy measured on the rollout of step k, over every kept response token (all of them,
also when the 80/20 rule restricts the policy gradient to the top-ρ tokens). Two estimators (DESIGN §2):

- `"full"`: mean full-vocabulary entropy H(π_θ(·|s_t)) — what the loss term differentiates (paper text);
- `"sampled"`: −mean log π_old(a_t) over the sampled tokens — what the released Skywork code measures.

Timing. The entropy of step k is known only after its last micro-batch has been forwarded, while the bonus of
step k is already in the loss of its first micro-batch. Like TRL and Skywork's released code, the controller
therefore gates step k with the entropy measured at step k−1 (`α_k = c_k · 1{e_{k−1} ≤ tgt}`): a lag of one step
in the gate, none in the coefficient update.

A step with no kept tokens (every group rejected) measures nothing: `update(None)` leaves c and the last
entropy unchanged (TRL would read an entropy of 0 and raise c).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Presets for (entropy_target, entropy_coef_delta, entropy_coef_min, entropy_coef_max).
# "paper": Skywork-OR1 report §3.2.4 (tgt 0.2, Δ 0.005; the report states no upper clip, we guard with 1.0).
# "released": the released training scripts (tgt 0.2, Δ 1e-4, c_min 0, c_max 5e-3).
ENTROPY_PRESETS: dict[str, dict[str, float]] = {
    "paper": {"entropy_target": 0.2, "entropy_coef_delta": 0.005, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0},
    "released": {
        "entropy_target": 0.2,
        "entropy_coef_delta": 1e-4,
        "entropy_coef_min": 0.0,
        "entropy_coef_max": 5e-3,
    },
}


@dataclass
class AdaptiveEntropyController:
    """State and update rule of eq. 3.2. Pure Python: testable without a trainer.

    Args:
        target: tgt, the entropy (nats) the controller steers towards.
        delta: Δ, the coefficient step.
        coef_min, coef_max: the clip range of c.
        coef: the current c_k (c_0 = 0 in the paper).
        last_entropy: the last measured e (∞ before the first measurement: no bonus on step 0).
        adaptive: False gives a constant coefficient `coef` (no gating, no updates).
    """

    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    coef: float = 0.0
    last_entropy: float = math.inf
    adaptive: bool = True

    @classmethod
    def for_config(cls, args) -> "AdaptiveEntropyController":
        """The controller of a run configured by `args` (`entropy_target`, `entropy_coef_*`,
        `use_adaptive_entropy`)."""
        return cls(target=args.entropy_target, delta=args.entropy_coef_delta, coef_min=args.entropy_coef_min,
                   coef_max=args.entropy_coef_max, coef=args.entropy_coef, adaptive=args.use_adaptive_entropy)

    def coefficient(self) -> float:
        """α applied to the entropy term of the current step: c · 1{e_last ≤ tgt} (or the constant c)."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float | None) -> float:
        """Feed e_k (None or NaN: nothing was measured — state unchanged). Returns the new c."""
        if not self.adaptive or entropy is None or math.isnan(entropy):
            return self.coef
        if entropy < self.target:
            self.coef = self.coef + self.delta
        elif entropy > self.target:
            self.coef = self.coef - self.delta
        self.coef = min(max(self.coef, self.coef_min), self.coef_max)
        self.last_entropy = float(entropy)
        return self.coef


class StepWindow:
    """The mean of a per-token value over the kept tokens of one optimizer step: `add` each micro-step's `[b, T]`
    values and mask, `close` at the step's end with the sum over ranks (`reduce`); `None` when no token was kept.

    A window nothing was added to closes to `None` without `reduce` (no collective): that is a skipped step that ran
    no pass (`sharding.UpdateSkip.without_passes`), skipped on every rank alike, so every rank leaves it out."""

    def __init__(self):
        self.stats: torch.Tensor | None = None  # [Σ v·m, Σ m]

    def add(self, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        stats = torch.stack([(per_token * mask).sum(), mask.sum()])  # [2]
        self.stats = stats if self.stats is None else self.stats + stats

    def close(self, reduce) -> float | None:
        if self.stats is None:
            return None
        total, count = reduce(self.stats).tolist()
        self.stats = None
        return total / count if count > 0 else None
