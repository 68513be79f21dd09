"""The math reward's worker pool: the rule of `rewards/math.py` runs in worker processes, each sample under a hard
deadline.

Math-Verify bounds parsing and comparison with ``signal.alarm`` (``parse(..., parsing_timeout=5)``, ``verify(...,
timeout_seconds=5)``, whole seconds), which only works in the main thread of a process, and which cannot interrupt
a C routine that never returns to the interpreter. So the rule runs in a pool of worker processes:

* each worker is a fresh interpreter started with ``subprocess`` (fork+exec): no ``fork`` of a process that
  holds torch/CUDA/NCCL threads, no re-import of the user's ``__main__`` (as ``spawn``/``forkserver`` do), and
  the rule's file (``rewards/math.py``, with this one beside it) is loaded on its own, without importing the rest
  of ``or1_trl`` (``_BOOTSTRAP``: a bare package ``_or1_trl_rewards`` holds them; the rule's module is also
  ``sys.modules["_or1_trl_math_reward_worker"]``); the worker then runs the rule file's ``_worker_main``, which is
  `serve` with the rule;
* each sample runs in a worker's main thread, so Math-Verify's own timeouts work;
* the parent gives every sample a hard wall-clock deadline (``timeout``): a worker that exceeds it is killed
  (SIGKILL) and replaced, and only that sample scores 0 (``STATUS_KILLED``); a worker that dies while scoring a
  sample (segfault, ``os._exit``, OOM killer) is replaced and only that sample scores 0 (``STATUS_CRASHED``); the
  other samples of the batch keep their scores;
* workers are reused across calls, shut down at exit (``weakref.finalize``, i.e. atexit) and always reaped;
  a worker whose parent disappears exits by itself.

Samples are pipelined (a worker has the next one waiting in its socket), and samples with the same gold go to the
same worker (the samples of one prompt share its caches). Standard library only: the rule's file imports this one,
and worker processes import nothing else of the package.
"""

from __future__ import annotations

import logging
import os
import pickle
import pickletools
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

logger = logging.getLogger(__name__.rpartition(".")[0] + ".math")  # the pool's warnings are the math reward's

#: Statuses the pool gives a sample in place of the rule's (see ``rewards/math.py``'s ``STATUS_*``).
STATUS_ERROR = "error"  # the scoring function raised
STATUS_KILLED = "killed_timeout"  # the parent's hard deadline expired; the worker was killed
STATUS_CRASHED = "worker_crashed"  # the worker process died while scoring the sample


# --------------------------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------------------------

# Run by ``python -c`` in each worker: load the rule's file (``sys.argv[1]``) as a stand-alone module, also named
# ``_or1_trl_math_reward_worker``, of a bare package ``_or1_trl_rewards`` over its folder (its relative import of
# this module resolves there; no ``or1_trl`` package import, no ``__main__`` re-import) and serve requests on the
# inherited socket.
_BOOTSTRAP = (
    "import importlib.util, os, sys, types\n"
    "package = types.ModuleType('_or1_trl_rewards')\n"
    "package.__path__ = [os.path.dirname(sys.argv[1])]\n"
    "sys.modules[package.__name__] = package\n"
    "name = package.__name__ + '.' + os.path.splitext(os.path.basename(sys.argv[1]))[0]\n"
    "spec = importlib.util.spec_from_file_location(name, sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = sys.modules['_or1_trl_math_reward_worker'] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._worker_main(int(sys.argv[2]))\n"
)


