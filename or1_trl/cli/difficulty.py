"""`or1-trl difficulty`: `DifficultyArguments`, then `or1_trl.data.difficulty` (paper §6.2)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .parsing import (BackendArguments, DatasetArguments, check_at_least_one, check_output_dir, command_parser,
                      failure_line, input_errors, parse_command)


@dataclass(kw_only=True)
class DifficultyArguments(BackendArguments, DatasetArguments):
    """Arguments of `or1-trl difficulty`: the dataset, the model or server to sample from, the sampling;
    `__post_init__` checks the counts, the output directory and the model path."""

    output_dir: str = field(metadata={"help": "Samples (resumable) and the dataset with the counts."})
    output_split: str | None = field(default=None, metadata={
        "help": "Split name of the written dataset (default: --split, or 'train' when it joins several)."})
    model_name: str | None = field(default=None, metadata={
        "help": "Key of the counts in model_difficulty (default: the model's directory or Hub name, e.g. "
        "DeepSeek-R1-Distill-Qwen-7B as in the released data)."})
    n_math: int = field(default=16, metadata={"help": "Samples per math prompt."})
    n_code: int = field(default=8, metadata={"help": "Samples per code prompt."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    max_tokens: int = field(default=32768, metadata={"help": "Completion tokens per sample."})
    seed: int = field(default=0, metadata={"help": "Base seed (each prompt gets its own from it)."})
    keep_all: bool = field(default=False, metadata={"help": "Write every row with its count, not only 1..N-1."})
    reward: str = field(default="auto", metadata={
        "help": "Verifier: by each row's ability (auto), or math / code for every row.",
        "choices": ["auto", "math", "code"]})
    prompt_column: str = field(default="prompt", metadata={"help": "Prompt column (plain datasets)."})
    answer_column: str | None = field(default=None,
                                      metadata={"help": "Gold column of plain datasets (answer / tests)."})

    def __post_init__(self):
        check_at_least_one(self, "n_math", "n_code", "max_tokens")
        self.check_backend()
        check_output_dir(self.output_dir)
        if self.output_split is None:
            self.output_split = self.split if "+" not in self.split else "train"


def difficulty_parser(prog: str | None = "or1-trl difficulty"):
    return command_parser(
        DifficultyArguments, prog,
        "Offline difficulty estimation (paper §6.2): N samples per prompt from a model (a vLLM server or in-process "
        "generation), scored with the math / code rewards; the number correct goes into "
        "extra_info.model_difficulty[MODEL_NAME] (the released data's layout) and the prompts solved 1..N-1 times are "
        "written to OUTPUT_DIR/data/SPLIT-00000-of-00001.parquet. Interrupted, it resumes from "
        "OUTPUT_DIR/samples-*.jsonl without redoing finished prompts.")


def difficulty(argv: list[str] | None = None, prog: str | None = "or1-trl difficulty") -> None:
    """Count each prompt's correct samples for a model and keep the prompts it solves sometimes (paper §6.2)."""
    from ..data.released import training_dataset
    from ..data.difficulty import estimate_difficulty
    from ..generation.finite_logits import NonFiniteLogitsError

    parser = difficulty_parser(prog)
    (args,) = parse_command(parser, argv)
    with input_errors(parser):
        dataset = args.load()
    with input_errors(parser, prefix=f"dataset {args.dataset_name!r} "):  # rows that cannot be scored
        training_dataset(dataset, reward=args.reward, prompt_column=args.prompt_column,
                         answer_column=args.answer_column)
    try:
        backend = args.make_backend()
        model_key = args.model_name or os.path.basename(str(args.model or backend.served_model()).rstrip("/"))
    except (ValueError, ConnectionError, ImportError) as exc:
        parser.error(str(exc))
    with failure_line(parser, NonFiniteLogitsError):  # the model's logits NaN at sampling: one line, exit 1
        result = estimate_difficulty(
            dataset, backend, model_key, args.output_dir, samples={"math": args.n_math, "code": args.n_code},
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
            reward=args.reward, prompt_column=args.prompt_column, answer_column=args.answer_column)
    print(result.summary())
    rows, path = result.write(args.output_dir, args.output_split, args.keep_all)
    print(f"wrote {rows} rows with extra_info.model_difficulty[{model_key!r}] to {path}", flush=True)
