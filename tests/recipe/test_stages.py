"""The stage schedule (`recipe/stages.py`, paper §3.2.2): stages in TRL's terms, bad schedules and shapes refused, the
paper's recipes' stages. The stages as the trainer runs them: `tests/trainer/test_stage_run.py`."""

import os

import pytest

from or1_trl import OR1Config
from or1_trl.recipe.stages import parse_stages, stage_index, stage_shape, stage_shapes, validate_stages

from ..helpers import ROOT

RUN = dict(max_completion_length=8, num_generations=16, batch_size=256, mini_batch_size=256, temperature=1.0,
           learning_rate=1e-6, rows_per_micro_step=64)


def test_paper_7b_stages_in_trl_terms():
    """Table 11 on 8 GPUs × 8 rows per micro-step: the accumulation and rollout split TRL needs."""
    stages = parse_stages([
        {"until_step": 660, "max_completion_length": 16384, "batch_size": 256, "mini_batch_size": 256, "num_generations": 16},
        {"until_step": 1320, "max_completion_length": 32768, "batch_size": 160, "mini_batch_size": 160, "num_generations": 32},
    ])
    assert validate_stages(stages, -1) == 1320
    first, second = (stage_shape(stages, i, **RUN) for i in (0, 1))
    assert (first.start_step, first.gradient_accumulation_steps, first.steps_per_generation) == (0, 64, 64)
    assert (second.start_step, second.gradient_accumulation_steps, second.steps_per_generation) == (660, 80, 80)
    assert second.generation_batch_size == 160 * 32 and second.max_completion_length == 32768
    assert [stage_index(stages, s) for s in (0, 659, 660, 1319, 1320)] == [0, 0, 1, 1, 1]
    # N_SGD = 2 (Math-7B: 256 prompts per rollout, 128 per optimizer step)
    math = stage_shape(parse_stages([{"until_step": 740, "mini_batch_size": 128}]), 0, **RUN)
    assert (math.gradient_accumulation_steps, math.steps_per_generation) == (32, 64)


@pytest.mark.parametrize(
    "stages,max_steps,message",
    [
        ([{"until_step": 10}, {"until_step": 10}], -1, r"stages\[1\].until_step=10 must be an integer > 10"),
        ([{"until_step": 0}], -1, r"must be an integer > 0"),
        ([{"until_step": 10}, {"until_step": 20}], 30, "The last stage ends at step 20, before max_steps=30"),
        ([{"until_step": 10, "context": 4}], -1, r"unknown field\(s\) \['context'\]"),
        ([{"max_completion_length": 4}], -1, "needs `until_step`"),
        ([{"until_step": 5, "num_generations": 0}], -1, r"stages\[0\].num_generations=0 must be an integer >= 2"),
        ([{"until_step": 5, "temperature": float("nan")}], -1, r"stages\[0\].temperature=nan must be > 0 and finite"),
        ([{"until_step": 5, "learning_rate": 1e308}], -1, r"stages\[0\].learning_rate=1e\+308 must be in \(0, 10\]"),
        ([{"until_step": 5, "batch_size": 0}], -1, r"stages\[0\].batch_size=0 must be a positive integer"),
        ({"until_step": 5}, -1, "must be a list"),
    ],
)
def test_bad_schedules_are_refused(stages, max_steps, message):
    with pytest.raises(ValueError, match=message):
        validate_stages(parse_stages(stages), max_steps)


def test_bad_batch_shapes_are_refused():
    with pytest.raises(ValueError, match="batch_size=100 prompts per rollout must be a multiple of mini_batch_size=64"):
        stage_shape(parse_stages([{"until_step": 5, "batch_size": 100, "mini_batch_size": 64}]), 0, **RUN)
    with pytest.raises(ValueError, match=r"3 × 16 = 48 rows per optimizer step must be a multiple of .* = 64"):
        stage_shape(parse_stages([{"until_step": 5, "batch_size": 3, "mini_batch_size": 3}]), 0, **RUN)
    assert validate_stages(parse_stages([{"until_step": 5}, {"until_step": 9}]), 7) == 7  # a shortened run is fine


RECIPES = os.path.join(ROOT, "examples", "recipes")


@pytest.mark.parametrize(
    "recipe,processes,table",
    [
        ("skywork_or1_math_7b.yaml", 8, [(740, 8192, 256, 128, 16), (1740, 16384, 256, 128, 16),
                                         (2080, 32768, 256, 128, 16), (2160, 32768, 128, 64, 64)]),
        ("skywork_or1_7b.yaml", 8, [(660, 16384, 256, 256, 16), (1320, 32768, 160, 160, 32)]),
        ("skywork_or1_32b.yaml", 32, [(760, 16384, 256, 256, 16), (1130, 24576, 160, 160, 32)]),
    ],
)
def test_paper_recipes_have_the_tables_stages(recipe, processes, table):
    """Tables 10-12 exactly: (until_step, context, prompts per rollout, prompts per optimizer step, group), a shape
    that divides on the recipe's world size, and the common settings with the entropy preset spelled out."""
    from trl import ModelConfig, TrlParser

    from or1_trl.cli import ScriptArguments

    parser = TrlParser((ScriptArguments, OR1Config, ModelConfig))
    _, args, _ = parser.parse_args_and_config(
        ["--config", os.path.join(RECIPES, recipe), "--dataset_name", "d", "--bf16", "false", "--use_cpu", "true"]
    )
    stages = args.stage_list
    assert [(s.until_step, s.max_completion_length, s.batch_size, s.mini_batch_size, s.num_generations) for s in stages] == table
    assert args.max_steps == table[-1][0]
    first = stage_shapes(stages, args, processes)[0]  # every stage divides on this world size; the config's shape is stage 0's
    assert (args.gradient_accumulation_steps, args.steps_per_generation) == (first.gradient_accumulation_steps, first.steps_per_generation)
    assert (args.learning_rate, args.lr_scheduler_type.value, args.epsilon, args.beta, args.temperature) == (1e-6, "constant", 0.2, 0.0, 1.0)
    assert (args.entropy_preset, args.entropy_target, args.entropy_coef_delta, args.entropy_coef_max) == ("paper", 0.2, 0.005, 1.0)
    assert args.rejection_sampling == "compact" and args.online_filter_threshold == 1.0
