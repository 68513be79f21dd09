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
  The return value is serialised *in the sandbox* by a strict encoder (exact builtin types only) and compared
  as data in the trainer: tuples equal lists, floats are compared with a 1e-6 relative tolerance.
* asserts — ``{"asserts": ["assert f(1) == 2", ...], "import_prefix": "..."}``: each entry is one test (any
  test code: asserts, assignments, loops, ``def check(candidate)``, ``try``/``except``).

Why no format's verdict can be influenced by the program (the policy is optimised to find any way):

* stdin/stdout: the verdict compares stdout *text* in the trainer with the expected text, which never enters the
  sandbox. Rebinding ``print``, ``sys.stdout`` or ``json``, writing to fd 1 directly or from a forked process only
  changes which text is compared (output after the test's process exited is not read); no object of the program's
  reaches the comparison.
* function call: the return value is encoded in the sandbox and decoded in the trainer by a strict decoder into
  exact builtin types, then compared as data (:func:`_data_equal`). An object with a custom ``__eq__``, a subclass of
  ``int``/``str``/``list`` or an object whose comparison raises is refused by the encoder; a program that patches the
  encoder, ``json`` or ``type``, or writes forged data to the result fd, still only sends data, and data equal to
  the expected value is the right answer.
* asserts: the test code runs **in the trainer**, never where the program ran, on pristine builtins and on the
  import prefix executed in the trainer (trusted test input, once per distinct prefix). The program reaches the
  judgment only through the values its functions return, as data: every name of the test that the program defines
  (a ``def``, a ``class`` or an assignment at top level) is a proxy (``_ProgramRef``) whose calls are sent to the
  sandbox — which runs the program in a fresh process and calls its function with the data-encoded arguments — and
  whose results come back through the same strict decoder (plus, for this format, iterators, ``range``, dict views
  and ``collections`` containers, rebuilt as the trainer's own objects, and objects of the classes the import prefix
  defines — LeetCode's ``ListNode``/``TreeNode`` — sent by reference, field by field, and rebuilt with the prefix's
  class in the trainer). Calling a program class returns a handle:
  its method calls are sent as one chain (instantiate, replay the earlier method calls, call), so LeetCode's
  ``Solution().method(...)`` and stateful classes work; arguments the function mutated are written back. Hence
  rebinding a builtin or a module attribute (``set = ...``, ``math.isclose = ...``) changes nothing the test sees,
  and a returned always-equal object, ``int``/``str``/``list`` subclass or raising ``__eq__`` cannot be judged
  (below). An exception raised by the program's function is raised in the test as the builtin class of the same
  name (any other as :class:`ProgramError`): a test that expects it (``try``/``except``) handles it, otherwise the
  test fails. The program's imports that the test names are replayed here pristine (a plain import of the standard
  library; ``import x as y`` or another package cannot be, see below).

  Names: the test's own bindings, then builtins and the prefix's names (pristine), then the program's. A program
  name that is also a builtin or a prefix name is the test's pristine one — unless no other program name appears
  in the test, in which case it is the function under test (a task asking for ``gcd`` under ``from math import
  *``) and is the program's; two or more such names and nothing else is ambiguous. A name the test uses without
  binding it (neither its prefix nor a builtin) is the program's, as it was when the test ran in the program's
  namespace: a test that relies on the program to import a helper (``isclose`` without ``from math import *`` in
  its prefix) trusts the program's definition of it — the prefix must import what the test uses.

  Cost: the test runs in rounds; each round is one sandbox run (one process per pending entry, as for every
  format) making the calls the entry's test needs next; a call that depends on another one's result (``f(g(x))``,
  one per loop iteration) takes another round, at most ``MAX_CALL_ROUNDS``. Every entry runs the program at least
  once, and must finish without error. Straight-line asserts need one round, like the other formats.

  **Unjudgeable** (the stated rule): a test that cannot be judged on data alone scores 0 with the status
  ``unjudgeable``, counted per call in the metric ``code_reward/unjudgeable_frac``: a program function returning
  something that is not data (a custom object, a subclass of a builtin type), an argument that is not data (a
  lambda, an object of a class the prefix does not define), a use of a program name other than calling it
  (comparing the function, reading an attribute), a test naming the program's aliased or non-stdlib import, an
  ambiguous name (above), or more than ``MAX_CALL_ROUNDS`` rounds. Test code is trusted input: it runs in the
  trainer without a sandbox.

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
import builtins
import json
import math
import os
import re
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from .math import completion_text
from .sandbox import Sandbox, SandboxError, UnserialisableValue, decode_data, decode_value, encode_data, encode_value

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
# Output comparison (in the trainer, on data)
# ---------------------------------------------------------------------------------------------------------


