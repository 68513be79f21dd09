"""The sandbox's driver: runs inside the sandbox as ``__main__`` (this file, bound in read-only), one per sample.

Standard library only: nothing of ``or1_trl`` exists inside the sandbox (a test checks that this file imports
nothing else). Trusted code, but it shares the sandbox with the untrusted children, so nothing it holds (test
inputs, the driver's own state) is secret except the nonce; the judged formats' tests (asserts, function call)
never pass through it.

Protocol (see :mod:`or1_trl.rewards.sandbox`): stdin carries the nonce (``NONCE_LEN`` hex characters), then the
job as one frame (its length in 16 hex digits, then its JSON), then, for a judged job (kind ``judge``: the asserts
and function-call formats) only, a second frame with the tests, which the judge reads (the driver reads no byte of
it); stdout carries nonce-tagged JSON records, one per line: ``ready`` (or ``compile_error``), one per test after
its child has exited (or ``sandbox_error`` if the driver itself could not run it), then ``done``.

A stdin/stdout test runs in a child forked here (:func:`_run_one_test`); a judged job's processes — the judge, its
entry processes, the program process — are forked here too (:func:`_judge_sample`), what they run is ``judge.py``,
beside this file.

The strict encoder of data also lives here: the program process and the judge run it (``judge.py`` imports
:func:`encode_data`/:func:`decode_data`, which add the import prefix's objects, and :func:`decode_value`); the
trainer imports :func:`encode_value` from this file to encode a function-call test's arguments and expected value
(the only import between the two sides, and only that way).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time

NONCE_LEN = 64  # hex characters (256 bits)
_STDERR_KEEP = 4096


# ---------------------------------------------------------------------------------------------------------
# Strict data encoding (used by the program process to serialise return values, by the judge to decode them).
# Only exact builtin types are accepted: a subclass of int/list/... or any custom object (e.g. one whose
# __eq__ always returns True) is refused, so the judge's comparison is a comparison of plain data.
# ---------------------------------------------------------------------------------------------------------


class UnserialisableValue(TypeError):
    pass


def encode_value(value, _depth: int = 0, _type=type, rich: bool = False):
    """Encode a value made of exact builtin types into JSON-compatible tagged data.

    ``type`` is bound at definition time, so a program that replaces ``builtins.type`` cannot change it.
    ``rich=True`` (the asserts format) also takes what test code commonly consumes from a function: iterators
    (generators, ``map``, ``zip``...; materialised, at most ``_ITER_MAX`` items), ``range``, dict views and the
    ``collections`` containers ``Counter``, ``OrderedDict``, ``defaultdict`` (its factory is dropped) and ``deque``.
    Whatever the program sends is only data: the judge's :func:`decode_value` rebuilds pristine objects from it.
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
    d = _depth + 1
    if t is list:
        return [encode_value(v, d, rich=rich) for v in value]
    if t is tuple:
        return {"t": [encode_value(v, d, rich=rich) for v in value]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [encode_value(v, d, rich=rich) for v in value]}
    if t is dict:
        return {"d": [[encode_value(k, d, rich=rich), encode_value(v, d, rich=rich)] for k, v in value.items()]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if rich:
        return _encode_rich(value, t, d, rich)
    raise UnserialisableValue(f"refusing to serialise a value of type {t.__module__}.{t.__qualname__}")


_ITER_MAX = 1 << 20


def _encode_rich(value, t, d, rich):
    import collections
    import itertools

    if isinstance(rich, ObjectTable) and rich.accepts(t):
        return {"ref": rich.add(value)}
    if t is range:
        return {"r": [value.start, value.stop, value.step]}
    if t in (collections.Counter, collections.OrderedDict, collections.defaultdict):
        tag = {collections.Counter: "C", collections.OrderedDict: "O", collections.defaultdict: "dd"}[t]
        return {tag: [[encode_value(k, d, rich=rich), encode_value(v, d, rich=rich)] for k, v in dict.items(value)]}
    if t is collections.deque:
        return {"dq": [encode_value(v, d, rich=rich) for v in value]}
    views = {type({}.keys()): "dk", type({}.values()): "dv", type({}.items()): "di"}
    if t in views:
        return {views[t]: [encode_value(v, d, rich=rich) for v in value]}
    if t.__module__ == "builtins" and hasattr(t, "__next__") and hasattr(t, "__iter__"):  # generator, map, zip...
        items = list(itertools.islice(value, _ITER_MAX + 1))
        if len(items) > _ITER_MAX:
            raise UnserialisableValue("iterator longer than %d items" % _ITER_MAX)
        return {"it": [encode_value(v, d, rich=rich) for v in items]}
    raise UnserialisableValue(f"refusing to serialise a value of type {t.__module__}.{t.__qualname__}")


def decode_value(data, rich: bool = False):
    """Inverse of :func:`encode_value` (run in the judge, on data only): exact builtin (or, with ``rich``, the
    judge's own ``collections``) types, never an object of the program's."""
    if data is None or isinstance(data, (bool, str, int)):
        return data
    if isinstance(data, list):
        return [decode_value(v, rich) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, v), = data.items()
        if tag == "i":
            return int(v, 16)
        if tag == "f":
            return float.fromhex(v)
        if tag == "t":
            return tuple(decode_value(x, rich) for x in v)
        if tag == "s":
            return {decode_value(x, rich) for x in v}
        if tag == "fs":
            return frozenset(decode_value(x, rich) for x in v)
        if tag == "d":
            return {decode_value(k, rich): decode_value(x, rich) for k, x in v}
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "c":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if rich:
            return _decode_rich(tag, v, rich)
    raise ValueError(f"malformed encoded value: {str(data)[:80]}")


def _decode_rich(tag, v, rich):
    import collections

    if tag == "ref" and isinstance(rich, _Refs) and type(v) is int and 0 <= v < len(rich.objs):
        return rich.objs[v]

    if tag == "r" and len(v) == 3 and all(type(x) is int for x in v):
        return range(*v)
    if tag in ("C", "O", "dd"):
        pairs = [(decode_value(k, rich), decode_value(x, rich)) for k, x in v]
        return {"C": lambda p: collections.Counter(dict(p)), "O": collections.OrderedDict,
                "dd": lambda p: collections.defaultdict(None, p)}[tag](pairs)
    if tag in ("dk", "di"):
        items = [decode_value(x, rich) for x in v]
        return dict.fromkeys(items).keys() if tag == "dk" else dict(items).items()
    if tag == "dv":
        return {i: decode_value(x, rich) for i, x in enumerate(v)}.values()
    if tag == "dq":
        return collections.deque(decode_value(x, rich) for x in v)
    if tag == "it":
        return iter([decode_value(x, rich) for x in v])
    raise ValueError(f"malformed encoded value: {str({tag: v})[:80]}")


class ObjectTable:
    """While encoding: the objects of the test's data classes (the import prefix's ``ListNode``, ``TreeNode``...)
    met so far. They are sent by reference, their fields flat (:func:`encode_data`): a long linked list or a cycle
    needs no recursion."""

    def __init__(self, accepts):
        self.accepts, self.nodes, self.index = accepts, [], {}

    def add(self, obj) -> int:
        k = self.index.get(id(obj))
        if k is None:
            k = self.index[id(obj)] = len(self.nodes)
            self.nodes.append(obj)
        return k


class _Refs:
    def __init__(self, objs):
        self.objs = objs


def encode_data(value, accepts=None):
    """``encode_value(value, rich=True)``; objects of a class ``accepts(type)`` takes become ``{"g": [value, nodes]}``,
    ``nodes`` being ``[class name, [[field, value], ...]]`` of each object (their instance dict)."""
    if accepts is None:
        return encode_value(value, rich=True)
    table = ObjectTable(accepts)
    top = encode_value(value, rich=table)
    nodes, k = [], 0
    while k < len(table.nodes):
        obj = table.nodes[k]
        fields = object.__getattribute__(obj, "__dict__")
        nodes.append([str(type(obj).__name__), [[str(n), encode_value(v, rich=table)] for n, v in dict.items(fields)]])
        k += 1
    return {"g": [top, nodes]} if nodes else top


def decode_data(data, classes=None):
    """Inverse of :func:`encode_data`: objects are made of ``classes[name]`` (the receiver's own class: in the
    judge, the prefix's pristine one) with their decoded fields as instance attributes, nothing else."""
    if classes and isinstance(data, dict) and len(data) == 1 and "g" in data:
        top, nodes = data["g"]
        objs = [object.__new__(classes[name]) for name, _ in nodes]
        refs = _Refs(objs)
        for obj, (_, fields) in zip(objs, nodes):
            attrs = object.__getattribute__(obj, "__dict__")
            for name, v in fields:
                if type(name) is not str or not name.isidentifier() or name.startswith("__"):
                    raise ValueError(f"malformed field name {str(name)[:40]!r}")
                attrs[name] = decode_value(v, refs)
        return decode_value(top, refs)
    return decode_value(data, True)


# ---------------------------------------------------------------------------------------------------------
# The driver process
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


def _read_frame(fd: int) -> dict:
    """One frame of stdin: its length (16 hex digits), then that many bytes of JSON. Reads no byte beyond it: what
    follows (a judged job's tests) is left for the judge."""
    size = bytearray(16)
    _read_exact_into(fd, size)
    data = bytearray(int(size.decode("ascii"), 16))
    _read_exact_into(fd, data)
    return json.loads(data.decode("utf-8"))


def _read_job(nonce: bytearray) -> dict:
    """The nonce (into ``nonce``, before any untrusted code exists), then the job, from stdin."""
    _read_exact_into(0, nonce)
    return _read_frame(0)


def _limit_driver(job):
    """The limits of the whole sandbox, set in the driver (its children inherit them)."""
    import resource

    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_FSIZE, int(job["max_file"]))
    _set_limit(resource.RLIMIT_NOFILE, 256)
    if job.get("max_processes"):
        _set_limit(resource.RLIMIT_NPROC, int(job["max_processes"]))
    os.umask(0o077)


