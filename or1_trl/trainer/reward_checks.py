"""Rewards that cannot be trained on: a reward function that returns `inf`, `-inf` or NaN.

TRL's `GRPOTrainer._calculate_rewards` stores each function's rewards in a float32 tensor and turns `None` (the
function's "not scored here", e.g. the code verifier on a math row of `mixed_rewards`) into NaN. An infinite reward
then makes the group's advantages NaN (inf − inf) and the loss NaN, and a NaN the function *returned* is silently read
as "not scored"; the log shows `reward=inf` and training goes on.

`OR1Trainer._calculate_rewards` runs TRL's method with each reward function wrapped in a recorder that notes where it
returned `None` (`record_abstentions`), then `nonfinite_mask` marks every other non-finite entry — a returned inf or
NaN, a float that overflowed float32, a reward model's NaN logit — over all ranks (every rank takes the same decision).
`OR1Config.nonfinite_rewards`:

- `"error"` (default): a `ValueError` naming the reward function, the sample (its row in the batch, its dataset row,
  the start of its prompt and completion) and the value (`nonfinite_message`);
- `"zero"`: those entries score 0; `reward/nonfinite` counts them per rollout; one warning per run names the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

NONFINITE_METRIC = "reward/nonfinite"


class _Recorder:
    """Calls `func` as TRL would and notes the rows where it returned `None` into `abstained`."""

    def __init__(self, func: Callable, abstained: list[int]):
        self.func, self.abstained = func, abstained

    def _note(self, output) -> list:
        output = list(output)
        self.abstained.extend(i for i, reward in enumerate(output) if reward is None)
        return output

    def __call__(self, *args, **kwargs):
        return self._note(self.func(*args, **kwargs))


class _AsyncRecorder(_Recorder):
    async def __call__(self, *args, **kwargs):  # TRL awaits async reward functions (`is_async_callable`)
        return self._note(await self.func(*args, **kwargs))


@contextmanager
def record_abstentions(trainer):
    """While open, `trainer.reward_funcs` are recorders of the same functions (reward models stay as they are);
    yields `abstained`: per function, this rank's rows where it returned `None`."""
    from trl.trainer.utils import is_async_callable

    funcs = trainer.reward_funcs
    abstained: list[list[int]] = [[] for _ in funcs]
    wrapped = []
    for func, rows in zip(funcs, abstained):
        if isinstance(func, torch.nn.Module):
            wrapped.append(func)
        else:
            wrapped.append((_AsyncRecorder if is_async_callable(func) else _Recorder)(func, rows))
    trainer.reward_funcs = wrapped
    try:
        yield abstained
    finally:
        trainer.reward_funcs = funcs


