"""Files that are whole or absent: JSON written atomically (temporary file, `fsync`, `os.replace`), and `fsync` of a
path (a file or a folder). Used by checkpoints, the final `trainer_state.json`, `or1-trl eval`'s summary and
`or1-trl select-examples`'s `selection.json`."""

from __future__ import annotations

import json
import os

#: In the name of a temporary file while it is written (`<path>.tmp-<pid>`); a leftover one is not a result.
TMP_INFIX = ".tmp-"


def fsync(path: str) -> None:
    """Flush `path` (a file or a folder: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, data) -> None:
    """Write `data` as JSON to `path` so that `path` holds either its old content or the whole new one."""
    tmp = f"{path}{TMP_INFIX}{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
