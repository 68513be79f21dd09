"""Command line: `or1-trl <command> [ARGS]`; every command has its own `--help`.

    or1-trl --help                                     # the commands
    or1-trl demo [--output_dir DIR] [--seed N]         # offline demo (tiny model, CPU, about a minute)
    or1-trl eval --model outputs/run --benchmarks aime24 aime25 --n 32 [--server_url http://localhost:8000]
    or1-trl train --config examples/recipes/skywork_or1_math_7b.yaml
    or1-trl train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name my/math-dataset --output_dir out
    or1-trl train --config examples/recipes/skywork_or1_7b.yaml --dataset_name Skywork/Skywork-OR1-RL-Data \
        --dataset_train_split code+code+math --difficulty_model 7B --difficulty_range 1 15
    or1-trl prepare --dataset_name my/math --output_dir prepared          # §6.1: dedup, figures, decontamination
    or1-trl difficulty --dataset_name my/math --model MODEL --output_dir d  # §6.2: N samples, keep 1..N-1
    or1-trl select-examples --stats out/prompt_stats.jsonl --dataset_name my/math --top 1 --output_dir pi1  # 1-shot
    or1-trl serve Qwen/Qwen2.5-0.5B-Instruct --weight-sync disk [vLLM args]   # a vLLM server to generate on
    or1-trl plot outputs/run                           # PNG figures of a run's curves (outputs/run/plots)

`examples/train_or1.py` is the same training entry point for `accelerate launch` (with no arguments it runs the
demo). `or1-trl train`'s arguments are TRL's: an `OR1Config` (every `GRPOConfig` field), TRL's `ModelConfig`
(model, dtype, LoRA) and the `ScriptArguments` below; `--config recipe.yaml` fills them from a YAML file (TRL's
`TrlParser`).

Errors: a wrong input (a flag, a `--config` file, a dataset, an output directory) ends the command with exit status
2 and one line `or1-trl CMD: error: WHAT` under a short usage line, before the model loads where the input allows
it: the parsers are `CommandParser`s (`ShortUsageErrors`: no 200-line option list; `allow_abbrev=False`: no
`--max_step` taken for `--max_steps`), and `input_errors(parser)` turns the `ValueError`s / `OSError`s of the input
phase into that line. `OR1_DEBUG=1` (or `or1-trl --debug CMD`) shows the traceback instead.

Adding a command: write `def my_command(argv: list[str]) -> None` that parses `argv` with its own parser
(`CommandParser(prog="or1-trl my-command")` or `train_parser`'s TRL parser), and add one `Command` to `COMMANDS`.
Commands import what they need inside the function, so `or1-trl --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from . import __version__
from .data import REWARD_COLUMNS

#: Set (to anything but "" or "0") to see the traceback of an input error instead of its one line.
DEBUG_ENV = "OR1_DEBUG"


def short_usage(parser: argparse.ArgumentParser) -> str:
    """The usage line of an error: the command, its positional and required arguments, `[options]`."""
    words = [parser.prog]
    for action in parser._actions:  # argparse's own usage formatter walks the same list
        if isinstance(action, argparse._SubParsersAction):
            words.append("COMMAND ...")
        elif not action.option_strings:
            words.append(action.metavar or action.dest)
        elif action.required:
            words.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
    return " ".join(words) + f" [options]   ({parser.prog} --help: all of them)"


class ShortUsageErrors:
    """Parser mixin: `error()` prints `usage: <short_usage>` and one line `PROG: error: MESSAGE` (newlines folded),
    exit 2 — argparse's format without the full option list in the usage (`or1-trl train` has 200 options)."""

    def error(self, message):
        self.exit(2, f"usage: {short_usage(self)}\n{self.prog}: error: {' '.join(str(message).split())}\n")


