"""The judge of the asserts and function-call formats: the test and the program in two processes of the sandbox, only
data between them.

Runs inside the sandbox, loaded by the driver (:mod:`~or1_trl.rewards.sandbox.driver`, which forks the processes);
standard library only, like the driver. A judged sample is three kinds of process, all in the sample's sandbox:

* the **program process** (:func:`serve_program`, one at a time, forked by the driver, which holds no test): the
  import prefix, then the program, run once as the module ``solution``; it then answers the judge's requests — call a
  function, make an instance of a class (kept here under a handle, so state lives on between calls: a counter, a
  stack), call the function-call format's function (LeetCode's ``Solution().name``, a fresh instance per call, else
  ``name``) — each with the result encoded as data by the strict encoder (exact builtin types; iterators, ``range``,
  dict views and the ``collections`` containers materialised; the prefix's own classes, LeetCode's ``ListNode``, by
  reference, field by field). It never receives a test or an expected value: only the arguments of its calls.
* the **judge** (:class:`Plan`, built in a process forked by the driver before any untrusted code ran): it alone reads
  the tests (from the sandbox's stdin, after the driver let go of it), runs the import prefix in a namespace of its
  own (pristine builtins, fresh for this sample), and forks one **entry process** per test entry.
* an **entry process** (:func:`judge_entry`) judges one entry. A function-call entry (``{"call": name, "args",
  "expected"}``, made by the trainer from ``{"fn_name", "inputs", "outputs"}``) is one call of the program's function
  with the arguments, its result compared with the expected value by :func:`data_equal` (tuples equal lists, a
  float expectation within a 1e-6 relative tolerance, an integer one exactly, a bool only a bool). An asserts entry
  runs its test code on the prefix's names and pristine builtins; each program name the test uses is a proxy
  (:class:`_ProgramRef`). Calls go to the program process over a socket that carries length-framed JSON only; results
  come back through the strict decoder, rebuilt as this process's own objects (the prefix's classes rebuilt with the
  judge's class). Its verdict is a small record: ``pass``, ``wrong``, ``unjudgeable``, ``error`` (the program failed
  to load; for a function call also: its function raised), ``no_result`` (its process ended without answering),
  ``output_limit``, ``memory_limit`` or ``bad_tests``.

The judge and the program process run as the same sandbox uid (bwrap maps one uid into the sample's user namespace;
a root trainer gives each sample one uid slot): the judge is out of the program's reach because it is not dumpable
(no ptrace, no ``/proc/<judge>/mem`` or ``fd``), holds nothing the program can open, and takes only data from it.
The program can still signal the judge: that ends the sample as a failure, never as a pass.

What this guarantees (the program is optimised to find any way to pass):

* nothing of the program's reaches the trainer: the driver writes one fixed-format record per entry (its status and
  verdict, a reason of at most 300 characters);
* no value the program returns can run code in the judge: it is data, rebuilt pristine; a bomb in it (a huge
  ``range`` consumed by ``set``, a cycle walked by a prefix helper) meets the entry process's own bounds (its
  memory, its deadline: the judge kills it at ``timeout`` per entry), never the trainer's;
* the program's rebindings (``set = ...``, ``math.isclose = ...``, ``builtins.AssertionError = ...``) stay in its own
  process: the test's names are the judge's;
* an exception the program raises is raised in the test as the builtin class of the same name, except those that
  steer iteration (``StopIteration``, ``StopAsyncIteration``) and any non-builtin one, which become
  :class:`ProgramError`: ``all(map(f, xs))`` cannot end early because ``f`` raised;
* each entry process is a fresh fork of the judge: an entry's mutations (of the prefix's objects, by write-back of a
  mutated argument) never reach another entry, and each sample's judge runs its prefix afresh.

Names, as the test sees them: its own bindings, then builtins and the prefix's names (pristine), then the program's
top-level names (``def``, ``class``, assignments; from its syntax tree). A program name that is also a builtin or a
prefix name is the test's pristine one — unless no other program name appears in the test, in which case it is the
function under test (a task asking for ``gcd`` under ``from math import *``); two or more such names and nothing
else is ambiguous. A name the test uses without binding it (neither its prefix nor a builtin) that the program
imports is replayed in the entry process pristine (a plain import of the standard library; ``import x as y`` or
another package cannot be: the name is then unusable).

**Unjudgeable** (the stated rule): a test that cannot be judged on data alone — a program function returning a value
that is not data (a custom object, a subclass of a builtin type, a cycle of lists), an argument that is not data
(a lambda, an object of a class the prefix does not define), a use of a program name other than calling it, a test
naming the program's aliased or non-stdlib import, an ambiguous name (above) — has the verdict ``unjudgeable``.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
import sys

if __package__:  # imported from the package (the trainer's tests and docs)
    from .driver import UnserialisableValue, decode_data, decode_value, encode_data
else:  # loaded by the driver inside the sandbox, where the driver is ``__main__`` and no package exists
    from __main__ import UnserialisableValue, decode_data, decode_value, encode_data

__all__ = ["ProgramError", "Plan", "VERDICTS", "data_equal", "judge_entry", "prefix_modules", "serve_program"]

#: The verdicts an entry process reports (its record's ``verdict``).
VERDICTS = ("pass", "wrong", "unjudgeable", "error", "no_result", "output_limit", "memory_limit", "bad_tests")
TEST_MODULE = "__or1_test__"  # the __name__ the test code and its prefix run under in the judge
PROGRAM_MODULE = "solution"  # the __name__ the prefix and the program run under in the program process
#: Standard-library modules a program's import is never replayed from (side effects on import).
_NO_REPLAY = frozenset({"antigravity", "this", "turtle", "turtledemo", "tkinter", "idlelib", "webbrowser", "pydoc"})
#: Builtin exceptions that steer the judge's own iteration: a program raising one gets ProgramError instead.
_NOT_AS_IS = frozenset({"StopIteration", "StopAsyncIteration"})
_WHY = 300  # characters of a verdict's reason


class ProgramError(Exception):
    """What the test sees when the program's function raised an exception that is not passed on as is."""