def _normalise_stdout(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _data_equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, float) or isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_data_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_data_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------------------------------------
# The asserts format: the test code runs here, on pristine builtins and modules; only the calls it makes on the
# program's names run in the sandbox, and only their data comes back.
# ---------------------------------------------------------------------------------------------------------

#: Standard-library modules a program's import is never replayed from (side effects on import).
_NO_REPLAY = frozenset({"antigravity", "this", "turtle", "turtledemo", "tkinter", "idlelib", "webbrowser", "pydoc"})
_TEST_MODULE = "__or1_test__"  # the __name__ the test code (and its prefix) run under in the trainer
#: Rounds of dependent calls (``f(g(x))`` takes 2) after which an entry is unjudgeable.
MAX_CALL_ROUNDS = 32


class ProgramError(Exception):
    """What the test sees when the program's function raised an exception that is not a builtin one."""


class _NeedCalls(BaseException):
    """A call whose result is not known yet: this round of the entry ends here (not an ``Exception``, so the
    test's own ``except Exception`` cannot swallow it; a bare ``except`` is caught by the session's flag)."""


class Unjudgeable(BaseException):
    """The test cannot be judged on data alone (a value that cannot cross, an ambiguous name): scores 0."""


def _unjudgeable(what: str):
    def refuse(self, *args, **kwargs):
        raise self._session.refuse(f"the test uses {self._describe()} as {what}, which is not data")
    return refuse


class _ProgramRef:
    """A program name (or an attribute path on it, or an instance of a program class) as the test sees it: calling
    it sends the call to the sandbox; every other use is unjudgeable. Never holds anything of the program's."""

    __slots__ = ("_session", "_name", "_is_class", "_new", "_history", "_owner", "_path")

    def __init__(self, session, name, is_class=False, new=None, owner=None, path=()):
        for k, v in (("_session", session), ("_name", name), ("_is_class", is_class), ("_new", new),
                     ("_history", []), ("_owner", owner), ("_path", tuple(path))):
            object.__setattr__(self, k, v)

    def _describe(self):
        base = self._owner if self._owner is not None else self
        return f"`{base._name}{'(...)' if base._new is not None else ''}{''.join('.' + p for p in self._path)}`"

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        owner = self._owner if self._owner is not None else self
        return _ProgramRef(self._session, self._name, owner=owner, path=self._path + (attr,))

    def __call__(self, *args, **kwargs):
        sess = self._session
        owner = self._owner if self._owner is not None else self
        if self._owner is None and self._is_class and self._new is None:  # a program class: an instance handle
            return _ProgramRef(sess, self._name, is_class=True, new=sess.encode([list(args), kwargs]))
        call = {"name": self._name, "new": owner._new, "history": list(owner._history),
                "call": [list(self._path), sess.encode([list(args), kwargs])]}
        value = sess.call(call, args, kwargs)
        if owner._new is not None:  # a method call on an instance: later calls replay it first
            owner._history.append(call["call"])
        return value

    __setattr__ = __delattr__ = _unjudgeable("a mutable object")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _unjudgeable("a value")
    __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = __setitem__ = _unjudgeable("a value")
    __hash__ = __index__ = __int__ = __float__ = __str__ = __add__ = __radd__ = _unjudgeable("a value")
    __sub__ = __mul__ = __truediv__ = __mod__ = __neg__ = __abs__ = _unjudgeable("a value")

    def __repr__(self):
        return f"<program {self._describe()}>"


