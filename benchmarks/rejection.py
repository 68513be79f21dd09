"""Rejection sampling: policy forward/backward cost of OR1Trainer vs vanilla TRL GRPOTrainer, in the same run.

    python benchmarks/rejection.py [--steps 8] [--constant-fraction 0.5] [--completion-length 64] [--markdown FILE]

A scripted reward makes a chosen fraction of the groups constant (solve_all / solve_none), as happens more and
more as training goes on. Vanilla TRL forwards and backpropagates every row; `rejection_sampling="mask"` (Skywork's
released code) too, with weight 0; `"compact"` (ours) drops them before the policy pass. Reported: rows through the
policy forward/backward, and the seconds spent in the optimisation part of each step (training_step minus the
rollout: generation and scoring), as ratios against TRL. Prints a Markdown table (the README's).
"""

from __future__ import annotations

import argparse
import sys
import time

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model, tiny_tokenizer, tiny_training_args

GROUP = 8


def timed(cls):
    """Subclass `cls` to time the optimisation part of each step and count the rows it forwards."""

    class Timed(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.bench = {"optimisation_s": 0.0, "rows": 0}

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.bench["optimisation_s"] -= time.perf_counter() - start  # rollout time is not optimisation
            return out

        def training_step(self, model, inputs, num_items_in_batch):
            start = time.perf_counter()
            out = super().training_step(model, inputs, num_items_in_batch)
            self.bench["optimisation_s"] += time.perf_counter() - start
            return out

        def _compute_loss(self, model, inputs):
            self.bench["rows"] += inputs["completion_ids"].size(0)
            return super()._compute_loss(model, inputs)

    return Timed


def scripted_reward(constant_fraction):
    def reward(prompts, completions, **kwargs):
        out = []
        for i, prompt in enumerate(prompts):
            index = int(prompt.split("#")[1].split(":")[0])
            if index % 100 < constant_fraction * 100:
                out.append(float(index % 2))  # constant group: all 0 or all 1
            else:
                out.append(float(i % GROUP == 0))  # informative group
        return out

    reward.__name__ = "scripted"
    return reward


def run(kind, args):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    dataset = Dataset.from_dict({"prompt": [f"Problem #{i}: compute {i}+{i}." for i in range(100)]})
    settings = tiny_training_args(
        f"/tmp/or1-bench-{kind}", max_steps=args.steps, per_device_train_batch_size=8 * GROUP, num_generations=GROUP,
        max_completion_length=args.completion_length, learning_rate=1e-5, lr_scheduler_type="constant", logging_steps=1000,
    )
    if kind == "trl":
        trainer_cls, config = timed(GRPOTrainer), GRPOConfig(**settings)
    else:
        trainer_cls = timed(OR1Trainer)
        config = OR1Config(**settings, rejection_sampling=kind, use_adaptive_entropy=False, overwrite_output_dir=True)  # scratch dir
    trainer = trainer_cls(model, scripted_reward(args.constant_fraction), args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer.bench


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--constant-fraction", type=float, default=0.5)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    args = parser.parse_args(argv)
    results = {kind: run(kind, args) for kind in ("trl", "mask", "compact")}
    base = results["trl"]
    settings = (("steps", args.steps, 8), ("constant-fraction", args.constant_fraction, 0.5),
                ("completion-length", args.completion_length, 64))
    flags = "".join(f" --{name} {value}" for name, value, default in settings if value != default)
    lines = [
        f"Rejection sampling, `python benchmarks/rejection.py{flags}` ({args.steps} steps × {8 * GROUP} rows, "
        f"{args.constant_fraction:.0%} of the groups constant, {args.completion_length}-token completions, a 4-layer "
        "tiny model; optimisation = `training_step` minus generation and scoring):",
        "",
        "| trainer | rows through policy forward/backward | optimisation s | vs TRL |",
        "|---|---:|---:|---:|",
    ]
    names = {"trl": "TRL `GRPOTrainer`", "mask": '`OR1Trainer`, `rejection_sampling="mask"` (Skywork\'s code)',
             "compact": '`OR1Trainer`, `rejection_sampling="compact"` (default)'}
    for kind, r in results.items():
        lines.append(f"| {names[kind]} | {r['rows']} | {r['optimisation_s']:.2f} | "
                     f"{r['optimisation_s'] / base['optimisation_s']:.2f}× |")
    block = "\n".join(lines) + "\n"
    print("\n" + block)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(block)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