def nonfinite_mask(rewards_per_func: torch.Tensor, abstained: Sequence[Sequence[int]], num_local: int,
                   gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`[N, F]` bool: the entries of `rewards_per_func` (`[N, F]`, all ranks) that are non-finite although the function
    did not return `None` there.

    Args:
        abstained: per function, this rank's rows where it returned `None` (`record_abstentions`).
        num_local: rows on this rank (`b`; N = b × ranks).
        gather: the all-gather over ranks (`accelerator.gather`), skipped when every reward is finite; the result is
            the same on every rank.
    """
    nonfinite = ~torch.isfinite(rewards_per_func)  # [N, F]
    if not nonfinite.any():  # the usual case, and the same on every rank (the rewards are gathered): no all-gather
        return nonfinite
    local = torch.zeros(num_local, rewards_per_func.size(1), device=rewards_per_func.device)  # [b, F]
    for column, rows in enumerate(abstained):
        local[list(rows), column] = 1.0
    none = gather(local).bool()  # [N, F]
    return nonfinite & ~none


def nonfinite_message(bad: torch.Tensor, rewards_per_func: torch.Tensor, names: Sequence[str], offset: int,
                      prompts: Sequence[Any], completions: Sequence[Any], dataset_rows: Sequence[int] | None,
                      step: int, action: str) -> str:
    """One line naming the first non-finite reward of `bad` (`[N, F]`): the function, the value, the sample, and how
    many more there are. Sample details (prompt, completion, dataset row) are known for this rank's rows: `offset` is
    the first of them in the `N` rows."""
    row, column = (int(i) for i in bad.nonzero()[0])
    value = rewards_per_func[row, column].item()
    where = f"sample {row} of the rollout at step {step}"
    local = row - offset
    if 0 <= local < len(prompts):
        if dataset_rows is not None and dataset_rows[local] >= 0:
            where += f" (dataset row {dataset_rows[local]})"
        where += f"; prompt {_snippet(prompts[local])}, completion {_snippet(completions[local])}"
    more = int(bad.sum()) - 1
    return (f"The reward function {names[column]!r} returned {value} for {where}"
            + (f"; {more} more non-finite reward{'s' if more > 1 else ''} in this rollout" if more else "")
            + f". A reward must be a finite number (or None: not scored). {action}")


def _snippet(value: Any, width: int = 60) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):  # a conversation: its last message
        value = value[-1].get("content", "")
    text = str(value)
    return repr(text if len(text) <= width else text[: width - 1] + "…")


class NonfiniteRewards:
    """`OR1Config.nonfinite_rewards` over a run: each rollout's `[N, F]` rewards screened for an inf/NaN a function
    returned; an error naming the function and the sample, or with `"zero"` such entries scored 0, counted, and
    warned about once (`warned`)."""

    def __init__(self):
        self.warned = False

    def screen(self, rewards_per_func: torch.Tensor, abstained, gather: Callable, zero: bool, names: Sequence[str],
               rank: int, prompts: Sequence[Any], completions: Sequence[Any], dataset_rows: Sequence[int],
               step: int) -> tuple[torch.Tensor, float | None, str | None]:
        """`(rewards, count, warning)`: the rewards with bad entries scored 0 (`zero`; else a `ValueError`), how many
        there were (`None` unless `zero`), and the warning to log (only the first time).

        Args:
            abstained: per function, this rank's rows where it returned `None` (`record_abstentions`).
            gather: the all-gather over ranks; rank: this rank's index; prompts, completions, dataset_rows: this
                rank's rows; step: the step the rollout is for.
        """
        bad = nonfinite_mask(rewards_per_func, abstained, num_local=len(prompts), gather=gather)  # [N, F]
        count = float(bad.sum()) if zero else None
        if not bad.any():
            return rewards_per_func, count, None
        action = ("Scored 0 (nonfinite_rewards='zero'; counted in reward/nonfinite); this warning is not repeated."
                  if zero else "Fix the reward function, or set nonfinite_rewards='zero' to score such samples 0 "
                  "(counted in reward/nonfinite).")
        message = nonfinite_message(
            bad, rewards_per_func, names=names, offset=rank * len(prompts), prompts=prompts, completions=completions,
            dataset_rows=dataset_rows, step=step, action=action)
        if not zero:
            raise ValueError(message)
        warning, self.warned = (None if self.warned else message), True
        return rewards_per_func.masked_fill(bad, 0.0), count, warning


def screen_rewards(trainer, nonfinite: NonfiniteRewards, rewards_per_func: torch.Tensor, abstained, inputs: list[dict],
                   prompts, completions, index_column: str) -> torch.Tensor:
    """`OR1Trainer._calculate_rewards`' screen (`nonfinite.screen`) of a rollout's `[N, F]` rewards, with `trainer`'s
    settings, ranks and step: the screened rewards; the count logged (`NONFINITE_METRIC`), the warning given."""
    rewards_per_func, count, warning = nonfinite.screen(
        rewards_per_func, abstained, gather=trainer.accelerator.gather, zero=trainer.args.nonfinite_rewards == "zero",
        names=trainer.reward_func_names, rank=trainer.accelerator.process_index, prompts=prompts,
        completions=completions, dataset_rows=[row.get(index_column, -1) for row in inputs],
        step=trainer.state.global_step + 1)
    if count is not None:
        trainer._metrics["train" if trainer.model.training else "eval"][NONFINITE_METRIC].append(count)
    trainer._warn(*filter(None, [warning]))
    return rewards_per_func
