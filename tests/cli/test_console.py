"""What `or1-trl train` shows on the console (`or1_trl/cli/console.py`): one line per step from the logged metrics,
the closing lines, one line on Ctrl-C, the decisions at the default log level, transformers' tied-weights warning
explained; end to end on the tiny model in a fresh interpreter (a run, a run stopped by Ctrl-C, its resume)."""

import json
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from or1_trl.cli.console import closing_lines, interrupted_line
from or1_trl.generation.serve import API_KEY_ENV
from or1_trl.testing import save_tiny_model, tiny_model_and_tokenizer
from ..helpers import ENV


def test_closing_and_interrupted_lines_name_the_files_and_the_next_commands():
    lines = closing_lines("out", 30, 30, 61.4, ["out/checkpoint-20", "out/checkpoint-30"], None, "data/train.jsonl")
    text = "\n".join(lines)
    assert lines[0] == "Training ended at step 30 of 30 (61 s). In out:"
    assert "AutoModelForCausalLM.from_pretrained('out')" in text and "checkpoint-20, checkpoint-30" in text
    assert "prompt_stats.jsonl" in text and "--resume_from_checkpoint true" in text
    assert "or1-trl eval --model out --benchmarks data/train.jsonl" in text and "or1-trl plot out" in text
    assert "--push_to_hub true --hub_model_id NAME" in text
    assert "pushed to the Hub: me/model" in "\n".join(closing_lines("out", 1, 1, None, [], "me/model"))
    assert interrupted_line("out", 7, 20, "out/checkpoint-6", ["out/checkpoint-7"]) == (
        "Interrupted at step 7 of 20: checkpoint-6 is complete (checkpoint-7 is incomplete: resuming skips it); "
        "continue with the same command and --resume_from_checkpoint true.")
    assert "before its first complete checkpoint" in interrupted_line("out", 1, 20, None, [])


INTERRUPTER = '''
import os, signal

calls = 0


def reward(completions, **kwargs):
    """Length parity; at its third call (step 3) with OR1_TEST_INTERRUPT set: Ctrl-C, as the terminal sends it."""
    global calls
    calls += 1
    if calls == 3 and os.environ.get("OR1_TEST_INTERRUPT"):
        os.kill(os.getpid(), signal.SIGINT)
    return [float(len(c) % 2) for c in completions]
'''


