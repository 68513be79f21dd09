"""N completions per prompt, from a vLLM server, in-process vLLM or HF `generate`, resumable per prompt.

One module for everything that samples a model outside training: `or1-trl eval` (avg@n, pass@k) and
`or1-trl difficulty` (paper §6.2: N rollouts per prompt at T = 1.0, the count of correct ones kept per model).

    from or1_trl.generation.sampling import (HFBackend, SampleStore, SamplingSettings, ServerBackend, reward_scorer,
                                             sample)
    from or1_trl.rewards import math_reward

    prompts = {"p0": [{"role": "user", "content": "What is 2 + 3?"}], "p1": "Plain text prompt"}  # id -> prompt
    settings = SamplingSettings(n=16, temperature=1.0, top_p=1.0, max_tokens=32768, seed=0)
    backend = ServerBackend("http://localhost:8000")           # `or1-trl serve` / `vllm serve` (OpenAI API)
    # backend = HFBackend("path/or/hub-id", batch_size=64)     # or HF generate, batched, in this process
    # backend = make_backend(model="path/or/hub-id", server_url=None)   # the same choice from CLI-style arguments
    with SampleStore("out/samples.jsonl", settings) as store:  # resumable: finished prompts are skipped
        records = sample(backend, prompts, settings, store=store,
                         score=reward_scorer(math_reward, {"p0": "5", "p1": "..."}))
    records["p0"]["rewards"]                                   # [1.0, 0.0, ...]: one per completion

**Prompts** are a mapping `{prompt_id: prompt}` (or a list of `(prompt_id, prompt)` pairs); a prompt is a
conversation (a list of `{"role", "content"}` messages, rendered with the model's chat template and its
generation prompt) or a plain string (sent as it is). Ids are strings and must be unique; they key the store.

**Records** (`sample` returns `{prompt_id: record}` in the order of `prompts`; the store holds the same, one JSON
line each)::

    {"id": "p0",
     "completions": ["...", ...],          # n texts (special tokens removed)
     "num_tokens": [412, ...],             # n completion lengths in tokens (EOS included, like TRL's masks)
     "truncated": [false, ...],            # n flags: finish_reason == "length" (max_tokens reached, no EOS)
     "sampling": {"n": 16, "temperature": 1.0, "top_p": 1.0, "max_tokens": 32768, "seed": 0},
     "backend": "server",
     ...}                                  # plus whatever `score` returned for this prompt, e.g. "rewards"

**Scoring**: `score(ids, completions) -> list[dict]` is called on each batch of finished prompts, before their
records are written (so a resumed run never re-scores): `completions[i]` is the list of `Completion`s of
`ids[i]`, and the i-th dict is merged into that prompt's record. `reward_scorer(reward_func, golds)` builds one
from any TRL-style reward function (`math_reward`, `code_reward`): it adds `{"rewards": [...]}`.

**Resuming**: `SampleStore(path, settings)` appends one line per finished prompt (one `write`, flushed and
fsynced), so an interrupted run leaves whole records (a torn last line is dropped when the file is opened
again). Re-running `sample` with the same store skips the prompts it holds. A store written with other
`SamplingSettings` is an error (delete it or pick another path): samples of two settings never mix.

**Seeds**: each prompt gets its own seed, `prompt_seed(settings.seed, prompt_id)`. The server and in-process vLLM
pass it with the request (vLLM seeds a generator per request), so a prompt's samples do not depend on which
other prompts are in flight, nor on resuming. HF `generate` samples a whole batch from one stream, seeded with
the seed of the batch's first prompt: results are reproducible for the same prompts, `n` and `batch_size`, and a
run resumed after a crash between two batches ends with the same records as an uninterrupted one (tested).

**Backends** (all sample plain softmax at `temperature` with nucleus `top_p` — no top-k, min-p or repetition
penalty, whatever the model's `generation_config.json` suggests, which vLLM and transformers would otherwise
apply):

- `ServerBackend(url)`: an OpenAI-compatible vLLM server (`or1-trl serve`, `vllm serve`): conversations go to
  `/v1/chat/completions` (the server applies the model's chat template), strings to `/v1/completions`; one
  request per prompt with `n` choices, `max_concurrency` requests in flight (vLLM batches them). Token counts come
  from vLLM's `return_token_ids` extension (a server without it: re-tokenised with `tokenizer` if given, else
  `None`). The server's API key from `api_key` or `$OR1_VLLM_API_KEY` (`or1-trl serve`'s variable;
  `or1-trl eval` and `difficulty` read it there), else, for a server on this machine, the key file `or1-trl serve`
  made (`serve.resolve_api_key`). `requests` only; no vLLM needed on the client.
- `VLLMBackend(model)`: vLLM in this process (`pip install or1-trl[vllm]`). Untested in this repository's test
  suite (vLLM is not installed in its environment); kept small.
- `HFBackend(model)`: `model.generate` in this process, `batch_size` sequences per call (left-padded), one process
  (no accelerate/DDP sharding). For tests, CPU runs and models vLLM does not serve.

A progress bar (tqdm) counts prompts, with the rate and ETA over this session, and the generated tokens per second;
on a terminal only (a log file would get every redraw).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Protocol, Union

#: A prompt: a conversation (list of {"role", "content"} messages) or a plain string.
Prompt = Union[str, list]
#: `score(ids, completions)`: one dict of extra record fields per prompt.
Score = Callable[[list[str], list[list["Completion"]]], list[dict]]
#: Keys every record has; `score` may not return them.
RECORD_KEYS = ("id", "completions", "num_tokens", "truncated", "sampling", "backend")


@dataclass(frozen=True)
class SamplingSettings:
    """How each prompt is sampled. Paper defaults for evaluation: T = 1.0, top-p = 1.0, 32,768 tokens (§8.1)."""

    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 32768  # completion tokens
    seed: int = 0  # base seed; each prompt's seed is prompt_seed(seed, prompt_id)

    def __post_init__(self):
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    text: str
    num_tokens: int | None  # completion tokens, EOS included; None if the backend cannot tell
    truncated: bool  # finish_reason == "length": max_tokens reached without EOS


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed of one prompt: a hash of (base seed, prompt id), in [0, 2**31)."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def is_conversation(prompt: Prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m for m in prompt)


def check_prompt(prompt_id: str, prompt: Any) -> None:
    if not (isinstance(prompt, str) or (is_conversation(prompt) and len(prompt) > 0)):
        raise ValueError(
            f"prompt {prompt_id!r} is neither a string nor a non-empty list of {{'role', 'content'}} messages: "
            f"{str(prompt)[:200]!r}"
        )


def prompt_token_ids(tokenizer, prompt: Prompt, chat_template_kwargs: Mapping | None = None) -> list[int]:
    """Token ids of a prompt as TRL tokenizes it: a conversation through the chat template with the generation
    prompt; a string with the tokenizer's own special tokens."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer of this model ({getattr(tokenizer, 'name_or_path', '?')!r}) has no chat template, so "
            "conversations cannot be rendered; pass plain-text prompts (or1-trl eval: --no_chat_template)"
        )
    encoded = tokenizer.apply_chat_template(
        list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True, **dict(chat_template_kwargs or {})
    )
    return list(encoded["input_ids"])


