"""One verifier per row: a mixed math + code dataset trained with both rewards in one run.

Skywork-OR1's released data has an `ability` column (`"math"` or `"code"`) and its reward dispatches each sample to
Math-Verify or to the code runner. In TRL the same is two reward functions that each score only their own rows and
return `None` for the others: `GRPOTrainer._calculate_rewards` turns `None` into NaN, the reward of a row is the NaN-
ignoring sum over the functions (so each row gets its own verifier's score), and `rewards/<name>/mean` is the mean
over that function's rows only. A row that no function scores (NaN everywhere) gets advantage 0 and a warning.

    from or1_trl.rewards import mixed_rewards
    trainer = OR1Trainer(model, reward_funcs=mixed_rewards(), train_dataset=ds)   # ds has `ability`, `answer`, `tests`
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .code import code_reward
from .columns import ABILITY_COLUMN, required_columns
from .math import math_reward

__all__ = ["AbilityReward", "mixed_rewards", "ABILITY_COLUMN"]


class AbilityReward:
    """`reward` on the rows whose `ability` column equals `ability`; `None` (TRL: not scored here) on the others.

    Every per-row keyword argument (the completions, prompts, completion ids and dataset columns) is cut to the
    selected rows before `reward` sees it, and what `reward` logs to the completions table (`log_extra`) is spread
    back to the whole batch (`None` on the other rows). `reward.__name__` is kept, so TRL logs
    `rewards/math_reward/mean` over the math rows.
    """

    def __init__(self, reward: Callable[..., list[float]], ability: str, column: str = ABILITY_COLUMN):
        self.reward, self.ability, self.column = reward, ability, column
        self.__name__ = getattr(reward, "__name__", type(reward).__name__)
        #: Checked by `OR1Trainer` at construction: the inner reward's columns plus the ability column.
        self.required_columns = (*required_columns(reward), column)

    def __repr__(self) -> str:
        return f"AbilityReward({self.__name__}, ability={self.ability!r})"

    def __call__(self, completions: Sequence[Any], **kwargs) -> list[float | None]:
        n = len(completions)
        abilities = kwargs.get(self.column)
        if abilities is None:
            raise ValueError(f"{self.__name__} scores the rows whose {self.column!r} is {self.ability!r}, but the "
                             f"dataset has no {self.column!r} column")
        rows = [i for i, ability in enumerate(abilities) if ability == self.ability]
        scores: list[float | None] = [None] * n
        if not rows:
            return scores
        sub = {key: [value[i] for i in rows] if isinstance(value, (list, tuple)) and len(value) == n else value
               for key, value in kwargs.items()}
        log_extra = kwargs.get("log_extra")
        if log_extra is not None:
            def spread(column: str, values: list) -> None:
                full = [None] * n
                for i, value in zip(rows, values):
                    full[i] = value
                log_extra(column, full)

            sub["log_extra"] = spread
        for i, score in zip(rows, self.reward([completions[i] for i in rows], **sub)):
            scores[i] = score
        return scores


def mixed_rewards(abilities: Sequence[str] = ("math", "code"), math: Callable | None = None,
                  code: Callable | None = None) -> list[AbilityReward]:
    """One `AbilityReward` per ability: `math_reward` on the `"math"` rows, `code_reward` on the `"code"` rows
    (or the rewards given)."""
    verifiers = {"math": math or math_reward, "code": code or code_reward}
    unknown = [a for a in abilities if a not in verifiers]
    if unknown:
        raise ValueError(f"no verifier for ability {unknown}; known: {sorted(verifiers)}")
    return [AbilityReward(verifiers[a], a) for a in abilities]