@pytest.fixture
def run_files(tmp_path):
    """A tiny model with tied embeddings (its tokenizer has a chat template), 16 string prompts, the reward above."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    save_tiny_model(tmp_path / "model", model=model, tokenizer=tokenizer)
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Q: {i % 5}+1=? A:", "answer": str(i % 5 + 1)}) + "\n")
    (tmp_path / "interrupter.py").write_text(INTERRUPTER)
    return tmp_path


def train(files, *extra, interrupt=False):
    """`or1-trl train` on `run_files` (4 steps, a checkpoint every 2) in a fresh interpreter."""
    env = {**ENV, **({"OR1_TEST_INTERRUPT": "1"} if interrupt else {})}
    return subprocess.run(
        [sys.executable, "-m", "or1_trl.cli", "train", "--model_name_or_path", str(files / "model"), "--dataset_name",
         str(files / "train.jsonl"), "--reward_funcs", "interrupter.reward", "--output_dir", str(files / "out"),
         "--use_cpu", "true", "--bf16", "false", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "6", "--max_steps", "4", "--save_steps", "2", "--report_to", "none", *extra],
        cwd=files, capture_output=True, text=True, timeout=600, env=env, preexec_fn=terminal_sigint)


def terminal_sigint():
    """In the child: SIGINT's default disposition, as a command started from a terminal has it. A test run started in
    the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: the interrupter's Ctrl-C would be lost and the run would go on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_run_prints_a_line_per_step_ctrl_c_one_line_and_a_resume_what_it_took(run_files):
    out = run_files / "out"
    # Ctrl-C at step 3 (checkpoint-2 is complete): one line, exit status 130, no traceback.
    stopped = train(run_files, interrupt=True)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert stopped.stderr.rstrip().splitlines()[-1] == (
        "or1-trl train: Interrupted at step 2 of 4: checkpoint-2 is complete; continue with the same command and "
        "--resume_from_checkpoint true.")
    assert "Step 1 of 4: sampling " in stopped.stdout.split("step   1/4")[0]  # what step 1 does, before it runs
    steps = [line for line in stopped.stdout.splitlines() if line.startswith("step ")]
    assert [line[:10] for line in steps] == ["step   1/4", "step   2/4"]  # one line per step, TRL's dict not printed
    for key in ("reward", "accuracy", "entropy", "entropy_coef", "kept_groups"):
        assert f"| {key} " in steps[0], key
    assert re.search(r"\| \d+\.\d\d s: rollout \d+% reward \d+% update \d+% other \d+% \| "
                     r"\d+(m\d\d)?s elapsed, ETA \d+(m\d\d)?s$", steps[0])  # the pace (issue 49)
    assert "{'loss'" not in stopped.stdout + stopped.stderr and "'skipped_steps'" not in stopped.stdout
    # Before the model trained: string prompts against a chat template, said once. The decisions at the default
    # log level; none of transformers' gradient_checkpointing FutureWarnings.
    assert stopped.stderr.count("The prompts are plain strings (the first: 'Q: 0+1=? A:')") == 1
    assert "Log-probs and entropies: logprob_backend=" in stopped.stderr
    assert "gradient_checkpointing" not in stopped.stderr and "FutureWarning" not in stopped.stderr
    # Output to a pipe (a log file): no progress bar redraws (datasets' map, the save's shards); no DeepSpeed guess.
    assert not re.search(r"it/s\]|examples/s\]", stopped.stdout + stopped.stderr)
    assert "Setting accelerator to CPU" not in stopped.stderr and "model_init_kwargs" not in stopped.stderr

    # The same command with --resume_from_checkpoint true: which checkpoint it took; nothing of the tied head, which
    # the checkpoint holds once (`checkpoint.without_tied_keys`).
    resumed = train(run_files, "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {out / 'checkpoint-2'} (step 2), the newest complete checkpoint." in resumed.stderr
    assert "There were missing keys" not in resumed.stderr
    lines = resumed.stdout.splitlines()
    assert [line[:10] for line in lines if line.startswith("step ")] == ["step   3/4", "step   4/4"]
    start = next(i for i, line in enumerate(lines) if line.startswith("Training ended at step 4 of 4 ("))
    closing = lines[start:]
    assert closing[0].endswith(f" s). In {out}:")
    assert f"AutoModelForCausalLM.from_pretrained({str(out)!r})" in closing[1]
    assert "complete checkpoints (checkpoint-2, checkpoint-4)" in closing[2]
    assert closing[-3] == f"  or1-trl eval --model {out} --benchmarks {run_files / 'train.jsonl'}   (the training " \
                          "file; better a held-out one in its format, or aime24 aime25 math500)"
    assert closing[-2].startswith(f"  or1-trl plot {out}")
    assert os.path.isfile(out / "model.safetensors") and os.path.isfile(out / "prompt_stats.jsonl")


def test_chat_prompts_wraps_string_prompts_as_a_user_turn_of_the_chat_template(run_files):
    """`--chat_prompts true`: the prompts TRL renders are the chat template's user turns, and nothing warns."""
    from or1_trl.cli import train_parser
    from or1_trl.cli.run import build_trainer
    from or1_trl.data.preflight import plain_prompts_problem

    argv = ["--model_name_or_path", str(run_files / "model"), "--dataset_name", str(run_files / "train.jsonl"),
            "--output_dir", str(run_files / "out"), "--use_cpu", "true", "--bf16", "false", "--max_steps", "1"]
    plain = build_trainer(*train_parser().parse_args_and_config(argv))
    assert plain_prompts_problem(plain.train_dataset, plain.processing_class) is not None
    trainer = build_trainer(*train_parser().parse_args_and_config([*argv, "--chat_prompts", "true"]))
    prompt = trainer.train_dataset[0]["prompt"]
    assert prompt == [{"role": "user", "content": "Q: 0+1=? A:"}]
    assert plain_prompts_problem(trainer.train_dataset, trainer.processing_class) is None
    (ids,), _, _ = trainer._tokenize_prompts([prompt])
    assert trainer.processing_class.decode(ids) == "<|im_start|>user\nQ: 0+1=? A:<|im_end|>\n<|im_start|>assistant\n"


def test_or1_trls_decisions_show_at_the_default_log_level_and_follow_log_level(capsys, tmp_path):
    """`console_output`: or1-trl's INFO lines (the sync directory, what is synced, the log-prob backend, the checkpoint
    a resume took) on the main process by default, hidden with --log_level warning and on replicas; undone on exit."""
    from or1_trl import OR1Config
    from or1_trl.cli.console import console_output

    sync = logging.getLogger("or1_trl.generation.vllm_generation")
    before = logging.getLogger("or1_trl").level
    for log_level, shown in (("passive", True), ("info", True), ("warning", False)):
        args = OR1Config(output_dir=str(tmp_path), use_cpu=True, bf16=False, log_level=log_level)
        with console_output(args):
            sync.info("vllm_sync_dir: /dev/shm/x (tmpfs)")
        assert ("vllm_sync_dir: /dev/shm/x (tmpfs)\n" in capsys.readouterr().err) is shown, log_level
    assert logging.getLogger("or1_trl").level == before
    sync.info("after the command: not shown")
    assert "after the command" not in capsys.readouterr().err


def test_the_weight_sync_decisions_show_at_the_default_log_level(vllm_server, run_files):
    """Against a vLLM server: where the weights go and what is pushed, one line each, with no --log_level."""
    result = subprocess.run(
        [sys.executable, "-m", "or1_trl.cli", "train", "--model_name_or_path", vllm_server.model_path,
         "--dataset_name", str(run_files / "train.jsonl"), "--reward_funcs", "interrupter.reward",
         "--output_dir", str(run_files / "out"), "--use_cpu", "true", "--bf16", "false", "--use_vllm", "true",
         "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url, "--vllm_weight_sync", "disk",
         "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "6",
         "--max_steps", "1", "--save_strategy", "no", "--report_to", "none"],
        cwd=run_files, capture_output=True, text=True, timeout=600, env={**ENV, API_KEY_ENV: vllm_server.api_key})
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^vllm_sync_dir: /dev/shm/\S+ \(tmpfs, private to this user, ", result.stderr, flags=re.M)
    assert re.search(r"^vLLM disk weight sync: full weights \(not a PEFT model\), written in ", result.stderr,
                     flags=re.M)


def test_ctrl_c_before_training_is_one_line_too(capsys):
    from or1_trl.cli import train_parser
    from or1_trl.cli.console import stop_on_interrupt

    with pytest.raises(SystemExit) as exited, stop_on_interrupt(train_parser()):
        raise KeyboardInterrupt
    assert exited.value.code == 130
    assert capsys.readouterr().err == "or1-trl train: interrupted before training started.\n"
