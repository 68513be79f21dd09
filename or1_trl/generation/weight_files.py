"""The files of one weight push: safetensors shards streamed to disk as the tensors come, in places no other user can
tamper with.

- `write_safetensors`: each tensor's bytes go into the open shard as the iterator yields it (`_Shard`: `HEADER_BYTES`
  of room first, the header written last, space-padded as the format allows), cast to the server's dtype
  (`sync_torch_dtype`); at most one tensor is held besides the caller's. Each file is a standard safetensors file.
- `private_dir`: the default sync directory on tmpfs (`TMPFS`): an unpredictable name made exclusively, mode 0700,
  in a parent only root or this user controls; the weight files in it are written 0600 (`PRIVATE_FILE_MODE`).
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

SHARD_BYTES = 2 * 2**30  # safetensors shard size (tensor bytes per file)
#: Header room reserved at the start of each shard: the header is written last (space-padded, as the safetensors
#: format allows), so tensors stream into the file as they come. A shard closes early when its header would not fit.
HEADER_BYTES = 2**18
TMPFS = "/dev/shm"
#: Name prefix of the private tmpfs directory (`private_dir`): a random suffix follows, so no name can be planted.
TMPFS_PREFIX = "or1-trl-vllm-sync-"
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


def private_dir(parent: str = TMPFS, prefix: str = TMPFS_PREFIX) -> str:
    """A new directory in `parent` that only this user can enter, for the weights on shared tmpfs.

    Its name is unpredictable and it is created exclusively (`tempfile.mkdtemp`: a random suffix, `mkdir` that fails
    on anything already there, mode 0700), so nothing another user plants at a name they can compute — a symlink to
    their directory, a file — is ever used. `parent` must be a directory owned by root or this user, and sticky
    wherever others may write to it (as `/dev/shm` and `/tmp` are), so that no one else can rename the directory
    away and put a link in its place. `OSError` saying what is wrong otherwise."""
    real = os.path.realpath(parent)
    info = os.stat(real)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{parent} is not a directory")
    if info.st_uid not in (0, os.getuid()):
        raise PermissionError(f"{parent} belongs to uid {info.st_uid}, neither root nor this user")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise PermissionError(f"{parent} is writable by others and not sticky: they could replace what is in it")
    path = tempfile.mkdtemp(prefix=prefix, dir=real)
    made = os.lstat(path)
    if not stat.S_ISDIR(made.st_mode) or made.st_uid != os.getuid():  # nothing but mkdir's own directory passes
        raise PermissionError(f"{path} is not the directory this process created")
    os.chmod(path, 0o700)  # mkdtemp's mode less the umask: exactly 0700
    return path


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
