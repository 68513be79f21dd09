"""Paired rollouts (`OR1Config.rollout_seed`): every sample's randomness is a function of the seed, the step, the
prompt and the sample's index, so two runs — or two configs compared on one model — share their random numbers.

Without a seed (TRL's behaviour) a sample's noise comes from a shared stream: the batch a prompt travels in, the
rank, the server's other requests and its restarts all change it, so two arms of a comparison draw unrelated samples
even where their policies agree, and the rollouts' noise swamps the difference between the arms. With a seed, each
row of a rollout gets a key

    key = sha256(rollout_seed, step, phase, draw, prompt token ids, occurrence)     # 62 bits
      step:       the global step the rollout is for (a one-step-off rollout: the step that trains on it);
      phase:      "train" or "eval";
      draw:       the rollout's index within that step and phase (0: the step's own; 1, 2, ...: refills), so a
                  prompt drawn twice in one step draws anew;
      occurrence: how many identical prompts came before it in the request (an example replicated, as in 1-shot
                  RLVR, draws each copy independently; in TRL's HF path the G rows of a group are its copies),

and its samples depend on nothing else: not on its neighbours, its position in the batch, padding or the rank.

- vLLM server (`seeded_requests`, called by `vllm_client.OR1VLLMClient.generate`): one request per prompt with
  `seed=key`. vLLM seeds a generator per request and gives the i-th of its `n` samples `seed + i`; its sampler is
  the exponential race (Gumbel-max), so two runs whose weights agree draw the same tokens, and two configs keep
  drawing the same tokens where their policies agree, as far as the server's logits do not depend on how it batched
  the concurrent requests (in bf16 near-ties flip now and then, docs/reproducible_runs.md; in fp32 they did not).
- HF `generate` (`SeededGumbel`, installed by `seeded_sampling`): Gumbel-max with noise from splitmix64, a
  counter-based generator (its n-th value from `key` is a pure function of `(key, n)`), at counter
  `position * V + token`. Temperature, top-k, top-p and min-p are transformers' own warpers, applied in
  transformers' order before the noise; then `generate` decodes greedily on the noisy scores.
- `completions_hash`: a short hash of a rollout's completions (`rollout/completions_hash`, logged with or without
  a seed), to compare two runs step by step.

    seeds = RolloutSeeds(rollout_seed=7)                  # OR1Trainer: RolloutSeeds.for_trainer(trainer)
    key = seeds.next_key(step=3, training=True)           # RolloutKey(7, 3, "train", 0); again: draw 1
    key.row_keys([[5, 6], [5, 6], [9]])                   # three keys: the two copies of [5, 6] differ
    with seeded_sampling(model, key, pad_token_id=0):     # HF: model.generate samples through SeededGumbel
        model.generate(input_ids, generation_config=config)

Invariants (tests/generation/test_seeded.py):
- equal keys and equal scores give equal tokens; a row's noise at a position depends only on its key and position
  (`splitmix64` against a pure-Python reference);
- `SeededGumbel` samples softmax(warped scores) exactly (Gumbel-max): the noise is standard Gumbel;
- the server's per-prompt requests return the completions in the order of the prompts, as TRL's one request does.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from accelerate.utils import gather_object
from transformers import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

#: The field of `generation_kwargs` that carries a rollout's key from the trainer to `OR1VLLMClient.generate`, which
#: takes it out of the request (TRL passes `generation_kwargs` through as they are).
KEY_FIELD = "or1_rollout_key"
#: Requests in flight at once for one seeded rollout (TRL's concurrency for per-prompt requests).
MAX_CONCURRENT_REQUESTS = 64

_MASK64 = (1 << 64) - 1
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


@dataclass(frozen=True)
class RolloutKey:
    """What a rollout's randomness is a function of, besides each row's prompt and occurrence (see the module)."""

    seed: int
    step: int
    phase: str = "train"
    draw: int = 0

    def row_keys(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """One key per prompt (token ids), in `[0, 2**62)`; the k-th copy of a prompt in `prompts` has occurrence k."""
        seen: dict[tuple, int] = {}
        keys = []
        for prompt in prompts:
            ids = tuple(int(token) for token in prompt)
            occurrence = seen[ids] = seen.get(ids, -1) + 1
            text = json.dumps([self.seed, self.step, self.phase, self.draw, ids, occurrence])
            keys.append(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2)
        return keys

    def as_field(self) -> list:
        """The key as `KEY_FIELD`'s JSON-able value."""
        return [self.seed, self.step, self.phase, self.draw]

    @classmethod
    def from_field(cls, value: Sequence) -> RolloutKey:
        return cls(*value)


