"""Loading training and evaluation data (`load_data`): a Hub id, a local folder or a local
`.jsonl`/`.json`/`.parquet`/`.csv` file, or TRL's `--dataset_name json --data_files ...`; a missing, empty or
unreadable file is a one-line error. `save_split` writes a split where `load_data` (and `datasets.load_dataset`)
reads it back, atomically.
"""

from __future__ import annotations

import logging
from typing import Any

#: `datasets` builders of local data files, by extension (`load_dataset` infers none from a single file's path).
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _is_local(path: str) -> bool:
    return "://" not in path and not any(c in path for c in "*?[")


def _data_source(name: str | None, data_files) -> tuple[str, Any]:
    """`(path, data_files)` for `datasets.load_dataset`, or a `ValueError` saying what is missing or unreadable."""
    import os

    files = [data_files] if isinstance(data_files, str) else list(data_files or [])
    if files and name is not None and name not in set(FILE_BUILDERS.values()) | {"text", "arrow"}:
        return name, files  # paths inside a folder or a Hub repository: `load_dataset` resolves them
    if files:
        for file in filter(_is_local, files):
            if not os.path.isfile(os.path.expanduser(file)):
                raise ValueError(f"data file {file!r} does not exist")
            if os.path.getsize(os.path.expanduser(file)) == 0:
                raise ValueError(f"data file {file!r} is empty")
        if name is None:
            name = FILE_BUILDERS.get(os.path.splitext(files[0])[1].lower())
            if name is None:
                raise ValueError(f"cannot tell the format of {files[0]!r}: name it with --dataset_name json, parquet "
                                 "or csv")
        return name, [os.path.expanduser(f) if _is_local(f) else f for f in files]
    if name is None:
        raise ValueError("no dataset: pass --dataset_name (a Hub id, a local folder or a .jsonl/.json/.parquet/.csv "
                         "file)")
    path = os.path.expanduser(name)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if suffix not in FILE_BUILDERS:
            raise ValueError(f"dataset file {name!r} is not {', '.join(FILE_BUILDERS)}; convert it, or name its "
                             "format: --dataset_name json --data_files FILE")
        if os.path.getsize(path) == 0:
            raise ValueError(f"dataset file {name!r} is empty")
        return FILE_BUILDERS[suffix], [path]
    if os.path.isdir(path):
        return path, None
    if suffix in FILE_BUILDERS or name.startswith(("/", "./", "../", "~")):
        raise ValueError(f"dataset {name!r} does not exist (resolved to {os.path.abspath(path)!r})")
    return name, None


def _load_failure(exc: BaseException) -> str:
    """What went wrong inside `datasets.load_dataset`, in words (its `DatasetGenerationError` says only "An error
    occurred while generating the dataset": the reason is the exception it was raised from)."""
    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
        if len(chain) > 20:
            break
    if any(isinstance(error, UnicodeDecodeError) for error in chain):
        return "not UTF-8 text (" + str(next(e for e in chain if isinstance(e, UnicodeDecodeError))) + ")"
    error = chain[1] if type(exc).__name__ == "DatasetGenerationError" and len(chain) > 1 else exc
    message = str(error)
    if "corresponds to no data" in message:
        return "no rows"
    if "Couldn't reach" in message:
        why = "HF_HUB_OFFLINE is set" if "OfflineModeIsEnabled" in message else "no network"
        return (f"it is not in the local cache and the Hub cannot be reached ({why}); load it once online, or pass a "
                "local .jsonl/.json/.parquet/.csv file or folder")
    return message or type(error).__name__


def load_data(name: str | None, config: str | None = None, split: str | None = "train", data_files=None):
    """`datasets.load_dataset` for what `--dataset_name` names: a Hub id, a local folder, a local `.jsonl` /
    `.json` / `.parquet` / `.csv` file, or (TRL's form) a builder with files, `name="json", data_files=[...]`
    (`name=None` with `data_files`: the builder their extension names). `split=None`: the first split.

    Everything that can be wrong with the source is a one-line `ValueError` naming it: a missing or empty file, text
    that is not UTF-8 or not JSON, a Hub dataset offline and not cached, a dataset without rows."""
    from datasets import load_dataset

    path, files = _data_source(name, data_files)
    shown = name if name is not None else ", ".join(files)
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_logger.level
    json_logger.setLevel(logging.CRITICAL)  # it logs "Failed to load JSON ..." before raising: our error says it
    try:
        loaded = load_dataset(path, config, split=split, data_files=files)
    except Exception as exc:  # the source's fault, or datasets' own errors (DatasetGenerationError: see its cause)
        ours = isinstance(exc, (ValueError, OSError, StopIteration, ImportError))
        if not ours and type(exc).__module__.split(".")[0] not in ("datasets", "pyarrow"):
            raise
        raise ValueError(f"cannot load dataset {shown!r}: {_load_failure(exc)}") from exc
    finally:
        json_logger.setLevel(level)
    dataset = loaded[next(iter(loaded))] if split is None else loaded
    try:  # Arrow's JSON reader keeps bytes that are not UTF-8 in string columns; they would fail at first use
        dataset.data.table.validate(full=True)
    except Exception as exc:  # pyarrow.ArrowInvalid
        raise ValueError(f"cannot load dataset {shown!r}: not UTF-8 text ({exc})") from exc
    if len(dataset) == 0:
        raise ValueError(f"dataset {shown!r} has no rows (split {split!r})")
    return dataset


def save_split(dataset, output_dir: str, split: str) -> str:
    """Write `dataset` as `<output_dir>/data/<split>-00000-of-00001.parquet` — what `datasets.load_dataset(output_dir,
    split=split)` reads, several splits side by side — under a temporary name first, so an interrupted write leaves
    no half-written file. Returns the path."""
    import os

    path = os.path.join(output_dir, "data", f"{split}-00000-of-00001.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    dataset.to_parquet(tmp)
    os.replace(tmp, path)
    return path
