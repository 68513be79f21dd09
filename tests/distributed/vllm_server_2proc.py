"""Run by tests/generation/test_serve.py under `accelerate launch` with 2 CPU processes (gloo) against one vLLM server.

Each rank writes the logged server/trainer log-prob differences, how many weight pushes it made, a fingerprint
of its weights, and (rank 0) the sync directory the trainer chose and what it held at the end. A third argument
"async" trains with one-step-off rollouts (tests/generation/test_async_training.py)."""

import json
import os
import sys

import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from tests.helpers import ScriptedReward, tagged_dataset


def main(output_dir, url, mode="sync"):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    args = OR1Config(**tiny_training_args(
        output_dir, max_steps=3, learning_rate=1e-2, ddp_backend="gloo", use_vllm=True, vllm_mode="server",
        vllm_server_base_url=url, vllm_weight_sync="disk", generation_kwargs={"ignore_eos": True},
        async_generation=mode == "async",
    ))
    trainer = OR1Trainer(
        model, ScriptedReward(), args=args, train_dataset=tagged_dataset(["MIX", "ALL"] * 8), processing_class=tokenizer
    )
    trainer.train()
    final = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    sync = trainer.vllm_generation.disk_sync
    with open(f"{output_dir}/vllm_rank{trainer.accelerator.process_index}.json", "w") as f:
        json.dump(
            {
                "diffs": [e["sampling/sampling_logp_difference/max"] for e in trainer.state.log_history
                          if "sampling/sampling_logp_difference/max" in e],
                "syncs": sync.version if sync is not None else 0,
                "staleness": [e["async/staleness"] for e in trainer.state.log_history if "async/staleness" in e],
                "weights_sum": final.double().sum().item(),
                "weights_moved": (final - initial).abs().max().item(),
                "sync_dir": sync.sync_dir if sync is not None else None,  # the default: tmpfs (removed at exit)
                "sync_files": sorted(os.listdir(sync.sync_dir)) if sync is not None else None,
            },
            f,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
