"""Generating rollouts on a vLLM server: `or1-trl serve`, the keyed HTTP client and the weight sync (disk or TRL's
NCCL), a server that fails or restarts, the one-step-off overlap, sampling for evaluation and difficulty, and the
code that runs inside the vLLM server (`vllm_ext/`).

May import `recipe/` and `rewards/`; never `trainer/`, `data/`, `eval/` or `cli/`.
"""
