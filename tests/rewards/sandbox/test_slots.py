"""uid slots (`or1_trl/rewards/sandbox/slots.py`): unique per machine, released on exit, reclaimed after a crash."""

import fcntl
import os
import subprocess
import sys
import textwrap
import time

import pytest

from or1_trl.rewards.sandbox.slots import acquire_uid_slot, slot_directory
from ...helpers import ROOT as REPO

IS_ROOT = os.geteuid() == 0


_HOLDER = textwrap.dedent("""
    import os, sys, time
    from or1_trl.rewards.sandbox.slots import acquire_uid_slot
    slot = acquire_uid_slot(int(sys.argv[1]))
    if os.fork() == 0:  # a process left under the slot's uid, as a crashed trainer's sandbox could leave one
        os.close(slot._fd)  # (sandboxes are exec'd with close_fds: they never hold the lock)
        os.setgid(slot.uid)
        os.setuid(slot.uid)
        time.sleep(60)
        os._exit(0)
    print(slot.uid, flush=True)
    time.sleep(60)
""")


def _uid_processes(uid: int) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f):
                    found.append(int(name))
        except OSError:
            pass
    return found


def test_uid_slots_are_unique_across_processes_and_reclaimed_after_a_crash(monkeypatch, tmp_path):
    if not IS_ROOT:
        pytest.skip("uid slots are a root trainer's: unprivileged, each sandbox has a user namespace of its own")
    directory = tmp_path / "slots"
    monkeypatch.setenv("OR1_SANDBOX_SLOT_DIR", str(directory))
    assert slot_directory() == str(directory)
    base = 1_500_000_000 + (os.getpid() % 1000) * 100  # a range no other test run uses
    env = dict(os.environ, PYTHONPATH=REPO)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(base)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        held = int(holder.stdout.readline())
        assert held == base
        deadline = time.monotonic() + 10  # the child calls setuid after the holder prints: wait for it (loaded CI)
        while len(_uid_processes(held)) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_uid_processes(held)) == 1  # the holder's leftover child
        with acquire_uid_slot(base) as mine, acquire_uid_slot(base) as mine2:  # threads of one process differ too
            assert (mine.uid, mine2.uid) == (base + 1, base + 2)
        holder.kill()  # a crash: the lock goes with the holder's descriptor, not its clean release
        holder.wait()
        slot = acquire_uid_slot(base)
        try:
            assert slot.uid == base  # reclaimed
            deadline = time.monotonic() + 2
            while _uid_processes(base) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _uid_processes(base) == []  # what the crashed holder left under the uid was killed
        finally:
            slot.release()
        with open(os.path.join(directory, f"uid-{base}.lock")) as f:
            assert f.read() == ""  # a clean release empties the file: the next holder has nothing to reclaim
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and the lock is free
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    os.chmod(directory, 0o777)
    with pytest.raises(PermissionError, match="writable by it only"):
        acquire_uid_slot(base)
