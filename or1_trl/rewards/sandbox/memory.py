"""A memory bound per sample — its whole process tree — not per process.

RLIMIT_AS bounds one process; a program that forks N children may use N times that. Two mechanisms bound the tree:

* **cgroup** (preferred): each sample runs in a memory cgroup of its own, limited to the sample's bound; the
  kernel's OOM killer ends a process of the sample past it (tmpfs pages the sample writes count too). cgroup v2 is
  used where the trainer may create a child cgroup with the ``memory`` controller (root on the host, or a delegated
  subtree whose ``cgroup.subtree_control`` enables memory), else cgroup v1's ``memory`` hierarchy where it is
  mounted and writable (root). The sandbox's first process moves itself into the cgroup before it starts anything
  (``echo 0 > cgroup.procs``), so every process of the sample is inside; the cgroup is emptied and removed afterwards.
  It needs the sandbox's first process to run with the trainer's credentials: bwrap and unshare (root or
  delegated), or the rlimit backend of an unprivileged trainer.
* **watchdog** (otherwise): a thread of the trainer sums the resident memory of each running sample's process tree
  every ``WATCHDOG_INTERVAL_S`` and SIGKILLs the tree past its bound (the sample then fails with ``memory_limit``).
  Between two looks a tree can overshoot, so the defaults also keep ``max_processes × memory_mb`` (each process's
  RLIMIT_AS times the process cap) within the sample's share of the machine.

:func:`sample_limits` derives the defaults from the machine's memory (the smaller of physical memory and the
trainer's own cgroup limit) and the number of samples that run at once on it.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time

__all__ = ["WATCHDOG", "SampleCgroup", "TreeWatchdog", "cgroup_parent", "cgroup_unavailable_reasons",
           "concurrent_samples", "machine_memory_mb", "sample_limits", "tree_of"]

WATCHDOG_INTERVAL_S = 0.05
#: Share of the machine's memory that the concurrent samples may use together (the rest is the trainer's).
SANDBOX_MEMORY_SHARE = 0.5
DEFAULT_MEMORY_MB = 1024
DEFAULT_MAX_PROCESSES = 32
#: Processes (and threads: RLIMIT_NPROC counts both) a sample keeps under the watchdog, at least.
MIN_PROCESSES = 8
_PAGE = os.sysconf("SC_PAGE_SIZE")
_COUNTER = itertools.count()


# ---------------------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------------------


def _own_cgroup_limit_bytes() -> int | None:
    """The memory limit of the cgroup this process runs in (v2 memory.max or v1 memory.limit_in_bytes), if any."""
    limits = []
    for version, mount, rel in _own_cgroups():
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        try:
            with open(os.path.join(mount, rel.lstrip("/"), name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            limits.append(int(text))
    return min(limits) if limits else None


def machine_memory_mb() -> int:
    """Memory this machine gives the trainer: physical memory, or its cgroup's limit when that is smaller."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:"))
    limit = _own_cgroup_limit_bytes()
    return min(total, limit or total) >> 20


def concurrent_samples(num_workers: int) -> int:
    """Samples running at once on this machine: this process's workers × the processes of this node (torchrun /
    accelerate set ``LOCAL_WORLD_SIZE``)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local = 1
    return max(1, num_workers) * max(1, local)


def sample_limits(concurrency: int, tree_bounded: bool, memory_mb: int | None = None,
                  max_processes: int | None = None) -> tuple[int, int]:
    """``(memory_mb, max_processes)`` for one sample; given values are kept, missing ones derived.

    The samples that run at once share ``SANDBOX_MEMORY_SHARE`` of :func:`machine_memory_mb`. ``memory_mb`` (the
    sample's bound and each process's RLIMIT_AS) is ``DEFAULT_MEMORY_MB`` or that share, whichever is smaller. When
    the tree is not bounded by a cgroup (``tree_bounded=False``), ``max_processes × memory_mb`` is also kept within
    the share: the process cap shrinks first (to ``MIN_PROCESSES``), then the per-process limit.
    """
    share = max(64, int(machine_memory_mb() * SANDBOX_MEMORY_SHARE) // max(1, concurrency))
    mem = memory_mb if memory_mb is not None else min(DEFAULT_MEMORY_MB, share)
    procs = max_processes if max_processes is not None else DEFAULT_MAX_PROCESSES
    if not tree_bounded and max_processes is None:
        procs = max(MIN_PROCESSES, min(procs, share // max(1, mem)))
    if not tree_bounded and memory_mb is None and procs * mem > share:
        mem = max(64, share // procs)
    return int(mem), int(procs)


# ---------------------------------------------------------------------------------------------------------
# cgroups
# ---------------------------------------------------------------------------------------------------------


def _mounts() -> list[tuple[str, str, set]]:
    """(mount point, fstype, super options) of the cgroup file systems."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if rfields and rfields[0] in ("cgroup", "cgroup2"):
                    opts = set(rfields[2].split(",")) if len(rfields) > 2 else set()
                    found.append((fields[4].replace("\\040", " "), rfields[0], opts))
    except OSError:
        pass
    return found


