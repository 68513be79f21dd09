"""Multi-stage training, Skywork-OR1 §3.2.2 (DESIGN §4): the context grows by stage, batch and group may change.

    stages:                                          # Skywork-OR1-7B, Table 11
      - {until_step: 660,  max_completion_length: 16384, batch_size: 256, mini_batch_size: 256, num_generations: 16}
      - {until_step: 1320, max_completion_length: 32768, batch_size: 160, mini_batch_size: 160, num_generations: 32}

A stage runs from the previous stage's `until_step` (0 for the first) to its own, in optimizer steps. `batch_size`
is prompts per rollout step and `mini_batch_size` prompts per optimizer step, both over all ranks; N_SGD =
batch_size / mini_batch_size. What a stage leaves out keeps the value of the run's config.

TRL expresses the same shape per rank and per micro-step: with R = per_device_train_batch_size × processes rows per
micro-step, `gradient_accumulation_steps = mini_batch_size·G / R` and `steps_per_generation = batch_size·G / R`.
`stage_shape` computes them and refuses shapes that do not divide, before anything runs.

The schedule only: setting a stage's shape on a trainer, its learning rate and the loop that walks the stages are
the trainer's (`trainer/stage_run.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .ranges import FIELD_RANGES


@dataclass(frozen=True)
class Stage:
    """One training stage. Fields left `None` keep the run's config value."""

    until_step: int
    max_completion_length: int | None = None
    batch_size: int | None = None  # prompts per rollout step, all ranks
    mini_batch_size: int | None = None  # prompts per optimizer step, all ranks
    num_generations: int | None = None
    temperature: float | None = None
    learning_rate: float | None = None
    max_tokens_per_microbatch: int | None = None  # the packed forwards' budget (`OR1Config.padding_free`)


@dataclass(frozen=True)
class StageShape:
    """A stage in TRL's terms, for one world size: what `OR1Trainer` sets when the stage starts."""

    index: int
    start_step: int
    until_step: int
    max_completion_length: int
    num_generations: int
    batch_size: int
    mini_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    temperature: float
    learning_rate: float
    max_tokens_per_microbatch: int | None = None

    @property
    def generation_batch_size(self) -> int:
        """Rows per rollout step over all ranks (TRL's `generation_batch_size`)."""
        return self.batch_size * self.num_generations


def parse_stages(raw) -> list[Stage]:
    """`OR1Config.stages` (dicts from YAML/CLI, or `Stage`s) as `Stage`s, with clear errors for bad entries."""
    if raw is None:
        return []
    if isinstance(raw, (dict, str)) or not hasattr(raw, "__iter__"):
        raise ValueError(f"stages must be a list of {{until_step, max_completion_length, ...}} entries, got {raw!r}")
    names = [f.name for f in fields(Stage)]
    stages = []
    for i, entry in enumerate(raw):
        if isinstance(entry, Stage):
            stages.append(entry)
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"stages[{i}] must be a mapping, got {entry!r}")
        unknown = sorted(set(entry) - set(names))
        if unknown:
            raise ValueError(f"stages[{i}] has unknown field(s) {unknown}; a stage takes {names}")
        if "until_step" not in entry:
            raise ValueError(f"stages[{i}] needs `until_step` (the optimizer step at which the stage ends)")
        stages.append(Stage(**entry))
    return stages


def validate_stages(stages: list[Stage], max_steps: int) -> int:
    """Check the schedule; return the run's length in optimizer steps (`max_steps`, or the last `until_step`)."""
    previous = 0
    for i, stage in enumerate(stages):
        if not isinstance(stage.until_step, int) or stage.until_step <= previous:
            raise ValueError(
                f"stages[{i}].until_step={stage.until_step!r} must be an integer > {previous}: stages end at strictly "
                "increasing optimizer steps."
            )
        for name in ("batch_size", "mini_batch_size"):
            value = getattr(stage, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"stages[{i}].{name}={value!r} must be a positive integer.")
        for name in ("max_completion_length", "num_generations", "temperature", "learning_rate",
                     "max_tokens_per_microbatch"):  # the run's fields of these names: their ranges
            value = getattr(stage, name)
            problem = None if value is None else FIELD_RANGES[name].problem(f"stages[{i}].{name}", value)
            if problem:
                raise ValueError(problem)
        previous = stage.until_step
    if not stages:
        return max_steps
    if max_steps is not None and max_steps > 0 and stages[-1].until_step < max_steps:
        raise ValueError(
            f"The last stage ends at step {stages[-1].until_step}, before max_steps={max_steps}: extend the last "
            "stage's until_step, or leave max_steps unset (-1) to train until the last stage ends."
        )
    return max_steps if max_steps is not None and max_steps > 0 else stages[-1].until_step


