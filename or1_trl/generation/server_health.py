"""A vLLM server that fails, restarts or goes away mid-run: retries, a check before each rollout, resyncs, a clean
stop.

What the trainer does when its server (vLLM server mode) misbehaves:

1. **Transient failures are retried** by the HTTP session itself: `mount_retries` mounts an `HTTPAdapter` with
   urllib3's `Retry` (`retry_policy`, `RETRY`: connection errors, a dropped response and 500/502/503/504, GET and POST
   — a generation re-requested is fine — with exponential backoff, ~7 s in all) on the client's session, in both
   weight-sync modes. It is the one policy of every session to the server: the trainer's client, the disk sync's and
   sampling's (`sampling.ServerBackend`, through `keyed_session`), each only setting its documented parameters.
2. **Before each rollout** (`ServerWatch.ready`, before every generation request, refill rounds included) the server
   must answer `/health`; if it does not, the trainer waits for it, up to `vllm_server_timeout` seconds (TRL's
   `GRPOConfig` field). With the disk sync, the server's worker extension then reports the version of the weights it
   holds (`or1_weights_version`: 0 after a (re)start, set by each push); a server whose version is not the trainer's
   gets the current weights again (the latest pushed directory) before it generates anything, counted in
   `vllm/resyncs`. A request that fails all its retries (the server died while generating) is asked again the same
   way, after the wait and the resync.
3. **A server down longer than `vllm_server_timeout`** raises `ServerDownError` on every rank at once (the main
   process talks to the server; `OR1VLLMGeneration` shares its outcome), and the trainer's
   `checkpoint.stop_with_checkpoint` ends training with a complete checkpoint of the last finished step (its verified
   marker) and one line saying how to resume.

In nccl mode (TRL's weight transfer) a restarted server has lost its NCCL group with the trainer and cannot be
re-synced over HTTP: once retries are exhausted the run stops the same way (checkpoint, one line) instead of
generating from weights it cannot check.
"""

from __future__ import annotations

import threading
import time

from transformers.utils import logging

from .serve import authorize, wait_for_health

logger = logging.get_logger(__name__)

RESYNCS_METRIC = "vllm/resyncs"
#: The disk sync's last push (`disk_sync.DiskWeightSync.last_breakdown`): `vllm/sync_seconds/<phase>` per phase
#: (gather, write, load, cache_reset) and `vllm/sync_bytes`, logged at the step that pushed.
SYNC_SECONDS_METRIC = "vllm/sync_seconds"
SYNC_BYTES_METRIC = "vllm/sync_bytes"
#: urllib3 `Retry` settings of every HTTP session to the server (`retry_policy`): backoff 0.5·2^(n-1) s (0, 1, 2,
#: 4 s: ~7 s in all), then, for the trainer, `ServerWatch` takes over (waits for `/health` up to
#: `vllm_server_timeout`).
RETRY = dict(total=4, connect=4, read=2, status=3, status_forcelist=(500, 502, 503, 504), backoff_factor=0.5,
             backoff_max=8, allowed_methods=("GET", "POST"))
POOL_SIZE = 64  # TRL's generation concurrency: connections are reused across its parallel requests


class ServerDownError(RuntimeError):
    """The vLLM server stayed unreachable longer than `vllm_server_timeout` (or, in nccl mode, past the retries)."""


class WeightsRefusedError(ServerDownError):
    """The vLLM server did not load a pushed version, asked twice (`disk_sync.RELOAD_TRIES`): a folder outside its
    sync roots, incomplete, or a load that failed. It keeps its previous weights; the run stops the way it does for
    a server that is down (`checkpoint.stop_with_checkpoint`: a complete checkpoint, one line)."""


def retry_policy(retries: int | None = None, resend: bool = True, last_answer: bool = False):
    """The retry policy of every HTTP session to a vLLM server, as urllib3's `Retry`: connection errors, a dropped
    response and 500/502/503/504 answers are retried, GET and POST alike (a generation asked again is fine), with
    backoff 0.5·2^(n-1) s (capped at 8 s); a 4xx answer is never retried (a 401: `serve.authorize`'s
    `ServerKeyError`). The defaults are the trainer's (`RETRY`); sampling (`sampling.ServerBackend`), with no watch
    behind it and requests that may generate for an hour, sets all three parameters.

    Args:
        retries: the retries of one request (connection errors and 5xx answers alike); `None`: `RETRY`'s (4 in all,
            of which at most 3 for 5xx answers and 2 for a dropped response), after which `ServerWatch` takes over.
        resend: send a request again when its answer was lost (a dropped connection, a read timeout); `False` where a
            lost answer may have cost an hour of generation (sampling's `timeout`).
        last_answer: past the retries, return the last 5xx answer (the caller raises with its text) instead of raising
            `requests.exceptions.RetryError` (a transient failure: `ServerWatch.call` waits and asks again).
    """
    from urllib3.util.retry import Retry

    settings = dict(RETRY) if retries is None else {**RETRY, "total": retries, "connect": retries, "read": retries,
                                                    "status": retries}
    if not resend:
        settings["read"] = 0
    return Retry(**settings, raise_on_status=not last_answer)


