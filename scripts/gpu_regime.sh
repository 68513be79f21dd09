#!/usr/bin/env bash
# The claims of `benchmarks/regime.py` (issue 50) on one GPU: each (arm, seed) run a process of its own, at most
# $PARALLEL at once, every one generating with HF `generate` (`--generation hf`: paired rollouts through the HF path's
# counter-based sampler, fp32) and writing its result when it ends; a relaunch skips the finished ones.
#   bash scripts/gpu_regime.sh [CLAIM...]        # default: every claim (1 2 3 4 5)
#   SEEDS=4 PARALLEL=8 RESULTS=benchmarks/results/regime-hf   (the defaults)
#   STEPS=200 bash scripts/gpu_regime.sh 5       # longer runs (`--steps`): RESULTS=benchmarks/results/regime-hf-200steps
#   QUICK=1 PARALLEL=2 bash scripts/gpu_regime.sh 3              # the tiny model on a CPU: tests this script
# Order: the starting point once; then every run that needs no other (claim 3's pilot, `magic`, the other arms);
# then the runs that read one: claim 3's arms (the pilot sets their entropy target), `one_shot` (it ranks the `magic`
# run's prompts of its seed). The runs share the GPU, so their seconds per step are measured under the same
# contention: compare them with each other only. One claim of 4 seeds is 8-20 runs: about one lent session each.
# A run stopped midway resumes from its last checkpoint in $RESULTS/checkpoints (1.6 GB a run, removed when it ends):
# bring back the *.json and logs/, not that folder.
# It ends with the report ($LOGS/report.log) and its plot ($RESULTS/regime.png); again, from the results brought back:
#   python benchmarks/regime.py --generation hf [--steps N] --report-only [--markdown FILE] [--plot PNG]
set -u
CLAIMS=${*:-1 2 3 4 5}
SEEDS=${SEEDS:-4}
PARALLEL=${PARALLEL:-8}
STEPS=${STEPS:-}
RESULTS=${RESULTS:-benchmarks/results/regime-hf${STEPS:+-${STEPS}steps}}
LOGS=$RESULTS/logs
PYTHON=${PYTHON:-python3}
mkdir -p "$LOGS"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false RESULTS LOGS PYTHON
export REGIME_FLAGS="--generation hf --results $RESULTS${QUICK:+ --quick}${STEPS:+ --steps $STEPS}"

# "RUN arm seed" lines of a wave's runs (imports may print their own lines): "first" needs no other run, "second"
# reads one
runs() {
    "$PYTHON" - "$1" "$SEEDS" $CLAIMS <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import regime
wave, seeds, claims = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3:]]
second = {"nsgd4", "nsgd4_off", "one_shot"}
for arm, seed in regime.plan(claims, seeds, 0):
    if (arm in second) == (wave == "second"):
        print("RUN", arm, seed)
PY
}
one() {  # ARM SEED: one run, its log apart
    # shellcheck disable=SC2086
    "$PYTHON" benchmarks/regime.py $REGIME_FLAGS --arms "$1" --first-seed "$2" --seeds 1 > "$LOGS/$1-seed$2.log" 2>&1
    local rc=$?
    echo "$(date +%T) $1 seed $2: exit $rc"
    return $rc
}
export -f one

# shellcheck disable=SC2086
"$PYTHON" benchmarks/regime.py $REGIME_FLAGS --claims $CLAIMS --seeds 0 > "$LOGS/start.log" 2>&1 \
    || { tail -20 "$LOGS/start.log"; exit 1; }  # the starting point, once
status=0
for wave in first second; do
    runs "$wave" | sed -n 's/^RUN //p' | xargs -P "$PARALLEL" -L 1 bash -c 'one "$0" "$1"' || status=1
done
# shellcheck disable=SC2086
"$PYTHON" benchmarks/regime.py $REGIME_FLAGS --claims $CLAIMS --seeds "$SEEDS" --report-only \
    --plot "$RESULTS/regime.png" > "$LOGS/report.log" 2>&1
tail -40 "$LOGS/report.log"
exit $status
