"""The Hopper attention guard (issue 47): PyTorch's cuDNN attention backend off where its backward returns NaN.

The bug (pytorch/pytorch#196678, huggingface/trl#7181): since torch 2.11, cuDNN is the first backend of
`scaled_dot_product_attention` on compute capability 9.x (H100, H200), and its SM90 backward kernel walks the keys in
128-wide tiles but masks their tail at 64-wide granularity. With an explicit attention mask (every padded batch
through transformers' `"sdpa"` attention), a key length of 64 more than a multiple of 128, and a query row whose
logsumexp is below -ln(FLT_MAX) = -88.7, the zero-filled tail enters `exp(0 - lse)`, overflows, and `grad_q` is NaN
(the forward, `grad_k` and `grad_v` are not). The NaN reaches the weights at the next optimizer step, and the next
sampling step dies in a device-side assert. `torch.backends.cuda.enable_cudnn_sdp(False)` sends SDPA to the
flash / memory-efficient kernels, which are clean on the same inputs. No torch release is known to carry the fix
(the PyTorch issue is closed, the fix belongs to cuDNN's SM90 kernel; the TRL issue is open), so every torch from 2.11
on counts as affected (`FIRST_AFFECTED`); a later torch that is known to be fixed gets an upper bound here.

    decide(capability, attn_implementation, torch_version, enabled) -> GuardDecision(disable_cudnn_sdpa, reason)
    guard(enabled, model)    # in OR1Trainer.__init__: decide for this process's GPU and the model, then act

Invariants:
- `decide` is pure; the guard acts only where all four hold: the field on (`OR1Config.cudnn_sdpa_guard`), a CUDA
  device of compute capability 9.x, the model's attention `"sdpa"`, torch >= 2.11. Its reason names the first
  condition that fails, or all four.
- `apply` turns the backend off for the rest of the process (a process-wide switch, as the backend choice itself is;
  not undone: a later trainer in the process finds it off) and says so once: one warning, when the switch changes,
  naming the reason and the field that turns the guard off. Elsewhere nothing changes.
- Imports torch and the standard library only (`benchmarks/sdpa_guard.py` loads it on a GPU machine without TRL).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

FIELD = "cudnn_sdpa_guard"  # the OR1Config field that turns the guard off
FIRST_AFFECTED = (2, 11)  # the first torch release whose SDPA dispatch runs the faulty cuDNN backward on Hopper
HOPPER_MAJOR = 9  # compute capability 9.x: H100, H200, GH200
BUG = ("cuDNN's SDPA backward returns NaN in grad_q with an attention mask at sequence lengths 64 more than a "
       "multiple of 128 (pytorch/pytorch#196678)")


@dataclass(frozen=True)
class GuardDecision:
    """Whether to turn PyTorch's cuDNN SDPA backend off, and why (or why not)."""

    disable_cudnn_sdpa: bool
    reason: str


def torch_release(version: str) -> tuple[int, int]:
    """`(major, minor)` of a torch version string: "2.11.0+cu130" -> (2, 11); nightlies count as their release."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def decide(capability: tuple[int, int] | None, attn_implementation: str | None, torch_version: str,
           enabled: bool) -> GuardDecision:
    """The guard's decision for a CUDA device of `capability` (`None`: no CUDA device), a model whose attention is
    `attn_implementation` (transformers' `config._attn_implementation`), torch `torch_version` and the field."""
    if not enabled:
        return GuardDecision(False, f"{FIELD}=False")
    if capability is None:
        return GuardDecision(False, "no CUDA device")
    if capability[0] != HOPPER_MAJOR:
        return GuardDecision(False, f"compute capability {capability[0]}.{capability[1]}, not Hopper (9.x)")
    if attn_implementation != "sdpa":
        return GuardDecision(False, f"attn_implementation={attn_implementation!r}, not 'sdpa'")
    if torch_release(torch_version) < FIRST_AFFECTED:
        return GuardDecision(False, f"torch {torch_version} predates the bug (torch "
                                    f"{FIRST_AFFECTED[0]}.{FIRST_AFFECTED[1]})")
    return GuardDecision(True, f"compute capability {capability[0]}.{capability[1]} (Hopper), attn_implementation="
                               f"'sdpa', torch {torch_version}: {BUG}")


def cuda_capability() -> tuple[int, int] | None:
    """This process's current CUDA device's compute capability (`None`: no CUDA device)."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def apply(decision: GuardDecision, announce: bool = True) -> bool:
    """Act on `decision`: cuDNN SDPA off when it says so (one warning if `announce` and the switch was on).
    Returns whether this call turned it off."""
    if not decision.disable_cudnn_sdpa or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    if announce:
        logger.warning(f"cuDNN scaled-dot-product attention is off for this process "
                       f"(torch.backends.cuda.enable_cudnn_sdp(False)): {decision.reason}. SDPA runs its flash or "
                       f"memory-efficient kernels instead. Set {FIELD}=False to keep cuDNN.")
    return True


def guard(enabled: bool, model, announce: bool = True) -> GuardDecision:
    """`decide` for this process's CUDA device, `model`'s attention and the installed torch, then `apply`."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    decision = decide(cuda_capability(), attention, torch_version=torch.__version__, enabled=enabled)
    apply(decision, announce)
    return decision
