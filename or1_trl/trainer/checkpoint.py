"""Checkpoints that are complete or ignored, and an output directory that is never overwritten silently.

**Complete checkpoints.** transformers writes a checkpoint folder in several steps (model, optimizer, RNG,
`trainer_state.json`), TRL then adds `entropy_ctrl_state.json`, and `OR1Trainer` adds its own state files. A kill
between two of these, a full disk, or a crash before the page cache reached the disk leaves a folder that *looks*
like a checkpoint. The rule here:

- each of our state files is written atomically (temporary file, `fsync`, `os.replace`);
- then every file of the folder is flushed to disk (`fsync`, and the folder itself), and only then the marker
  `or1_checkpoint.json` is written: it lists **every file** of the checkpoint (model, optimizer, scheduler, RNG,
  trainer and OR1 state, sub-folders included) with its size and a CRC-32 of its first and last MiB (the whole file
  when it is at most 2 MiB);
- `find_problems(folder, required)` says what is wrong with a folder (empty list: complete): no marker, a listed or
  required file missing, a size or a checksum that differs from the marker's; under DeepSpeed and FSDP the required
  files include every rank's shards (`sharding.checkpoint_layout`), so a rank's missing file is caught too;
- `resolve_resume(...)` is what `resume_from_checkpoint` resumes from: `True` takes the newest checkpoint that
  verifies, logging each newer one it skips and why; an explicit folder must verify.

What the checksum covers, and why not the whole file: the size catches truncation (a kill or a full disk while
writing, a copy cut short) and the ends catch a torn or zeroed head or tail — where the formats keep their index
(safetensors' JSON header is at the start, the zip directory of `torch.save` at the end). A flipped bit in the middle
of a GB-sized tensor is not caught; hashing whole files would read the full checkpoint (the optimizer of a 7B model is
tens of GB) at every save and every resume. CRC-32 itself runs at ~6 GB/s here; the disk read is the cost.

`OR1Trainer` also holds back transformers' checkpoint rotation until the marker is written, so a kill — or a full
disk: `saving(folder)` turns it into one line, "no space left on <dir>", and removes the partial folder — can never
leave the output directory without the complete checkpoint that existed before. The final model's save
(`saving_final`, `run.train_and_save`) says the same line; `or1-trl train` prints it alone, exit status 1.

**Relaunch safety.** `check_output_dir` refuses an output directory holding a previous run's checkpoints or
`prompt_stats.jsonl` unless `resume_from_checkpoint` (continue it) or `overwrite_output_dir` (start over: `start_over`
then removes them) is given, so nothing of a previous run is deleted (by rotation) or truncated silently.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from contextlib import contextmanager, suppress

from transformers.trainer import TRAINER_STATE_NAME, rotate_checkpoints
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..files import TMP_INFIX, fsync, write_json_atomic
from ..generation.server_health import RESYNCS_METRIC, SYNC_BYTES_METRIC, SYNC_SECONDS_METRIC, ServerDownError
from ..recipe.prompts import PromptSchedule
from .sharding import checkpoint_layout

logger = logging.get_logger(__name__)

MARKER_FILE = "or1_checkpoint.json"
MARKER_VERSION = 2
EDGE_BYTES = 1 << 20  # the checksum covers the first and the last MiB of each file
PROMPT_STATS_LOG = "prompt_stats.jsonl"
OR1_STATE_FILE = "or1_state.json"
TRL_ENTROPY_STATE_FILE = "entropy_ctrl_state.json"  # written by GRPOTrainer._save_checkpoint
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


class DiskFullError(OSError):
    """Saving a checkpoint ran out of disk space (the message is one line: "no space left on <dir>: ...")."""


def fingerprint(path: str) -> dict:
    """`{"size": bytes, "crc32": CRC-32 of the first and the last MiB}` (of the whole file up to 2 MiB)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            crc = zlib.crc32(f.read(EDGE_BYTES), crc)
    return {"size": size, "crc32": f"{crc:08x}"}


