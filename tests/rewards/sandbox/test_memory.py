"""The memory and process limits of a sample (`or1_trl/rewards/sandbox/memory.py`): they follow the machine and the
concurrent samples."""

from or1_trl.rewards.sandbox import Sandbox
from or1_trl.rewards.sandbox import memory as sandbox_memory


def test_default_limits_follow_the_machine_and_the_concurrent_samples(monkeypatch):
    with open("/proc/meminfo") as f:
        total_mb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024
    machine = sandbox_memory.machine_memory_mb()
    assert 0 < machine <= total_mb
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for concurrency in (1, 2, 8, 64, 512):
        share = max(64, int(machine * 0.5) // concurrency)
        mem, procs = sandbox_memory.sample_limits(concurrency, tree_bounded=True)
        assert (mem, procs) == (min(1024, share), 32)
        mem, procs = sandbox_memory.sample_limits(concurrency, tree_bounded=False)
        assert 8 <= procs <= 32 and mem <= 1024
        if share >= 8 * 64:  # processes x per-process limit fit the share
            assert procs * mem <= share, (concurrency, mem, procs, share)
        else:  # the floors (8 processes of 64 MB): the Sandbox warns that the machine is overcommitted
            assert (mem, procs) == (64, 8)
    assert sandbox_memory.sample_limits(4, False, memory_mb=2048, max_processes=64) == (2048, 64)  # given: kept
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sandbox_memory.concurrent_samples(2) == 16
    assert Sandbox(concurrency=2, min_isolation="bwrap").memory_mb == \
        sandbox_memory.sample_limits(16, sandbox_memory.cgroup_parent() is not None)[0]
