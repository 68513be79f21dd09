"""TRL's generation backend with a choice of weight sync: `OR1VLLMGeneration`, built in place of TRL's
`VLLMGeneration` (`generation_backend`).

In server mode, `vllm_weight_sync="nccl"` is TRL's weight transfer, as is; `"disk"` pushes safetensors through a
directory both sides read (`disk_sync.DiskWeightSync`; no vLLM needed on the trainer). Everything else — generation
requests, their batching across ranks, the NCCL path — is TRL's, unchanged, except that with both syncs the trainer
talks to the server through the keyed, retrying, watched `vllm_client.OR1VLLMClient`. The main process's outcome (a
`server_health.ServerDownError`, the resync count, a push's seconds per phase) reaches every rank, so that all of them
stop together with a complete checkpoint (`trainer/checkpoint.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from accelerate.utils import broadcast_object_list
from transformers.utils import logging
from trl.generation import vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

from . import seeded
from .disk_sync import DiskWeightSync
from .serve import SYNC_PEFT_MODES
from .server_health import ServerDownError, ServerWatch
from .vllm_client import OR1VLLMClient, http_vllm_client

logger = logging.get_logger(__name__)


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
        api_key: the server's key (`None`: the environment's, else the key file of a server on this machine,
            which the client resolves: `OR1VLLMClient`).
        *args, **kwargs: `VLLMGeneration`'s.

    Attributes:
        adapter_sync (`bool`): the disk sync pushes the LoRA adapter only (every rank knows).
        sync_breakdown (`dict` or `None`): seconds per phase of the last push and its bytes, on every rank, until
            `checkpoint.stop_with_checkpoint` logs them (`vllm/sync_seconds/<phase>`, `vllm/sync_bytes`).
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
        self.rollout_key: list | None = None  # the next request's paired-rollout key (`seeded.RolloutSeeds.generate`)
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
                        f"(vllm_sync_dtype={self.sync_dtype!r}; the server computes in "
                        f"{self.disk_sync.server_info['dtype']}).")
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
        # paired rollouts: the key travels in the request's `generation_kwargs`; `OR1VLLMClient.generate` takes it out
        keyed = self.generation_kwargs if self.rollout_key is None else {**(self.generation_kwargs or {}),
                                                                         seeded.KEY_FIELD: self.rollout_key}
        try:  # the main process's request goes through the watch: a healthy server holding the trainer's weights
            with _swapped(self, "generation_kwargs", keyed):
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
def _swapped(owner, name: str, value):
    """While active, `owner.name` is `value` (TRL builds its objects by module-level name, with no factory, and reads
    its sampling settings from its backend's attributes)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


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