def _emit(nonce: bytearray, record: dict):
    data = json.dumps(record).encode()
    parts = [nonce, b" ", data, b"\n"]
    total = sum(len(p) for p in parts)
    written = os.writev(1, parts)
    if written != total:  # partial write on a pipe: finish it (rare, large records)
        rest = (bytes(nonce) + b" " + data + b"\n")[written:]
        while rest:
            rest = rest[os.write(1, rest):]


def main():
    _make_non_dumpable()
    nonce = bytearray(NONCE_LEN)
    job = _read_job(nonce)
    _limit_driver(job)
    try:
        code_obj = compile(job["code"], "<solution>", "exec")
    except BaseException as e:  # noqa: BLE001 - e.g. `return` outside a function: the program's fault
        _emit(nonce, {"compile_error": type(e).__name__})
        os._exit(0)
    # The sandbox and the driver work. Until this record, no untrusted code has run: a failure before it is the
    # sandbox's (status "sandbox_error"), a failure after it may be the program's.
    _emit(nonce, {"ready": len(job["tests"])})
    if job["kind"] == "judge":
        try:
            _judge_sample(job, nonce, code_obj)
        except (OSError, MemoryError) as e:  # the driver's own fork / socket failed: it could not judge the sample
            _emit(nonce, {"sandbox_error": f"{type(e).__name__}: {e}"})
            os._exit(0)
        _emit(nonce, {"done": len(job["tests"])})
        os._exit(0)
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
# One test, driver side: fork the child, collect its output within the limits, end it, make the record
# ---------------------------------------------------------------------------------------------------------


