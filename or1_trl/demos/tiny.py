"""The offline demo: a tiny model learns small additions with the MAGIC recipe, on CPU, in a few minutes.

1. Build the tiny Qwen2 model and tokenizer (`or1_trl.testing`), no network.
2. SFT warm-up (TRL's `SFTTrainer`, a few dozen steps) teaches the answer *format* `\\boxed{n}` — not yet the sums.
3. `OR1Trainer` with the MAGIC defaults (rejection sampling, adaptive entropy control, token-level loss, τ = 1.0)
   trains against the paper's Math-Verify reward (`or1_trl.rewards.math_reward`). Only the learning rate is raised: the
   paper's 1e-6 is for 7B models. Its rollouts are seeded (`rollout_seed` = the demo's seed, as the real-model demo's;
   docs/reproducible_runs.md): two demos with one seed draw the same completions at every step, whatever the batching.

The demo starts over in its own output directory every time it runs, and says so when an earlier demo's run is
there (`mark_demo_dir`): it is replaced (`OR1Config.overwrite_output_dir`), unlike `or1-trl train`, which refuses an
output directory holding a previous run. A directory holding a run that is not the demo's is refused
(`check_demo_dir`).

`run_demo()` saves the trained model and tokenizer in `output_dir` and returns the per-step rewards; `demo()` (what
`or1-trl demo` calls) runs it and prints where the outputs are (`outputs_line`) and `OR1 demo: reward A -> B` (first
5 / last 5 steps), on the main process only. The SFT warm-up prints its loss four times (`SFTProgress`).
"""

from __future__ import annotations

import json
import os
import random
import time

from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback

from ..trainer.step_printer import StepPrinter, duration  # the per-step line `or1-trl train` prints too

PROMPT = "Q: {a}+{b}=? A:"
DEMO_MARK = "or1_demo.json"  # written into the demo's output directory: the demo may start over there


def addition_dataset(n: int, seed: int = 0, max_operand: int = 5) -> Dataset:
    """`n` prompts "Q: a+b=? A:" with the sum as the gold `answer` (a string, as `math_reward` expects)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    return Dataset.from_dict(
        {
            "prompt": [PROMPT.format(a=a, b=b) for a, b in pairs],
            "completion": [f" \\boxed{{{a + b}}}" for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )


class SFTProgress(TrainerCallback):
    """Prints one line per logged step of the SFT warm-up: `SFT warm-up step 15/60 | loss 1.234`."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.is_world_process_zero:
            print(f"SFT warm-up step {state.global_step}/{state.max_steps} | loss {logs['loss']:.3f}", flush=True)


