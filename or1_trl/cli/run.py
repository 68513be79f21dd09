"""A training run from the parsed arguments of `or1-trl train` (`or1_trl/cli/train.py`), as TRL's
`trl/scripts/grpo.py` does it: the rewards, the dataset, the trainer (`build_trainer`, where every input error is a
`ValueError` raised before the model trains), then `train_and_save`.

Without a model and a dataset, the run is the demo's: its tiny model (after the SFT warm-up) and addition prompts,
offline.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..paths import local_model_path, model_path_problem

# `trl grpo --reward_funcs` names (trl/scripts/grpo.py, from `trl.rewards`).
TRL_REWARD_NAMES = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                    "get_soft_overlong_punishment")


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
            # a factory: `trl grpo` fixes 1280 / 256; we use the run's length
            if name == "get_soft_overlong_punishment":
                func = func(max_completion_len=max_completion_length,
                            soft_punish_cache=min(256, max_completion_length // 4))
        elif "." in name.strip("."):
            module, attr = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                func = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"--reward_funcs {name}: cannot import {attr!r} from {module!r} ({exc})") from None
        else:
            raise ValueError(f"--reward_funcs {name}: neither one of TRL's reward names "
                             f"({', '.join(TRL_REWARD_NAMES)}) nor a module.function import path")
        if not callable(func):
            raise ValueError(f"--reward_funcs {name}: {type(func).__name__} is not callable")
        funcs.append(func)
    return funcs


def uses_demo_data(script_args, model_args) -> bool:
    """Neither a model nor a dataset: the demo's tiny model and addition prompts. `ValueError` for one without the
    other, or for the demo's prompts with the code reward."""
    data = script_args.dataset_name is not None or script_args.data_files is not None
    builtin = model_args.model_name_or_path is None and not data
    if builtin and script_args.reward == "code":
        raise ValueError("without --model_name_or_path and --dataset_name, training uses the demo's tiny model and "
                         "addition prompts, which need --reward math (or auto)")
    if not builtin and (model_args.model_name_or_path is None or not data):
        raise ValueError("training needs both --model_name_or_path and --dataset_name, or neither (then the demo's "
                         "tiny model and addition prompts, offline; `or1-trl demo` runs the demo itself)")
    return builtin


def training_data(script_args, training_args):
    """The dataset and the verifier rewards (`--reward`): rows checked and converted
    (`data.released.training_dataset`), or the prompt column alone for `--reward_funcs` without a verifier.
    `ValueError` names the dataset."""
    from ..data.loading import load_data
    from ..data.released import training_dataset
    from ..rewards import code_reward, math_reward, mixed_rewards

    files = script_args.data_files  # a list from the command line, maybe a string from a --config file
    name = script_args.dataset_name or ", ".join([files] if isinstance(files, str) else files)
    dataset = load_data(script_args.dataset_name, script_args.dataset_config, split=script_args.dataset_train_split,
                        data_files=script_args.data_files)
    if script_args.reward is None:  # --reward_funcs alone: they read the dataset's own columns
        if script_args.prompt_column not in dataset.column_names:
            raise ValueError(f"dataset {name!r} has no column {script_args.prompt_column!r} (columns: "
                             f"{dataset.column_names}); training generates from the prompt in --prompt_column")
        if script_args.prompt_column != "prompt":
            dataset = dataset.rename_column(script_args.prompt_column, "prompt")
        return dataset, []
    try:
        dataset, abilities, report = training_dataset(
            dataset, reward=script_args.reward, prompt_column=script_args.prompt_column,
            answer_column=script_args.answer_column, difficulty_model=script_args.difficulty_model,
            difficulty_range=script_args.difficulty_range, drop_invalid=script_args.drop_invalid_rows,
            num_proc=script_args.dataset_num_proc,
        )
    except ValueError as exc:
        raise ValueError(f"dataset {name!r} {exc}") from exc
    if training_args.process_index == 0:
        print("\n".join(report), flush=True)
    single = {"math": math_reward, "code": code_reward}
    return dataset, [single[abilities[0]]] if len(abilities) == 1 else mixed_rewards(abilities)  # a list


