"""The README's main job: `accelerate launch examples/train_or1.py` with no arguments (offline demo)."""

import os
import re
import subprocess
import sys

from ..helpers import ROOT



def test_demo_runs_offline_and_improves(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(ROOT, "examples/train_or1.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 150
    for key in ("reward", "entropy", "entropy_coef", "kept_groups"):
        assert f"| {key} " in steps[0]
    match = re.fullmatch(r"OR1 demo: reward (\d\.\d{3}) -> (\d\.\d{3})", lines[-1])
    assert match, lines[-1]
    first, last = map(float, match.groups())
    rewards = [float(re.search(r"reward (\S+)", line).group(1)) for line in steps]
    assert abs(first - sum(rewards[:5]) / 5) < 1e-3 and abs(last - sum(rewards[-5:]) / 5) < 1e-3
    # Deterministic on one machine with the fixed seed, but not across machines (float rounding of other CPU
    # kernels): 0.364 -> 0.655 on one of ours, 0.364 -> 0.670 on another. See the README's "Measured".
    assert last > first + 0.1