class RolloutSeeds:
    """The trainer's rollout keys: `next_key(step, training)` counts the draws of each (step, phase); `None` without
    a seed. Every rank calls it in step (TRL's `_generate` is collective), so every rank gets the same keys."""

    def __init__(self, rollout_seed: int | None):
        self.rollout_seed = rollout_seed
        self._step: int | None = None
        self._draws: dict[str, int] = {}  # phase -> rollouts drawn so far at `_step`
        self._hash_step: tuple[int, str] | None = None
        self._hash = 0  # `completions_hash` of the rollouts so far at `_hash_step`

    @classmethod
    def for_trainer(cls, trainer) -> RolloutSeeds:
        return cls(trainer.args.rollout_seed)

    def next_key(self, step: int, training: bool) -> RolloutKey | None:
        if self.rollout_seed is None:
            return None
        if step != self._step:
            self._step, self._draws = step, {}
        phase = "train" if training else "eval"
        draw = self._draws[phase] = self._draws.get(phase, -1) + 1
        return RolloutKey(self.rollout_seed, step, phase, draw)

    def generate(self, trainer, generate: Callable[[], tuple]) -> tuple:
        """`generate()` (TRL's `_generate` of `trainer`, an `OR1Trainer`) under the next key: on the vLLM server path
        the key travels in the request's `generation_kwargs` (`OR1VLLMClient` sends one seeded request per prompt),
        on TRL's HF path the policy samples through `seeded_sampling`. Either way the step's completions, over all
        ranks, are hashed into `rollout/completions_hash` (`train` or `eval` metrics)."""
        training = trainer.model.training
        key = self.next_key(trainer.state.global_step, training)
        if key is None:
            output = generate()
        elif trainer.use_vllm:  # `OR1VLLMGeneration.generate` puts it in the request's `generation_kwargs`
            trainer.vllm_generation.rollout_key = key.as_field()
            try:
                output = generate()
            finally:
                trainer.vllm_generation.rollout_key = None
        else:
            policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)  # whose `generate` TRL calls
            with seeded_sampling(policy, key, pad_token_id=trainer._tokenizer.pad_token_id):
                output = generate()
        self._record_hash(trainer, output[1], training)
        return output

    def _record_hash(self, trainer, completion_ids: list[list[int]], training: bool) -> None:
        """Chain this rollout's completions (all ranks', in rank order) into the step's hash, logged as one value."""
        where = (trainer.state.global_step, "train" if training else "eval")
        if where != self._hash_step:
            self._hash_step, self._hash = where, 0
        rows = [list(row) for row in completion_ids]
        every_rank = gather_object(rows) if trainer.accelerator.num_processes > 1 else rows
        self._hash = completions_hash(every_rank, previous=self._hash)
        trainer._metrics[where[1]]["rollout/completions_hash"] = [float(self._hash)]  # one value: never averaged


def next_step_request(request: dict, step: int) -> dict:
    """A server request (`generation_kwargs` holding a `KEY_FIELD`) re-keyed for the own rollout of training step
    `step`: the one-step-off prefetch asks for step k+1's rollout with step k's sampling parameters. Without a key:
    `request` as it is."""
    field = (request.get("generation_kwargs") or {}).get(KEY_FIELD)
    if field is None:
        return request
    key = replace(RolloutKey.from_field(field), step=step, phase="train", draw=0)
    return {**request, "generation_kwargs": {**request["generation_kwargs"], KEY_FIELD: key.as_field()}}


# --- the vLLM server: one seeded request per prompt ------------------------------------------------------------------
def seeded_requests(send: Callable[..., dict], prompts: list, features: list | None = None,
                    generation_kwargs: dict | None = None, **sampling) -> dict:
    """`VLLMClient.generate`'s answer for a request whose `generation_kwargs` hold a `KEY_FIELD`: `send` (TRL's
    `generate`) is called once per prompt, concurrently, with `seed` = that prompt's row key; the answers are joined
    in the order of `prompts` (TRL's one request answers prompt-major, the `n` completions of a prompt together)."""
    generation_kwargs = dict(generation_kwargs or {})
    key = RolloutKey.from_field(generation_kwargs.pop(KEY_FIELD))
    seeds = key.row_keys(prompts)

    def one(index: int) -> dict:
        return send(prompts=[prompts[index]], features=None if features is None else [features[index]],
                    generation_kwargs={**generation_kwargs, "seed": seeds[index]}, **sampling)

    if not prompts:
        return {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []}
    with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_REQUESTS, len(prompts))) as executor:
        answers = list(executor.map(one, range(len(prompts))))
    joined = {}
    for name in answers[0]:
        parts = [answer[name] for answer in answers]
        joined[name] = None if any(part is None for part in parts) else [row for part in parts for row in part]
    return joined