class Unjudgeable(BaseException):
    """The test cannot be judged on data alone (a value that cannot cross, an ambiguous name): scores 0."""


class _Ended(BaseException):
    """The program's process can no longer answer (it ended, sent too much, sent garbage): the entry's verdict."""

    def __init__(self, verdict: str, why: str):
        super().__init__(why)
        self.verdict = verdict


def prefix_modules(prefix: str) -> list[str]:
    """The modules the import prefix's top-level imports name (the driver imports them once, before forking the judge
    and the program processes, which both run the prefix)."""
    try:
        tree = ast.parse(prefix)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    names = []
    for st in tree.body:
        if isinstance(st, ast.Import):
            names += [alias.name for alias in st.names]
        elif isinstance(st, ast.ImportFrom) and st.level == 0 and st.module:
            names.append(st.module)
    return [n for n in names if _replayable(n)]


# ---------------------------------------------------------------------------------------------------------
# The socket between an entry process and the program process: length-framed JSON, both ways
# ---------------------------------------------------------------------------------------------------------


def _send(fd: int, message) -> None:
    data = json.dumps(message).encode()
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _receive(fd: int, cap: int):
    """One message; ``_Ended`` when the peer ended, sent more than ``cap`` bytes or something that is not JSON."""
    try:
        n = int.from_bytes(_read_exact(fd, 4), "big")
        if n > cap:
            raise _Ended("output_limit", f"the program sent a result of {n} bytes (more than {cap})")
        return json.loads(_read_exact(fd, n))
    except EOFError:
        raise _Ended("no_result", "the program's process ended without answering") from None
    except (ValueError, RecursionError):
        raise _Ended("unjudgeable", "the program's process sent malformed data") from None


# ---------------------------------------------------------------------------------------------------------
# The program process: the program runs once, then answers calls with data
# ---------------------------------------------------------------------------------------------------------


