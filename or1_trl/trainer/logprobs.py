"""Per-token log-probabilities and entropies of the LM head: TRL's fused head or Liger's kernel (`logprob_backend`).

Every loss term of eq. 3.1 needs, for each completion token, log π(a_t | s_t) and the full-vocabulary entropy
H(π(· | s_t)) at the sampling temperature τ. The naive way materialises `[B, T, V]` logits: at 16K tokens and
Qwen's 151,936-token vocabulary that is ~10 GB in fp32 before its gradient. Two backends avoid it:

- `"trl"`: TRL 1.16's fused LM head (`trl.trainer.utils.add_fused_lm_head` → `ChunkedLogProbFunction`). GRPO
  always installs it. Its fold is Triton on CUDA/XPU and plain PyTorch elsewhere, where it scores every position of
  the sequence (prompt and padding included) in `[4096, 32768]` tiles.
- `"liger"`: Liger-Kernel's `LigerFusedLinearScaledCrossEntropyFunction(..., return_entropy=True)` (liger-kernel
  0.8.5), on the scored positions only. It projects a chunk of tokens at a time and recomputes the chunk's logits in
  backward. Liger dispatches by device: its CuTe-DSL Hopper kernel on sm90 GPUs (bf16 only; needs the `cutedsl`
  extra), its PyTorch path everywhere else (CPU included). Off CUDA, we call it on pieces of
  `CPU_TOKENS_PER_CALL` tokens, so that its PyTorch path holds `[128, V]` temporaries instead of `[512, V]` ones
  (~0.6 GB instead of ~2.5 GB at V = 151,936).

The Liger backend reuses the whole of TRL's fused head — the backbone call, FSDP2/ZeRO-3 weight gathering, the
temperature fixed when the head was patched, MoE auxiliary loss, the `[B, T]` layout of the result — and replaces
only the kernel it calls, on the trainer's models only (`use_liger_head`). So the temperature of a stage
(`OR1Trainer._enter_stage` re-patches the head) and the old-policy and reference passes use it the same way.

`"auto"` picks what `benchmarks/memory.py` measured lowest per device: `liger` on CPU; `trl` on CUDA and other
accelerators (Liger on GPUs is not measured here), and `trl` wherever Liger cannot run the model (see
`resolve_logprob_backend`).
"""

from __future__ import annotations

import functools
import importlib.util
import types

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

