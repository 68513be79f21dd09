"""Non-finite logits at sampling (issue 47): one line naming where and which rows, never a device-side assert.

A NaN or inf in a policy's logits (NaN weights after a bad update; cuDNN's SDPA backward on Hopper,
`trainer/attention_guard.py`) reaches `torch.multinomial`, which on CUDA dies in a device-side assert naming no step
and no row, and leaves the process unusable. On the vLLM path the sampled tokens come with NaN log-probs: in-process
vLLM hands them to TRL as `None`, and TRL 1.16 trains on the rollout with those positions' correction zeroed; a vLLM
server (0.32) cannot write a NaN in JSON and answers the whole request with HTTP 400 "Out of range float values are
not JSON compliant", which TRL's client raises as a bare `Exception`.

    checked_rollout(trainer, sample)           # OR1Trainer._generate_single_turn: TRL's, checked, the step named
    checked_sampling(sample, model=policy, end_token_id=eos, place=lambda: "training step 3")
        # sample() -> (completion_ids, logprobs), TRL's `_generate_single_turn`; HF path (`model` given): `generate`
        # through `FiniteLogits`; vLLM path (`model=None`): its log-probs read, the server's refusal recognised
    with finite_sampling(model, end_token_id=eos) as guard:   # the HF part alone: model.generate gets the processor
        model.generate(...)
    guard.bad_rows()                                          # the one host read: rows whose logits were non-finite
    nonfinite_logprob_rows(logprobs)                          # vLLM: rows whose sampled tokens' log-probs are not

Invariants:
- A row is bad at a step when the log-sum-exp of its scores (after every other processor: temperature, top-k/p) is
  not finite: a NaN, a +inf, or every score -inf, each of which `softmax` turns into NaN. One reduction per step.
- `FiniteLogits` runs tensor operations only: its flags (`[B]` bool, on the scores' device) are OR-ed each step, never
  read on the host while `generate` runs (no `.item()`, no Python `bool` of a tensor: no sync per token). A bad row's
  scores become a one-hot on `end_token_id` (the row samples it and ends; uniform without one); other rows' scores
  are returned unchanged (the same tensor values). `bad_rows` is the one read, after `generate` returns.
- `finite_sampling` gives `model.generate` the processor (appended to any the call passes, so it sees the final
  scores) for the duration of the block only: an instance attribute, removed on exit, as TRL calls `generate` with no
  way to pass a processor.
- `NonFiniteLogitsError`'s message is one line: where (the step, the process), the rows (unknown when the server
  refused its whole answer), what to do. `checked_sampling` raises it only after the sampling call returned (or
  failed), never from inside `generate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from transformers import LogitsProcessor, LogitsProcessorList

ADVICE = ("the model's forward returned NaN/inf for them: its weights may hold a NaN from an earlier update (lower "
          "learning_rate or max_grad_norm; bf16 or fp32 rather than fp16), and on H100/H200 GPUs keep "
          "cudnn_sdpa_guard on (docs/distributing_training.md#the-hopper-attention-guard)")
SERVER_REFUSAL = "Out of range float values are not JSON compliant"  # a vLLM server's 400 for a NaN in its answer


class NonFiniteLogitsError(RuntimeError):
    """A non-finite logit (HF `generate`) or log-prob (vLLM) at sampling: one line naming `where` and the rows.

    Attributes: `rows` (the bad rows of the sampled batch; `None`: unknown), `batch_size` (`None`: unknown),
    `where`."""

    def __init__(self, where: str, rows: Sequence[int] | None, batch_size: int | None, source: str = "logits"):
        self.where, self.rows, self.batch_size = where, None if rows is None else list(rows), batch_size
        if self.rows is None:
            shown = ("rows unknown (the vLLM server refused its whole answer: it cannot write a NaN log-prob in "
                     f"JSON, {SERVER_REFUSAL!r})")
        else:
            listed = self.rows if len(self.rows) <= 16 else [*self.rows[:16], f"... {len(self.rows) - 16} more"]
            shown = f"rows {listed}"
        batch = "the batch" if batch_size is None else f"the {batch_size}-row batch"
        super().__init__(f"non-finite {source} (NaN/inf) at sampling, {where}: {shown} of {batch}; {ADVICE}")


class FiniteLogits(LogitsProcessor):
    """A transformers `LogitsProcessor` that flags the rows whose scores are not finite and samples `end_token_id` for
    them instead (uniform without one), without reading anything on the host. See the module's invariants.

    Attributes: `flags` (`[B]` bool tensor on the scores' device, OR-ed over the steps so far; `None` before the
    first step)."""

    def __init__(self, end_token_id: int | None = None):
        self.end_token_id = end_token_id
        self.flags: torch.Tensor | None = None
        self._fallback: torch.Tensor | None = None  # [V]: 0 at end_token_id, -inf elsewhere (or 0 everywhere)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:  # [B, L], [B, V]
        bad = ~torch.isfinite(torch.logsumexp(scores, dim=-1))  # [B]
        self.flags = bad if self.flags is None else self.flags | bad
        return torch.where(bad[:, None], self.fallback(scores), scores)  # [B, V]

    def fallback(self, scores: torch.Tensor) -> torch.Tensor:
        """The finite distribution a bad row samples from (`[V]`, made once for the scores' vocabulary and device)."""
        made = self._fallback
        if made is None or (made.shape[0], made.device, made.dtype) != (scores.shape[-1], scores.device, scores.dtype):
            if self.end_token_id is None:
                made = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)  # [V] uniform
            else:
                made = torch.full((scores.shape[-1],), float("-inf"), dtype=scores.dtype, device=scores.device)
                made[self.end_token_id] = 0.0
            self._fallback = made
        return made

    def bad_rows(self) -> list[int]:
        """The rows flagged at any step so far: one read of the flags on the host (after `generate` returns)."""
        return [] if self.flags is None else self.flags.nonzero().flatten().tolist()


