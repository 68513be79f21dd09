"""The range table (`FIELD_RANGES`): every numeric field of the config the trainer reads (OR1's, TRL's,
transformers') in its range, walked through `OR1Config` (a value outside is one line naming the field)."""

import dataclasses
import math
import os
import typing
import warnings

import pytest

from or1_trl import OR1Config
from or1_trl.recipe.ranges import FIELD_RANGES, UNCHECKED, check_ranges
from or1_trl.testing import tiny_training_args

from ..helpers import ROOT


def config(tmp_path, **overrides):
    return OR1Config(**tiny_training_args(tmp_path, **overrides))


# Other checks a boundary value meets, and the fields set beside it so that only the range is tested.
BESIDE = {
    "max_tokens_per_microbatch": dict(padding_free=True),
    "entropy_coef": dict(use_adaptive_entropy=False),
    "entropy_coef_min": dict(use_adaptive_entropy=False, entropy_coef_max=1e308),
    "entropy_coef_max": dict(use_adaptive_entropy=False, entropy_coef_min=-1e308),
    "vllm_importance_sampling_clip_min": dict(rollout_correction="trl", vllm_importance_sampling_clip_max=None),
    "vllm_importance_sampling_clip_max": dict(rollout_correction="trl"),
    "vllm_importance_sampling_cap": dict(rollout_correction="trl"),
    "dataloader_prefetch_factor": dict(dataloader_num_workers=1),
    "num_generations": dict(per_device_train_batch_size=2),
    "per_device_train_batch_size": dict(gradient_accumulation_steps=2, num_generations=2, use_adaptive_entropy=False),
    "generation_batch_size": dict(per_device_train_batch_size=2, num_generations=2),
}
# A bound no config can reach for another field's sake (a group needs 2 completions), and the value tested instead.
REACHABLE = {"generation_batch_size": {1: 2}}
# Fields that TRL or the stages derive when unset, or that TRL renames (the deprecated `_cap`).
DERIVED = {"generation_batch_size", "steps_per_generation", "max_steps", "vllm_importance_sampling_cap"}


def outside(entry):
    """Values one step outside each bound, NaN, ±inf, a non-integer for an integer, None where it is not allowed,
    a string."""
    values = []
    for bound, direction, is_open in ((entry.low, -math.inf, entry.low_open), (entry.high, math.inf, entry.high_open)):
        if bound is not None:
            values.append(bound if is_open else bound + (-1 if direction < 0 else 1) if entry.integer
                          else math.nextafter(bound, direction))
    values += [math.nan, math.inf, -math.inf, "1"]
    if entry.integer:
        values.append((entry.low or 0) + 1.5)
    if not entry.optional:
        values.append(None)
    if entry.elements:
        values = [[1.0, v] for v in values if v is not None and not isinstance(v, str)] + [3.0]
    return [v for v in values if v not in entry.special]


def inside(name, entry):
    """Each bound itself where it is closed, the nearest float inside where it is open; the special values; None."""
    values = []
    for bound, direction, is_open in ((entry.low, math.inf, entry.low_open), (entry.high, -math.inf, entry.high_open)):
        if bound is not None:
            values.append(math.nextafter(bound, direction) if is_open else bound)
    values += [*entry.special, *([None] if entry.optional else [])]
    if entry.elements:
        values.append([0.0, -1e300, 1e300])
    if not values:
        values = [-1e300, 0.0, 1e300]
    return [REACHABLE.get(name, {}).get(v, v) if not isinstance(v, list) else v for v in values]


RANGE_CASES = [(name, value) for name, entry in FIELD_RANGES.items() for value in outside(entry)]


@pytest.mark.parametrize("name,value", RANGE_CASES, ids=[f"{n}={v!r}" for n, v in RANGE_CASES])
def test_out_of_range_is_one_line_naming_the_field(tmp_path, name, value):
    with pytest.raises(ValueError) as raised:
        config(tmp_path, **{**BESIDE.get(name, {}), name: value})
    message = str(raised.value)
    shown = name if not FIELD_RANGES[name].elements or not isinstance(value, list) else f"{name}[1]"
    shown_value = value[1] if shown != name else value
    assert message.startswith(f"{shown}={shown_value!r} must be "), message
    assert "\n" not in message


@pytest.mark.parametrize("name", list(FIELD_RANGES))
def test_range_bounds_are_accepted(tmp_path, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. beta > 0: "not the paper's objective"
        for value in inside(name, FIELD_RANGES[name]):
            args = config(tmp_path, **{**BESIDE.get(name, {}), name: value})
            if value is not None and name not in DERIVED:
                assert getattr(args, name) == value, (name, value)


def test_every_numeric_field_has_a_range_or_a_reason():
    """A numeric field added to OR1Config (or by a TRL/transformers upgrade) must be classified here."""
    # The declared types (transformers' HfArgumentParser rewrites `field.type` in place once a parser is built, e.g.
    # `int | str | None` to `str`, so a CLI test earlier in the session would hide a field).
    hints = typing.get_type_hints(OR1Config)
    numeric = {f.name for f in dataclasses.fields(OR1Config)
               if "int" in str(hints[f.name]) or "float" in str(hints[f.name])}
    assert numeric - set(FIELD_RANGES) - set(UNCHECKED) == set()
    assert set(FIELD_RANGES) | set(UNCHECKED) <= numeric  # no stale entries
    assert not set(FIELD_RANGES) & set(UNCHECKED)
    assert all(entry.reason for entry in FIELD_RANGES.values())


def test_defaults_and_every_recipe_are_in_range(tmp_path):
    """OR1Config's defaults and every YAML recipe of examples/recipes pass the range table."""
    import glob

    import yaml

    check_ranges(OR1Config(output_dir=str(tmp_path), use_cpu=True))
    recipes = sorted(glob.glob(os.path.join(ROOT, "examples", "recipes", "*.yaml")))
    assert len(recipes) >= 6
    for path in recipes:
        with open(path) as f:
            recipe = yaml.safe_load(f)
        fields = {name: value for name, value in recipe.items() if name in FIELD_RANGES}
        for name, value in fields.items():
            value = float(value) if isinstance(value, str) else value  # YAML 1.1 reads 1e-6 as text
            assert FIELD_RANGES[name].problem(name, value) is None, (path, name, value)
