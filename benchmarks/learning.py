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
`SFTTrainer`, `or1_trl.cli.demo_run.warm_up`: batch 32, lr 3e-3, about 19 examples per addition problem: 60 steps for toy
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
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import random
import re
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
from or1_trl.cli.demo_run import warm_up
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


def target_reached(points: list[dict], gain: float, window: int = TARGET_WINDOW) -> dict | None:
    """The first evaluation at which the mean held-out accuracy of the last `window` evaluations (fewer at the start,
    the starting one included) is at least the starting accuracy + `gain`; None if none is."""
    target = points[0]["accuracy"] + gain
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

    from or1_trl.generation.serve import start_server as serve
    from or1_trl.testing import VLLM_CPU_ARGS, save_tiny_model, vllm_python

    if vllm_python() is None:
        sys.exit("the server arms need the vLLM CPU venv: run `bash scripts/install_vllm_cpu.sh` first")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = save_tiny_model(f"{workdir}/server-model")
    log = open(f"{workdir}/server.log", "w")
    SERVER["process"], SERVER["url"] = serve(path, "disk", port=port, python=vllm_python(), extra_args=VLLM_CPU_ARGS,
                                             log_file=log, sync_roots=["/dev/shm", workdir])  # the runs' sync dirs


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds per arm")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds FIRST..FIRST+N-1 (pilots: 100)")
    parser.add_argument("--toys", nargs="+", default=list(TOYS), choices=list(TOYS))
    parser.add_argument("--arms", nargs="+", default=None, help="only these arms (default: every arm of each toy)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 steps per arm: tests this script")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    args = parser.parse_args(argv)
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds)))
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
    sys.exit(main() and 0)
