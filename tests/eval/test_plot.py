"""`or1-trl plot`: which state file is read, what each figure draws (numbers from a hand-built log), usage errors."""

import json
import math
import os

import pytest

from or1_trl.cli import main
from or1_trl.eval.plot import (accuracy_figure, entropy_figure, find_state, load_run, moving_average, plot_run, pool_figure,
                          time_split, time_split_figure)


def step(n, stage, **metrics):
    return {"step": n, "stage": stage, "loss": 0.0, **metrics}


# 6 steps, two stages (steps 1-4 and 5-6); the pool shrinks at the stage start.
HISTORY = [
    step(1, 0, entropy=0.5, **{"entropy/target": 0.2, "entropy_coef": 0.0, "entropy/alpha": 0.0, "pool/size": 10,
                               "accuracy/all": 0.25, "accuracy/non_truncated": 0.5, "completions/clipped_ratio": 0.5,
                               "rejection/kept_group_frac": 1.0, "time/step_s": 4.0, "time/rollout_s": 2.0,
                               "time/reward_s": 0.5, "time/update_s": 1.0, "time/other_s": 0.5}),
    step(2, 0, entropy=0.3, **{"entropy/target": 0.2, "entropy_coef": 0.0, "entropy/alpha": 0.0, "pool/size": 10,
                               "accuracy/all": 0.5, "accuracy/non_truncated": None, "completions/clipped_ratio": 1.0,
                               "rejection/kept_group_frac": 0.5, "time/step_s": 6.0, "time/rollout_s": 4.0,
                               "time/reward_s": 0.5, "time/update_s": 1.0, "time/other_s": 0.5}),
    step(3, 0, entropy=0.19, **{"entropy/target": 0.2, "entropy_coef": 0.005, "entropy/alpha": 0.0, "pool/size": 10,
                                "time/step_s": 2.0, "time/rollout_s": 1.0, "time/reward_s": 0.5, "time/update_s": 0.5,
                                "time/other_s": 0.0}),
    step(4, 0, entropy=0.18, **{"entropy/target": 0.2, "entropy_coef": 0.01, "entropy/alpha": 0.005, "pool/size": 10}),
    step(5, 1, entropy=0.21, **{"entropy/target": 0.2, "entropy_coef": 0.005, "entropy/alpha": 0.01, "pool/size": 6,
                                "time/step_s": 3.0, "time/rollout_s": 2.0, "time/reward_s": 0.0, "time/update_s": 1.0,
                                "time/other_s": 0.0}),
    step(6, 1, entropy=0.22, **{"entropy/target": 0.2, "entropy_coef": 0.0, "entropy/alpha": 0.0, "pool/size": 6}),
    {"step": 6, "train_runtime": 10.0, "train_loss": 0.0},  # the summary transformers adds at the end
]


def write_state(folder, history, global_step):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": global_step, "log_history": history}, f)


def test_the_newest_state_is_read(tmp_path):
    write_state(tmp_path / "checkpoint-2", HISTORY[:2], 2)
    write_state(tmp_path / "checkpoint-4", HISTORY[:4], 4)
    assert find_state(str(tmp_path)) == str(tmp_path / "checkpoint-4" / "trainer_state.json")  # a run still going
    write_state(tmp_path, HISTORY, 6)  # written by OR1Trainer when training ends
    assert find_state(str(tmp_path)) == str(tmp_path / "trainer_state.json")
    run = load_run(str(tmp_path))
    assert [e["step"] for e in run.entries] == [1, 2, 3, 4, 5, 6]  # the end-of-training summary is not a step
    assert run.series("accuracy/non_truncated") == ([1], [0.5])  # None (nothing to measure) left out
    assert run.stages() == [(0, 1, 4), (1, 5, 6)]
    with pytest.raises(FileNotFoundError, match="no trainer_state.json in"):
        find_state(str(tmp_path / "nothing"))


