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
* **watchdog** (otherwise): a thread of the trainer measures each running sample's process tree every
  ``WATCHDOG_INTERVAL_S`` (:func:`tree_memory`) and SIGKILLs the tree past its bound (the sample then fails with
  ``memory_limit``). Between two looks a tree can overshoot, so the defaults also keep ``max_processes × memory_mb``
  (each process's RLIMIT_AS times the process cap) within the sample's share of the machine.

What the watchdog counts. Resident memory alone misses shared memory, which a program can hold outside every
process's resident set (60 memfds of 16 MiB, written and never mapped, are 960 MiB that no RSS shows). The invariant:
every page a sample can hold is either in the address space of one of its processes (bounded by RLIMIT_AS ×
``max_processes``, its resident part counted) or counted once as part of an object:

* private memory: RssAnon + RssFile of each process;
* shared-memory files — memfds, ``MAP_SHARED|MAP_ANONYMOUS`` regions, SysV segments (all on the kernel's internal
  shmem mount) and files of a tmpfs the sandbox shares with the host — at their allocated size, each (device, inode)
  once, whether held by a descriptor (/proc/<pid>/fd; for the non-dumpable driver and tests of an unprivileged
  trainer, /proc/<pid>/fdinfo and ``pidfd_getfd``) or by a mapping (/proc/<pid>/maps, sized through map_files);
* the tmpfs mounts private to the sandbox (its /tmp, bwrap's /dev), as a whole (statvfs), which covers files
  written there and closed;
* SysV segments no process maps any longer, read in the sample's own IPC namespace (``setns`` of the watchdog
  thread), and refused outright under the watchdog in bwrap (a seccomp filter, :func:`shared_memory_filter`: bwrap
  ``--seccomp``), since an unprivileged trainer cannot read them.

Where the trainer lacks CAP_SYS_ADMIN (map_files, setns) a mapping's object counts by its resident pages in each
process (RssShmem), so a region one process wrote and another holds untouched is bounded only by that process's
RLIMIT_AS. Memory the kernel holds for a sample (pipe and socket buffers, descriptors in flight over a unix socket)
is not counted: only a cgroup accounts for it. A look costs about 0.1-0.2 ms per process of the tree on top of the
process table (the program's /proc/<pid>/status, fds and maps; the sandbox's mountinfo and statvfs).

:func:`sample_limits` derives the defaults from the machine's memory (the smaller of physical memory and the
trainer's own cgroup limit) and the number of samples that run at once on it.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import stat
import threading
import time

__all__ = ["WATCHDOG", "SampleCgroup", "TreeWatchdog", "cgroup_parent", "cgroup_unavailable_reasons",
           "concurrent_samples", "machine_memory_mb", "sample_limits", "shared_memory_filter", "tree_memory",
           "tree_of"]

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
# Shared memory no process maps: refused under the watchdog (bwrap)
# ---------------------------------------------------------------------------------------------------------

#: Per architecture (``os.uname().machine``): its seccomp audit arch, and the system calls that make memory the
#: watchdog of an unprivileged trainer cannot see, refused with EPERM: SysV segments (they outlive every mapping and
#: descriptor; reading them needs CAP_SYS_ADMIN) and secret memfds (memory no file system shows). Plain memfds stay
#: allowed (the driver passes each test's stdin in one): they are counted.
_REFUSED_SYSCALLS = {
    "x86_64": (0xC000003E, {"shmget": 29, "memfd_secret": 447}),
    "aarch64": (0xC00000B7, {"shmget": 194, "memfd_secret": 447}),
}
_X32_BIT = 0x40000000


def shared_memory_filter(machine: str | None = None) -> bytes | None:
    """A seccomp filter (classic BPF, ``struct sock_filter[]``, the format of bwrap's ``--seccomp FD``) that refuses,
    with EPERM, the system calls of ``_REFUSED_SYSCALLS`` and every system call of another ABI (i386 via
    ``int 0x80``, x32), where the numbers differ; it allows everything else. None on other architectures."""
    import errno
    import struct

    arch, numbers = _REFUSED_SYSCALLS.get(machine or os.uname().machine, (None, None))
    if arch is None:
        return None
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ...|BPF_JGE, BPF_RET
    checks = ([(jge, _X32_BIT)] if arch == 0xC000003E else []) + [(jeq, nr) for nr in sorted(numbers.values())]
    deny = 4 + len(checks) + 1  # the index of the refusing return
    prog = [(ld_abs, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x00050000 | errno.EPERM),  # seccomp_data.arch
            (ld_abs, 0, 0, 0)]  # seccomp_data.nr
    for op, k in checks:
        prog.append((op, deny - (len(prog) + 1), 0, k))
    prog += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | errno.EPERM)]  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


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


# ---------------------------------------------------------------------------------------------------------
# A tree's memory: resident memory and what it holds in shared memory
# ---------------------------------------------------------------------------------------------------------

