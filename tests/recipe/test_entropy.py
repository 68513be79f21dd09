"""Eq. 3.2 — the controller alone, against a plain transcription of the equation."""


import pytest

from or1_trl.recipe.entropy import ENTROPY_PRESETS, AdaptiveEntropyController
from ..helpers import reference_eq_3_2


SCRIPT = [0.5, 0.15, 0.1, None, 0.05, 0.2, 0.3, 0.19, None, None, 0.25, 0.1, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("preset", sorted(ENTROPY_PRESETS))
def test_coefficient_sequence_matches_equation(preset):
    p = ENTROPY_PRESETS[preset]
    controller = AdaptiveEntropyController(
        target=p["entropy_target"], delta=p["entropy_coef_delta"], coef_min=p["entropy_coef_min"], coef_max=p["entropy_coef_max"]
    )
    expected = reference_eq_3_2(SCRIPT, p["entropy_target"], p["entropy_coef_delta"], p["entropy_coef_min"], p["entropy_coef_max"])
    for e, (alpha, c) in zip(SCRIPT, expected):
        assert controller.coefficient() == pytest.approx(alpha, abs=1e-12)
        controller.update(e)
        assert controller.coef == pytest.approx(c, abs=1e-12)
    # the script crosses the target both ways, so the sequence is not trivially monotone
    cs = [c for _, c in expected]
    assert max(cs) > 0 and any(b < a for a, b in zip(cs, cs[1:]))


def test_clipping_and_equality():
    controller = AdaptiveEntropyController(target=0.2, delta=0.5, coef_min=0.0, coef_max=0.7)
    controller.update(0.0)
    controller.update(0.0)
    assert controller.coef == 0.7  # clipped at c_max
    controller.update(0.2)  # e == tgt: neither branch of eq. 3.2
    assert controller.coef == 0.7 and controller.coefficient() == 0.7  # gate is e <= tgt
    controller.update(1.0)
    controller.update(1.0)
    assert controller.coef == 0.0 and controller.coefficient() == 0.0


def test_empty_window_leaves_state_unchanged():
    controller = AdaptiveEntropyController(target=0.2, delta=0.01)
    controller.update(0.1)
    state = (controller.coef, controller.last_entropy)
    controller.update(None)
    controller.update(float("nan"))
    assert (controller.coef, controller.last_entropy) == state


def test_static_coefficient_when_not_adaptive():
    controller = AdaptiveEntropyController(coef=0.003, adaptive=False)
    controller.update(10.0)
    assert controller.coefficient() == 0.003 and controller.coef == 0.003


def test_no_bonus_before_first_measurement():
    assert AdaptiveEntropyController(coef=0.5).coefficient() == 0.0