def test_moving_average_by_hand():
    assert moving_average([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([3, 1], 1) == [3, 1]
    smoothed = moving_average([1, math.nan, 3, 5], 2)  # nothing measured: a gap, left out of the next mean
    assert smoothed[0] == 1 and math.isnan(smoothed[1]) and smoothed[2:] == [3, 4]


def test_a_step_that_measured_nothing_is_a_gap_steps_are_integers_and_no_curve_hides_another(tmp_path):
    """Three steps, the second with every group rejected (TRL logs its entropy as 0: no kept token) and every sample
    truncated; equal curves: accuracy over all and over non-truncated samples, c and α, kept and solve_none groups."""
    history = [
        step(1, 0, entropy=0.5, **{"rejection/kept_group_frac": 0.5, "rejection/solve_none_frac": 0.5,
                                   "accuracy/all": 0.5, "accuracy/non_truncated": 0.5, "entropy_coef": 0.0,
                                   "entropy/alpha": 0.0, "pool/size": 8}),
        step(2, 0, entropy=0.0, **{"rejection/kept_group_frac": 0.0, "rejection/solve_none_frac": 1.0,
                                   "accuracy/all": 0.0, "accuracy/non_truncated": None, "entropy_coef": 0.0,
                                   "entropy/alpha": 0.0, "pool/size": 8}),
        step(3, 0, entropy=0.4, **{"rejection/kept_group_frac": 0.5, "rejection/solve_none_frac": 0.5,
                                   "accuracy/all": 0.25, "accuracy/non_truncated": 0.25, "entropy_coef": 0.0,
                                   "entropy/alpha": 0.0, "pool/size": 8}),
    ]
    write_state(tmp_path, history, 3)
    run = load_run(str(tmp_path))
    for window in (1, 3):
        fig, _ = entropy_figure(run, window=window)
        entropy = next(line for line in fig.axes[0].lines if line.get_label().startswith("entropy of the policy"))
        values = list(entropy.get_ydata())
        assert list(entropy.get_xdata()) == [1, 2, 3] and values[0] == 0.5 and math.isnan(values[1]), window
        assert values[2] == (0.4 if window == 1 else (0.5 + 0.4) / 2)  # the mean of 3 steps leaves the gap out
    for figure in (entropy_figure, accuracy_figure, pool_figure):
        fig, _ = figure(run, window=1)
        ticks = [t for t in fig.axes[-1].get_xticks() if 1 <= t <= 3]
        assert ticks and all(float(t).is_integer() for t in ticks), (figure.__name__, ticks)
        for ax in fig.axes:  # curves that coincide (c and α; accuracy all and non-truncated) both stay visible
            drawn = [line for line in ax.lines if not line.get_label().startswith("_")]
            styles = [(line.get_linestyle(), line.get_marker()) for line in drawn]
            assert len(set(styles)) == len(styles), (figure.__name__, styles)
            widths = [line.get_linewidth() for line in drawn if line.get_marker() not in ("None", None)]
            assert widths == sorted(widths, reverse=True), widths  # the earlier drawn wider: its edges show


def test_figures_draw_the_logged_numbers(tmp_path):
    write_state(tmp_path, HISTORY, 6)
    run = load_run(str(tmp_path))

    fig, _ = entropy_figure(run, window=1)
    top, bottom = fig.axes
    lines = {line.get_label(): line for line in top.lines}
    entropy = lines["entropy of the policy, kept tokens"]
    assert list(entropy.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(entropy.get_ydata()) == [0.5, 0.3, 0.19, 0.18, 0.21, 0.22]
    assert list(lines["target (entropy_target)"].get_ydata()) == [0.2] * 6
    boundaries = [line.get_xdata()[0] for line in top.lines if line.get_linestyle() == ":"]
    assert boundaries == [4.5]  # between stage 0's last step and stage 1's first
    coef = {line.get_label(): list(line.get_ydata()) for line in bottom.lines}
    assert coef["coefficient c"] == [0.0, 0.0, 0.005, 0.01, 0.005, 0.0]
    assert coef["α applied (c when entropy ≤ target, else 0)"] == [0.0, 0.0, 0.0, 0.005, 0.01, 0.0]

    fig, _ = accuracy_figure(run, window=1)
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines}
    assert curves["accuracy, all samples"] == ([1, 2], [0.25, 0.5])
    steps, values = curves["accuracy, non-truncated samples"]  # step 2 logged None (every sample truncated): a gap
    assert steps == [1, 2] and values[0] == 0.5 and math.isnan(values[1])
    assert curves["truncation ratio (hit the length limit)"] == ([1, 2], [0.5, 1.0])

    # Time split: the mean seconds per step of each stage over the steps that logged it.
    assert time_split(run) == [
        ("stage 0\nsteps 1–4", {"rollout": 7 / 3, "reward": 0.5, "update": 2.5 / 3, "other": 1 / 3}),
        ("stage 1\nsteps 5–6", {"rollout": 2.0, "reward": 0.0, "update": 1.0, "other": 0.0}),
    ]
    fig, _ = time_split_figure(run, window=1)
    heights = [[round(p.get_height(), 6) for p in container] for container in fig.axes[0].containers]
    assert heights == [[round(7 / 3, 6), 2.0], [0.5, 0.0], [round(2.5 / 3, 6), 1.0], [round(1 / 3, 6), 0.0]]
    # Shares of each stage's step (stage 0: 4 s per step), phase by phase; a share below 4% is not written.
    assert [t.get_text() for t in fig.axes[0].texts] == [f"{7 / 12:.0%}", "67%", f"{0.5 / 4:.0%}", f"{2.5 / 12:.0%}",
                                                         "33%", f"{1 / 12:.0%}"]

    fig, _ = pool_figure(run, window=1)
    assert list(fig.axes[0].lines[0].get_ydata()) == [10, 10, 10, 10, 6, 6]
    assert list(fig.axes[1].lines[0].get_ydata()) == [1.0, 0.5]


def test_plot_writes_pngs_and_skips_what_the_run_did_not_log(tmp_path):
    write_state(tmp_path / "or1", HISTORY, 6)
    written, skipped = plot_run(str(tmp_path / "or1"), smooth=2)
    assert sorted(written) == ["accuracy", "entropy", "pool", "time_split"] and skipped == {}
    for path in written.values():
        assert os.path.dirname(path) == str(tmp_path / "or1" / "plots")
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # A plain GRPOTrainer run: TRL's entropy and truncation ratio, no pool, no time split.
    write_state(tmp_path / "trl", [{"step": 1, "loss": 0.0, "entropy": 1.0, "completions/clipped_ratio": 0.5}], 1)
    written, skipped = plot_run(str(tmp_path / "trl"), out_dir=str(tmp_path / "figures"))
    assert sorted(written) == ["accuracy", "entropy"] and sorted(skipped) == ["pool", "time_split"]
    assert "no `pool/size` in the log" in skipped["pool"]
    assert sorted(os.listdir(tmp_path / "figures")) == ["accuracy.png", "entropy.png"]


def test_plot_command(tmp_path, capsys):
    write_state(tmp_path, HISTORY, 6)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.split()
    assert sorted(out) == sorted(str(tmp_path / "out" / f"{n}.png") for n in ("entropy", "accuracy", "time_split", "pool"))
    for argv, message in [
        ([str(tmp_path / "missing")], "is not a directory"),
        ([str(tmp_path / "out")], "no trainer_state.json in"),
        ([str(tmp_path), "--smooth", "0"], "--smooth must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["plot", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
