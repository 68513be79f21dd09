"""Run by tests/trainer/test_distributed.py under `accelerate launch` with 2 CPU processes: one tiny OR1 step, with
`use_cpu` set (`use_cpu`) or left unset (`default`, what a user types from docs/clis.md). Each rank writes how many
processes its trainer trains with and a fingerprint of its weights: one distributed job has two processes and the
same weights on both ranks."""

import json
import sys

import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args


def reward(completions, **kwargs):
    return [float(i % 4 == 0) for i in range(len(completions))]  # one success per group


def main(output_dir, form):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    settings = tiny_training_args(output_dir, max_steps=1, learning_rate=1e-3)
    if form == "default":
        del settings["use_cpu"]
    args = OR1Config(**settings)
    data = Dataset.from_dict({"prompt": [f"Q: {i}+1=? A:" for i in range(16)]})
    trainer = OR1Trainer(model, reward, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(f"{output_dir}/rank{rank}.json", "w") as f:
        json.dump({"num_processes": trainer.accelerator.num_processes, "world_size": args.world_size,
                   "use_cpu": args.use_cpu, "rows_per_step": trainer.args.generation_batch_size,
                   "weights_sum": sum(p.detach().double().sum().item() for p in model.parameters())}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