def serve_program(code_obj, prefix: str, fd: int) -> None:
    """In the program process (limits and fds set by the driver; ``fd`` is its end of the socket): run the prefix and
    the program as ``solution``, then answer requests until the socket closes. Never returns."""
    ns = {"__name__": PROGRAM_MODULE, "__builtins__": builtins}
    state = _BuiltinsState()  # before any untrusted code: the pristine builtins
    failure, data_names = None, []
    try:
        exec(compile(prefix, "<import_prefix>", "exec"), ns)
        data_names = [n for n, v in ns.items() if isinstance(v, type) and v.__module__ == PROGRAM_MODULE]
    except BaseException as e:  # noqa: BLE001 - the test's prefix does not run: every entry fails with it
        failure = f"the import prefix failed: {type(e).__name__}: {e}"[:_WHY]
    if failure is None:
        try:
            exec(code_obj, ns)
        except BaseException as e:  # noqa: BLE001 - the program fails as it loads
            failure = f"{type(e).__name__}: {e}"[:_WHY]
    state.to_driver()
    objects: list = []  # instances of the program's classes the test made, by handle
    exit_ = os._exit
    while True:
        try:
            request = _receive(fd, 1 << 30)
        except BaseException:  # noqa: BLE001 - the judge is gone
            exit_(0)
        try:
            if failure is not None:
                reply = {"fail": failure}
            elif request.get("op") == "ping":
                reply = {"ok": True}
            else:
                reply = _serve_call(ns, request, data_names, state, objects)
            _send(fd, reply)
        except BaseException:  # noqa: BLE001 - the program broke its own process: the judge sees it end
            exit_(1)


class _BuiltinsState:
    """The builtins as the process found them (before any untrusted code) and as the program left them: the
    program's functions run with its own, the decoding and encoding with the pristine ones, so a program that rebinds
    ``isinstance`` or ``str`` is judged on what its functions return instead of breaking its own harness."""

    def __init__(self, _copy=dict.copy):
        self.live = builtins.__dict__
        self.pristine = _copy(self.live)
        self.program = _copy(self.live)

    def to_driver(self, _copy=dict.copy, _clear=dict.clear, _update=dict.update):
        self.program = _copy(self.live)
        _clear(self.live)
        _update(self.live, self.pristine)

    def to_program(self, _clear=dict.clear, _update=dict.update):
        _clear(self.live)
        _update(self.live, self.program)


