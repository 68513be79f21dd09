"""The stages of one run as `OR1Trainer` walks them (Skywork-OR1 §3.2.2; the schedule: `recipe/stages.py`).

At a stage start the trainer sets the stage's shape on TRL's config and on itself (`apply_to_args`,
`apply_to_trainer`: completion length, group size, temperature, on the generator too), its base learning rate under
the resumed schedule (`set_base_learning_rate`); `StageEnd` ends transformers' loop at the stage's last step, saving
the checkpoint the next stage starts from. `StageRun` holds the run's shapes, the current stage and the checkpoint its
loop resumed from.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback

from ..recipe.stages import Stage, StageShape, check_fits_vllm, stage_index, stage_shapes


def set_base_learning_rate(optimizer, scheduler, learning_rate: float) -> None:
    """A stage's base learning rate under a resumed schedule: each group's lr = `learning_rate` × the schedule's
    factor at its current step (transformers' schedules are `LambdaLR`s)."""
    groups = optimizer.param_groups
    if all(group.get("initial_lr") == learning_rate for group in groups):
        return
    if not hasattr(scheduler, "lr_lambdas"):
        raise ValueError("A stage learning_rate needs a LambdaLR schedule (transformers' own); got "
                         f"{type(scheduler)}.")
    scheduler.base_lrs = [learning_rate] * len(groups)
    for group, factor in zip(groups, scheduler.lr_lambdas):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def apply_to_args(args, shape: StageShape) -> None:
    """Set the stage's shape on TRL's config (what `GRPOTrainer` reads when it builds batches and generates)."""
    args.max_completion_length = shape.max_completion_length
    args.num_generations = shape.num_generations
    args.gradient_accumulation_steps = shape.gradient_accumulation_steps
    args.steps_per_generation = shape.steps_per_generation
    args.generation_batch_size = shape.generation_batch_size
    args.temperature = shape.temperature
    args.learning_rate = shape.learning_rate
    if args.padding_free:
        args.max_tokens_per_microbatch = shape.max_tokens_per_microbatch


def apply_to_trainer(trainer, shape: StageShape) -> bool:
    """`shape` as a `GRPOTrainer` samples it: `apply_to_args`, then its completion length, group size and temperature
    on the trainer and its generator (TRL's `VLLMGeneration`, or transformers' generation settings). Returns whether
    the temperature changed: log-probs are taken at the sampling temperature, so the caller re-patches the head."""
    apply_to_args(trainer.args, shape)
    trainer.max_completion_length, trainer.num_generations = shape.max_completion_length, shape.num_generations
    changed, trainer.temperature = shape.temperature != trainer.temperature, shape.temperature
    if trainer.use_vllm:
        trainer.vllm_generation.max_completion_length = shape.max_completion_length
        trainer.vllm_generation.temperature = shape.temperature
    else:
        trainer.generation_kwargs.update(max_new_tokens=shape.max_completion_length, temperature=shape.temperature)
        trainer.generation_config.max_new_tokens = shape.max_completion_length
        trainer.generation_config.temperature = shape.temperature
    return changed


class StageEnd(TrainerCallback):
    """Ends `Trainer.train` at the current stage's last step (`current()`, a `StageShape` or `None`), saving a
    checkpoint the next stage starts from."""

    def __init__(self, current: Callable[[], StageShape | None]):
        self.current = current

    def on_step_end(self, args, state, control, **kwargs):
        stage = self.current()
        if stage is not None and state.global_step >= stage.until_step and state.global_step < args.max_steps:
            control.should_save = True
            control.should_training_stop = True
        return control


def plan(stages: list[Stage], args, num_processes: int, pool_size: int) -> list[StageShape]:
    """The stages' shapes (`stage_shapes`), stage 0's set on `args` (`apply_to_args`); a prompt pool of `pool_size`
    prompts smaller than stage 0's batch is a `ValueError`."""
    shapes = stage_shapes(stages, args, num_processes)
    apply_to_args(args, shapes[0])
    if pool_size < shapes[0].batch_size:
        raise ValueError(f"train_dataset holds {pool_size} prompts, fewer than stage 0's batch of "
                         f"{shapes[0].batch_size} prompts per rollout step.")
    return shapes


class StageRun:
    """The stages of one run as the trainer walks them: their shapes in TRL's terms (`plan`), the current stage and
    the checkpoint its loop resumes from. Empty (falsy) without `OR1Config.stages`: one loop, TRL's shape.

    Args:
        stages: `OR1Config.stage_list` (`[]`: no stages).
        args, num_processes, pool_size: as `plan` takes them (stage 0's shape is set on `args`).

    Attributes:
        shapes: each stage's `StageShape`; current: the stage being trained (`None` before `enter` and without
            stages); resumed_from: the checkpoint the current stage's loop started from, until its RNG state was
            restored (`None` after, or for a fresh start).
    """

    def __init__(self, stages: list[Stage], args=None, num_processes: int = 1, pool_size: int = 0):
        self.stages = stages
        self.shapes: list[StageShape] = plan(stages, args, num_processes, pool_size) if stages else []
        self.current: StageShape | None = None
        self.resumed_from: str | None = None

    def __bool__(self) -> bool:
        return bool(self.stages)

    @property
    def index(self) -> int:
        """The current stage's index (0 before any and without stages: one stage)."""
        return self.current.index if self.current is not None else 0

    def index_at(self, step: int) -> int:
        """Index of the stage that trains optimizer step `step + 1`."""
        return stage_index(self.stages, step)

    def enter(self, index: int) -> StageShape:
        """Make stage `index` current."""
        self.current = self.shapes[index]
        return self.current

    def attach(self, trainer) -> None:
        """After TRL's `__init__`: the prompt sampler restores its own position on resume (`ignore_data_skip`),
        `StageEnd` saves and stops at each stage's last step, and every stage must fit vLLM's context."""
        trainer.args.ignore_data_skip = True
        trainer.add_callback(StageEnd(lambda: self.current))
        limit = trainer.args.vllm_max_model_length if trainer.use_vllm else None
        if trainer.use_vllm and trainer.vllm_mode == "server" and trainer.accelerator.is_main_process:
            limit = trainer.vllm_generation.vllm_client.get_server_info()["model_config"].get("max_model_len", limit)
        check_fits_vllm(self.shapes, limit)

    def take_resumed_from(self) -> str | None:
        """The checkpoint whose RNG state is still to restore (once: `None` afterwards). transformers restores the
        checkpoint's RNG before the data loader iterator draws a seed from it (unless it skips batches; our sampler
        restores its own position): the trainer restores it after the first fetch, as transformers does on its
        skipping path, so a resumed run samples what the uninterrupted did."""
        folder, self.resumed_from = self.resumed_from, None
        return folder
