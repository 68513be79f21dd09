"""Comparing two configs on paired runs: every pair's value, an exact test and an interval that mean what they say.

Two arms run with the same seeds — and, with `OR1Config.rollout_seed`, the same rollouts' random numbers (common
random numbers, `generation/seeded.py`) — so the pair's difference cancels what the pair shares. What can honestly be
said of n pairs:

- every pair's value and difference (`PairedComparison.pairs`), always beside any summary;
- the paired t interval of the mean difference (`scipy.stats.ttest_rel`; assumes roughly normal differences; n ≥ 2);
- the exact sign-flip permutation test of "no difference" (`scipy.stats.permutation_test`, all 2**n sign patterns:
  exact, no normality assumed; with n pairs its smallest two-sided p-value is 2 / 2**n: 0.125 at n = 4, 0.0625 at
  n = 5, so fewer than 6 pairs can never reach p < 0.05);
- non-inferiority with a margin stated before the runs: B is not worse than A by more than `margin` when the
  interval's lower end is above −margin.

No percentile bootstrap: with fewer than 8 pairs its bounds are nearly the pairs' own extremes, not a 95% interval.

    comparison = compare_paired([0.41, 0.52, 0.47, 0.50], [0.45, 0.55, 0.46, 0.56])   # arm A's, arm B's values
    comparison.mean, comparison.interval, comparison.sign_flip_p
    comparison.non_inferior(margin=0.05)        # B - A > -0.05 at the interval's confidence
    held_out_auc([(0, 0.18), (3, 0.30), (6, 0.41)])   # mean accuracy over the run (trapezoid / span)
    identical_fraction(rows_a, rows_b)          # the share of a step's completions two arms drew alike
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PairedComparison:
    """Arm B against arm A over n pairs (`compare_paired`).

    Attributes:
        a, b: the pairs' values, in pair order.
        differences: b − a per pair.
        mean, sd: of the differences (sd: the sample standard deviation, n − 1; NaN for n < 2).
        interval: the paired t interval of the mean difference at `confidence` (NaN bounds for n < 2).
        sign_flip_p: two-sided p-value of the exact sign-flip test (1.0 for n < 2).
        confidence: the interval's level.
    """

    a: tuple[float, ...]
    b: tuple[float, ...]
    differences: tuple[float, ...]
    mean: float
    sd: float
    interval: tuple[float, float]
    sign_flip_p: float
    confidence: float

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def pairs(self) -> list[tuple[float, float, float]]:
        """`(a, b, b − a)` of every pair."""
        return list(zip(self.a, self.b, self.differences))

    def non_inferior(self, margin: float) -> bool:
        """B is not worse than A by `margin` or more: the interval's lower end is above −margin."""
        return self.interval[0] > -margin

    def summary(self, digits: int = 3) -> str:
        """One line: the mean difference, its interval (none from fewer than 2 pairs), the test, and every pair's
        difference."""
        each = ", ".join(f"{d:+.{digits}f}" for d in self.differences)
        low, high = self.interval
        interval = (f"paired t {self.confidence:.0%} interval {low:+.{digits}f} to {high:+.{digits}f}" if self.n >= 2
                    else "no interval from one pair")
        return (f"mean difference {self.mean:+.{digits}f} ({interval}; exact sign-flip p = {self.sign_flip_p:.3g}; "
                f"n = {self.n} pairs: {each})")


def compare_paired(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedComparison:
    """B against A over pairs `(a[i], b[i])` (the same seed, the same rollouts' random numbers)."""
    import numpy as np
    from scipy import stats

    if len(a) != len(b):
        raise ValueError(f"paired values: {len(a)} of arm A against {len(b)} of arm B")
    differences = tuple(float(y - x) for x, y in zip(a, b))
    n = len(differences)
    nan = float("nan")
    mean = statistics.fmean(differences) if n else nan
    sd = statistics.stdev(differences) if n >= 2 else nan
    if n >= 2 and sd > 0:
        interval = tuple(float(v) for v in stats.ttest_rel(b, a).confidence_interval(confidence))
    elif n >= 2:  # every difference equal: the interval is that value
        interval = (mean, mean)
    else:
        interval = (nan, nan)
    p = 1.0
    if n >= 2 and any(differences):  # one pair: its two sign patterns give p = 1
        test = stats.permutation_test((list(differences),), statistic=np.mean, permutation_type="samples",
                                      alternative="two-sided", n_resamples=2**n)
        p = float(test.pvalue)
    return PairedComparison(tuple(map(float, a)), tuple(map(float, b)), differences, mean, sd, interval, p,
                            confidence)


def held_out_auc(curve: Sequence[tuple[float, float]]) -> float:
    """The area under a held-out curve `[(step, accuracy), ...]` (steps increasing) divided by its span: the mean
    accuracy over the run, trapezoid rule. One point: its accuracy."""
    if not curve:
        raise ValueError("an empty curve has no area")
    if len(curve) == 1:
        return float(curve[0][1])
    area = sum((s1 - s0) * (y0 + y1) / 2 for (s0, y0), (s1, y1) in zip(curve, curve[1:]))
    return float(area / (curve[-1][0] - curve[0][0]))


def identical_fraction(rows_a: Sequence, rows_b: Sequence) -> float:
    """The share of rows two arms drew alike (`rows_a[i] == rows_b[i]`: completions, or their digests, in the same
    order)."""
    if len(rows_a) != len(rows_b) or not rows_a:
        raise ValueError(f"rows to compare: {len(rows_a)} against {len(rows_b)}")
    return sum(x == y for x, y in zip(rows_a, rows_b)) / len(rows_a)
