"""Step time on a real model: `OR1Trainer` against `GRPOTrainer` on SmolLM2-135M-Instruct at the real-model demo's
shape, where each step's time goes, and the update's achieved FLOP/s against a GEMM's measured in the same run.

    python benchmarks/real_step_time.py [--reps 3] [--steps 2] [--model-dir DIR] [--markdown FILE] [--json FILE]
    python benchmarks/real_step_time.py --quick      # about a minute: 1 repetition of 1 step, 1 prompt x 8, 8 tokens

The model: `or1-trl model smollm2`'s folder (`--model-dir`, default `or1_trl.models.model_folder("smollm2")`), loaded
in fp32 for each run. The shape: the real-model demo's (`or1_trl.demos.real_model.demo_config`): 4 prompts x 8 samples
per step from the arithmetic ladder's training prompts (`or1_trl.demos.ladder`), completions of at most 48 tokens (the
demo's second stage; its first has 24), bf16 autocast (fp32 weights and AdamW), learning rate 3e-5, CPU. Arms:

| arm | trainer | config | reward |
|---|---|---|---|
| `trl` | `GRPOTrainer` | `GRPOConfig` with the demo config's shape fields (`SHARED_FIELDS`), TRL's defaults elsewhere | scripted: in every group exactly one sample is right (nothing to reject) |
| `or1_engine` | `OR1Trainer` | `OR1Config.from_grpo` of the `trl` arm's config: every OR1 field at TRL's value (`TRL_BEHAVIOUR`), the same GRPO configuration — the engine alone | the same |
| `or1` | `OR1Trainer` | `demo_config` with one stage (48 tokens): MAGIC defaults (rejection with compaction, adaptive entropy, Liger's log-prob head) | the same |
| `or1_demo` | `OR1Trainer` | the same | `math_reward` (the demo itself: groups all right or all wrong are rejected) |

The goal (`OR1Trainer` / `GRPOTrainer` ≤ 1.0×) compares `or1` with `trl`: the same work, nothing rejected, so the
ratio is OR1's overhead with its defaults (which include a cheaper log-prob backend); `or1_engine` against `trl` is
the engine alone (issue 48: the engine's step cost is not the recipe's learning), one GRPO configuration in both
classes; `or1_demo` shows the demo's own steps and what rejection leaves to the update.

Both generate with TRL's in-process HF `generate` (under bf16 autocast: with `bf16=True` accelerate wraps the model's
forward, `generate` included): `GRPOTrainer` has no CPU path to a vLLM server (its weight sync is NCCL), so generation
is the same code in both arms; `benchmarks/generation.py` compares the backends. Both classes carry the same
benchmark-only clocks (`Clocked`): seconds in `_generate` (rollout: tokenising, generation, decoding),
`_calculate_rewards` (reward), `training_step` minus the `_prepare_inputs` it runs first (forward+backward: the policy
forward, the loss, the backward), the optimizer step (between the `on_pre_optimizer_step` and `on_optimizer_step`
callbacks), and the rest of the step's wall clock (`other`: the rollout's bookkeeping, rejection, clipping, logging).
`OR1Trainer` also logs its own split (`time/*`, shown below the table). One repetition runs each arm for `--steps`
steps from the same weights; the order rotates from one repetition to the next; the ratios are formed within a
repetition (median step of each arm).

FLOPs, counted plainly (`update_flops`): a forward costs 2 FLOPs per multiply-add of every `nn.Linear` of the decoder
(q, k, v, o, gate, up, down: 2 x 106.2 M per token for SmolLM2) and of the tied 576 x 49,152 head (2 x 28.3 M per token),
plus the attention's two matmuls over the full T x T of a row of T tokens, 2 x 2 x T^2 x 576 per layer (what sdpa
computes with a padding mask); a forward+backward is 3 forwards. T and the rows are what the update actually forwards
with gradient: prompt + completion, padded, kept rows only (`OR1Trainer` compacts away rejected groups). Embedding
lookups, norms, activations, softmaxes and the optimizer count 0. Achieved FLOP/s = those FLOPs / the
forward+backward seconds, over each run (goal: `or1`'s); its fraction of a square 2048 GEMM's FLOP/s in fp32 (the
machine's practical peak: goal >= 0.7) and in bf16 (the dtype autocast computes in), each GEMM timed right after each
run. What limits it (`replay_update`): the `or1` arm's last update replayed after its run under the torch profiler:
the self time of its ops in groups (`PROFILE_GROUPS`), and the GEMMs' own FLOP/s (their FLOPs over their time).
`--warmup` untimed steps of each arm run first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.demos.real_model import CONTEXT, GROUP, HELD_OUT_PER_RUNG, PROMPTS_PER_STEP, TRAIN_PER_RUNG, demo_config
from or1_trl.demos.ladder import ladder_split
from or1_trl.rewards import math_reward
from or1_trl.testing import CPU_RUN
from step_time import StepClock, scripted_reward, spread

ARMS = ("trl", "or1_engine", "or1", "or1_demo")
GOALS = {"step_ratio": 1.0, "fp32_fraction": 0.7}
# The fields of the demo's config that give its shape, copied into TRL's config (the rest: TRL's defaults).
SHARED_FIELDS = (*CPU_RUN, "bf16", "learning_rate", "per_device_train_batch_size", "num_generations",
                 "max_completion_length", "max_steps", "log_level")
PHASES = ("rollout", "reward", "forward_backward", "optimizer", "other")
# Profiler op names by group (self CPU time); everything else is "other ops".
PROFILE_GROUPS = {
    "GEMM (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"),
    "attention (sdpa)": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "dtype casts and copies (autocast)": ("aten::copy_", "aten::_to_copy", "aten::to"),
}
GEMM_SIZE, QUICK_GEMM_SIZE = 2048, 512


# ---------------------------------------------------------------------------------------------------------------
# The clocks both trainer classes carry
# ---------------------------------------------------------------------------------------------------------------
class PhaseClock(StepClock):
    """`StepClock`'s step wall clock, plus the seconds of each timed phase within the step and the `(rows, width)` of
    each forward the update runs with gradient."""

    def __init__(self):
        super().__init__()
        self.records, self.current, self.forwards = [], defaultdict(float), []
        self._optimizer_start = None

    @contextlib.contextmanager
    def timing(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[phase] += time.perf_counter() - start

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.current["optimizer"] += time.perf_counter() - self._optimizer_start

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.records.append(phases(self.steps[-1], self.current, self.forwards))
        self.current, self.forwards = defaultdict(float), []


def phases(step_s: float, seconds: dict, forwards: list) -> dict:
    """One step's split: rollout, reward, forward+backward (`training_step` minus its `_prepare_inputs`), optimizer,
    and other (the rest of the step's wall clock)."""
    out = {"step": step_s, "rollout": seconds["rollout"], "reward": seconds["reward"],
           "forward_backward": seconds["training_step"] - seconds["prepare"], "optimizer": seconds["optimizer"]}
    out["other"] = step_s - sum(out[p] for p in PHASES[:-1])
    return {**out, "forwards": list(forwards)}


def timed(method: str, phase: str):
    """`Clocked`'s `method`: the trainer's own, its seconds added to `phase`."""

    def wrapper(self, *args, **kwargs):
        with self.clock.timing(phase):
            return getattr(super(Clocked, self), method)(*args, **kwargs)

    wrapper.__name__ = method
    return wrapper


class Clocked:
    """Benchmark-only mixin, first in the method order of either trainer class: the same clocks on both. It also keeps
    the last update's inputs (`replay_update`)."""

    _generate = timed("_generate", "rollout")
    _calculate_rewards = timed("_calculate_rewards", "reward")
    _prepare_inputs = timed("_prepare_inputs", "prepare")
    training_step = timed("training_step", "training_step")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = PhaseClock()
        self.add_callback(self.clock)
        self.last_inputs = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            self.last_inputs = inputs
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if torch.is_grad_enabled():  # the update's forward (no-grad passes: old or reference log-probs)
            self.clock.forwards.append(tuple(input_ids.shape))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


class ClockedGRPOTrainer(Clocked, GRPOTrainer):
    pass


class ClockedOR1Trainer(Clocked, OR1Trainer):
    pass


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and the GEMM peak
# ---------------------------------------------------------------------------------------------------------------
def flop_counts(model) -> dict:
    """Per-token forward FLOPs of the decoder's linear layers and of the head, and the attention's per-layer factor."""
    config = model.config
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"linear": 2 * linear, "head": 2 * config.vocab_size * config.hidden_size,
            "attention_width": config.num_attention_heads * head_dim, "layers": config.num_hidden_layers}