# --------------------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------------------


class Backend(Protocol):
    """What `sample` needs from a backend."""

    name: str

    def generate(
        self, prompts: Sequence[Prompt], settings: SamplingSettings, seeds: Sequence[int]
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """Sample `settings.n` completions for each prompt (`seeds[i]` is prompt i's seed). Yields batches of finished
        prompts as `(index into prompts, completions)`, in any order; every prompt exactly once."""
        ...


class HFBackend:
    """HF `generate`, batched: `batch_size` sequences (prompt × sample rows) per call, left-padded.

    Args:
        model: a `PreTrainedModel`, or a local path / Hub id loaded with `AutoModelForCausalLM` (`dtype`, `device`).
        tokenizer: default: `AutoTokenizer.from_pretrained(model)` (a path or id) — required with a model object.
        batch_size: sequences per `generate` call; a prompt's `n` samples may span calls when `n > batch_size`.
        chat_template_kwargs: passed to `apply_chat_template` (e.g. `{"enable_thinking": True}`).

    Attributes:
        calls, sequences: `generate` calls made and sequences generated so far (what a resumed run saved).
    """

    name = "hf"

    def __init__(self, model, tokenizer=None, batch_size: int = 64, device: str | None = None, dtype: str = "auto",
                 chat_template_kwargs: Mapping | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
            if device is not None:
                model = model.to(device)
        elif tokenizer is None:
            raise ValueError("HFBackend needs a tokenizer when the model is an object")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = batch_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.calls = self.sequences = 0

    def eos_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        configured = self.model.generation_config.eos_token_id
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
        return sorted(i for i in ids if i is not None)

    def generate(self, prompts, settings, seeds):
        from .finite_logits import NonFiniteLogitsError

        token_ids = [prompt_token_ids(self.tokenizer, p, self.chat_template_kwargs) for p in prompts]  # fail early
        per_call = max(1, self.batch_size // settings.n)  # prompts per batch
        for start in range(0, len(prompts), per_call):
            rows = [i for i in range(start, min(start + per_call, len(prompts))) for _ in range(settings.n)]
            completions: dict[int, list[Completion]] = {}
            for part, begin in enumerate(range(0, len(rows), self.batch_size)):
                chunk = rows[begin : begin + self.batch_size]
                seed = (seeds[start] + part) & 0x7FFFFFFF
                try:
                    generated = self._generate_rows([token_ids[i] for i in chunk], settings, seed)
                except NonFiniteLogitsError as error:  # its rows are this call's: their prompts named too
                    prompts_hit = sorted({chunk[r] for r in error.rows})  # positions in `prompts`
                    raise NonFiniteLogitsError(f"HF generate, prompts {prompts_hit} of the {len(prompts)} sampled",
                                               rows=error.rows, batch_size=error.batch_size) from None
                for i, completion in zip(chunk, generated):
                    completions.setdefault(i, []).append(completion)
            yield sorted(completions.items())

    def _generate_rows(self, rows: list[list[int]], settings: SamplingSettings, seed: int) -> list[Completion]:
        import torch
        from transformers import GenerationConfig

        from .finite_logits import NonFiniteLogitsError, finite_sampling

        device = self.model.device
        eos = self.eos_token_ids()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)  # [R, P]
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)  # [R, P]
        sampling = settings.temperature > 0
        config = GenerationConfig(
            max_new_tokens=settings.max_tokens,
            do_sample=sampling,
            temperature=settings.temperature if sampling else None,
            top_p=settings.top_p if sampling else None,
            top_k=0,  # plain nucleus sampling, whatever the model's generation_config says
            repetition_penalty=1.0,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            # A non-finite logit: that row samples EOS, and one read after `generate` raises (`finite_logits.py`)
            with finite_sampling(self.model, end_token_id=eos[0]) as guard:
                output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                             generation_config=config)
            if bad := guard.bad_rows():
                raise NonFiniteLogitsError("HF generate", rows=bad, batch_size=len(rows))
        self.calls += 1
        self.sequences += len(rows)
        out = []
        for ids in output[:, width:].tolist():  # [R, T] completion tokens, padded after EOS
            end = next((t for t, token in enumerate(ids) if token in eos), None)
            ids = ids if end is None else ids[: end + 1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Completion(text, len(ids), truncated=end is None))
        return out


class ServerBackend:
    """An OpenAI-compatible vLLM server (`or1-trl serve`, `vllm serve`, `python -m
    vllm.entrypoints.openai.api_server`).

    Args:
        url: the server's address, e.g. `http://localhost:8000` (a trailing `/v1` is accepted).
        model: the served model name; default: the first one `/v1/models` lists.
        max_concurrency: requests in flight (one request per prompt, `n` choices each).
        timeout: seconds one request may take (a 32K-token completion at low throughput takes minutes).
        retries: attempts per request on connection errors and 5xx answers (exponential backoff); 4xx are raised.
        tokenizer: counts completion tokens when the server does not return token ids (older vLLM, other servers).
        chat_template_kwargs: sent with chat requests (vLLM renders the template with them).
        api_key: the server's key, sent as `Authorization: Bearer` with every request; default: `$OR1_VLLM_API_KEY`,
            else `$VLLM_API_KEY` (`or1-trl serve`'s variables), else the key file of a server on this machine
            (`serve.resolve_api_key`), else none. A 401 answer is a `ServerKeyError`.

    Attributes:
        requests: generation requests answered so far (one per prompt).
    """

    name = "server"

    def __init__(self, url: str, model: str | None = None, max_concurrency: int = 64, timeout: float = 3600.0,
                 retries: int = 3, tokenizer=None, chat_template_kwargs: Mapping | None = None,
                 api_key: str | None = None):
        from .serve import resolve_api_key

        url = url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.model = model
        self.max_concurrency = max_concurrency
        self.timeout, self.retries = timeout, retries
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._api_key = resolve_api_key(api_key, self.base_url)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.requests = 0  # generation requests answered so far (what a resumed run saved)

    def _session(self):
        """This thread's `requests.Session` (`server_health.keyed_session`: keyed, and retrying connection errors
        and 5xx answers `retries` times with exponential backoff, the trainer's policy); 4xx answers are not retried,
        a lost answer is not asked again (it may have generated for `timeout` s), and the last 5xx answer comes back,
        so that `_post` raises with its text."""
        from .server_health import keyed_session

        if not hasattr(self._local, "session"):
            self._local.session = keyed_session(self._api_key, retries=self.retries, resend=False, last_answer=True)
        return self._local.session

    def served_model(self) -> str:
        """The model name requests use; asks `/v1/models` once. A clear error when no server answers."""
        if self.model is None:
            import requests

            try:
                response = self._session().get(f"{self.base_url}/v1/models", timeout=30)
                response.raise_for_status()
                self.model = response.json()["data"][0]["id"]
            except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
                raise ConnectionError(
                    f"no OpenAI-compatible server answers at {self.base_url}/v1/models ({exc}). Start one with "
                    "`or1-trl serve --model MODEL` (or `vllm serve MODEL`), or pass --server_url correctly."
                ) from exc
        return self.model

    def request_body(self, prompt: Prompt, settings: SamplingSettings, seed: int) -> tuple[str, dict]:
        """`(endpoint, JSON body)` of one prompt's request."""
        body = {
            "model": self.served_model(),
            "n": settings.n,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": -1,  # vLLM: no top-k / min-p / repetition penalty, even if generation_config.json sets them
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": settings.max_tokens,
            "seed": seed,
            "return_token_ids": True,  # vLLM extension: choices[i].token_ids
        }
        if isinstance(prompt, str):
            return "/v1/completions", {**body, "prompt": prompt}
        body = {**body, "messages": list(prompt)}
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return "/v1/chat/completions", body

    def _post(self, endpoint: str, body: dict) -> dict:
        response = self._session().post(f"{self.base_url}{endpoint}", json=body, timeout=self.timeout)
        if response.status_code >= 400:
            raise RuntimeError(f"{self.base_url}{endpoint} answered {response.status_code}: {response.text[:1000]}")
        return response.json()

    def parse_choices(self, response: dict) -> list[Completion]:
        """The completions of one response (`/v1/completions` or `/v1/chat/completions`), in choice order."""
        out = []
        for choice in sorted(response["choices"], key=lambda c: c.get("index", 0)):
            if "message" in choice:
                message = choice["message"]
                text = message.get("content") or ""
                reasoning = message.get("reasoning_content") or message.get("reasoning")
                if reasoning:  # a server started with a reasoning parser splits the thinking off: join it back
                    text = f"{reasoning}</think>{text}"
            else:
                text = choice["text"]
            if choice.get("token_ids") is not None:
                num_tokens = len(choice["token_ids"])
            elif self.tokenizer is not None:
                num_tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                num_tokens = None
            out.append(Completion(text, num_tokens, truncated=choice.get("finish_reason") == "length"))
        return out

    def _one(self, prompt: Prompt, settings: SamplingSettings, seed: int) -> list[Completion]:
        completions = self.parse_choices(self._post(*self.request_body(prompt, settings, seed)))
        with self._lock:
            self.requests += 1
        if len(completions) != settings.n:
            raise RuntimeError(f"the server returned {len(completions)} choices instead of n={settings.n}")
        return completions

    def generate(self, prompts, settings, seeds):
        self.served_model()  # fail before queueing anything
        pending = iter(range(len(prompts)))
        pool = ThreadPoolExecutor(self.max_concurrency)
        futures = {}

        def submit(count: int) -> None:  # keep about 2 x max_concurrency requests queued, not all of them
            for i in pending:
                futures[pool.submit(self._one, prompts[i], settings, seeds[i])] = i
                count -= 1
                if count == 0:
                    return

        try:
            submit(2 * self.max_concurrency)
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                batch = [(futures.pop(f), f.result()) for f in done]
                submit(len(batch))
                yield batch
        finally:  # an error or an interrupt: drop what is queued; requests in flight finish in the background
            pool.shutdown(wait=False, cancel_futures=True)


class VLLMBackend:
    """vLLM in this process (`LLM(model, **llm_kwargs)`), `chunk_size` prompts per `LLM.generate` call.

    Not exercised by this repository's tests (vLLM is not installed in its test environment); the server backend is
    the tested path to vLLM.
    """

    name = "vllm"

    def __init__(self, model: str, chunk_size: int = 256, chat_template_kwargs: Mapping | None = None, **llm_kwargs):
        from vllm import LLM

        self.llm = LLM(model=str(model), **llm_kwargs)
        self.chunk_size = chunk_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def generate(self, prompts, settings, seeds):
        from vllm import SamplingParams

        tokenizer = self.llm.get_tokenizer()
        for start in range(0, len(prompts), self.chunk_size):
            chunk = range(start, min(start + self.chunk_size, len(prompts)))
            inputs = [{"prompt_token_ids": prompt_token_ids(tokenizer, prompts[i], self.chat_template_kwargs)}
                      for i in chunk]
            params = [
                SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p, top_k=-1,
                               min_p=0.0, repetition_penalty=1.0, max_tokens=settings.max_tokens, seed=seeds[i])
                for i in chunk
            ]
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
            yield [
                (i, [Completion(o.text, len(o.token_ids), o.finish_reason == "length") for o in output.outputs])
                for i, output in zip(chunk, outputs)
            ]


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def make_backend(model=None, server_url: str | None = None, backend: str = "auto", *, tokenizer=None,
                 batch_size: int = 64, max_concurrency: int = 64, dtype: str = "auto", device: str | None = None,
                 chat_template_kwargs: Mapping | None = None, vllm_kwargs: Mapping | None = None) -> Backend:
    """The backend for command-line style arguments.

    `backend="auto"`: the server when `server_url` is given, else in-process vLLM when `import vllm` works, else HF
    `generate`. `"server"`, `"vllm"` and `"hf"` force one (a clear error when it cannot run).
    """
    if backend not in ("auto", "server", "vllm", "hf"):
        raise ValueError(f"backend must be 'auto', 'server', 'vllm' or 'hf', got {backend!r}")
    if backend == "server" or (backend == "auto" and server_url):
        if not server_url:
            raise ValueError("backend 'server' needs a server URL (--server_url http://HOST:PORT)")
        return ServerBackend(server_url, model=None, max_concurrency=max_concurrency, tokenizer=tokenizer,
                             chat_template_kwargs=chat_template_kwargs)
    if server_url:
        raise ValueError(f"a server URL was given with backend {backend!r}; use backend 'server' or 'auto'")
    if model is None:
        raise ValueError("a model (local path or Hub id) is needed without a server URL")
    if backend == "vllm" or (backend == "auto" and vllm_available()):
        if not vllm_available():
            raise ImportError("backend 'vllm' needs vLLM in this environment: pip install 'or1-trl[vllm]'")
        return VLLMBackend(model, chat_template_kwargs=chat_template_kwargs, seed=0, dtype=dtype,
                           **dict(vllm_kwargs or {}))
    return HFBackend(model, tokenizer=tokenizer, batch_size=batch_size, device=device, dtype=dtype,
                     chat_template_kwargs=chat_template_kwargs)