class _Opaque:
    """A name the program binds in a way the trainer cannot reproduce pristine (an aliased or non-stdlib import):
    any use by the test is unjudgeable."""

    __slots__ = ("_session", "_name")

    def __init__(self, session, name):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_name", name)

    def _describe(self):
        return f"`{self._name}` (the program's import, not replayable pristine)"

    __getattr__ = __call__ = __setattr__ = _unjudgeable("a module or function")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __iter__ = _unjudgeable("a value")


class _Session:
    """One round of one test entry in the trainer: the known call results (``memo``, from earlier rounds), the calls
    it needs next, and why it was unjudgeable (set even when the test's own bare ``except`` swallows it)."""

    def __init__(self, memo: dict, classes: dict):
        self.memo, self.needed, self.unjudgeable = memo, [], None
        self.classes = classes  # the prefix's data classes (ListNode...), by name: their objects cross as data
        kinds = set(classes.values())
        self.accepts = (lambda t: t in kinds) if kinds else None

    def refuse(self, why: str) -> Unjudgeable:
        self.unjudgeable = self.unjudgeable or why
        return Unjudgeable(why)

    def encode(self, value):
        try:
            return encode_data(value, self.accepts)
        except (UnserialisableValue, RecursionError) as e:
            raise self.refuse(f"an argument cannot be sent to the program as data ({e})") from None

    def call(self, call: dict, args: tuple, kwargs: dict):
        """The program's result of ``call`` (decoded data), or the exception it raised, or a new round."""
        key = json.dumps(call, sort_keys=True)
        if key not in self.memo:
            self.needed.append(call)
            raise _NeedCalls
        res, name = self.memo[key], call["name"]
        if "u" in res:
            raise self.refuse(f"the program's `{name}` returned a {str(res['u'])[:60]}, which is not data")
        if "e" in res:
            exc = getattr(builtins, str(res["e"]), None)
            if isinstance(exc, type) and issubclass(exc, Exception):
                try:
                    err = exc(f"raised by the program's `{name}`")
                except Exception:  # noqa: BLE001 - its constructor wants more (UnicodeDecodeError): an empty one
                    err = exc.__new__(exc)
                raise err
            raise ProgramError(f"{str(res['e'])[:100]} raised by the program's `{name}`")
        try:
            value = decode_data(res["v"], self.classes)
            after = decode_data(res["a"], self.classes) if "a" in res else None
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            raise self.refuse(f"the sandbox sent malformed data for `{name}`") from None
        if isinstance(after, list) and len(after) == 2 and isinstance(after[1], dict):
            _write_back(args, after[0])
            _write_back(list(kwargs.values()), [after[1].get(k) for k in kwargs])
        return value


def _write_back(before, after):
    """Arguments the program mutated (a list it sorted in place, ...): their new contents, into the test's objects."""
    if not isinstance(after, list):
        return
    for old, new in zip(before, after):
        if type(old) is not type(new) or old == new:
            continue
        if type(old) is list:
            old[:] = new
        elif type(old) in (dict, set):
            old.clear()
            old.update(new)


def _program_bindings(tree: ast.Module):
    """The program's top-level names: ``{name: "class"|"def"|"value"}`` for what it defines (defs, classes,
    assignment and loop targets, at top level or in top-level ``if``/``try``/``for``/``with`` blocks), and its
    import statements, in order. Function and class bodies are not entered."""
    names: dict[str, str] = {}
    imports: list = []

    def stores(node):  # assignment / loop / with / except targets and walruses of this statement, not its blocks
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.setdefault(node.id, "value")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.setdefault(node.name, "value")
        for field, value in ast.iter_fields(node):
            if field in ("body", "orelse", "finalbody") and isinstance(node, ast.stmt):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST) and not isinstance(child, (ast.Lambda, ast.comprehension, ast.stmt)):
                    stores(child)

    def visit(stmts):
        for st in stmts:
            if isinstance(st, ast.ClassDef):
                names[st.name] = "class"
                continue
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[st.name] = "def"
                continue
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                imports.append(st)
                continue
            stores(st)
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(st, field, None)
                if isinstance(sub, list):
                    visit([y for x in sub for y in (x.body if isinstance(x, ast.ExceptHandler) else [x])])

    visit(tree.body)
    return names, imports


