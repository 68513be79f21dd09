#!/usr/bin/env bash
# The wheels scripts/gpu_matrix.sh needs on a GPU machine that has torch, transformers, accelerate and peft but no
# internet (TRL, datasets and DeepSpeed with what they pull in; pytest): downloaded for CPython 3.12 on x86-64 Linux,
# DeepSpeed's built from its sdist (the only form PyPI has; a pure-Python wheel, its kernels compiled on use), into DIR.
# Run it where pip reaches the index, then carry DIR to the GPU machine:
#   bash scripts/gpu_wheels.sh DIR [PYTHON_VERSION]     # default 3.12; about 60 MB
# The versions are the ones the CPU suite runs with (huggingface_hub: the newest that transformers 5.17 takes, in case the
# machine's is older than datasets 5.2 needs); gpu_matrix.sh installs only those the machine lacks. pyarrow is 55 of
# the ~75 MB: leave it out where the machine has pyarrow >= 24.
set -euo pipefail
DIR=${1:?usage: bash scripts/gpu_wheels.sh DIR [PYTHON_VERSION]}
PY=${2:-3.12}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
PURE=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 python-dateutil==4.0.0 tzdata==2026.6 hjson==3.1.0 py-cpuinfo==9.0.0
      einops==0.8.2 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 Pygments==2.21.0 requests==2.34.2 urllib3==2.8.0
      idna==3.20 certifi==2026.10.19.post1 fsspec==2026.9.0 huggingface_hub==1.33.0 gguf==0.19.0
      math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2)  # the ladder's reward
BINARY=(pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0 msgpack==1.2.4 ninja==1.13.2 charset-normalizer==3.5.3
        multiprocess==0.70.19)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "${PURE[@]}"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR" "${BINARY[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w "$DIR" deepspeed==0.19.8
ls "$DIR"
du -sh "$DIR"
