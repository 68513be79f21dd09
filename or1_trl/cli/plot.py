"""`or1-trl plot`: `PlotArguments`, then `or1_trl.eval.plot.plot_run`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .parsing import check_at_least_one, command_parser, input_errors, parse_command


@dataclass
class PlotArguments:
    """Arguments of `or1-trl plot`; `__post_init__` checks that the run's directory exists and `--smooth`."""

    output_dir: str = field(metadata={"help": "The run's output_dir.", "positional": True})
    out: str | None = field(default=None, metadata={"help": "Where to write the PNGs (default: OUTPUT_DIR/plots)."})
    smooth: int | None = field(default=None, metadata={
        "help": "Moving-average window in steps (default: about 1/25 of the run from 40 steps on; 1: off)."})

    def __post_init__(self):
        if not os.path.isdir(self.output_dir):
            raise ValueError(f"{self.output_dir!r} is not a directory (pass the run's output_dir)")
        check_at_least_one(self, "smooth")


def plot_parser(prog: str | None = "or1-trl plot"):
    return command_parser(
        PlotArguments, prog,
        "Plot a training run: entropy vs its target with stage boundaries, training accuracy (all and non-truncated) "
        "and truncation ratio, the step's time split per stage, the prompt pool. Reads the newest trainer_state.json "
        "in OUTPUT_DIR or its checkpoint-N folders; writes PNG files.")


def plot(argv: list[str] | None = None, prog: str | None = "or1-trl plot") -> None:
    """PNG figures of a run's curves (`or1_trl/eval/plot.py`), from the trainer_state.json it wrote."""
    from ..eval.plot import plot_run

    parser = plot_parser(prog)
    (args,) = parse_command(parser, argv)
    with input_errors(parser):  # no trainer_state.json, nothing to plot
        written, skipped = plot_run(args.output_dir, args.out, args.smooth)
    for path in written.values():
        print(path)
    for name, why in skipped.items():
        print(f"skipped {name}.png: {why}")
