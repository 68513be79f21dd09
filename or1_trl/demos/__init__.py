"""The demos and their task: what `or1-trl demo` runs, as library code the benchmarks and tests import too.

- `tiny.py`: the offline demo, a tiny model learning small additions on CPU (`or1-trl demo`), and its addition
  prompts and SFT warm-up.
- `real_model.py`: the real-model demo, SmolLM2-135M-Instruct on the arithmetic ladder with held-out accuracy before
  and after (`or1-trl demo --model smollm2`).
- `ladder.py`: the arithmetic ladder, the real-model demo's task.

May import `trainer/`, `eval/`, `data/`, `recipe/`, `rewards/`, `generation/` and the top-level `models` and
`testing`; nothing imports it but `cli/`.
"""
