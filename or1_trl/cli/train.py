"""`or1-trl train`: TRL's parser for `ScriptArguments` (below), `OR1Config` (every `GRPOConfig` field) and TRL's
`ModelConfig` (model, dtype, LoRA), `--config recipe.yaml` filling any of them; then `run.build_trainer` and
`run.train_and_save` (`or1_trl/cli/run.py`). `examples/train_or1.py` calls `train` too."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..data.released import REWARD_COLUMNS
from ..rewards.by_name import TRL_REWARD_NAMES
from .console import console_output, stop_on_interrupt
from .parsing import command_parser, failure_line, first_group, hide_flag_value, input_errors, parse_command


@dataclass
class ScriptArguments:
    """Data arguments of `or1-trl train` (with `OR1Config` and TRL's `ModelConfig`): the dataset, its columns, the
    verifier and extra reward functions, the offline difficulty filter."""

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
    chat_prompts: bool = field(
        default=False,
        metadata={"help": "Send each string prompt as one user turn ([{'role': 'user', 'content': prompt}]) through "
                  "the tokenizer's chat template, as `or1-trl eval` does (an instruct model's input); conversations "
                  "are sent as they are. Without it, TRL sends a string prompt as raw text (a base model's input), "
                  "and a warning says so when the tokenizer has a chat template."},
    )
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
        if self.difficulty_range is not None:
            if len(self.difficulty_range) != 2 or self.difficulty_range[0] > self.difficulty_range[1]:
                raise ValueError("--difficulty_range takes LOW HIGH with LOW <= HIGH, got "
                                 f"{' '.join(map(str, self.difficulty_range))}")
            if self.difficulty_model is None:
                raise ValueError("--difficulty_range needs --difficulty_model (whose counts to filter on)")
        if self.reward is None and self.difficulty_model:
            raise ValueError("--difficulty_model filters rows as the verifier reads them: give --reward (e.g. auto) "
                             "with it")


#: The flags `or1-trl train --help` lists first: model, data, output, steps, batch, generations, lengths, saving,
#: resuming, reporting.
EVERYDAY_FLAGS = [
    "model_name_or_path", "dataset_name", "output_dir", "max_steps", "per_device_train_batch_size",
    "num_generations", "max_prompt_length", "max_completion_length", "learning_rate", "save_steps",
    "resume_from_checkpoint", "report_to", "use_vllm", "vllm_mode", "vllm_server_base_url", "push_to_hub",
    "hub_model_id",
]


def train_parser(prog: str | None = "or1-trl train"):
    """TRL's parser for the training arguments: `ScriptArguments`, `OR1Config`, `ModelConfig`, plus `--config`."""
    from trl import ModelConfig

    from ..trainer.or1_config import OR1Config

    parser = command_parser(
        (ScriptArguments, OR1Config, ModelConfig), prog,
        "Train with the Skywork-OR1 (MAGIC) recipe: OR1Trainer = TRL's GRPOTrainer + the paper. The options come in "
        "groups: the data and rewards, OR1's by paper section, then TRL's model (ModelConfig), GRPO and Trainer "
        "settings as their docstrings group them. Every --flag_name is also --flag-name.",
        epilog="--config RECIPE.yaml sets any of these flags from a YAML file (flags given here win); see "
        "examples/recipes/. Run with `accelerate launch examples/train_or1.py ...` for several processes.",
        usage="%(prog)s [-h] [--config RECIPE.yaml] [--model_name_or_path M --dataset_name D] [--FLAG VALUE ...]",
    )
    parser.set_defaults(logging_steps=1)  # a line per step (`step_printer.StepPrinter`); TRL's default logs every 10th
    first_group(parser, "everyday flags", "what most runs set; every other flag follows, grouped as the code groups "
                "them", EVERYDAY_FLAGS)
    return parser


def train(argv: list[str] | None = None, prog: str | None = "or1-trl train") -> None:
    """Train with the MAGIC recipe on `--dataset_name`, scored by the `--reward` verifier and/or `--reward_funcs`."""
    from ..generation.finite_logits import NonFiniteLogitsError
    from ..trainer.checkpoint import DiskFullError
    from ..trainer.nonfinite import NonFiniteStop
    from ..trainer.or1_config import API_KEY_PLACEHOLDER
    from .run import build_trainer, train_and_save

    parser = train_parser(prog)
    script_args, training_args, model_args = parse_command(parser, argv)
    # The server's key lives in `training_args` only: not in the command line W&B records (`OR1Config` never saves it).
    for spelling in ("--vllm_server_api_key", "--vllm-server-api-key"):  # the parser takes both
        hide_flag_value(spelling, API_KEY_PLACEHOLDER)
    # The rewards, the model path, output_dir, the dataset: before the model trains. Ctrl-C: one line, exit 130.
    with stop_on_interrupt(parser), input_errors(parser), console_output(training_args):
        trainer = build_trainer(script_args, training_args, model_args)
    with (stop_on_interrupt(parser, trainer),
          failure_line(parser, DiskFullError, NonFiniteStop, NonFiniteLogitsError),
          console_output(training_args)):
        # a full disk while saving, NaN/inf gradients steps in a row, NaN logits at sampling: one line, exit 1
        train_and_save(trainer, script_args.dataset_name)
