"""`or1-trl plot OUTPUT_DIR`: a run's diagnostic curves as PNG files, from what the run wrote.

The source is `trainer_state.json`'s `log_history` (one entry per logged step): `OR1Trainer` writes it into
`output_dir` when training ends, and transformers into every `checkpoint-N`; the newest of them (largest
`global_step`) is read, so a run still training or killed is plotted up to its last checkpoint. The figures are the
paper's diagnostics:

- `entropy.png`: entropy over the kept tokens vs step, with the controller's target and the stage boundaries; below
  it the coefficient c and the α applied (eq. 3.2);
- `accuracy.png`: training accuracy over all samples and over non-truncated ones, and the truncation ratio, vs step
  (paper Fig. 6);
- `time_split.png`: where a step's time goes — rollout, reward, update, other — as a stacked bar per stage (mean
  seconds per step, shares in %);
- `pool.png`: the prompt pool's size vs step (the online filter at stage starts); below it the group outcomes of
  rejection sampling (kept, solve_all, solve_none).

A figure whose metrics the run did not log (e.g. `pool.png` without a prompt pool, or a plain `GRPOTrainer` run) is
skipped with the reason. Noisy curves are drawn thin with a moving average over them (`smooth` steps). A step that
logged a metric but measured nothing (`None`, NaN, or the entropy of a step whose every group was rejected: no kept
token, logged as 0) is a gap in its line, not a point. Steps are integers on the x axis. Curves sharing an axes each
get their own dash pattern and marker, the earlier drawn wider, so a curve that coincides with another stays visible.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

STATE_FILE = "trainer_state.json"
PHASES = ("rollout", "reward", "update", "other")
PHASE_COLORS = {"rollout": "#4C72B0", "reward": "#DD8452", "update": "#55A868", "other": "#8C8C8C"}
#: Metrics measured over the kept tokens: a step whose every group was rejected (`rejection/kept_group_frac` 0) logs
#: them as 0 although it measured nothing.
KEPT_TOKEN_METRICS = ("entropy",)
#: The n-th curve of an axes: its dash pattern, marker and line width (the earlier drawn wider, so one on top of
#: another leaves it visible).
CURVE_STYLES = (("-", "o", 2.6), ("--", "s", 1.8), (":", "^", 1.6), ("-.", "D", 1.2))


@dataclass
class Run:
    """The logged steps of a run: `entries` are `log_history` rows with a `step` and training metrics."""

    source: str  # the trainer_state.json read
    entries: list[dict]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """`(steps, values)` of `key` where it was logged with a value (None/NaN left out)."""
        points = [(e["step"], e[key]) for e in self.entries if e.get(key) is not None and not _isnan(e[key])]
        return [s for s, _ in points], [v for _, v in points]

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """`(steps, values)` of `key` at every step that logged it, NaN (a gap in the line) where it measured nothing:
        `None`, NaN, or a `KEPT_TOKEN_METRICS` value at a step whose every group was rejected."""
        steps, values = [], []
        for e in self.entries:
            if key not in e:
                continue
            value = e[key]
            if value is None or _isnan(value) or (key in KEPT_TOKEN_METRICS
                                                  and e.get("rejection/kept_group_frac") == 0):
                value = math.nan
            steps.append(e["step"])
            values.append(value)
        return steps, values

    def has(self, *keys: str) -> bool:
        return all(self.series(key)[0] for key in keys)

    def stages(self) -> list[tuple[int, int, int]]:
        """`(stage, first step, last step)` of each stage in the log (one stage 0 when no `stage` was logged)."""
        steps, values = self.series("stage")
        if not steps:
            all_steps = [e["step"] for e in self.entries]
            return [(0, min(all_steps), max(all_steps))] if all_steps else []
        spans: list[list[int]] = []
        for step, stage in zip(steps, values):
            if spans and spans[-1][0] == int(stage):
                spans[-1][2] = step
            else:
                spans.append([int(stage), step, step])
        return [tuple(span) for span in spans]


def _isnan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def find_state(output_dir: str) -> str:
    """The newest `trainer_state.json` of a run: in `output_dir` or one of its `checkpoint-N` folders."""
    candidates = [os.path.join(output_dir, STATE_FILE)]
    if os.path.isdir(output_dir):
        candidates += [os.path.join(output_dir, d, STATE_FILE) for d in os.listdir(output_dir)
                       if re.fullmatch(r"checkpoint-\d+", d)]
    found = []
    for path in candidates:
        if os.path.isfile(path):
            with open(path) as f:
                found.append((json.load(f).get("global_step", 0), path == candidates[0], path))
    if not found:
        raise FileNotFoundError(
            f"no {STATE_FILE} in {output_dir!r} or its checkpoint-N folders: OR1Trainer writes one into output_dir "
            "when training ends, and each checkpoint holds one (save_strategy='steps')."
        )
    return max(found)[2]


def load_run(output_dir: str) -> Run:
    """The logged training steps of the run in `output_dir` (see `find_state`)."""
    path = find_state(output_dir)
    with open(path) as f:
        history = json.load(f).get("log_history", [])
    entries = [e for e in history if "step" in e and "train_runtime" not in e
               and not any(k.startswith("eval_") for k in e)]
    if not entries:
        raise ValueError(f"{path} logs no training step (log_history is empty): nothing to plot.")
    return Run(path, entries)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first points average what exists so far); NaN (nothing
    measured) stays NaN and is left out of its neighbours' means."""
    out = []
    for i, value in enumerate(values):
        measured = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(math.nan if math.isnan(value) else sum(measured) / len(measured))
    return out