def _run_one_test(job, test, nonce, code_obj):
    in_fd, (out_r, out_w), (err_r, err_w) = _test_fds(test)
    start = time.monotonic()
    pid = _start_child(job, nonce, code_obj, (in_fd, out_w, err_w, None), (err_r, out_r))
    for fd in (in_fd, out_w, err_w):
        os.close(fd)
    status, exited, wstatus, bufs, pidfd = _watch_child(pid, start + float(job["timeout"]), out_r, err_r,
                                                        int(job["max_output"]))
    elapsed = time.monotonic() - start
    wstatus = _end_child(job, pid, exited, wstatus)
    for fd in (out_r, err_r, pidfd):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    return _test_record("stdio", status, wstatus, elapsed, bytes(bufs[out_r]), bytes(bufs[err_r]))


def _test_fds(test):
    """A stdin/stdout test's fds: the child's stdin (a memfd holding the test's input), and the pipes
    ``(read, write)`` of its stdout and stderr."""
    stdin_data = test.get("stdin", "").encode()
    in_fd = os.memfd_create("stdin", 0) if hasattr(os, "memfd_create") else os.open(os.devnull, os.O_RDONLY)
    if stdin_data:
        view = memoryview(stdin_data)
        while view:
            view = view[os.write(in_fd, view):]
        os.lseek(in_fd, 0, os.SEEK_SET)
    return in_fd, os.pipe(), os.pipe()