def _watch_parent(parent_pid: int) -> None:
    # Exit if the parent disappears while this worker is busy (an idle worker sees EOF on its socket).
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def serve(fd: int, default_score_fn: Callable, setup: Callable) -> None:
    """A worker's life: take the pool's ``init`` message, ready the rule (``setup(parsing_timeout, verify_timeout,
    warmup, fast_paths)``), say ``("ready", pid)``, then serve ``("task", id, text, golds)`` requests until EOF or
    ``None``, answering ``("result", id, score, status)``. The score function is the pickled ``score_fn`` of the
    ``init`` message, or ``default_score_fn``; a sample it fails on scores 0 (``STATUS_ERROR``)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us on the way out
    conn = Connection(fd)
    try:
        _, sys_path, fn_bytes, parsing_timeout, verify_timeout, memory_limit_mb, warmup, fast_paths = conn.recv()
        sys.path[:] = sys_path
        if memory_limit_mb:
            import resource

            limit = int(memory_limit_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        score_fn = pickle.loads(fn_bytes) if fn_bytes is not None else default_score_fn
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
        setup(parsing_timeout, verify_timeout, warmup, fast_paths)
        conn.send(("ready", os.getpid()))
    except (EOFError, OSError):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, task_id, text, golds = msg
        try:
            score, status = score_fn(text, golds, parsing_timeout, verify_timeout)
            result = ("result", task_id, float(score), str(status))
        except BaseException:  # noqa: BLE001 - a sample's failure is that sample's 0, never the worker's
            result = ("result", task_id, 0.0, STATUS_ERROR)
        try:
            conn.send(result)
        except (EOFError, OSError):
            return


# --------------------------------------------------------------------------------------------------------------
# Worker pool (parent side)
# --------------------------------------------------------------------------------------------------------------


class WorkerStartupError(RuntimeError):
    """A worker process failed to start (broken environment): raised instead of silently scoring 0."""


def pickle_score_fn(score_fn: Callable) -> bytes:
    """``score_fn`` as the bytes the workers unpickle; raises ``TypeError`` if a worker could not load it.

    Pickle stores a function (or a class) by reference, ``module.qualname``, and each worker is a fresh interpreter
    that imports that module: a lambda or a nested function cannot be pickled at all, and anything defined in the
    parent's ``__main__`` (the script being run, a notebook, ``python -c``) is not importable in a worker, whose
    ``__main__`` is its own bootstrap. Checked in the parent, before any worker starts."""
    what = getattr(score_fn, "__qualname__", None) or type(score_fn).__qualname__
    try:
        data = pickle.dumps(score_fn, protocol=2)  # protocol 2 names every global in a GLOBAL opcode, see below
    except Exception as exc:
        raise TypeError(
            f"MathReward(score_fn={what!r}): score_fn cannot be pickled ({exc}); the worker processes receive it "
            "by reference, so it must be a module-level function (or picklable object) defined in an importable "
            "module, e.g. `from my_rewards import my_score`, not a lambda or a nested function. "
            "MathReward(num_workers=0) runs it in-process instead."
        ) from exc
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL" and arg.split(" ", 1)[0] == "__main__":
            name = arg.split(" ", 1)[1]
            raise TypeError(
                f"MathReward(score_fn={what!r}): {name!r} is defined in __main__ (the script or notebook being "
                "run). The worker processes are fresh interpreters that import score_fn by reference and cannot "
                "import your __main__: define it in an importable module (e.g. my_rewards.py next to your script, "
                "then `from my_rewards import ...`), or use MathReward(num_workers=0) to score in-process."
            )
    return data


class _Worker:
    """Parent-side handle of one worker process. Tasks are pipelined: ``inflight`` holds the ids sent to the
    worker, in order; the first is being scored (since ``since``), the others wait in the socket, so that the
    worker never waits for a busy parent to hand it the next sample."""

    __slots__ = ("proc", "conn", "ready", "inflight", "queued_bytes", "key", "since")

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc = proc
        self.conn = conn
        self.ready = False  # set by the worker's "ready" message
        self.inflight: deque[tuple[int, int]] = deque()  # (task id, message size)
        self.queued_bytes = 0  # bytes of the waiting (not yet started) messages
        self.key: tuple[str, ...] | None = None  # golds of the last task: see WorkerPool.run
        self.since = time.monotonic()  # start of the current task (or of the process)

    @property
    def task(self) -> int | None:
        """The task being scored, if any."""
        return self.inflight[0][0] if self.inflight else None

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)  # reap: no zombies
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered in 10 s
            logger.error("math_reward: worker %d did not exit after SIGKILL", self.proc.pid)


def _shutdown_workers(workers: list[_Worker], owner_pid: int, grace: float = 2.0) -> None:
    """Ask idle workers to exit, then kill whatever is left; always reap. In a forked copy of the owner
    process, only drop our copies of the sockets: the workers belong to the owner."""
    if os.getpid() != owner_pid:
        for w in workers:
            try:
                w.conn.close()
            except OSError:
                pass
        workers.clear()
        return
    for w in workers:
        try:
            if not w.inflight:
                w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    for w in workers:
        if not w.inflight:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        w.kill()
    workers.clear()


class WorkerPool:
    """Worker processes that score samples, with a per-sample hard deadline and crash recovery. Each runs
    ``worker_file``'s ``_worker_main`` (``rewards/math.py``)."""

    #: At most this many samples wait in a worker's socket behind the one being scored, and at most this many
    #: bytes: a busy worker does not read, and the parent must never block on a send (it enforces deadlines).
    PREFETCH = 2
    PREFETCH_BYTES = 128 * 1024

    def __init__(
        self,
        worker_file: str,
        size: int,
        score_fn: Callable | None,
        parsing_timeout: int | None,
        verify_timeout: int | None,
        memory_limit_mb: int | None,
        startup_timeout: float,
        warmup: bool = True,
        fast_paths: bool = True,
    ):
        self.pid = os.getpid()
        self._worker_file = os.path.abspath(worker_file)  # the rule's file, whose `_worker_main` each worker runs
        self._init = (
            "init",
            list(sys.path),
            pickle_score_fn(score_fn) if score_fn is not None else None,
            parsing_timeout,
            verify_timeout,
            memory_limit_mb,
            warmup,
            fast_paths,
        )
        self._score_fn_module = (
            None if score_fn is None else getattr(score_fn, "__module__", type(score_fn).__module__))
        self._startup_timeout = startup_timeout
        self._env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _shutdown_workers, self.workers, self.pid)
        for _ in range(size):
            self.workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        if not sys.executable:
            raise WorkerStartupError("math_reward: sys.executable is unknown; use MathReward(num_workers=0)")
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, self._worker_file, str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=self._env,
            )
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        worker = _Worker(proc, conn)
        try:
            conn.send(self._init)
        except OSError:
            pass  # the worker already died: noticed as a startup failure below
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = self._spawn()
        self.restarts += 1

    def close(self) -> None:
        self._finalizer()

    def run(self, tasks: list[tuple[str, tuple[str, ...]]], timeout: float) -> list[tuple[float, str]]:
        """Score ``tasks`` (answer text, golds); returns ``(score, status)`` per task, in order."""
        results: list[tuple[float, str] | None] = [None] * len(tasks)
        # Tasks are queued per gold answer, and a worker keeps taking samples of the gold it worked on last:
        # the samples of one prompt (TRL puts a group's samples next to each other) then share the worker's
        # caches (the parsed gold; Math-Verify's cache of recently parsed LaTeX, which the group's repeated
        # final answers hit).
        queues: dict[tuple[str, ...], deque[int]] = {}
        for i, (_, golds) in enumerate(tasks):
            queues.setdefault(golds, deque()).append(i)
        messages: dict[int, bytes] = {}
        remaining = len(tasks)

        def requeue(worker: _Worker, keep_first: bool) -> None:
            # Give back the samples that were waiting behind the failed one: not their fault.
            for i, _ in reversed(list(worker.inflight)[1:] if keep_first else list(worker.inflight)):
                queues.setdefault(tasks[i][1], deque()).appendleft(i)
            worker.inflight.clear()

        while remaining:
            # Dispatch: fill each ready worker's pipeline.
            for w in list(self.workers):
                while w.ready and queues and len(w.inflight) <= self.PREFETCH:
                    key = self._pick_queue(w, queues)
                    i = queues[key][0]
                    msg = messages.get(i)
                    if msg is None:
                        msg = messages[i] = pickle.dumps(("task", i, tasks[i][0], tasks[i][1]), protocol=5)
                    if w.inflight and w.queued_bytes + len(msg) > self.PREFETCH_BYTES:
                        break  # too big to wait in the socket: send it when the worker is idle
                    queues[key].popleft()
                    if not queues[key]:
                        del queues[key]
                    try:
                        w.conn.send_bytes(msg)
                    except OSError:  # died (e.g. killed from outside) with nothing of ours running
                        queues.setdefault(key, deque()).appendleft(i)
                        if w.inflight:
                            break  # its death is noticed below, where the running sample gets its 0
                        self._replace(w)
                        break
                    if not w.inflight:
                        w.since = time.monotonic()
                    else:
                        w.queued_bytes += len(msg)
                    w.inflight.append((i, len(msg)))
                    w.key = key
            # Wait for a result, a death, or the nearest deadline.
            waiting = [w for w in self.workers if w.inflight or not w.ready]
            now = time.monotonic()
            nearest = min(w.since + (timeout if w.ready else self._startup_timeout) for w in waiting)
            by_conn = {w.conn: w for w in waiting}
            for conn in wait(list(by_conn), timeout=max(0.0, nearest - now)):
                w = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:  # the worker died
                    code = w.proc.wait()
                    if not w.ready:
                        self._startup_failed(w, f"exited with code {code}")
                    if w.inflight:
                        i = w.task
                        logger.warning(
                            "math_reward: worker %d died (exit code %s) while scoring sample %d; it scores 0",
                            w.proc.pid, code, i,
                        )
                        results[i] = (0.0, STATUS_CRASHED)
                        remaining -= 1
                        requeue(w, keep_first=True)
                    self._replace(w)
                elif msg[0] == "ready":
                    w.ready, w.since = True, time.monotonic()
                else:
                    _, i, score, status = msg
                    if w.inflight and w.inflight[0][0] == i:
                        w.inflight.popleft()
                        if w.inflight:  # the next one starts now
                            w.queued_bytes -= w.inflight[0][1]
                            w.since = time.monotonic()
                    if results[i] is None:
                        results[i] = (score, status)
                        remaining -= 1
            # Enforce deadlines.
            now = time.monotonic()
            for w in list(self.workers):
                if w.inflight and now - w.since > timeout:
                    i = w.task
                    logger.warning(
                        "math_reward: sample %d exceeded the %.1f s deadline; worker %d killed, sample scores 0",
                        i, timeout, w.proc.pid,
                    )
                    results[i] = (0.0, STATUS_KILLED)
                    remaining -= 1
                    requeue(w, keep_first=True)
                    self._replace(w)
                elif not w.ready and now - w.since > self._startup_timeout:
                    self._startup_failed(w, f"not ready after {self._startup_timeout:.0f} s")
        return results  # type: ignore[return-value]

    def _pick_queue(self, worker: _Worker, queues: dict) -> tuple[str, ...]:
        if worker.key in queues:
            return worker.key
        others = {w.key for w in self.workers if w is not worker}
        for key in queues:  # the first group nobody is working on ...
            if key not in others:
                return key
        return next(iter(queues))  # ... else help with one

    def _startup_failed(self, worker: _Worker, why: str) -> None:
        worker.kill()
        needs = "math-verify"
        if self._score_fn_module is not None:
            needs += f" and the module of score_fn ({self._score_fn_module!r}, with everything it imports)"
        raise WorkerStartupError(
            f"math_reward: a worker process failed to start ({why}); see its traceback above. "
            f"Check that {needs} can be imported by a fresh `{sys.executable}` with this process's sys.path, "
            "or use MathReward(num_workers=0)."
        )

