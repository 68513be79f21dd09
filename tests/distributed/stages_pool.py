"""Run by tests/trainer/test_distributed.py under `accelerate launch` with 2 CPU processes (gloo): a two-stage run with the
online filter. Each rank writes the pool, statistics and sampler position it holds, and a fingerprint of its weights."""

import json
import sys

import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args


def reward(prompts, completions, **kwargs):
    # prompts tagged ALL are solved by every sample (they leave the pool at stage 2); the others once per group
    return [1.0 if p.startswith("ALL") else float(i % 4 == 0) for i, p in enumerate(prompts)]


def main(output_dir):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    stages = [
        {"until_step": 2, "max_completion_length": 4, "batch_size": 4, "mini_batch_size": 4, "num_generations": 4},
        {"until_step": 4, "max_completion_length": 6, "batch_size": 2, "mini_batch_size": 2, "num_generations": 8},
    ]
    args = OR1Config(**tiny_training_args(output_dir, max_steps=-1, stages=stages, learning_rate=1e-3, ddp_backend="gloo"))
    tags = ["ALL", "MIX"] * 6
    dataset = Dataset.from_dict({"prompt": [f"{t}: {i}+{i}=? A:" for i, t in enumerate(tags)]})
    trainer = OR1Trainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    rank = trainer.accelerator.process_index
    final = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    with open(f"{output_dir}/stages_rank{rank}.json", "w") as f:
        json.dump(
            {
                "pool": trainer.prompt_pool.state_dict(),
                "stats": trainer.prompt_stats.state_dict(),
                "sampler": trainer.prompt_schedule.position,
                "steps": trainer.state.global_step,
                "stage_log": [e["stage"] for e in trainer.state.log_history if "stage" in e],
                "weights_sum": final.double().sum().item(),
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1])
