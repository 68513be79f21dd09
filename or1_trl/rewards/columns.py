"""What a reward function reads from the dataset: the keyword arguments TRL fills itself, and the columns a reward
cannot score without (declared, or read from its signature), checked against a dataset before anything loads.

Imported by `data/released.py`, `data/preflight.py` (the pre-flight) and `rewards/mixed.py` (an `AbilityReward`
needs its inner reward's columns plus the ability column); it imports nothing from the package, so no import of it
closes a circle.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["ABILITY_COLUMN", "ANSWER_COLUMN", "TESTS_COLUMN", "TRL_REWARD_KWARGS", "check_reward_columns",
           "required_columns"]

#: Where `math_reward` reads the gold answers, `code_reward` the tests, and `mixed_rewards` each row's verifier
#: (verl's and Skywork's name for it).
ANSWER_COLUMN, TESTS_COLUMN, ABILITY_COLUMN = "answer", "tests", "ability"

# Keyword arguments TRL itself passes to every reward function (not dataset columns).
TRL_REWARD_KWARGS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


def required_columns(reward_func: Any) -> tuple[str, ...]:
    """Dataset columns `reward_func` cannot score without.

    A reward may declare them (`MathReward.required_columns == ("answer",)`); otherwise they are the parameters
    of its signature without a default that TRL does not fill itself (`def f(completions, solution, **kw)` needs
    `solution`). Reward models (a model or a model id) need none.
    """
    declared = getattr(reward_func, "required_columns", None)
    if declared is not None:
        return tuple(declared)
    if isinstance(reward_func, str) or not callable(reward_func) or hasattr(reward_func, "config"):
        return ()
    try:
        parameters = inspect.signature(reward_func).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(
        p.name for p in parameters if p.kind in kinds and p.default is p.empty and p.name not in TRL_REWARD_KWARGS
    )


def check_reward_columns(reward_funcs: Any, dataset: Any, dataset_name: str = "train_dataset") -> None:
    """Raise a `ValueError` naming the reward and the column if `dataset` lacks a column a reward needs.

    Datasets whose columns are unknown up front (some streaming datasets) are not checked.
    """
    if dataset is None:
        return
    if isinstance(dataset, dict):  # eval_dataset may be {name: dataset}
        for name, split in dataset.items():
            check_reward_columns(reward_funcs, split, f"{dataset_name}[{name!r}]")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return
    if "prompt" not in columns:
        raise ValueError(
            f"{dataset_name} has no 'prompt' column (columns: {columns}); GRPO/OR1 training generates from it. "
            "Rename yours with `dataset.rename_column(old, 'prompt')` (examples/train_or1.py: --prompt_column)."
        )
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for func in funcs:
        missing = [column for column in required_columns(func) if column not in columns]
        if missing:
            name = getattr(func, "__name__", type(func).__name__)
            raise ValueError(
                f"The reward function {name!r} needs the dataset column(s) {missing}, but {dataset_name} has only "
                f"{columns}. Rename the column holding them with `dataset.rename_column(old, new)` "
                "(examples/train_or1.py: --answer_column)."
            )
