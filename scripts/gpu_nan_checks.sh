#!/usr/bin/env bash
# The non-finite checks of issue 47 on this machine's GPU, one short call (docs/distributing_training.md, "The
# non-finite sentinel"): benchmarks/nonfinite_sentinel.py on SmolLM2-135M's architecture (random weights: the machine
# has no model files), (1) on CUDA, 32 rows x 704 tokens under bf16 autocast, 30 timed steps per arm interleaved: the
# sentinel's cost on the update (median ratio, same run), and whether its hooks' backward runs without a host
# synchronisation (torch.cuda.set_sync_debug_mode("error")); (2) on this machine's CPUs, 32 rows x 72 tokens (the
# real-model demo's update), 6 timed steps per arm; (3) benchmarks/finite_logits_check.py on CUDA: plain `generate`
# with a NaN in one row's logits (a device-side assert in torch.multinomial, in a child process) against the same NaN
# under finite_logits' check (that row flagged and ended, the others sampled as without the NaN).
#   OUT=DIR bash scripts/gpu_nan_checks.sh [--quick]     # from anywhere; runs in the repository root; ~2 minutes
# Needs torch with CUDA, transformers and accelerate (no TRL). Without CUDA, or with --quick, it runs the tiny model on
# the CPU in seconds (tests/test_benchmarks.py runs it so). Writes to $OUT (default ./gpu_nan_checks_out):
# sentinel_cuda.json, sentinel_cpu.json (every step's time, the medians, the ratio, the device, torch),
# finite_logits.json (the child's exit status and last line, the rows flagged, the comparison) and
# output.txt (what it printed). Exit status: 0 when every part ran, else the first failing part's.
set -uo pipefail
cd "$(dirname "$0")/.." && export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-$PWD/gpu_nan_checks_out} PYTHON=${PYTHON:-python} status=0
mkdir -p "$OUT"
run() {  # run NAME ARGS...: one part, its output into output.txt, its exit status kept if it is the first failure
    local name=$1
    shift
    echo "== $name" | tee -a "$OUT/output.txt"
    timeout "${NAN_CHECKS_TIMEOUT:-300}" "$PYTHON" "$@" 2>&1 | grep -v '^USDT:' | tee -a "$OUT/output.txt" | tail -5
    local rc=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$rc
}

if [ "${1:-}" = "--quick" ] || ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    run sentinel_cpu benchmarks/nonfinite_sentinel.py --quick --json "$OUT/sentinel_cpu.json"
    run finite_logits benchmarks/finite_logits_check.py --device cpu --json "$OUT/finite_logits.json"
else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/output.txt" 2>&1
    run sentinel_cuda benchmarks/nonfinite_sentinel.py --device cuda --architecture --rows 32 --tokens 704 \
        --reps 30 --json "$OUT/sentinel_cuda.json"
    run sentinel_cpu benchmarks/nonfinite_sentinel.py --device cpu --architecture --rows 32 --tokens 72 --reps 6 \
        --json "$OUT/sentinel_cpu.json"
    run finite_logits benchmarks/finite_logits_check.py --device cuda --json "$OUT/finite_logits.json"
fi
exit "$status"