def _serve_call(ns, request, names, state, objects):
    """One request on the program's namespace ``ns``: ``{"h": handle}`` for ``"op": "new"`` (an instance of a program
    class, kept in ``objects``), else ``{"v": value}`` (rich data, plus ``"a"``, the ``[args, kwargs]`` after the
    call when the call changed them); ``{"e": exception class name}`` if it raised, ``{"u": type name}`` for a value
    that cannot cross as data. ``request``: ``op``, ``name`` (a program name) or ``h`` (a handle), ``path``
    (attributes read before calling) and ``args`` (``[args, kwargs]``). Objects of the test's data classes ``names``
    are made of the classes ``ns`` binds to those names now."""
    classes = {n: ns[n] for n in names if isinstance(ns.get(n), type)}
    accepts = (lambda t: t.__name__ in classes) if classes else None
    encoded = request.get("args")
    function = request.get("op") == "fn"
    try:
        args, kwargs = decode_data(encoded, classes)
        handle = request.get("h")
        name = str(request["name"])
        if type(handle) is int and 0 <= handle < len(objects):
            target = objects[handle]
        else:
            target = None if function else ns[name]
        path = [str(p) for p in request.get("path") or ()]
    except BaseException:  # noqa: BLE001 - arguments the program's classes refuse to be made of
        return {"u": "arguments"}
    state.to_program()
    try:
        if function:
            target = _function(ns, name)
        for attr in path:
            target = getattr(target, attr)
        value = target(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the program's exception is data for the test
        state.to_driver()
        return {"e": str(type(e).__name__)[:100]}
    state.to_driver()
    if request.get("op") == "new":
        objects.append(value)
        return {"h": len(objects) - 1}
    try:
        out = {"v": encode_data(value, accepts)}
    except BaseException:  # noqa: BLE001 - not plain data: the test cannot judge it
        return {"u": str(type(value).__qualname__)[:100]}
    try:
        after = encode_data([args, kwargs], accepts)
        if after != encoded:  # only arguments the call changed travel back
            out["a"] = after
    except BaseException:  # noqa: BLE001 - arguments that no longer encode are not written back
        pass
    return out


def _function(ns: dict, name: str):
    """The function-call format's function (op ``fn``): LeetCode's ``Solution().name`` (a fresh instance per call)
    when the program defines a class ``Solution`` with that attribute, else the program's ``name``."""
    solution = ns.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    return ns[name]


# ---------------------------------------------------------------------------------------------------------
# The judge: the plan (prefix, program names, entries), then one entry per process
# ---------------------------------------------------------------------------------------------------------


class Plan:
    """What the judge knows before any entry runs: the prefix's namespace (run here, for this sample only), its data
    classes (LeetCode's ``ListNode``: their objects cross as data), the program's top-level names and imports (from
    its syntax tree; nothing of it runs here) and the entries' sources. ``error``: why nothing can be judged."""

    def __init__(self, code: str, prefix: str, entries: list):
        self.entries = [e if isinstance(e, dict) else str(e) for e in entries]
        self.error = None
        self.prefix_tree, self.prefix_ns, self.classes = ast.Module([], []), {}, {}
        self.program, self.imports = {}, []
        try:
            self.prefix_tree = ast.parse(prefix)
            self.prefix_ns = {"__name__": TEST_MODULE, "__builtins__": builtins}
            exec(compile(self.prefix_tree, "<import_prefix>", "exec"), self.prefix_ns)
        except BaseException as e:  # noqa: BLE001 - a broken prefix is a broken test
            self.error = f"the import prefix failed: {type(e).__name__}: {e}"[:_WHY]
            return
        self.classes = {n: v for n, v in self.prefix_ns.items()
                        if isinstance(v, type) and v.__module__ == TEST_MODULE}
        try:
            self.program, self.imports = _program_bindings(ast.parse(code))
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            self.error = f"the program cannot be parsed: {type(e).__name__}"


def judge_entry(plan: Plan, k: int, fd: int, cap: int) -> dict:
    """In an entry process: judge entry ``k`` against the program process at the other end of ``fd`` (results of at
    most ``cap`` bytes). ``{"verdict", "why", "clean"}``; ``clean``: every request was answered, the socket can serve
    the next entry."""
    if plan.error:
        return {"verdict": "bad_tests", "why": plan.error, "clean": True}
    sess = _Session(fd, cap, plan.classes)
    if isinstance(plan.entries[k], dict):
        return _judge_call(plan.entries[k], sess)
    try:
        entry = _plan_entry(plan.entries[k], plan)
        sess.ping()
    except (SyntaxError, ValueError, RecursionError) as e:
        return {"verdict": "bad_tests", "why": f"the test cannot be parsed: {type(e).__name__}: {e}"[:_WHY],
                "clean": True}
    except _Ended as e:
        return {"verdict": e.verdict, "why": str(e)[:_WHY], "clean": False}
    if sess.failure:
        return {"verdict": "error", "why": sess.failure, "clean": True}
    if entry.ambiguous:
        return {"verdict": "unjudgeable", "why": entry.ambiguous, "clean": True}
    ns = dict(plan.prefix_ns)
    ns.update(entry.replayed)
    ns.update({n: _ProgramRef(sess, n, is_class) for n, is_class in entry.remote.items()})
    ns.update({n: _Opaque(sess, n) for n in entry.opaque})
    verdict, why = "pass", ""
    try:
        exec(entry.code, ns)
    except (Unjudgeable, _Ended):
        pass  # recorded in the session
    except MemoryError:
        verdict, why = "memory_limit", "the test ran out of memory on the program's results"
    except BaseException as e:  # noqa: BLE001 - a failing assert, or an exception the test did not expect
        verdict, why = "wrong", f"{type(e).__name__}: {e}"
    return _outcome(sess, verdict, why)


def _judge_call(entry: dict, sess: _Session) -> dict:
    """A function-call test ``{"call": name, "args": [...], "expected": value}`` (arguments and expected value
    encoded by :func:`~.driver.encode_value` in the trainer): the program's function (``Solution().name`` or
    ``name``, see :func:`_function`) called once with the arguments, its result compared with :func:`data_equal`.
    A function that raises (or a program that fails to load) has the verdict ``error``."""
    try:
        args, expected = decode_value(entry["args"]), decode_value(entry["expected"])
        name = str(entry["call"])
    except (KeyError, TypeError, ValueError) as e:
        return {"verdict": "bad_tests", "why": f"malformed function-call test: {type(e).__name__}", "clean": True}
    try:
        actual = sess.call("fn", name, None, (), list(args), {})
    except (Unjudgeable, _Ended):
        return _outcome(sess, "pass", "")  # recorded in the session
    except MemoryError:
        return _outcome(sess, "memory_limit", "the judge ran out of memory on the program's result")
    except Exception as e:  # noqa: BLE001 - the program's function raised, or the program failed to load
        return _outcome(sess, "error", f"{type(e).__name__}: {e}")
    try:
        equal = data_equal(actual, expected)
    except MemoryError:
        return _outcome(sess, "memory_limit", "the judge ran out of memory comparing the program's result")
    except (RecursionError, OverflowError):  # nested too deeply, an int beyond any float: not the value
        equal = False
    return _outcome(sess, "pass" if equal else "wrong", "" if equal else f"`{name}` returned another value")


def _outcome(sess: _Session, verdict: str, why: str) -> dict:
    """The entry's record: ``verdict``, unless the program's process ended or a use was unjudgeable (even where the
    test's own ``except:`` swallowed it)."""
    if sess.ended is not None:
        verdict, why = sess.ended.verdict, str(sess.ended)
    elif sess.unjudgeable:
        verdict, why = "unjudgeable", sess.unjudgeable
    return {"verdict": verdict, "why": why[:_WHY], "clean": sess.ended is None}


def data_equal(actual, expected) -> bool:
    """The function-call format's comparison, on data the judge rebuilt (never an object of the program's): tuples
    equal lists, a bool equals only a bool; a float expectation matches within a relative 1e-6 (absolute 1e-9), an
    integer one exactly (``10000000`` is not ``10000001.0``); any other value by exact type and ``==`` (a ``Counter``
    is not a ``dict``, a ``range`` not a ``list``). May raise ``OverflowError`` (an int beyond any float against a
    float expectation) or ``RecursionError``: not equal."""
    ta, te = type(actual), type(expected)
    if ta is bool or te is bool:
        return ta is te and actual == expected
    if ta in (int, float) and te in (int, float):
        if te is float:
            return math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-9)
        return actual == expected
    if ta in (list, tuple) and te in (list, tuple):
        return len(actual) == len(expected) and all(data_equal(x, y) for x, y in zip(actual, expected))
    if ta is dict and te is dict:
        return actual.keys() == expected.keys() and all(data_equal(actual[k], expected[k]) for k in actual)
    return ta is te and actual == expected


