#!/usr/bin/env bash
# The GPU matrix of sharded training (issue 35; docs/distributing_training.md): tests/trainer/test_sharding.py's
# test_every_feature_trains_as_one_process_does on this machine's CUDA GPUs — DDP, DeepSpeed ZeRO-2, ZeRO-3 and FSDP2
# (configs multi_gpu.yaml, deepspeed_zero2.yaml, deepspeed_zero3.yaml, fsdp2.yaml in fp32, one process per GPU; with
# one GPU, world size 1 still runs DeepSpeed's engine and FSDP2's wrapping) each train the tiny model 4 steps with
# every OR1 feature (rejection with refill, an all-rejected step skipped, the entropy controller, packing, two stages,
# a verified checkpoint each step) against one plain process of the same global batch. The five runs share the GPU
# at once (tiny models), so the matrix takes about two minutes.
#   bash scripts/gpu_matrix.sh [WHEELS_DIR]          # from anywhere; runs in the repository root
# WHEELS_DIR (made by scripts/gpu_wheels.sh): TRL, datasets, DeepSpeed, pytest and what they pull in, installed from
# there with no index, only what the machine lacks (the machine needs torch with CUDA, transformers, accelerate, peft).
# Writes to $OUT (default ./gpu_matrix_out): summary.json (the verdict; each backend's distributed type, largest
# parameter difference from the plain process, whether the skipped step moved anything), environment.json,
# pytest.log, junit.xml. Exit status: pytest's (0: the matrix passed). MATRIX_DEVICE=cpu runs the same matrix on two
# CPU processes instead (a check of this script where no GPU is lent; minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_matrix_out}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ -n "${1:-}" ]; then  # only what is missing, from the folder
    "$PYTHON" -m pip install -q --no-index --find-links "$1" trl==1.16.0 datasets==5.2.0 deepspeed==0.19.8 pytest \
        requests 2>&1 | tail -5
fi

DEVICE=${MATRIX_DEVICE:-cuda}
"$PYTHON" - "$OUT/environment.json" "$DEVICE" <<'PY'
import importlib.metadata as md, json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
for name in ("transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "pyarrow", "pytest"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
missing = [name for name in ("trl", "datasets", "deepspeed", "pytest") if info[name] is None]
if (sys.argv[2] == "cuda" and not info["gpus"]) or missing:
    sys.exit("cannot run the GPU matrix: " + ("missing " + ", ".join(missing) + " (pass the wheels folder of "
             "scripts/gpu_wheels.sh)" if missing else "no CUDA GPU (MATRIX_DEVICE=cpu runs it on CPUs)"))
PY
[ $? -eq 0 ] || exit 3

rm -f "$OUT/summary.jsonl"
OR1_TEST_DEVICE=$DEVICE OR1_MATRIX_SUMMARY="$OUT/summary.jsonl" timeout "${MATRIX_TIMEOUT:-420}" \
    "$PYTHON" -m pytest tests/trainer/test_sharding.py -k every_feature -p no:cacheprovider -q -rA \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log" | grep -v -i "warn" | tail -40
status=${PIPESTATUS[0]}

"$PYTHON" - "$OUT" "$status" <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET
out, status = sys.argv[1], int(sys.argv[2])
tests = {}
if os.path.exists(f"{out}/junit.xml"):
    for case in ET.parse(f"{out}/junit.xml").iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        tests[case.get("name")] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
figures = []
if os.path.exists(f"{out}/summary.jsonl"):
    figures = [json.loads(line) for line in open(f"{out}/summary.jsonl")]
summary = {"status": status, "passed": status == 0, "tests": tests, "runs": figures,
           "environment": json.load(open(f"{out}/environment.json"))}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps({"passed": status == 0, "tests": tests}))
PY
exit "$status"
