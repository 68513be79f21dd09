"""The offline demo (`or1_trl/demos/tiny.py`, `or1-trl demo`): its step lines, the summary and the outputs line once per
run, the SFT warm-up's progress, and the saved model, with two processes."""

import os
import re
import subprocess
import sys

from ..helpers import ENV, ROOT, free_port


def test_demo_with_two_processes_prints_the_summary_once(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"),
               "--main_process_port", str(free_port()),
               "-m", "or1_trl.cli", "demo", "--output_dir", str(tmp_path / "demo"),
               "--max_steps", "3", "--sft_steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**ENV, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line[:8] for line in steps] == ["step   1", "step   2", "step   3"]
    summaries = [line for line in lines if line.startswith("OR1 demo:")]
    assert len(summaries) == 1 and summaries[0] == lines[-1]
    rewards = [float(re.search(r"reward (\S+)", line).group(1)) for line in steps]
    first, last = map(float, re.fullmatch(r"OR1 demo: reward (\d\.\d{3}) -> (\d\.\d{3}) in \d+(?:m\d\d)?s",
                                            summaries[0]).groups())
    assert abs(first - sum(rewards) / 3) < 1e-3 and first == last  # fewer than 5 steps: both windows are all steps
    assert sorted(os.listdir(tmp_path)) == ["demo"] and os.path.isdir(tmp_path / "demo" / "sft")
    # The warm-up shows progress (its loss falls), the demo says where its outputs are, and they are there.
    sft = [float(line.split("loss ")[1]) for line in lines if line.startswith("SFT warm-up step ")]
    assert [line.split(" |")[0] for line in lines if line.startswith("SFT warm-up")] == \
        ["SFT warm-up step 1/2", "SFT warm-up step 2/2"] and sft[1] < sft[0]
    saved = str(tmp_path / "demo")
    assert lines[-2].startswith(f"Saved the trained model and tokenizer to {saved} ")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(saved).num_parameters() > 0 and AutoTokenizer.from_pretrained(saved)
    assert {"trainer_state.json", "prompt_stats.jsonl"} <= set(os.listdir(saved))