def _unjudgeable(what: str):
    def refuse(self, *args, **kwargs):
        raise self._session.refuse(f"the test uses {self._describe()} as {what}, which is not data")
    return refuse


class _ProgramRef:
    """A program name (or an attribute path on it, or an instance of a program class, by handle) as the test sees it:
    calling it sends the call to the program process; every other use is unjudgeable. Holds nothing of the
    program's."""

    __slots__ = ("_session", "_name", "_is_class", "_handle", "_path")

    def __init__(self, session, name, is_class=False, handle=None, path=()):
        for k, v in (("_session", session), ("_name", name), ("_is_class", is_class), ("_handle", handle),
                     ("_path", tuple(path))):
            object.__setattr__(self, k, v)

    def _describe(self):
        return f"`{self._name}{'(...)' if self._handle is not None else ''}{''.join('.' + p for p in self._path)}`"

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _ProgramRef(self._session, self._name, handle=self._handle, path=self._path + (attr,))

    def __call__(self, *args, **kwargs):
        if self._is_class and self._handle is None and not self._path:  # a program class: an instance, by handle
            handle = self._session.call("new", self._name, None, (), args, kwargs)
            return _ProgramRef(self._session, self._name, is_class=True, handle=handle)
        return self._session.call("call", self._name, self._handle, self._path, args, kwargs)

    __setattr__ = __delattr__ = _unjudgeable("a mutable object")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _unjudgeable("a value")
    __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = __setitem__ = _unjudgeable("a value")
    __hash__ = __index__ = __int__ = __float__ = __str__ = __add__ = __radd__ = _unjudgeable("a value")
    __sub__ = __mul__ = __truediv__ = __mod__ = __neg__ = __abs__ = _unjudgeable("a value")

    def __repr__(self):
        return f"<program {self._describe()}>"


