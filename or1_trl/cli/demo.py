"""`or1-trl demo`: `DemoArguments`, then `or1_trl.cli.demo_run.demo`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .parsing import check_at_least_one, check_output_dir, command_parser, parse_command


@dataclass
class DemoArguments:
    """Arguments of `or1-trl demo`; `__post_init__` refuses counts below 1 and an output directory that cannot be
    written or holds another run than the demo's."""

    output_dir: str = field(default="outputs/or1-demo", metadata={
        "help": "Where the trained model and tokenizer, trainer_state.json and prompt_stats.jsonl go."})
    seed: int = field(default=0, metadata={"help": "Seed of the model, the data and the training."})
    max_steps: int = field(default=150, metadata={"help": "OR1 training steps."})
    sft_steps: int = field(default=60, metadata={"help": "SFT warm-up steps (answer format)."})

    def __post_init__(self):
        from .demo_run import check_demo_dir

        check_at_least_one(self, "max_steps", "sft_steps")
        check_output_dir(self.output_dir)  # before the warm-up, not when OR1Config is built after it
        check_demo_dir(self.output_dir)  # another run's directory: one line, before the warm-up


def demo_parser(prog: str | None = "or1-trl demo"):
    return command_parser(
        DemoArguments, prog,
        "The offline demo: a tiny model (built in-process, no network) gets an SFT warm-up on the answer format, then "
        "learns small additions with OR1Trainer and the MAGIC defaults, on CPU. Prints one line per step and ends "
        "with `OR1 demo: reward A -> B` (mean reward of the first and of the last 5 steps).")


def demo(argv: list[str] | None = None, prog: str | None = "or1-trl demo") -> None:
    """The offline demo: tiny model, SFT warm-up on the answer format, then MAGIC on small additions."""
    from .console import quiet_deprecations
    from .demo_run import demo as run

    (args,) = parse_command(demo_parser(prog), argv)
    with quiet_deprecations():  # transformers' `gradient_checkpointing` FutureWarnings, raised by TRL at every step
        run(**asdict(args))