def stage_index(stages: list[Stage], step: int) -> int:
    """Index of the stage that trains optimizer step `step + 1` (the last stage once the schedule is over)."""
    for i, stage in enumerate(stages):
        if step < stage.until_step:
            return i
    return len(stages) - 1


def stage_shape(
    stages: list[Stage],
    index: int,
    *,
    max_completion_length: int,
    num_generations: int,
    batch_size: int,
    mini_batch_size: int,
    temperature: float,
    learning_rate: float,
    rows_per_micro_step: int,
    max_tokens_per_microbatch: int | None = None,
) -> StageShape:
    """Stage `index` in TRL's terms. The keyword arguments are the run's config values (what a stage may override);
    `rows_per_micro_step` is `per_device_train_batch_size × number of processes`."""
    stage = stages[index]
    values = {
        "max_completion_length": max_completion_length,
        "num_generations": num_generations,
        "batch_size": batch_size,
        "mini_batch_size": mini_batch_size,
        "temperature": temperature,
        "learning_rate": learning_rate,
        "max_tokens_per_microbatch": max_tokens_per_microbatch,
    }
    values.update({k: v for k, v in asdict(stage).items() if k in values and v is not None})
    G, batch, mini = values["num_generations"], values["batch_size"], values["mini_batch_size"]
    where = f"stages[{index}]"
    if G < 2:
        raise ValueError(f"{where}: num_generations={G}; group-relative advantages need at least 2 samples per "
                         "prompt.")
    if batch % mini:
        raise ValueError(
            f"{where}: batch_size={batch} prompts per rollout must be a multiple of mini_batch_size={mini} prompts "
            "per optimizer step (N_SGD = batch_size / mini_batch_size optimizer steps per rollout)."
        )
    if (mini * G) % rows_per_micro_step:
        raise ValueError(
            f"{where}: mini_batch_size × num_generations = {mini} × {G} = {mini * G} rows per optimizer step must be "
            f"a multiple of per_device_train_batch_size × processes = {rows_per_micro_step} rows per micro-step."
        )
    return StageShape(
        index=index,
        start_step=stages[index - 1].until_step if index else 0,
        until_step=stage.until_step,
        max_completion_length=values["max_completion_length"],
        num_generations=G,
        batch_size=batch,
        mini_batch_size=mini,
        gradient_accumulation_steps=mini * G // rows_per_micro_step,
        steps_per_generation=batch * G // rows_per_micro_step,
        temperature=values["temperature"],
        learning_rate=values["learning_rate"],
        max_tokens_per_microbatch=values["max_tokens_per_microbatch"],
    )


def stage_shapes(stages: list[Stage], args, num_processes: int) -> list[StageShape]:
    """Every stage of a run in TRL's terms: what a stage leaves out comes from `args` (an `OR1Config`), with
    `per_device_train_batch_size` fixed. Shapes that do not divide fail here, before anything runs."""
    rows = args.per_device_train_batch_size * num_processes  # rows per micro-step, all ranks
    G = args.num_generations
    run = dict(
        max_completion_length=args.max_completion_length,
        num_generations=G,
        batch_size=args.generation_batch_size // G,
        mini_batch_size=rows * args.gradient_accumulation_steps // G,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        rows_per_micro_step=rows,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
    )
    return [stage_shape(stages, i, **run) for i in range(len(stages))]


def check_fits_vllm(shapes: list[StageShape], limit: int | None) -> None:
    """Every stage's generation length fits vLLM's max model length `limit` (prompt + completion; `None`: no vLLM)."""
    for shape in shapes:
        if limit is not None and shape.max_completion_length >= limit:
            raise ValueError(
                f"stages[{shape.index}].max_completion_length={shape.max_completion_length} does not fit the vLLM "
                f"max model length {limit} (prompt + completion). Start vLLM with a larger --max-model-len."
            )