def mount_retries(session, retries: int | None = None, resend: bool = True, last_answer: bool = False):
    """Mount an `HTTPAdapter` retrying with `retry_policy(retries, resend, last_answer)` and pooling `POOL_SIZE`
    connections on `session` (a `requests.Session`), for http and https. Returns `session`."""
    from requests.adapters import HTTPAdapter

    adapter = HTTPAdapter(max_retries=retry_policy(retries, resend, last_answer), pool_maxsize=POOL_SIZE)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def keyed_session(api_key: str | None, **policy):
    """A new `requests.Session` to a vLLM server: it sends `api_key` (`serve.authorize`: a 401 is a
    `ServerKeyError`) and retries with `retry_policy(**policy)` (`mount_retries`). The disk sync's and sampling's
    sessions; the trainer's client gets the same on the session TRL's `VLLMClient` creates (`OR1VLLMClient`)."""
    import requests

    return mount_retries(authorize(requests.Session(), api_key), **policy)


def _transient():
    import requests

    return (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
            requests.exceptions.RetryError)


class ServerWatch:
    """Keeps one server fit to generate: healthy, and holding the trainer's weights.

    Args:
        base_url: the server.
        timeout: seconds the server may stay unreachable before `ServerDownError` (`vllm_server_timeout`).
        weights: the disk sync (`disk_sync.DiskWeightSync`: `version`, `server_versions()`, `reload()`), or `None`
            (nccl mode: a server that was unreachable cannot be re-synced, so it stops the run).

    Attributes:
        resyncs (`int`): times the server was found with other weights than the trainer's and given them again.
    """

    def __init__(self, base_url: str, timeout: float, weights=None):
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.weights = weights
        self.resyncs = 0
        # With `async_generation` the rollout thread's request and the training thread's refill may both find a
        # restarted server: one resyncs it, the other then finds it current.
        self._lock = threading.Lock()

    def healthy(self) -> bool:
        import requests

        try:
            return requests.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def down_error(self, reason: str) -> ServerDownError:
        return ServerDownError(f"The vLLM server at {self.base_url} {reason} (vllm_server_timeout={self.timeout:g} s)")

    def ready(self, down_since: float | None = None, check_weights: bool = True) -> None:
        """Return once the server answers `/health` (waiting up to `timeout` s from `down_since`, default now) and
        holds the trainer's weights (resyncing it otherwise); `ServerDownError` if it does not come back in time."""
        with self._lock:
            self._ready(down_since, check_weights)

    def _ready(self, down_since: float | None, check_weights: bool) -> None:
        if not self.healthy():
            if self.weights is None:
                raise self.down_error("stopped answering and its weights cannot be checked in nccl mode")
            down_since = down_since or time.monotonic()
            logger.warning(f"The vLLM server at {self.base_url} is not answering: waiting up to "
                           f"{self.timeout:g} s (vllm_server_timeout) for it to come back.")
            try:
                wait_for_health(self.base_url, timeout=max(0.0, self.timeout - (time.monotonic() - down_since)))
            except TimeoutError:
                raise self.down_error(f"did not answer for {time.monotonic() - down_since:.0f} s") from None
        if check_weights and self.weights is not None and self.weights.version:
            held = self.weights.server_versions()
            if held != {self.weights.version}:
                logger.warning(f"The vLLM server at {self.base_url} holds weights version {sorted(held)} (0: it "
                               f"restarted), the trainer's are {self.weights.version}: sending them again.")
                self.weights.reload()
                self.resyncs += 1

    def call(self, request, *args, check_weights: bool = True, **kwargs):
        """`request(*args, **kwargs)` once the server is `ready`; asked again, after waiting and resyncing, when it
        fails past the session's retries, until the server has been unreachable for `timeout` s."""
        down_since = None
        while True:
            try:
                self.ready(down_since, check_weights)
                return request(*args, **kwargs)
            except _transient() as error:
                if self.weights is None:
                    raise self.down_error(f"failed a request past its retries ({type(error).__name__})") from None
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > self.timeout:
                    raise self.down_error(f"did not answer for {time.monotonic() - down_since:.0f} s") from None
                logger.warning(f"vLLM server at {self.base_url}: {type(error).__name__} past the retries; waiting for "
                               "it, then asking again.")