def _start_child(job, nonce, code_obj, child_fds, parent_fds) -> int:
    """Fork the test's child (which closes the parent's ends ``parent_fds`` and runs the test); its pid."""
    pid = _fork(job)
    if pid == 0:  # child
        try:
            for fd in parent_fds:
                if fd is not None:
                    os.close(fd)
        except BaseException:
            os._exit(121)
        _child_run(job, nonce, child_fds, code_obj)
        os._exit(121)  # not reached
    return pid


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


def _child_poller(fds, pid):
    """A poller on ``fds`` and on the child's pidfd (where the kernel has one: it wakes the poll at exit)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    return poller, pidfd


def _watch_child(pid, deadline, main_fd, err_r, max_out):
    """Read the child's output until it exits, overflows ``max_out`` or passes ``deadline``.

    Returns ``(status, exited, wstatus, bufs, pidfd)``: ``status`` is None (it exited), "output_limit" or "timeout".
    """
    bufs = {main_fd: bytearray(), err_r: bytearray()}
    open_fds = {main_fd, err_r}
    for fd in open_fds:
        os.set_blocking(fd, False)
    poller, pidfd = _child_poller(open_fds, pid)
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
    return status, exited, wstatus, bufs, pidfd


def _end_child(job, pid, exited, wstatus):
    """Kill the child if it still runs (and reap it), then whatever it left; the child's wait status."""
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
    return wstatus


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


def _test_record(kind, status, wstatus, elapsed, main: bytes, err: bytes) -> dict:
    """The test's record: its status (from how the child ended), time, stderr and stdout or result data."""
    rec = {"time": round(elapsed, 4), "stderr": err.decode("utf-8", "replace")}
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
        if kind == "stdio":
            rec["stdout"] = main.decode("utf-8", "replace")
        else:
            try:
                rec.update(json.loads(main.decode("utf-8")))
            except Exception:
                rec["status"] = "no_result"
    return rec


# ---------------------------------------------------------------------------------------------------------
# One test, in the forked child: the untrusted program runs here
# ---------------------------------------------------------------------------------------------------------


def _child_run(job, nonce: bytearray, fds, code_obj):
    """In the forked child: drop the nonce, wire the fds, apply limits, run one stdin/stdout test. Never returns."""
    for i in range(len(nonce)):
        nonce[i] = 0
    del nonce
    try:
        _child_setup(job, fds)
        real_stdout, real_os_exit = sys.stdout, os._exit
    except BaseException:
        os._exit(121)
    _child_stdio(code_obj, real_stdout, real_os_exit)


def _child_setup(job, fds):
    """New session, fds 0-3 (stdin, stdout, stderr, result channel) and nothing else, per-test limits, sys.std*."""
    import resource

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