# --------------------------------------------------------------------------------------------------------------
# The store and the driver
# --------------------------------------------------------------------------------------------------------------


class SampleStore:
    """Append-only JSONL of finished prompts, one record per line; the resume point of `sample`.

    Each record is written with one `write` of a whole line, then flushed and fsynced. Opening a file whose last
    line is torn (the process died mid-write) drops that line. A record sampled with other `settings` is an error.

    Args:
        path: the JSONL file (its folder is created).
        settings: the settings this run samples with (checked against the file's records); `None`: no check.
    """

    def __init__(self, path: str | os.PathLike, settings: SamplingSettings | None = None):
        self.path = os.fspath(path)
        self.settings = settings
        self.records: dict[str, dict] = {}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            self._load()
        self._file = open(self.path, "a", encoding="utf-8")

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn last line: cut it off
            with open(self.path, "r+b") as f:
                f.truncate(end)
        expected = self.settings.as_dict() if self.settings is not None else None
        for number, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                pid = record["id"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.path}:{number} is not a sample record ({exc}); the file is not a "
                                 "store") from exc
            if expected is not None and record.get("sampling") != expected:
                raise ValueError(
                    f"{self.path} holds samples taken with {record.get('sampling')} (line {number}), but this run "
                    f"samples with {expected}. Delete the file (or choose another output) to start over; samples of "
                    "different settings are never mixed."
                )
            self.records[pid] = record

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self.records

    def __getitem__(self, prompt_id: str) -> dict:
        return self.records[prompt_id]

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[record["id"]] = record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reward_scorer(reward_func: Callable, golds: Mapping[str, Any], column: str = "answer",
                  field: str = "rewards") -> Score:
    """A `score` for `sample` from a TRL-style reward function: `reward_func(completions=texts, **{column: golds})`.

    `golds[prompt_id]` is the prompt's gold (an answer for `math_reward`, a test spec for `code_reward`, with
    `column="tests"`). Each record gets `{field: [one reward per completion]}`.
    """

    def score(ids: list[str], completions: list[list[Completion]]) -> list[dict]:
        texts = [c.text for group in completions for c in group]
        gold = [golds[pid] for pid, group in zip(ids, completions) for _ in group]
        rewards = [float(r) for r in reward_func(completions=texts, **{column: gold})]
        out, start = [], 0
        for group in completions:
            out.append({field: rewards[start : start + len(group)]})
            start += len(group)
        return out

    return score