# --- HF generate: Gumbel-max with counter-based noise --------------------------------------------------------------
def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(value: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic): the bits of an unsigned 64-bit value."""
    return (value >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The `counters`-th values (0-based) of splitmix64's stream from each of `keys`, as int64 bit patterns.

    `keys`: `[B]` int64; `counters`: `[N]` int64; returns `[B, N]`. Integer arithmetic wraps modulo 2**64, as the
    generator's definition does (`splitmix64_reference` is the same in plain Python)."""
    state = keys[:, None] + (counters[None, :] + 1) * _signed(_GAMMA)  # [B, N]
    state = (state ^ _shift_right(state, 30)) * _signed(_MIX1)
    state = (state ^ _shift_right(state, 27)) * _signed(_MIX2)
    return state ^ _shift_right(state, 31)


def splitmix64_reference(key: int, counter: int) -> int:
    """`splitmix64` for one key and counter, on Python integers (unsigned)."""
    z = (key + (counter + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def gumbel_noise(keys: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise `[B, V]` (float64) for decoding position `position` of rows with `keys` (`[B]` int64):
    uniforms from the top 53 bits of `splitmix64` at counters `position * V + token`, then `-log(-log(u))`."""
    counters = position * vocab_size + torch.arange(vocab_size, dtype=torch.int64, device=keys.device)  # [V]
    bits = _shift_right(splitmix64(keys, counters), 11)  # [B, V], in [0, 2**53)
    uniform = (bits.double() + 0.5) * 2.0**-53  # (0, 1)
    return -torch.log(-torch.log(uniform))


class SeededGumbel(LogitsProcessor):
    """Adds `gumbel_noise` of each row's key to the (already warped) scores; `generate` then takes the argmax.

    The rows' keys are made at the first call, from the prompt (`input_ids` then, less its left padding) and the
    `RolloutKey`; the position is the number of tokens generated so far. Returns float32 or wider (noise added in
    float64), so that bf16 scores do not round the noisy scores into ties."""

    def __init__(self, key: RolloutKey, pad_token_id: int | None):
        self.key, self.pad_token_id = key, pad_token_id
        self.prompt_length: int | None = None
        self.row_keys: torch.Tensor | None = None  # [B] int64

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:  # [B, L], [B, V]
        if self.prompt_length is None:
            self.prompt_length = input_ids.size(1)
            prompts = [self._unpadded(row) for row in input_ids.tolist()]
            self.row_keys = torch.tensor(self.key.row_keys(prompts), dtype=torch.int64, device=scores.device)
        position = input_ids.size(1) - self.prompt_length
        noisy = scores.double() + gumbel_noise(self.row_keys, position, scores.size(-1))  # [B, V]
        return noisy.to(torch.promote_types(scores.dtype, torch.float32))

    def _unpadded(self, row: list[int]) -> list[int]:
        start = 0
        while start < len(row) and row[start] == self.pad_token_id:  # left padding belongs to the batch, not the row
            start += 1
        return row[start:]


def sampling_warpers(config) -> list[LogitsProcessor]:
    """transformers' warpers for a sampling `GenerationConfig` (temperature, top-k, top-p, min-p), in its order."""
    warpers = []
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    if getattr(config, "min_p", None):
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    return warpers


@contextlib.contextmanager
def seeded_sampling(model, key: RolloutKey, pad_token_id: int | None) -> Iterator[None]:
    """While active, `model.generate(...)` samples with `SeededGumbel(key)` (one per call) after transformers'
    warpers of its generation config, decoding greedily on the noisy scores; the call's own processors (e.g.
    `finite_logits.FiniteLogits`) come after, and see the noisy scores. An instance attribute, removed on exit."""
    own = vars(model).get("generate")
    generate = model.generate

    def generate_seeded(*args, generation_config=None, logits_processor=None, **kwargs):
        config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
        processors = [*sampling_warpers(config), SeededGumbel(key, pad_token_id), *(logits_processor or [])]
        config.do_sample, config.temperature, config.top_k, config.top_p, config.min_p = False, None, None, None, None
        return generate(*args, generation_config=config, logits_processor=LogitsProcessorList(processors), **kwargs)

    model.generate = generate_seeded
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def completions_hash(completion_ids: Sequence[Sequence[int]], previous: int = 0) -> int:
    """A 24-bit hash of a rollout's completions (token ids, in order), chained with `previous` (the step's earlier
    rollouts): exact as a float metric, equal for equal completions, and different otherwise but for a chance of
    2**-24."""
    text = json.dumps([previous, [[int(token) for token in row] for row in completion_ids]])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], "little")