_CLONE_NEWIPC = 0x08000000
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (new system calls share one table)
_STATUS_FIELDS = {b"RssAnon:": 0, b"RssFile:": 1, b"RssShmem:": 2}


def _shmem_device() -> int | None:
    """``st_dev`` of the kernel's internal shmem mount, which holds every memfd, ``MAP_SHARED|MAP_ANONYMOUS`` region
    and SysV segment (read from a memfd of this process's own); None where memfds do not exist."""
    try:
        fd = os.memfd_create("or1-shmem-probe")
    except (AttributeError, OSError):
        return None
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "setns") else None
    except (OSError, AttributeError):
        return None


_SHMEM_DEV = _shmem_device()
_LIBC = _libc()


def _tmpfs_mounts(mountinfo: str) -> dict[int, str]:
    """``st_dev`` -> mount point of each tmpfs in a mountinfo file (points relative to its process's root)."""
    found = {}
    try:
        with open(mountinfo, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(b" - ")
        if right.startswith(b"tmpfs "):
            fields = left.split()
            major, minor = fields[2].split(b":")
            point = fields[4].decode("utf-8", "surrogateescape").replace("\\040", " ")
            found.setdefault(os.makedev(int(major), int(minor)), point)
    return found


def _ns_id(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class _HostView:
    """The trainer's own side of one look: its tmpfs devices and its mount and IPC namespaces."""

    __slots__ = ("tmpfs", "mnt_ns", "ipc_ns")

    def __init__(self):
        self.tmpfs = _tmpfs_mounts("/proc/self/mountinfo")
        self.mnt_ns = _ns_id("/proc/self/ns/mnt")
        self.ipc_ns = _ns_id("/proc/self/ns/ipc")  # the main thread's: the watchdog thread may visit a sample's


def _status_rss(pid: int) -> tuple[int, int, int] | None:
    """``(RssAnon, RssFile, RssShmem)`` of a process in bytes, from /proc/<pid>/status."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    values = [0, 0, 0]
    for line in lines:
        key, _, rest = line.partition(b"\t")
        i = _STATUS_FIELDS.get(key)
        if i is not None:
            values[i] = int(rest.split()[0]) << 10  # kB
    return values[0], values[1], values[2]


def _fd_objects(pid: int, devices: set, objects: dict):
    """Add each shared-memory file ``pid`` holds open (a file of ``devices``) to ``objects``: (dev, inode) -> its
    allocated bytes. A process that is not dumpable (the driver and its tests) has its /proc/<pid>/fd owned by root:
    an unprivileged trainer lists /proc/<pid>/fdinfo instead and takes a copy of each descriptor (``pidfd_getfd``,
    allowed to the owner of the sandbox's user namespace)."""
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except PermissionError:
        _fd_objects_by_pidfd(pid, devices, objects)
        return
    except OSError:
        return
    for fd in fds:
        try:
            st = os.stat(f"{base}/{fd}")
        except OSError:
            continue
        _add_object(st, devices, objects)


def _add_object(st: os.stat_result, devices: set, objects: dict):
    if st.st_dev in devices and stat.S_ISREG(st.st_mode):
        objects[(st.st_dev, st.st_ino)] = st.st_blocks * 512


def _fd_objects_by_pidfd(pid: int, devices: set, objects: dict):
    """:func:`_fd_objects` through ``pidfd_getfd`` (Linux 5.6)."""
    if _LIBC is None or not hasattr(os, "pidfd_open"):
        return
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        for fd in fds:
            copy = _LIBC.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
            if copy < 0:
                continue
            try:
                _add_object(os.fstat(copy), devices, objects)
            finally:
                os.close(copy)
    finally:
        os.close(pidfd)


def _mapped_objects(pid: int, devices: dict, objects: dict, w: "_Watch"):
    """Add each shared-memory file ``pid`` has mapped (its device's ``maps`` spelling in ``devices``) to ``objects``,
    sized through /proc/<pid>/map_files (which needs CAP_SYS_ADMIN: without it ``w.map_files`` turns False and the
    caller counts the mapped pages that are resident instead)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[3] not in devices:
            continue
        dev, ino = devices[fields[3]], int(fields[4])
        key = ("sysv", ino) if len(fields) > 5 and fields[5].startswith(b"/SYSV") else (dev, ino)
        if key in objects or not w.map_files:
            continue
        try:
            st = os.stat(f"/proc/{pid}/map_files/{fields[0].decode()}")
        except PermissionError:
            w.map_files = False
            return
        except OSError:  # unmapped meanwhile
            continue
        objects[key] = st.st_blocks * 512


def _sysv_segments(pid: int, host: _HostView, w: "_Watch") -> dict:
    """("sysv", shmid) -> bytes (resident + swapped) of each SysV segment in the IPC namespace of ``pid``, when that
    namespace is the sample's own (bwrap, unshare). Read by moving the watchdog thread into the namespace and back
    (``setns``, which needs CAP_SYS_ADMIN: without it ``w.sysv`` turns False)."""
    if not w.sysv or _LIBC is None or host.ipc_ns is None:
        return {}
    try:
        fd = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY)
    except OSError:
        return {}
    segments = {}
    try:
        if os.fstat(fd).st_ino == host.ipc_ns:  # the trainer's namespace: its segments are not the sample's alone
            return {}
        back = os.open("/proc/self/ns/ipc", os.O_RDONLY)
        try:
            if _LIBC.setns(fd, _CLONE_NEWIPC) != 0:
                w.sysv = False
                return {}
            try:
                with open("/proc/sysvipc/shm", "rb") as f:
                    lines = f.read().splitlines()[1:]
            finally:
                _LIBC.setns(back, _CLONE_NEWIPC)
        finally:
            os.close(back)
    finally:
        os.close(fd)
    for line in lines:
        fields = line.split()  # key shmid perms size cpid lpid nattch uid gid cuid cgid atime dtime ctime rss swap
        held = int(fields[14]) + int(fields[15]) if len(fields) >= 16 else int(fields[3])
        segments[("sysv", int(fields[1]))] = held
    return segments


def tree_memory(tree: list[int], table: dict[int, tuple[int, int]], host: _HostView | None = None,
                w: "_Watch | None" = None) -> int:
    """Bytes of memory a process tree holds: its resident memory, and its shared memory, each object once.

    * private memory: RssAnon + RssFile of each process;
    * shared memory objects, by (device, inode), at their allocated size: memfds, SysV segments,
      ``MAP_SHARED|MAP_ANONYMOUS`` regions and files of a tmpfs the sandbox shares with the host, held by a
      descriptor (/proc/<pid>/fd) or a mapping (/proc/<pid>/maps and map_files, root only); SysV segments no process
      maps any longer are read from the sample's own IPC namespace (root only);
    * the tmpfs mounts private to the sandbox (its /tmp, bwrap's /dev; found in the mountinfo of a process of the
      tree in another mount namespace than the trainer's), as a whole: used blocks (statvfs).

    Without the rights for map_files and SysV (an unprivileged trainer) the resident shared pages of each process
    (RssShmem) count instead of the mapped objects. ``host`` None: resident memory only (the table's RSS).
    """
    if host is None:
        return sum(table[p][1] for p in tree)
    w = w or _Watch(0, 0, None)
    inside = next((p for p in reversed(tree) if _ns_id(f"/proc/{p}/ns/mnt") not in (None, host.mnt_ns)), None)
    tmpfs = _tmpfs_mounts(f"/proc/{inside}/mountinfo") if inside else host.tmpfs
    private = {dev: point for dev, point in tmpfs.items() if dev not in host.tmpfs} if inside else {}
    shared_devs = {dev for dev in (_SHMEM_DEV, *tmpfs) if dev is not None and dev not in private}
    maps_devs = {f"{os.major(d):02x}:{os.minor(d):02x}".encode(): d for d in shared_devs}
    objects = _sysv_segments(inside, host, w) if inside else {}
    total = resident_shared = 0
    for pid in tree:
        rss = _status_rss(pid)
        if rss is None:
            continue
        if pid != tree[0]:  # the tree's root is the sandbox's launcher (bwrap, unshare, the driver): trusted
            _fd_objects(pid, shared_devs, objects)
            if w.map_files:  # maps costs ~0.13 ms a process: read only where it can size what it finds
                _mapped_objects(pid, maps_devs, objects, w)
        total += rss[0] + rss[1]
        resident_shared += rss[2]
    if not w.map_files:
        total += resident_shared
    for point in private.values():
        try:
            fs = os.statvfs(f"/proc/{inside}/root{point}")
        except OSError:
            continue
        total += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    return total + sum(objects.values())


class _Watch:
    __slots__ = ("root", "bound", "cgroup", "peak", "exceeded", "map_files", "sysv")

    def __init__(self, root: int, bound: int, cgroup: "SampleCgroup | None"):
        self.root, self.bound, self.cgroup, self.peak, self.exceeded = root, bound, cgroup, 0, False
        self.map_files = self.sysv = True  # may the watchdog stat a mapping's file / read the sample's SysV segments


class TreeWatchdog:
    """One thread per process: while samples are watched, every ``interval`` s it measures each tree's memory
    (:func:`tree_memory`: resident memory plus what it holds in shared memory) and SIGKILLs every process of a tree
    past its bound. A sample in a cgroup is bounded by the kernel; for it the watchdog only ends the rest of the
    sample once the kernel has OOM-killed one of its processes (v1 has no ``memory.oom.group``), so that it fails at
    once rather than at its timeout."""

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
        host = _HostView() if table else None
        for w in watches:
            if w.cgroup is not None:
                if not w.exceeded and w.cgroup.oom_kills():
                    w.exceeded = True
                    _kill_all(w.cgroup.pids())
                continue
            tree = tree_of(w.root, table, children)
            used = tree_memory(tree, table, host, w)
            w.peak = max(w.peak, used)
            if used > w.bound:
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