def _child_stdio(code_obj, real_stdout, real_os_exit):
    """A stdio test: run the program as ``__main__``; its exit status is the program's. Never returns."""
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


# ---------------------------------------------------------------------------------------------------------
# The judged formats: a judge process and a program process (the semantics are judge.py's, the processes here)
# ---------------------------------------------------------------------------------------------------------


def _load_judge():
    """judge.py, beside this file (bound beside it in the sandbox), loaded before any untrusted code exists."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "judge.py")
    spec = importlib.util.spec_from_file_location("or1_judge", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _judge_sample(job, nonce, code_obj):
    """Judge a sample of the asserts or function-call format (see judge.py). Fork the judge first: it alone reads the
    tests, from stdin, after which the driver lets go of stdin, so no process it forks later (a program process) can
    hold them; the judge writes one record per entry itself. Start a program process at once, and a fresh one each
    time the judge asks (after an entry that left the last one mid-call), passing the judge its end of their socket.
    Returns when the judge has ended; records the judge did not write (it died) are written here as errors."""
    import _socket

    own_pidns = job.get("own_pidns")
    job = dict(job, own_pidns=False)  # a fork retry must not kill(-1): the judge and the driver share the sandbox
    judge = _load_judge()
    for module in judge.prefix_modules(job.get("prefix") or ""):  # shared by both processes' prefixes (faster)
        try:
            __import__(module)
        except BaseException:  # noqa: BLE001 - the prefix's own run reports it
            pass
    ctl, ctl_judge = _socketpair(_socket.SOCK_SEQPACKET)
    judge_pid = _fork(job)
    if judge_pid == 0:
        try:
            os.close(ctl)
            _judge_process(job, nonce, ctl_judge, judge)
        finally:
            os._exit(1)
    os.close(ctl_judge)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the tests are the judge's alone
    os.close(devnull)
    recorded, program = 0, None
    try:
        message = b"P"  # the first program process starts now, beside the judge's own start
        while message:
            if message == b"P":
                _end_program(program)
                program, fd = _start_program(job, nonce, code_obj, judge)
                _send_fd(ctl, fd)
                os.close(fd)
            elif message[:1] == b"R":
                recorded = int(message[1:]) + 1
            try:
                message = os.read(ctl, 64)
            except OSError:
                message = b""  # the judge has ended
    finally:
        _end_program(program)
        try:
            os.kill(judge_pid, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(judge_pid, 0)
        _kill_stragglers(dict(job, own_pidns=own_pidns), None)
    for i in range(recorded, len(job["tests"])):
        _emit(nonce, {"i": i, "status": "error", "time": 0.0, "verdict": "error",
                      "stderr": "the judge process ended before this test was judged (killed by the program?)"})


def _socketpair(kind) -> tuple[int, int]:
    """A connected pair of Unix sockets, as plain fds (``_socket``: ``socket`` costs its enums at import)."""
    import _socket

    a, b = _socket.socketpair(_socket.AF_UNIX, kind)
    return a.detach(), b.detach()


def _send_fd(sock: int, fd: int):
    """Pass ``fd`` over the Unix socket ``sock`` (SCM_RIGHTS), with the message ``P``."""
    import _socket
    import array

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, sock)
    try:
        s.sendmsg([b"P"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        s.detach()


def _receive_fd(sock: int) -> int | None:
    """The fd passed by :func:`_send_fd` on ``sock`` (None if the peer is gone)."""
    import _socket
    import array

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, sock)
    try:
        _, ancillary, _, _ = s.recvmsg(16, _socket.CMSG_SPACE(array.array("i").itemsize))
    finally:
        s.detach()
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            return array.array("i", data[: array.array("i").itemsize])[0]
    return None


def _start_program(job, nonce, code_obj, judge):
    """Fork a program process (judge.serve_program on fd 3, its end of a new socket); ``(pid, the judge's end)``."""
    import _socket

    ours, theirs = _socketpair(_socket.SOCK_STREAM)
    pid = _fork(job)
    if pid == 0:
        try:
            for i in range(len(nonce)):
                nonce[i] = 0
            os.close(ours)
            devnull = os.open(os.devnull, os.O_RDWR)
            # alive for the whole sample: its CPU limit covers every entry
            _child_setup(dict(job, timeout=float(job["timeout"]) * len(job["tests"])),
                         (devnull, devnull, devnull, theirs))
        except BaseException:  # noqa: BLE001
            os._exit(121)
        judge.serve_program(code_obj, job.get("prefix") or "", 3)
        os._exit(1)  # not reached
    os.close(theirs)
    return pid, ours


def _end_program(pid):
    if pid is None:
        return
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.waitpid(pid, 0)


def _judge_process(job, nonce, ctl, judge):
    """The judge (forked before any untrusted code ran; the driver's nonce is its to write records with): read the
    tests, plan, then judge each entry in an entry process of its own, killed at the entry's deadline. Its program
    process's socket comes from the driver on ``ctl`` (the first unasked; another after ``P``, when an entry left
    the last one mid-call); it tells the driver each record it wrote (``R<i>``). Never returns."""
    import resource

    _make_non_dumpable()
    secret = _read_frame(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _set_limit(resource.RLIMIT_AS, int(job["memory_bytes"]))
    plan = judge.Plan(job["code"], job.get("prefix") or "", secret["entries"])
    del secret
    fd = None
    for k in range(len(job["tests"])):
        if fd is None:
            if k:  # the driver started the first one unasked
                os.write(ctl, b"P")
            fd = _receive_fd(ctl)
            if fd is None:
                os._exit(1)
        rec = _judge_one_entry(job, plan, k, fd, ctl, judge)
        clean = rec.pop("clean", False) is True and rec["status"] == "ok"
        rec["i"] = k
        _emit(nonce, rec)
        os.write(ctl, b"R%d" % k)
        if not clean:  # the program process may be mid-call (or gone): the next entry gets a fresh one
            os.close(fd)
            fd = None
    os._exit(0)


def _judge_one_entry(job, plan, k, fd, ctl, judge) -> dict:
    """Entry ``k`` in an entry process (a fork of the judge: the plan, pristine) talking to the program process on
    ``fd``; its record: the status of the process (``timeout`` at the entry's deadline) and its verdict."""
    import resource

    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    start = time.monotonic()
    pid = _fork(job)
    if pid == 0:
        try:
            os.close(ctl)
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            _place_fds([devnull, devnull, err_w, res_w, fd])
            _set_limit(resource.RLIMIT_CPU, int(float(job["timeout"])) + 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
            verdict = judge.judge_entry(plan, k, 4, int(job["max_output"]))
            view = memoryview(json.dumps(verdict).encode())
            while view:
                view = view[os.write(3, view):]
        except BaseException:  # noqa: BLE001 - the record says "error", with the traceback
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    for own in (err_w, res_w):
        os.close(own)
    status, exited, wstatus, bufs, pidfd = _watch_child(pid, start + float(job["timeout"]), res_r, err_r,
                                                        int(job["max_output"]))
    elapsed = time.monotonic() - start
    wstatus = _end_child(dict(job, own_pidns=False), pid, exited, wstatus)  # never kill(-1) here: the driver lives
    for own in (res_r, err_r, pidfd):
        if own is not None:
            os.close(own)
    rec = _test_record("judge", status, wstatus, elapsed, bytes(bufs[res_r]), bytes(bufs[err_r]))
    if "why" in rec:
        rec["stderr"] = str(rec.pop("why"))
    return rec


def _place_fds(fds):
    """Make ``fds[i]`` this process's fd ``i`` and close every other (sources first moved above any target)."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(fds), 1 << 16)


def _finish_threads():
    """Mimic interpreter shutdown for stdio programs: join non-daemon threads, run atexit handlers."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    import atexit

    atexit._run_exitfuncs()


if __name__ == "__main__":
    main()
