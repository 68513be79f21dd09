"""A training run from the parsed arguments of `or1-trl train` (`or1_trl/cli/train.py`), as TRL's
`trl/scripts/grpo.py` does it: the rewards (`rewards/by_name.py`), the dataset (`data/training.py`), the trainer
(`build_trainer`, where every input error is a `ValueError` raised before the model trains), then `train_and_save`.

Without a model and a dataset, the run is the demo's: its tiny model (after the SFT warm-up) and addition prompts,
offline (`uses_demo_data`: which of the two the flags ask for).
"""

from __future__ import annotations

import os

from ..paths import hub_push_problem, local_model_path, model_path_problem


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


def build_trainer(script_args, training_args, model_args):
    """The `OR1Trainer` of a run (`ScriptArguments`, `OR1Config`, TRL's `ModelConfig`). Every input error — the
    rewards, the model path, a previous run in `output_dir`, the dataset, its columns against the rewards — is a
    `ValueError` (or an `OSError`) raised before training starts; with the demo's model, after its SFT warm-up."""
    from trl import get_peft_config

    from ..data.training import as_user_turns, training_data
    from ..rewards.by_name import resolve_reward_funcs
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
    if training_args.push_to_hub and (problem := hub_push_problem()):  # before training, not after it
        raise ValueError(problem)
    if builtin:
        from ..demos.tiny import demo_model_and_data
        from ..rewards import math_reward

        model, tokenizer, dataset = demo_model_and_data(os.path.join(training_args.output_dir, "sft"),
                                                        seed=training_args.seed)
        reward_funcs = [math_reward] if script_args.reward else []
    else:
        model, tokenizer = model_args.model_name_or_path, None
        dataset, reward_funcs, report = training_data(
            script_args.dataset_name, dataset_config=script_args.dataset_config,
            split=script_args.dataset_train_split, data_files=script_args.data_files, reward=script_args.reward,
            prompt_column=script_args.prompt_column, answer_column=script_args.answer_column,
            difficulty_model=script_args.difficulty_model, difficulty_range=script_args.difficulty_range,
            drop_invalid=script_args.drop_invalid_rows, num_proc=script_args.dataset_num_proc)
        if report and training_args.process_index == 0:  # what the checks kept
            print("\n".join(report), flush=True)
    if script_args.chat_prompts:
        dataset = as_user_turns(dataset)
    if isinstance(model, str):  # TRL loads it with these (TRL warns that they are ignored for a loaded model)
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
