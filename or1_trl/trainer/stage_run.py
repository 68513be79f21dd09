"""The stages of one run as `OR1Trainer` walks them (Skywork-OR1 §3.2.2; the schedule: `recipe/stages.py`).

At a stage start the trainer sets the stage's shape on TRL's config and on itself (`apply_to_args`,
`apply_to_trainer`: completion length, group size, temperature, on the generator too), its base learning rate under
the resumed schedule (`set_base_learning_rate`); `StageEnd` ends transformers' loop at the stage's last step, saving
the checkpoint the next stage starts from. `StageRun` holds the run's shapes, the current stage and the checkpoint its
loop resumed from.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from transformers import TrainerCallback
from transformers import trainer as hf_trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..recipe.stages import Stage, StageShape, check_fits_vllm, stage_index, stage_shapes
from . import checkpoint, sharding
from .observability import stage_loop_end


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
        self.shapes: list[StageShape] = (plan(stages, args, num_processes=num_processes, pool_size=pool_size)
                                         if stages else [])
        self.current: StageShape | None = None
        self.resumed_from: str | None = None

    def __bool__(self) -> bool:
        return bool(self.stages)

    @property
    def index(self) -> int:
        """The current stage's index (0 before any and without stages: one stage)."""
        return self.current.index if self.current is not None else 0

    def end_step(self, max_steps: int) -> int:
        """The global step the current stage ends at (`max_steps` without stages)."""
        return self.current.until_step if self.current is not None else max_steps

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

    def start(self, trainer, index: int, warn: Callable[[str], None], repatch: Callable[[float], None]) -> None:
        """Make stage `index` current on `trainer`: DeepSpeed's engine for its batch shape (`sharding.enter_stage`),
        the prompt schedule's stage entry (the online filter; `warn` says what it removed), then the shape on TRL's
        config, the trainer and its generator (`apply_to_trainer`); a new temperature calls `repatch(temperature)`."""
        shape = self.enter(index)
        sharding.enter_stage(trainer, shape)
        args = trainer.args
        trainer.prompt_schedule.enter_stage(index, start_step=shape.start_step, batch_size=shape.batch_size,
                                            threshold=args.online_filter_threshold,
                                            unsolved_after=args.online_filter_unsolved_after, warn=warn)
        if apply_to_trainer(trainer, shape):
            repatch(shape.temperature)

    def walk(self, trainer, folder: str | None, train_pass: Callable, enter_stage: Callable[[int], None]):
        """Train from the checkpoint `folder` (`None`: a fresh start) to the run's end, OR1's state loaded from each
        checkpoint first (`checkpoint.load_or1_state`). Without stages: one pass of transformers' loop
        (`train_pass(folder)`). With stages: from the stage of `folder`'s step (`enter_stage(index)`), one pass per
        stage, each ending with the checkpoint the next starts from; trackers stay open across the passes. Returns
        the last pass's output (a callback that stops training early ends the walk)."""
        while True:
            if folder is not None:
                checkpoint.load_or1_state(trainer, folder)
            if not self:
                return train_pass(folder)
            step = 0 if folder is None else TrainerState.load_from_json(
                os.path.join(folder, hf_trainer.TRAINER_STATE_NAME)).global_step
            enter_stage(self.index_at(step))
            final, self.resumed_from = self.current.until_step >= trainer.args.max_steps, folder
            with stage_loop_end(trainer.callback_handler, final):
                output = train_pass(folder)
            if final or trainer.state.global_step < self.current.until_step:  # done, or a callback stopped it
                return output
            trainer.accelerator.wait_for_everyone()
            folder = os.path.join(trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
