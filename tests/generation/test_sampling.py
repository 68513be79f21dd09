"""`or1_trl.generation.sampling`: N completions per prompt through HF generate, resumable per prompt, scored with our rewards.

The model is `answer_model_dir` (conftest): the tiny chat model after a short SFT on additions, so its samples
mix right and wrong answers, and finished and truncated completions. The server backend runs against the real vLLM
CPU server of conftest (`vllm_server`: the random tied tiny model, whatever weights earlier tests synced into it).
"""

import json
import re

import pytest
import requests

from or1_trl.demos.tiny import addition_dataset
from or1_trl.generation.finite_logits import NonFiniteLogitsError
from or1_trl.rewards import MathReward
from or1_trl.generation.sampling import (
    HFBackend,
    SampleStore,
    SamplingSettings,
    ServerBackend,
    prompt_seed,
    prompt_token_ids,
    reward_scorer,
    sample,
)

DATA = addition_dataset(10, seed=1, max_operand=9)
PROMPTS = {f"q{i}": [{"role": "user", "content": p}] for i, p in enumerate(DATA["prompt"])}
GOLDS = {f"q{i}": a for i, a in enumerate(DATA["answer"])}
SETTINGS = SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=6, seed=0)


def test_hf_records_lengths_truncation_and_batching(answer_model_dir):
    backend = HFBackend(answer_model_dir, batch_size=16)
    records = sample(backend, PROMPTS, SETTINGS, progress=False)
    assert list(records) == list(PROMPTS)
    assert (backend.calls, backend.sequences) == (3, 40)  # 16 rows per call = 4 prompts x 4 samples
    tokenizer = backend.tokenizer
    kinds = set()
    for pid, record in records.items():
        assert record["id"] == pid and record["sampling"] == SETTINGS.as_dict() and record["backend"] == "hf"
        assert len(record["completions"]) == len(record["num_tokens"]) == len(record["truncated"]) == 4
        for text, length, truncated in zip(record["completions"], record["num_tokens"], record["truncated"]):
            # A finished completion is its text and the end-of-turn token; a truncated one is max_tokens of text.
            retokenized = tokenizer(text + ("" if truncated else "<|im_end|>"), add_special_tokens=False)["input_ids"]
            assert len(retokenized) == length
            assert length == 6 if truncated else length <= 6
            kinds.add(truncated)
    assert kinds == {True, False}  # two-digit sums need 7 tokens: both kinds occur


def test_hf_a_nan_logit_names_the_prompt_and_keeps_what_was_sampled_before(tiny, tmp_path):
    """A NaN in row 5's logits during the second `generate` call (prompts 2 and 3, 4 samples each): one
    `NonFiniteLogitsError` naming prompt 3 and row 5, no device-side assert; the first call's prompts are stored."""
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, batch_size=8)
    planted = []

    def nan_in_row_5_of_the_second_call(module, inputs, output):
        if backend.calls == 1 and not planted:
            planted.append(True)
            output = output.clone()
            output[5] = float("nan")
        return output

    model.lm_head.register_forward_hook(nan_in_row_5_of_the_second_call)
    with SampleStore(tmp_path / "samples.jsonl", SETTINGS) as store, pytest.raises(NonFiniteLogitsError) as error:
        sample(backend, {f"p{i}": f"{i} + {i} = " for i in range(4)}, SETTINGS, store=store, progress=False)
    assert str(error.value).startswith("non-finite logits (NaN/inf) at sampling, HF generate, prompts [3] of the 4 "
                                       "sampled: rows [5] of the 8-row batch; ")
    assert error.value.rows == [5] and planted and backend.calls == 1
    assert list(SampleStore(tmp_path / "samples.jsonl", SETTINGS).records) == ["p0", "p1"]


def test_hf_splits_a_prompt_over_calls_when_n_exceeds_the_batch(answer_model_dir):
    backend = HFBackend(answer_model_dir, batch_size=3)
    records = sample(backend, dict(list(PROMPTS.items())[:2]), SETTINGS, progress=False)
    assert (backend.calls, backend.sequences) == (4, 8)  # 3 + 1 rows per prompt
    assert [len(r["completions"]) for r in records.values()] == [4, 4]


def test_seeded_and_reproducible(answer_model_dir):
    first = sample(HFBackend(answer_model_dir, batch_size=16), PROMPTS, SETTINGS, progress=False)
    again = sample(HFBackend(answer_model_dir, batch_size=16), PROMPTS, SETTINGS, progress=False)
    other = sample(HFBackend(answer_model_dir, batch_size=16), PROMPTS,
                   SamplingSettings(n=4, max_tokens=6, seed=1), progress=False)
    assert first == again
    assert [r["completions"] for r in first.values()] != [r["completions"] for r in other.values()]
    assert prompt_seed(0, "q1") == prompt_seed(0, "q1") != prompt_seed(1, "q1")


