"""Ending a completion at a pattern, the same on every generation path (`OR1Config.stop_pattern`).

A task whose answer closes the useful part of a completion ("... 12 - 5 = 7.\\nAnswer: 7\\n") gains nothing from what
the model writes after it, and loses twice: the reward may read the later text, and the 80/20 rule's selected tokens
and the entropy term fall on it. vLLM's stop strings cannot say "the end of the answer line" (the number varies), and
TRL's HF `generate` passes no tokenizer, so transformers' `stop_strings` fail there. So the rollout is cut after it is
generated, on token lists, whatever made them (the vLLM server, the one-step-off overlap, HF `generate`):

    stop = StopAt(r"Answer:[^\\n]*\\n", decode=tokenizer.decode)
    cut = stop.cut(completion_ids=completion_ids, logprobs=logprobs)
    cut.completion_ids, cut.logprobs, cut.stopped
    cut_rollout(trainer, completion_ids=..., logprobs=...)   # OR1Trainer._generate_single_turn: TRL's, then this

Invariants:
- a completion is cut after the token that completes the pattern's first match in its decoded text (`decode`,
  special tokens skipped, as TRL decodes it): the smallest k with a match in `decode(ids[:k])` keeps `ids[:k]`;
  the generator's log-probs (vLLM's, for the rollout correction) are cut alike;
- a completion without a match is left as it is: `stopped` is False, its ids and log-probs are the same objects;
- cutting is idempotent, and a cut completion still matches (`stopped`): the trainer tells a stopped completion from
  a truncated one by its text, as TRL tells an ended one by its last token.

What it changes and what not. The policy gradient of a reward that depends on the completion only up to a stopping
time is the gradient over the tokens up to that time (the tokens after it leave the rollout: reward, loss, T_k,
lengths, the 80/20 mask's quantile). The model is not taught to stop there (no end-of-sequence token is added), as
with vLLM's own stop strings; TRL's `completions/clipped_ratio` counts a stopped completion as clipped (its last
token is no EOS: TRL's rule, also for stop strings), so the trainer logs `completions/stopped_ratio` beside it.
The tokens after the stop were still generated: the cut saves no generation time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cut:
    """The rollout after `StopAt.cut`: per completion its ids, its generator log-probs (None when the path has
    none, as TRL's HF path), and whether it was stopped."""

    completion_ids: list[list[int]]
    logprobs: list | None
    stopped: list[bool]


class StopAt:
    """Cuts completions after the first match of `pattern` (a regular expression, `re.search` semantics) in their
    decoded text. `decode` maps token ids to text (the tokenizer's, special tokens skipped); without it only the
    text-level methods (`matches`, `text`) work."""

    def __init__(self, pattern: str, decode: Callable[[Sequence[int]], str] | None = None):
        self.pattern = re.compile(pattern)
        self.decode = decode

    def matches(self, text: str) -> bool:
        """Whether `text` holds the pattern: a completion that was stopped, or would be."""
        return self.pattern.search(text) is not None

    def text(self, text: str) -> str:
        """`text` up to the end of the pattern's first match (all of it without one): what a judge reads of a
        completion generated without the cut (e.g. an evaluation on a server) to score it as the trainer's cut one."""
        match = self.pattern.search(text)
        return text if match is None else text[: match.end()]

    def stopped(self, ids: Sequence[int]) -> bool:
        """Whether the completion `ids` ends at the pattern: after `cut`, exactly the completions it stopped."""
        return self.matches(self.decode(ids))

    def end(self, ids: Sequence[int]) -> int | None:
        """How many tokens of `ids` to keep: the smallest k with a match in `decode(ids[:k])`; None without a match.
        A match in a prefix stays a match in every longer one, so k is found by bisection (about log2(len) decodes)."""
        if not self.matches(self.decode(ids)):
            return None
        low, high = 1, len(ids)  # a match in ids[:high]; none in ids[:low - 1]
        while low < high:
            middle = (low + high) // 2
            if self.matches(self.decode(ids[:middle])):
                high = middle
            else:
                low = middle + 1
        return high

    def cut(self, completion_ids: list[list[int]], logprobs: list | None) -> Cut:
        """Every completion cut at its `end`; `logprobs` (one list per completion, aligned with its ids) alike."""
        ids_out, logprobs_out, stopped = [], None if logprobs is None else [], []
        for row, ids in enumerate(completion_ids):
            keep = self.end(ids)
            stopped.append(keep is not None)
            ids_out.append(ids if keep is None else ids[:keep])
            if logprobs is not None:
                logprobs_out.append(logprobs[row] if keep is None else logprobs[row][:keep])
        return Cut(completion_ids=ids_out, logprobs=logprobs_out, stopped=stopped)


def for_trainer(args, tokenizer) -> StopAt | None:
    """The trainer's `StopAt` for `args.stop_pattern` (None without one), decoding as TRL decodes completions."""
    if getattr(args, "stop_pattern", None) is None:
        return None
    return StopAt(args.stop_pattern, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def cut_rollout(trainer, completion_ids: list[list[int]], logprobs: list | None) -> tuple[list, list | None]:
    """`OR1Trainer._generate_single_turn`'s output cut by the trainer's `completion_stop` (as it is without one), and
    the share of completions stopped over all ranks logged (`completions/stopped_ratio`; every rank calls this in
    step, as TRL's generation)."""
    stop = trainer.completion_stop
    if stop is None:
        return completion_ids, logprobs
    cut = stop.cut(completion_ids=completion_ids, logprobs=logprobs)
    stopped = trainer.accelerator.gather(torch.tensor(cut.stopped, device=trainer.accelerator.device))  # [B*G]
    trainer._metrics["train" if trainer.model.training else "eval"]["completions/stopped_ratio"].append(
        stopped.float().mean().item())
    return cut.completion_ids, cut.logprobs


def stopped_rows(stop: StopAt | None, completion_ids: list[list[int]]) -> list[bool] | None:
    """Per completion, whether `stop` ended it (None without a stop): such a completion is not truncated."""
    return None if stop is None else [stop.stopped(ids) for ids in completion_ids]