class CommandParser(ShortUsageErrors, argparse.ArgumentParser):
    """An `argparse.ArgumentParser` with short errors, without abbreviations (`--max_step` is not `--max_steps`)
    and with the defaults shown in `--help`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def check_output_dir(parser: argparse.ArgumentParser, output_dir: str) -> None:
    """`parser.error` if `output_dir` is a file or cannot be written (`OR1Config` checks the trainers' own)."""
    from .paths import output_dir_problem

    problem = output_dir_problem(output_dir)
    if problem:
        parser.error(problem)


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def input_errors(parser: argparse.ArgumentParser, prefix: str = ""):
    """Inside: a `ValueError` or an `OSError` (a flag, a `--config` file, a dataset, a model path, an output
    directory that is wrong) ends the command as `parser.error` does, with `prefix` before the message; with
    `OR1_DEBUG=1` it propagates with its traceback. Wrap the input phase only (parsing, loading the data, building
    the trainer): errors raised while training keep their traceback."""
    import yaml

    try:
        yield
    except (ValueError, OSError, yaml.YAMLError) as exc:
        if debug():
            raise
        parser.error(f"{prefix}{exc}" if str(exc) else f"{prefix}{type(exc).__name__}")

# --------------------------------------------------------------------------------------------------------------
# or1-trl train
# --------------------------------------------------------------------------------------------------------------

# `trl grpo --reward_funcs` names (trl/scripts/grpo.py, from `trl.rewards`).
TRL_REWARD_NAMES = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")

@dataclass
class ScriptArguments:
    """Data arguments of `or1-trl train`."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset: a Hub id, a local folder, a local .jsonl/.json/.parquet/.csv file, or a builder "
                  "(json, parquet, csv) for --data_files."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    data_files: list[str] | None = field(
        default=None,
        metadata={"help": "Local data files, TRL's form: --dataset_name json --data_files a.jsonl b.jsonl (without "
                  "--dataset_name, the builder their extension names)."},
    )
    dataset_train_split: str = field(
        default="train",
        metadata={"help": "Split to train on; '+' joins splits: 'math+code' for Skywork/Skywork-OR1-RL-Data, "
                  "'code+code+math' as its released 7B/32B scripts mix them."},
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompt."})
    answer_column: str | None = field(
        default=None,
        metadata={
            "help": "Column holding the gold answer(s) (math) or the tests (code). Default: the reward's own column, "
            "'answer' for --reward math or auto, 'tests' for --reward code. Not used with the released (verl) format, "
            "whose gold is reward_model.ground_truth."
        },
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "Verifier: 'math' (Math-Verify, paper §7.1), 'code' (sandbox, §7.2), or 'auto': each row by its "
            "'ability' column (the released format: math and code rows in one run); without one, math. Default: "
            "auto, or none when --reward_funcs is given alone.",
            "choices": ["auto", "math", "code"],
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Reward functions as `trl grpo` takes them: TRL's names ({', '.join(TRL_REWARD_NAMES)}; the "
            "last with max_completion_len = --max_completion_length) or module.function import paths (the current "
            "directory is importable). Alone: they score the completions; beside --reward: added to the verifier's."
        },
    )
    difficulty_model: str | None = field(
        default=None,
        metadata={"help": "Offline difficulty filter (paper §6.2): keep rows whose extra_info.model_difficulty count "
                  "for this model lies in --difficulty_range. '1.5B', '7B', '32B' name DeepSeek-R1-Distill-Qwen-*; "
                  "any other name is a key as `or1-trl difficulty` writes it."},
    )
    difficulty_range: list[int] | None = field(
        default=None,
        metadata={"help": "LOW HIGH, inclusive (default with --difficulty_model: 1 15, the released scripts' filter "
                  "of 16 samples)."},
    )
    drop_invalid_rows: bool = field(
        default=False,
        metadata={"help": "Drop rows that cannot be scored (no gold answer, malformed tests, unknown ability) "
                  "instead of stopping with their counts."},
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes for checking and converting the dataset (`datasets.map`)."}
    )

    def __post_init__(self):
        if self.reward is None and not self.reward_funcs:
            self.reward = "auto"
        if self.answer_column is None:
            self.answer_column = REWARD_COLUMNS["code" if self.reward == "code" else "math"]

    def problem(self) -> str | None:
        """What is wrong with these arguments together, or `None`."""
        if self.difficulty_range is not None:
            if len(self.difficulty_range) != 2 or self.difficulty_range[0] > self.difficulty_range[1]:
                return f"--difficulty_range takes LOW HIGH with LOW <= HIGH, got {' '.join(map(str, self.difficulty_range))}"
            if self.difficulty_model is None:
                return "--difficulty_range needs --difficulty_model (whose counts to filter on)"
        return None


def model_path_problem(name: str) -> str | None:
    """Why `name` can be neither a local model directory nor a Hugging Face Hub id, or `None` if it can be one.

    Checked before anything is loaded, so that a mistyped path says so instead of failing later with the Hub's
    "Repo id must be in the form ..." (or a network error). A name that looks like a filesystem path (absolute,
    `./`, `../`, `~`, more than one separator) must exist; anything else must be a valid Hub id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return f"model path {name!r} is a file; pass the model's directory (the one with config.json)"
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    looks_like_path = (
        name.startswith(("~", "./", "../", ".\\", "..\\"))
        or os.path.isabs(name)
        or name in (".", "..")
        or sum(name.count(s) for s in separators) > 1
        or name.endswith(tuple(separators))
    )
    if looks_like_path:
        return (
            f"model path {name!r} does not exist (resolved to {os.path.abspath(path)!r}); pass an existing local "
            "model directory or a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        return f"--model_name_or_path {name!r} is neither an existing local directory nor a valid Hub id ({exc})"
    return None


def resolve_reward_funcs(names: list[str], max_completion_length: int) -> list[Callable]:
    """`--reward_funcs` as `trl grpo` resolves them (TRL exposes no resolver): a name of `TRL_REWARD_NAMES` from
    `trl.rewards`, or `module.function` imported with the current directory on `sys.path`. A `ValueError` names the
    first that is neither; nothing else is loaded."""
    import importlib

    funcs = []
    for name in names:
        if name in TRL_REWARD_NAMES:
            import trl.rewards

            func = getattr(trl.rewards, name)
            if name == "get_soft_overlong_punishment":  # a factory: `trl grpo` fixes 1280 / 256; we use the run's length
                func = func(max_completion_len=max_completion_length, soft_punish_cache=min(256, max_completion_length // 4))
        elif "." in name.strip("."):
            module, attr = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                func = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"--reward_funcs {name}: cannot import {attr!r} from {module!r} ({exc})") from None
        else:
            raise ValueError(f"--reward_funcs {name}: neither one of TRL's reward names ({', '.join(TRL_REWARD_NAMES)}) "
                             "nor a module.function import path")
        if not callable(func):
            raise ValueError(f"--reward_funcs {name}: {type(func).__name__} is not callable")
        funcs.append(func)
    return funcs


def train_parser(prog: str | None = "or1-trl train"):
    """TRL's parser for the training arguments: `ScriptArguments`, `OR1Config`, `ModelConfig`, plus `--config`."""
    from trl import ModelConfig, TrlParser

    from .config import OR1Config

    class TrainParser(ShortUsageErrors, TrlParser):
        pass

    return TrainParser(
        (ScriptArguments, OR1Config, ModelConfig),
        prog=prog,
        description="Train with the Skywork-OR1 (MAGIC) recipe: OR1Trainer = TRL's GRPOTrainer + the paper.",
        epilog="--config RECIPE.yaml sets any of these flags from a YAML file (flags given here win); see "
        "examples/recipes/. Run with `accelerate launch examples/train_or1.py ...` for several processes.",
        allow_abbrev=False,
    )


def config_file_problem(argv: list[str]) -> str | None:
    """What is wrong with the `--config` file of `argv` (TRL's parser reads it with a traceback), or `None`."""
    import yaml

    if "--config" not in argv:
        return None
    index = argv.index("--config")
    if index + 1 == len(argv) or argv[index + 1].startswith("--"):
        return "--config needs a YAML file (e.g. examples/recipes/tiny_cpu.yaml)"
    path = argv[index + 1]
    if not os.path.isfile(path):
        return f"--config {path!r}: {'a directory, not a file' if os.path.isdir(path) else 'no such file'}"
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as exc:
        return f"--config {path!r} cannot be read: {exc}"
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"--config {path!r} is not valid YAML: {getattr(exc, 'problem', None) or exc}{where}"
    if not isinstance(config, dict):
        return f"--config {path!r} must be a YAML mapping (flag: value lines), not {type(config).__name__}"
    return None


def train(argv: list[str] | None = None, prog: str | None = "or1-trl train") -> None:
    """Train with the MAGIC recipe on `--dataset_name`, scored by the `--reward` verifier and/or `--reward_funcs`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = train_parser(prog)
    if config_file_problem(argv):
        parser.error(config_file_problem(argv))
    with input_errors(parser):  # OR1Config's and TRL's checks of the values: one line, not a traceback
        script_args, training_args, model_args, config_unknown, cli_unknown = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    if cli_unknown:
        parser.error(f"unrecognized arguments: {' '.join(cli_unknown)}")
    if config_unknown:
        keys = [s[2:] for s in config_unknown[::2]]
        parser.error(f"unknown keys in the --config file: {', '.join(keys)}")
    if script_args.problem():
        parser.error(script_args.problem())
    with input_errors(parser):
        extra_rewards = resolve_reward_funcs(script_args.reward_funcs or [], training_args.max_completion_length)
    if script_args.reward is None and script_args.difficulty_model:
        parser.error("--difficulty_model filters rows as the verifier reads them: give --reward (e.g. auto) with it")
    data = script_args.dataset_name is not None or script_args.data_files is not None
    builtin = model_args.model_name_or_path is None and not data
    if builtin and script_args.reward == "code":
        parser.error("without --model_name_or_path and --dataset_name, training uses the demo's tiny model and "
                     "addition prompts, which need --reward math (or auto)")
    if not builtin and (model_args.model_name_or_path is None or not data):
        parser.error("training needs both --model_name_or_path and --dataset_name, or neither (then the demo's tiny "
                     "model and addition prompts, offline; `or1-trl demo` runs the demo itself)")
    if not builtin:
        problem = model_path_problem(model_args.model_name_or_path)
        if problem:
            parser.error(problem)
        if os.path.isdir(os.path.expanduser(model_args.model_name_or_path)):
            model_args.model_name_or_path = os.path.expanduser(model_args.model_name_or_path)
    from .checkpoint import check_output_dir

    try:  # a previous run in --output_dir, a missing checkpoint: refused before the model loads
        check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint, training_args.overwrite_output_dir)
    except ValueError as exc:
        parser.error(str(exc))

    from trl import get_peft_config

    from .data import load_data, training_dataset
    from .rewards import code_reward, math_reward, mixed_rewards
    from .trainer import OR1Trainer

    if builtin:
        from .demo import demo_model_and_data

        model, tokenizer, dataset = demo_model_and_data(os.path.join(training_args.output_dir, "sft"), seed=training_args.seed)
        reward_funcs = [math_reward] if script_args.reward else []
    else:
        model, tokenizer = model_args.model_name_or_path, None
        files = script_args.data_files  # a list from the command line, maybe a string from a --config file
        name = script_args.dataset_name or ", ".join([files] if isinstance(files, str) else files)
        with input_errors(parser):
            dataset = load_data(script_args.dataset_name, script_args.dataset_config,
                                split=script_args.dataset_train_split, data_files=script_args.data_files)
    if not builtin and script_args.reward is None:  # --reward_funcs alone: they read the dataset's own columns
        if script_args.prompt_column not in dataset.column_names:
            parser.error(f"dataset {name!r} has no column {script_args.prompt_column!r} "
                         f"(columns: {dataset.column_names}); training generates from the prompt in --prompt_column")
        if script_args.prompt_column != "prompt":
            dataset = dataset.rename_column(script_args.prompt_column, "prompt")
        reward_funcs = []
    elif not builtin:
        with input_errors(parser, prefix=f"dataset {name!r} "):
            dataset, abilities, report = training_dataset(
                dataset, reward=script_args.reward, prompt_column=script_args.prompt_column,
                answer_column=script_args.answer_column, difficulty_model=script_args.difficulty_model,
                difficulty_range=script_args.difficulty_range, drop_invalid=script_args.drop_invalid_rows,
                num_proc=script_args.dataset_num_proc,
            )
        if training_args.process_index == 0:
            print("\n".join(report), flush=True)
        single = {"math": math_reward, "code": code_reward}
        reward_funcs = [single[abilities[0]]] if len(abilities) == 1 else mixed_rewards(abilities)  # a list
    reward_funcs = reward_funcs + extra_rewards

    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "revision": model_args.model_revision,
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
    }
    with input_errors(parser):  # the dataset's columns against the rewards, the model's files
        trainer = OR1Trainer(
            model=model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
        )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


# --------------------------------------------------------------------------------------------------------------
# or1-trl demo
# --------------------------------------------------------------------------------------------------------------


def demo_parser(prog: str | None = "or1-trl demo") -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=prog,
        description="The offline demo: a tiny model (built in-process, no network) gets an SFT warm-up on the answer "
        "format, then learns small additions with OR1Trainer and the MAGIC defaults, on CPU. Prints one line per "
        "step and ends with `OR1 demo: reward A -> B` (mean reward of the first and of the last 5 steps).",
    )
    parser.add_argument("--output_dir", default="outputs/or1-demo",
                        help="where the trained model and tokenizer, trainer_state.json and prompt_stats.jsonl go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and the training")
    parser.add_argument("--max_steps", type=int, default=150, help="OR1 training steps")
    parser.add_argument("--sft_steps", type=int, default=60, help="SFT warm-up steps (answer format)")
    return parser


def demo(argv: list[str] | None = None, prog: str | None = "or1-trl demo") -> None:
    """The offline demo: tiny model, SFT warm-up on the answer format, then MAGIC on small additions."""
    parser = demo_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("max_steps", "sft_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    check_output_dir(parser, args.output_dir)  # before the warm-up, not when OR1Config is built after it

    from accelerate import PartialState

    from .demo import check_demo_dir, outputs_line, run_demo, summary_line

    with input_errors(parser):  # another run's directory: one line, before the warm-up
        check_demo_dir(args.output_dir)
    rewards = run_demo(args.output_dir, sft_steps=args.sft_steps, seed=args.seed, max_steps=args.max_steps)
    if PartialState().is_main_process:  # one line each per run, not one per rank
        print(outputs_line(args.output_dir), flush=True)
        print(summary_line(rewards), flush=True)


# --------------------------------------------------------------------------------------------------------------
# or1-trl prepare
# --------------------------------------------------------------------------------------------------------------


def dataset_command_parser(prog: str | None, description: str, dataset_help: str, split_help: str) -> argparse.ArgumentParser:
    """The parser of a command that reads one dataset split: `--dataset_name`, `--dataset_config`, `--split`."""
    parser = CommandParser(prog=prog, description=description)
    parser.add_argument("--dataset_name", required=True, help=dataset_help)
    parser.add_argument("--dataset_config", default=None, help="dataset configuration name")
    parser.add_argument("--split", default="train", help=split_help)
    return parser


PREPARE_SKIPS = ("dedup", "figures", "decontaminate", "verify")


def prepare_parser(prog: str | None = "or1-trl prepare") -> argparse.ArgumentParser:
    parser = dataset_command_parser(
        prog,
        "Prepare training data as the paper does (§6.1): exact and normalised de-duplication, problems "
        "with figures or URLs dropped, decontamination against evaluation sets by n-gram overlap, each math answer "
        "re-verified against a reference solution with Math-Verify. Prints rows in, rows removed by each step and "
        "rows out; writes the kept rows (unchanged) to OUTPUT_DIR/data/SPLIT-00000-of-00001.parquet and the removed "
        "ones with their reason to OUTPUT_DIR/removed-SPLIT.jsonl. The released (verl) format is understood.",
        "Hub dataset, local folder or local .jsonl/.json/.parquet/.csv file",
        "split to prepare (e.g. 'math' of Skywork/Skywork-OR1-RL-Data)",
    )
    parser.add_argument("--output_dir", required=True, help="where the kept and the removed rows go")
    parser.add_argument("--problem_column", default="prompt", help="problem text: a string or a conversation")
    parser.add_argument("--answer_column", default="answer",
                        help="gold answer(s) of plain datasets (the released format: reward_model.ground_truth)")
    parser.add_argument("--solution_column", default="solution",
                        help="reference solution to re-verify each gold answer against (step skipped without it)")
    parser.add_argument("--eval_sets", default="aime24,aime25,math500",
                        help="comma-separated evaluation sets to decontaminate against: aime24, aime25, math500 (Hub, "
                        "loaded when this runs), local files (NAME=PATH.jsonl/.parquet/.csv), Hub ids; 'none': no "
                        "decontamination")
    parser.add_argument("--eval_column", default=None, help="problem column of the evaluation sets (default: problem, "
                        "question or prompt, the first present)")
    parser.add_argument("--ngram", type=int, default=8, help="n of the word n-grams compared")
    parser.add_argument("--overlap_threshold", type=float, default=0.5,
                        help="remove a problem sharing at least this fraction of an evaluation problem's n-grams")
    parser.add_argument("--skip", default="", help=f"comma-separated steps not to run: {', '.join(PREPARE_SKIPS)}")
    parser.add_argument("--num_proc", type=int, default=None, help="processes for datasets.map and Math-Verify")
    return parser


def prepare(argv: list[str] | None = None, prog: str | None = "or1-trl prepare") -> None:
    """De-duplicate, drop figures/URLs, decontaminate and re-verify a dataset (paper §6.1)."""
    parser = prepare_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    skip = tuple(s for s in args.skip.split(",") if s)
    unknown = [s for s in skip if s not in PREPARE_SKIPS]
    if unknown:
        parser.error(f"--skip {','.join(unknown)}: unknown step; the steps are {', '.join(PREPARE_SKIPS)}")
    if args.ngram < 1 or not 0.0 < args.overlap_threshold <= 1.0:
        parser.error("--ngram must be >= 1 and --overlap_threshold in (0, 1]")
    if args.num_proc is not None and args.num_proc < 1:
        parser.error("--num_proc must be at least 1")
    check_output_dir(parser, args.output_dir)

    from .data import load_data
    from .prepare import load_eval_sets, overlap_report, prepare_dataset, write_prepared

    with input_errors(parser):
        dataset = load_data(args.dataset_name, args.dataset_config, split=args.split)
    if args.problem_column not in dataset.column_names:
        parser.error(f"dataset {args.dataset_name!r} has no column {args.problem_column!r} (columns: "
                     f"{dataset.column_names}); name the problem's column with --problem_column")
    eval_specs = [] if args.eval_sets.strip().lower() == "none" else [s for s in args.eval_sets.split(",") if s]
    eval_sets = None
    if "decontaminate" not in skip and eval_specs:
        try:
            eval_sets = load_eval_sets(eval_specs, args.eval_column)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(str(exc))
    result = prepare_dataset(dataset, problem_column=args.problem_column, answer_column=args.answer_column,
                             solution_column=args.solution_column, eval_sets=eval_sets, ngram=args.ngram,
                             threshold=args.overlap_threshold, skip=skip, num_proc=args.num_proc)
    data_path, removed_path = write_prepared(dataset, result, args.output_dir, args.split)
    print(result.table())
    overlaps = overlap_report(result)
    if overlaps:
        print(f"Overlapping pairs (training row ~ evaluation problem, {args.ngram}-grams):\n{overlaps}")
    print(f"kept rows: {data_path}\nremoved rows: {removed_path}", flush=True)


# --------------------------------------------------------------------------------------------------------------
# or1-trl select-examples
# --------------------------------------------------------------------------------------------------------------


def select_examples_parser(prog: str | None = "or1-trl select-examples") -> argparse.ArgumentParser:
    parser = dataset_command_parser(
        prog,
        "1-shot RLVR: rank the prompts of a normal run by their historical variance score (standard "
        "deviation of each prompt's per-epoch training accuracy, from prompt_stats.jsonl), print the ranking, and "
        "write the TOP prompts replicated to REPLICATE rows as OUTPUT_DIR/data/train-00000-of-00001.parquet "
        "(`or1-trl train --dataset_name OUTPUT_DIR`). See examples/recipes/one_shot_rlvr.yaml.",
        "the dataset that run trained on (Hub or local)",
        "its split ('+' joins splits, as for training)",
    )
    parser.add_argument("--stats", required=True, help="<output_dir>/prompt_stats.jsonl of the normal run")
    parser.add_argument("--prompt_column", default="prompt", help="prompt column (as --prompt_column in training)")
    parser.add_argument("--prompt_id_column", default="id",
                        help="column of prompt ids (as OR1Config.prompt_id_column); without it, a hash of the prompt")
    parser.add_argument("--top", type=int, default=1, help="how many of the best-ranked prompts to keep (1: π₁)")
    parser.add_argument("--replicate", type=int, default=128,
                        help="rows of the written dataset: the chosen prompts cycled to this size (the paper: 128, "
                        "one rollout batch)")
    parser.add_argument("--output_dir", required=True, help="where the replicated dataset goes")
    parser.add_argument("--show", type=int, default=20, help="ranking lines to print")
    return parser


def select_examples(argv: list[str] | None = None, prog: str | None = "or1-trl select-examples") -> None:
    """Rank a run's prompts by historical variance and write the best ones, replicated (1-shot RLVR)."""
    parser = select_examples_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("top", "replicate", "show"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    check_output_dir(parser, args.output_dir)

    from .one_shot import rank_prompts, ranking_table, read_stats
    from .one_shot import select_examples as choose

    try:
        ranking = rank_prompts(read_stats(args.stats))
    except ValueError as exc:
        parser.error(str(exc))
    from .files import write_json_atomic
    from .data import load_data, prompt_text, save_split

    with input_errors(parser):
        dataset = load_data(args.dataset_name, args.dataset_config, split=args.split)
    if args.prompt_column not in dataset.column_names:
        parser.error(f"dataset {args.dataset_name!r} has no column {args.prompt_column!r} (columns: "
                     f"{dataset.column_names})")
    if args.prompt_column != "prompt":
        dataset = dataset.rename_column(args.prompt_column, "prompt")
    try:
        selected, chosen = choose(dataset, ranking, args.top, args.replicate, args.prompt_id_column)
    except ValueError as exc:
        parser.error(str(exc))
    texts = {chosen[i].prompt_id: prompt_text(selected[i]["prompt"]) for i in range(min(len(chosen), len(selected)))}
    print(f"{len(ranking)} prompts ranked by historical variance score (std of per-epoch accuracy):")
    print(ranking_table(ranking, args.show, texts))
    path = save_split(selected, args.output_dir, "train")
    write_json_atomic(os.path.join(args.output_dir, "selection.json"), {
        "stats": os.path.abspath(args.stats), "dataset": args.dataset_name, "split": args.split,
        "chosen": [{"rank": i + 1, "prompt_id": r.prompt_id, "score": r.score, "accuracies": r.accuracies}
                   for i, r in enumerate(chosen)]})
    print(f"wrote {len(selected)} rows ({args.top} prompt{'s' if args.top > 1 else ''} cycled) to {path}", flush=True)


# --------------------------------------------------------------------------------------------------------------
# or1-trl difficulty
# --------------------------------------------------------------------------------------------------------------


def difficulty_parser(prog: str | None = "or1-trl difficulty") -> argparse.ArgumentParser:
    parser = dataset_command_parser(
        prog,
        "Offline difficulty estimation (paper §6.2): N samples per prompt from a model (a vLLM server "
        "or in-process generation), scored with the math / code rewards; the number correct goes into "
        "extra_info.model_difficulty[MODEL_NAME] (the released data's layout) and the prompts solved 1..N-1 times "
        "are written to OUTPUT_DIR/data/SPLIT-00000-of-00001.parquet. Interrupted, it resumes from "
        "OUTPUT_DIR/samples-*.jsonl without redoing finished prompts.",
        "Hub dataset, local folder or local .jsonl/.json/.parquet/.csv file",
        "split to estimate ('+' joins splits: 'math+code')",
    )
    parser.add_argument("--output_dir", required=True, help="samples (resumable) and the dataset with the counts")
    parser.add_argument("--output_split", default=None, help="split name of the written dataset (default: --split, "
                        "or 'train' when it joins several)")
    parser.add_argument("--model", default=None, help="local model directory or Hub id to sample in this process")
    parser.add_argument("--server_url", default=None, help="OpenAI-compatible vLLM server to sample from instead "
                        "(`or1-trl serve` / `vllm serve`), e.g. http://localhost:8000")
    parser.add_argument("--backend", default="auto", choices=["auto", "server", "vllm", "hf"],
                        help="auto: the server if --server_url, else vLLM if installed, else HF generate")
    parser.add_argument("--model_name", default=None, help="key of the counts in model_difficulty (default: the "
                        "model's directory or Hub name, e.g. DeepSeek-R1-Distill-Qwen-7B as in the released data)")
    parser.add_argument("--n_math", type=int, default=16, help="samples per math prompt")
    parser.add_argument("--n_code", type=int, default=8, help="samples per code prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling")
    parser.add_argument("--max_tokens", type=int, default=32768, help="completion tokens per sample")
    parser.add_argument("--seed", type=int, default=0, help="base seed (each prompt gets its own from it)")
    parser.add_argument("--keep_all", action="store_true", help="write every row with its count, not only 1..N-1")
    parser.add_argument("--reward", default="auto", choices=["auto", "math", "code"],
                        help="verifier: by each row's ability (auto), or math / code for every row")
    parser.add_argument("--prompt_column", default="prompt", help="prompt column (plain datasets)")
    parser.add_argument("--answer_column", default=None, help="gold column of plain datasets (answer / tests)")
    parser.add_argument("--batch_size", type=int, default=64, help="HF generate: sequences per call")
    parser.add_argument("--max_concurrency", type=int, default=64, help="server: requests in flight")
    parser.add_argument("--dtype", default="auto", help="HF / vLLM: model dtype")
    return parser


def difficulty(argv: list[str] | None = None, prog: str | None = "or1-trl difficulty") -> None:
    """Count each prompt's correct samples for a model and keep the prompts it solves sometimes (paper §6.2)."""
    parser = difficulty_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("n_math", "n_code", "max_tokens", "batch_size", "max_concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.model is None and args.server_url is None:
        parser.error("give --model (sampled in this process) or --server_url (a vLLM server)")
    check_output_dir(parser, args.output_dir)
    if args.model is not None and args.server_url is None:
        problem = model_path_problem(args.model)
        if problem:
            parser.error(problem)
        if os.path.isdir(os.path.expanduser(args.model)):
            args.model = os.path.expanduser(args.model)

    from .data import load_data, save_split, training_dataset
    from .difficulty import estimate_difficulty
    from .sampling import make_backend

    with input_errors(parser):
        dataset = load_data(args.dataset_name, args.dataset_config, split=args.split)
    try:  # rows that cannot be scored: an error before the model loads
        training_dataset(dataset, reward=args.reward, prompt_column=args.prompt_column, answer_column=args.answer_column)
    except ValueError as exc:
        parser.error(f"dataset {args.dataset_name!r} {exc}")
    try:
        backend = make_backend(model=args.model, server_url=args.server_url, backend=args.backend,
                               batch_size=args.batch_size, max_concurrency=args.max_concurrency, dtype=args.dtype)
        model_key = args.model_name or os.path.basename(str(args.model or backend.served_model()).rstrip("/"))
    except (ValueError, ConnectionError, ImportError) as exc:
        parser.error(str(exc))
    result = estimate_difficulty(
        dataset, backend, model_key, args.output_dir, samples={"math": args.n_math, "code": args.n_code},
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
        reward=args.reward, prompt_column=args.prompt_column, answer_column=args.answer_column)
    print(result.summary())
    out = result.dataset if args.keep_all else result.dataset.select(result.kept_rows())
    split = args.output_split or (args.split if "+" not in args.split else "train")
    path = save_split(out, args.output_dir, split)
    print(f"wrote {len(out)} rows with extra_info.model_difficulty[{model_key!r}] to {path}", flush=True)
# or1-trl eval
# --------------------------------------------------------------------------------------------------------------

#: `--preset`: (temperature, top_p). The paper's (§8.1) is the default; open-r1's is offered, not preferred.
EVAL_PRESETS = {"paper": (1.0, 1.0), "open-r1": (0.6, 0.95)}


def eval_parser(prog: str | None = "or1-trl eval") -> argparse.ArgumentParser:
    from .evaluation import BENCHMARKS, DEFAULT_PROMPT_TEMPLATE

    parser = CommandParser(
        prog=prog,
        description="Evaluate a model on math benchmarks: avg@n, unbiased pass@k and maj@n, each with a bootstrap "
        "interval over problems, and the sampling standard error of avg@n. Writes one JSONL record per problem "
        "(resumable: finished problems are not sampled again), eval_summary.json and eval_summary.md.",
    )
    source = parser.add_argument_group("model and generation backend")
    source.add_argument("--model", help="local model directory or Hub id (required unless --server_url is given)")
    source.add_argument("--server_url", help="an OpenAI-compatible vLLM server (`or1-trl serve`), e.g. http://localhost:8000")
    source.add_argument("--backend", default="auto", choices=["auto", "server", "vllm", "hf"],
                        help="auto: the server if --server_url, else in-process vLLM if installed, else HF generate")
    source.add_argument("--batch_size", type=int, default=64, help="HF generate: sequences per call")
    source.add_argument("--max_concurrency", type=int, default=64, help="server: requests in flight")
    source.add_argument("--dtype", default="auto", help="HF / vLLM: model dtype")
    source.add_argument("--device", default=None, help="HF: device (default: where from_pretrained puts it, CPU)")
    data = parser.add_argument_group("benchmarks")
    data.add_argument("--benchmarks", nargs="+", default=["aime24", "aime25"],
                      help=f"named benchmarks ({', '.join(f'{k}: {v.hub_id}' for k, v in BENCHMARKS.items())}, loaded "
                      "from the Hub) or local .jsonl/.json/.parquet files")
    data.add_argument("--problem_column", default=None, help="column with the problem (default: 'problem')")
    data.add_argument("--answer_column", default=None, help="column with the gold answer(s) (default: 'answer')")
    data.add_argument("--id_column", default=None, help="column with a unique problem id (default: row index)")
    data.add_argument("--prompt_template", default=DEFAULT_PROMPT_TEMPLATE,
                      help="user message; {problem} is replaced by the problem (a problem that is a list of messages is sent as it is)")
    data.add_argument("--no_chat_template", action="store_true",
                      help="send the filled template as plain text instead of a chat turn (base models)")
    data.add_argument("--limit", type=int, default=None, help="only the first N problems of each benchmark (smoke runs)")
    sampling = parser.add_argument_group("sampling (paper §8.1: n=32 for AIME, T=1.0, top-p 1.0, 32,768 tokens)")
    sampling.add_argument("--n", type=int, default=32, help="samples per problem")
    sampling.add_argument("--k", type=int, nargs="+", default=None, help="pass@k for these k (default: 1, 2, 4, ..., n)")
    sampling.add_argument("--preset", choices=sorted(EVAL_PRESETS), default="paper",
                          help="temperature/top-p: paper (1.0, 1.0) or open-r1 (0.6, 0.95); --temperature/--top_p win")
    sampling.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the preset's)")
    sampling.add_argument("--top_p", type=float, default=None, help="nucleus top-p (default: the preset's)")
    sampling.add_argument("--max_tokens", type=int, default=32768, help="completion tokens")
    sampling.add_argument("--seed", type=int, default=0, help="sampling seed (per problem) and bootstrap seed")
    report = parser.add_argument_group("report")
    report.add_argument("--output_dir", default=None,
                        help="where results go (default: MODEL/eval for a local model, else outputs/eval/<model>)")
    report.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    report.add_argument("--confidence", type=float, default=0.95, help="interval level")
    return parser


def evaluate_command(argv: list[str] | None = None, prog: str | None = "or1-trl eval") -> dict:
    """`or1-trl eval`: sample, score with math_reward, summarize with intervals; prints the table."""
    parser = eval_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    from .evaluation import benchmark_name, check_benchmark_spec, check_ks, default_ks
    from .sampling import SamplingSettings

    # Everything that can be wrong with the arguments fails here, before a model loads or a token is generated.
    temperature, top_p = EVAL_PRESETS[args.preset]
    try:
        settings = SamplingSettings(
            n=args.n,
            temperature=temperature if args.temperature is None else args.temperature,
            top_p=top_p if args.top_p is None else args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        check_ks(args.k or default_ks(args.n), args.n)
        for spec in args.benchmarks:
            check_benchmark_spec(spec)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 < args.confidence < 1 or args.resamples < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--confidence must be in (0, 1); --resamples, --batch_size and --limit must be at least 1")
    names = [benchmark_name(spec) for spec in args.benchmarks]
    if len(set(names)) != len(names):
        parser.error(f"two benchmarks share a name ({names}); their sample files would collide")
    if args.model is None and not args.server_url:
        parser.error("pass --model (a local directory or Hub id), or --server_url of a running server")
    if args.model is not None and not args.server_url:
        problem = model_path_problem(args.model)
        if problem:
            parser.error(problem.replace("--model_name_or_path", "--model"))
    from .model_card import EVAL_SUBDIR

    local_model = args.model is not None and os.path.isdir(os.path.expanduser(args.model))
    output_dir = args.output_dir
    if output_dir is None:
        if local_model:
            output_dir = os.path.join(os.path.expanduser(args.model), EVAL_SUBDIR)
        elif args.model is not None:
            output_dir = os.path.join("outputs", "eval", args.model.replace("/", "__"))
        else:
            parser.error("--output_dir is needed with --server_url and no --model")
    check_output_dir(parser, output_dir)

    from .evaluation import evaluate, load_problems, summary_markdown
    from .sampling import SampleStore, make_backend

    benchmarks = {}
    for spec, name in zip(args.benchmarks, names):
        try:
            problems = load_problems(spec, args.problem_column, args.answer_column, args.id_column)
        except ValueError as exc:
            parser.error(str(exc))
        benchmarks[name] = problems[: args.limit] if args.limit else problems
        samples = os.path.join(output_dir, f"{name}.jsonl")
        if os.path.exists(samples):  # samples of earlier runs must have been taken with these settings
            try:
                SampleStore(samples, settings).close()
            except ValueError as exc:
                parser.error(str(exc))
    model = os.path.expanduser(args.model) if local_model else args.model
    try:
        backend = make_backend(model=model, server_url=args.server_url, backend=args.backend, batch_size=args.batch_size,
                               max_concurrency=args.max_concurrency, dtype=args.dtype, device=args.device)
    except (ValueError, ImportError) as exc:  # a backend that cannot run here (checked before anything loads)
        parser.error(str(exc))
    model_name = args.model or backend.served_model()
    summary = evaluate(backend, benchmarks, settings, output_dir, model_name, ks=args.k, template=args.prompt_template,
                       chat=not args.no_chat_template, resamples=args.resamples, confidence=args.confidence)
    print(summary_markdown(summary), end="", flush=True)
    print(f"Per-problem samples and the summary are in {output_dir}", flush=True)
    if local_model and os.path.abspath(output_dir) == os.path.abspath(os.path.join(model, EVAL_SUBDIR)):
        from .model_card import update_eval_block

        if update_eval_block(os.path.join(model, "README.md"), summary):  # a card OR1Trainer wrote: show the results
            print(f"Updated the evaluation section of {os.path.join(model, 'README.md')}", flush=True)
    return summary


# --------------------------------------------------------------------------------------------------------------
# or1-trl serve
# --------------------------------------------------------------------------------------------------------------


def serve(argv: list[str]) -> None:
    """A vLLM server for `vllm_mode="server"` with the flags the weight sync needs (`or1_trl/serve.py`)."""
    from .serve import serve as run_server

    run_server(argv)


# --------------------------------------------------------------------------------------------------------------
# or1-trl plot
# --------------------------------------------------------------------------------------------------------------


def plot(argv: list[str]) -> None:
    """PNG figures of a run's curves (`or1_trl/plot.py`), from the trainer_state.json it wrote."""
    parser = CommandParser(
        prog="or1-trl plot",
        description="Plot a training run: entropy vs its target with stage boundaries, training accuracy (all and "
        "non-truncated) and truncation ratio, the step's time split per stage, the prompt pool. Reads the newest "
        "trainer_state.json in OUTPUT_DIR or its checkpoint-N folders; writes PNG files.",
    )
    parser.add_argument("output_dir", help="the run's output_dir")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: OUTPUT_DIR/plots)")
    parser.add_argument("--smooth", type=int, default=None,
                        help="moving-average window in steps (default: about 1/25 of the run from 40 steps on; 1: off)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.output_dir):
        parser.error(f"{args.output_dir!r} is not a directory (pass the run's output_dir)")
    if args.smooth is not None and args.smooth < 1:
        parser.error("--smooth must be at least 1")

    from .plot import plot_run

    try:
        written, skipped = plot_run(args.output_dir, args.out, args.smooth)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    for path in written.values():
        print(path)
    for name, why in skipped.items():
        print(f"skipped {name}.png: {why}")


# --------------------------------------------------------------------------------------------------------------
# or1-trl
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A sub-command: `run(argv)` gets the arguments after the command's name and parses them itself."""

    name: str
    help: str
    run: Callable[[list[str]], object]


COMMANDS: list[Command] = [
    Command("train", "train with the MAGIC recipe (TRL's flags, --config recipe.yaml)", train),
    Command("demo", "the offline demo: a tiny model learns small additions on CPU (about a minute)", demo),
    Command("serve", "start a vLLM server to generate on (vllm_mode='server'; weight sync nccl or disk)", serve),
    Command("prepare", "prepare training data: de-duplicate, drop figures/URLs, decontaminate, re-verify (§6.1)",
            prepare),
    Command("difficulty", "offline difficulty: N samples per prompt, count the correct ones, keep 1..N-1 (§6.2)",
            difficulty),
    Command("select-examples", "1-shot RLVR: rank prompts by historical variance, write the top ones replicated",
            select_examples),
    Command("eval", "avg@n / pass@k / maj@n with bootstrap intervals on AIME24/25, MATH-500 or a local file", evaluate_command),
    Command("plot", "PNG figures of a run: entropy vs target, accuracy and truncation, time split, prompt pool", plot),
]


def build_parser(commands: list[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="or1-trl",
        description="The Skywork-OR1 (MAGIC) recipe on top of Hugging Face TRL.",
        epilog="Run `or1-trl COMMAND --help` for the arguments of a command.",
        formatter_class=argparse.HelpFormatter,
    )
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


if __name__ == "__main__":
    raise SystemExit(main())
