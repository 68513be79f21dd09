"""`or1_trl.trainer.observability`: the step time split, training accuracy, the entropy and skipped-step warnings;
and what a run logs."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.recipe.rejection import group_outcomes
from or1_trl.testing import tiny_model, tiny_model_and_tokenizer, tiny_tokenizer, tiny_training_args
from or1_trl.trainer.observability import EntropyWatch, SkippedStepWatch, StepTimer, StepTimerCallback, accuracy_metrics

from ..helpers import G, TrainerLog


class ScriptedClock:
    """A clock that reads the times it is given, one per call."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_step_timer_charges_each_moment_to_the_innermost_phase():
    # t: 0 start | 1 update | 3 other (prepare inputs) | 4 rollout | 9 /rollout | 10 reward | 12 /reward
    #    | 13 /other | 16 /update | 17 update (optimizer) | 18 /update | 20 step end
    timer = StepTimer(ScriptedClock(0, 1, 3, 4, 9, 10, 12, 13, 16, 17, 18, 20))
    timer.start()
    with timer.phase("update"):
        with timer.phase("other"):
            with timer.phase("rollout"):
                pass
            with timer.phase("reward"):
                pass
    with timer.phase("update"):
        pass
    split = timer.end_step()
    # update: 1-3, 13-16, 17-18 = 6; rollout 5; reward 2; other = 20 - 13 = 7 (0-1, 3-4, 9-10, 12-13, 16-17, 18-20)
    expected = {"rollout": 5, "reward": 2, "update": 6, "other": 7}
    assert split["time/step_s"] == 20
    for name, seconds in expected.items():
        assert split[f"time/{name}_s"] == seconds
        assert split[f"time/{name}_share"] == seconds / 20
    # The next step starts where this one ended.
    timer._clock = ScriptedClock(21, 23, 25)
    with timer.phase("rollout"):
        pass
    assert timer.end_step() == pytest.approx({"time/step_s": 5, "time/rollout_s": 2, "time/reward_s": 0, "time/update_s": 0,
                                              "time/other_s": 3, "time/rollout_share": 0.4, "time/reward_share": 0,
                                              "time/update_share": 0, "time/other_share": 0.6})
    with pytest.raises(ValueError, match="unknown phase 'generate'"):
        timer.enter("generate")


def test_step_timer_callback_charges_the_optimizer_step_to_update():
    splits = []
    timer = StepTimer(ScriptedClock(0, 4, 7, 10))
    callback = StepTimerCallback(timer, splits.append)
    callback.on_train_begin(None, None, None)  # t=0
    callback.on_pre_optimizer_step(None, None, None)  # t=4
    callback.on_optimizer_step(None, None, None)  # t=7
    callback.on_step_end(None, None, None)  # t=10
    assert splits == [pytest.approx({"time/step_s": 10, "time/rollout_s": 0, "time/reward_s": 0, "time/update_s": 3,
                                     "time/other_s": 7, "time/rollout_share": 0, "time/reward_share": 0,
                                     "time/update_share": 0.3, "time/other_share": 0.7})]


def test_accuracy_metrics_by_hand():
    nan = float("nan")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, nan, 0.5, 2.0, 0.0])
    truncated = torch.tensor([0, 0, 1, 0, 0, 0, 1, 1], dtype=torch.bool)
    # scored: all but row 4 (7 rows); correct (reward >= 1): rows 0, 2, 3, 6 -> 4/7
    # not truncated and scored: rows 0, 1, 3, 5 -> correct 0, 3 -> 2/4
    assert accuracy_metrics(rewards, truncated) == {"accuracy/all": 4 / 7, "accuracy/non_truncated": 0.5}
    everything_truncated = accuracy_metrics(rewards, torch.ones(8, dtype=torch.bool))
    assert everything_truncated["accuracy/all"] == 4 / 7 and math.isnan(everything_truncated["accuracy/non_truncated"])


