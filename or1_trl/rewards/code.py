"""The code reward of Skywork-OR1 (paper §7.2), on a hardened local sandbox.

Paper §7.2: the reward is rule-based and binary. The program is the *last* ```python block of the response;
it is first checked with ``ast.parse`` (a syntax error scores 0 without starting any process); it is then run
against the problem's unit tests with a time limit per test and a memory limit; the reward is 1 only if every
test passes. Three test formats are supported (``tests`` is a dict or its JSON string):

* stdin/stdout — ``{"inputs": [stdin, ...], "outputs": [stdout, ...]}``: one fresh process per input,
  the full stdout is compared with the expected one, ignoring trailing whitespace on every line and trailing
  blank lines (input/output items may also be lists of lines).
* function call — ``{"fn_name": name, "inputs": [[args...], ...], "outputs": [value, ...]}``: a plain
  function ``name`` or a LeetCode-style ``class Solution`` method ``name``. LiveCodeBench's string encoding
  (each input a string of newline-separated JSON arguments, each output a JSON string) is also accepted.
  Each test is one call (a fresh ``Solution()`` each), judged *in the sandbox* like an assert: the return value is
  serialised by a strict encoder (exact builtin types only) and compared as data by the judge
  (:func:`~or1_trl.rewards.sandbox.judge.data_equal`): tuples equal lists; a float expectation matches within a
  1e-6 relative tolerance, an integer one exactly; a bool only a bool.
* asserts — ``{"asserts": ["assert f(1) == 2", ...], "import_prefix": "..."}``: each entry is one test (any
  test code: asserts, assignments, loops, ``def check(candidate)``, ``try``/``except``, randomness, state).

Why no format's verdict can be influenced by the program (the policy is optimised to find any way):

* stdin/stdout: the verdict compares stdout *text* in the trainer with the expected text, which never enters the
  sandbox. Rebinding ``print``, ``sys.stdout`` or ``json``, writing to fd 1 directly or from a forked process only
  changes which text is compared (output after the test's process exited is not read); no object of the program's
  reaches the comparison. This text (at most ``max_output_bytes`` per test) is the one thing of a sample the trainer
  reads: it is only split into lines and compared.
* function call: the arguments and the expected value travel to the judge alone (below); the program process gets
  the arguments of its call, never the expected value. Its return value is encoded there and rebuilt by the judge's
  strict decoder into exact builtin types, then compared as data. An object with a custom ``__eq__``, a subclass of
  ``int``/``str``/``list`` or a cycle cannot be encoded (``unjudgeable``); a program that patches the encoder,
  ``json`` or ``type``, or writes forged bytes to its socket, still only sends data, and data equal to the expected
  value is the right answer. A function that raises (or is missing) is an ``error``.
* asserts: the test code runs in the sandbox, in a **judge** that is not the program's process
  (:mod:`~or1_trl.rewards.sandbox.judge`): pristine builtins, the import prefix run afresh for each sample, and each
  program name the test uses a proxy whose calls go to a **program process** (the program run once, persistent, so
  state and many calls are cheap) over a socket that carries data only. The program never receives the tests (only
  its calls' arguments), its rebindings stay in its process, its results are rebuilt as the judge's own data (a
  value that is not data is ``unjudgeable``), and an exception it raises cannot steer the judge's iteration. The
  judge's entry processes have their own deadline (``timeout_per_test`` each) and memory bound: a returned bomb (a
  huge ``range`` fed to ``set``, a cycle walked by a helper) ends that entry as ``timeout`` or ``memory_limit``.
  **Nothing derived from a completion runs or is iterated in the trainer**, in either judged format (asserts,
  function call): for each entry it receives a record of fixed form (status, verdict, a reason of at most 300
  characters). The judge's module docstring gives the names rule and what is ``unjudgeable`` (counted per call in
  the metric ``code_reward/unjudgeable_frac``).

The sandbox, its threat model and what each backend isolates are documented in
:mod:`or1_trl.rewards.sandbox`. Rewards are plain floats (TRL reward-function signature); samples of a batch
are evaluated in parallel.

A sample the sandbox could not evaluate (it did not start, its harness broke before the program ran, or the
driver could not fork a test) is not a wrong answer: it is retried once, with a ``RuntimeWarning``, and if it
fails again it gets the status ``sandbox_error``. Under TRL each sample's status is logged to the
completions table (``code_reward_status``) and the fraction of ``sandbox_error`` per call as the metric
``code_reward/sandbox_error_frac``; when more than ``max_sandbox_error_frac`` (default 0.5) of the samples
sent to the sandbox in one call hit it, the reward raises :class:`~or1_trl.rewards.sandbox.SandboxError`
with the first error instead of returning zeros.
"""

