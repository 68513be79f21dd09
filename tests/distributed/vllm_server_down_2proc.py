"""Run by tests/generation/test_server_health.py under `accelerate launch` with 2 CPU processes (gloo) against one vLLM server
(its key in `$OR1_VLLM_API_KEY`), which rank 0's reward kills (SIGKILL to the process group `pid`) during step 2's
first rollout, scoring it all 0 on both ranks so that the step's refill round generates on the dead server.

Only rank 0 talks to the server; each rank writes the error it stopped with and its step."""

import json
import os
import signal
import sys

from or1_trl import OR1Config, OR1Trainer
from or1_trl.generation.server_health import ServerDownError
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from tests.helpers import KillsTheServerMidStep
from tests.helpers import tagged_dataset


def main(output_dir, url, pid):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    args = OR1Config(**tiny_training_args(
        output_dir, max_steps=3, learning_rate=1e-2, ddp_backend="gloo", use_vllm=True, vllm_mode="server",
        vllm_server_base_url=url, vllm_weight_sync="disk", generation_kwargs={"ignore_eos": True},
        rejection_refill_rounds=1, vllm_server_timeout=3,
    ))

    def kill():  # rank 0, by pid; the server stays down
        if os.environ.get("RANK", "0") == "0":
            os.killpg(int(pid), signal.SIGKILL)

    trainer = OR1Trainer(model, KillsTheServerMidStep(kill, at=2), args=args, train_dataset=tagged_dataset(["MIX"] * 16),
                         processing_class=tokenizer)
    error = None
    try:
        trainer.train()
    except ServerDownError as stopped:
        error = str(stopped)
    with open(f"{output_dir}/down_rank{trainer.accelerator.process_index}.json", "w") as f:
        json.dump({"error": error, "step": trainer.state.global_step, "files": trainer._checkpoint_files()}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
