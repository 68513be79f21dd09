#!/usr/bin/env bash
# The Hopper attention guard on this machine's GPU (issue 47; or1_trl/trainer/attention_guard.py,
# docs/distributing_training.md): benchmarks/sdpa_guard.py, one short run. (1) One SDPA forward+backward in bf16 at
# SmolLM2-135M's attention shape with a left-padded causal mask, at key lengths 640 704 768 832 960 1088, each backend
# forced in turn and the default dispatch with cuDNN SDPA on and off: non-finite counts in grad_q/k/v and the
# difference from MATH in fp32 (704 = 5 x 128 + 64 is where cuDNN's backward is reported to return NaN in grad_q,
# pytorch/pytorch#196678). (2) The left-padding candidate: forward NaN in query rows that attend to nothing, per
# backend. (3) The guard's cost: SmolLM2-135M's architecture (random weights), forward+backward of 32 left-padded
# rows x 704 tokens under bf16 autocast, cuDNN SDPA on vs off interleaved, 12 timed steps each: medians and ratio.
#   OUT=DIR bash scripts/gpu_sdpa_guard.sh [--quick]     # from anywhere; runs in the repository root; ~1 minute
# Needs torch with CUDA and transformers only (no TRL). Without CUDA (or with --quick) it runs the same code paths on
# small shapes in seconds (tests/test_benchmarks.py runs it so). Writes to $OUT (default ./gpu_sdpa_guard_out):
# sdpa_guard.json (every figure; the device, compute capability, torch, CUDA, cuDNN and transformers versions; what
# the guard decides here) and sdpa_guard.log (what it printed). Exit status: the Python script's (0: it ran, NaNs
# found or not — they are the finding; 124: past SDPA_GUARD_TIMEOUT, default 300 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_sdpa_guard_out}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

timeout "${SDPA_GUARD_TIMEOUT:-300}" "$PYTHON" benchmarks/sdpa_guard.py --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/output.txt" | grep -v '^USDT:' | tail -40
exit "${PIPESTATUS[0]}"
