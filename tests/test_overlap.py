"""One-step-off rollouts (`or1_trl/overlap.py`, `OR1Config.async_generation`): the generation request on one background
thread, timed (overlap), tagged with its weights version (staleness), errors and shutdown; a real request to the
vLLM CPU server off the training thread; and the loss on a one-update-stale batch against the plain PPO-clip
objective whose π_old is the generating policy (`docs/async_generation.md`)."""

import copy
import threading
import time
import traceback

import pytest
import torch

from or1_trl import OR1Config
from or1_trl.overlap import THREAD_NAME, RolloutPrefetch, StaleRolloutError, rollout_threads
from or1_trl.rollout_correction import correction_weights
from or1_trl.testing import tiny_training_args

GENERATION_S = 0.3


def slow_generation(value, seconds=GENERATION_S, log=None):
    """Stands in for the HTTP request: sleeps (releases the GIL, as a socket read does), records its thread."""
    if log is not None:
        log.append(threading.current_thread().name)
    time.sleep(seconds)
    return value


def training_work(seconds):
    """Real torch work on the training thread for `seconds`."""
    end, x = time.perf_counter() + seconds, torch.randn(128, 128)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x.T / 128)
    return x


def test_generation_hidden_behind_training():
    threads = []
    with RolloutPrefetch() as prefetch:
        prefetch.submit(0, slow_generation, "rollout", log=threads)
        training_work(GENERATION_S + 0.1)  # update 0 runs while the server generates rollout 1
        rollout = prefetch.result(1)
    assert rollout.value == "rollout" and rollout.version == 0 and rollout.staleness == 1
    assert threads[0].startswith(THREAD_NAME) and threads[0] != threading.current_thread().name
    assert GENERATION_S <= rollout.generation_s < GENERATION_S + 0.25
    assert rollout.waited_s < 0.03 and rollout.overlap > 0.9
    assert rollout.metrics() == {"async/staleness": 1.0, "async/overlap": rollout.overlap,
                                 "async/generation_s": rollout.generation_s, "async/wait_s": rollout.waited_s}


@pytest.mark.parametrize("work", [0.0, GENERATION_S / 2])
def test_overlap_is_the_hidden_fraction(work):
    """No training work: the update waits for all of the generation (overlap ≈ 0, as without async); half of it: ≈ ½."""
    with RolloutPrefetch() as prefetch:
        prefetch.submit(4, slow_generation, None)
        training_work(work)
        rollout = prefetch.result(5)
    expected = work / GENERATION_S
    assert rollout.overlap == pytest.approx(min(1.0, max(0.0, 1.0 - rollout.waited_s / rollout.generation_s)))
    assert abs(rollout.overlap - expected) < 0.15
    assert rollout.waited_s == pytest.approx(GENERATION_S - work, abs=0.06)


def test_staleness_counts_updates_and_refuses_beyond_the_bound():
    with RolloutPrefetch(max_staleness=1) as prefetch:
        prefetch.submit(3, slow_generation, "a", 0.05)
        assert prefetch.pending and prefetch.pending_version == 3
        with pytest.raises(RuntimeError, match="the rollout of weights v3 is still pending"):
            prefetch.submit(4, slow_generation, "b", 0.0)
        with pytest.raises(StaleRolloutError, match=r"weights v3, 2 updates before this update \(v5\), above "
                                                    r"max_staleness=1") as refused:
            prefetch.result(5)
        assert "\n" not in str(refused.value)
        assert not prefetch.pending  # the refused rollout was waited for and dropped: nothing in flight
        prefetch.submit(5, slow_generation, "c", 0.0)
        with pytest.raises(StaleRolloutError, match="newer than this update's v4"):
            prefetch.result(4)
    with RolloutPrefetch(max_staleness=2) as prefetch:
        prefetch.submit(3, slow_generation, "a", 0.0)
        assert prefetch.result(5).staleness == 2
        with pytest.raises(RuntimeError, match="no rollout was submitted"):
            prefetch.result(6)
    with pytest.raises(ValueError, match="max_staleness=0 must be >= 1"):
        RolloutPrefetch(max_staleness=0)


def failing_request():
    try:
        {}["choices"]
    except KeyError as cause:
        raise ConnectionError("server answered 500") from cause


