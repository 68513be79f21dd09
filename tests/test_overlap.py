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
