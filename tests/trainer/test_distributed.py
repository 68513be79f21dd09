"""Two processes (gloo, the CPU twin of NCCL DDP): a rank whose every group is rejected still runs its
zero-weight forward/backward, so DDP's gradient all-reduce does not deadlock and the ranks stay identical."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from ..helpers import ROOT, free_port

def launch_rejection_run(tmp_path, *arguments):
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        os.path.join(ROOT, "tests/distributed/ddp_rejection.py"), str(tmp_path), *map(str, arguments),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_rank_with_no_kept_rows_does_not_deadlock(tmp_path, steps_per_generation):
    ranks = launch_rejection_run(tmp_path, steps_per_generation)
    # rank 0 kept its 8 rows per step; rank 1 kept none and ran one zero-weight row per micro-step
    assert ranks[0]["rows_forwarded"] == 2 * 8 * steps_per_generation
    assert ranks[1]["rows_forwarded"] == 2 * steps_per_generation
    assert ranks[0]["kept_group_frac"] == [0.5, 0.5]  # 2 of the 4 groups (all ranks) are informative
    assert ranks[0]["skipped_steps"] == ranks[1]["skipped_steps"] == 0
    # the update happened and is identical on both ranks (DDP averaged the zero gradient of rank 1 in)
    assert ranks[0]["weights_moved"] > 0
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_a_step_skipped_on_every_rank_runs_no_pass_on_any(tmp_path):
    """Issue 49: a step with nothing to train anywhere does no log-prob pass and no backward, on every DDP rank alike
    (no collective waits on a rank that skipped), and leaves the weights where they were."""
    ranks = launch_rejection_run(tmp_path, 1, "skipped")
    for rank in ranks:
        assert rank["rows_forwarded"] == 0 and rank["forwards_with_grad"] == 0
        assert rank["skipped_steps"] == 2 and rank["weights_moved"] == 0.0
        assert rank["kept_group_frac"] == [0.0, 0.0]


def test_packed_ranks_with_different_forward_counts_stay_in_lockstep(tmp_path):
    """`padding_free` with a small token budget: rank 0 forwards its 8 kept rows in several packed forwards per
    micro-step, rank 1 its one zero-weight row in one; each still runs one DDP forward and one backward per micro-step,
    so the all-reduce pairs up, and the run ends with the padded run's weights on both ranks."""
    padded = launch_rejection_run(tmp_path / "padded", 2, "padded")
    packed = launch_rejection_run(tmp_path / "packed", 2, 16)
    for run in (padded, packed):
        assert run[0]["weights"] == run[1]["weights"]  # DDP kept the ranks identical
    assert torch.allclose(torch.tensor(packed[0]["weights"]), torch.tensor(padded[0]["weights"]), rtol=1e-5, atol=1e-7)
    assert packed[0]["weights_moved"] > 1e-3
    # policy passes with gradients: 2 steps x 2 micro-steps; rank 0 needs more forwards than rank 1 when packed
    assert padded[0]["forwards_with_grad"] == padded[1]["forwards_with_grad"] == 4
    assert packed[1]["forwards_with_grad"] == 4 < packed[0]["forwards_with_grad"]


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


LAUNCH_CONFIGS = {
    "single_cpu.yaml": ("NO", 1), "cpu_2proc.yaml": ("MULTI_GPU", 2), "single_gpu.yaml": ("NO", 1),
    "multi_gpu.yaml": ("MULTI_GPU", 8), "fsdp2.yaml": ("FSDP", 8), "deepspeed_zero2.yaml": ("DEEPSPEED", 8),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 8), "multi_node.yaml": ("FSDP", 32), "cpu_2proc_zero3.yaml": ("DEEPSPEED", 2),
}


def test_launch_configs_load_and_give_their_launch_command():
    folder = os.path.join(ROOT, "configs", "accelerate")
    assert sorted(os.listdir(folder)) == sorted(LAUNCH_CONFIGS)
    for name, (distributed_type, processes) in LAUNCH_CONFIGS.items():
        path = os.path.join(folder, name)
        with open(path) as f:
            header = f.read().split("\ncompute_environment:")[0]
        assert f"accelerate launch --config_file configs/accelerate/{name}" in header, name
        config = load_config_from_file(path)
        assert (config.distributed_type.value, config.num_processes) == (distributed_type, processes), name
        if distributed_type == "FSDP":
            assert config.fsdp_config["fsdp_version"] == 2, name
        if distributed_type == "DEEPSPEED":  # <...>zero<stage>.yaml; stages change the accumulation: "auto"
            deepspeed = config.deepspeed_config
            if "deepspeed_config_file" in deepspeed:  # a DeepSpeed JSON, relative to the repository root
                with open(os.path.join(ROOT, deepspeed["deepspeed_config_file"])) as f:
                    deepspeed = json.load(f)
                stage, accumulation = deepspeed["zero_optimization"]["stage"], deepspeed["gradient_accumulation_steps"]
            else:
                stage, accumulation = deepspeed["zero_stage"], deepspeed.get("gradient_accumulation_steps", "auto")
            assert (stage, accumulation) == (int(name[-6]), "auto"), name
    multi_node = load_config_from_file(os.path.join(folder, "multi_node.yaml"))
    assert multi_node.num_machines == 4 and multi_node.num_processes == 32


def test_paper_recipes_name_a_launch_config_with_their_process_count():
    for recipe in glob.glob(os.path.join(ROOT, "examples", "recipes", "skywork_*.yaml")):
        with open(recipe) as f:
            header = "".join(line for line in f if line.startswith("#"))
        config = re.search(r"--config_file (configs/accelerate/\S+)", header).group(1)
        processes = int(re.search(r"Written for (\d+) processes", header).group(1))
        assert load_config_from_file(os.path.join(ROOT, config)).num_processes == processes, recipe


@pytest.mark.parametrize("form", ["use_cpu", "default"])
def test_a_two_process_cpu_launch_is_one_distributed_job_with_or_without_use_cpu(tmp_path, form):
    """Issue 49: `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml` on a machine with no GPU trains
    as one job of two processes whether `use_cpu` is set or not (unset, each process used to train alone on half the
    data into the same folder); unset, the first process says so in one line."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"), "--main_process_port", str(free_port()),
        os.path.join(ROOT, "tests/distributed/cpu_launch.py"), str(tmp_path), form,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert (rank["num_processes"], rank["world_size"], rank["use_cpu"]) == (2, 2, True)
        assert rank["rows_per_step"] == 16  # 8 rows per process, two processes: one global batch
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]  # DDP kept the ranks identical
    said = [line for line in (result.stdout + result.stderr).splitlines() if "train as one distributed job" in line]
    assert len(said) == (1 if form == "default" else 0), said