def test_an_error_on_the_rollout_thread_reraises_on_the_training_thread():
    with RolloutPrefetch() as prefetch:
        prefetch.submit(2, failing_request)
        with pytest.raises(ConnectionError, match="server answered 500") as raised:
            prefetch.result(3)
        error = raised.value
        assert isinstance(error.__cause__, KeyError)  # the original exception, its cause kept
        assert "failing_request" in [frame.name for frame in traceback.extract_tb(error.__traceback__)]
        assert error.__notes__ == ["(raised on the rollout thread, in the generation request of weights v2)"]
        assert not prefetch.pending
        prefetch.submit(3, slow_generation, "next", 0.0)  # still usable
        assert prefetch.result(4).value == "next"
        prefetch.submit(4, failing_request)
        with pytest.raises(ConnectionError):
            prefetch.drain()


def test_drain_and_cancel_leave_nothing_running():
    prefetch = RolloutPrefetch()
    assert prefetch.drain() is None
    prefetch.submit(7, slow_generation, "old stage", 0.1)
    drained = prefetch.drain()  # a stage boundary: the caller discards the old stage's rollout
    assert (drained.value, drained.version, drained.staleness, prefetch.pending) == ("old stage", 7, 0, False)
    prefetch.submit(8, slow_generation, "x", 0.1)
    assert prefetch.drain(version=9).staleness == 1

    started, finished = threading.Event(), threading.Event()
    prefetch.submit(9, lambda: (started.set(), time.sleep(0.2), finished.set()))
    assert started.wait(5)
    prefetch.cancel()  # shutdown: waits for the running request, discards it, ends the thread
    assert finished.is_set() and not prefetch.pending and rollout_threads() == []
    prefetch.cancel()  # idempotent
    with pytest.raises(RuntimeError, match="after cancel"):
        prefetch.submit(10, slow_generation, "y", 0.0)

    with RolloutPrefetch() as failing:
        failing.submit(0, failing_request)
    assert rollout_threads() == []  # exit cancels; the error of a discarded rollout is not raised at shutdown


# --- OR1Config -----------------------------------------------------------------------------------------------------
SERVER = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:1")


