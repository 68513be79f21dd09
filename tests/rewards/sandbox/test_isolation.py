"""Sandboxes isolated from each other: across processes (uid slots), in memory (a bound per sample, not per process),
and on the host's file system (a private /tmp), with infrastructure failures never scored as the program's 0.

Real processes, real sandboxes throughout. ``test_suite_as_unprivileged_user`` (tests/rewards/test_code.py) re-runs
this file as uid 65534, where each sandbox has a user namespace of its own and no cgroup can be made (the watchdog
path).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from or1_trl.rewards.code import CodeReward
from or1_trl.rewards.sandbox import Sandbox, SandboxUnavailable
from or1_trl.rewards.sandbox import memory as sandbox_memory
from or1_trl.rewards.sandbox.slots import slot_directory


REPO = str(pathlib.Path(os.path.abspath(__file__)).parents[3])  # the repository
IS_ROOT = os.geteuid() == 0
TIMEOUT = 4.0
LIMITS = dict(timeout_per_test=TIMEOUT, total_timeout=20.0, max_processes=16, num_workers=2, min_isolation="bwrap")


def block(code: str) -> str:
    return f"```python\n{code}\n```"


PLUS = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}
CORRECT = block("a, b = map(int, input().split())\nprint(a + b)")


@pytest.fixture(scope="module")
def reward(sandbox_missing):
    r = CodeReward(memory_mb=256, **LIMITS)
    try:
        _ = r.sandbox
    except SandboxUnavailable as e:
        sandbox_missing(str(e))
    return r


# ------------------------------------------------------------------------------------------------------
# 2. uid slots: unique per machine, released on exit, reclaimed after a crash
# ------------------------------------------------------------------------------------------------------


_PROCESS_HOLDER = textwrap.dedent("""
    import sys
    from or1_trl.rewards.code import CodeReward
    hold = '''```python
    import os, time
    n = 0
    while True:
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
    time.sleep(7)
    print(n)
    ```'''
    r = CodeReward(timeout_per_test=12, total_timeout=30, memory_mb=256, max_processes=16, num_workers=1)
    job = r.prepare(hold, {"inputs": [""], "outputs": [""]}).job
    _ = r.sandbox
    print("holding", flush=True)
    res = r.sandbox.run(job)
    print(res.status, res.records[0]["status"], res.records[0]["stdout"].strip(), flush=True)