def _items(prompts: Mapping[str, Prompt] | Sequence[tuple[str, Prompt]]) -> list[tuple[str, Prompt]]:
    items = [(str(k), v) for k, v in (prompts.items() if isinstance(prompts, Mapping) else prompts)]
    seen: set[str] = set()
    for pid, prompt in items:
        if pid in seen:
            raise ValueError(f"prompt id {pid!r} occurs twice; ids must be unique (they key the records)")
        seen.add(pid)
        check_prompt(pid, prompt)
    return items


def sample(
    backend: Backend,
    prompts: Mapping[str, Prompt] | Sequence[tuple[str, Prompt]],
    settings: SamplingSettings,
    store: SampleStore | None = None,
    score: Score | None = None,
    desc: str = "sampling",
    progress: bool = True,
) -> dict[str, dict]:
    """Sample `settings.n` completions of every prompt that `store` does not hold yet; returns every prompt's record.

    Records (see the module docstring) are written to `store` as prompts finish, after `score` added its fields.
    Prompts are checked (unique ids, strings or conversations) before anything is generated.
    """
    from tqdm.auto import tqdm

    items = _items(prompts)
    if store is not None and store.settings is not None and store.settings != settings:
        raise ValueError(f"the store was opened with {store.settings}, but sample() was given {settings}")
    records: dict[str, dict] = {} if store is None else store.records
    todo = [(pid, prompt) for pid, prompt in items if pid not in records]
    bar = tqdm(total=len(items), initial=len(items) - len(todo), desc=desc, unit="prompt",
               disable=None if progress else True,  # None: tqdm's "on a terminal only"
               dynamic_ncols=True, smoothing=0.1)
    tokens, started = 0, time.monotonic()
    try:
        if todo:
            seeds = [prompt_seed(settings.seed, pid) for pid, _ in todo]
            for finished in backend.generate([prompt for _, prompt in todo], settings, seeds):
                ids = [todo[i][0] for i, _ in finished]
                groups = [completions for _, completions in finished]
                extras = score(ids, groups) if score is not None else [{} for _ in ids]
                for pid, group, extra in zip(ids, groups, extras, strict=True):
                    clash = set(extra) & set(RECORD_KEYS)
                    if clash:
                        raise ValueError(f"score() returned reserved record keys {sorted(clash)}")
                    record = {
                        "id": pid,
                        "completions": [c.text for c in group],
                        "num_tokens": [c.num_tokens for c in group],
                        "truncated": [c.truncated for c in group],
                        "sampling": settings.as_dict(),
                        "backend": backend.name,
                        **extra,
                    }
                    if store is not None:
                        store.append(record)
                    else:
                        records[pid] = record
                    tokens += sum(c.num_tokens or 0 for c in group)
                bar.update(len(finished))
                bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - started, 1e-9):.0f}", refresh=False)
    finally:
        bar.close()
    return {pid: records[pid] for pid, _ in items}


__all__ = [
    "Backend",
    "Completion",
    "HFBackend",
    "Prompt",
    "SampleStore",
    "SamplingSettings",
    "Score",
    "ServerBackend",
    "VLLMBackend",
    "is_conversation",
    "make_backend",
    "prompt_seed",
    "prompt_token_ids",
    "reward_scorer",
    "sample",
    "vllm_available",
]
