"""What a sandbox run returns, and the errors of a sandbox that cannot run (parent side)."""

from __future__ import annotations

__all__ = ["SandboxError", "SandboxResult", "SandboxUnavailable"]


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


def _describe_failure(res: SandboxResult) -> str:
    if res.status == "sandbox_error":
        return res.error
    if res.records:
        rec = res.records[0]
        return f"test status {rec.get('status')!r}: {_one_line(rec.get('stderr', '')) or 'no stderr'}"
    return f"sandbox status {res.status!r}: {_one_line(res.stderr) or 'no stderr'}"