def feed(watch, entropies, coefs=None):
    """`[(step, message)]` the watch gives when fed `entropies` (and the controller's c after each step)."""
    coefs = coefs or [0.0] * len(entropies)
    return [(step, m) for step, (e, c) in enumerate(zip(entropies, coefs), 1) for m in watch.observe(e, c)]


def test_collapse_warning_when_the_controller_is_off():
    watch = EntropyWatch(target=0.2, adaptive=False, coef_max=1.0, collapse_fraction=0.5, collapse_steps=3,
                         settings={"N_SGD": 4.0})
    # below 0.1 at steps 2, (3: None, not measured: neither counts nor breaks the run) 4; 5 is above; then 6, 7, 8
    # -> fires at 8, once
    entropies = [0.3, 0.09, None, 0.08, 0.15, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01]
    warnings = feed(watch, entropies)
    assert [step for step, _ in warnings] == [8]
    message = warnings[0][1]
    assert "below 0.5 x entropy_target = 0.1 nats for 3 steps (now 0.03)" in message
    assert "off (use_adaptive_entropy=False)" in message
    for remedy in ("N_SGD = 1", "temperature", "use_adaptive_entropy=True", "entropy_coef_max"):
        assert remedy in message
    assert "This run: N_SGD=4.0." in message


def test_collapse_warning_waits_for_a_saturated_controller():
    watch = EntropyWatch(target=0.2, adaptive=True, coef_max=0.01, collapse_steps=2)
    entropies = [0.05] * 6
    coefs = [0.005, 0.01, 0.005, 0.01, 0.01, 0.01]  # saturated at steps 2, 4, 5, 6: two in a row first at 5
    warnings = feed(watch, entropies, coefs)
    collapses = [(step, m) for step, m in warnings if m.startswith("Entropy collapse")]
    assert [step for step, _ in collapses] == [5]
    assert "saturated at entropy_coef_max=0.01" in collapses[0][1]
    # Not saturated, or entropy at the fraction exactly, or the warning disabled: never.
    for watch, entropies, coefs in [
        (EntropyWatch(target=0.2, adaptive=True, coef_max=0.01, collapse_steps=2), [0.05] * 6, [0.005] * 6),
        (EntropyWatch(target=0.2, adaptive=False, coef_max=1.0, collapse_steps=2), [0.1] * 6, None),
        (EntropyWatch(target=0.2, adaptive=False, coef_max=1.0, collapse_steps=0), [0.01] * 6, None),
    ]:
        assert not [m for _, m in feed(watch, entropies, coefs) if m.startswith("Entropy collapse")]


@pytest.mark.parametrize(
    "entropies,adaptive,fires_at",
    [
        ([0.25, 0.20, 0.12, 0.1], True, 3),  # mean of the first 3 = 0.19 <= target
        ([0.25, 0.20, 0.16, 0.1], True, None),  # mean 0.2033 > target; later steps do not count
        ([None, 0.25, 0.2, 0.12], True, 4),  # an unmeasured step is not one of the first steps
        ([0.1, 0.1, 0.1, 0.1], False, None),  # the controller is off: it will not hold anything up
    ],
)
def test_low_start_warning_once_from_the_first_steps(entropies, adaptive, fires_at):
    watch = EntropyWatch(target=0.2, adaptive=adaptive, coef_max=1.0, collapse_steps=0)
    warnings = feed(watch, entropies + [0.01] * 3, [0.005] * 7)
    assert [step for step, _ in warnings] == ([fires_at] if fires_at else [])
    if fires_at:
        assert "already at or below entropy_target=0.2" in warnings[0][1]
        for knob in ("entropy_target", "use_adaptive_entropy=False", "entropy_coef_max", "entropy_coef_delta"):
            assert knob in warnings[0][1]


def prompts(n=16):
    return Dataset.from_dict({"prompt": [f"Q: {i}+{i}=? A:" for i in range(n)]})