LOGPROB_BACKENDS = ("auto", "trl", "liger")
# Off CUDA, Liger is called on pieces of this many scored positions (its PyTorch path chunks by 512 internally).
CPU_TOKENS_PER_CALL = 128


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_logps_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    tokens_per_call: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log softmax(hidden · weightᵀ / τ)[label]` and the entropy of that softmax, per position, with Liger's fused
    linear scaled cross-entropy: no `[N, V]` logits; each chunk's logits are recomputed in backward.

    Args:
        hidden (`torch.Tensor`): `[N, H]` last hidden states of the scored positions.
        weight (`torch.Tensor`): `[V, H]` LM-head weight.
        labels (`torch.Tensor`): `[N]` the tokens to score (int64).
        temperature (`float`): τ the logits are divided by.
        compute_entropy (`bool`): also return the entropy (and its gradient path).
        tokens_per_call (`int`, *optional*): call Liger on pieces of at most this many positions (its PyTorch path
            then holds `[tokens_per_call, V]` temporaries); `None`: one call.

    Returns:
        `(logps [N], entropy [N] or None)`, float32, differentiable in `hidden` and `weight`.
    """
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    if hidden.size(0) == 0:
        # Nothing to score: an empty result still connected to hidden and weight, so that every rank's backward
        # reaches the LM head (DDP/FSDP expect each rank to produce every gradient).
        empty = (hidden @ weight.t()).sum(-1).float()  # [0]
        return empty, (empty.clone() if compute_entropy else None)
    step = tokens_per_call or hidden.size(0)
    logps, entropies = [], []
    for start in range(0, hidden.size(0), step):
        piece = slice(start, start + step)
        out = LigerFusedLinearScaledCrossEntropyFunction.apply(
            hidden[piece], weight, labels[piece], temperature, return_entropy=compute_entropy
        )
        nll, entropy = out if compute_entropy else (out, None)  # [n], [n]
        logps.append(-nll.float())
        if compute_entropy:
            entropies.append(entropy.float())
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None)


class LigerLogProbFunction:
    """Liger in place of TRL's `ChunkedLogProbFunction` inside TRL's fused head: same `apply` signature and outputs.

    Takes what TRL's head passes (the scored positions, the head's weight and bias, the temperature, softcapping,
    logit scale and the requested outputs) and returns `(log_probs, entropy, None, None, None)`. A positive logit
    scale s is folded into the temperature (z·s/τ = z/(τ/s)); Liger has no bias, softcapping or the other outputs.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs",)):
        unsupported = [name for name in outputs if name not in ("log_probs", "entropy")]
        if bias is not None or final_logit_softcapping is not None or unsupported or logit_scale <= 0:
            raise ValueError(
                "logprob_backend='liger' cannot score this model: Liger's fused linear cross-entropy takes no LM-head "
                f"bias (bias: {bias is not None}), no logit softcapping ({final_logit_softcapping}), a positive logit "
                f"scale only ({logit_scale}) and no outputs besides log-probs and entropy ({unsupported}). Use "
                "logprob_backend='trl'."
            )
        # TRL's tiles run in the autocast dtype when autocast is on (bf16 training); Liger needs one dtype for both.
        device = hidden.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        logps, entropy = liger_logps_and_entropy(
            hidden.to(dtype),
            weight.to(dtype),
            targets,
            temperature=temperature / logit_scale,
            compute_entropy="entropy" in outputs,
            tokens_per_call=None if device.type == "cuda" else CPU_TOKENS_PER_CALL,
        )
        return logps, entropy, None, None, None


def _score_valid_positions_only(device) -> bool:
    return True


def use_liger_head(model) -> None:
    """Make `model`'s fused LM head (TRL's `add_fused_lm_head`, already installed on it) compute with Liger, on the
    scored positions only. Only this model changes: other models, trainers and threads keep TRL's kernel.

    TRL's patched forward looks its kernel (`_ChunkedLogProbFunction`) and its "score only the valid positions" switch
    (`_use_triton`, true on Triton devices) up in the globals of `trl.trainer.utils` at call time, and takes no
    argument for either. Instead of swapping those module globals (process-wide), this model's forward is rebuilt
    from TRL's own code with those two names bound to Liger's (`LigerLogProbFunction`, always valid positions only):
    a per-model binding, which lasts until TRL patches the head again (`OR1Trainer._enter_stage` then calls this
    again). Backward needs nothing: the Liger autograd nodes carry their own backward.
    """
    forward = getattr(model.forward, "__func__", None)
    code = getattr(forward, "__code__", None)
    if code is None or not {"_ChunkedLogProbFunction", "_use_triton"} <= set(code.co_names):
        raise TypeError(
            f"logprob_backend='liger' needs TRL's fused LM head on the model (trl.trainer.utils.add_fused_lm_head); "
            f"{type(model).__name__}.forward is not it."
        )
    names = {"_ChunkedLogProbFunction": LigerLogProbFunction, "_use_triton": _score_valid_positions_only}
    liger = types.FunctionType(code, {**forward.__globals__, **names}, forward.__name__, forward.__defaults__,
                               forward.__closure__)
    liger.__kwdefaults__ = forward.__kwdefaults__
    functools.update_wrapper(liger, forward)  # the signature `generate` validates its kwargs against
    model.forward = types.MethodType(liger, model)


def _liger_cannot_run(model, device: torch.device) -> str | None:
    """Why Liger cannot compute this model's head on `device` (`None` if it can)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not liger_available():
        return "liger-kernel is not installed (pip install liger-kernel==0.8.5; Linux only)"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return "the model's LM head has a bias, which Liger's kernel does not take"
    if getattr(base.config.get_text_config(), "final_logit_softcapping", None) is not None:
        return "the model softcaps its logits, which Liger's kernel does not do"
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 re-partitions the LM head before Liger's backward recomputes with it"
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0):
        if importlib.util.find_spec("cutlass") is None:
            return ("on Hopper (sm90) GPUs Liger 0.8.5 runs its CuTe-DSL kernel, which needs "
                    "pip install 'liger-kernel[cutedsl]==0.8.5'")
    return None


def resolve_logprob_backend(requested: str, model, device: torch.device) -> tuple[str, str]:
    """The backend to use, `"trl"` or `"liger"`, and why.

    `"trl"` is always possible. `"liger"` raises a `ValueError` naming the reason when Liger cannot run the model on
    `device` (not installed, an LM-head bias, logit softcapping, DeepSpeed ZeRO-3, a Hopper GPU without Liger's CuTe
    extra). `"auto"` takes `"liger"` on CPU when it can run, else `"trl"`.
    """
    if requested not in LOGPROB_BACKENDS:
        raise ValueError(f"logprob_backend={requested!r} is not one of {list(LOGPROB_BACKENDS)}.")
    if requested == "trl":
        return "trl", "requested"
    if requested == "auto" and device.type != "cpu":
        return "trl", f"auto: Liger on {device.type} is not measured (benchmarks/memory.py ran on CPU only)"
    problem = _liger_cannot_run(model, device)
    if requested == "liger":
        if problem is not None:
            raise ValueError(f"logprob_backend='liger' cannot run here: {problem}. Use logprob_backend 'trl' or "
                             "'auto'.")
        return "liger", "requested"
    if problem is not None:
        return "trl", f"auto: {problem}"
    return "liger", "auto: the lowest peak memory on CPU (benchmarks/memory.py)"


def use_logprob_backend(backend: str, policy, ref_model=None, temperature: float | None = None,
                        cast_lm_head_to_fp32: bool = False) -> None:
    """TRL's fused head on the unwrapped `policy` (patched again at `temperature` if given: a stage's); with
    `backend="liger"`, Liger's kernel bound into it and into the unwrapped `ref_model`'s (`use_liger_head`: these
    models only)."""
    from trl.trainer.utils import add_fused_lm_head

    policy = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    if temperature is not None:
        add_fused_lm_head(policy, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy"))
    if backend == "liger":
        use_liger_head(policy)
        if ref_model is not None:
            use_liger_head(ref_model)


def use_for_trainer(trainer, temperature: float | None = None) -> None:
    """`use_logprob_backend` for an `OR1Trainer`: its resolved `logprob_backend` on its unwrapped policy and reference
    model (TRL's fused head re-patched at a stage's sampling `temperature` when given)."""
    unwrap, ref = trainer.accelerator.unwrap_model, trainer.ref_model
    use_logprob_backend(trainer.logprob_backend, unwrap(trainer.model), ref_model=None if ref is None else unwrap(ref),
                        temperature=temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32)


def attach(trainer) -> str:
    """After TRL's `__init__`: `OR1Config.logprob_backend` resolved for the trainer's device and model
    (`resolve_logprob_backend`), said in one line (INFO), and bound (`use_for_trainer`). Returns the backend."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.logprob_backend, why = resolve_logprob_backend(trainer.args.logprob_backend, policy,
                                                           trainer.accelerator.device)
    logger.info(f"Log-probs and entropies: logprob_backend={trainer.logprob_backend!r} ({why}).")
    use_for_trainer(trainer)
    return trainer.logprob_backend
