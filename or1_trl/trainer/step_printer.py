"""One line per logged training step, on the main process: what `or1-trl train` and the demos print as they
train.

- `step_line`: a step's line from its logged metrics (reward, accuracy, entropy, the entropy coefficient, the
  kept-group fraction, the step's time split) and the run's pace (elapsed time, ETA).
- `start_line`: before the first step, what it is doing (the rollout's shape, where it generates).
- `StepPrinter`: prints the start line, then `step_line` for each logged step, in place of transformers' printed
  metrics dict (its `PrinterCallback` / `ProgressCallback`, removed by `show_steps`); the trackers of `report_to`
  still get every metric. `or1-trl train` logs every step (`logging_steps=1` unless set); with a longer logging
  window a line shows the window's means, as TRL logs them.
"""

from __future__ import annotations

import math
import time

from transformers import PrinterCallback, ProgressCallback, TrainerCallback


def _number(logs: dict, key: str, digits: int) -> str:
    value = logs.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"  # nothing measured (e.g. every group rejected, every sample truncated)
    return f"{value:.{digits}f}"


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: a wall time as a reader reads it."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def step_line(logs: dict, step: int, max_steps: int, skipped_before: float | None = None,
              pace: tuple[float, float] | None = None) -> str:
    """One step's line from its logged metrics: reward, accuracy, the entropy over the kept tokens ("-" when every
    group was rejected: it measured nothing), the entropy coefficient c, the kept-group fraction (and "skipped"
    when the cumulative `skipped_steps` grew since `skipped_before`), the step's time split, and with `pace`
    (seconds since training began, seconds to go at this session's mean pace) the elapsed time and an ETA."""
    kept = logs.get("rejection/kept_group_frac")
    entropy = "-" if kept == 0 else _number(logs, "entropy", 3)
    parts = [f"step {step:3d}/{max_steps}", f"reward {_number(logs, 'reward', 3)}",
             f"accuracy {_number(logs, 'accuracy/all', 2)}", f"entropy {entropy}",
             f"entropy_coef {_number(logs, 'entropy_coef', 4)}",
             f"kept_groups {_number(logs, 'rejection/kept_group_frac', 2)}"]
    skipped = logs.get("skipped_steps")
    if skipped is not None and skipped_before is not None and skipped > skipped_before:
        parts[-1] += " (skipped: no trainable token)"
    if logs.get("time/step_s") is not None:
        shares = " ".join(f"{phase} {logs.get(f'time/{phase}_share', 0.0):.0%}"
                          for phase in ("rollout", "reward", "update", "other"))
        parts.append(f"{logs['time/step_s']:.2f} s: {shares}")
    if pace is not None:
        parts.append(f"{duration(pace[0])} elapsed, ETA {duration(pace[1])}")
    return " | ".join(parts)


def start_line(step: int, max_steps: int, prompts: int, generations: int, max_tokens: int, generator: str) -> str:
    """What the first step does, said before it starts (a real model's first rollout on a CPU takes minutes; a line
    comes only when a step ends): step `step` (1-based) of `max_steps`, its rollout's shape and where it generates."""
    return (f"Step {step} of {max_steps}: sampling {generations} completions for each of {prompts} prompts (up to "
            f"{max_tokens} tokens) {generator}, then the rewards and the update; a line follows each step.")


def generator_of(args) -> str:
    """Where a trainer with config `args` generates, in words."""
    if args.use_vllm:
        where = args.vllm_server_base_url or f"{args.vllm_server_host}:{args.vllm_server_port}"
        return f"on the vLLM server at {where}" if args.vllm_mode == "server" else "with vLLM in this process"
    return f"with transformers' generate on {args.device.type.upper() if args.device.type != 'cpu' else 'the CPU'}"


class StepPrinter(TrainerCallback):
    """Prints `step_line` for each logged training step on the main process; `rewards` keeps each line's reward.
    Evaluation logs get a line of their own (`eval at step N | ...`)."""

    def __init__(self, clock=time.monotonic):
        self.rewards: list[float] = []
        self._skipped: float | None = 0.0
        self._clock = clock
        self._began: tuple[float, int] | None = None  # (clock, global step) when this session's training began

    def on_train_begin(self, args, state, control, **kwargs):
        if self._began is None:  # a stage's pass begins training again: the pace counts from the first
            self._began = (self._clock(), state.global_step)
            if state.is_world_process_zero and args is not None:
                print(start_line(step=state.global_step + 1, max_steps=state.max_steps,
                                 prompts=args.generation_batch_size // args.num_generations,
                                 generations=args.num_generations, max_tokens=args.max_completion_length,
                                 generator=generator_of(args)), flush=True)

    def pace(self, step: int, max_steps: int) -> tuple[float, float] | None:
        """(seconds since training began, seconds left at the mean pace of the steps since), or `None` before."""
        if self._began is None or step <= self._began[1]:
            return None
        elapsed = self._clock() - self._began[0]
        return elapsed, elapsed / (step - self._began[1]) * max(0, max_steps - step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        if "reward" in logs:
            self.rewards.append(logs["reward"])
            if state.is_world_process_zero:
                print(step_line(logs, step=state.global_step, max_steps=state.max_steps, skipped_before=self._skipped,
                                pace=self.pace(state.global_step, state.max_steps)), flush=True)
            self._skipped = logs.get("skipped_steps", self._skipped)
        elif "eval_reward" in logs and state.is_world_process_zero:
            shown = [key for key in logs if key == "eval_reward" or "avg@" in key or "pass@" in key]
            print(f"eval at step {state.global_step} | "
                  + " | ".join(f"{key.removeprefix('eval_')} {_number(logs, key, 3)}" for key in shown), flush=True)


def show_steps(trainer) -> StepPrinter:
    """Put a `StepPrinter` in place of transformers' printed metrics (`PrinterCallback`, or the progress bar's
    `ProgressCallback`, which writes the same dict); returns it."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    printer = StepPrinter()
    trainer.add_callback(printer)
    return printer