def test_entropy_warnings_are_logged_once_during_training(tmp_path, caplog):
    """The tiny model's entropy (~6 nats) is far below a target of 100: the low-start warning after 3 steps, and —
    c saturated from step 1 (c_max = Δ), collapse_steps=1 — the collapse warning at step 1; each exactly once."""
    from transformers.utils import logging as hf_logging

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(
        tmp_path, max_steps=4, learning_rate=1e-3, entropy_target=100.0, entropy_coef_delta=1e-3, entropy_coef_max=1e-3,
        entropy_collapse_steps=1, rejection_sampling="off"))
    trainer = OR1Trainer(model, lambda completions, **kw: [float(len(c) % 2) for c in completions], args=args,
                         train_dataset=prompts(), processing_class=tokenizer)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING", logger="or1_trl.trainer.or1_trainer"):
            trainer.train()
    finally:
        hf_logging.disable_propagation()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith("Entropy collapse")]) == 1
    assert len([m for m in messages if "already at or below entropy_target=100" in m]) == 1
    entropies = [e["entropy"] for e in trainer.state.log_history if "entropy" in e]
    assert len(entropies) == 4 and max(entropies) < 50


def wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline wandb run, read from its `.wandb` file by wandb's own reader."""
    (log,) = [os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".wandb")]
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", log], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


# The list of per-step metrics, as logged.
STEP_METRICS = [
    "entropy", "entropy_coef", "entropy/alpha", "entropy/active", "entropy/target", "rejection/kept_group_frac",
    "rejection/solve_none_frac", "rejection/solve_all_frac", "pool/size", "stage", "completions/clipped_ratio",
    "accuracy/all", "accuracy/non_truncated", "completions/mean_length", "refill/rounds",
    *[f"time/{phase}_{unit}" for phase in ("rollout", "reward", "update", "other") for unit in ("s", "share")],
    "time/step_s",
]
REWARD_SECONDS = 0.2