def default_window(n: int) -> int:
    """Moving-average window for `n` points: about 1/25 of the run, none below 40 points."""
    return max(1, round(n / 25)) if n >= 40 else 1


def _curve(ax, run: Run, key: str, label: str, color: str, window: int) -> None:
    """`key`'s curve on `ax` (gaps where nothing was measured), in the next of `CURVE_STYLES` of `ax`."""
    if not run.series(key)[0]:
        return
    steps, values = run.curve(key)
    drawn = sum(1 for line in ax.lines if not line.get_label().startswith("_"))
    linestyle, marker, width = CURVE_STYLES[drawn % len(CURVE_STYLES)]
    style = dict(color=color, linestyle=linestyle, linewidth=width)
    if window > 1:
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(steps, moving_average(values, window), label=f"{label} (mean of {window} steps)", **style)
    else:
        ax.plot(steps, values, label=label, marker=marker if len(steps) < 30 else None, markersize=2 + 1.5 * width,
                **style)


def _stage_lines(axes, run: Run) -> None:
    """Dotted vertical lines where a stage starts (after the first), labelled on the top axes."""
    stages = run.stages()
    for index, (stage, first, _) in enumerate(stages[1:], 1):
        boundary = (stages[index - 1][2] + first) / 2
        for ax in axes:
            ax.axvline(boundary, color="black", linestyle=":", linewidth=1)
        axes[0].annotate(f"stage {stage} →", (boundary, 1), xycoords=("data", "axes fraction"), xytext=(0, 2),
                         textcoords="offset points", fontsize=8, ha="left", va="bottom")


