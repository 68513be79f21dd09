"""The files of one weight push: safetensors shards streamed to disk as the tensors come, in places no other user can
tamper with.

- `write_safetensors`: each tensor's bytes go into the open shard as the iterator yields it (`_Shard`: `HEADER_BYTES`
  of room first, the header written last, space-padded as the format allows), cast to the server's dtype
  (`sync_torch_dtype`); at most one tensor is held besides the caller's. Each file is a standard safetensors file.
- `private_dir`: the default sync directory on tmpfs: an unpredictable name made exclusively, mode 0700, in this
  user's folder there (`or1_private.user_dir`, `/dev/shm/or1-trl-<uid>`, the server's default sync root); the weight
  files in it are written 0600 (`PRIVATE_FILE_MODE`). It holds a record of the run that made it (`RUN_RECORD`).
- `remove_ended_runs`: a run killed before its exit hook ran (`kill -9`, an OOM kill) leaves its folder, the size
  of its weights, in RAM until reboot; the next run of the user removes the folders of runs that provably ended.
- `create_file` never writes through something planted at a path (`O_EXCL`); `remove_path` removes a symlink itself,
  never what it points to.

The disk weight sync (`disk_sync.DiskWeightSync`) writes every push with these.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable

import torch

from .vllm_ext.or1_private import open_parent_problem, user_dir

SHARD_BYTES = 2 * 2**30  # safetensors shard size (tensor bytes per file)
#: Header room reserved at the start of each shard: the header is written last (space-padded, as the safetensors
#: format allows), so tensors stream into the file as they come. A shard closes early when its header would not fit.
HEADER_BYTES = 2**18
#: Name prefix of the private tmpfs directory (`private_dir`): a random suffix follows, so no name can be planted.
TMPFS_PREFIX = "or1-trl-vllm-sync-"
#: The file in each `private_dir` naming the process that made it: `"<pid> <start> <boot id> <pid namespace>"`
#: (`run_identity`), so that a later run can tell a folder whose run ended from one in use (`remove_ended_runs`).
RUN_RECORD = ".or1-run"
#: Mode of the weight files in that directory (the server, which read the probe there, runs as this user); elsewhere
#: (`vllm_sync_dir`, `<output_dir>/_vllm_sync`) files get 0o666 less the umask, as any saved model.
PRIVATE_FILE_MODE = 0o600

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def sync_torch_dtype(name: str | None) -> torch.dtype | None:
    """`"bfloat16"` -> `torch.bfloat16`; `None` or `"model"`: `None` (no cast)."""
    if name in (None, "model"):
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"not a floating-point torch dtype: {name!r}")
    return dtype


class _Shard:
    """One `.safetensors` file written as tensors arrive: data first (after `HEADER_BYTES` of room), header last."""

    def __init__(self, path: str, mode: int = 0o666):
        self.path = path
        self.file = create_file(path, mode, buffering=0)  # each tensor goes straight to the file
        self.file.seek(8 + HEADER_BYTES)
        self.header = {"__metadata__": {"format": "pt"}}
        self.header_size = len(json.dumps(self.header))
        self.offset = 0

    def entry(self, tensor: torch.Tensor) -> dict:
        nbytes = tensor.numel() * tensor.element_size()
        return {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                "data_offsets": [self.offset, self.offset + nbytes]}

    def fits(self, name: str, tensor: torch.Tensor) -> bool:
        return self.header_size + len(json.dumps({name: self.entry(tensor)})) + 1 <= HEADER_BYTES

    def add(self, name: str, tensor: torch.Tensor) -> int:
        entry = self.entry(tensor)
        self.header[name] = entry
        self.header_size += len(json.dumps({name: entry})) + 1
        if tensor.numel():  # the tensor's own memory, no copy (a CPU tensor already in the right dtype)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
            while view:  # an unbuffered write may be short (Linux caps one at ~2 GiB)
                view = view[self.file.write(view):]
        self.offset = entry["data_offsets"][1]
        return self.offset - entry["data_offsets"][0]

    def close(self) -> None:
        header = json.dumps(self.header, separators=(",", ":")).encode()
        self.file.seek(0)
        self.file.write(HEADER_BYTES.to_bytes(8, "little") + header.ljust(HEADER_BYTES, b" "))
        self.file.close()


def create_file(path: str, mode: int = 0o666, text: bool = False, **kwargs):
    """`open(path, "wb")` (`text`: `"w"`) for a file that must not exist yet (`O_EXCL`: a file or a symlink planted
    at `path` is an error, never written through), created with `mode` (less the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    return open(fd, "w" if text else "wb", **kwargs)


def remove_path(path: str) -> None:
    """Remove whatever is at `path`: a directory tree, a file, or a symlink itself (never what it points to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def private_dir(parent: str | None = None, prefix: str = TMPFS_PREFIX) -> str:
    """A new directory in `parent` (default: `user_dir()`, this user's folder on tmpfs) that only this user can
    enter, for the weights on shared tmpfs, holding `RUN_RECORD` (this process).

    Its name is unpredictable and it is created exclusively (`tempfile.mkdtemp`: a random suffix, `mkdir` that fails
    on anything already there, mode 0700), so nothing another user plants at a name they can compute — a symlink to
    their directory, a file — is ever used. `parent` must be a directory owned by root or this user, and sticky
    wherever others may write to it (`or1_private.open_parent_problem`), so that no one else can rename the directory
    away and put a link in its place. `OSError` saying what is wrong otherwise."""
    real = os.path.realpath(parent or user_dir())
    info = os.stat(real)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{parent} is not a directory")
    problem = open_parent_problem(real)
    if problem:
        raise PermissionError(problem)
    path = tempfile.mkdtemp(prefix=prefix, dir=real)
    made = os.lstat(path)
    if not stat.S_ISDIR(made.st_mode) or made.st_uid != os.getuid():  # nothing but mkdir's own directory passes
        raise PermissionError(f"{path} is not the directory this process created")
    os.chmod(path, 0o700)  # mkdtemp's mode less the umask: exactly 0700
    with create_file(os.path.join(path, RUN_RECORD), PRIVATE_FILE_MODE, text=True) as f:
        f.write(run_identity())
    return path


def _proc_start(pid: int | str) -> str | None:
    """When process `pid` started (clock ticks after boot, `/proc/<pid>/stat` field 22), `None` if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # fields after the command name start at field 3
    except (OSError, IndexError):
        return None


def _machine() -> str | None:
    """This boot of this machine and this process's pid namespace, in which pids and start times mean something."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def run_identity(pid: int | None = None) -> str:
    """`"<pid> <start> <boot id> <pid namespace>"` of process `pid` (default: this one), as `RUN_RECORD` holds it;
    `?` for what `/proc` does not tell."""
    pid = os.getpid() if pid is None else pid
    return f"{pid} {_proc_start(pid) or '?'} {_machine() or '? ?'}"


def run_ended(record: str) -> bool:
    """Whether the run `record` (`run_identity`) names has provably ended: it ran in this boot and pid namespace,
    and its pid is gone or now a process that started at another time (a pid taken again). Anything else — a run in
    another container, a record that does not parse — is not provably ended."""
    fields = record.split()
    if len(fields) != 4 or not fields[0].isdigit() or "?" in fields or " ".join(fields[2:]) != _machine():
        return False
    return _proc_start(int(fields[0])) != fields[1]


def _ended_run_bytes(parent_fd: int, name: str) -> int | None:
    """The bytes held by the folder `name` (in the folder open as `parent_fd`) if it is the sync folder of a run that
    provably ended: a folder itself (never a link), this user's, mode 0700, whose `RUN_RECORD` (a regular file of
    this user's, not a link) says so (`run_ended`); else `None`."""
    info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) != 0o700:
        return None
    folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        opened = os.fstat(folder)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            return None
        with open(os.open(RUN_RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)) as f:
            record = os.fstat(f.fileno())
            if not stat.S_ISREG(record.st_mode) or record.st_uid != os.geteuid() or not run_ended(f.read(512)):
                return None
        return sum(os.stat(file, dir_fd=fd, follow_symlinks=False).st_size
                   for _, _, files, fd in os.fwalk(dir_fd=folder) for file in files)
    finally:
        os.close(folder)


def remove_ended_runs(parent: str | None = None, prefix: str = TMPFS_PREFIX) -> tuple[list[str], int]:
    """Remove from `parent` (default: `user_dir()`) the `private_dir` folders of runs that provably ended
    (`_ended_run_bytes`: ours, 0700, a record of a process that is gone), never following a link: each is checked
    and removed through file descriptors (`shutil.rmtree(dir_fd=...)`, which does not follow links inside either).
    Anything else is left alone, including whatever cannot be read. Returns `(paths removed, bytes freed)`."""
    parent = parent or user_dir()
    removed, freed = [], 0
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in sorted(os.listdir(parent_fd)):
            if not name.startswith(prefix):
                continue
            try:
                size = _ended_run_bytes(parent_fd, name)
                if size is None:
                    continue
                shutil.rmtree(name, dir_fd=parent_fd)
            except OSError:  # gone meanwhile, unreadable: not ours to judge
                continue
            removed.append(os.path.join(parent, name))
            freed += size
    finally:
        os.close(parent_fd)
    return removed, freed


def write_safetensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str, shard_bytes: int = SHARD_BYTES,
    dtype: torch.dtype | None = None, mode: int = 0o666,
) -> tuple[int, int]:
    """Write `(name, tensor)` pairs as `model-NNNNN.safetensors` shards into `directory` (created), cast to `dtype`
    (floating-point tensors only; `None`: as they are). Each file is new (`create_file`: one already there is an
    error) and gets `mode` less the umask.

    Streaming: each tensor's bytes go into the open shard as soon as the iterator yields it (a CPU tensor already in
    `dtype` is written from its own memory; others are copied to CPU one at a time), so at most one tensor is held
    besides the caller's — a gathered ZeRO-3/FSDP parameter is released by the caller's iterator right after. A
    shard closes after `shard_bytes` of tensors; each file is a standard safetensors file (header space-padded).
    Returns `(tensors, bytes)`."""
    os.makedirs(directory, exist_ok=True)
    shard: _Shard | None = None
    count = total = index = 0
    try:
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            if tensor.device.type != "cpu" or tensor.dtype != target:
                tensor = tensor.to("cpu", target)
            tensor = tensor.contiguous()
            if shard is not None and (shard.offset >= shard_bytes or not shard.fits(name, tensor)):
                shard.close()
                shard = None
            if shard is None:
                index += 1
                shard = _Shard(os.path.join(directory, f"model-{index:05d}.safetensors"), mode)
                if not shard.fits(name, tensor):
                    raise ValueError(f"tensor name too long for a safetensors header: {name[:100]!r}...")
            total += shard.add(name, tensor)
            count += 1
    finally:
        if shard is not None:
            shard.close()
    return count, total
