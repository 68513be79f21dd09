"""The learning benchmark's arms and what they train on (`benchmarks/learning.py` describes the benchmark): the toys'
data and the arms' configs; the real model's ladder: its settings (`LadderSettings`, `LADDER`), data, the arms'
configs and the 1-shot datasets."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from datasets import Dataset
from trl import GRPOConfig

from or1_trl import OR1Config
from or1_trl.testing import CPU_RUN


PROMPT = "Q: {a}+{b}=? A:"
COPY_PROMPT = "Q: {n}=? A:"
GROUP, PROMPTS_PER_STEP, LEARNING_RATE = 8, 16, 2e-4
EVAL_EVERY, HELD_OUT_SAMPLES, TRAIN_SAMPLES, TARGET_WINDOW, SPLIT_SEED = 10, 16, 4, 3, 1234


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


def arm_config(toy: Toy, arm: str, seed: int, output_dir: str, steps: int, stage1_until: int | None,
               prompts_per_step: int = PROMPTS_PER_STEP, url: str | None = None):
    """The arm's config for `toy`; a server arm (`SERVER_ARMS`) generates on the vLLM server at `url`."""
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
        settings.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                        vllm_weight_sync="disk", async_generation=SERVER_ARMS[arm])
    import warnings

    with warnings.catch_warnings():  # the N_SGD > 2 warning of OR1Config: this arm measures exactly that
        warnings.simplefilter("ignore", UserWarning)
        return OR1Config(**settings, truncated_advantage_mask=MASKS.get(arm, "none"))


# ---------------------------------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct on the arithmetic ladder (`--ladder`; the module docstring's last part)
# ---------------------------------------------------------------------------------------------------------------------

LADDER_ARMS = ("or1", "grpo", "or1_no_rejection", "or1_no_entropy", "or1_8020", "one_shot", "one_shot_random")
LADDER_QUICK_ARMS = ("or1", "grpo", "one_shot")
LADDER_SEEDS = {"or1": 3, "grpo": 3}  # the matrix's seeds per arm; every other arm: LADDER_OTHER_SEEDS
LADDER_OTHER_SEEDS = 2


LADDER_SPLIT_SEED, LADDER_EVAL_SEED, LADDER_REGIME_SEED, ONE_SHOT_RANDOM_SEED = 1234, 20_000, 5, 777
#: What each OR1 arm changes in the recipe (`real_model.demo_config`: MAGIC defaults, stages, the demo's shape).
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


#: The pairing experiment (`--pairing`, issue 48): what common random numbers buy. One A/B pair of the ladder's arms,
#: 12 steps, held-out evaluations every 3 (72 held-out prompts: 12 per rung), `PAIRING_SEEDS` seed pairs with the
#: rollouts seeded alike (`rollout_seed` = `PAIRING_ROLLOUT_SEED` + seed, both arms: "crn") and as many unseeded
#: ("plain"), and one A/A pair (arm A again, "crn", seed 0).
PAIRING = LadderSettings(steps=12, target=0.6, eval_every=3, samples=4, train_per_rung=10, held_out_per_rung=12)
PAIRING_QUICK = LADDER_QUICK  # 2 steps, 1 prompt per rung: tests this script
PAIRING_ARMS = ("or1", "or1_no_rejection")
PAIRING_SEEDS = 4
PAIRING_ROLLOUT_SEED = 1000
PAIRING_GOAL = 2.0  # SD of the paired AUC difference without common random numbers ÷ with them: at least this


def pairing_plan(seeds: int, first_seed: int = 0) -> list[tuple[str, int, str]]:
    """`(arm, seed, mode)` runs, seed-major (every run of a seed before the next seed: the same load for all); mode
    "crn", "plain", or "crn_again" (the A/A run: arm A, seed `first_seed`, "crn" again), which comes first."""
    plan = [(PAIRING_ARMS[0], first_seed, "crn_again")]
    for seed in range(first_seed, first_seed + seeds):
        plan += [(arm, seed, mode) for mode in ("crn", "plain") for arm in PAIRING_ARMS]
    return plan


def pairing_rollout_seed(seed: int, mode: str) -> int | None:
    return None if mode == "plain" else PAIRING_ROLLOUT_SEED + seed


def ladder_data(settings: LadderSettings):
    """`(training prompts, held-out prompts)` of the ladder: the fixed split (`LADDER_SPLIT_SEED`), every rung, with
    `answer` and `prompt_id` (the training set without `rung`)."""
    from or1_trl.demos.ladder import ladder_split

    train, held_out = ladder_split(settings.train_per_rung, settings.held_out_per_rung, seed=LADDER_SPLIT_SEED)
    return train.remove_columns("rung"), held_out


def ladder_config(arm: str, seed: int, output_dir: str, settings: LadderSettings, url: str | None,
                  rollout_seed: int | None = None):
    """The arm's config: the OR1 arms `real_model.demo_config` (MAGIC defaults, the demo's shape and stages) with the
    arm's change and `rollout_seed` (paired rollouts; `None`: unseeded); `grpo` a `GRPOConfig` with its defaults but
    the OR1 arm's learning rate and (constant) schedule, batch, group size, precision and final context, generating on
    the same server (`url`; None: HF `generate` in the trainer, on the GPU where there is one)."""
    from or1_trl.demos.real_model import demo_config

    or1 = demo_config(output_dir, settings.steps, seed, url, prompt_id_column="prompt_id", rollout_seed=rollout_seed,
                      **OR1_ARMS.get(arm, {}))
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


def best_by_variance(stats: str, train, rows: int, missing: str):
    """π₁: the training prompt of highest historical variance in a run's `prompt_stats.jsonl` (`stats`;
    `or1_trl.data.one_shot`, what `or1-trl select-examples` runs), replicated to `rows` rows. Returns `(dataset, what
    was chosen: its id, score and accuracies, how many prompts were ranked, the top five)`; `missing`: the error's
    text when there is no `stats` yet."""
    from or1_trl.data.one_shot import rank_prompts, read_stats, select_examples

    if not os.path.exists(stats):
        raise FileNotFoundError(missing)
    ranking = rank_prompts(read_stats(stats))
    data, _ = select_examples(train, ranking, 1, rows, prompt_id_column="prompt_id")
    top = [{"prompt_id": r.prompt_id, "score": r.score, "accuracies": r.accuracies} for r in ranking[:5]]
    return data, {**top[0], "ranked": len(ranking), "top5": top}


def one_shot_dataset(arm: str, seed: int, train, results_dir: str, rows: int):
    """The 1-shot training set of `arm` for `seed`: `one_shot` the best prompt by historical variance in the `or1`
    run of the same seed (`prompt_stats.jsonl`, `or1_trl.data.one_shot`: what `or1-trl select-examples` runs),
    `one_shot_random` a random training prompt; replicated to `rows` rows. Returns `(dataset, what was chosen)`."""
    from or1_trl.data.one_shot import replicate

    if arm == "one_shot":
        stats = os.path.join(results_dir, f"or1-seed{seed}.prompt_stats.jsonl")
        return best_by_variance(stats, train, rows, missing=f"one_shot, seed {seed}: no {stats}; the or1 run of seed "
                                f"{seed} must finish first")
    row = random.Random(ONE_SHOT_RANDOM_SEED + seed).randrange(len(train))
    data = replicate(train, [row], rows).rename_column("prompt_id", "source_prompt_id")
    return data, {"prompt_id": train[row]["prompt_id"]}


def ladder_problems(held_out) -> list:
    from or1_trl.demos.real_model import held_out_problems

    return held_out_problems(held_out)