def test_math_scores_match_a_hand_check(answer_model_dir):
    records = sample(HFBackend(answer_model_dir, batch_size=16), PROMPTS, SETTINGS, progress=False,
                     score=reward_scorer(MathReward(num_workers=0), GOLDS))
    rewards = [reward for r in records.values() for reward in r["rewards"]]
    for pid, record in records.items():
        for text, reward in zip(record["completions"], record["rewards"]):
            boxed = re.fullmatch(r"\s*\\boxed\{(\d+)\}", text)
            assert reward == float(boxed is not None and boxed.group(1) == GOLDS[pid]), text
    assert 0 < sum(rewards) < len(rewards)


class Crash(Exception):
    pass


def crash_on_batch(number: int):
    """A `score` that raises `Crash` on its `number`-th call (the run dies after number - 1 scored batches)."""
    calls = []

    def score(ids, completions):
        calls.append(ids)
        if len(calls) == number:
            raise Crash
        return [{} for _ in ids]

    return score


def test_resume_skips_finished_prompts_and_ends_like_an_uninterrupted_run(answer_model_dir, tmp_path):
    uninterrupted = sample(HFBackend(answer_model_dir, batch_size=8), PROMPTS, SETTINGS,
                           store=SampleStore(tmp_path / "full.jsonl", SETTINGS), progress=False)

    path = tmp_path / "resumed.jsonl"
    with pytest.raises(Crash), SampleStore(path, SETTINGS) as store:
        sample(HFBackend(answer_model_dir, batch_size=8), PROMPTS, SETTINGS, store=store, score=crash_on_batch(3),
               progress=False)
    assert len(SampleStore(path, SETTINGS)) == 4  # two batches of 2 prompts were written before the crash
    backend = HFBackend(answer_model_dir, batch_size=8)
    with SampleStore(path, SETTINGS) as store:
        resumed = sample(backend, PROMPTS, SETTINGS, store=store, progress=False)
    assert (backend.calls, backend.sequences) == (3, 24)  # only the 6 missing prompts
    assert resumed == uninterrupted
    assert [json.loads(line)["id"] for line in open(path)] == list(PROMPTS)

    again = HFBackend(answer_model_dir, batch_size=8)
    assert sample(again, PROMPTS, SETTINGS, store=SampleStore(path, SETTINGS), progress=False) == uninterrupted
    assert again.calls == 0


def test_store_drops_a_torn_line_and_refuses_other_settings(tmp_path):
    path = tmp_path / "s.jsonl"
    with SampleStore(path, SETTINGS) as store:
        store.append({"id": "a", "completions": [], "sampling": SETTINGS.as_dict()})
    with open(path, "a") as f:
        f.write('{"id": "b", "compl')  # killed mid-write
    store = SampleStore(path, SETTINGS)
    assert list(store.records) == ["a"] and open(path).read().endswith("}\n")
    store.close()
    with pytest.raises(ValueError, match="Delete the file"):
        SampleStore(path, SamplingSettings(n=8, max_tokens=6))
    with open(path, "a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=r"s.jsonl:2 is not a sample record"):
        SampleStore(path, SETTINGS)


def test_bad_prompts_fail_before_generating(answer_model_dir):
    backend = HFBackend(answer_model_dir, batch_size=8)
    with pytest.raises(ValueError, match="occurs twice"):
        sample(backend, [("a", "x"), ("a", "y")], SETTINGS, progress=False)
    with pytest.raises(ValueError, match="neither a string nor"):
        sample(backend, {"a": [{"content": "no role"}]}, SETTINGS, progress=False)
    backend.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        sample(backend, PROMPTS, SETTINGS, progress=False)
    assert backend.calls == 0
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingSettings(n=0, top_p=0)


def test_server_request_and_response_translation():
    """The OpenAI-compatible request (vLLM's extensions included) and the parse of a vLLM response body."""
    backend = ServerBackend("http://localhost:8000/v1/", model="m", chat_template_kwargs={"enable_thinking": True})
    assert backend.base_url == "http://localhost:8000"
    endpoint, body = backend.request_body(PROMPTS["q0"], SETTINGS, seed=7)
    assert endpoint == "/v1/chat/completions" and body["messages"] == PROMPTS["q0"]
    assert {k: body[k] for k in ("model", "n", "temperature", "top_p", "max_tokens", "seed", "top_k")} == {
        "model": "m", "n": 4, "temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "seed": 7, "top_k": -1}
    assert body["return_token_ids"] is True and body["chat_template_kwargs"] == {"enable_thinking": True}
    endpoint, body = backend.request_body("Q: 1+1=? A:", SETTINGS, seed=7)
    assert endpoint == "/v1/completions" and body["prompt"] == "Q: 1+1=? A:"

    response = {"choices": [
        {"index": 1, "text": " 2", "finish_reason": "length", "token_ids": [5, 6]},
        {"index": 0, "text": " \\boxed{2}", "finish_reason": "stop", "token_ids": [1, 2, 3]},
    ]}
    assert [(c.text, c.num_tokens, c.truncated) for c in backend.parse_choices(response)] == [
        (" \\boxed{2}", 3, False), (" 2", 2, True)]
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "\\boxed{2}", "reasoning_content": "1+1"}}]}
    assert [(c.text, c.num_tokens) for c in backend.parse_choices(chat)] == [("1+1</think>\\boxed{2}", None)]