def test_async_generation_defaults_off_and_is_validated(tmp_path):
    args = OR1Config(**tiny_training_args(tmp_path))
    assert (args.async_generation, args.max_staleness) == (False, 1)
    assert not any("async" in d for d in args.magic_departures())
    with pytest.warns(UserWarning, match=r"not the paper's objective: async_generation=True \(MAGIC: on-policy"):
        args = OR1Config(**tiny_training_args(tmp_path, async_generation=True, max_staleness=2, **SERVER))
    assert args.max_staleness == 2
    for overrides, message in [
        (dict(async_generation=True), r"use_vllm=False, vllm_mode='colocate': set use_vllm=True, vllm_mode='server'"),
        (dict(SERVER, async_generation=True, vllm_mode="colocate"), "set use_vllm=True, vllm_mode='server'"),
        (dict(SERVER, async_generation=True, rollout_correction="off"),
         "rollout_correction='off' turns off: set rollout_correction='geo_mask_token_truncate'"),
        (dict(SERVER, async_generation=True, rollout_correction="trl", vllm_importance_sampling_correction=False),
         "rollout_correction='trl' turns off"),
        (dict(max_staleness=0), "max_staleness=0 must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            OR1Config(**tiny_training_args(tmp_path, **overrides))


# --- Against the real vLLM CPU server ------------------------------------------------------------------------------
def test_a_server_request_runs_off_the_training_thread_and_equals_a_synchronous_one(vllm_server):
    """The request (TRL's `VLLMClient.generate` over HTTP, seeded sampling) runs on the rollout thread while the training thread
    runs torch work; what it returns equals the same request (same seed) made synchronously."""
    from or1_trl.weight_sync import http_vllm_client

    client = http_vllm_client(base_url=vllm_server.url, api_key=vllm_server.api_key)
    prompts = [[5, 9, 13, 17], [6, 7, 11]]
    params = dict(n=2, temperature=1.0, max_tokens=24, logprobs=0, generation_kwargs={"seed": 0, "ignore_eos": True})
    request = {}

    def generate():
        request["thread"], request["start"] = threading.current_thread().name, time.perf_counter()
        output = client.generate(prompts, **params)
        request["end"] = time.perf_counter()
        return output

    torch_steps = []
    with RolloutPrefetch() as prefetch:
        prefetch.submit(0, generate)
        deadline = time.perf_counter() + 120
        while "end" not in request and time.perf_counter() < deadline:
            training_work(0.01)
            torch_steps.append(time.perf_counter())
        rollout = prefetch.result(1)
    during = [t for t in torch_steps if request["start"] < t < request["end"]]
    assert request["thread"].startswith(THREAD_NAME) and len(during) >= 3, (request, len(torch_steps))
    assert rollout.overlap > 0.9 and rollout.generation_s >= request["end"] - request["start"] - 1e-3

    synchronous = client.generate(prompts, **params)
    assert rollout.value["completion_ids"] == synchronous["completion_ids"]
    assert [len(c) for c in synchronous["completion_ids"]] == [24] * 4
    torch.testing.assert_close(torch.tensor(rollout.value["logprobs"]), torch.tensor(synchronous["logprobs"]))


# --- The objective on a one-update-stale batch ---------------------------------------------------------------------
def _stale_batch(trainer, lr):
    """A rollout generated by weights v_{k-1} (its own log-probs μ: here the trainer's, on CPU the same numbers as the
    fp32 server's), then update k (one SGD step), then the batch as TRL scores it for update k+1: `old_per_token_logps`
    = π_{v_k} recomputed by the trainer, `importance_sampling_ratio` = the rollout correction π_{v_k} / μ."""
    from .test_loss_reference import _fixed_batch, _reference_logps_entropy

    model = trainer.model
    batch = _fixed_batch(model, len(trainer.processing_class))
    ids, mask = (batch["prompt_ids"], batch["completion_ids"]), batch["completion_mask"]
    with torch.no_grad():
        generator, _ = _reference_logps_entropy(model, *ids, mask)  # μ: the policy that generated the sample
    logps, _ = _reference_logps_entropy(model, *ids, mask)  # update k, on some loss
    (-(logps * mask * batch["advantages"][:, None]).sum() / mask.sum()).backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    model.zero_grad()
    with torch.no_grad():
        old, _ = _reference_logps_entropy(model, *ids, mask)  # π_{v_k}: where update k+1 starts
    args = trainer.args
    batch.update(old_per_token_logps=old, sampling_per_token_logps=generator, importance_sampling_ratio=correction_weights(
        old, generator, mask.float(), args.rollout_correction, args.rollout_correction_cap))
    return batch, generator


def _clipped(logps, old, batch, eps_low=0.2, eps_high=0.2, weight=1.0):
    """Plain PPO-clip of eq. 3.1 over the kept tokens, ratio to `old`, each token weighted by `weight`."""
    from or1_trl.rejection import WEIGHT_KEY

    kept = batch["completion_mask"].float() * batch[WEIGHT_KEY][:, None]
    A, ratio = batch["advantages"][:, None], torch.exp(logps - old)
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
    return -(kept * weight * surrogate).sum() / kept.sum()


def _loss_and_grads(trainer, loss_fn):
    trainer.model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("lr", [3e-3, 3e-2])
def test_stale_batch_loss_is_ppo_clip_against_the_generating_policy(vllm_server, tmp_path, lr):
    """Update k+1 on a rollout of v_{k-1}: TRL's loss (ratio to π_{v_k}) × the rollout correction (π_{v_k} / μ) has
    the value and gradient of PPO-clip whose π_old is the generating policy μ while update k moved no ratio π_{v_k}/μ
    out of [1−ε, 1+ε] (lr 3e-3); beyond (lr 3e-2), it is the decoupled objective w · clip(π_θ/π_{v_k}): the trust region
    stays around the weights the update starts from, the correction weight carries the staleness."""
    from .test_loss_reference import _reference_logps_entropy
    from .test_vllm_server import tied_trainer

    # use_vllm=True (the server): TRL multiplies the rollout correction into the loss only then
    trainer = tied_trainer(vllm_server, tmp_path, rejection_sampling="mask", use_adaptive_entropy=False)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch, generator = _stale_batch(trainer, lr)
    mask = batch["completion_mask"].bool()
    drift = (batch["old_per_token_logps"] - generator)[mask].abs().max().item()  # |log π_{v_k}/μ|
    ids = (batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"])

    ours = _loss_and_grads(trainer, lambda: trainer._compute_loss(trainer.model, batch))
    decoupled = _loss_and_grads(trainer, lambda: _clipped(
        _reference_logps_entropy(trainer.model, *ids)[0], batch["old_per_token_logps"], batch,
        weight=batch["importance_sampling_ratio"]))
    generating = _loss_and_grads(trainer, lambda: _clipped(_reference_logps_entropy(trainer.model, *ids)[0], generator,
                                                            batch))
    _assert_same(ours, decoupled)
    if lr < 1e-2:
        assert 1e-3 < drift < 0.18  # a real update, every ratio inside [0.8, 1.2]
        _assert_same(ours, generating)
    else:
        assert drift > 0.3  # ratios leave the clip range: PPO against μ would clip them, the decoupled form does not
        assert abs(ours[0] - generating[0]) > 1e-3
