"""The learning benchmark's evaluations during a run (`benchmarks/learning.py` describes them): held-out accuracy and
the policy's entropy, for the toys (`Evaluation`, HF `generate`) and for the ladder (`LadderEvaluation`: on the vLLM
server or with HF `generate`), and the ladder's regime before RL (`measure_regime`)."""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback

from learning_arms import LADDER_EVAL_SEED, LADDER_REGIME_SEED, LadderSettings


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


# ---------------------------------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct on the arithmetic ladder (`--ladder`; the module docstring's last part)
# ---------------------------------------------------------------------------------------------------------------------

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


def evaluate_ladder(backends, problems: list, settings: LadderSettings, step: int, judge=None,
                    context: int | None = None) -> dict:
    """Held-out accuracy of the policy `backends` sample from (`(sampled, greedy)`: `server_backends`, `hf_backends`):
    avg@`samples` at T = 1.0 (seeded per prompt and step, the same for every arm and seed), the policy's entropy on
    those samples (NaN where the backend gives no log-probs: HF), greedy accuracy; overall and per rung. `judge` (a
    TRL reward function, default the ladder's `math_reward`) scores a sample, `context` (default the ladder's
    `real_model.CONTEXT`) caps its new tokens: `benchmarks/regime.py` passes the word problems' own."""
    from or1_trl.demos.real_model import CONTEXT
    from or1_trl.eval.evaluation import eval_scorer
    from or1_trl.generation.sampling import SamplingSettings, sample
    from or1_trl.rewards import math_reward

    context = CONTEXT if context is None else context
    prompts = {p.id: p.problem for p in problems}
    score = eval_scorer(math_reward if judge is None else judge, {p.id: p for p in problems})
    backend, greedy_backend = backends
    sampled = sample(backend, prompts, SamplingSettings(n=settings.samples, temperature=1.0, max_tokens=context,
                                                        seed=LADDER_EVAL_SEED + step), score=score, progress=False)
    entropy = getattr(backend, "entropy", float("nan"))
    greedy = sample(greedy_backend, prompts, SamplingSettings(n=1, temperature=0.0, max_tokens=context,
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

    def __init__(self, trainer_ref: list, url: str | None, problems: list, settings: LadderSettings, start: dict,
                 judge=None, context: int | None = None):
        self.trainer_ref, self.url, self.problems, self.settings = trainer_ref, url, problems, settings
        self.judge, self.context = judge, context  # `evaluate_ladder`'s: None, the ladder's
        self.start_point, self.start, self.excluded, self.points, self.loads = start, None, 0.0, [], []
        self.push = None  # the backend's own sync_weights (the trainer's calls go through a counting wrapper)
        self.collapse_warning_step = None
        self.resumed_wall = 0.0  # the training wall clock a resumed run had run before (`restore`)

    def state(self) -> dict:
        """What a checkpoint keeps of this evaluation, for `restore` in a resumed process: the points so far, the
        load samples, the collapse warning's step and the training wall clock."""
        return {"points": self.points, "loads": self.loads, "collapse_warning_step": self.collapse_warning_step,
                "wall_s": time.perf_counter() - self.start - self.excluded}

    def restore(self, saved: dict) -> None:
        """Continue the evaluation a checkpoint kept (`state`): its curve, loads and clock go on from there."""
        self.points, self.loads = list(saved["points"]), list(saved["loads"])
        self.collapse_warning_step, self.resumed_wall = saved["collapse_warning_step"], saved["wall_s"]

    def on_train_begin(self, args, state, control, **kwargs):
        if self.start is None:  # the run's first pass (a stage's next pass goes on with the same clock)
            self.start = time.perf_counter() - self.resumed_wall
            if not self.points:
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
        point = evaluate_ladder(backends, self.problems, self.settings, step, judge=self.judge, context=self.context)
        trainer.model.train()  # HFBackend put it in eval mode
        self.points.append({**point, "wall_s": wall, "tokens": tokens, "load": os.getloadavg()[0]})
        self.excluded += time.perf_counter() - before
        print(f"    step {step}: held-out avg@{self.settings.samples} {point['accuracy']:.3f}, greedy "
              f"{point['greedy']:.3f}, entropy {point['entropy']:.3f}, mean length {point['mean_length']:.1f} "
              f"({wall:.0f} s training, {time.perf_counter() - before:.0f} s evaluating)", file=sys.stderr, flush=True)