def update_flops(counts: dict, forwards: list[tuple[int, int]]) -> float:
    """FLOPs of the update's forward+backward passes over `forwards` `(rows, width)`: 3 x the forward's (module
    docstring)."""
    total = 0.0
    for rows, width in forwards:
        attention = 2 * 2 * width**2 * counts["attention_width"] * counts["layers"]  # QKᵀ and A·V, per row
        total += rows * (width * (counts["linear"] + counts["head"]) + attention)
    return 3 * total


def gemm_flops(dtype: torch.dtype, size: int, min_seconds: float = 1.0) -> float:
    """FLOP/s of a square `size` GEMM in `dtype` on the device the trainers use (a CUDA GPU when there is one, as
    `demo_config` chooses; synchronised), repeated for at least `min_seconds` after a warm-up."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    a @ b
    sync()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or count < 3:
        a @ b
        count += 1
        if count % 8 == 0:
            sync()
    sync()
    return 2 * size**3 * count / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------------------
# One run of one arm
# ---------------------------------------------------------------------------------------------------------------
def configs(arm: str, output_dir: str, steps: int, quick: bool):
    """The arm's config: the demo's (`demo_config`, one stage), or TRL's with the demo's shape fields."""
    shape = dict(per_device_train_batch_size=GROUP, max_completion_length=8) if quick else {}  # 1 prompt x 8
    or1 = demo_config(output_dir, max_steps=steps, stages=None, **shape)
    if arm not in ("trl", "or1_engine"):
        return or1
    trl = GRPOConfig(output_dir=output_dir, **{name: getattr(or1, name) for name in SHARED_FIELDS})
    return OR1Config.from_grpo(trl) if arm == "or1_engine" else trl  # the engine: every OR1 field at TRL's value


def run_arm(arm: str, folder: str, tokenizer, dataset, steps: int, workdir: str, quick: bool,
            replay: bool = False) -> dict:
    """Train `arm` for `steps` steps from the model in `folder` (fp32): its per-step records, `OR1Trainer`'s logged
    time split, and with `replay` the last update replayed (`replay_update`)."""
    trainer_cls = ClockedGRPOTrainer if arm == "trl" else ClockedOR1Trainer
    reward = math_reward if arm == "or1_demo" else scripted_reward(False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    counts = flop_counts(model)
    trainer = trainer_cls(model=model, reward_funcs=reward, args=configs(arm, f"{workdir}/{arm}", steps, quick),
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    out = {"records": trainer.clock.records, "log": logged, "counts": counts}
    if replay:
        out["replay"] = replay_update(trainer, counts)
    return out


def replay_update(trainer, counts: dict) -> dict:
    """The last step's forward+backward again, outside the loop, on the same inputs, under the torch profiler
    (`profile_groups`)."""
    trainer.clock.forwards = []
    model = trainer.model_wrapped
    model.train()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with profiler:
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, trainer.last_inputs)
        trainer.accelerator.backward(loss)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    model.zero_grad(set_to_none=True)
    forwards = trainer.clock.forwards
    return {"seconds_total": seconds, "forwards": forwards, "user_s": after.ru_utime - usage.ru_utime,
            "system_s": after.ru_stime - usage.ru_stime, "page_faults": after.ru_minflt - usage.ru_minflt,
            **profile_groups(profiler, seconds, forwards, counts)}


def profile_groups(profiler, wall: float, forwards: list, counts: dict) -> dict:
    """A profiled forward+backward of `wall` seconds: the self seconds of each op group (`PROFILE_GROUPS`, "other ops",
    and "outside ops": the wall clock no op accounts for), the ten costliest ops, and the GEMMs' FLOP/s (the linear
    layers' and the head's FLOPs over the GEMM group's seconds)."""
    seconds, ops = defaultdict(float), {}
    for event in profiler.key_averages():
        group = next((g for g, names in PROFILE_GROUPS.items() if event.key in names), "other ops")
        seconds[group] += event.self_cpu_time_total / 1e6
        ops[event.key] = event.self_cpu_time_total / 1e6
    seconds["outside ops"] = max(0.0, wall - sum(seconds.values()))
    gemm_flops_total = 3 * sum(rows * width * (counts["linear"] + counts["head"]) for rows, width in forwards)
    gemm_s = seconds["GEMM (mm, addmm, bmm)"]
    return {"seconds": dict(seconds), "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10]),
            "flops": update_flops(counts, forwards), "gemm_flops": gemm_flops_total,
            "gemm_flop_per_s": gemm_flops_total / gemm_s if gemm_s else float("nan")}


