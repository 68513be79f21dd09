"""`OR1Trainer`'s pre-flight (the Python API and `or1-trl train` alike): checks before the model loads, and before
any step.

`check_datasets`, when `OR1Trainer` is built: reward columns the dataset lacks, empty datasets, and gold answers our
verifiers cannot read (the gold readers of `data/released.py`); each error names the dataset, the column, the count
and the first rows. TRL passes every dataset column to the reward functions as a keyword argument, so a missing gold
column would otherwise surface only after the first generation, deep inside the reward call, and a gold of the wrong
type (a dict) would be scored as its text: 0 for every sample, silently. Once the tokenizer is known,
`check_prompts_fit` / `check_prompt_lengths` compare the prompts with the context (TRL 1.16 does not truncate
prompts), and `plain_prompts_problem` says when string prompts will skip the tokenizer's chat template.
"""

from __future__ import annotations

from typing import Any

from ..rewards.columns import ANSWER_COLUMN, TESTS_COLUMN, check_reward_columns
from .released import InvalidRow, check_math_gold, check_tests, invalid_rows, row_list

_GOLD_FIX = {
    ANSWER_COLUMN: "math_reward reads, per row, a string, a number or a list of them (the acceptable answers); a dict "
                   "is scored as its Python text and never matches. Store the answer itself (a released-format "
                   "struct: pass the dataset with its reward_model column as it is, OR1Trainer converts it)",
    TESTS_COLUMN: "code_reward reads, per row, a test spec (a dict or its JSON string) with inputs/outputs lists or "
                  "asserts (`or1_trl/rewards/code.py`)",
}


def _gold_checks(reward_func) -> list[tuple[str, Any, str | None, str | None]]:
    """`(gold column, check, ability, ability column)` for each gold column one of our verifiers reads (user rewards:
    none). `check(value)` raises `InvalidRow`; `ability` restricts it to the rows of that ability (`mixed_rewards`)."""
    from ..rewards.code import CodeReward
    from ..rewards.math import MathReward
    from ..rewards.mixed import AbilityReward

    ability = ability_column = None
    if isinstance(reward_func, AbilityReward):
        ability, ability_column, reward_func = reward_func.ability, reward_func.column, reward_func.reward
    if isinstance(reward_func, MathReward):
        return [(ANSWER_COLUMN, check_math_gold, ability, ability_column)]
    if isinstance(reward_func, CodeReward):
        return [(TESTS_COLUMN, check_tests, ability, ability_column)]
    return []


