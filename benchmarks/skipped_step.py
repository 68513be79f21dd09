"""What a fully skipped step costs in its update (issue 49): SmolLM2-135M-Instruct on CPU, every group rejected (a
constant reward), 2 prompts x 4 samples of at most 48 tokens, HF `generate`, bf16 autocast, 3 steps; the update's
seconds per step (`time/step_s` x `time/update_share`) with the zero-weight log-prob pass and backward that a skipped
step ran before (`passes`: `UpdateSkip.without_passes` forced off, what DeepSpeed and FSDP still run) and without them
(`nopasses`: one process or DDP now).

    python benchmarks/skipped_step.py passes    # one JSON line on stdout
    python benchmarks/skipped_step.py nopasses

Run both one after the other on the same machine; the results of a run are in
`benchmarks/results/skipped_step-cpu/`.
"""

import json
import sys
import tempfile

from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.models import model_folder
from or1_trl.trainer import sharding


def main(mode: str) -> dict:
    if mode not in ("passes", "nopasses"):
        raise SystemExit("usage: python benchmarks/skipped_step.py passes|nopasses")
    if mode == "passes":
        sharding.UpdateSkip.without_passes = lambda self: False  # the zero-weight passes, as before
    prompts = [[{"role": "user", "content": f"What is {i} + {i + 1}? Answer with the number."}] for i in range(16)]
    with tempfile.TemporaryDirectory() as output_dir:
        args = OR1Config(output_dir=output_dir, max_steps=3, per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=48, save_strategy="no", report_to=[], logging_steps=1, seed=0,
                         bf16=True, use_cpu=True)
        trainer = OR1Trainer(model_folder("smollm2"), lambda completions, **kw: [0.0] * len(completions), args=args,
                             train_dataset=Dataset.from_dict({"prompt": prompts}))
        trainer.train()
    steps = [{"step": e["step"], "step_s": e["time/step_s"], "update_s": e["time/step_s"] * e["time/update_share"],
              "skipped_steps": e["skipped_steps"]} for e in trainer.state.log_history if "time/step_s" in e]
    return {"mode": mode, "rows_forwarded": trainer.or1_rows_forwarded, "steps": steps}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "")))