def test_run_logs_time_split_and_accuracy_and_wandb_files_hold_them(tmp_path, monkeypatch):
    """A 2-step run with report_to=["wandb"] (offline): every step logs the metrics above; accuracy matches the
    completions the reward saw; the time split adds up and charges a reward that sleeps to `reward`; and the offline
    run's `.wandb` file holds every metric at every step."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "or1-test")
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    calls = []

    def reward(completions, completion_ids, **kwargs):
        time.sleep(REWARD_SECONDS)
        rewards = [float(len(c) % 2) for c in completions]
        calls.append([(r, ids[-1] != tokenizer.eos_token_id) for r, ids in zip(rewards, completion_ids)])
        return rewards

    args = OR1Config(**tiny_training_args(
        tmp_path / "run", learning_rate=1e-3, report_to=["wandb"], rejection_refill_rounds=1,
        generation_kwargs={"sequence_bias": {(tokenizer.eos_token_id,): 4.0}}))  # some completions end, some not
    trainer = OR1Trainer(model, reward, args=args, train_dataset=prompts(), processing_class=tokenizer)
    try:
        trainer.train()
    finally:
        wandb.finish()
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert len(steps) == 2
    for entry in steps:
        missing = [key for key in STEP_METRICS if key not in entry]
        assert not missing, missing

    # Accuracy: the generate calls of each step (a refill round adds one), by hand from what the reward saw.
    per_step, i = [], 0
    for entry in steps:
        rows_calls = calls[i : i + 1 + int(entry["refill/rounds"])]
        i += len(rows_calls)
        alls = [sum(r >= 1 for r, _ in rows) / len(rows) for rows in rows_calls]
        finished = [[r for r, truncated in rows if not truncated] for rows in rows_calls]
        finished = [sum(r >= 1 for r in f) / len(f) for f in finished if f]
        per_step.append((sum(alls) / len(alls), sum(finished) / len(finished) if finished else None))
    assert i == len(calls)
    measured = [(e["accuracy/all"], e["accuracy/non_truncated"]) for e in steps]
    assert len(measured) == len(per_step)
    for got, want in zip(measured, per_step):  # (pytest.approx takes no nested tuples)
        assert list(got) == pytest.approx(list(want))
    assert any(0 < e["completions/clipped_ratio"] < 1 for e in steps)

    # The time split: phases add up to the step; the sleeping reward is charged to `reward`; generation ran inside
    # TRL's timed training_step (`step_time`); the steps add up to at most the run's wall clock.
    for e in steps:
        phases = [e[f"time/{p}_s"] for p in ("rollout", "reward", "update", "other")]
        assert sum(phases) == pytest.approx(e["time/step_s"])
        assert sum(e[f"time/{p}_share"] for p in ("rollout", "reward", "update", "other")) == pytest.approx(1.0)
        n_calls = 1 + e["refill/rounds"]
        assert n_calls * REWARD_SECONDS <= e["time/reward_s"] < n_calls * REWARD_SECONDS + 0.15
        assert e["time/rollout_s"] > 0 and e["time/update_s"] > 0
        assert e["time/rollout_s"] + e["time/reward_s"] < e["step_time"] <= e["time/step_s"]
    runtime = trainer.state.log_history[-1]["train_runtime"]
    assert sum(e["time/step_s"] for e in steps) <= runtime

    # The final state is in output_dir (no checkpoint was saved), whole: `or1-trl plot` draws all four figures from it.
    from or1_trl.eval.plot import load_run, plot_run

    assert load_run(str(tmp_path / "run")).entries == steps
    written, skipped = plot_run(str(tmp_path / "run"))
    assert sorted(written) == ["accuracy", "entropy", "pool", "time_split"] and not skipped

    # The offline run files: every metric at every step, the values the trainer logged.
    (run_dir,) = [os.path.join(tmp_path, "wandb", d) for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]
    history = [row for row in wandb_history(run_dir) if "train/loss" in row]
    assert len(history) == 2
    for row, entry in zip(history, steps):
        for key in STEP_METRICS:
            assert row[f"train/{key}"] == pytest.approx(entry[key]), key


def test_skipped_step_warning_after_exactly_n_consecutive_steps():
    watch = SkippedStepWatch(after=3)
    rejected = group_outcomes(torch.tensor([0.0] * 8 + [1.0] * 4), G)  # 2 groups all fail, 1 all solve
    due = [watch.observe(skipped, rejected) for skipped in [True, True, False, True, True, True, True, True]]
    assert [bool(m) for m in due] == [False, False, False, False, False, True, False, False]  # once, at the 3rd in a row
    message = due[5][0]
    assert message.startswith("The last 3 optimizer steps were all skipped")
    assert "of 3 groups 2 had every sample fail and 1 every sample solved." in message
    masked = SkippedStepWatch(after=1).observe(True, group_outcomes(torch.tensor([0.0, 1.0, 0.0, 1.0]), G))
    assert "mask_truncated_completions=True" in masked[0]
    assert SkippedStepWatch(after=0).observe(True, rejected) == []


def test_a_run_whose_steps_are_all_skipped_says_why(tmp_path):
    """Every group rejected (the reward is always 0): the warning comes at the end of the 2nd skipped step, once."""
    tokenizer = tiny_tokenizer()
    args = OR1Config(**tiny_training_args(tmp_path, max_steps=3, skipped_steps_warning=2))
    data = Dataset.from_dict({"prompt": [f"Q: {i}+{i}=? A:" for i in range(8)]})
    trainer = OR1Trainer(tiny_model(tokenizer), lambda completions, **kw: [0.0] * len(completions), args=args,
                         train_dataset=data, processing_class=tokenizer)
    with TrainerLog() as log:
        log.trainer = trainer
        trainer.train()
    assert trainer.or1_skipped_steps == 3
    warnings = log.matching("optimizer steps were all skipped")
    assert [step for step, _ in warnings] == [1]  # given inside step 2 (one step completed before it), not repeated
    assert "of 2 groups 2 had every sample fail and 0 every sample solved" in warnings[0][1]
