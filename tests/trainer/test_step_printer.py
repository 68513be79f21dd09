"""One line per logged training step (`or1_trl/trainer/step_printer.py`): the line from the logged metrics, and the
printer that prints it on the main process only."""

from or1_trl.trainer.step_printer import step_line


LOGS = {"reward": 0.25, "accuracy/all": 0.25, "entropy": 0.5123, "entropy_coef": 0.005, "skipped_steps": 1.0,
        "rejection/kept_group_frac": 0.5, "time/step_s": 2.0, "time/rollout_share": 0.5, "time/reward_share": 0.125,
        "time/update_share": 0.25, "time/other_share": 0.125}


def test_a_step_line_shows_the_logged_numbers():
    assert step_line(LOGS, 7, 20, skipped_before=1.0) == (
        "step   7/20 | reward 0.250 | accuracy 0.25 | entropy 0.512 | entropy_coef 0.0050 | kept_groups 0.50 | "
        "2.00 s: rollout 50% reward 12% update 25% other 12%")
    # Every group rejected: the step is skipped (the count grew) and its entropy measured nothing (logged as 0).
    rejected = {**LOGS, "rejection/kept_group_frac": 0.0, "entropy": 0.0, "skipped_steps": 2.0}
    line = step_line(rejected, 8, 20, skipped_before=1.0)
    assert "| entropy - |" in line and "| kept_groups 0.00 (skipped: no trainable token) |" in line
    assert step_line({"reward": 0.5, "accuracy/all": None}, 1, 2) == (
        "step   1/2 | reward 0.500 | accuracy - | entropy - | entropy_coef - | kept_groups -")


def test_the_printer_prints_steps_and_evaluations_on_the_main_process_only(capsys):
    from transformers import TrainerState

    from or1_trl.trainer.step_printer import StepPrinter

    printer, state = StepPrinter(), TrainerState(global_step=3, max_steps=5)
    printer.on_log(None, state, None, logs=dict(LOGS))
    printer.on_log(None, state, None, logs={"eval_reward": 0.5, "eval_avg@4": 0.25, "eval_loss": 0.0})
    printer.on_log(None, state, None, logs={"train_runtime": 9.0})  # the end-of-training summary: the closing lines
    assert capsys.readouterr().out.splitlines() == [step_line(LOGS, 3, 5, 0.0),
                                                    "eval at step 3 | reward 0.500 | avg@4 0.250"]
    state.is_world_process_zero = False
    printer.on_log(None, state, None, logs=dict(LOGS))
    assert capsys.readouterr().out == "" and printer.rewards == [0.25, 0.25]


def test_step_lines_carry_the_elapsed_time_and_an_eta_at_the_mean_pace():
    """Issue 49: training began at step 2 (a resume) at clock 100; step 5 logged at clock 160: 3 steps in 60 s, 15
    steps to go at 20 s each."""
    from transformers import TrainerState

    from or1_trl.trainer.step_printer import StepPrinter, duration

    clock = [100.0]
    printer = StepPrinter(clock=lambda: clock[0])
    assert printer.pace(3, 20) is None  # before training began
    printer.on_train_begin(None, TrainerState(global_step=2, max_steps=20), None)
    clock[0] = 130.0
    printer.on_train_begin(None, TrainerState(global_step=4, max_steps=20), None)  # a stage's pass: not a new start
    clock[0] = 160.0
    assert printer.pace(5, 20) == (60.0, 300.0)
    assert step_line({"reward": 0.5}, 5, 20, pace=(60.0, 300.0)).endswith("| 1m00s elapsed, ETA 5m00s")
    assert [duration(s) for s in (42.4, 185, 7620)] == ["42s", "3m05s", "2h07m"]


def test_the_first_step_says_what_it_is_doing_before_it_starts(capsys, tmp_path):
    """Issue 49: minutes of silence before step 1 on a real model; the printer says what the step does first."""
    from transformers import TrainerState

    from or1_trl import OR1Config
    from or1_trl.testing import tiny_training_args
    from or1_trl.trainer.step_printer import StepPrinter, start_line

    assert start_line(1, 36, 8, 8, 48, "on the vLLM server at http://127.0.0.1:8000") == (
        "Step 1 of 36: sampling 8 completions for each of 8 prompts (up to 48 tokens) on the vLLM server at "
        "http://127.0.0.1:8000, then the rewards and the update; a line follows each step.")
    args = OR1Config(**tiny_training_args(tmp_path))  # 2 prompts x 4 completions a step, on this process
    capsys.readouterr()
    printer = StepPrinter()
    printer.on_train_begin(args, TrainerState(global_step=2, max_steps=5), None)  # a resume at step 2
    printer.on_train_begin(args, TrainerState(global_step=3, max_steps=5), None)  # a stage's pass: said once
    prompts = args.generation_batch_size // args.num_generations
    assert capsys.readouterr().out.splitlines() == [
        f"Step 3 of 5: sampling {args.num_generations} completions for each of {prompts} prompts (up to "
        f"{args.max_completion_length} tokens) with transformers' generate on the CPU, then the rewards and the "
        "update; a line follows each step."]
