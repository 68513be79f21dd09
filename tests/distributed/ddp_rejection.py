"""Run by tests/trainer/test_distributed.py under `accelerate launch` with 2 CPU processes (gloo).

Rank 1's reward is constant, so every group of rank 1 is rejected: rank 1 keeps no row at all, while rank 0 keeps
all of its rows. Each rank writes what it forwarded and a fingerprint of its weights. A third argument runs SGD,
padded ("padded") or packed under that token budget (`padding_free`): rank 0's rows then take many forwards per
micro-step, rank 1's single zero-weight row one. The third argument "skipped" makes both ranks' rewards constant:
every step is skipped on every rank, and no rank runs a pass (`UpdateSkip.without_passes`).
"""

import json
import sys

import torch
from accelerate import PartialState
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args


def reward(completions, **kwargs):
    if PartialState().process_index == 1 or sys.argv[3:] == ["skipped"]:
        return [1.0] * len(completions)  # solve_all everywhere on rank 1
    return [float(i % 4 == 0) for i in range(len(completions))]  # one success per group on rank 0


def main(output_dir, steps_per_generation, packing=None):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(torch.is_grad_enabled()))
    settings = {"learning_rate": 1e-3}
    if packing == "skipped":
        packing = None
    if packing is not None:  # SGD: the packed and padded runs compared to float rounding
        settings = dict(optim="sgd", learning_rate=0.5)
        if packing != "padded":
            settings.update(padding_free=True, max_tokens_per_microbatch=int(packing))
    args = OR1Config(
        **tiny_training_args(
            output_dir, max_steps=2, gradient_accumulation_steps=steps_per_generation, ddp_backend="gloo",
            **settings,
        )
    )
    dataset = Dataset.from_dict({"prompt": [f"Q: {i}+{i}=? A:" for i in range(32)]})
    trainer = OR1Trainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    final = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    rank = trainer.accelerator.process_index
    with open(f"{output_dir}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "rows_forwarded": trainer.or1_rows_forwarded,
                "skipped_steps": trainer.or1_skipped_steps,
                "weights_sum": final.double().sum().item(),
                "weights": final.tolist() if packing is not None else None,
                "forwards_with_grad": sum(forwards),
                "weights_moved": (final - initial).abs().max().item(),
                "kept_group_frac": [e["rejection/kept_group_frac"] for e in trainer.state.log_history if "rejection/kept_group_frac" in e],
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
