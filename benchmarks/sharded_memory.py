"""Memory per GPU of the paper's recipes under each launch config: computed, not measured.

    python benchmarks/sharded_memory.py [--markdown FILE]

For Skywork-OR1-7B and -32B (DeepSeek-R1-Distill-Qwen-7B / -32B: Qwen2 shapes, counted by building the model on
PyTorch's meta device, no weights) and each config of `configs/accelerate/`: the training state each GPU holds
(`or1_trl.trainer.sharding.training_state_gb`: bf16 weights and gradients, fp32 master weights and AdamW moments,
sharded as the backend shards them) and the bf16 parameters a sharding backend holds whole while it computes
(`gathered_gb`). Activations (set by the tokens per micro-step and `max_tokens_per_microbatch`) and the vLLM server
(its own GPUs) come on top. The README's table is this script's output (`tests/test_benchmarks.py` checks it).
"""

from __future__ import annotations

import argparse

import torch

# The models' config.json (Qwen2ForCausalLM), the shapes that size them.
MODELS = {
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
# (model, config, GPUs): each recipe's config and the alternatives its header names.
ROWS = [
    ("7B", "multi_gpu.yaml", "ddp", 8), ("7B", "deepspeed_zero2.yaml", "zero2", 8),
    ("7B", "deepspeed_zero3.yaml", "zero3", 8), ("7B", "fsdp2.yaml", "fsdp2", 8),
    ("32B", "deepspeed_zero2.yaml", "zero2", 8), ("32B", "deepspeed_zero3.yaml", "zero3", 8),
    ("32B", "fsdp2.yaml", "fsdp2", 8), ("32B", "deepspeed_zero3.yaml", "zero3", 32),
    ("32B", "multi_node.yaml", "fsdp2", 32),
]
GPU_GB = 80


def sizes(model: str) -> tuple[int, int, int]:
    """(parameters, input embedding + LM head, one decoder layer) of `model`, counted on the meta device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        net = Qwen2ForCausalLM(Qwen2Config(**MODELS[model]))
    count = lambda module: sum(p.numel() for p in module.parameters())
    return count(net), count(net.model.embed_tokens) + count(net.lm_head), count(net.model.layers[0])


def table() -> str:
    from or1_trl.trainer.sharding import gathered_gb, training_state_gb

    lines = [f"| model (parameters) | config | GPUs | training state GB/GPU | + gathered while computing | "
             f"left of {GPU_GB} GB for activations |", "|---|---|---:|---:|---:|---:|"]
    counted = {model: sizes(model) for model in MODELS}
    for model, config, backend, gpus in ROWS:
        params, embeddings, layer = counted[model]
        state, gathered = training_state_gb(params, backend, gpus), gathered_gb(backend, embeddings, layer)
        left = GPU_GB - state - gathered
        lines.append(f"| {model} ({params / 1e9:.2f}B) | `{config}` | {gpus} | {state:.1f} | {gathered:.1f} | "
                     + (f"{left:.1f} |" if left > 0 else "does not fit |"))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    text = table()
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