def warm_up(model, tokenizer, dataset: Dataset, output_dir: str, steps: int, seed: int, progress: bool = False):
    """Teach the answer format with a short SFT run on prompt/completion pairs (TRL's SFTTrainer); `progress`: print
    its loss four times (`SFTProgress`)."""
    from trl import SFTConfig, SFTTrainer

    from ..testing import CPU_RUN

    args = SFTConfig(
        **{**CPU_RUN, "seed": seed, "logging_steps": max(steps // 4, 1)},
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[SFTProgress()] if progress else None)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer.model


def demo_config(output_dir: str = "outputs/or1-demo", **overrides):
    """The demo's `OR1Config`: MAGIC defaults, sized for a tiny model on CPU."""
    from ..trainer.or1_config import OR1Config
    from ..testing import CPU_RUN

    settings = dict(
        CPU_RUN,
        output_dir=output_dir,
        learning_rate=2e-4,  # the paper's 1e-6 is for 7B models; a 0.4M-parameter model needs more
        per_device_train_batch_size=128,
        num_generations=8,  # 16 prompts x 8 samples per step
        max_completion_length=8,
        max_steps=150,
        log_level="warning",
    )
    settings.update(overrides)
    return OR1Config(**settings)


def demo_model_and_data(sft_output_dir: str, sft_steps: int = 60, seed: int = 0):
    """The demo's starting point, offline: `(model, tokenizer, prompts)` — the tiny model after its SFT warm-up on
    the answer format, and 2,000 addition prompts with their `answer` (also what the training script uses when it
    is given neither a model nor a dataset, e.g. `examples/recipes/tiny_cpu_two_stage.yaml`)."""
    from transformers import set_seed

    from ..testing import tiny_model_and_tokenizer

    set_seed(seed)
    model, tokenizer = tiny_model_and_tokenizer(seed=seed)
    tokenizer.chat_template = None  # it reads raw text: its prompts are strings, as its warm-up writes them
    train = addition_dataset(2000, seed=seed)
    model = warm_up(model, tokenizer, train, sft_output_dir, sft_steps, seed, progress=True)
    return model, tokenizer, train.remove_columns("completion")


def check_demo_dir(output_dir: str) -> None:
    """The demo starts over only in a directory that is new, holds no previous run, or holds an earlier demo
    (`DEMO_MARK`): a directory holding another run's checkpoints or statistics is refused (`ValueError`), so the
    demo never deletes those."""
    from ..trainer.checkpoint import previous_run

    previous = previous_run(output_dir)
    if previous and not os.path.exists(os.path.join(output_dir, DEMO_MARK)):
        raise ValueError(
            f"{output_dir} holds a training run that is not the demo's ({', '.join(previous[:3])}); the demo starts "
            "over in its own directory every time, so it does not touch that one: pass another --output_dir."
        )


def mark_demo_dir(output_dir: str) -> None:
    """Mark `output_dir` as the demo's (main process); when an earlier demo's run is there (`previous_run`), say that
    the demo starts over (a first run says nothing)."""
    from ..trainer.checkpoint import previous_run

    replaced = previous_run(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, DEMO_MARK), "w") as f:
        json.dump({"written_by": "or1-trl demo"}, f)
    if replaced:
        print(f"Starting over in {output_dir}: each demo run replaces the previous one there.", flush=True)


def run_demo(output_dir: str = "outputs/or1-demo", sft_steps: int = 60, seed: int = 0, reward_func=None, **overrides):
    """Run warm-up + OR1 training, scored by `math_reward` (paper §7.1). Returns the per-step mean rewards."""
    from ..rewards import math_reward
    from ..trainer.or1_trainer import OR1Trainer

    check_demo_dir(output_dir)  # before the warm-up: another run's directory is refused
    model, tokenizer, train = demo_model_and_data(f"{output_dir}/sft", sft_steps, seed)
    printer = StepPrinter()
    trainer = OR1Trainer(
        model=model,
        reward_funcs=reward_func or math_reward,
        args=demo_config(output_dir, **{"seed": seed, "rollout_seed": seed, "overwrite_output_dir": True,
                                        **overrides}),
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[printer],
    )
    trainer.remove_callback(PrinterCallback)  # StepPrinter prints the one line per step instead of the raw dict
    if trainer.accelerator.is_main_process:
        mark_demo_dir(output_dir)  # the trainer (overwrite_output_dir=True) removes the earlier demo's run
    trainer.train()
    trainer.save_model(output_dir)  # the model and its tokenizer: `AutoModelForCausalLM.from_pretrained(output_dir)`
    return printer.rewards


def outputs_line(output_dir: str) -> str:
    """Where the demo's outputs are."""
    return (f"Saved the trained model and tokenizer to {output_dir} (AutoModelForCausalLM.from_pretrained"
            f"({output_dir!r})), with trainer_state.json and prompt_stats.jsonl; `or1-trl plot {output_dir}` draws "
            "the curves.")


def summary_line(rewards: list[float], seconds: float, window: int = 5) -> str:
    """`OR1 demo: reward A -> B in T` with A, B the mean reward of the first and last `window` steps and T the demo's
    wall time (the warm-up and the training)."""
    first = sum(rewards[:window]) / len(rewards[:window])
    last = sum(rewards[-window:]) / len(rewards[-window:])
    return f"OR1 demo: reward {first:.3f} -> {last:.3f} in {duration(seconds)}"


def demo(output_dir: str = "outputs/or1-demo", seed: int = 0, max_steps: int = 150,
         sft_steps: int = 60) -> list[float]:
    """`or1-trl demo`: `run_demo`, then (main process, once per run) where the outputs are and
    `OR1 demo: reward A -> B in T`. Returns the per-step mean rewards."""
    from accelerate import PartialState

    began = time.monotonic()
    rewards = run_demo(output_dir, sft_steps=sft_steps, seed=seed, max_steps=max_steps)
    if PartialState().is_main_process:  # one line each per run, not one per rank
        print(outputs_line(output_dir), flush=True)
        print(summary_line(rewards, time.monotonic() - began), flush=True)
    return rewards