def summarise(run: dict) -> dict:
    """A run's medians per step (each phase), the sums behind its FLOP/s, and OR1's own split (`time/*`)."""
    records = run["records"]
    out = {phase: statistics.median(r[phase] for r in records) for phase in ("step", *PHASES)}
    flops = sum(update_flops(run["counts"], r["forwards"]) for r in records)
    seconds = sum(r["forward_backward"] for r in records)
    out.update(flops=flops, forward_backward_total_s=seconds, flop_per_s=flops / seconds,
               forwards=[f for r in records for f in r["forwards"]],
               rows=statistics.mean(sum(rows for rows, _ in r["forwards"]) for r in records),
               tokens=statistics.mean(sum(rows * width for rows, width in r["forwards"]) for r in records))
    log = run["log"]
    if log and "time/step_s" in log[0]:
        total = sum(e["time/step_s"] for e in log)
        out["or1_split"] = {p: sum(e[f"time/{p}_s"] for e in log) / total for p in ("rollout", "reward", "update", "other")}
        out["kept"] = statistics.mean(e.get("rejection/kept_group_frac", float("nan")) for e in log)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The block
# ---------------------------------------------------------------------------------------------------------------
def figures(results: list[dict], replay: dict | None, counts: dict, args) -> dict:
    """Every figure of the block, unrounded (`--json`)."""
    ratios = [r["or1"]["step"] / r["trl"]["step"] for r in results]
    engine_ratios = [r["or1_engine"]["step"] / r["trl"]["step"] for r in results]
    demo_ratios = [r["or1_demo"]["step"] / r["trl"]["step"] for r in results]
    fractions = {dtype: {arm: [r[arm]["flop_per_s"] / r[arm][f"gemm_{dtype}"] for r in results] for arm in ARMS}
                 for dtype in ("fp32", "bf16")}
    out = {"reps": results, "step_ratios": ratios, "step_ratio": statistics.median(ratios), "demo_ratios": demo_ratios,
           "engine_ratios": engine_ratios, "engine_ratio": statistics.median(engine_ratios), "fractions": fractions, "fp32_fraction": statistics.median(fractions["fp32"]["or1"]),
           "bf16_fraction": statistics.median(fractions["bf16"]["or1"]), "counts": counts, "replay": replay,
           "gemm": {dtype: statistics.median(r[arm][f"gemm_{dtype}"] for r in results for arm in ARMS)
                    for dtype in ("fp32", "bf16")},
           "settings": {"reps": args.reps, "steps": args.steps, "quick": args.quick}}
    out["goals_met"] = {"step_ratio": out["step_ratio"] <= GOALS["step_ratio"],
                        "fp32_fraction": out["fp32_fraction"] >= GOALS["fp32_fraction"]}
    return out