def _files(folder: str) -> list[str]:
    """Every regular file under `folder` (relative paths), except the marker and leftover temporary files."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MARKER_FILE and TMP_INFIX not in name:
                found.append(rel)
    return sorted(found)


def write_state(folder: str, states: dict[str, dict], required: list[str]) -> None:
    """Write each `{file name: JSON state}` into `folder`, flush every file of the folder to disk, then write the
    marker listing them all with their fingerprints.

    `required` are the files this trainer needs besides `states` (written earlier by transformers and TRL): if one
    is missing the folder is not marked complete.
    """
    for name, state in states.items():
        write_json_atomic(os.path.join(folder, name), state)
    present = _files(folder)
    missing = [name for name in required if not _holds(present, name)]
    if missing:
        raise RuntimeError(f"checkpoint {folder} lacks {missing} after saving: not marking it complete")
    files = {}
    for name in present:
        path = os.path.join(folder, name)
        fsync(path)
        files[name] = fingerprint(path)
    for root, _, _ in os.walk(folder):  # the folders' entries (new names) reach the disk too
        fsync(root)
    checksum = f"crc32 of the first and last {EDGE_BYTES} bytes"
    write_json_atomic(os.path.join(folder, MARKER_FILE),
                      {"version": MARKER_VERSION, "checksum": checksum, "files": files})
    fsync(folder)


def _holds(names, required: str) -> bool:
    """Whether `names` (relative paths) hold `required`: a name, or a glob pattern for sharded layouts whose folder
    names vary (`global_step*/zero_pp_rank_1_mp_rank_00_optim_states.pt`, `sharding.checkpoint_layout`)."""
    return required in names if not glob.has_magic(required) else any(fnmatch.fnmatchcase(n, required) for n in names)


def read_state(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def find_problems(folder: str, required: list[str]) -> list[str]:
    """What is wrong with `folder` as a checkpoint, one reason per problem (empty list: complete).

    Every file the marker lists must be there with its size and checksum; `required` (the files this trainer needs)
    must be listed. Reasons name the file: "optimizer.pt is missing", "model.safetensors is 100 bytes, the marker
    says 1600 (truncated)", "... differs from its checksum (corrupted)"; a folder without the marker (the run stopped
    while saving it) ends with "or1_checkpoint.json is missing".
    """
    if not os.path.isdir(folder):
        return [f"{folder} does not exist"]
    if not os.path.exists(os.path.join(folder, MARKER_FILE)):
        present = _files(folder)
        missing = [f"{name} is missing" for name in required if not _holds(present, name)]
        return [*missing, f"{MARKER_FILE} is missing (the run stopped before the checkpoint was complete)"]
    try:
        marker = read_state(folder, MARKER_FILE)
        listed = marker["files"]
        assert marker["version"] == MARKER_VERSION and isinstance(listed, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return [f"{MARKER_FILE} is unreadable or from an older or1-trl (no file sizes)"]
    problems = [f"{name} is missing" for name in required if not _holds(listed, name)]
    for name, expected in listed.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
            continue
        actual = fingerprint(path)
        if actual["size"] != expected["size"]:
            problems.append(f"{name} is {actual['size']} bytes, the marker says {expected['size']} (truncated or "
                            "changed)")
        elif actual["crc32"] != expected["crc32"]:
            problems.append(f"{name} differs from its checksum in the marker (corrupted)")
    return problems


def checkpoints(output_dir: str) -> list[str]:
    """The `checkpoint-N` folders of `output_dir`, oldest (smallest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_DIR.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def last_complete_checkpoint(output_dir: str, required: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """`(newest checkpoint of output_dir that verifies or None, [(newer folder skipped, why), ...])`."""
    skipped = []
    for folder in reversed(checkpoints(output_dir)):
        problems = find_problems(folder, required)
        if not problems:
            return folder, skipped
        skipped.append((folder, "; ".join(problems)))
    return None, skipped


def _wants_latest(resume_from_checkpoint) -> bool:
    return resume_from_checkpoint is True or (
        isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "latest")
    )


def resolve_resume(output_dir: str, resume_from_checkpoint: str | bool | None, required: list[str]) -> str | None:
    """The folder `Trainer.train(resume_from_checkpoint=...)` should resume from, or None for a fresh start.

    `True` (or the command line's `"true"`) is the newest checkpoint of `output_dir` that verifies; each newer one is
    skipped with a warning saying why. An explicit folder must exist and verify. Otherwise a `ValueError` says why.
    """
    if _wants_latest(resume_from_checkpoint):
        found, skipped = last_complete_checkpoint(output_dir, required)
        for folder, why in skipped:
            logger.warning(f"Skipping {folder} for resume: {why}.")
        if found is None:
            raise ValueError(
                f"No complete checkpoint to resume from in {output_dir}"
                + (f" (incomplete: {[os.path.basename(c) for c, _ in skipped]})." if skipped else ".")
                + " Pass --overwrite_output_dir true to start over."
            )
        if skipped:
            logger.warning(f"Resuming from {found}, the newest complete checkpoint.")
        else:
            logger.info(f"Resuming from {found} (step {_step(found)}), the newest complete checkpoint.")
        return found
    if resume_from_checkpoint:
        if not os.path.exists(resume_from_checkpoint):
            raise ValueError(f"resume_from_checkpoint {resume_from_checkpoint} does not exist.")
        problems = find_problems(resume_from_checkpoint, required)
        if problems:
            raise ValueError(
                f"Checkpoint {resume_from_checkpoint} is incomplete: {problems[0]}, so resuming from it would fail or "
                "silently reset state. Resume from an earlier checkpoint, or pass resume_from_checkpoint=True to take "
                "the newest complete one."
            )
        logger.info(f"Resuming from {resume_from_checkpoint} (step {_step(resume_from_checkpoint)}).")
        return resume_from_checkpoint
    return None


def without_tied_keys(model, load_result):
    """transformers' `load_result` (torch's `_IncompatibleKeys`) of loading a checkpoint into `model`, less the missing
    keys that are weights tied to one the checkpoint holds: SmolLM2's `lm_head.weight` *is* its embeddings' tensor
    (one parameter under two names), which safetensors saves once, so loading the embeddings loaded the head and
    nothing is missing. Tied means the same parameter object now, after loading; a missing key whose tie does not
    hold (another name, a separate tensor) stays, and transformers warns about it as before."""
    names_of: dict[int, list[str]] = {}  # id(parameter) -> every name it has
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    missing = set(load_result.missing_keys)
    loaded_through_a_tie = {name for names in names_of.values() if any(other not in missing for other in names)
                            for name in names if name in missing}
    return load_result._replace(missing_keys=[key for key in load_result.missing_keys
                                              if key not in loaded_through_a_tie])


def _step(folder: str) -> int | str:
    """The step a complete checkpoint `folder` holds (its `trainer_state.json`), "?" if unreadable."""
    try:
        return read_state(folder, TRAINER_STATE_NAME)["global_step"]
    except (OSError, ValueError, KeyError):
        return "?"


# ---------------------------------------------------------------------------------------------------------------
# Relaunch safety
# ---------------------------------------------------------------------------------------------------------------


def previous_run(output_dir: str) -> list[str]:
    """What a previous run left in `output_dir` that a new one would delete or truncate: its `checkpoint-N` folders
    (rotation removes them) and a non-empty `prompt_stats.jsonl` (a fresh run restarts it)."""
    found = [os.path.basename(folder) for folder in checkpoints(output_dir)]
    stats = os.path.join(output_dir, PROMPT_STATS_LOG)
    if os.path.isfile(stats) and os.path.getsize(stats) > 0:
        found.append(PROMPT_STATS_LOG)
    return found


def check_output_dir(output_dir: str, resume_from_checkpoint: str | bool | None, overwrite_output_dir: bool) -> None:
    """Refuse, with a `ValueError` (one line), a launch that would silently destroy or misuse what is on disk:

    - `output_dir` holds a previous run (`previous_run`) and neither `resume_from_checkpoint` nor
      `overwrite_output_dir` says what to do with it;
    - both are given (continue *and* start over);
    - an explicit `resume_from_checkpoint` folder that does not exist, or `True` with no checkpoint in `output_dir`.

    Cheap (no file is read): the CLI calls it before the model loads, `OR1Trainer.train` before training.
    """
    latest = _wants_latest(resume_from_checkpoint)
    if resume_from_checkpoint and overwrite_output_dir:
        raise ValueError(
            "--resume_from_checkpoint (continue the run) and --overwrite_output_dir true (start over) contradict each "
            "other: pass one of them."
        )
    if resume_from_checkpoint and not latest and not os.path.exists(resume_from_checkpoint):
        raise ValueError(f"resume_from_checkpoint {resume_from_checkpoint} does not exist.")
    if latest and not checkpoints(output_dir):
        raise ValueError(
            f"--resume_from_checkpoint true: {output_dir} holds no checkpoint-N folder to resume from "
            "(drop the flag to start a new run there)."
        )
    found = previous_run(output_dir)
    if found and not resume_from_checkpoint and not overwrite_output_dir:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        if found == [PROMPT_STATS_LOG]:  # killed before its first checkpoint: nothing to continue from
            raise ValueError(
                f"{output_dir} holds a previous run's {PROMPT_STATS_LOG} but no checkpoint, so "
                "--resume_from_checkpoint true cannot continue it: pass --overwrite_output_dir true to start over and "
                "delete it (OR1Config(overwrite_output_dir=True)), or choose another --output_dir."
            )
        raise ValueError(
            f"{output_dir} holds a previous run ({shown}): pass --resume_from_checkpoint true to continue it "
            "(train(resume_from_checkpoint=True)), or --overwrite_output_dir true to start over and delete them "
            "(OR1Config(overwrite_output_dir=True)), or choose another --output_dir."
        )


def start_over(output_dir: str) -> list[str]:
    """Remove what a previous run left in `output_dir` (`previous_run`); returns what was removed."""
    found = previous_run(output_dir)
    for name in found:
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return found


def prepare_output_dir(output_dir: str, resume_from_checkpoint, overwrite_output_dir: bool,
                       main_process: bool) -> None:
    """At the start of training: `check_output_dir`, then, with `overwrite_output_dir`, `start_over` (main process)."""
    check_output_dir(output_dir, resume_from_checkpoint, overwrite_output_dir)
    if overwrite_output_dir and main_process:
        removed = start_over(output_dir)
        if removed:
            logger.warning(f"overwrite_output_dir=True: starting over in {output_dir}, removed the previous run's "
                           f"{removed}.")


# ---------------------------------------------------------------------------------------------------------------
# Full disk
# ---------------------------------------------------------------------------------------------------------------


def _disk_full(exc: BaseException, folder: str) -> bool:
    """Whether `exc`, raised while saving into `folder`, is the disk running full.

    safetensors and `open` say so (ENOSPC/EDQUOT, "No space left"); `torch.save` does not ("unexpected pos 576 vs
    534"), so a disk left with less than one MiB free after the error counts too.
    """
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "os error 28" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    existing = folder if os.path.isdir(folder) else os.path.dirname(folder)
    try:
        return shutil.disk_usage(existing).free < EDGE_BYTES
    except OSError:
        return False


@contextmanager
def saving(folder: str):
    """Around the writing of checkpoint `folder`: a full disk becomes a one-line `DiskFullError` ("no space left on
    <dir>: ..."), and the partial folder is removed, so the previous complete checkpoint stays the one to resume from.

    A marker already in `folder` (a resumed run saving over a step it had saved before) is removed first: the folder
    is no longer complete until its new marker is written."""
    try:
        with suppress(FileNotFoundError):
            os.remove(os.path.join(folder, MARKER_FILE))
        yield
    except Exception as exc:
        if not _disk_full(exc, folder):
            raise
        shutil.rmtree(folder, ignore_errors=True)
        output_dir = os.path.dirname(folder)
        raise DiskFullError(
            f"no space left on {output_dir}: {os.path.basename(folder)} was not saved (its partial folder is "
            f"removed); free space, then --resume_from_checkpoint true ({_resume_hint(output_dir)})."
        ) from None


def _resume_hint(output_dir: str) -> str:
    earlier = [os.path.basename(c) for c in checkpoints(output_dir) if os.path.exists(os.path.join(c, MARKER_FILE))]
    return f"resume from {earlier[-1]}" if earlier else "no earlier checkpoint to resume from"


@contextmanager
def saving_final(output_dir: str):
    """Around the final `save_model(output_dir)`: a full disk becomes a one-line `DiskFullError` ("no space left on
    <dir>: the final model was not saved ..."); the checkpoints stay as they are."""
    try:
        yield
    except Exception as exc:
        if not _disk_full(exc, output_dir):
            raise
        raise DiskFullError(
            f"no space left on {output_dir}: the final model was not saved (its files there may be partial); free "
            f"space, then --resume_from_checkpoint true ({_resume_hint(output_dir)}) saves it again."
        ) from None


@contextmanager
def stop_with_checkpoint(trainer):
    """Around a rollout of `trainer` (an `OR1Trainer`): record `vllm/resyncs` (resyncs so far) and, after a disk push,
    `vllm/sync_seconds/<phase>` and `vllm/sync_bytes`; on `ServerDownError` (raised on every
    rank together) save a complete checkpoint of the last finished step, unless one is there, and stop with one
    line."""
    try:
        yield
    except ServerDownError as error:
        step = trainer.state.global_step
        folder = os.path.join(trainer._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if find_problems(folder, trainer._checkpoint_files()):
            trainer._save_checkpoint(trainer.model, trial=None)
        raise ServerDownError(
            f"{error}: training stopped at step {step}, {os.path.basename(folder)} is complete (nothing lost); "
            "restart the server (or1-trl serve ...), then resume with --resume_from_checkpoint true."
        ) from None
    generation = getattr(trainer, "vllm_generation", None)
    resyncs = getattr(generation, "resyncs", None)
    if resyncs is not None and trainer.model.training:  # the run's count so far (one value per logged step)
        trainer._metrics["train"][RESYNCS_METRIC] = [float(resyncs)]
    breakdown = getattr(generation, "sync_breakdown", None)
    if breakdown is not None:  # a disk push happened in this rollout: its seconds per phase and bytes, logged once
        generation.sync_breakdown = None
        if trainer.model.training:
            for name, value in breakdown.items():
                metric = SYNC_BYTES_METRIC if name == "bytes" else f"{SYNC_SECONDS_METRIC}/{name}"
                trainer._metrics["train"][metric] = [float(value)]


# --- What an `OR1Trainer` checkpoint holds besides transformers' and TRL's files
def required_files(trainer) -> list[str]:
    """Every file a checkpoint of `trainer` (an `OR1Trainer`) must hold to be resumed from."""
    schedule = PromptSchedule.STATE_FILES if trainer.prompt_schedule else ()
    entropy = [TRL_ENTROPY_STATE_FILE] if trainer.use_adaptive_entropy else []
    return [TRAINER_STATE_NAME, OR1_STATE_FILE, *schedule, *entropy, *checkpoint_layout(trainer.accelerator)]


def or1_state(trainer) -> dict[str, dict]:
    """`{file name: JSON state}` of `trainer`'s own state: its counters and its prompt schedule's."""
    counters = {"skipped_steps": trainer.or1_skipped_steps, "rows_forwarded": trainer.or1_rows_forwarded,
                "nonfinite": trainer.sentinel.state()}  # the non-finite sentinel's counts (`nonfinite.py`)
    return {OR1_STATE_FILE: counters, **(trainer.prompt_schedule.state() if trainer.prompt_schedule else {})}


def load_or1_state(trainer, folder: str) -> None:
    """Restore `trainer`'s own state from the complete checkpoint `folder`, before `Trainer.train` builds the data
    loader."""
    counters = read_state(folder, OR1_STATE_FILE)
    trainer.or1_skipped_steps, trainer.or1_rows_forwarded = counters["skipped_steps"], counters["rows_forwarded"]
    if "nonfinite" in counters:  # a checkpoint of an earlier version has none: the counts start from 0
        trainer.sentinel.load_state(counters["nonfinite"])
    if trainer.prompt_schedule is not None:
        states = {name: read_state(folder, name) for name in PromptSchedule.STATE_FILES}
        trainer.prompt_schedule.load_state(states, truncate_log=trainer.accelerator.is_main_process)


def save_complete(trainer, save: Callable[[], None], trial) -> None:
    """`trainer._save_checkpoint`: transformers' and TRL's files (`save`, the wrapped method), then ours and the
    marker; transformers' rotation (`args.save_total_limit`, scoped to this call) waits until the checkpoint is
    complete. A full disk: one line, and the previous checkpoint stays the one to resume (`saving`)."""
    save_total_limit, trainer.args.save_total_limit = trainer.args.save_total_limit, None
    run_dir = trainer._get_output_dir(trial=trial)
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    with saving(folder):
        try:
            save()
        finally:
            trainer.args.save_total_limit = save_total_limit
        trainer.accelerator.wait_for_everyone()  # every rank's files are written before the marker lists them
        if not trainer.args.should_save:
            return
        write_state(folder, or1_state(trainer), trainer._checkpoint_files())
    rotate_checkpoints(output_dir=run_dir, save_total_limit=save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