def _own_cgroups() -> list[tuple[int, str, str]]:
    """(version, mount point, this process's cgroup path) for the v2 hierarchy and the v1 memory hierarchy."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    out = []
    for mount, fstype, opts in _mounts():
        for _, controllers, rel in entries:
            if fstype == "cgroup2" and controllers == "":
                out.append((2, mount, rel))
            elif fstype == "cgroup" and "memory" in opts and "memory" in controllers.split(","):
                out.append((1, mount, rel))
    return out


def _kill_all(pids):
    """SIGKILL each of ``pids``, ignoring those already gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _write(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)


def _try_parent(version: int, parent: str) -> str | None:
    """Can samples' cgroups be made below ``parent``? None if yes, else why not."""
    try:
        if version == 2:
            with open(os.path.join(parent, "cgroup.controllers")) as f:
                if "memory" not in f.read().split():
                    return f"{parent}: the memory controller is not available to this cgroup"
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
        probe = SampleCgroup(version, parent, 64 << 20)
        probe.remove()
    except OSError as e:
        return f"{parent}: {e.strerror or e}"
    return None


_PARENT_LOCK = threading.Lock()
_PARENT: dict = {}


def cgroup_parent() -> tuple[int, str] | None:
    """``(version, directory)`` below which this process can make memory-limited cgroups, or None. Cached.

    Tried in order: a sub-cgroup ``or1-sandbox`` of this process's own cgroup v2 (its ``memory`` must be delegated),
    the same at the v2 root, then a sub-cgroup ``or1-sandbox`` of this process's cgroup in the v1 memory hierarchy.
    ``OR1_SANDBOX_MEMORY=watchdog`` disables cgroups.
    """
    with _PARENT_LOCK:
        if "value" in _PARENT:
            return _PARENT["value"]
        value, reasons = None, []
        if os.environ.get("OR1_SANDBOX_MEMORY") != "watchdog":
            candidates = []
            for version, mount, rel in _own_cgroups():
                own = os.path.join(mount, rel.lstrip("/"))
                if version == 2:  # processes may not sit in a v2 cgroup that hands controllers down: use a child
                    candidates += [(2, os.path.join(own, "or1-sandbox")), (2, os.path.join(mount, "or1-sandbox"))]
                else:  # v1 lets processes and child cgroups share a cgroup
                    candidates.append((1, os.path.join(own, "or1-sandbox")))
            for version, parent in sorted(dict.fromkeys(candidates), key=lambda c: -c[0]):
                made = not os.path.isdir(parent)
                try:
                    os.makedirs(parent, exist_ok=True)
                except OSError as e:
                    reasons.append(f"{parent}: {e.strerror or e}")
                    continue
                why = _try_parent(version, parent)
                if why is None:
                    value = (version, parent)
                    _reclaim(parent)
                    break
                reasons.append(why)
                if made:  # leave no unusable cgroup behind
                    try:
                        os.rmdir(parent)
                    except OSError:
                        pass
        _PARENT["value"], _PARENT["reasons"] = value, reasons
        return value


def cgroup_unavailable_reasons() -> list[str]:
    """Why :func:`cgroup_parent` found nothing (one line per candidate tried)."""
    cgroup_parent()
    return list(_PARENT.get("reasons", []))