def as_user_turns(dataset):
    """`--chat_prompts`: each string `prompt` of `dataset` as one user turn, `[{"role": "user", "content": prompt}]`,
    which TRL renders with the tokenizer's chat template (conversations stay as they are)."""
    if "prompt" not in dataset.column_names or not isinstance(dataset[0]["prompt"], str):
        return dataset
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]},
                       desc="Prompts as user turns (--chat_prompts)")


def build_trainer(script_args, training_args, model_args):
    """The `OR1Trainer` of a run (`ScriptArguments`, `OR1Config`, TRL's `ModelConfig`). Every input error — the
    rewards, the model path, a previous run in `output_dir`, the dataset, its columns against the rewards — is a
    `ValueError` (or an `OSError`) raised before training starts; with the demo's model, after its SFT warm-up."""
    from trl import get_peft_config

    from ..trainer.checkpoint import check_output_dir
    from ..trainer.or1_trainer import OR1Trainer

    extra_rewards = resolve_reward_funcs(script_args.reward_funcs or [], training_args.max_completion_length)
    builtin = uses_demo_data(script_args, model_args)
    if not builtin:
        problem = model_path_problem(model_args.model_name_or_path)
        if problem:
            raise ValueError(problem)
        model_args.model_name_or_path = local_model_path(model_args.model_name_or_path)
    # A previous run in --output_dir, a missing checkpoint: refused before the model loads.
    check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint,
                     training_args.overwrite_output_dir)
    if builtin:
        from ..demos.tiny import demo_model_and_data
        from ..rewards import math_reward

        model, tokenizer, dataset = demo_model_and_data(os.path.join(training_args.output_dir, "sft"),
                                                        seed=training_args.seed)
        reward_funcs = [math_reward] if script_args.reward else []
    else:
        model, tokenizer = model_args.model_name_or_path, None
        dataset, reward_funcs = training_data(script_args, training_args)
    if script_args.chat_prompts:
        dataset = as_user_turns(dataset)
    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "revision": model_args.model_revision,
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
    }
    return OR1Trainer(model=model, reward_funcs=reward_funcs + extra_rewards, args=training_args,
                      train_dataset=dataset, processing_class=tokenizer, peft_config=get_peft_config(model_args))


def train_and_save(trainer, dataset_name: str | None = None) -> None:
    """Train (resuming from `args.resume_from_checkpoint`) with one line per step (`step_printer.show_steps`), save the
    model and its card to `args.output_dir`, push it to the Hub when `args.push_to_hub`, then say where everything is
    and what to run next (`console.closing_lines`, main process). A full disk while saving a checkpoint or the model:
    `checkpoint.DiskFullError`, one line."""
    from ..trainer.checkpoint import checkpoints, find_problems, required_files, saving_final
    from ..trainer.step_printer import show_steps
    from .console import closing_lines

    args = trainer.args
    show_steps(trainer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    with saving_final(args.output_dir):  # a full disk: one line (`checkpoint.DiskFullError`)
        trainer.save_model(args.output_dir)
        # The card beside the model, as TRL writes it at each checkpoint (a run without checkpoints gets one too):
        # `or1-trl eval --model OUTPUT_DIR` reads its completion length and writes its results into it.
        trainer.create_model_card(model_name=(args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir)))
                                  .split("/")[-1], dataset_name=dataset_name)
    pushed = trainer.push_to_hub(dataset_name=dataset_name) if args.push_to_hub else None
    if trainer.is_world_process_zero():
        runtime = next((e["train_runtime"] for e in reversed(trainer.state.log_history) if "train_runtime" in e), None)
        complete = [c for c in checkpoints(args.output_dir) if not find_problems(c, required_files(trainer))]
        local = dataset_name if dataset_name and os.path.isfile(dataset_name) else None
        pushed_to = (getattr(pushed, "commit_url", None) or args.hub_model_id
                     or "the Hub") if args.push_to_hub else None
        print("\n".join(closing_lines(args.output_dir, trainer.state.global_step, trainer.state.max_steps, runtime,
                                     complete, pushed_to, local)), flush=True)
