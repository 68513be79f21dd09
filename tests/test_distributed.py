"""Two processes (gloo, the CPU twin of NCCL DDP): a rank whose every group is rejected still runs its
zero-weight forward/backward, so DDP's gradient all-reduce does not deadlock and the ranks stay identical."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_rank_with_no_kept_rows_does_not_deadlock(tmp_path, steps_per_generation):
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        os.path.join(ROOT, "tests/distributed/ddp_rejection.py"), str(tmp_path), str(steps_per_generation),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # rank 0 kept its 8 rows per step; rank 1 kept none and ran one zero-weight row per micro-step
    assert ranks[0]["rows_forwarded"] == 2 * 8 * steps_per_generation
    assert ranks[1]["rows_forwarded"] == 2 * steps_per_generation
    assert ranks[0]["kept_group_frac"] == [0.5, 0.5]  # 2 of the 4 groups (all ranks) are informative
    assert ranks[0]["skipped_steps"] == ranks[1]["skipped_steps"] == 0
    # the update happened and is identical on both ranks (DDP averaged the zero gradient of rank 1 in)
    assert ranks[0]["weights_moved"] > 0
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_two_ranks_agree_on_stages_pool_and_statistics(tmp_path):
    """Two processes, two stages with the online filter: both ranks hold the same pool, statistics, sampler position
    and weights (every rank computes them from the same gathered data)."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        os.path.join(ROOT, "tests/distributed/stages_pool.py"), str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"stages_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    state = ranks[0]
    assert state["steps"] == 4 and state["stage_log"] == [0, 0, 1, 1]
    assert state["pool"]["stage"] == 1 and state["pool"]["removed"]  # ALL prompts drawn in stage 0 left
    assert all(v["reason"] == "solved" for v in state["pool"]["removed"].values())
    assert len(state["pool"]["active"]) == 12 - len(state["pool"]["removed"])
    assert sum(counts[0] for counts in state["stats"]["0"].values()) == 2 * 4 * 4  # 2 steps x 4 prompts x 4 samples
    assert state["sampler"]["stage"] == 1 and state["sampler"]["consumed"] == 2
