"""The run that died, traced (issue 47): one configuration of the real-model ladder trained step by step, recording
where a NaN or an infinity could appear, to see whether any does without the GPU's kernels.

    python benchmarks/nan_trace.py [--arm or1] [--seed 0] [--steps 36] [--out FILE] [--model FOLDER] [--fp32]
    python benchmarks/nan_trace.py --quick [--out FILE]   # the tiny model, 2 steps in fp32: tests this script

What runs: the ladder's (`benchmarks/learning.py --ladder --generation hf`) run of one (arm, seed): `ladder_config`
with `LADDER`'s settings (36 steps, 4 prompts x 8 samples, the stage schedule's 24 then 48 new tokens), `ladder_data`'s
training prompts, HF `generate` inside the trainer, on the CUDA GPU when there is one and on the CPU otherwise, in
bf16 autocast as on the H200 (`real_model.demo_config` sets `bf16=True`, also on a CPU), SmolLM2-135M-Instruct
(`or1-trl model smollm2`, or `--model FOLDER`). The OR1 arms run with `OR1Config`'s defaults, so the non-finite
sentinel (`nonfinite_stop_after=3`, `or1_trl/trainer/nonfinite.py`) and the attention guard (`cudnn_sdpa_guard`,
which acts only on a Hopper GPU) are on; `grpo` is TRL's `GRPOTrainer`, which has neither: the script applies the
guard itself (`attention_guard.guard`) and its sentinel figures are `null`. The held-out evaluations of the ladder
are not run: they sample from the same policy at the same weights as the rollouts (the evaluation's `multinomial`
died with the rollouts' on the H200), and the rollouts' sampling is what is traced here; they would double each
step's time. Differences from the ladder's run: a checkpoint every `--save-every` steps (default 1; the ladder
saves none), and the trace's own hooks, which only read.

What is measured, per finished optimizer step, one JSON line appended to `--out` as the step ends:
- `nonfinite_steps`, `nonfinite_grads`, `nonfinite_losses`: the sentinel's counts since the run began;
- at sampling (`sampling`), over every call of `generate` in the step: the scores `generate` samples from. A logits
  processor appended to `generate`'s own (`SamplingProbe`) sees `next_token_scores`, the fp32 copy of the lm_head's
  last-position logits, after the processors `generate` builds before the sampling warpers; the trainers sample at
  temperature 1.0 with top-k 0, top-p 1.0 and no min-p (`GRPOConfig`'s defaults, checked at the start), so there
  are no warpers and `softmax` of these scores is exactly the `probs` tensor `torch.multinomial` receives (the tensor
  whose check fired on the H200: "probability tensor contains either inf, nan or element < 0"). Counted over every
  row `multinomial` sees, finished sequences included: `positions` (rows x tokens), `nonfinite_scores` (NaN/±inf
  scores), `invalid_probs` (probabilities NaN, inf or negative); over the rows whose distribution is finite,
  `max_top1` and `mean_top1` (the largest probability of each row), `min_entropy` and `mean_entropy` (nats),
  `confident` (the fraction of rows whose top-1 is >= 0.99): how confident the policy has become;
- `nonfinite_weights`: NaN/inf values in the trainable weights after the step (all of them read once);
- from the trainer's log: `reward`, `completions/mean_length` and `max_length`, `entropy`, `grad_norm`, `loss`; and
  `step_s`, the step's wall clock (its checkpoint excluded).

Resume: relaunched with the same `--out`, it resumes from the last complete checkpoint in `--workdir` and keeps the
lines of the steps up to it (a line written after that checkpoint is dropped and its step run again), so a crash
loses at most `--save-every` - 1 steps and no line is written twice. The run's identity (arm, seed, steps, precision,
model) is kept beside `--out` (`<out>.run.json`); a relaunch with another identity stops with one line. A run the
sentinel stops (`NonFiniteStop`: 3 non-finite steps in a row) ends with exit status 3 and its line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time

import torch
from transformers import AutoTokenizer, LogitsProcessor, PrinterCallback, TrainerCallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # or1_trl from this checkout
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the ladder's settings
from learning_arms import LADDER, LADDER_QUICK, ladder_config, ladder_data  # noqa: E402

ARMS = ("or1", "grpo", "or1_no_rejection", "or1_no_entropy", "or1_8020")  # the ladder's arms without a 1-shot set
RESULTS = os.path.join(ROOT, "benchmarks", "results", "nan_trace-cpu")
CONFIDENT = 0.99  # a row whose top-1 probability is at least this counts as `confident`
STOPPED = 3  # exit status of a run the sentinel stopped
LOG_KEYS = ("reward", "completions/mean_length", "completions/max_length", "entropy", "grad_norm", "loss",
            "nonfinite_steps", "nonfinite_grads", "nonfinite_losses")


class SamplingProbe(LogitsProcessor):
    """Reads the scores `generate` samples from (module docstring) and returns them unchanged."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.positions = self.finite_rows = self.nonfinite_scores = self.invalid_probs = self.confident = 0
        self.top1_sum = self.entropy_sum = 0.0
        self.max_top1, self.min_entropy = 0.0, math.inf

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)  # [B, V] what multinomial receives (no warpers: module docstring)
        top1 = probs.max(dim=-1).values  # [B]
        entropy = -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(dim=-1)  # [B]
        self.positions += scores.shape[0]
        self.nonfinite_scores += int(torch.isfinite(scores).logical_not().sum())
        self.invalid_probs += int((torch.isfinite(probs).logical_not() | (probs < 0)).sum())
        finite = torch.isfinite(top1) & torch.isfinite(entropy)
        self.finite_rows += int(finite.sum())
        if finite.any():
            self.max_top1 = max(self.max_top1, float(top1[finite].max()))
            self.min_entropy = min(self.min_entropy, float(entropy[finite].min()))
            self.top1_sum += float(top1[finite].sum())
            self.entropy_sum += float(entropy[finite].sum())
            self.confident += int((top1[finite] >= CONFIDENT).sum())
        return scores

    def figures(self) -> dict:
        n = self.finite_rows  # the means and extremes are over the rows whose distribution is finite
        return {"positions": self.positions, "nonfinite_scores": self.nonfinite_scores,
                "invalid_probs": self.invalid_probs, "max_top1": self.max_top1 if n else None,
                "mean_top1": self.top1_sum / n if n else None, "min_entropy": self.min_entropy if n else None,
                "mean_entropy": self.entropy_sum / n if n else None, "confident": self.confident / n if n else None}