@contextmanager
def finite_sampling(model, end_token_id: int | None = None) -> Iterator[FiniteLogits]:
    """While active, every `model.generate(...)` call samples through one `FiniteLogits(end_token_id)`, appended to
    the call's own `logits_processor`; yields it (`bad_rows()` after the calls)."""
    processor = FiniteLogits(end_token_id)
    own = vars(model).get("generate")  # an instance attribute already there is restored on exit
    generate = model.generate

    def generate_finite(*args, logits_processor=None, **kwargs):
        processors = LogitsProcessorList([*(logits_processor or []), processor])
        return generate(*args, logits_processor=processors, **kwargs)

    model.generate = generate_finite
    try:
        yield processor
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def nonfinite_logprob_rows(logprobs: Sequence[Sequence[float | None]] | None) -> list[int]:
    """The rows of vLLM's per-token log-probs of the sampled tokens (TRL's form: one list per completion, a NaN sent
    as `None`) that hold a `None`, a NaN or an inf; `[]` for `None` (no log-probs asked for)."""
    if logprobs is None:
        return []
    return [row for row, values in enumerate(logprobs)
            if not all(value is not None and math.isfinite(value) for value in values)]


def checked_sampling(sample: Callable[[], tuple], model=None, end_token_id: int | None = None, *,
                     place: Callable[[], str], batch_size: int | None = None) -> tuple:
    """`sample()` (-> `(completion_ids, logprobs)`, e.g. TRL's `_generate_single_turn`), checked: with `model` (the
    HF path) every `model.generate` in it samples through `FiniteLogits(end_token_id)` and its flags are read once
    after; without (vLLM), `logprobs` are read and a server's refusal to write a NaN is recognised. Either raises
    `NonFiniteLogitsError(place(), ...)` (`batch_size`: default, the completions' count; unknown after a refusal);
    else returns what `sample()` returned."""
    try:
        with finite_sampling(model, end_token_id) if model is not None else nullcontext() as guard:
            completion_ids, logprobs = sample()
    except Exception as error:  # TRL's client raises a bare `Exception` with the server's answer in its text
        if model is not None or SERVER_REFUSAL not in str(error):
            raise
        raise NonFiniteLogitsError(place(), rows=None, batch_size=batch_size, source="vLLM log-probs") from error
    rows = guard.bad_rows() if model is not None else nonfinite_logprob_rows(logprobs)
    if rows:
        raise NonFiniteLogitsError(place(), rows=rows, batch_size=batch_size or len(completion_ids),
                                   source="logits" if model is not None else "vLLM log-probs")
    return completion_ids, logprobs


def checked_rollout(trainer, sample: Callable[[], tuple]) -> tuple:
    """`checked_sampling` for a GRPO trainer's `_generate_single_turn` (`sample`, which returns `(completion_ids,
    logprobs)`): on TRL's HF `generate` path the policy samples through `FiniteLogits`; the error names the step
    (`state.global_step + 1` in training, the process when there are several) and the rows of this process's batch."""
    hf = not (trainer.use_vllm or trainer.use_transformers_continuous_batching)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped) if hf else None  # whose `generate` TRL calls

    def place() -> str:
        step, accelerator = trainer.state.global_step, trainer.accelerator
        where = (f"training step {step + 1} (the step was not trained on)" if trainer.model.training
                 else f"evaluation at step {step}")
        return where + (f", process {accelerator.process_index}" if accelerator.num_processes > 1 else "")

    return checked_sampling(sample, model=model, end_token_id=next(iter(trainer.eos_token_ids), None), place=place)