def new_figure(rows: int = 1, height: float = 4.0, steps: bool = True):
    """A `Figure` of `rows` axes sharing x, in this module's style (light grid, constrained layout); `steps`: x is the
    optimizer step (integer ticks only). Public for the benchmarks' plots."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, height * rows if rows == 1 else 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    if steps:
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[-1].set_xlabel("optimizer step")
    return fig, list(axes)


def entropy_figure(run: Run, window: int):
    if not run.has("entropy"):
        return None, "no `entropy` in the log"
    controller = run.has("entropy_coef") or run.has("entropy/alpha")
    fig, axes = new_figure(2 if controller else 1)
    ax = axes[0]
    _curve(ax, run, "entropy", "entropy of the policy, kept tokens", "#4C72B0", window)
    full = dict(zip(*run.series("entropy")))
    if any(abs(m - full.get(s, m)) > 1e-6 for s, m in zip(*run.series("entropy/measured"))):  # estimators differ
        _curve(ax, run, "entropy/measured", "e_k the controller measured", "#937860", window)
    steps, target = run.series("entropy/target")
    if steps:
        ax.step(steps, target, where="mid", color="#C44E52", linestyle="-.", linewidth=1.5,
                label="target (entropy_target)")
    ax.set_ylabel("entropy (nats)")
    ax.set_ylim(bottom=0)
    ax.set_title("Policy entropy vs. the adaptive controller's target (Skywork-OR1 eq. 3.2)", pad=14)
    ax.legend(loc="best", fontsize=8)
    if controller:
        ax = axes[1]
        _curve(ax, run, "entropy_coef", "coefficient c", "#8172B3", 1)
        _curve(ax, run, "entropy/alpha", "α applied (c when entropy ≤ target, else 0)", "#DA8BC3", 1)
        ax.set_ylabel("entropy coefficient")
        _, coefs = run.series("entropy_coef")
        _, alphas = run.series("entropy/alpha")
        top = max(coefs + alphas, default=0.0)
        ax.set_ylim(-0.04 * (top or 0.01), 1.1 * (top or 0.01))
        if coefs and not any(coefs):
            ax.text(0.5, 0.6, "c = 0 throughout: the entropy never fell below the target", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, color="#555555")
        ax.legend(loc="best", fontsize=8)
    _stage_lines(axes, run)
    return fig, None


def accuracy_figure(run: Run, window: int):
    keys = ("accuracy/all", "accuracy/non_truncated", "completions/clipped_ratio")
    if not any(run.has(key) for key in keys):
        return None, "no `accuracy/*` or `completions/clipped_ratio` in the log"
    fig, (ax,) = new_figure()
    _curve(ax, run, "accuracy/all", "accuracy, all samples", "#4C72B0", window)
    _curve(ax, run, "accuracy/non_truncated", "accuracy, non-truncated samples", "#55A868", window)
    _curve(ax, run, "completions/clipped_ratio", "truncation ratio (hit the length limit)", "#C44E52", window)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("fraction of samples")
    ax.set_title("Training accuracy and truncation (cf. Skywork-OR1 Fig. 6)", pad=14)
    ax.legend(loc="best", fontsize=8)
    _stage_lines([ax], run)
    return fig, None


def time_split(run: Run) -> list[tuple[str, dict[str, float]]]:
    """`(label, {phase: mean seconds per step})` per stage, from the `time/*_s` metrics."""
    out = []
    stages = run.stages()
    for stage, first, last in stages:
        rows = [e for e in run.entries if first <= e["step"] <= last and e.get("time/step_s") is not None]
        if not rows:
            continue
        label = f"stage {stage}\nsteps {first}–{last}" if len(stages) > 1 else f"steps {first}–{last}"
        out.append((label, {p: sum(e[f"time/{p}_s"] for e in rows) / len(rows) for p in PHASES}))
    return out


def time_split_figure(run: Run, window: int):
    bars = time_split(run)
    if not bars:
        return None, "no `time/*` metrics in the log (OR1Trainer logs them)"
    fig, (ax,) = new_figure(height=4.5, steps=False)
    ax.grid(True, axis="y", alpha=0.3)
    ax.grid(False, axis="x")
    labels = [label for label, _ in bars]
    bottoms = [0.0] * len(bars)
    for phase in PHASES:
        heights = [seconds[phase] for _, seconds in bars]
        ax.bar(labels, heights, bottom=bottoms, color=PHASE_COLORS[phase], label=phase, width=0.6)
        for i, (height, (_, seconds)) in enumerate(zip(heights, bars)):
            share = height / sum(seconds.values()) if sum(seconds.values()) else 0.0
            if share >= 0.04:
                ax.text(i, bottoms[i] + height / 2, f"{share:.0%}", ha="center", va="center", fontsize=9,
                        color="white")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xlabel("")
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("Where a training step's time goes (host clocks; see or1_trl/trainer/observability.py on GPUs)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    return fig, None


def pool_figure(run: Run, window: int):
    if not run.has("pool/size"):
        return None, "no `pool/size` in the log (OR1Trainer with a datasets.Dataset logs it)"
    outcomes = [k for k in ("rejection/kept_group_frac", "rejection/solve_all_frac", "rejection/solve_none_frac")
                if run.has(k)]
    fig, axes = new_figure(2 if outcomes else 1)
    steps, size = run.series("pool/size")
    axes[0].step(steps, size, where="mid", color="#4C72B0", label="prompts in the pool")
    axes[0].set_ylabel("prompts")
    axes[0].set_ylim(bottom=0)
    axes[0].set_title("Prompt pool (online filter at stage starts) and rejection sampling", pad=14)
    axes[0].legend(loc="best", fontsize=8)
    if outcomes:
        names = {"rejection/kept_group_frac": ("kept (informative)", "#55A868"),
                 "rejection/solve_all_frac": ("solve_all (every sample correct)", "#4C72B0"),
                 "rejection/solve_none_frac": ("solve_none (no sample correct)", "#C44E52")}
        for key in outcomes:
            label, color = names[key]
            _curve(axes[1], run, key, label, color, window)
        axes[1].set_ylim(-0.02, 1.02)
        axes[1].set_ylabel("fraction of groups")
        axes[1].legend(loc="best", fontsize=8)
    _stage_lines(axes, run)
    return fig, None


FIGURES = {"entropy": entropy_figure, "accuracy": accuracy_figure, "time_split": time_split_figure,
           "pool": pool_figure}


def plot_run(
    output_dir: str, out_dir: str | None = None, smooth: int | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """Write the figures of the run in `output_dir` as PNGs into `out_dir` (default `<output_dir>/plots`).

    Args:
        smooth: moving-average window in steps (None: about 1/25 of the run from 40 steps on; 1: raw curves only).

    Returns `({name: path written}, {name: why it was skipped})`.
    """
    run = load_run(output_dir)
    out_dir = out_dir or os.path.join(output_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    window = smooth if smooth is not None else default_window(len(run.entries))
    written, skipped = {}, {}
    for name, make in FIGURES.items():
        fig, reason = make(run, window)
        if fig is None:
            skipped[name] = reason
            continue
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=120)
        written[name] = path
    return written, skipped
