"""The server's API-key middleware (`or1_trl/generation/vllm_ext/or1_vllm_auth.py`), without a server: a web page is
refused on every route whatever the key, this machine's clients pass the site check and then need the key."""

import asyncio
import json
import os
from unittest import mock

import pytest

from or1_trl.generation.vllm_ext.or1_vllm_auth import API_KEY_ENV, APIKeyMiddleware, site_problem
from ...helpers import KEY


PORT = 8123


def answer(headers, path="/collective_rpc", server=("127.0.0.1", PORT), kind="http", key=True):
    """What `APIKeyMiddleware` (key `KEY`) answers a request: `(status, error)`, status 200 where it reached vLLM."""
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    headers = [(n.encode(), v.encode()) for n, v in headers] + [(b"authorization", f"Bearer {KEY}".encode())] * key
    scope = {"type": kind, "path": path, "headers": headers, "server": server}
    with mock.patch.dict(os.environ, {API_KEY_ENV: KEY}):
        asyncio.run(APIKeyMiddleware(app)(scope, None, send))
    if reached:
        return 200, None
    if kind == "websocket":
        return sent[0]["code"], None
    return sent[0]["status"], json.loads(sent[1]["body"])["error"]


LOCAL = ("host", f"127.0.0.1:{PORT}")


#: Requests a web page can make a browser send to 127.0.0.1 (directly, or with its DNS name rebound to 127.0.0.1).
FROM_A_PAGE = [
    [("host", f"evil.example.com:{PORT}"), ("origin", "http://evil.example.com"), ("content-type", "text/plain")],
    [("host", "evil.example.com")],  # DNS rebinding to port 80's server
    [("host", f"127.0.0.1.evil.example.com:{PORT}")],
    [LOCAL, ("origin", "http://evil.example.com")],  # a simple request straight to 127.0.0.1
    [LOCAL, ("origin", "null")],  # a sandboxed frame, a file:// page
    [LOCAL, ("origin", f"http://localhost:{PORT + 1}")],  # another local server's page
    [LOCAL, ("origin", f"https://127.0.0.1:{PORT}")],
    [LOCAL, ("origin", f"http://127.0.0.1:{PORT}"), ("origin", "http://evil.example.com")],
    [LOCAL, ("sec-fetch-site", "cross-site")],  # a GET sends no Origin; the browser still says where it comes from
    [LOCAL, ("sec-fetch-site", "same-site")],
    [("host", f"127.0.0.1:{PORT + 1}")],
    [("host", f"evil@127.0.0.1:{PORT}")],
    [LOCAL, LOCAL],  # two Host headers
    [],  # none
]


@pytest.mark.parametrize("headers", FROM_A_PAGE, ids=lambda h: ";".join(f"{n}={v}" for n, v in h) or "no-host")
def test_a_web_page_is_refused_on_every_route_whatever_the_key(headers):
    """The attack of the issue (`Content-Type: text/plain`, `Host: evil.example.com`, `Origin:
    http://evil.example.com`, `POST /sleep?level=1`) and its variants: 403 before any route, with the key or
    without, `/health` included; a WebSocket is closed before its handshake."""
    for path in ("/sleep", "/collective_rpc", "/v1/completions", "/health"):
        for key in (True, False):
            status, error = answer(headers, path=path, key=key)
            assert status == 403 and error.startswith("Forbidden: ") and "\n" not in error, (path, key, error)
    assert answer(headers, kind="websocket") == (1008, None)


def test_this_machines_clients_pass_the_site_check_and_then_need_the_key():
    port = f":{PORT}"
    for host in ("127.0.0.1", "localhost", "LocalHost", "[::1]", "0.0.0.0", "127.0.0.2"):
        for extra in ([], [("origin", f"http://{host}{port}")], [("sec-fetch-site", "same-origin")],
                      [("sec-fetch-site", "none")]):
            headers = [("host", host + port), *extra]
            assert answer(headers) == (200, None), headers
            assert answer(headers, key=False)[0] == 401, headers
            assert answer(headers, path="/health", key=False) == (200, None), headers
    assert answer([("host", "127.0.0.1")], server=("127.0.0.1", 80)) == (200, None)  # port 80: Host has none


def test_a_connection_over_another_interface_is_left_to_the_key():
    """`--host 0.0.0.0` (the user's own key required): a request that arrives over another interface may name the
    node any way, so only the key decides; one that arrives over loopback is still checked."""
    page = [("host", f"evil.example.com:{PORT}"), ("origin", "http://evil.example.com")]
    assert answer(page, server=("10.1.2.3", PORT)) == (200, None)
    assert answer(page, server=("10.1.2.3", PORT), key=False)[0] == 401
    assert answer(page, server=("127.0.0.1", PORT))[0] == 403
    assert site_problem({"type": "http", "headers": [], "server": None}) is None  # a Unix socket
