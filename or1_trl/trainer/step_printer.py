"""One line per logged training step, on the main process: what `or1-trl train` and the demos print as they
train.

- `step_line`: a step's line from its logged metrics (reward, accuracy, entropy, the entropy coefficient, the
  kept-group fraction, the step's time split).
- `StepPrinter`: prints it for each logged step, in place of transformers' printed metrics dict (its
  `PrinterCallback` / `ProgressCallback`, removed by `show_steps`); the trackers of `report_to` still get every
  metric. `or1-trl train` logs every step (`logging_steps=1` unless set); with a longer logging window a line shows
  the window's means, as TRL logs them.
"""

from __future__ import annotations

import math

from transformers import PrinterCallback, ProgressCallback, TrainerCallback


def _number(logs: dict, key: str, digits: int) -> str:
    value = logs.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"  # nothing measured (e.g. every group rejected, every sample truncated)
    return f"{value:.{digits}f}"


def step_line(logs: dict, step: int, max_steps: int, skipped_before: float | None = None) -> str:
    """One step's line from its logged metrics: reward, accuracy, the entropy over the kept tokens ("-" when every
    group was rejected: it measured nothing), the entropy coefficient c, the kept-group fraction (and "skipped"
    when the cumulative `skipped_steps` grew since `skipped_before`), and the step's time split."""
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
    return " | ".join(parts)


class StepPrinter(TrainerCallback):
    """Prints `step_line` for each logged training step on the main process; `rewards` keeps each line's reward.
    Evaluation logs get a line of their own (`eval at step N | ...`)."""

    def __init__(self):
        self.rewards: list[float] = []
        self._skipped: float | None = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        if "reward" in logs:
            self.rewards.append(logs["reward"])
            if state.is_world_process_zero:
                print(step_line(logs, step=state.global_step, max_steps=state.max_steps, skipped_before=self._skipped),
                      flush=True)
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
