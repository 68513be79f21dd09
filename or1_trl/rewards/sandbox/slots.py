"""Sandbox uid slots, unique per machine across every process that runs the sandbox.

A root trainer runs each sample as a dedicated uid (``uid_base + slot``) so that the per-user limits
(RLIMIT_NPROC above all) are the sample's own. Every process on the machine that runs the sandbox — each rank of a
multi-process trainer, evaluation and difficulty workers — must therefore pick different slots: a slot is a lock
file ``uid-<uid>.lock`` in a shared directory, held with ``fcntl.flock`` for as long as the sample runs. flock locks
belong to the open file, so threads of one process exclude each other too, and a holder that dies (even by SIGKILL)
frees its slot: the kernel drops the lock with its last descriptor. The holder writes its pid into the file and
empties it on a clean release; a non-empty file found free means its holder crashed, and the processes it may have
left under that uid are killed before the slot is reused.

The directory: ``$OR1_SANDBOX_SLOT_DIR`` if set, else ``/run/or1-trl-sandbox`` (a root trainer; ``/run`` is local to
the machine and emptied at boot), else ``/tmp/or1-trl-sandbox``. It must be owned by the trainer's uid and not be
writable by others (checked), and every process of the machine must see the same one: set ``OR1_SANDBOX_SLOT_DIR``
to a common path when processes run in containers with private ``/run`` and ``/tmp``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat

__all__ = ["UidSlot", "acquire_uid_slot", "slot_directory"]

#: Slots tried before giving up (more concurrent sandboxes than this on one machine is a configuration error).
MAX_SLOTS = 4096


def slot_directory() -> str:
    """The shared directory of the slot lock files (see the module docstring)."""
    env = os.environ.get("OR1_SANDBOX_SLOT_DIR")
    if env:
        return env
    if os.geteuid() == 0 and os.path.isdir("/run") and os.access("/run", os.W_OK):
        return "/run/or1-trl-sandbox"
    return "/tmp/or1-trl-sandbox"


def _checked_directory(path: str) -> str:
    os.makedirs(path, mode=0o755, exist_ok=True)
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"the sandbox slot directory {path} must be a directory owned by uid {os.geteuid()} and writable by it "
            f"only; remove it or set OR1_SANDBOX_SLOT_DIR to another shared path")
    return path


class UidSlot:
    """A held slot: ``uid`` is the sandbox's, unique on the machine until :meth:`release`."""

    __slots__ = ("uid", "path", "_fd")

    def __init__(self, uid: int, path: str, fd: int):
        self.uid, self.path, self._fd = uid, path, fd

    def release(self):
        """Mark the slot cleanly released (empty file) and drop the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # drops the flock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        return f"UidSlot(uid={self.uid}, path={self.path!r}, held={self._fd is not None})"


def _kill_uid(uid: int):
    """SIGKILL every process whose real uid is ``uid`` (what a crashed holder may have left running)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(name), signal.SIGKILL)
                        break
        except (OSError, ValueError):
            continue


def acquire_uid_slot(uid_base: int, directory: str | None = None) -> UidSlot:
    """Hold the lowest free slot: uid ``uid_base + slot`` is this caller's until :meth:`UidSlot.release`."""
    directory = _checked_directory(directory or slot_directory())
    for slot in range(MAX_SLOTS):
        uid = uid_base + slot
        path = os.path.join(directory, f"uid-{uid}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_size:  # the previous holder died without releasing: reclaim what it left
                _kill_uid(uid)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BlockingIOError:  # held by another sandbox
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return UidSlot(uid, path, fd)
    raise RuntimeError(f"no free sandbox uid slot among {MAX_SLOTS} in {directory}: too many concurrent sandboxes")