def _replayable(module: str | None, level: int = 0) -> bool:
    top = (module or "").split(".")[0]
    return level == 0 and top in sys.stdlib_module_names and top not in _NO_REPLAY


def _replay_imports(imports: list, wanted: set[str]) -> dict:
    """The names in ``wanted`` that the program binds by import, bound the same way here, pristine: a plain
    ``import x.y`` / ``from x import y`` / ``from x import *`` of the standard library is replayed in the trainer;
    an aliased one (``as``) or one of another package binds an :class:`_Opaque` marker instead (None here)."""
    out: dict = {}
    for st in imports:
        if isinstance(st, ast.Import):
            for alias in st.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound not in wanted:
                    continue
                ok = alias.asname is None and _replayable(alias.name)
                out[bound] = _exec_import(ast.Import([alias]), bound) if ok else None
        else:
            for alias in st.names:
                if alias.name == "*":
                    if _replayable(st.module, st.level):
                        scratch: dict = {}
                        exec(compile(ast.fix_missing_locations(ast.Module([st], [])), "<import>", "exec"), scratch)
                        out.update({k: v for k, v in scratch.items() if k in wanted})
                    continue
                bound = alias.asname or alias.name
                if bound not in wanted:
                    continue
                ok = alias.asname in (None, alias.name) and _replayable(st.module, st.level)
                out[bound] = _exec_import(ast.ImportFrom(st.module, [alias], 0), bound) if ok else None
    return out


def _exec_import(node, bound: str):
    scratch: dict = {}
    try:
        exec(compile(ast.fix_missing_locations(ast.Module([node], [])), "<import>", "exec"), scratch)
    except Exception:  # noqa: BLE001 - the program's import fails here too: not replayable
        return None
    return scratch.get(bound)


def _names_in(tree) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


class _Entry:
    """One test entry, prepared: its code, compiled, and how each name it may touch resolves (see the module
    docstring): pristine values, the program's names (``remote``: name → is a class), the program's imports
    replayed here, and names the test cannot use (``opaque``). ``ambiguous``: why it is unjudgeable up front."""

    __slots__ = ("code", "remote", "replayed", "opaque", "ambiguous")

    def __init__(self, code, remote, replayed, opaque, ambiguous):
        self.code, self.remote, self.replayed, self.opaque, self.ambiguous = code, remote, replayed, opaque, ambiguous


def _plan_entry(source: str, prefix_tree, prefix_ns: dict, program: dict, imports: list) -> _Entry:
    tree = ast.parse(source)
    wanted = _names_in(tree) | _names_in(prefix_tree)
    pristine = set(prefix_ns) | set(vars(builtins))
    referenced = {n for n in program if n in wanted}
    clash = referenced & pristine
    own = referenced - clash
    ambiguous = None
    if clash and not own:
        if len(clash) == 1:  # the function under test is named like a builtin or a prefix name: it is the program's
            own = clash
        else:
            ambiguous = (f"the test names {', '.join(sorted(clash))}, each both the program's and a builtin or an "
                         f"import of the test's prefix: which one the test means cannot be told")
    replayed = _replay_imports(imports, wanted - pristine - own)
    opaque = {n for n, v in replayed.items() if v is None}
    replayed = {n: v for n, v in replayed.items() if v is not None}
    return _Entry(compile(tree, "<test>", "exec"), {n: program[n] == "class" for n in own}, replayed, opaque,
                  ambiguous)