def _reclaim(parent: str):
    """Remove the sample cgroups of processes that died without removing them (a crash)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"or1-(\d+)-\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            SampleCgroup.attach(os.path.join(parent, name)).remove()


class SampleCgroup:
    """One sample's memory cgroup: made with its limit, joined by the sandbox's first process, removed after."""

    def __init__(self, version: int, parent: str, limit_bytes: int, _path: str | None = None):
        self.version = version
        self.path = _path or os.path.join(parent, f"or1-{os.getpid()}-{next(_COUNTER)}")
        if _path is not None:
            return
        os.mkdir(self.path)
        try:
            if version == 2:
                _write(self._file("memory.max"), str(limit_bytes))
                for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):  # one OOM kill ends all
                    try:
                        _write(self._file(name), value)
                    except OSError:
                        pass
            else:
                _write(self._file("memory.limit_in_bytes"), str(limit_bytes))
                try:  # memory + swap, where swap accounting exists
                    _write(self._file("memory.memsw.limit_in_bytes"), str(limit_bytes))
                except OSError:
                    pass
        except BaseException:
            os.rmdir(self.path)
            raise

    @classmethod
    def attach(cls, path: str) -> "SampleCgroup":
        version = 2 if os.path.exists(os.path.join(path, "cgroup.kill")) or \
            os.path.exists(os.path.join(path, "memory.max")) else 1
        return cls(version, os.path.dirname(path), 0, _path=path)

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def procs_file(self) -> str:
        """Writing ``0`` here moves the writing process (and what it starts later) into the cgroup."""
        return self._file("cgroup.procs")

    def peak_mb(self) -> float | None:
        """Highest memory use of the sample so far (v2 ``memory.peak``, v1 ``memory.max_usage_in_bytes``)."""
        try:
            with open(self._file("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")) as f:
                return int(f.read().split()[0]) / (1 << 20)
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int:
        """Processes of the sample that the kernel killed at the limit."""
        try:
            with open(self._file("memory.events" if self.version == 2 else "memory.oom_control")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        try:
            with open(self.procs_file) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def remove(self, timeout: float = 2.0):
        """SIGKILL every process still inside, then remove the cgroup (best effort within ``timeout``)."""
        if self.version == 2:
            try:
                _write(self._file("cgroup.kill"), "1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            _kill_all(self.pids())
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(pause)  # its last processes are still exiting
                pause = min(2 * pause, 0.01)


# ---------------------------------------------------------------------------------------------------------
# The watchdog
# ---------------------------------------------------------------------------------------------------------


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, resident bytes), from /proc/<pid>/stat: one read per process. (psutil's ``process_iter(["ppid",
    "memory_info"])`` reads two files per process and took 14 ms against 4 ms here for 108 processes; the watchdog
    looks 20 times a second while samples run.)"""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        try:
            table[int(name)] = (int(fields[1]), int(fields[21]) * _PAGE)  # ppid, rss (pages)
        except (IndexError, ValueError):
            continue
    return table


def _children(table: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
    """ppid -> its child pids, from :func:`_process_table`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    return children


def tree_of(root: int, table: dict[int, tuple[int, int]], children: dict[int, list[int]] | None = None) -> list[int]:
    """``root`` and all its descendants in ``table`` (``children``: :func:`_children` of ``table``, when known)."""
    if children is None:
        children = _children(table)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            tree.append(pid)
            todo.extend(children.get(pid, ()))
    return tree


class _Watch:
    __slots__ = ("root", "bound", "cgroup", "peak", "exceeded")

    def __init__(self, root: int, bound: int, cgroup: "SampleCgroup | None"):
        self.root, self.bound, self.cgroup, self.peak, self.exceeded = root, bound, cgroup, 0, False


class TreeWatchdog:
    """One thread per process: while samples are watched, every ``interval`` s it sums each tree's resident memory
    and SIGKILLs every process of a tree past its bound. A sample in a cgroup is bounded by the kernel; for it the
    watchdog only ends the rest of the sample once the kernel has OOM-killed one of its processes (v1 has no
    ``memory.oom.group``), so that it fails at once rather than at its timeout."""

    def __init__(self, interval: float = WATCHDOG_INTERVAL_S):
        self.interval = interval
        self._lock = threading.Lock()
        self._watches: set = set()
        self._wake = threading.Condition(self._lock)
        self._thread = None

    def watch(self, root_pid: int, bound_bytes: int, cgroup: SampleCgroup | None = None) -> _Watch:
        w = _Watch(root_pid, bound_bytes, cgroup)
        with self._lock:
            self._watches.add(w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="or1-sandbox-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
        return w

    def unwatch(self, w: _Watch):
        with self._lock:
            self._watches.discard(w)

    def check(self):
        """One look at every watched tree (the thread's loop body)."""
        with self._lock:
            watches = list(self._watches)
        if not watches:
            return
        table = _process_table() if any(w.cgroup is None for w in watches) else {}
        children = _children(table)  # one process table and one tree index per look, for every watched sample
        for w in watches:
            if w.cgroup is not None:
                if not w.exceeded and w.cgroup.oom_kills():
                    w.exceeded = True
                    _kill_all(w.cgroup.pids())
                continue
            tree = tree_of(w.root, table, children)
            rss = sum(table[p][1] for p in tree)
            w.peak = max(w.peak, rss)
            if rss > w.bound:
                w.exceeded = True
                _kill_all(tree)

    def _loop(self):
        while True:
            with self._lock:
                while not self._watches:
                    self._wake.wait()
            self.check()
            time.sleep(self.interval)


WATCHDOG = TreeWatchdog()