def test_server_that_does_not_answer_is_a_clear_error():
    with pytest.raises(ConnectionError, match="or1-trl serve"):
        ServerBackend("http://127.0.0.1:9", max_concurrency=2).served_model()


def test_seeded_requests_past_the_cpu_token_budget_leave_the_server_alive(vllm_server):
    """Seeded prompts whose prefills exceed vLLM CPU's 2,048-token step budget: with chunked prefill, a seeded
    request's split prefill kills the whole server (`CPU Generator does not use offset`); `or1-trl serve` starts a
    CPU server without it (`serve.cpu_defaults`), so every prompt is answered, the same at any concurrency."""
    import requests

    prompts = {f"p{i}": f"Q: {i}+{' '.join(['plus'] * 120)}=? A:" for i in range(40)}  # ~125 tokens each
    settings = SamplingSettings(n=2, max_tokens=2, seed=5)
    records = sample(ServerBackend(vllm_server.url, max_concurrency=40), prompts, settings, progress=False)
    assert requests.get(f"{vllm_server.url}/health", timeout=10).status_code == 200
    assert sorted(records) == sorted(prompts) and all(len(r["completions"]) == 2 for r in records.values())
    first = dict(list(prompts.items())[:3])
    assert sample(ServerBackend(vllm_server.url, max_concurrency=1), first, settings, progress=False) == {
        pid: records[pid] for pid in first}


def test_server_backend_on_a_real_vllm_server(vllm_server, tmp_path):
    """The OpenAI-compatible path on vLLM: both endpoints, the server's chat template rendering equal to ours,
    token counts from `return_token_ids`, per-request seeds (the same samples at any concurrency), resume."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_path)
    prompts = {"text": "Q: 1+2=? A:", **{pid: PROMPTS[pid] for pid in ("q0", "q1", "q2")}}
    settings = SamplingSettings(n=3, max_tokens=8, seed=0)
    backend = ServerBackend(vllm_server.url, max_concurrency=4)
    records = sample(backend, prompts, settings, progress=False)
    assert backend.requests == 4
    for record in records.values():
        assert record["backend"] == "server" and len(record["completions"]) == 3
        for length, truncated in zip(record["num_tokens"], record["truncated"]):
            assert length <= 8 and (length == 8 if truncated else True)
    for pid in ("text", "q0"):  # the server renders (chat) and tokenizes (text) the prompt as TRL and HFBackend do
        response = backend._post(*backend.request_body(prompts[pid], settings, seed=1))
        rendered = response.get("prompt_token_ids") or response["choices"][0]["prompt_token_ids"]  # chat / completions
        assert rendered == prompt_token_ids(tokenizer, prompts[pid])
        assert [len(c["token_ids"]) for c in response["choices"]] == [c.num_tokens for c in backend.parse_choices(response)]

    assert sample(ServerBackend(vllm_server.url, max_concurrency=1), prompts, settings, progress=False) == records

    path = tmp_path / "server.jsonl"
    with pytest.raises(Crash), SampleStore(path, settings) as store:  # one prompt per batch here
        sample(ServerBackend(vllm_server.url, max_concurrency=1), prompts, settings, store=store,
               score=crash_on_batch(2), progress=False)
    resumed_backend = ServerBackend(vllm_server.url, max_concurrency=4)
    with SampleStore(path, settings) as store:
        assert len(store) == 1
        resumed = sample(resumed_backend, prompts, settings, store=store, progress=False)
    assert resumed_backend.requests == 3 and resumed == records

    with pytest.raises(requests.ConnectionError):  # a server that goes away mid-run: the error, not a hang
        ServerBackend("http://127.0.0.1:9", model="m", retries=0)._post("/v1/completions", {})


def test_server_backend_retries_5xx_answers_not_4xx():
    """`_post` retries a 5xx answer (urllib3's `Retry` on the session) up to `retries` times, then raises with the
    last answer; a 4xx answer is raised at once."""
    import http.server
    import threading

    answers, seen = [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers.pop(0)
            seen.append(status)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        answers[:] = [(503, b"{}"), (502, b"{}"), (200, b'{"choices": []}')]
        assert ServerBackend(url, model="m", retries=2)._post("/v1/completions", {}) == {"choices": []}
        assert seen == [503, 502, 200]
        seen.clear()
        answers[:] = [(503, b"busy"), (503, b"still busy")]
        with pytest.raises(RuntimeError, match="answered 503: still busy"):
            ServerBackend(url, model="m", retries=1)._post("/v1/completions", {})
        assert seen == [503, 503]
        seen.clear()
        answers[:] = [(400, b"bad request"), (200, b"{}")]
        with pytest.raises(RuntimeError, match="answered 400: bad request"):
            ServerBackend(url, model="m", retries=3)._post("/v1/completions", {})
        assert seen == [400]
    finally:
        server.shutdown()