def markdown(values: dict, args) -> str:
    results, counts = values["reps"], values["counts"]
    flags = "".join(f" --{name} {value}" for name, value, default in
                    (("reps", args.reps, 3), ("steps", args.steps, 2), ("warmup", args.warmup, 1)) if value != default)
    shape = f"1 prompt × {GROUP} samples, ≤ 8 new tokens (`--quick`: the numbers mean nothing)" if args.quick else (
        f"{PROMPTS_PER_STEP} prompts × {GROUP} samples, ≤ {CONTEXT} new tokens")
    params = (counts["linear"] + counts["head"]) / 2
    met = values["goals_met"]
    fp32 = {arm: values["fractions"]["fp32"][arm] for arm in ARMS}
    bf16 = {arm: values["fractions"]["bf16"][arm] for arm in ARMS}
    lines = [
        f"Real-model step time, `python benchmarks/real_step_time.py{' --quick' if args.quick else flags}`: "
        f"SmolLM2-135M-Instruct at the real-model demo's shape ({shape}; the ladder's training prompts, bf16 autocast, "
        "lr 3e-5), both trainers generating with HF `generate` in-process (under the same autocast); "
        f"{args.warmup} untimed step(s) of each arm, then {args.reps} interleaved repetitions of {args.steps} step(s) per "
        "arm; min / median / max over the repetitions:",
        "",
        "| measure | min / median / max | goal (median) |",
        "|---|---:|---|",
        f"| step time, `OR1Trainer` / `GRPOTrainer`, nothing rejected | {spread(values['step_ratios'], '.3f')}× | "
        f"≤ {GOALS['step_ratio']:.2f}×: {'met' if met['step_ratio'] else '**missed**'} |",
        f"| step time, `OR1Trainer` with every OR1 field at TRL's value (the engine alone) / `GRPOTrainer` | "
        f"{spread(values['engine_ratios'], '.3f')}× | — |",
        f"| step time, `OR1Trainer` with `math_reward` (the demo) / `GRPOTrainer` | "
        f"{spread(values['demo_ratios'], '.3f')}× | — |",
        f"| `OR1Trainer`'s forward+backward FLOP/s ÷ an fp32 GEMM's, nothing rejected | {spread(fp32['or1'], '.2f')} | "
        f"≥ {GOALS['fp32_fraction']:.1f}: {'met' if met['fp32_fraction'] else '**missed**'} |",
        f"| the same ÷ a bf16 GEMM's | {spread(bf16['or1'], '.2f')} | — |",
        f"| `GRPOTrainer`'s forward+backward FLOP/s ÷ fp32 / ÷ bf16 GEMM's (median) | "
        f"{statistics.median(fp32['trl']):.2f} / {statistics.median(bf16['trl']):.2f} | — |",
        "",
        "| arm | step s | rollout s | reward s | forward+backward s | optimizer s | other s | rows × width forwarded "
        "| forward+backward GFLOP/s | kept groups |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"trl": "`GRPOTrainer`, scripted reward", "or1_engine": "`OR1Trainer`, TRL's values, scripted reward",
             "or1": "`OR1Trainer` (MAGIC defaults), scripted reward",
             "or1_demo": "`OR1Trainer`, `math_reward` (the demo)"}
    for arm in ARMS:
        rows = [r[arm] for r in results]

        def med(key):
            return statistics.median(r[key] for r in rows)

        kept = f"{med('kept'):.2f}" if "kept" in rows[0] and not math.isnan(med("kept")) else "—"  # rejection off
        lines.append(f"| {names[arm]} | {med('step'):.1f} | " + " | ".join(f"{med(p):.1f}" for p in PHASES[:-1])
                     + f" | {med('other'):.1f} | {med('rows'):.0f} rows, {med('tokens'):,.0f} tokens | "
                     f"{med('flop_per_s') / 1e9:.1f} | {kept} |")
    def split(arm):
        return ", ".join(f"{p} {statistics.median(r[arm]['or1_split'][p] for r in results):.0%}"
                         for p in ("rollout", "reward", "update", "other"))

    lines += [
        "",
        f"Medians per step over the repetitions. GEMMs timed after each run (square {values['settings'].get('gemm_size', GEMM_SIZE)}, "
        f"median): fp32 {values['gemm']['fp32'] / 1e9:.0f} GFLOP/s, bf16 {values['gemm']['bf16'] / 1e9:.0f} GFLOP/s. "
        f"`OR1Trainer`'s own time split (`time/*`), scripted reward: {split('or1')}; `math_reward`: "
        f"{split('or1_demo')}. The scripted reward makes exactly one sample of each group right: no group is "
        f"rejected, and both trainers forward every row. FLOPs counted: 3 × (2 × {params / 1e6:.1f} M "
        "multiply-adds per token through the decoder's linear layers and the tied head, + the attention's 2 × 2 × T² × "
        f"{counts['attention_width']} per layer and row) over the rows the update forwards (prompt + completion, "
        "padded, kept rows only).",
    ]
    replay = values["replay"]
    if replay:
        wall = replay["seconds_total"]
        groups = ", ".join(f"{name} {seconds / wall:.0%}" for name, seconds in
                           sorted(replay["seconds"].items(), key=lambda kv: -kv[1]))
        lines += ["", f"What limits it: `OR1Trainer`'s last update (scripted reward) replayed after its run on the same "
                  f"inputs, under the torch profiler, took {wall:.1f} s ({replay['flops'] / wall / 1e9:.0f} GFLOP/s; in "
                  f"the step: {replay['step_s']:.1f} s; CPU time {replay['user_s']:.1f} s user, {replay['system_s']:.1f} s "
                  f"system, {replay['page_faults']:,} page faults). Self time of its ops: {groups}; the GEMMs themselves "
                  "run at "
                  f"{replay['gemm_flop_per_s'] / 1e9:.0f} GFLOP/s ({replay['gemm_flop_per_s'] / values['gemm']['bf16']:.2f} "
                  f"of the bf16 GEMM's, {replay['gemm_flop_per_s'] / values['gemm']['fp32']:.2f} of the fp32 GEMM's)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the three arms")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--model-dir", help="the SmolLM2 folder (default: or1-trl model smollm2's, built if missing)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each arm before the repetitions")
    parser.add_argument("--no-replay", action="store_true", help="skip the replayed update (what limits the FLOP/s)")
    parser.add_argument("--quick", action="store_true", help="tests this script: 1 repetition of 1 step, 1 prompt × "
                        "8 samples, 8 tokens (the real model; about a minute)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown block for the README to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the figures, unrounded, to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 1, 0
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be at least 1")
    gemm_size = QUICK_GEMM_SIZE if args.quick else GEMM_SIZE
    if args.model_dir is None:
        from or1_trl.models import model_folder

        args.model_dir = model_folder("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    train, _ = ladder_split(TRAIN_PER_RUNG, HELD_OUT_PER_RUNG, seed=0)  # the demo's training prompts
    dataset = train.remove_columns("rung")
    results, replay, counts = [], None, None
    with tempfile.TemporaryDirectory(prefix="or1-real-step-") as workdir:
        for arm in ARMS if args.warmup else ():  # one-time costs of the process (first calls of everything)
            run_arm(arm, args.model_dir, tokenizer, dataset, args.warmup, workdir, args.quick)
        for rep in range(args.reps):
            result = {}
            for arm in ARMS[rep % len(ARMS):] + ARMS[: rep % len(ARMS)]:
                last = rep == args.reps - 1 and arm == "or1" and not args.no_replay
                run = run_arm(arm, args.model_dir, tokenizer, dataset, args.steps, workdir, args.quick, replay=last)
                counts = run["counts"]
                if last:
                    replay = {**run["replay"], "step_s": run["records"][-1]["forward_backward"]}
                result[arm] = summarise(run)
                result[arm]["gemm_fp32"] = gemm_flops(torch.float32, gemm_size)
                result[arm]["gemm_bf16"] = gemm_flops(torch.bfloat16, gemm_size)
                print(f"rep {rep + 1}/{args.reps} {arm}: {result[arm]['step']:.2f} s/step, forward+backward "
                      f"{result[arm]['forward_backward']:.2f} s at {result[arm]['flop_per_s'] / 1e9:.1f} GFLOP/s "
                      f"(GEMM fp32 {result[arm]['gemm_fp32'] / 1e9:.0f}, bf16 {result[arm]['gemm_bf16'] / 1e9:.0f})",
                      file=sys.stderr, flush=True)
            results.append(result)
    values = figures(results, replay, counts, args)
    values["settings"]["gemm_size"] = gemm_size
    block = markdown(values, args)
    print("\n" + block)
    if args.markdown:  # the README block (benchmarks/update_readme.py)
        pathlib.Path(args.markdown).write_text(block)
    if args.json:  # the figures behind the block, unrounded (the tests read these)
        pathlib.Path(args.json).write_text(json.dumps(values, indent=1))


if __name__ == "__main__":
    main()
