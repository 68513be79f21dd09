"""API-key check on every route of a vLLM server but `/health`: `--middleware or1_vllm_auth.APIKeyMiddleware`.

vLLM's own `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`
(`vllm/entrypoints/serve/middleware/authenticate.py`). A server in dev mode (`VLLM_SERVER_DEV_MODE=1`, which both
weight-sync backends need) also serves `/collective_rpc` (any worker method), `/sleep`, `/reset_prefix_cache`,
`/server_info`, the weight-transfer routes and more, all unauthenticated. This middleware, which `or1-trl serve`
adds whenever it has a key, answers 401 to any request that lacks `Authorization: Bearer <key>`, whatever the
route; `/health` stays open (readiness checks, TRL's wait loop).

`LoRAPathGuard`, which `or1-trl serve --enable-lora` adds (with or without a key), confines the one route that
loads files from a path the caller names outside our worker extension: `POST /v1/load_lora_adapter` is refused (403)
unless its `lora_path` is a folder under one of the server's sync roots (`or1_vllm_worker.under_sync_root`); vLLM
would otherwise load an adapter from any local path, or download one from the Hub.

The key comes from the server's environment (`OR1_VLLM_API_KEY`, set by `or1-trl serve`), never from its command
line (visible to every user of the machine in `ps`). Plain ASGI, standard library only: the module loads in the
server's environment, where or1_trl is not installed (`or1-trl serve` puts this directory on its `PYTHONPATH`).
"""

from __future__ import annotations

import hmac
import json
import os

API_KEY_ENV = "OR1_VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Refuses every HTTP and WebSocket request without the server's key, except those to `OPEN_PATHS`."""

    def __init__(self, app):
        key = os.environ.get(API_KEY_ENV, "")
        if not key:  # never serve open because a variable went missing
            raise RuntimeError(f"{API_KEY_ENV} is unset or empty: set it to the key clients must send.")
        self.app = app
        self._key = key.encode()

    def authorized(self, headers) -> bool:
        """Whether ASGI `headers` (a list of `(name, value)` byte pairs) carry `Authorization: Bearer <key>`."""
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan events
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self.authorized(scope.get("headers", [])):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # closing before the handshake is accepted rejects it
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'."})
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
        })
        await send({"type": "http.response.body", "body": body.encode()})


#: Largest request body `LoRAPathGuard` reads (a load request is a few hundred bytes).
MAX_BODY = 2**20


def lora_path_problem(body: bytes) -> str | None:
    """Why a `/v1/load_lora_adapter` request body may not be served, or `None`: its `lora_path` must be a folder
    under a sync root (symlinks resolved), its adapter files regular files."""
    from or1_vllm_worker import under_sync_root

    try:
        path = json.loads(body).get("lora_path")
    except (ValueError, AttributeError):
        return "the body is not a JSON object"
    if not isinstance(path, str) or not path:
        return "no lora_path"
    try:
        real = under_sync_root(path)
    except ValueError as error:
        return str(error)
    if not os.path.isdir(real):
        return f"{path} is not a folder"
    for name in os.listdir(real):
        if os.path.islink(os.path.join(real, name)):
            return f"{path}/{name} is a link"
    return None


class LoRAPathGuard:
    """Answers 403 to `POST /v1/load_lora_adapter` unless `lora_path_problem` finds nothing; passes every other
    request through untouched (the body it read is handed on unchanged)."""

    PATH = "/v1/load_lora_adapter"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path != self.PATH:
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body") or len(body) > MAX_BODY:
                break
        problem = "the body is too large" if len(body) > MAX_BODY else lora_path_problem(body)
        if problem:
            error = json.dumps({"error": f"Forbidden: {problem}"}).encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json")]})
            return await send({"type": "http.response.body", "body": error})
        replay = iter(messages)

        async def receive_again():
            return next(replay, None) or await receive()

        return await self.app(scope, receive_again, send)