def check_golds(reward_funcs: Any, dataset: Any, dataset_name: str = "train_dataset") -> None:
    """Raise a `ValueError` if rows of `dataset` hold gold answers our verifiers cannot read: the column, the reward,
    the count, the first rows and what the first one holds (`check_math_gold`, `check_tests`)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None or not hasattr(dataset, "__len__"):
        return
    for func in reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]:
        for column, check, ability, ability_column in _gold_checks(func):
            if column not in columns or (ability is not None and ability_column not in columns):
                continue  # check_reward_columns names the missing column
            abilities = dataset[ability_column] if ability is not None else None
            reasons = []
            for index, value in enumerate(dataset[column]):
                reason = None
                if abilities is None or abilities[index] == ability:
                    try:
                        check(value)
                    except InvalidRow as exc:
                        reason = f"{exc.reason}\t{exc}"
                reasons.append(reason)
            count, details = invalid_rows(reasons)
            if count:
                name = getattr(func, "__name__", type(func).__name__)
                raise ValueError(f"{dataset_name} column {column!r} (read by {name!r}): {count} of {len(dataset)} "
                                 f"rows cannot be scored: {details}. {_GOLD_FIX[column]}.")


def check_datasets(reward_funcs: Any, train_dataset: Any, eval_dataset: Any = None) -> None:
    """`OR1Trainer`'s pre-flight, before the model loads: for the train dataset and each eval dataset, the columns the
    rewards need (`check_reward_columns`), at least one row, and gold answers our verifiers can read (`check_golds`).
    Datasets without a length (streaming) are checked for columns only."""
    splits = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        splits += [(f"eval_dataset[{name!r}]", split) for name, split in eval_dataset.items()]
    else:
        splits.append(("eval_dataset", eval_dataset))
    for name, dataset in splits:
        if dataset is None:
            continue
        check_reward_columns(reward_funcs, dataset, name)
        if hasattr(dataset, "__len__") and len(dataset) == 0:
            raise ValueError(f"{name} has no rows: training would run 0 steps. Check the split and any filtering "
                             "(e.g. `or1-trl train`'s difficulty filter) that produced it.")
        check_golds(reward_funcs, dataset, name)


def prompt_lengths(prompts: list, tokenize, batch_size: int = 256) -> list[int]:
    """Token count of each prompt as generation sees it: `tokenize(batch)` returns the token ids of a batch of
    prompts (`OR1Trainer` passes TRL's own `_tokenize_prompts`: chat template, generation prompt, tools)."""
    lengths = []
    for start in range(0, len(prompts), batch_size):
        lengths.extend(len(ids) for ids in tokenize(list(prompts[start : start + batch_size])))
    return lengths


def check_prompt_lengths(lengths: list[int], context: int | None, completion_length: int,
                         max_prompt_length: int | None = None, dataset_name: str = "train_dataset",
                         context_source: str = "the context") -> str | None:
    """Prompts that do not fit: TRL 1.16 generates from the whole prompt (it has no `max_prompt_length`), so a prompt
    longer than `context - completion_length` runs past the model's context (transformers only prints a reminder).

    - `max_prompt_length=None`: such prompts are a `ValueError` (their count, the first rows, the longest, the limit).
    - `max_prompt_length=P`: prompts longer than P are cut to their last P tokens at generation (`OR1Trainer`); the
      warning returned says how many (None if none). `P + completion_length` must fit the context.

    `context=None` (unknown): only `max_prompt_length` is checked.
    """
    limit = None if context is None else context - completion_length
    if max_prompt_length is not None:
        if limit is not None and max_prompt_length > limit:
            raise ValueError(f"max_prompt_length={max_prompt_length} + max_completion_length={completion_length} "
                             f"exceed {context_source} ({context} tokens); set max_prompt_length <= {limit}.")
        long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
        if not long:
            return None
        return (f"{len(long)} of {len(lengths)} prompts of {dataset_name} are longer than max_prompt_length="
                f"{max_prompt_length} tokens ({row_list(long)}; longest {max(lengths)}): generation sees only their "
                "last max_prompt_length tokens (the start of the problem is cut off).")
    if limit is None:
        return None
    long = [i for i, n in enumerate(lengths) if n > limit]
    if long:
        raise ValueError(
            f"{len(long)} of {len(lengths)} prompts of {dataset_name} are longer than {limit} tokens "
            f"({row_list(long)}; longest {max(lengths)}), the room {context_source} ({context} tokens) leaves after "
            f"max_completion_length={completion_length}. Drop them (`dataset.filter`), set max_prompt_length={limit} "
            f"(OR1Config) to keep their last {limit} tokens, or lower max_completion_length."
        )
    return None


def check_prompts_fit(train_dataset, eval_dataset, tokenize, text_config, completion_length: int,
                      max_prompt_length: int | None, vllm_max_model_length: int | None, strict: bool, warn,
                      is_vlm: bool = False, tokenised_elsewhere: bool = False) -> None:
    """`check_prompt_lengths` over the train and eval datasets (each of a dict of eval datasets) that are
    `datasets.Dataset`s with a `prompt` column, measured with `tokenize` (`prompt_lengths`; `OR1Trainer` passes TRL's
    own tokenisation). The context is `vllm_max_model_length` where set, else `text_config.max_position_embeddings`.
    Each warning goes to `warn(message)` as it is found; with `strict=False` (a plain `GRPOConfig`, which has no
    truncation to offer) the errors are warnings too.

    Not measured: a vision-language model (`is_vlm`: it would process every image; `max_prompt_length` is an error
    there, it would cut image tokens), or prompts tokenised elsewhere (a rollout function, environments).
    """
    from datasets import Dataset

    if is_vlm:
        if max_prompt_length is not None:
            raise ValueError("max_prompt_length cuts token ids, which would cut image tokens too: it supports "
                             "text-only models; unset it.")
        return
    if tokenised_elsewhere:
        return
    context = getattr(text_config, "max_position_embeddings", None)
    source = "the model's max_position_embeddings"
    if vllm_max_model_length:
        context, source = vllm_max_model_length, "vllm_max_model_length"
    datasets = {"train_dataset": train_dataset}
    evals = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    datasets.update({"eval_dataset" if k is None else f"eval_dataset[{k!r}]": v for k, v in evals.items()})
    for name, dataset in datasets.items():
        if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
            continue
        lengths = prompt_lengths(dataset["prompt"], tokenize)
        try:
            message = check_prompt_lengths(lengths, context, completion_length, max_prompt_length, name, source)
        except ValueError as exc:
            if strict:
                raise
            message = str(exc)
        if message:
            warn(message)


def _user_turn_opening(tokenizer) -> str | None:
    """What the chat template writes just before a user turn's text (e.g. `<|im_start|>user`), or None without a
    template (or one that cannot render a lone user turn)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "\x00OR1\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that needs more than a user turn: nothing to compare with
        return None
    opening = text.split(mark)[0].rstrip()
    return opening.splitlines()[-1].strip() if opening.strip() else None


def plain_prompts_problem(dataset, tokenizer) -> str | None:
    """Why string prompts skip the chat template of `tokenizer`, or None: TRL sends a string prompt as raw text, so
    an instruct model sees no user turn (it may answer its end-of-turn token at once), while `or1-trl eval` sends it
    as one. None when the first prompt is a conversation, the tokenizer has no chat template, the prompt already
    holds the template's user-turn opening (rendered by hand), or the dataset cannot be indexed."""
    try:
        prompt = dataset[0]["prompt"]
    except (TypeError, KeyError, IndexError, AttributeError, NotImplementedError):
        return None
    opening = _user_turn_opening(tokenizer)
    if not isinstance(prompt, str) or opening is None or opening in prompt:
        return None
    return (
        f"The prompts are plain strings (the first: {prompt[:60]!r}) and the tokenizer has a chat template: TRL sends "
        "a string prompt as raw text, without the template, so an instruct model sees no user turn (it may answer its "
        "end-of-turn token at once: 1-token completions, rewards near 0); `or1-trl eval` sends it as a user turn. "
        "To train on the template: conversational prompts, [{'role': 'user', 'content': prompt}] "
        "(dataset.map(lambda row: {'prompt': [{'role': 'user', 'content': row['prompt']}]})), or `or1-trl train "
        "--chat_prompts true`, which wraps each string prompt so. Raw text on purpose (a base model)? Then evaluate "
        "with `or1-trl eval --no_chat_template`."
    )