def _run_entry(entry: _Entry, prefix_ns: dict, memo: dict, classes: dict) -> tuple[str, list, str]:
    """One round of an entry in the trainer: ``("pass" | "wrong" | "unjudgeable" | "need", calls needed, why)``."""
    sess = _Session(memo, classes)
    if entry.ambiguous:
        return "unjudgeable", [], entry.ambiguous
    ns = dict(prefix_ns)
    ns.update(entry.replayed)
    ns.update({n: _ProgramRef(sess, n, is_class) for n, is_class in entry.remote.items()})
    ns.update({n: _Opaque(sess, n) for n in entry.opaque})
    why = ""
    try:
        exec(entry.code, ns)
        outcome = "pass"
    except _NeedCalls:
        outcome = "need"
    except Unjudgeable as e:
        outcome, why = "unjudgeable", str(e)
    except BaseException as e:  # noqa: BLE001 - a failing assert, or an exception the test did not expect
        outcome, why = "wrong", f"{type(e).__name__}: {e}"[:300]
    if sess.unjudgeable:  # even if the test's own `except:` swallowed it
        return "unjudgeable", [], sess.unjudgeable
    if sess.needed:
        return "need", sess.needed[:1], ""
    return outcome, [], why


class _AssertPlan:
    __slots__ = ("prefix_ns", "entries", "classes")

    def __init__(self, prefix_ns, entries):
        self.prefix_ns, self.entries = prefix_ns, entries
        # the classes the prefix defines (LeetCode's ListNode, TreeNode): their objects cross as data
        self.classes = {n: v for n, v in prefix_ns.items() if isinstance(v, type) and v.__module__ == _TEST_MODULE}


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
        self._prefixes: dict[str, tuple] = {}

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
        tests, checks = [], []
        for inp, out in zip(inputs, outputs):
            if isinstance(inp, str):  # LiveCodeBench: newline-separated JSON arguments, JSON output
                args = [json.loads(line) for line in inp.split("\n") if line.strip()]
                out = json.loads(out) if isinstance(out, str) else out
            else:
                args = _as_list(inp)
            tests.append({"args": encode_value(list(args))})
            checks.append(lambda rec, expected=out: "value" in rec and _data_equal(decode_value(rec["value"]),
                                                                                      expected))
        prefix = self.import_prefix + "\n" + (spec.get("import_prefix") or "")
        return _Prepared({"kind": "call", "code": code, "fn_name": str(spec["fn_name"]), "tests": tests,
                          "prefix": prefix}, checks)

    def _prepare_asserts(self, code, spec) -> _Prepared:
        entries = _as_list(spec["asserts"])
        if not entries:
            return _Prepared(status="bad_tests", reason="no asserts")
        prefix = self.import_prefix + "\n" + (spec.get("import_prefix") or "")
        prefix_tree, prefix_ns = self._prefix_namespace(prefix)
        program, imports = _program_bindings(ast.parse(code))
        plan = _AssertPlan(prefix_ns, [_plan_entry(str(e), prefix_tree, prefix_ns, program, imports)
                                       for e in entries])
        return _Prepared({"kind": "assert", "code": code, "tests": [], "prefix": prefix,
                          "data_classes": sorted(plan.classes)}, plan)

    def _prefix_namespace(self, prefix: str):
        """The import prefix run here (trusted test input), once per distinct prefix: its names, pristine."""
        if prefix not in self._prefixes:
            tree = ast.parse(prefix)
            ns = {"__name__": _TEST_MODULE, "__builtins__": builtins}
            exec(compile(tree, "<import_prefix>", "exec"), ns)
            if len(self._prefixes) > 64:
                self._prefixes.clear()
            self._prefixes[prefix] = (tree, ns)
        return self._prefixes[prefix]

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
                warnings.warn(f"{self.__name__}: the retry failed too ({_tail(result['reason'])}); its 0.0 is "
                              f"counted in {self.__name__}/sandbox_error_frac as a sandbox failure, not a wrong answer",
                              RuntimeWarning, stacklevel=1)
        return result

    def _attempt(self, prep: _Prepared) -> dict:
        if prep.job["kind"] == "assert":
            return self._attempt_asserts(prep)
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
            statuses.append("pass" if ok else ("wrong" if rec.get("status") == "ok" else rec.get("status", "?")))
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

    def _attempt_asserts(self, prep: _Prepared) -> dict:
        """The asserts format, in rounds: each entry's test runs here until it needs a call of the program it has
        no result for; one sandbox run per round executes the program once per pending entry (a fresh process
        each, as for every format) and makes that entry's calls; the entry runs again with the results. Every
        entry runs the program at least once. Rounds end when each entry has a verdict."""
        plan: _AssertPlan = prep.checks
        n = len(plan.entries)
        memos = [{} for _ in range(n)]
        verdict: list[str | None] = [None] * n
        why = [""] * n
        calls: dict[int, list] = {}
        for i, entry in enumerate(plan.entries):  # round 0, here: the first calls (or a verdict without any)
            outcome, need, why[i] = _run_entry(entry, plan.prefix_ns, memos[i], plan.classes)
            if outcome in ("wrong", "unjudgeable"):
                verdict[i] = outcome
            else:  # "pass" needs the program to have run once too
                calls[i] = need
        start = time.monotonic()
        res = None
        memory_exceeded = False
        for _ in range(MAX_CALL_ROUNDS):
            if not calls or (not self.partial and any(v not in (None, "pass") for v in verdict)):
                break
            order = sorted(calls)
            job = dict(prep.job, tests=[{"calls": calls[i]} for i in order])
            nxt: dict[int, list] = {}

            def on_record(rec, order=order, job=job, nxt=nxt) -> bool:
                k = len(res_records)
                i = order[k]
                res_records.append(rec)
                results = rec.get("results")
                if rec.get("status") != "ok":
                    verdict[i], why[i] = rec.get("status", "?"), _tail(str(rec.get("stderr", "")))
                elif not isinstance(results, list) or len(results) != len(job["tests"][k]["calls"]) or \
                        not all(isinstance(r, dict) for r in results):
                    verdict[i], why[i] = "no_result", "the sandbox returned no result for a call"
                else:
                    for call, r in zip(job["tests"][k]["calls"], results):
                        memos[i][json.dumps(call, sort_keys=True)] = r
                    outcome, need, why[i] = _run_entry(plan.entries[i], plan.prefix_ns, memos[i], plan.classes)
                    if outcome == "need":
                        nxt[i] = need
                    else:
                        verdict[i] = outcome
                return verdict[i] in (None, "pass") or self.partial

            res_records: list = []
            remaining = self._sandbox_kwargs["total_timeout"] - (time.monotonic() - start)
            if remaining <= 0:
                for i in order:
                    verdict[i] = verdict[i] or "total_timeout"
                break
            res = self.sandbox._run(job, on_record, self.sandbox.timeout_per_test, remaining)
            memory_exceeded = memory_exceeded or res.memory_exceeded
            if res.status == "sandbox_error":
                return {"reward": 0.0, "status": "sandbox_error", "reason": res.error, "passed": 0, "total": n,
                        "statuses": [], "elapsed": time.monotonic() - start}
            for i in order[len(res_records):]:  # entries the sandbox never reported (it died, timed out, stopped)
                if verdict[i] is None:
                    verdict[i], why[i] = ("not_run" if res.status == "stopped" else res.status), _tail(res.stderr)
            calls = nxt
        else:
            for i in calls:
                verdict[i], why[i] = "unjudgeable", f"more than {MAX_CALL_ROUNDS} rounds of dependent calls"
        statuses = [v or "not_run" for v in verdict]  # not_run: never ran, an earlier entry had already failed
        n_pass = statuses.count("pass")
        if n_pass == n:
            status, reason = "pass", "every test passed"
        else:
            first = next((k for k, st in enumerate(statuses) if st not in ("pass", "not_run")), 0)
            status = "memory_limit" if memory_exceeded else statuses[first]
            reason = f"{n_pass}/{n} tests passed; {status}: {why[first]}"
        reward = n_pass / n if self.partial else float(n_pass == n)
        return {"reward": float(reward), "status": status, "reason": reason, "passed": n_pass, "total": n,
                "statuses": statuses, "elapsed": time.monotonic() - start}

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
