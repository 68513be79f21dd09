"""Complete checkpoints: a `checkpoint-N` folder counts only once all of its state is on disk.

transformers writes a checkpoint folder in several steps (model, optimizer, RNG, `trainer_state.json`), TRL then
adds `entropy_ctrl_state.json`, and `OR1Trainer` adds its own state files. A kill between any two of these leaves a
folder that *looks* like a checkpoint, and `resume_from_checkpoint=True` would take it, silently resetting whatever
was not written yet (the entropy controller, our counters, and — from the stage/pool issue on — the stage, the
prompt pool and the statistics).

The rule here: each state file is written atomically (temporary file, then `os.replace`), and the marker
`or1_checkpoint.json` — which lists every file the checkpoint must hold — is written *last*. A folder without the
marker, or with a listed file missing, is incomplete:

- `last_complete_checkpoint(output_dir, required)` is what `resume_from_checkpoint=True` resumes from;
- `missing_files(folder, required)` names what an incomplete folder lacks (an explicit resume from it is an error).

`OR1Trainer` also holds back transformers' checkpoint rotation until the marker is written, so a kill can never
leave the output directory without a complete checkpoint that existed before.
"""

from __future__ import annotations

import json
import os
import re

MARKER_FILE = "or1_checkpoint.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def write_json_atomic(path: str, data) -> None:
    """Write `data` as JSON to `path` so that `path` holds either its old content or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_state(folder: str, states: dict[str, dict], required: list[str]) -> None:
    """Write each `{file name: JSON state}` into `folder`, then the completeness marker listing `required`.

    `required` are every file the checkpoint must contain: `states`' files plus those written earlier by
    transformers and TRL.
    """
    for name, state in states.items():
        write_json_atomic(os.path.join(folder, name), state)
    missing = [name for name in required if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise RuntimeError(f"checkpoint {folder} lacks {missing} after saving: not marking it complete")
    write_json_atomic(os.path.join(folder, MARKER_FILE), {"files": sorted(set(required) | set(states))})


def read_state(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def missing_files(folder: str, required: list[str]) -> list[str]:
    """What `folder` lacks to be a complete checkpoint (empty list: complete).

    `required` are the files this trainer needs; the marker's own list (the files that were there when the
    checkpoint was written) is checked too. The marker, written last, is named last.
    """
    listed: list[str] = []
    marker = os.path.join(folder, MARKER_FILE)
    if os.path.exists(marker):
        try:
            listed = read_state(folder, MARKER_FILE)["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return [MARKER_FILE]
    names = list(dict.fromkeys([*required, *listed]))
    missing = [name for name in names if not os.path.exists(os.path.join(folder, name))]
    if not os.path.exists(marker):
        missing.append(MARKER_FILE)
    return missing


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


def last_complete_checkpoint(output_dir: str, required: list[str]) -> str | None:
    """The newest complete checkpoint of `output_dir` (None if there is none)."""
    for folder in reversed(checkpoints(output_dir)):
        if not missing_files(folder, required):
            return folder
    return None


def resolve_resume(output_dir: str, resume_from_checkpoint: str | bool | None, required: list[str]) -> str | None:
    """The folder `Trainer.train(resume_from_checkpoint=...)` should resume from, or None for a fresh start.

    `True` (or the command line's `"true"`) is the newest *complete* checkpoint of `output_dir`; an explicit folder
    must be complete. Either way a clear `ValueError` says what is missing.
    """
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "latest"):
        resume_from_checkpoint = True
    if resume_from_checkpoint is True:
        found = last_complete_checkpoint(output_dir, required)
        if found is None:
            incomplete = checkpoints(output_dir)
            raise ValueError(
                f"No complete checkpoint to resume from in {output_dir}"
                + (f" (incomplete: {[os.path.basename(c) for c in incomplete]})." if incomplete else ".")
            )
        return found
    if resume_from_checkpoint:
        missing = missing_files(resume_from_checkpoint, required)
        if missing:
            raise ValueError(
                f"Checkpoint {resume_from_checkpoint} is incomplete: {missing[0]} is missing (the run was probably "
                "stopped while saving it), so resuming from it would silently reset state. Resume from an earlier "
                "checkpoint, or pass resume_from_checkpoint=True to take the newest complete one."
            )
        return resume_from_checkpoint
    return None
