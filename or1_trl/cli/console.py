"""What `or1-trl train` and `or1-trl demo` show on the console while they train, and what they keep off it. The
line per step is `or1_trl.trainer.step_printer`'s (`StepPrinter`, `show_steps`); here:

- `closing_lines`: where the run's outputs are and what to run next, when training ends.
- `interrupted_line`: Ctrl-C during training ends with this one line (exit status 130) instead of a traceback.
- `quiet_deprecations`: transformers' `gradient_checkpointing` FutureWarnings, which TRL's own calls raise at every
  step (TRL's generation toggles checkpointing by the deprecated names), kept off the screen while a command trains.
- `console_output`: all of `or1-trl train`'s console settings for its duration: `quiet_deprecations`, and or1-trl's
  one-line decisions shown (its loggers at INFO on the main process unless `--log_level` says otherwise: the
  weight-sync directory and what is synced, the log-prob backend, the checkpoint a resume took). A tied head
  "missing" from a checkpoint is the trainer's to keep quiet (`checkpoint.without_tied_keys`), for every caller.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

#: transformers 5 deprecates `gradient_checkpointing*` for `activation_checkpointing*`; TRL 1.16 uses the old names.
GRADIENT_CHECKPOINTING_DEPRECATION = r"`(is_)?gradient_checkpointing(_enable|_disable|_kwargs)?` is deprecated"


def closing_lines(output_dir: str, step: int, max_steps: int, seconds: float | None, checkpoints: list[str],
                  pushed_to: str | None = None, benchmark: str | None = None) -> list[str]:
    """What a finished run left in `output_dir` and what to run next (the main process prints them): `checkpoints`
    the complete ones, `pushed_to` where `push_to_hub` put the model, `benchmark` the training file (a local one),
    which `or1-trl eval` takes as it is."""
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    shown = ", ".join(os.path.basename(c) for c in checkpoints[-2:]) or "none (save_strategy)"
    lines = [
        f"Training ended at step {step} of {max_steps}{took}. In {output_dir}:",
        f"  the model and tokenizer     AutoModelForCausalLM.from_pretrained({output_dir!r})",
        f"  {'checkpoint-N':<26}  complete checkpoints ({shown}): --resume_from_checkpoint true continues from the "
        "newest",
        f"  {'prompt_stats.jsonl':<26}  each prompt's samples and accuracy, step by step (or1-trl select-examples "
        "ranks them)",
        f"  {'trainer_state.json':<26}  every logged metric",
        "Next:",
        f"  or1-trl eval --model {output_dir} --benchmarks {benchmark or 'TEST.jsonl'}   ("
        + ("the training file; better a held-out one in its format" if benchmark
           else "a held-out file in the training "
           "format") + ", or aime24 aime25 math500)",
        f"  or1-trl plot {output_dir}   (entropy, accuracy, time split, prompt pool as PNGs)",
    ]
    lines.append(f"  pushed to the Hub: {pushed_to}" if pushed_to else
                 "  to the Hub: the same command with --push_to_hub true --hub_model_id NAME, or "
                 "trainer.push_to_hub()")
    return lines


def interrupted_line(output_dir: str, step: int, max_steps: int, complete: str | None, incomplete: list[str]) -> str:
    """The one line of a run stopped by Ctrl-C at `step`: the newest `complete` checkpoint and how to continue."""
    where = f"Interrupted at step {step} of {max_steps}"
    if complete is None:
        return (f"{where}, before its first complete checkpoint: nothing to resume; run the command again with "
                "--overwrite_output_dir true to start over in " + output_dir + ".")
    names = ", ".join(os.path.basename(c) for c in incomplete)
    skipped = f" ({names} is incomplete: resuming skips it)" if incomplete else ""
    return (f"{where}: {os.path.basename(complete)} is complete{skipped}; continue with the same command and "
            "--resume_from_checkpoint true.")


@contextlib.contextmanager
def quiet_deprecations():
    """Inside: transformers' `gradient_checkpointing` FutureWarnings are not shown (TRL raises them, the user cannot
    act on them); every other warning is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator is found",
                                category=UserWarning)  # a CPU run: pinning has nothing to pin for
        yield


@contextlib.contextmanager
def stop_on_interrupt(parser, trainer=None):
    """Inside: Ctrl-C (`KeyboardInterrupt`) ends the command with exit status 130 and one line on the main process —
    `interrupted_line` for `trainer`'s run, or "interrupted before training started" — instead of a traceback; with
    `OR1_DEBUG=1` the traceback shows."""
    from ..trainer.checkpoint import last_complete_checkpoint, required_files
    from .parsing import debug

    try:
        yield
    except KeyboardInterrupt:
        if debug():
            raise
        if trainer is None:
            main = os.environ.get("RANK", "0") == "0"
            parser.exit(130, f"{parser.prog}: interrupted before training started.\n" if main else None)
        args, state = trainer.args, trainer.state
        complete, skipped = last_complete_checkpoint(args.output_dir, required_files(trainer))
        line = interrupted_line(args.output_dir, state.global_step, state.max_steps, complete, [f for f, _ in skipped])
        parser.exit(130, f"{parser.prog}: {line}\n" if trainer.is_world_process_zero() else None)


@contextlib.contextmanager
def console_output(args):
    """`or1-trl train`'s console for the block: `quiet_deprecations`; or1-trl's loggers at INFO on the main process
    (`args.log_level` when set, `args.log_level_replica` elsewhere) through one handler printing the message alone.
    All undone on exit."""
    main = args.process_index == 0
    name = args.log_level if main else args.log_level_replica
    # transformers' level names are Python's ("debug" ... "critical"), and "passive": ours show INFO on the main
    # process
    level = getattr(logging, name.upper()) if name != "passive" else (logging.INFO if main else logging.WARNING)
    package = logging.getLogger("or1_trl")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous = package.level
    package.setLevel(level)
    package.addHandler(handler)
    try:
        with quiet_deprecations():
            yield
    finally:
        package.removeHandler(handler)
        package.setLevel(previous)
