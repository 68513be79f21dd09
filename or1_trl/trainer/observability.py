"""What a run shows while it trains: where each step's time goes, training accuracy, two entropy warnings, and a
warning when steps keep being skipped.

Pure pieces, testable without a trainer; `OR1Trainer` (`trainer/or1_trainer.py`, through one `RunWatch`) feeds them
from the hooks TRL already calls.

**Time split** (`StepTimer`, metrics `time/*`). The Skywork-OR1 report breaks a step down into rollout, update and
the rest (Table 7: 72% / 8.7% / 19% at 32B). Each moment of an optimizer step is charged to the innermost phase
open at that moment:

| phase | what it covers |
|---|---|
| `rollout` | TRL's `_generate`: tokenising the prompts, the vLLM weight sync, generation (HF or vLLM), decoding |
| `reward` | TRL's `_calculate_rewards`: the reward functions, and the gather of the rewards over ranks |
| `update` | `training_step` (policy forward, loss, backward of every micro-step) and `optimizer.step()` |
| `other` | the rest of the step's wall clock (below) |

`other` holds the rollout's bookkeeping (padding, advantages, rejection and its refill logic, per-prompt statistics;
with N_SGD > 1 TRL's log-prob forward pass over the rollout, and a reference model's), data loading, gradient
clipping, the scheduler, logging, checkpoints and evaluation. The step's wall clock runs from the end of the previous
optimizer step (`on_step_end`) to the end of this one, so the per-step seconds add up to the training time, and `other`
is that wall clock minus the three phases. The logged keys are `time/{phase}_s`, `time/{phase}_share` and
`time/step_s`, each the main process's own timing (averaged over the steps of a logging window when
`logging_steps > 1`).

The timers are CPU clocks (`time.perf_counter`) read when a phase opens or closes: nothing synchronises the device
for them. On CPU they are exact. On CUDA they measure when the *host* got through each phase; device work launched
but not finished when a phase closes is paid at the next point where the host waits for the device, which may lie
in the next phase. Where those points are in TRL 1.16 + transformers 5: generation ends with the tokens copied to
the host (`rollout` holds its own GPU time); transformers checks each micro-step's loss for NaN
(`logging_nan_inf_filter`, on by default), which waits for that micro-step's forward *and* backward (`update` holds
them); `optimizer.step()` is launched asynchronously, so its device time lands in whatever waits next (logging in
`other`, or the next step's rollout). So on CUDA `update` is short by the optimizer's device time, at most, and that
time appears in `other` or `rollout`; with `logging_nan_inf_filter=False` the backward pass can move out of `update`
the same way.

**Accuracy** (`accuracy_metrics`, metrics `accuracy/all`, `accuracy/non_truncated`): the share of scored samples
whose reward is ≥ 1 (the verifier's "correct", as in `prompts.py`), over all samples and over the samples that ended
before the length limit (TRL's truncation rule). Paper Fig. 6 plots both against the truncation ratio (TRL's
`completions/clipped_ratio`).

**Entropy warnings** (`EntropyWatch`): entropy collapse (the entropy stays below a fraction of the target for K steps
while the controller is saturated or off — the paper's §4 remedies are named), and a low start (the entropy of the
first steps is already at or below the target, so the controller holds it up from step 1).

**Skipped steps** (`SkippedStepWatch`): N consecutive optimizer steps without a trainable token (every group rejected,
or every completion masked) — why, and what to check.

**String prompts and a chat template** (`PromptFormatCheck`): when training starts, a warning if the prompts are plain
strings while the tokenizer has a chat template (`data/preflight.plain_prompts_problem`): TRL sends them as raw text.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME

from transformers.utils import logging

from ..data.preflight import plain_prompts_problem
from ..files import write_json_atomic
from ..recipe.entropy import StepWindow
from .reward_checks import NonfiniteRewards

logger = logging.get_logger(__name__)

PHASES = ("rollout", "reward", "update", "other")
TIMED = PHASES[:3]  # measured directly; `other` is the rest of the step


class StepTimer:
    """Wall-clock split of optimizer steps into `PHASES`; each moment goes to the innermost open phase.

    Args:
        clock: seconds, monotonic (`time.perf_counter`; tests pass a scripted clock).

        timer = StepTimer(); timer.start()
        with timer.phase("update"):          # a training step ...
            with timer.phase("rollout"):     # ... that generates: those seconds count as rollout, not update
                ...
        split = timer.end_step()             # {"time/step_s": .., "time/rollout_s": .., "time/rollout_share": .., ...}
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._open: list[str] = []
        self._spent = dict.fromkeys(TIMED, 0.0)
        self._step_start: float | None = None
        self._last: float | None = None

    def start(self) -> None:
        """A step window starts now (training starts or resumes); phases still open keep counting."""
        self._step_start = self._last = self._clock()
        self._spent = dict.fromkeys(TIMED, 0.0)

    def _advance(self) -> None:
        now = self._clock()
        if self._last is None:
            self._step_start = now
        elif self._open and self._open[-1] in self._spent:
            self._spent[self._open[-1]] += now - self._last
        self._last = now

    def enter(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        self._advance()
        self._open.append(phase)

    def exit(self) -> None:
        self._advance()
        self._open.pop()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def end_step(self) -> dict[str, float]:
        """Close the current step: `time/step_s`, `time/{phase}_s` and `time/{phase}_share`; the next step starts
        now."""
        self._advance()
        total = self._last - self._step_start
        seconds = dict(self._spent)
        seconds["other"] = max(total - sum(seconds.values()), 0.0)
        out = {"time/step_s": total}
        for name in PHASES:
            out[f"time/{name}_s"] = seconds[name]
            out[f"time/{name}_share"] = seconds[name] / total if total > 0 else float("nan")
        self._step_start = self._last
        self._spent = dict.fromkeys(TIMED, 0.0)
        return out


class StepTimerCallback(TrainerCallback):
    """Drives a `StepTimer` from transformers' loop: a window per optimizer step, `optimizer.step()` as `update`.

    `sink(split)` receives each step's `StepTimer.end_step()` (the trainer appends it to its metrics), before the
    step's metrics are logged."""

    def __init__(self, timer: StepTimer, sink: Callable[[dict[str, float]], None]):
        self.timer, self.sink = timer, sink

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timer.enter("update")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timer.exit()

    def on_step_end(self, args, state, control, **kwargs):
        self.sink(self.timer.end_step())


class PromptFormatCheck(TrainerCallback):
    """At the start of training (main process, once per run): the warning of `plain_prompts_problem` for the train
    dataset and the tokenizer, before the first step generates anything."""

    def __init__(self):
        self.said = False

    def on_train_begin(self, args, state, control, processing_class=None, train_dataloader=None, **kwargs):
        if self.said or not state.is_world_process_zero or train_dataloader is None:
            return
        self.said = True
        if problem := plain_prompts_problem(getattr(train_dataloader, "dataset", None), processing_class):
            logger.warning(problem)


class SaveFinalState(TrainerCallback):
    """Writes `trainer_state.json` (with the whole `log_history`) into `output_dir` when training ends (main process,
    atomically), so that `or1-trl plot OUTPUT_DIR` reads the complete run: a checkpoint holds it only up to its step,
    and a run without checkpoints has none."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            write_json_atomic(os.path.join(args.output_dir, TRAINER_STATE_NAME), dataclasses.asdict(state))


@contextmanager
def stage_loop_end(handler, final: bool):
    """Scoped to `handler` (this trainer's `CallbackHandler`) during one stage's loop: a stage that is not the last
    (`final=False`) closes only the progress bars at its end (`close_progress_bars`); trackers and the like stay open
    across stages. The handler's own `on_train_end` is back on exit."""
    train_end = handler.on_train_end
    if not final:
        handler.on_train_end = close_progress_bars(handler)
    try:
        yield
    finally:
        handler.on_train_end = train_end


def close_progress_bars(handler):
    """An `on_train_end` for `handler` (a `CallbackHandler`) that ends only its progress bars (`ProgressCallback`):
    what a stage that is not the last calls at its end, so that trackers and the like stay open across stages."""
    from transformers import ProgressCallback

    def on_train_end(args, state, control):
        for callback in handler.callbacks:
            if isinstance(callback, ProgressCallback):
                callback.on_train_end(args, state, control)
        return control

    return on_train_end


def accuracy_metrics(rewards: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """Share of correct samples (reward ≥ 1) among all scored samples and among those not truncated.

    Args:
        rewards: `[N]` each sample's reward (NaN: unscored — every reward function abstained).
        truncated: `[N]` whether the sample hit the length limit.

    Returns `{"accuracy/all": .., "accuracy/non_truncated": ..}`; NaN where no sample qualifies (TRL's `log` leaves
    NaN out of its averages).
    """
    scored = ~torch.isnan(rewards)  # [N]
    correct = (rewards >= 1.0) & scored  # [N]
    finished = scored & ~truncated.bool()  # [N]

    def share(selected: torch.Tensor) -> float:
        count = int(selected.sum())
        return int((correct & selected).sum()) / count if count else float("nan")

    return {"accuracy/all": share(scored), "accuracy/non_truncated": share(finished)}


@dataclass
class EntropyWatch:
    """Two warnings about the entropy the controller steers (paper §3.2.4, §4), each given at most once per run.

    Fed once per optimizer step with the policy's entropy over the kept tokens of the step (`observe`; or summed
    micro-step by micro-step with `add`, then `end_step`).

    - **Collapse**: the entropy stays below `collapse_fraction · target` for `collapse_steps` consecutive measured
      steps while the controller cannot push back — it is off (`adaptive=False`) or saturated (c = c_max). The
      message names the paper's remedies: on-policy updates (N_SGD = 1), a higher temperature, adaptive entropy
      control, a larger c_max.
    - **Low start** (adaptive only): the mean entropy of the first `start_steps` measured steps is already at or
      below the target. The paper's target (0.2) assumes a model whose entropy starts above it; here the controller
      adds the entropy bonus from step 1 and holds the entropy up at the target instead of letting it fall.

    Args:
        target: the controller's `entropy_target` (nats).
        adaptive: whether the controller is on (`use_adaptive_entropy`).
        coef_max: c_max (`entropy_coef_max`).
        collapse_fraction, collapse_steps: the collapse condition; `collapse_steps=0` disables the warning.
        start_steps: steps averaged for the low-start check.
        settings: the run's values of the knobs, quoted in the messages (e.g. `{"N_SGD": 4, "temperature": 1.0}`).
    """

    target: float
    adaptive: bool
    coef_max: float
    collapse_fraction: float = 0.5
    collapse_steps: int = 10
    start_steps: int = 3
    settings: dict[str, object] = field(default_factory=dict)
    _low_run: int = 0
    _first: list[float] = field(default_factory=list)
    _warned_collapse: bool = False
    _warned_start: bool = False
    _step: StepWindow = field(default_factory=StepWindow)  # this rank's [Σ H·m, Σ m] of the current step

    def add(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        """One micro-step's entropies `[b, T]` on its kept tokens `mask` `[b, T]` (this rank), towards the step's."""
        self._step.add(entropies, mask)

    def end_step(self, coef: float, reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
        """`observe` the entropy of the step `add` summed (`reduce`: the sum over ranks, one collective per step;
        None without a kept token); starts the next step."""
        return self.observe(self._step.close(reduce), coef)

    @classmethod
    def for_config(cls, args) -> "EntropyWatch":
        """The watch of a run configured by `args` (an `OR1Config`)."""
        return cls(
            target=args.entropy_target,
            adaptive=args.use_adaptive_entropy,
            coef_max=args.entropy_coef_max,
            collapse_fraction=args.entropy_collapse_fraction,
            collapse_steps=args.entropy_collapse_steps,
            settings={"N_SGD": args.sgd_steps_per_rollout, "temperature": args.temperature,
                      "use_adaptive_entropy": args.use_adaptive_entropy, "entropy_coef_max": args.entropy_coef_max},
        )

    def observe(self, entropy: float | None, coef: float) -> list[str]:
        """One step's entropy (None or NaN: nothing measured, e.g. every group rejected — ignored) and the controller's
        coefficient c after the step. Returns the warnings due now (usually none)."""
        if entropy is None or math.isnan(entropy):
            return []
        messages = []
        if len(self._first) < self.start_steps:
            self._first.append(entropy)
            if len(self._first) == self.start_steps and self.adaptive and not self._warned_start:
                start = sum(self._first) / len(self._first)
                if start <= self.target:
                    self._warned_start = True
                    messages.append(self._low_start_message(start))
        saturated = not self.adaptive or coef >= self.coef_max
        self._low_run = self._low_run + 1 if entropy < self.collapse_fraction * self.target and saturated else 0
        if self.collapse_steps and self._low_run >= self.collapse_steps and not self._warned_collapse:
            self._warned_collapse = True
            messages.append(self._collapse_message(entropy))
        return messages

    def _settings(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.settings.items())

    def _collapse_message(self, entropy: float) -> str:
        state = (f"saturated at entropy_coef_max={self.coef_max:g}" if self.adaptive
                 else "off (use_adaptive_entropy=False)")
        return (
            f"Entropy collapse: the policy's entropy has stayed below {self.collapse_fraction:g} x entropy_target = "
            f"{self.collapse_fraction * self.target:.3g} nats for {self._low_run} steps (now {entropy:.3g}) while the "
            f"entropy controller is {state}. Skywork-OR1 (§4) finds that collapse costs test accuracy and names the "
            "remedies: on-policy updates (N_SGD = 1: num_iterations=1, steps_per_generation = "
            "gradient_accumulation_steps), a higher sampling temperature (temperature), adaptive entropy control "
            "(use_adaptive_entropy=True) and a larger entropy_coef_max."
            + (f" This run: {self._settings()}." if self.settings else "")
        )

    def _low_start_message(self, start: float) -> str:
        return (
            f"The policy's entropy over its first {self.start_steps} steps is {start:.3g} nats, already at or below "
            f"entropy_target={self.target:g}: adaptive entropy control adds the entropy bonus from step 1 and holds "
            "the entropy up at the target instead of letting it fall (the paper's target assumes a model whose "
            "entropy starts above it). If that is not what you want: set entropy_target below the starting entropy, "
            "use_adaptive_entropy=False, or a smaller entropy_coef_max / entropy_coef_delta "
            "(entropy_preset='released')."
            + (f" This run: {self._settings()}." if self.settings else "")
        )


@dataclass
class SkippedStepWatch:
    """A warning, given once per run, when `after` consecutive optimizer steps were skipped (no trainable token on
    any rank, `OR1Trainer.training_step`): training is going nowhere, and the message says why and what to check.

    Fed once per optimizer step (`observe`) with whether it was skipped and the group outcomes of its rollout
    (`rejection.GroupOutcomes`; `None` with rejection sampling off). Why a step is skipped: every group was rejected
    (all its rewards equal: every sample failed, or every one solved it), or — groups kept — every completion was
    masked (`mask_truncated_completions=True` and every completion truncated).

    Args:
        after: consecutive skipped steps before the warning; 0 disables it.
        settings: the run's values of the knobs, quoted in the message (e.g. `{"num_generations": 4}`).
    """

    after: int = 5
    settings: dict[str, object] = field(default_factory=dict)
    _run: int = 0
    _warned: bool = False

    @classmethod
    def for_config(cls, args) -> "SkippedStepWatch":
        return cls(after=args.skipped_steps_warning, settings={
            "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
            "mask_truncated_completions": args.mask_truncated_completions})

    def observe(self, skipped: bool, outcomes=None) -> list[str]:
        """One optimizer step. Returns the warning when it is due (at most once per run), else `[]`."""
        self._run = self._run + 1 if skipped else 0
        if not self.after or self._warned or self._run < self.after:
            return []
        self._warned = True
        return [self._message(outcomes)]

    def _message(self, outcomes) -> str:
        head = (f"The last {self._run} optimizer steps were all skipped: no completion token was left to train on, so "
                "the weights did not move. ")
        settings = f" This run: {', '.join(f'{k}={v!r}' for k, v in self.settings.items())}." if self.settings else ""
        if outcomes is not None and int(outcomes.keep.sum()) == 0:
            n, none, solved = outcomes.num_groups, int(outcomes.solve_none.sum()), int(outcomes.solve_all.sum())
            return head + (
                f"Every group was rejected (all its rewards equal); in the last rollout, of {n} groups {none} had "
                f"every sample fail and {solved} every sample solved" + (f", {n - none - solved} "
                                                                         "other" if n - none - solved
                else "") + ". Check that the reward reads the right gold column and scores a correct answer 1 "
                "(rewards/<name>/mean), that completions can finish within max_completion_length "
                "(completions/clipped_ratio; a truncated completion scores 0), and the prompts' difficulty for this "
                "model (too hard: all fail — the offline difficulty filter; too easy: all solve — the online filter); "
                "more samples per prompt (num_generations) make mixed groups likelier." + settings
            )
        return head + (
            "Groups were kept, but every completion was masked out of the loss: mask_truncated_completions=True and "
            "every completion hit max_completion_length (completions/clipped_ratio = 1). Raise max_completion_length "
            "or set mask_truncated_completions=False." + settings
        )


class RunWatch:
    """Everything `OR1Trainer` shows besides TRL's metrics, in one place: the step's time split (`timer`), the entropy
    and skipped-step warnings (`entropy`, `skipped`) and the inf/NaN reward screen (`nonfinite`, `reward_checks.py`).

    Args:
        args: the trainer's `OR1Config` (the entropy watch runs with OR1's objective only: `OR1Trainer.training_step`).
    """

    def __init__(self, args):
        self.timer = StepTimer()
        self.entropy = EntropyWatch.for_config(args)
        self.skipped = SkippedStepWatch.for_config(args)
        self.nonfinite = NonfiniteRewards()

    def callbacks(self, sink: Callable[[dict[str, float]], None]) -> list[TrainerCallback]:
        """The callbacks the trainer adds: the time split into `sink` each step, the final `trainer_state.json`, and
        the string-prompts check when training starts."""
        return [StepTimerCallback(self.timer, sink), SaveFinalState(), PromptFormatCheck()]

    @classmethod
    def attach(cls, trainer, args, sink: Callable[[dict[str, float]], None]) -> "RunWatch":
        """The trainer's watch for `args`, its `callbacks(sink)` added to `trainer`."""
        watch = cls(args)
        for callback in watch.callbacks(sink):
            trainer.add_callback(callback)
        return watch

    def end_step(self, coef: float, reduce: Callable, rollout) -> list[str]:
        """At an optimizer step's end: the entropy warnings (collapse, low start; `reduce` sums over ranks) and the
        skipped-step warning for the step's `rollout` (`trainer/rollout_record.Rollout`), those that are due."""
        return self.entropy.end_step(coef, reduce) + self.skipped.observe(rollout.skip_update, rollout.outcomes)

    def log_skipped_micro_step(self, metrics: dict[str, list], controller) -> None:
        """A micro-step of a step skipped without a pass (`sharding.UpdateSkip.without_passes`): what it measured —
        nothing (`entropy` NaN, never TRL's 0.0, which would read as a collapse), no row forwarded — and the entropy
        controller's c and α, as a step with zero-weight rows logs them (DeepSpeed, FSDP)."""
        alpha = controller.coefficient()
        metrics["entropy"].append(float("nan"))
        metrics["entropy_coef"].append(controller.coef)
        metrics["entropy/alpha"].append(alpha)
        metrics["entropy/active"].append(float(alpha != 0.0))
        metrics["rejection/rows_forwarded"].append(0.0)

    def log_loss(self, metrics: dict[str, list], gather: Callable, policy_loss: torch.Tensor, alpha: float,
                 entropies: torch.Tensor, mask: torch.Tensor, training: bool) -> None:
        """A micro-step's loss metrics besides TRL's into `metrics` (the trainer's lists of the mode): α, the policy
        loss over ranks (`gather`), and while training the rows forwarded and the entropy watch's input; TRL's
        `entropy` NaN where no rank kept a token. `entropies`, `mask`: `[b, T]`."""
        losses, kept = gather(torch.stack([policy_loss.float(), mask.sum()])[None]).T  # [ranks] each
        if not kept.sum().item():  # no kept token on any rank: TRL's 0.0 `entropy` measured nothing; NaN: not logged
            metrics["entropy"][-1] = float("nan")
        metrics["entropy/alpha"].append(alpha)
        metrics["entropy/active"].append(float(alpha != 0.0))
        metrics["policy_loss"].append(losses.nanmean().item())
        if training:
            metrics["rejection/rows_forwarded"].append(float(mask.size(0)))
            self.entropy.add(entropies.detach(), mask)  # summed over ranks once, at the step's end

    def timed(self, phase: str, training: bool):
        """Charge the block to `phase` of the step's time split (training only: evaluation counts as "other")."""
        return self.timer.phase(phase) if training else nullcontext()


def changed_defaults(args) -> list[str]:
    """The line that says which defaults `OR1Config` (the MAGIC recipe) changes of `GRPOConfig`'s, or none: the
    values OR1 uses (`GRPOConfig`'s are in docs/or1_trainer.md and `args.changed_defaults()`), kept short."""
    changed = args.changed_defaults()
    if not changed:
        return []
    return ["OR1Config's MAGIC defaults, not GRPOConfig's: "
            + ", ".join(f"{name}={value!r}" for name, value, _ in changed) + " (set one to change it)"]
