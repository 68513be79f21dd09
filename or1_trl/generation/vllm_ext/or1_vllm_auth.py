"""Who may talk to a vLLM server started by `or1-trl serve`: `--middleware or1_vllm_auth.APIKeyMiddleware`, on every
server, whatever its address.

vLLM's own `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`
(`vllm/entrypoints/serve/middleware/authenticate.py`). A server in dev mode (`VLLM_SERVER_DEV_MODE=1`, which both
weight-sync backends need) also serves `/collective_rpc` (any worker method), `/sleep`, `/reset_prefix_cache`,
`/server_info`, the weight-transfer routes and more, all unauthenticated. This middleware answers 401 to any request
that lacks `Authorization: Bearer <key>`, whatever the route; `/health` stays open (readiness checks, TRL's wait
loop). The key is the user's (`or1-trl serve --api-key`, `$OR1_VLLM_API_KEY`) or, when they give none, one
`or1-trl serve` made for this server (`or1_private.key_file`: a file only this user can read, where the trainer's
client finds it): a server never runs without one.

**A request that arrives over loopback must come from this machine's own clients, not a web page**
(`site_problem`, checked first, on every route, `/health` included). A browser lets any page send a "simple"
request (`Content-Type: text/plain`) to `127.0.0.1`, and a page whose DNS name is rebound to `127.0.0.1` talks to
the server as if it were its own site. So on a connection whose local address is a loopback one, the `Host` must be
a name of this machine (`localhost`, a loopback address, or `0.0.0.0`/`::`, which TRL's client uses by default) with
the server's port, any `Origin` must be that too (`http://127.0.0.1:<port>`), and `Sec-Fetch-Site` (which browsers
send) must say same-origin; otherwise 403. On a connection that arrives over another interface (`--host 0.0.0.0`,
which needs the user's own key) the server has as many names as the node, so neither is checked there: the key,
which no page can read, does the refusing.

`LoRAPathGuard`, which `or1-trl serve --enable-lora` adds, confines the one route that loads files from a path the
caller names outside our worker extension: `POST /v1/load_lora_adapter` is refused (403) unless its `lora_path` is a
folder under one of the server's sync roots (`or1_vllm_worker.under_sync_root`) that the server may load from
(`or1_private.loadable_problem`); vLLM would otherwise load an adapter from any local path, or download one from the
Hub. It runs inside the key check (`or1-trl serve` gives it first: vLLM adds each `--middleware` around the ones
before), so a caller without the key learns nothing of the sync roots or of which paths exist.

The key comes from the server's environment (`OR1_VLLM_API_KEY`, set by `or1-trl serve`), never from its command
line (visible to every user of the machine in `ps`). Plain ASGI, standard library only: the module loads in the
server's environment, where or1_trl is not installed (`or1-trl serve` puts this directory on its `PYTHONPATH`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import stat
from urllib.parse import urlsplit

API_KEY_ENV = "OR1_VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
#: `Sec-Fetch-Site` values of a request a browser did not send on another site's behalf.
SAME_SITE = (b"same-origin", b"none")


def local_host(name: str | None) -> bool:
    """Whether the host name `name` (of a URL or a `Host` header) names this machine: `localhost`, a loopback
    address, or an unspecified one (`0.0.0.0`, `::`), which connects to this machine."""
    if not name:
        return False
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _loopback_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _names_this_server(value: bytes, port: int, origin: bool = False) -> bool:
    """Whether `value`, a `Host` header (`host[:port]`) or an `Origin` (`http://host[:port]`), names this machine
    with `port` and nothing else."""
    try:
        text = value.decode("ascii")
        parts = urlsplit(text if origin else f"//{text}")
        given = parts.port or 80
    except (UnicodeDecodeError, ValueError):
        return False
    if parts.path or parts.query or parts.fragment or parts.username is not None:
        return False
    return (parts.scheme == "http" if origin else True) and local_host(parts.hostname) and given == port


def site_problem(scope) -> str | None:
    """Why a request (an ASGI `scope`) that arrived over loopback may not be served, or `None`: its `Host` is not
    this machine with the server's port (a page whose DNS name was rebound to 127.0.0.1), an `Origin` is another
    site's, or the browser says it comes from another site (`Sec-Fetch-Site`). A connection that arrived over
    another interface (or a Unix socket) is not checked (module docstring)."""
    server = scope.get("server")
    if not server or not _loopback_address(str(server[0])):
        return None
    port = int(server[1])
    headers = scope.get("headers", [])
    hosts = [value for name, value in headers if name.lower() == b"host"]
    if len(hosts) != 1 or not _names_this_server(hosts[0], port):
        shown = hosts[0][:100].decode("ascii", "replace") if hosts else "none"
        return f"the Host header ({shown!r}) does not name this machine's loopback address with port {port}"
    for name, value in headers:
        if name.lower() == b"origin" and not _names_this_server(value, port, origin=True):
            return f"requests from another site (Origin {value[:100].decode('ascii', 'replace')!r}) are refused"
        if name.lower() == b"sec-fetch-site" and value.lower() not in SAME_SITE:
            return f"requests from another site (Sec-Fetch-Site: {value[:30].decode('ascii', 'replace')}) are refused"
    return None


async def _refuse(send, scope, status: int, error: str, headers=()) -> None:
    """Answer `status` with `{"error": error}` (HTTP), or close a WebSocket before its handshake (a rejection)."""
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1008})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


class APIKeyMiddleware:
    """Refuses a request over loopback from another site (`site_problem`, 403), then every HTTP and WebSocket
    request without the server's key (401), except those to `OPEN_PATHS`."""

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
        problem = site_problem(scope)
        if problem:
            return await _refuse(send, scope, 403, f"Forbidden: {problem}.")
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self.authorized(scope.get("headers", [])):
            return await self.app(scope, receive, send)
        await _refuse(send, scope, 401, "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'.",
                      headers=[(b"www-authenticate", b"Bearer")])


#: Largest request body `LoRAPathGuard` reads (a load request is a few hundred bytes).
MAX_BODY = 2**20


def lora_path_problem(body: bytes) -> str | None:
    """Why a `/v1/load_lora_adapter` request body may not be served, or `None`: its `lora_path` must be a folder
    under a sync root (symlinks resolved) that the server may load from (`or1_private.loadable_problem`), its
    adapter files regular files of the server's user."""
    if __package__:  # imported as part of or1_trl
        from .or1_vllm_worker import loadable_folder
    else:  # in the server, where this directory is on the PYTHONPATH
        from or1_vllm_worker import loadable_folder

    try:
        path = json.loads(body).get("lora_path")
    except (ValueError, AttributeError):
        return "the body is not a JSON object"
    if not isinstance(path, str) or not path:
        return "no lora_path"
    try:
        real = loadable_folder(path)
    except (ValueError, OSError) as error:
        return str(error)
    for name in os.listdir(real):
        file = os.lstat(os.path.join(real, name))
        if stat.S_ISLNK(file.st_mode):
            return f"{path}/{name} is a link"
        if file.st_uid != os.geteuid():
            return f"{path}/{name} belongs to uid {file.st_uid}, not to the server's user"
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
            return await _refuse(send, scope, 403, f"Forbidden: {problem}")
        replay = iter(messages)

        async def receive_again():
            return next(replay, None) or await receive()

        return await self.app(scope, receive_again, send)