def probe_generation(model, probe: SamplingProbe) -> None:
    """Make `model.generate` (what both trainers call on the unwrapped policy) append `probe` to its processors."""
    generate = model.generate

    def probed(*args, **kwargs):
        kwargs["logits_processor"] = [*(kwargs.get("logits_processor") or []), probe]
        return generate(*args, **kwargs)

    model.generate = probed


class Trace(TrainerCallback):
    """One JSON line per finished step (module docstring); on a resume, the lines past the resumed step dropped."""

    def __init__(self, trainer_ref: list, probe: SamplingProbe, out: str):
        self.trainer_ref, self.probe, self.out = trainer_ref, probe, out
        self.began = None
        self.step_s = None

    def on_train_begin(self, args, state, control, **kwargs):
        kept = [row for row in read_trace(self.out) if row["step"] <= state.global_step]
        tmp = f"{self.out}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(tmp, self.out)

    def on_step_begin(self, args, state, control, **kwargs):
        self.probe.reset()
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s = time.perf_counter() - self.began

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "reward" not in logs or self.step_s is None:
            return  # the end-of-training summary, or a pass's first log without a step
        trainer = self.trainer_ref[0]
        weights = sum(int(torch.isfinite(p).logical_not().sum()) for p in trainer.model.parameters()
                      if p.requires_grad)
        row = {"step": state.global_step, "step_s": round(self.step_s, 2),
               **{key: logs.get(key) for key in LOG_KEYS}, "nonfinite_weights": weights,
               "sampling": self.probe.figures()}
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        s = row["sampling"]
        print(f"step {row['step']}: {row['step_s']:.0f} s, reward {row['reward']:.3f}, length "
              f"{row['completions/mean_length']:.1f}; sentinel {row['nonfinite_steps']} steps / "
              f"{row['nonfinite_grads']} gradients / {row['nonfinite_losses']} losses; sampling "
              f"{s['nonfinite_scores']} non-finite scores, {s['invalid_probs']} invalid probs over {s['positions']} "
              f"rows, max top-1 {figure(s['max_top1'])}, min entropy {figure(s['min_entropy'])}; non-finite weights "
              f"{weights}", file=sys.stderr, flush=True)
        self.step_s = None


def figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def read_trace(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def identity_check(out: str, identity: dict) -> None:
    """Keep the run's identity beside `out`; a relaunch with another one stops here, in one line."""
    path = f"{out}.run.json"
    if os.path.exists(path):
        with open(path) as f:
            before = json.load(f)
        if before != identity:
            changed = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in identity.items() if before.get(k) != v)
            sys.exit(f"{out} traces another run ({changed}): pass another --out, or delete it and {path}")
    else:
        with open(path, "w") as f:
            json.dump(identity, f)


def check_no_warpers(config) -> None:
    """The probe's scores are the sampled distribution only without `generate`'s sampling warpers."""
    warpers = {"temperature": config.temperature != 1.0, "top_k": bool(config.top_k), "top_p": config.top_p < 1.0,
               "min_p": config.min_p is not None}
    if any(warpers.values()):
        sys.exit(f"the sampling probe reads the scores before {', '.join(k for k, v in warpers.items() if v)}: "
                 "it would not see the distribution multinomial samples from")


def build(arm: str, seed: int, steps: int, quick: bool, fp32: bool, folder: str, workdir: str, save_every: int,
          resume: bool, guard_on: bool = True):
    """The trainer of the run, its probe and the trainer class's name. `guard_on=False`: the control, cuDNN SDPA
    left on (`cudnn_sdpa_guard=False`; `grpo` gets no guard)."""
    import dataclasses

    from trl import GRPOTrainer

    from or1_trl import OR1Trainer
    from or1_trl.rewards import math_reward
    from or1_trl.trainer import attention_guard

    settings = dataclasses.replace(LADDER_QUICK if quick else LADDER, steps=steps, generation="hf")
    train, _ = ladder_data(settings)
    config = ladder_config(arm, seed, workdir, settings, url=None)
    # transformers reads these when the trainer is built (its dataclass cannot be replaced: TRL's post-init refuses)
    config.save_strategy, config.save_steps, config.save_total_limit = "steps", save_every, 2
    config.overwrite_output_dir = not resume  # the demo's config starts over; a relaunch continues
    if fp32:
        config.bf16 = False
    if hasattr(config, "cudnn_sdpa_guard"):  # OR1Config's (read when the trainer is built)
        config.cudnn_sdpa_guard = guard_on
    check_no_warpers(config)
    cls = GRPOTrainer if arm == "grpo" else OR1Trainer
    trainer_ref: list = []
    probe = SamplingProbe()
    trainer = cls(model=folder, reward_funcs=math_reward, args=config, train_dataset=train,
                  processing_class=AutoTokenizer.from_pretrained(folder))
    trainer_ref.append(trainer)
    trainer.remove_callback(PrinterCallback)
    if arm == "grpo":  # TRL's trainer has no guard: the same decision, applied here
        attention_guard.guard(guard_on, trainer.model)
    probe_generation(trainer.accelerator.unwrap_model(trainer.model), probe)
    attention = getattr(trainer.model.config, "_attn_implementation", None)
    guard = attention_guard.decide(attention_guard.cuda_capability(), attention, torch_version=torch.__version__,
                                   enabled=getattr(config, "cudnn_sdpa_guard", guard_on))
    environment = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPUs",
                   "capability": attention_guard.cuda_capability(), "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                   "attn_implementation": attention, "trainer": cls.__name__, "bf16": bool(config.bf16),
                   "sentinel": getattr(config, "nonfinite_stop_after", None),
                   "guard": {"disable_cudnn_sdpa": guard.disable_cudnn_sdpa, "reason": guard.reason},
                   "cudnn_sdpa_enabled": torch.backends.cuda.cudnn_sdp_enabled()}  # after the trainer's guard
    return trainer, trainer_ref, probe, environment


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, default="or1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps (default the ladder's {LADDER.steps}; --quick {LADDER_QUICK.steps})")
    parser.add_argument("--out", help="the trace, one JSON line per step (default "
                        "benchmarks/results/nan_trace-cpu/<arm>-seed<seed>.jsonl)")
    parser.add_argument("--workdir", help="the run's output_dir, its checkpoints (default under $TMPDIR)")
    parser.add_argument("--model", help="a Hugging Face model folder (default `or1-trl model smollm2`'s)")
    parser.add_argument("--save-every", type=int, default=1, help="a checkpoint every N steps (default 1)")
    parser.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 autocast")
    parser.add_argument("--quick", action="store_true", help="the tiny model of or1_trl.testing, fp32, 2 steps")
    parser.add_argument("--no-guard", action="store_true",
                        help="the control: cudnn_sdpa_guard=False, cuDNN's SDPA left on where the guard would act")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (LADDER_QUICK if args.quick else LADDER).steps
    if steps < 1 or args.save_every < 1:
        sys.exit("--steps and --save-every must be at least 1")
    fp32 = args.fp32 or args.quick
    out = os.path.abspath(args.out or os.path.join(RESULTS, f"{args.arm}-seed{args.seed}.jsonl"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    workdir = args.workdir or os.path.join(tempfile.gettempdir(), "or1-nan-trace",
                                           f"{args.arm}-seed{args.seed}-{'quick' if args.quick else 'ladder'}")
    with contextlib.ExitStack() as stack:
        if args.quick:
            from or1_trl.testing import save_tiny_model

            folder = save_tiny_model(stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-nan-trace-")))
        elif args.model:
            folder = os.path.abspath(args.model)
            if not os.path.isfile(os.path.join(folder, "config.json")):
                sys.exit(f"--model {args.model}: no config.json there, not a Hugging Face model folder")
        else:
            from or1_trl.models import model_folder

            folder = model_folder("smollm2")
        identity = {"arm": args.arm, "seed": args.seed, "steps": steps, "precision": "fp32" if fp32 else "bf16",
                    **({"guard": "off"} if args.no_guard else {}),
                    "model": "tiny" if args.quick else os.path.basename(folder), "workdir": workdir}
        identity_check(out, identity)
        resume = os.path.isdir(workdir) and any(name.startswith("checkpoint-") for name in os.listdir(workdir))
        trainer, trainer_ref, probe, environment = build(args.arm, args.seed, steps, args.quick, fp32, folder,
                                                         workdir, args.save_every, resume, guard_on=not args.no_guard)
        with open(f"{out}.env.json", "w") as f:
            json.dump(environment, f)
        trainer.add_callback(Trace(trainer_ref, probe, out))
        print(f"nan_trace {args.arm} seed {args.seed}: {steps} steps, {identity['precision']}, "
              f"{'resuming from ' + workdir if resume else 'from the start'}; device {environment['device']}; cuDNN "
              f"SDPA {'on' if environment['cudnn_sdpa_enabled'] else 'off'} ({environment['guard']['reason']}); trace "
              f"{out}", file=sys.stderr, flush=True)
        from or1_trl.trainer.nonfinite import NonFiniteStop

        try:
            trainer.train(resume_from_checkpoint=True if resume else None)
        except NonFiniteStop as stop:
            print(f"stopped by the sentinel: {stop}", file=sys.stderr, flush=True)
            return STOPPED
    rows = read_trace(out)
    last = rows[-1] if rows else {"step": 0, "nonfinite_steps": 0}
    print(f"nan_trace {args.arm} seed {args.seed}: {len(rows)} steps traced, the last {last['step']}; non-finite: "
          f"sampling scores {sum(r['sampling']['nonfinite_scores'] for r in rows)}, weights "
          f"{sum(r['nonfinite_weights'] for r in rows)}, sentinel steps {last['nonfinite_steps']}",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
