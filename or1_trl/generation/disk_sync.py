"""Weight sync to a vLLM server through files: `OR1Config(vllm_weight_sync="disk")`.

TRL 1.16 pushes the policy's weights to a vLLM server over NCCL only (vLLM's weight-transfer engine): it needs a
CUDA trainer, the CUDA build of vLLM and an NCCL route between the two. The disk backend needs only a directory both
sides can read:

1. every rank walks the policy's parameters with TRL's own iterator (`VLLMGeneration._iter_named_params`: it
   gathers ZeRO-3/FSDP shards and merges PEFT adapters, so the server gets merged full weights under vLLM's names);
2. the main process streams them as safetensors shards (`weight_files.write_safetensors`: each tensor's bytes go
   into the open file as the iterator yields it, the header last), cast to the server's dtype (`vllm_sync_dtype`),
   into a fresh directory (mode 0700: the server loads only folders no other user can write to) under
   `vllm_sync_dir` (default: a private directory on tmpfs, files 0600, when it has room and the server reads it,
   `use_default_dir`), renamed into place only once complete;
3. it asks the server to reload them (`POST /collective_rpc`, method `or1_reload_weights` of our worker extension,
   `or1_trl/generation/vllm_ext/or1_vllm_worker.py`: vLLM's `reload_weights`, then a re-pack of a tied `lm_head` on
   CPU) and to reset its prefix cache (cached KV blocks were computed with the old weights);
4. every rank waits for the main process before generating; the push's seconds per phase (`last_breakdown`: gather,
   write, load, cache reset) are logged as `vllm/sync_seconds/<phase>`.

With a PEFT (LoRA) policy and a server started with `or1-trl serve --enable-lora`, only the adapter is written
(`DiskWeightSync.push_adapter`: PEFT's state dict and `adapter_config.json`; the base weights once, before the first)
and the server loads it with `/v1/load_lora_adapter` under a new name per push, which generation requests name as
their model (`vllm_client.OR1VLLMClient.model`); `OR1Config.vllm_sync_peft` chooses.

The trainer drives it from `vllm_generation.OR1VLLMGeneration`. A server that fails or restarts mid-run
(`server_health.py`): before each generation request the server must be healthy (waited for up to
`vllm_server_timeout`) and hold the trainer's weights version (`or1_weights_version` of the worker extension: 0
after a restart), else it reloads the latest pushed directory first (`vllm/resyncs`).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from contextlib import contextmanager

import torch
from transformers.utils import logging

from .serve import SYNC_DTYPES, resolve_api_key
from .server_health import ServerWatch, WeightsRefusedError, keyed_session
from .vllm_ext.or1_private import TMPFS, user_dir
from .weight_files import (
    PRIVATE_FILE_MODE, create_file, private_dir, remove_ended_runs, remove_path, sync_torch_dtype, write_safetensors,
)

logger = logging.get_logger(__name__)

#: Version of `or1_vllm_worker.OR1WorkerExtension` this trainer speaks to (3: `or1_server_info`,
#: `or1_set_weights_version`; 4: a boolean probe, sync roots, `or1_reload_weights` answering `{"ok", "error"}`;
#: 5: every weight change zeroes the KV cache, so NaN computed by earlier weights cannot reach new requests).
WORKER_EXTENSION_VERSION = 5
#: Times the server is asked to load one version before the run stops (`WeightsRefusedError`).
RELOAD_TRIES = 2
#: The phases of one push, in `DiskWeightSync.last_breakdown` and the trainer's `vllm/sync_seconds/<phase>`.
SYNC_PHASES = ("gather", "write", "load", "cache_reset")


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
        api_key: the server's key, for the default session; default: `resolve_api_key` (the environment, else the
            key file of a server on this machine).
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
        file_mode (`int`): mode of the files written (less the umask): 0o666, as any saved model, or 0o600 in
            `use_default_dir`'s private tmpfs directory. Each version's folder is 0700 either way: the server loads
            only folders of its own user that no one else can write to, so it runs as this user.
    """

    def __init__(self, base_url: str, sync_dir: str, session=None, api_key: str | None = None,
                 server_timeout: float = 240.0, dtype: str = "model"):
        if dtype not in SYNC_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {list(SYNC_DTYPES)}")
        self.base_url = base_url.rstrip("/")
        self.sync_dir = os.path.abspath(sync_dir)
        self.session = session or keyed_session(resolve_api_key(api_key, self.base_url))
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
            raise RuntimeError(f"The vLLM server at {self.base_url} does not run in dev mode (no /collective_rpc). "
                               f"{how}")
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

        The tmpfs directory is `private_dir`'s: a new one per run under an unpredictable name, mode 0700, in this
        user's folder there (`user_dir`, `/dev/shm/or1-trl-<uid>`: the server's default sync root), removed when this
        process exits; its weight files are written 0600 (`PRIVATE_FILE_MODE`): a server that reads the probe in it
        runs as this user. The folders of this user's runs that ended without removing theirs (`kill -9`) are removed
        first, in one line (`remove_ended_runs`). Any error making or checking it (a `tmpfs` others could tamper
        with, no permission, ...) falls back, with one warning."""
        reason = tmpfs_dir = None
        try:
            if not os.path.isdir(tmpfs):
                reason = f"no {tmpfs}"
            else:
                parent = user_dir(base=tmpfs)
                removed, freed = remove_ended_runs(parent)
                if removed:
                    folders = f"{len(removed)} weight-sync folder{'s' * (len(removed) > 1)}"
                    logger.warning(f"removed {folders} of ended runs ({freed / 1e9:.1f} GB): {', '.join(removed)}")
                if (free := shutil.disk_usage(tmpfs).free) < 2 * needed_bytes + 2**28:
                    reason = (f"{tmpfs} has {free / 2**30:.1f} GiB free, two versions of the weights need "
                              f"{2 * needed_bytes / 2**30:.1f} GiB")
                else:
                    tmpfs_dir = private_dir(parent)
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
        os.mkdir(partial_dir, 0o700)  # a new one, or an error; 0700: the server loads no folder others can write to
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
                                         json={"lora_name": self.adapter_name, "lora_path": path,
                                               "load_inplace": True})
            if response.status_code != 200:
                raise RuntimeError(f"vLLM server at {self.base_url}: /v1/load_lora_adapter {self.adapter_name!r} "
                                   f"failed ({response.status_code}): {response.text[:500]}")
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