class _Opaque:
    """A name the program binds in a way the judge cannot reproduce pristine (an aliased or non-stdlib import): any
    use by the test is unjudgeable."""

    __slots__ = ("_session", "_name")

    def __init__(self, session, name):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_name", name)

    def _describe(self):
        return f"`{self._name}` (the program's import, not replayable pristine)"

    __getattr__ = __call__ = __setattr__ = _unjudgeable("a module or function")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __iter__ = _unjudgeable("a value")


class _Session:
    """One entry's conversation with the program process, and why it cannot be judged or ended (set even when the
    test's own bare ``except`` swallows the exception)."""

    def __init__(self, fd: int, cap: int, classes: dict):
        self.fd, self.cap = fd, cap
        self.unjudgeable = self.failure = self.ended = None
        self.classes = classes  # the prefix's data classes, by name
        kinds = set(classes.values())
        self.accepts = (lambda t: t in kinds) if kinds else None

    def refuse(self, why: str) -> Unjudgeable:
        self.unjudgeable = self.unjudgeable or why
        return Unjudgeable(why)

    def exchange(self, request: dict) -> dict:
        if self.ended is not None:
            raise self.ended
        try:
            _send(self.fd, request)
            reply = _receive(self.fd, self.cap)
            if not isinstance(reply, dict):
                raise _Ended("unjudgeable", "the program's process sent malformed data")
        except _Ended as e:
            self.ended = e
            raise
        except MemoryError:  # mid-frame: the socket cannot serve another request
            self.ended = _Ended("memory_limit", "the judge ran out of memory reading the program's result")
            raise self.ended from None
        except BaseException:  # noqa: BLE001 - OSError: the program's process is gone
            self.ended = _Ended("no_result", "the program's process ended without answering")
            raise self.ended from None
        if "fail" in reply:
            self.failure = str(reply["fail"])[:_WHY]
        return reply

    def ping(self):
        """The program loaded (it ran once, without error: ``failure`` otherwise)."""
        self.exchange({"op": "ping"})

    def call(self, op: str, name: str, handle, path, args: tuple, kwargs: dict):
        """The program's result (decoded data; a handle for ``"new"``), or the exception it raised."""
        try:
            encoded = encode_data([list(args), kwargs], self.accepts)
        except (UnserialisableValue, RecursionError) as e:
            raise self.refuse(f"an argument cannot be sent to the program as data ({e})") from None
        reply = self.exchange({"op": op, "name": name, "h": handle, "path": list(path), "args": encoded})
        if "fail" in reply:
            raise ProgramError(f"the program failed: {self.failure}")
        if "u" in reply:
            raise self.refuse(f"the program's `{name}` returned a {str(reply['u'])[:60]}, which is not data")
        if "e" in reply:
            raise _program_exception(str(reply["e"]), name)
        if op == "new":
            if type(reply.get("h")) is not int:
                raise self.refuse("the program's process sent malformed data")
            return reply["h"]
        try:
            value = decode_data(reply["v"], self.classes)
            after = decode_data(reply["a"], self.classes) if "a" in reply else None
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            raise self.refuse(f"the program's process sent malformed data for `{name}`") from None
        if isinstance(after, list) and len(after) == 2 and isinstance(after[1], dict):
            _write_back(args, after[0])
            _write_back(list(kwargs.values()), [after[1].get(k) for k in kwargs])
        return value


