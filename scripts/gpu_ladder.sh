#!/usr/bin/env bash
# The ladder matrix of `benchmarks/learning.py --ladder` on one GPU, its (arm, seed) runs in parallel processes:
#   bash scripts/gpu_ladder.sh [RESULTS_DIR] [LOG_DIR]      # default benchmarks/results/learning_ladder-hf, RESULTS/logs
# Every run generates with HF `generate` in its own trainer (`--generation hf`: no vLLM on the GPU machine) and writes
# its result when it ends; a relaunch skips the finished ones. The regime and the starting point are measured first,
# once; then `or1`, `grpo` and the ablations all start together, and each seed's 1-shot arms start when that seed's
# `or1` run has written the `prompt_stats.jsonl` they rank. The runs share the GPU (and its 16 CPU cores), so their
# wall clocks are measured under the same contention: compare them with each other, not with a run alone.
# Needs `or1-trl model smollm2` done. Then the table: python benchmarks/learning.py --ladder --generation hf
#   --report-only [--plot docs/learning_ladder.png]
set -u
RESULTS=${1:-benchmarks/results/learning_ladder-hf}
LOGS=${2:-$RESULTS/logs}
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS" "$LOGS"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
ladder() { "$PYTHON" benchmarks/learning.py --ladder --generation hf --results "$RESULTS" "$@"; }
run() {
    ladder --arms "$1" --first-seed "$2" --seeds 1 > "$LOGS/$1-seed$2.log" 2>&1
    local rc=$?
    echo "$(date +%T) $1 seed $2: exit $rc"
    return $rc
}

ladder --seeds 0 > "$LOGS/start.log" 2>&1 || { tail -20 "$LOGS/start.log"; exit 1; }  # regime and start, once
for seed in 0 1; do
    (run or1 "$seed" && { run one_shot "$seed" & run one_shot_random "$seed"; wait; }) &
done
run or1 2 &
for seed in 0 1 2; do run grpo "$seed" & done
for arm in or1_no_rejection or1_no_entropy or1_8020; do
    for seed in 0 1; do run "$arm" "$seed" & done
done
wait
ladder --report-only > "$LOGS/report.log" 2>&1
tail -40 "$LOGS/report.log"
