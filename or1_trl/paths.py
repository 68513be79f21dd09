"""Checks of the paths a user gives, made before anything loads (importing this loads nothing heavy)."""

from __future__ import annotations

import os
import tempfile


def output_dir_problem(output_dir: str) -> str | None:
    """Why a run cannot write to `output_dir`, or `None`: it (or, if it does not exist yet, its nearest existing
    parent) must be a directory where a file can be created. Tested by creating a temporary file, which is removed."""
    path = os.path.abspath(os.path.expanduser(output_dir))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"cannot be created: {existing!r} is a file"
        return f"output_dir {output_dir!r} {where}; pass a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        where = "is" if existing == path else f"cannot be created: {existing!r} is"
        return f"output_dir {output_dir!r} {where} not writable ({exc.strerror}); pass a directory you can write to"
    return None