""")


def test_a_process_holding_program_of_another_process_does_not_fail_correct_programs(reward):
    """Another trainer process (a rank, an eval worker) runs a program that takes every process its sandbox allows
    and keeps them; meanwhile this process's correct programs must all score 1 (they used to die with driver_died
    when both processes picked the same sandbox uid)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    other = subprocess.Popen([sys.executable, "-c", _PROCESS_HOLDER], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline() == "holding\n", other.stderr.read()
        time.sleep(1.5)  # its sandbox starts and forks up to its process limit, then holds them for 7 s
        logged = {}
        t0 = time.monotonic()
        out = reward([CORRECT] * 4, [PLUS] * 4, log_extra=logged.__setitem__, log_metric=logged.__setitem__)
        elapsed = time.monotonic() - t0
        holder = other.stdout.readline().split()
        assert other.wait(timeout=30) == 0, other.stderr.read()
    finally:
        other.kill()
        other.wait()
        other.stdout.close()
        other.stderr.close()
    assert elapsed < 5, f"did the correct programs run while the other process held its processes? {elapsed:.1f}s"
    assert out == [1.0] * 4, logged
    assert logged == {"code_reward_status": ["pass"] * 4, "code_reward/sandbox_error_frac": 0.0,
                      "code_reward/unjudgeable_frac": 0.0}
    # it ran to its end, having forked children up to its limit (16 tasks with its driver) and held them meanwhile
    assert holder[:2] == ["ok", "ok"] and 10 <= int(holder[2]) < 16, holder


# ------------------------------------------------------------------------------------------------------
# Infrastructure errors: retried once, counted, warned about; never the program's 0
# ------------------------------------------------------------------------------------------------------


def test_driver_fork_failure_is_a_sandbox_error_retried_once(reward):
    # The same sandbox as the reward's, then left one process (the driver itself): the driver cannot fork a test.
    broken = Sandbox(**reward._sandbox_kwargs)
    broken.max_processes = 1
    res = broken.run({"kind": "stdio", "code": "print(1)", "tests": [{"stdin": ""}]})
    assert res.status == "sandbox_error", res
    assert "driver failed: test 0: BlockingIOError" in res.error, res.error
    bad = CodeReward(**LIMITS)
    bad._sandbox = broken
    with pytest.warns(RuntimeWarning) as warned:
        result = bad.evaluate(CORRECT, PLUS)
    messages = [str(w.message) for w in warned]
    assert sum("retrying it once" in m for m in messages) == 1, messages
    assert sum("the retry failed too" in m and "sandbox_error_frac" in m for m in messages) == 1, messages
    assert result["status"] == "sandbox_error" and result["reward"] == 0.0
    tolerant = CodeReward(max_sandbox_error_frac=1.0, **LIMITS)
    tolerant._sandbox = broken
    logged = {}
    with pytest.warns(RuntimeWarning):
        assert tolerant([CORRECT, "no code"], [PLUS, PLUS], log_extra=logged.__setitem__,
                        log_metric=logged.__setitem__) == [0.0, 0.0]
    assert logged == {"code_reward_status": ["sandbox_error", "no_code"], "code_reward/sandbox_error_frac": 1.0,
                      "code_reward/unjudgeable_frac": 0.0}


# ------------------------------------------------------------------------------------------------------
# 3. Memory bounded per sample, not per process
# ------------------------------------------------------------------------------------------------------

FORKED_HOG = block("""import os, time
for _ in range(8):
    if os.fork() == 0:
        a = bytearray(200 << 20)  # 200 MB each, under the per-process limit; 1.6 GB together
        for j in range(0, len(a), 4096):
            a[j] = 1
        time.sleep(30)
        os._exit(0)
time.sleep(30)
print(3)
print(30)""")


@pytest.mark.parametrize("enforcement", ["auto", "watchdog"])
def test_eight_forked_children_stay_within_the_sample_bound(enforcement, reward):
    r = reward if enforcement == "auto" else CodeReward(memory_mb=256, memory_enforcement="watchdog", **LIMITS)
    sb = r.sandbox
    assert sb.memory_mb == 256
    expected_bound = sandbox_memory.cgroup_parent() if enforcement == "auto" else None
    assert sb.memory_bound == (f"cgroup v{expected_bound[0]}" if expected_bound else "watchdog")
    logged = {}
    t0 = time.monotonic()
    out = r([CORRECT, FORKED_HOG, CORRECT], [PLUS] * 3, log_extra=logged.__setitem__)
    elapsed = time.monotonic() - t0
    assert out == [1.0, 0.0, 1.0]  # and this process (the trainer) is alive
    assert logged["code_reward_status"] == ["pass", "memory_limit", "pass"]
    assert elapsed < TIMEOUT, f"{elapsed:.1f}s: the tree was not ended at its bound but at the timeout"
    res = sb.run(r.prepare(FORKED_HOG, PLUS).job)
    assert res.status == "memory_limit", (res, res.records)
    assert res.memory_exceeded
    if sb.memory_bound.startswith("cgroup"):
        assert 0 < res.peak_memory_mb <= 256  # the kernel's bound
    else:
        # sampled every 50 ms: the watchdog kills past 256 MB, a tree can overshoot by what it allocates meanwhile
        # (measured 290-336 MB here; the 8 children would reach 1600 MB unbounded)
        assert 256 < res.peak_memory_mb < 4 * 256, res.peak_memory_mb


# Shared memory under the watchdog: what a tree holds outside its processes' resident memory counts against its bound.
# Each program holds 960 MiB (60 x 16 MiB, every page written) under a 256 MB bound, then prints "held" and waits;
# unbounded it ends "ok" with "held\ndone".
_HOLD_END = "print('held', flush=True)\ntime.sleep(4)\nprint('done')\n"
SHARED_HOGS = {
    "memfd": """
held = []
for i in range(60):
    fd = os.memfd_create(f'm{i}')
    os.write(fd, bytes([1]) * (16 << 20))
    held.append(fd)
""",
    "tmpfs_file": """
for i in range(60):
    with open(f'/tmp/f{i}', 'wb') as f:
        f.write(bytes([1]) * (16 << 20))
""",
    # MAP_SHARED|MAP_ANONYMOUS regions the parent writes, each then held by a child that never touches it (the
    # child's resident memory shows none of it) while the parent unmaps it
    "shared_anonymous_held_by_children": """
for i in range(6):
    m = mmap.mmap(-1, 160 << 20)
    for j in range(160):
        m.write(bytes([1]) * (1 << 20))
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
    m.close()
""",
}


@pytest.fixture(scope="module")
def watchdog_sandbox(sandbox_missing):
    try:
        return Sandbox(memory_mb=256, max_processes=16, tmpfs_mb=1024, timeout_per_test=20, total_timeout=60,
                       memory_enforcement="watchdog", min_isolation="bwrap")
    except SandboxUnavailable as e:
        sandbox_missing(str(e))


def _stdio(sandbox: Sandbox, code: str):
    return sandbox.run({"kind": "stdio", "code": "import ctypes, mmap, os, time\n" + code, "tests": [{"stdin": ""}]})


@pytest.mark.parametrize("hog", sorted(SHARED_HOGS))
def test_shared_memory_counts_against_the_watchdog_bound(hog, watchdog_sandbox):
    if hog == "shared_anonymous_held_by_children" and not IS_ROOT:
        pytest.skip("sizing a mapping a process holds untouched needs /proc/<pid>/map_files (CAP_SYS_ADMIN); an "
                    "unprivileged watchdog counts the resident part, the rest is within RLIMIT_AS x max_processes")
    assert watchdog_sandbox.memory_bound == "watchdog"
    res = _stdio(watchdog_sandbox, SHARED_HOGS[hog] + _HOLD_END)
    assert res.status == "memory_limit", (res, res.records)
    assert res.memory_exceeded and res.peak_memory_mb > 256


def test_sysv_shared_memory_is_refused_under_the_watchdog(watchdog_sandbox):
    """A SysV segment outlives every mapping and descriptor of it, and an unprivileged watchdog cannot read the
    sandbox's segments: under the watchdog bwrap refuses shmget (seccomp)."""
    code = ("libc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.shmget(0, 16 << 20, 0o1600), ctypes.get_errno())\n")
    res = _stdio(watchdog_sandbox, code)
    assert res.done and res.records[0]["status"] == "ok", (res, res.records)
    assert res.records[0]["stdout"] == "-1 1\n"  # EPERM


def test_moderate_shared_memory_below_the_bound_passes(watchdog_sandbox):
    """An honest program using shared memory — two memfds, a shared region a child writes into and the parent reads
    back, a /tmp file, 80 MiB in all — passes under a 256 MB bound, and the watchdog saw that memory (each object
    once). The parent reads every page of the region: an unprivileged watchdog cannot size a mapping (no map_files)
    and counts the shared pages resident in the tree's processes instead (RssShmem); a region only the exited child
    had touched would count nowhere, and the lower bound would hold only by the interpreter's own resident memory
    (about 30 MiB in a fresh venv: it failed there)."""
    code = textwrap.dedent("""
        mib = bytes([1]) * (1 << 20)  # written a MiB at a time: no large temporary in resident memory
        fds = [os.memfd_create('data'), os.memfd_create('more')]  # 16 MiB each (RLIMIT_FSIZE bounds a file)
        for _ in range(16):
            for fd in fds:
                os.write(fd, mib)
        shared = mmap.mmap(-1, 32 << 20)
        pid = os.fork()
        if pid == 0:
            for _ in range(32):
                shared.write(mib)
            os._exit(0)
        os.waitpid(pid, 0)
        read_back = sum(shared[i] for i in range(0, len(shared), mmap.PAGESIZE))  # a byte of each page the child wrote
        with open('/tmp/scratch', 'wb') as f:
            for _ in range(16):
                f.write(mib)
        time.sleep(1)
        print(read_back, os.pread(fds[1], 1, 777)[0], os.path.getsize('/tmp/scratch') >> 20)
    """)
    res = _stdio(watchdog_sandbox, code)
    assert res.done and res.records[0]["status"] == "ok", (res, res.records)
    assert res.records[0]["stdout"] == f"{(32 << 20) // mmap.PAGESIZE} 1 16\n"
    assert 80 < res.peak_memory_mb < 256, res.peak_memory_mb


# ------------------------------------------------------------------------------------------------------
# 4. A private /tmp: what a sample writes there leaves nothing on the host
# ------------------------------------------------------------------------------------------------------


def test_private_tmp_leaves_nothing_on_the_host(reward):
    name = f"or1-private-{uuid.uuid4().hex}"
    code = block(f"""import os
os.makedirs('/tmp/{name}/sub')
with open('/tmp/{name}/sub/data', 'w') as f:
    f.write(input())
with open('/tmp/{name}/sub/data') as f:
    print(int(f.read()) * 2)""")
    tests = {"inputs": ["21"], "outputs": ["42"]}
    assert reward([code, code], [tests, tests]) == [1.0, 1.0]  # it could write and read back its /tmp
    for root in {"/tmp", tempfile.gettempdir(), "/var/tmp"}:
        assert not os.path.exists(os.path.join(root, name))
    # nor any sample cgroup or held uid slot once the samples are done
    parent = sandbox_memory.cgroup_parent()
    if parent is not None:
        assert not [n for n in os.listdir(parent[1]) if n.startswith(f"or1-{os.getpid()}-")]
    if IS_ROOT:
        directory = slot_directory()
        for lock in os.listdir(directory):
            with open(os.path.join(directory, lock)) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # held by another process running sandboxes (another test run)
                    assert f.read().strip() != str(os.getpid()), lock