from __future__ import annotations

import ast
import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

from .math import completion_text
from .sandbox import Sandbox, SandboxError, encode_value
from .sandbox.judge import VERDICTS

__all__ = ["CodeReward", "code_reward", "extract_code", "DEFAULT_IMPORT_PREFIX"]

#: Executed before the program for function-call and assert tests (LeetCode-style code uses ``List`` etc.
#: without importing them). Overridden by a test's own ``import_prefix``.
DEFAULT_IMPORT_PREFIX = (
    "from typing import *\n"
    "from collections import *\n"
    "from functools import *\n"
    "from heapq import *\n"
    "from bisect import *\n"
    "import collections, functools, heapq, bisect, itertools, math, string, re, sys\n"
)

_CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion) -> str | None:
    """The last ```python fenced block of a completion (a string or a list of chat messages), or None."""
    text = completion_text(completion)
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


# ---------------------------------------------------------------------------------------------------------
# Output comparison: the stdin/stdout format's text (in the trainer); the judged formats' verdicts
# ---------------------------------------------------------------------------------------------------------


def _normalise_stdout(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _judged_pass(rec: dict) -> bool:
    """A judged test's record (asserts, function call): the judge's verdict (see the module docstring)."""
    return rec.get("verdict") == "pass"


def _verdict(rec: dict) -> str:
    """The status of a record whose process ended cleanly but did not pass: the judge's verdict, else ``wrong``."""
    verdict = rec.get("verdict")
    return verdict if isinstance(verdict, str) and verdict in VERDICTS and verdict != "pass" else "wrong"


# ---------------------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------------------


class _Prepared:
    __slots__ = ("job", "checks", "status", "reason")

    def __init__(self, job=None, checks=None, status="", reason=""):
        self.job, self.checks, self.status, self.reason = job, checks, status, reason


def _as_list(x):
    return x if isinstance(x, list) else [x]


class CodeReward:
    """Binary (or, with ``partial=True``, fractional) code reward of paper §7.2, TRL reward signature.

    ``reward(completions, tests, **kwargs) -> list[float]``; ``tests`` is the dataset column (one dict or
    JSON string per sample). Samples run in parallel, at most ``num_workers`` sandboxes at a time (default:
    CPU count). All limits are per sample and enforced by :class:`or1_trl.rewards.sandbox.Sandbox`, which is
    built (and its backend probed) on the first call; ``backend``, ``min_isolation``, ``python`` and
    ``memory_enforcement`` are passed to it. ``memory_mb`` bounds a sample's whole process tree; it and
    ``max_processes`` default to values derived from the machine's memory and the samples running at once
    (``num_workers`` × ``LOCAL_WORLD_SIZE``), see :func:`or1_trl.rewards.sandbox.memory.sample_limits`.

    Each sample gets a status (logged by TRL as ``code_reward_status``): ``pass``; a failure of the program —
    ``wrong`` (ran, wrong output), ``error`` (exception / non-zero exit), ``timeout``, ``signal``,
    ``memory_limit`` (its process tree reached ``memory_mb``), ``output_limit``, ``no_result``, ``compile_error``,
    ``total_timeout``, ``protocol_error``, ``driver_died``; ``unjudgeable`` (asserts: a test that cannot be judged
    on data, see the module docstring; counted in ``code_reward/unjudgeable_frac``); nothing to run — ``no_code``,
    ``syntax_error``, ``bad_tests``; or ``sandbox_error``, an infrastructure failure (retried once with a warning;
    reward 0 if the retry fails too). When more than ``max_sandbox_error_frac`` of the samples sent to the sandbox
    in one call end with ``sandbox_error``, the call raises :class:`SandboxError` with the first error.
    """

    #: Dataset columns TRL must pass (checked by `OR1Trainer` at construction): the unit tests.
    required_columns = ("tests",)

    def __init__(self, timeout_per_test: float = 6.0, total_timeout: float = 60.0, memory_mb: int | None = None,
                 max_processes: int | None = None, max_output_bytes: int = 1 << 20, max_file_bytes: int = 16 << 20,
                 num_workers: int | None = None, partial: bool = False, backend: str = "auto",
                 import_prefix: str = DEFAULT_IMPORT_PREFIX, allow_site_packages: bool = True,
                 tmpfs_mb: int = 64, min_isolation: str | None = None, python: str | None = None,
                 max_sandbox_error_frac: float = 0.5, memory_enforcement: str = "auto"):
        self.__name__ = "code_reward"
        self.partial = partial
        self.num_workers = max(1, num_workers or os.cpu_count() or 1)
        self.import_prefix = import_prefix
        self.max_sandbox_error_frac = float(max_sandbox_error_frac)
        self._sandbox_kwargs = dict(
            timeout_per_test=timeout_per_test, total_timeout=total_timeout, memory_mb=memory_mb,
            max_processes=max_processes, max_output_bytes=max_output_bytes, max_file_bytes=max_file_bytes,
            backend=backend, min_isolation=min_isolation, python=python, allow_site_packages=allow_site_packages,
            tmpfs_mb=tmpfs_mb, concurrency=self.num_workers, memory_enforcement=memory_enforcement)
        self._sandbox: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:  # lazily: choosing the backend runs probe programs (and may raise)
            self._sandbox = Sandbox(**self._sandbox_kwargs)
        return self._sandbox

    # -- preparation (trainer side, no process started) -------------------------------------------------

    def prepare(self, completion, tests) -> _Prepared:
        code = extract_code(completion)
        if code is None:
            return _Prepared(status="no_code", reason="no ```python block")
        try:
            ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            return _Prepared(status="syntax_error", reason=f"syntax error: {type(e).__name__}")
        try:
            spec = json.loads(tests) if isinstance(tests, (str, bytes)) else tests
            if not isinstance(spec, dict):
                return _Prepared(status="bad_tests", reason="tests must be a dict or its JSON string")
            if spec.get("asserts") is not None:
                return self._prepare_asserts(code, spec)
            if spec.get("fn_name"):
                return self._prepare_call(code, spec)
            return self._prepare_stdio(code, spec)
        except Exception as e:  # malformed test spec: nothing to verify against
            return _Prepared(status="bad_tests", reason=f"bad tests: {type(e).__name__}: {e}")

    def _prepare_stdio(self, code, spec) -> _Prepared:
        inputs, outputs = spec["inputs"], spec["outputs"]
        if len(inputs) != len(outputs) or not inputs:
            return _Prepared(status="bad_tests", reason="inputs/outputs mismatch or empty")
        tests, checks = [], []
        for inp, out in zip(inputs, outputs):
            inp = "\n".join(inp) if isinstance(inp, list) else str(inp)
            out = "\n".join(map(str, out)) if isinstance(out, list) else str(out)
            tests.append({"stdin": inp})
            expected = _normalise_stdout(out)
            checks.append(lambda rec, expected=expected: _normalise_stdout(rec.get("stdout", "")) == expected)
        return _Prepared({"kind": "stdio", "code": code, "tests": tests}, checks)

    def _prepare_call(self, code, spec) -> _Prepared:
        inputs, outputs = spec["inputs"], spec["outputs"]
        if len(inputs) != len(outputs) or not inputs:
            return _Prepared(status="bad_tests", reason="inputs/outputs mismatch or empty")
        fn_name, entries = str(spec["fn_name"]), []
        for inp, out in zip(inputs, outputs):
            if isinstance(inp, str):  # LiveCodeBench: newline-separated JSON arguments, JSON output
                args = [json.loads(line) for line in inp.split("\n") if line.strip()]
                out = json.loads(out) if isinstance(out, str) else out
            else:
                args = _as_list(inp)
            entries.append({"call": fn_name, "args": encode_value(list(args)), "expected": encode_value(out)})
        return self._judged(code, spec, entries)

    def _prepare_asserts(self, code, spec) -> _Prepared:
        entries = [str(e) for e in _as_list(spec["asserts"])]
        if not entries:
            return _Prepared(status="bad_tests", reason="no asserts")
        return self._judged(code, spec, entries)

    def _judged(self, code, spec, entries: list) -> _Prepared:
        """A judged job (asserts, function call): the entries travel as the job's ``secret``, for the sandbox's judge
        alone (:mod:`~or1_trl.rewards.sandbox.judge`); each comes back as a record with its verdict."""
        prefix = self.import_prefix + "\n" + (spec.get("import_prefix") or "")
        job = {"kind": "judge", "code": code, "prefix": prefix, "tests": [{} for _ in entries],
               "secret": {"entries": entries}}
        return _Prepared(job, [_judged_pass] * len(entries))

    # -- evaluation --------------------------------------------------------------------------------------

    def evaluate(self, completion, tests) -> dict:
        """Score one sample and explain it: ``{"reward", "status", "reason", "passed", "total", "statuses"}``."""
        return self._evaluate(self.prepare(completion, tests))

    def _evaluate(self, prep: _Prepared) -> dict:
        if prep.job is None:
            return {"reward": 0.0, "status": prep.status, "reason": prep.reason, "passed": 0, "total": 0,
                    "statuses": []}
        result = self._attempt(prep)
        if result["status"] == "sandbox_error":  # the sandbox's failure, not the program's: once more
            warnings.warn(f"{self.__name__}: the sandbox could not run a sample ({_tail(result['reason'])}); "
                          f"retrying it once", RuntimeWarning, stacklevel=1)
            result = self._attempt(prep)
            if result["status"] == "sandbox_error":
                warnings.warn(
                    f"{self.__name__}: the retry failed too ({_tail(result['reason'])}); its 0.0 is counted in "
                    f"{self.__name__}/sandbox_error_frac as a sandbox failure, not a wrong answer",
                    RuntimeWarning, stacklevel=1)
        return result

    def _attempt(self, prep: _Prepared) -> dict:
        passed: list[bool] = []
        statuses: list[str] = []
        failure_stderr: list[str] = []

        def on_record(rec) -> bool:
            ok = rec.get("status") == "ok"
            if ok:
                try:
                    ok = bool(prep.checks[len(passed)](rec))
                except Exception:
                    ok = False
            passed.append(ok)
            if not ok and not failure_stderr:
                failure_stderr.append(str(rec.get("stderr", "")))
            status = rec.get("status", "?")
            statuses.append("pass" if ok else (_verdict(rec) if status == "ok" else status))
            return ok or self.partial  # all-or-nothing: the first failing test decides, stop the sandbox

        res = self.sandbox.run(prep.job, on_record=on_record)
        total = len(prep.checks)
        n_pass = sum(passed)
        complete = res.done and len(passed) == total
        if self.partial:
            reward = n_pass / total if total else 0.0
        else:
            reward = 1.0 if (complete and n_pass == total) else 0.0
        if res.status == "sandbox_error":
            status, reason = "sandbox_error", res.error
        elif complete and n_pass == total:
            status, reason = "pass", "every test passed"
        else:
            status = "memory_limit" if res.memory_exceeded else next((st for st in statuses if st != "pass"),
                                                                      res.status)
            reason = f"{n_pass}/{total} tests passed; {status}: " + _tail((failure_stderr or [res.stderr])[0])
        return {"reward": float(reward), "status": status, "reason": reason, "passed": n_pass, "total": total,
                "statuses": statuses, "elapsed": res.elapsed}

    def __call__(self, completions, tests=None, **kwargs) -> list[float]:
        if tests is None:
            raise ValueError("code_reward needs a `tests` column (one dict or JSON string per sample)")
        if len(tests) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(tests)} test specs")
        prepared = [self.prepare(c, t) for c, t in zip(completions, tests)]
        n_run = sum(p.job is not None for p in prepared)
        if n_run:
            _ = self.sandbox  # choose (probe) the backend once, before the threads start
        workers = min(self.num_workers, max(1, n_run))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="or1-code-reward") as pool:
            results = list(pool.map(self._evaluate, prepared))
        errors = [r["reason"] for r in results if r["status"] == "sandbox_error"]
        log_extra = kwargs.get("log_extra")
        if log_extra is not None:
            log_extra(f"{self.__name__}_status", [r["status"] for r in results])
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and n_run:
            log_metric(f"{self.__name__}/sandbox_error_frac", len(errors) / n_run)
            log_metric(f"{self.__name__}/unjudgeable_frac",
                       sum(r["status"] == "unjudgeable" for r in results) / n_run)
        if errors and len(errors) > self.max_sandbox_error_frac * n_run:
            raise SandboxError(
                f"{self.__name__}: the sandbox ({self.sandbox.backend}) failed on {len(errors)} of the {n_run} "
                f"samples it was given (more than max_sandbox_error_frac={self.max_sandbox_error_frac}); "
                f"these are infrastructure failures, not wrong answers. First error: {errors[0]}")
        return [r["reward"] for r in results]


def _tail(text: str, keep: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= keep else "..." + text[-keep:]


#: Default instance (paper §7.2 settings: binary reward, 6 s per test; memory per sample derived from the machine).
code_reward = CodeReward()
