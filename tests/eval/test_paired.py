"""`eval/paired.py`: paired comparisons against plain references — the exact sign-flip test by enumerating every sign
pattern, the paired t interval from its formula, the trapezoid AUC by hand."""

import itertools
import math
import statistics

import pytest
from scipy import stats

from or1_trl.eval.paired import compare_paired, held_out_auc, identical_fraction

A = [0.41, 0.52, 0.47, 0.50, 0.38]
B = [0.45, 0.55, 0.46, 0.56, 0.44]


def enumerated_sign_flip_p(differences):
    """Two-sided p of "mean difference 0": the share of the 2**n sign patterns whose |mean| reaches the observed."""
    observed = abs(statistics.fmean(differences))
    patterns = list(itertools.product((1, -1), repeat=len(differences)))
    extreme = sum(abs(statistics.fmean(s * d for s, d in zip(signs, differences))) >= observed - 1e-12
                  for signs in patterns)
    return extreme / len(patterns)


def test_every_pair_the_t_interval_and_the_exact_test_against_their_definitions():
    comparison = compare_paired(A, B)
    differences = [b - a for a, b in zip(A, B)]
    assert comparison.pairs == list(zip(A, B, differences))
    assert comparison.n == 5 and comparison.mean == pytest.approx(statistics.fmean(differences), abs=1e-15)
    assert comparison.sd == pytest.approx(statistics.stdev(differences), abs=1e-15)
    half = stats.t.ppf(0.975, 4) * statistics.stdev(differences) / math.sqrt(5)
    assert comparison.interval == pytest.approx((comparison.mean - half, comparison.mean + half), abs=1e-12)
    assert comparison.sign_flip_p == pytest.approx(enumerated_sign_flip_p(differences), abs=1e-12)
    assert comparison.non_inferior(margin=0.0) and not compare_paired(B, A).non_inferior(margin=0.01)


def test_the_exact_test_cannot_reject_with_few_pairs_and_the_summary_says_each_difference():
    """With 4 pairs, even 4 large positive differences give p = 2/16 = 0.125: the smallest p of 4 pairs."""
    comparison = compare_paired([0.0] * 4, [0.3, 0.2, 0.4, 0.25])
    assert comparison.sign_flip_p == 0.125
    assert comparison.summary() == (
        "mean difference +0.287 (paired t 95% interval "
        f"{comparison.interval[0]:+.3f} to {comparison.interval[1]:+.3f}; exact sign-flip p = 0.125; n = 4 pairs: "
        "+0.300, +0.200, +0.400, +0.250)")


def test_degenerate_pairs():
    assert compare_paired([1.0, 2.0], [1.5, 2.5]).interval == (0.5, 0.5)  # equal differences: no spread
    same = compare_paired([0.3, 0.4], [0.3, 0.4])
    assert same.mean == 0.0 and same.sign_flip_p == 1.0
    one = compare_paired([0.3], [0.5])
    assert math.isnan(one.sd) and all(math.isnan(v) for v in one.interval)
    assert one.summary() == ("mean difference +0.200 (no interval from one pair; exact sign-flip p = 1; n = 1 pairs: "
                             "+0.200)")
    with pytest.raises(ValueError, match="2 of arm A against 1 of arm B"):
        compare_paired([0.1, 0.2], [0.1])


def test_held_out_auc_is_the_trapezoid_mean_and_identical_fraction_counts_rows():
    assert held_out_auc([(0, 0.2), (3, 0.5), (6, 0.5), (12, 0.8)]) == pytest.approx(
        (3 * 0.35 + 3 * 0.5 + 6 * 0.65) / 12)
    assert held_out_auc([(5, 0.4)]) == 0.4
    assert identical_fraction(["a", "b", "c", "d"], ["a", "x", "c", "y"]) == 0.5
    with pytest.raises(ValueError):
        identical_fraction(["a"], ["a", "b"])
