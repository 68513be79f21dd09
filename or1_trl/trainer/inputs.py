"""What `OR1Trainer` trains on, checked before compute: the inputs before the model loads (`preflight`), the prompt
pool over the train dataset (`prompt_schedule`), and the prompts against the context once TRL's tokenizer is there
(`check_prompt_lengths`). Each bad input ends in one line naming it (`data/preflight.py` says how)."""

from __future__ import annotations

import os
from collections.abc import Callable

from datasets import Dataset

from ..data.preflight import check_datasets, check_prompts_fit
from ..recipe.prompts import PromptSchedule
from . import checkpoint
from .or1_config import OR1Config, check_liger_layer_kernels
from .packing import check_model_attention

INDEX_COLUMN = "or1_index"  # added to the train dataset: the row's index, for per-prompt statistics


def preflight(model, reward_funcs, args: OR1Config, train_dataset, eval_dataset) -> None:
    """Bad input fails here, before the model is loaded or anything is generated: Liger's layer kernels, the datasets'
    columns, rows and gold types (`data/preflight.py`), a model instance's attention with `padding_free`."""
    check_liger_layer_kernels(args)
    check_datasets(reward_funcs, train_dataset, eval_dataset)
    check_model_attention(model, args.padding_free)


def prompt_schedule(args: OR1Config, train_dataset) -> tuple[PromptSchedule | None, object]:
    """The prompt pool over a map-style train dataset (OR1's recipe; stages and refills need one), and the dataset."""
    if args.recipe == "magic" and isinstance(train_dataset, Dataset):
        return PromptSchedule.over(
            train_dataset, id_column=args.prompt_id_column, seed=args.seed, index_column=INDEX_COLUMN,
            log_path=os.path.join(args.output_dir, checkpoint.PROMPT_STATS_LOG))
    if args.stage_list or args.rejection_refill_rounds:
        raise ValueError("stages and rejection_refill_rounds need a map-style `datasets.Dataset` as train_dataset "
                         "(the prompt pool indexes it).")
    return None, train_dataset


def keep_last_tokens(prompt_ids: list[list[int]], limit: int | None) -> list[list[int]]:
    """Each prompt's last `limit` tokens (`OR1Config.max_prompt_length`; left truncation, as TRL's SDPO trainer), or
    the prompts as they are (`None`)."""
    return prompt_ids if limit is None else [ids[-limit:] for ids in prompt_ids]


def check_prompt_lengths(trainer, tokenize, completion_length: int, warn: Callable[[str], None]) -> None:
    """Prompts that do not fit the context left by `completion_length` (the longest stage's), by TRL's own tokenisation
    (`tokenize`: TRL's `_tokenize_prompts` without the trainer's left truncation): an error with OR1's recipe, else a
    warning given to `warn` (`data/preflight.check_prompts_fit`)."""
    args = trainer.args
    check_prompts_fit(
        trainer.train_dataset, trainer.eval_dataset,
        tokenize=lambda batch: tokenize(batch)[0],
        text_config=trainer.accelerator.unwrap_model(trainer.model).config.get_text_config(),
        completion_length=completion_length,
        max_prompt_length=args.max_prompt_length,
        vllm_max_model_length=args.vllm_max_model_length if trainer.use_vllm else None,
        strict=args.recipe == "magic",
        warn=warn,
        is_vlm=trainer._is_vlm,
        tokenised_elsewhere=trainer.rollout_func is not None or trainer.environment_factories is not None)
