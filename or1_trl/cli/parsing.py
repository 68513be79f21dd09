"""What every command shares: its parser (TRL's `TrlParser`, so `--config cmd.yaml` works everywhere, with short
errors), the one-line input errors, and the argument groups two commands use (`DatasetArguments`,
`BackendArguments`).

Errors: a wrong input ends the command with exit status 2 and one line `or1-trl CMD: error: WHAT` under a short usage
line (`ShortUsageErrors`: no 200-line option list; `allow_abbrev=False`: no `--max_step` taken for `--max_steps`);
`input_errors(parser)` turns the `ValueError`s / `OSError`s of the input phase (an arguments dataclass's
`__post_init__`, a `--config` file, a dataset, a model path) into that line; `failure_line(parser, errors)` ends a
command with exit status 1 and the one line of a failure that the library words as one (a full disk while saving).
`OR1_DEBUG=1` (or `or1-trl --debug CMD`) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field

from ..paths import local_model_path, model_path_problem, output_dir_problem

#: Set (to anything but "" or "0") to see the traceback of an input error instead of its one line.
DEBUG_ENV = "OR1_DEBUG"


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


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


@contextlib.contextmanager
def failure_line(parser: argparse.ArgumentParser, *errors: type[BaseException]):
    """Inside: one of `errors` — a failure after the input phase that the library already words as one line (e.g.
    `checkpoint.DiskFullError`) — ends the command with exit status 1 and that line, `PROG: error: MESSAGE`, on
    stderr (no usage line: the input was fine); with `OR1_DEBUG=1` it propagates with its traceback."""
    try:
        yield
    except errors as exc:
        if debug():
            raise
        parser.exit(1, f"{parser.prog}: error: {' '.join(str(exc).split())}\n")


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`HfArgumentParser`'s formatter (defaults shown, unless the help already says its default: no `(default: None)`
    after `(default: 150 tiny, 30 smollm2)`), naming each flag once: `--max_steps`, not also its alias `--max-steps`
    (which still works)."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):
        strings = action.option_strings
        shown = [s for s in strings if not (s != "--" + s[2:].replace("-", "_") and "--" + s[2:].replace("-", "_")
                                                  in strings)]
        if shown != strings:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


#: `> Parameters that control ...` in a config class's docstring heads the fields documented under it (TRL's and
#: transformers' convention, followed by `OR1Config`).
_SECTION = re.compile(r"^ {8}> (?:Parameters that control )?(.+?)\s*$")
_ENTRY = re.compile(r"^ {8}(\w+) \(")


def docstring_sections(cls: type) -> dict[str, str | None]:
    """`{field: its section}` as the docstring of `cls` itself (not its bases') documents them; `None` for a field
    documented before the first section."""
    found, section = {}, None
    for line in (cls.__dict__.get("__doc__") or "").splitlines():
        if match := _SECTION.match(line):
            section = match.group(1).removesuffix(":")
        elif match := _ENTRY.match(line):
            found.setdefault(match.group(1), section)
    return found


def _library(cls: type) -> str:
    return {"or1_trl": "", "trl": " (TRL)", "transformers": " (transformers)"}.get(cls.__module__.split(".")[0], "")


def option_groups(dataclass_types) -> list[tuple[str, str | None, list[str]]]:
    """`[(title, description, fields)]`: the fields of `dataclass_types` grouped as their docstrings group them, a
    field in the section of the first class of its dataclass's MRO that documents it (so `OR1Config`'s own sections
    hold its fields and the TRL fields it documents anew), else in a group of the class that declares it. or1-trl's
    groups come first, then those of the other dataclasses themselves (TRL's `ModelConfig`), then what they inherit
    (`GRPOConfig`'s, `TrainingArguments`'); each class's sections in its docstring's order."""
    groups: dict[tuple[type, str | None], list[str]] = {}
    order: dict[tuple[type, str | None], tuple] = {}
    for i, dtype in enumerate(dataclass_types):
        documented = [(cls, docstring_sections(cls)) for cls in dtype.__mro__ if dataclasses.is_dataclass(cls)]
        for j, (cls, sections) in enumerate(documented):
            for k, section in enumerate([*dict.fromkeys(v for v in sections.values() if v), None]):
                order.setdefault((cls, section), (not cls.__module__.startswith("or1_trl"), j > 0, i, j, k))
        for f in dataclasses.fields(dtype):
            if f.init:  # its section, else a group of the class that declares it
                home = next(((cls, sections[f.name]) for cls, sections in documented if sections.get(f.name)), None)
                owner = next(cls for cls, _ in documented if f.name in cls.__dict__.get("__annotations__", {}))
                groups.setdefault(home or (owner, None), []).append(f.name)
    out = []
    for cls, section in sorted(groups, key=order.__getitem__):
        first_paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        out.append((f"{cls.__name__}{_library(cls)}" + (f": {section}" if section else ""),
                    None if section else first_paragraph, groups[cls, section]))
    return out


def group_options(parser: argparse.ArgumentParser, dataclass_types) -> None:
    """Move the parser's options into argument groups (`option_groups`), as `--help` then prints them; parsing is
    unchanged. Only where a docstring has sections (`or1-trl train`: `OR1Config`, `GRPOConfig`,
    `TrainingArguments`)."""
    if not any(section for dtype in dataclass_types for cls in dtype.__mro__
               for section in docstring_sections(cls).values()):
        return
    by_dest: dict[str, list] = {}  # a bool field defaulting to True has two flags: --name and --no_name
    for action in parser._optionals._group_actions:
        by_dest.setdefault(action.dest, []).append(action)
    for title, description, names in option_groups(dataclass_types):
        group = parser.add_argument_group(title, description)
        for action in (action for name in names for action in by_dest.pop(name, [])):
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)


def first_group(parser: argparse.ArgumentParser, title: str, description: str, names: list[str]) -> None:
    """Move the options of fields `names` (in that order) into a group `--help` prints first, before every other
    group (the everyday flags of a command with hundreds); parsing is unchanged."""
    group = parser.add_argument_group(title, description)
    parser._action_groups.remove(group)
    parser._action_groups.insert(parser._action_groups.index(parser._optionals) + 1, group)
    for name in names:
        for other in parser._action_groups:
            for action in [a for a in other._group_actions if a.dest == name and other is not group]:
                other._group_actions.remove(action)
                group._group_actions.append(action)


def command_parser(dataclass_types, prog: str | None, description: str, epilog: str | None = None,
                   usage: str | None = None):
    """TRL's `TrlParser` for `dataclass_types` (each field a flag, `--config FILE.yaml` for any of them) with short
    errors and no abbreviations; `--help` lists the options in the groups their docstrings give them
    (`group_options`), each flag once (`HelpFormatter`). A field with `metadata={"positional": True}` is a
    positional argument (`or1-trl plot OUTPUT_DIR`, `or1-trl serve MODEL`)."""
    from transformers import HfArgumentParser
    from trl import TrlParser

    class CommandParser(ShortUsageErrors, TrlParser):
        @staticmethod
        def _parse_dataclass_field(parser, field):  # HfArgumentParser's, which makes every field an --option
            if not field.metadata.get("positional"):
                return HfArgumentParser._parse_dataclass_field(parser, field)
            options = {k: v for k, v in field.metadata.items() if k != "positional"}
            parser.add_argument(field.name, **options)

    types = list(dataclass_types) if isinstance(dataclass_types, (list, tuple)) else [dataclass_types]
    parser = CommandParser(types, prog=prog, description=description, epilog=epilog, usage=usage, allow_abbrev=False,
                           formatter_class=HelpFormatter)
    group_options(parser, types)
    return parser


def parse_command(parser, argv: list[str] | None, vllm_args: bool = False):
    """`parser.parse_args_and_config(argv)` (`argv=None`: `sys.argv[1:]`) with every input error as one line: the
    `--config` file, the dataclasses' `__post_init__` checks, unknown flags and unknown keys of the `--config` file.
    Returns the dataclasses, plus the unknown command-line strings when `vllm_args` (they go to vLLM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = config_file_problem(argv)
    if problem:
        parser.error(problem)
    with input_errors(parser):
        *parsed, config_unknown, cli_unknown = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True)
    if cli_unknown and not vllm_args:
        parser.error(f"unrecognized arguments: {' '.join(cli_unknown)}{did_you_mean(parser, cli_unknown)}")
    if config_unknown:
        parser.error(f"unknown keys in the --config file: {', '.join(s[2:] for s in config_unknown[::2])}")
    quiet_libraries()
    return (*parsed, cli_unknown) if vllm_args else tuple(parsed)


def quiet_libraries(stream=None) -> None:
    """What a command keeps off its output once its arguments are read:

    - the libraries' progress bars (datasets' map, transformers' and the Hub's downloads and saves) when the output is
      not a terminal: a log file gets every redraw of every bar;
    - DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." on
      a machine without CUDA (DeepSpeed, which the `dev` extra installs, is imported by accelerate): `DS_ACCELERATOR`
      is set to `cpu`, what DeepSpeed chooses there anyway, unless the user set it."""
    import importlib.util

    if not (stream or sys.stderr).isatty():
        import datasets
        import huggingface_hub.utils
        from transformers.utils import logging as hf_logging

        datasets.disable_progress_bars()
        hf_logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
    if "DS_ACCELERATOR" not in os.environ and importlib.util.find_spec("deepspeed") is not None:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def did_you_mean(parser, unknown: list[str]) -> str:
    """`; did you mean --max_steps?` for the first unknown flag among `unknown` with a close known option (difflib's
    ratio ≥ 0.75, hyphens read as underscores), else `""`."""
    import difflib

    options = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    normal = {}
    for option in sorted(options, key=lambda o: "_" in o):  # `--max_steps` over its alias `--max-steps`
        normal[option.replace("-", "_")] = option
    for flag in unknown:
        if flag.startswith("--"):
            name = flag.split("=", 1)[0].replace("-", "_")
            close = difflib.get_close_matches(name, list(normal), n=1, cutoff=0.75)
            if close:
                return f"; did you mean {normal[close[0]]}?"
    return ""


def hide_flag_value(flag: str, placeholder: str) -> int:
    """Replace, in place, the value given to `flag` (`FLAG VALUE` or `FLAG=VALUE`) in this process's command line as
    Python holds it: `sys.argv` (which W&B records as the run's arguments) and `sys.orig_argv`. Call it once the
    arguments are parsed: a secret given on the command line then lives in the parsed arguments only. Returns how
    many values were replaced. (The operating system's copy, `/proc/PID/cmdline`, shown by `ps`, is not Python's.)"""
    replaced = 0
    for argv in (sys.argv, getattr(sys, "orig_argv", [])):
        for i, arg in enumerate(argv):
            if arg == flag and i + 1 < len(argv) and argv[i + 1] != placeholder:
                argv[i + 1], replaced = placeholder, replaced + 1
            elif arg.startswith(flag + "=") and arg != f"{flag}={placeholder}":
                argv[i], replaced = f"{flag}={placeholder}", replaced + 1
    return replaced


def check_at_least_one(args, *names: str) -> None:
    """`ValueError` naming the first of `names` whose value (when set) is below 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1")


def check_output_dir(output_dir: str) -> None:
    """`ValueError` if `output_dir` is a file or cannot be written (`paths.output_dir_problem`)."""
    problem = output_dir_problem(output_dir)
    if problem:
        raise ValueError(problem)


@dataclass(kw_only=True)
class DatasetArguments:
    """One dataset split to read: `--dataset_name`, `--dataset_config`, `--split`."""

    dataset_name: str = field(
        metadata={"help": "Hub dataset, local folder or local .jsonl/.json/.parquet/.csv file."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    split: str = field(default="train", metadata={"help": "Split to read ('+' joins splits: 'math+code')."})

    def load(self, column: str | None = None, hint: str = ""):
        """The split (`data.loading.load_data`); `ValueError` if it cannot be read or has no `column` (then `hint`)."""
        from ..data.loading import load_data

        dataset = load_data(self.dataset_name, self.dataset_config, split=self.split)
        if column is not None and column not in dataset.column_names:
            raise ValueError(f"dataset {self.dataset_name!r} has no column {column!r} (columns: "
                             f"{dataset.column_names}){hint}")
        return dataset


@dataclass(kw_only=True)
class BackendArguments:
    """Where samples come from (`sampling.make_backend`): a model in this process or a vLLM server."""

    model: str | None = field(default=None, metadata={"help": "Local model directory or Hub id to sample in this "
                                                               "process (required unless --server_url is given)."})
    server_url: str | None = field(default=None, metadata={
        "help": "An OpenAI-compatible vLLM server to sample from instead (`or1-trl serve` / `vllm serve`), e.g. "
        "http://localhost:8000."})
    backend: str = field(default="auto", metadata={
        "help": "auto: the server if --server_url, else in-process vLLM if installed, else HF generate.",
        "choices": ["auto", "server", "vllm", "hf"]})
    batch_size: int = field(default=64, metadata={"help": "HF generate: sequences per call."})
    max_concurrency: int = field(default=64, metadata={"help": "Server: requests in flight."})
    dtype: str = field(default="auto", metadata={"help": "HF / vLLM: model dtype."})

    def check_backend(self) -> None:
        """`ValueError` for counts below 1, neither a model nor a server, or a model path that cannot be one; a local
        model's `~` is expanded."""
        check_at_least_one(self, "batch_size", "max_concurrency")
        if self.model is None and self.server_url is None:
            raise ValueError("give --model (sampled in this process) or --server_url (a vLLM server)")
        if self.model is not None and self.server_url is None:
            problem = model_path_problem(self.model, flag="--model")
            if problem:
                raise ValueError(problem)
            self.model = local_model_path(self.model)

    def make_backend(self, **options):
        """The backend these arguments name (`sampling.make_backend`); `options` add to them (e.g. `device`)."""
        from ..generation.sampling import make_backend

        return make_backend(model=self.model, server_url=self.server_url, backend=self.backend,
                            batch_size=self.batch_size, max_concurrency=self.max_concurrency, dtype=self.dtype,
                            **options)