def _program_exception(name: str, where: str) -> BaseException:
    """The exception the test sees for the program's ``name``: the builtin class itself where that cannot steer the
    judge, else :class:`ProgramError`."""
    exc = getattr(builtins, name, None)
    if name not in _NOT_AS_IS and isinstance(exc, type) and issubclass(exc, Exception):
        try:
            return exc(f"raised by the program's `{where}`")
        except Exception:  # noqa: BLE001 - its constructor wants more (UnicodeDecodeError): an empty one
            return exc.__new__(exc)
    return ProgramError(f"{name[:100]} raised by the program's `{where}`")


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


# ---------------------------------------------------------------------------------------------------------
# Which name is whose: the program's bindings (from its syntax tree), its imports replayed pristine
# ---------------------------------------------------------------------------------------------------------


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
    parts = (module or "").split(".")
    return level == 0 and parts[0] in sys.stdlib_module_names and parts[0] not in _NO_REPLAY \
        and "__main__" not in parts


def _replay_imports(imports: list, wanted: set[str]) -> dict:
    """The names in ``wanted`` that the program binds by import, bound the same way here, pristine: a plain
    ``import x.y`` / ``from x import y`` / ``from x import *`` of the standard library is replayed; an aliased one
    (``as``), one of another package or one that fails here binds None (an :class:`_Opaque` marker)."""
    out: dict = {}
    if not wanted:
        return out
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
                        scratch = _exec_import(ast.ImportFrom(st.module, [alias], 0), None) or {}
                        out.update({k: v for k, v in scratch.items() if k in wanted})
                    continue
                bound = alias.asname or alias.name
                if bound not in wanted:
                    continue
                ok = alias.asname in (None, alias.name) and _replayable(st.module, st.level)
                out[bound] = _exec_import(ast.ImportFrom(st.module, [alias], 0), bound) if ok else None
    return out


def _exec_import(node, bound: str | None):
    """The value ``node`` binds to ``bound`` (its whole namespace for None), or None if the import fails here."""
    scratch: dict = {}
    try:
        exec(compile(ast.fix_missing_locations(ast.Module([node], [])), "<import>", "exec"), scratch)
    except BaseException:  # noqa: BLE001 - it fails (or exits) here: not replayable
        return None
    scratch.pop("__builtins__", None)
    return scratch if bound is None else scratch.get(bound)


def _names_in(tree) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


class _Entry:
    """One test entry, prepared: its code, compiled, and how each name it may touch resolves (see the module
    docstring): the program's names (``remote``: name → is a class), the program's imports replayed here, and names
    the test cannot use (``opaque``). ``ambiguous``: why it is unjudgeable up front."""

    __slots__ = ("code", "remote", "replayed", "opaque", "ambiguous")

    def __init__(self, code, remote, replayed, opaque, ambiguous):
        self.code, self.remote, self.replayed, self.opaque, self.ambiguous = code, remote, replayed, opaque, ambiguous


def _plan_entry(source: str, plan: Plan) -> _Entry:
    tree = ast.parse(source)
    wanted = _names_in(tree) | _names_in(plan.prefix_tree)
    pristine = set(plan.prefix_ns) | set(vars(builtins))
    referenced = {n for n in plan.program if n in wanted}
    clash = referenced & pristine
    own = referenced - clash
    ambiguous = None
    if clash and not own:
        if len(clash) == 1:  # the function under test is named like a builtin or a prefix name: it is the program's
            own = clash
        else:
            ambiguous = (f"the test names {', '.join(sorted(clash))}, each both the program's and a builtin or an "
                         f"import of the test's prefix: which one the test means cannot be told")
    replayed = _replay_imports(plan.imports, wanted - pristine - own)
    opaque = {n for n, v in replayed.items() if v is None}
    replayed = {n: v for n, v in replayed.items() if v is not None}
    return _Entry(compile(tree, "<test>", "exec"), {n: plan.program[n] == "class" for n in own}, replayed, opaque,
                  ambiguous)
