"""The Math-Verify reward of Skywork-OR1 (paper §7.1).

For a completion ``y`` and the gold answers ``g_1..g_k`` of its prompt, the paper's rule is:

    (a) keep the text after ``</think>`` if the completion has one, else the whole text;
    (b) ``parsed = math_verify.parse(text)``; fewer than 2 parsed items -> reward 0
        (on success Math-Verify returns ``[sympy_object, extracted_string]``);
    (c) ``parsed[1]`` equal to one of the gold strings -> reward 1;
    (d) otherwise, for each gold: ``verify(parse("\\boxed{" + gold + "}"), parsed)`` -> reward 1 on success;
    any exception or timeout -> reward 0 for that sample only.

The rule is implemented once, in :func:`score_answer` (steps b-d) and :func:`extract_final_answer` (step a).
:class:`MathReward` applies it to a batch with TRL's reward-function signature.

Execution model. Math-Verify bounds parsing and comparison with ``signal.alarm`` (``parse(...,
parsing_timeout=5)``, ``verify(..., timeout_seconds=5)``, whole seconds), which only works in the main thread
of a process, and which cannot interrupt a C routine that never returns to the interpreter. So the rule runs in
a pool of worker processes:

* each worker is a fresh interpreter started with ``subprocess`` (fork+exec): no ``fork`` of a process that
  holds torch/CUDA/NCCL threads, no re-import of the user's ``__main__`` (as ``spawn``/``forkserver`` do), and
  this file is loaded on its own, without importing the rest of ``or1_trl``;
* each sample runs in a worker's main thread, so Math-Verify's own timeouts work;
* the parent gives every sample a hard wall-clock deadline (``timeout``): a worker that exceeds it is killed
  (SIGKILL) and replaced, and only that sample scores 0; a worker that dies while scoring a sample (segfault,
  ``os._exit``, OOM killer) is replaced and only that sample scores 0; the other samples of the batch keep
  their scores;
* workers are reused across calls, shut down at exit (``weakref.finalize``, i.e. atexit) and always reaped;
  a worker whose parent disappears exits by itself.

Throughput. Nearly all the time goes to Math-Verify itself (its pure-Python ANTLR LaTeX parser, then sympy),
so the pool aims at keeping every worker busy: samples are pipelined (a worker has the next one waiting in its
socket), samples with the same gold go to the same worker (the samples of one prompt share its caches),
identical (answer, gold) pairs in a batch are scored once, step (c) skips ``verify``, gold parses are cached,
and each worker warms the LaTeX parser on ~30 typical answers when it starts. Two exact fast paths
(``fast_paths=True``, workers only) halve the CPU per sample: Math-Verify's LaTeX grammar is parsed with ANTLR's
two-stage strategy (SLL prediction, whose decisions are cached, and the original LL parse only after an SLL
syntax error; ANTLR guarantees the same tree), and the outcome of step (d) is remembered per (gold, exact
structure of the parsed prediction). Both return what the plain rule returns; ``num_workers=0`` runs the plain
rule, and the tests and ``benchmarks/rewards.py`` compare the two.

Input guard (our addition, not in the paper). Math-Verify's extraction regexes are super-linear on some inputs
(a run of ``$1+`` takes ~1 s per 10k characters; a 1 MB digit string ~3 s), so before step (b) the answer text
is cut to its last ``max_answer_chars`` characters (default 8,192). Math-Verify prefers the right-most match,
and the final answer sits at the end of a completion, so the cut only matters for answer sections longer than
that, where it can change which match is extracted. ``max_answer_chars=None`` disables the guard.

Difference from the released Skywork-OR1 code (``hf_math_verify.py``): it keeps
``solution_str.split("</think>")[1]``, the text between the first and a possible second ``</think>``; we keep
the text after the last ``</think>`` as the design asks (identical when ``</think>`` occurs once).
"""

from __future__ import annotations

import logging
import os
import pickle
import pickletools
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache
from multiprocessing.connection import Connection, wait
from typing import Any


__all__ = [
    "MathReward",
    "math_reward",
    "score_answer",
    "extract_final_answer",
    "completion_text",
    "normalize_golds",
    "THINK_END",
]

logger = logging.getLogger(__name__)

THINK_END = "</think>"

#: Paper code: ``parse(..., parsing_timeout=5)`` and ``verify(..., timeout_seconds=5)`` (whole seconds: SIGALRM).
DEFAULT_PARSING_TIMEOUT = 5
DEFAULT_VERIFY_TIMEOUT = 5
#: Hard wall-clock deadline per sample, enforced by the parent. One sample may legitimately need
#: parse (<= 5 s) + per gold parse (<= 5 s) + up to 4 comparisons (<= 5 s each), so keep it generous.
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_ANSWER_CHARS = 8192

#: Status codes returned next to each score (logged to TRL's completions table as ``math_reward_status``).
STATUS_STRING_MATCH = "string_match"  # step (c)
STATUS_VERIFIED = "verified"  # step (d)
STATUS_WRONG = "wrong"  # parsed, but neither (c) nor (d)
STATUS_NO_ANSWER = "no_answer"  # step (b): fewer than 2 parsed items
STATUS_PARSE_TIMEOUT = "parse_timeout"  # Math-Verify's own (SIGALRM) timeout during step (b)
STATUS_PARSE_ERROR = "parse_error"  # exception during step (b)
STATUS_NO_GOLD = "no_gold"  # the sample has no gold answer
STATUS_ERROR = "error"  # the scoring function raised
STATUS_KILLED = "killed_timeout"  # the parent's hard deadline expired; the worker was killed
STATUS_CRASHED = "worker_crashed"  # the worker process died while scoring the sample


# --------------------------------------------------------------------------------------------------------------
# The rule (paper §7.1)
# --------------------------------------------------------------------------------------------------------------


def extract_final_answer(text: str) -> str:
    """Step (a): the text after the last ``</think>``, or the whole text if there is none."""
    head, sep, tail = text.rpartition(THINK_END)
    return tail if sep else text


def completion_text(completion: Any) -> str:
    """The text of one completion: a plain string, or a conversation (list of messages) whose last message's
    ``content`` is used (a string, or a list of ``{"type": "text", "text": ...}`` parts)."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content", "")
    elif isinstance(completion, Sequence) and len(completion) > 0:
        last = completion[-1]
        content = last.get("content", "") if isinstance(last, dict) else last
    else:
        return ""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal content parts
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content if part is not None
        )
    return str(content)


def normalize_golds(answer: Any) -> tuple[str, ...]:
    """Gold answers of one sample as a tuple of strings: a string, a number, or a list/tuple/array of them."""
    if answer is None:
        return ()
    if isinstance(answer, str):
        return (answer,)
    if hasattr(answer, "tolist") and not isinstance(answer, (int, float)):  # numpy / torch
        answer = answer.tolist()
    if isinstance(answer, (list, tuple, set, frozenset)):
        return tuple(str(a) for a in answer if a is not None)
    return (str(answer),)


def _math_verify():
    # Imported lazily: the parent process of the worker pool never needs sympy.
    import math_verify
    from math_verify.errors import TimeoutException

    return math_verify.parse, math_verify.verify, TimeoutException


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, parsing_timeout: int | None) -> list:
    """``parse("\\boxed{" + gold + "}")``, cached per process: the same gold is parsed once per group of samples.
    Only successful results are cached (an exception or timeout propagates and is retried next time)."""
    parse, _, _ = _math_verify()
    return parse("\\boxed{" + gold + "}", parsing_timeout=parsing_timeout, raise_on_error=True)


def score_answer(
    text: str,
    golds: Sequence[str],
    parsing_timeout: int | None = DEFAULT_PARSING_TIMEOUT,
    verify_timeout: int | None = DEFAULT_VERIFY_TIMEOUT,
) -> tuple[float, str]:
    """Steps (b)-(d) of the paper's rule (§7.1) on an answer text (step (a) already applied).

    Returns ``(score, status)`` with ``score`` in ``{0.0, 1.0}``. Math-Verify's timeouts use SIGALRM: call this
    in the main thread of a process, or pass ``None`` timeouts (then nothing bounds it).
    """
    parse, verify, TimeoutException = _math_verify()
    golds = tuple(golds)
    if not golds:
        return 0.0, STATUS_NO_GOLD
    # (b) ``raise_on_error=True`` only turns the ``[]`` that parse returns on an error/timeout into an
    # exception, so that we can tell them apart; the score is 0 either way, as in the paper.
    try:
        parsed = parse(text, parsing_timeout=parsing_timeout, raise_on_error=True)
    except TimeoutException:
        return 0.0, STATUS_PARSE_TIMEOUT
    except Exception:
        return 0.0, STATUS_PARSE_ERROR
    if len(parsed) < 2:
        return 0.0, STATUS_NO_ANSWER
    # (c) cheap exact match of the extracted string.
    if parsed[1] in golds:
        return 1.0, STATUS_STRING_MATCH
    # (d) semantic verification against each gold, wrapped in \boxed{} as in the paper. ``verify`` keeps its
    # default ``raise_on_error=False``: a failing (gold, prediction) pair must not stop the other pairs.
    memo = _VERIFY_MEMO  # workers with fast paths only; see below
    memo_key = memo.key(parsed, verify_timeout) if memo is not None else None
    for gold in golds:
        try:
            ok = memo.get((gold, memo_key)) if memo_key is not None else None
            if ok is None:
                ok = bool(verify(_parse_gold(gold, parsing_timeout), parsed, timeout_seconds=verify_timeout))
                if memo_key is not None:
                    memo.put((gold, memo_key), ok)
            if ok:
                return 1.0, STATUS_VERIFIED
        except (Exception, TimeoutException):
            continue
    return 0.0, STATUS_WRONG


# --------------------------------------------------------------------------------------------------------------
# Exact fast paths (installed in the worker processes only)
# --------------------------------------------------------------------------------------------------------------
# None of these changes a score: each returns what the plain rule returns, only sooner. ``num_workers=0`` runs the
# plain rule, which is the reference they are tested against (tests/rewards/test_math.py, benchmarks/rewards.py).


#: Conversions decided by stage 1 (``sll``) and re-run by stage 2 (``ll``) of the two-stage parser, in this process.
TWO_STAGE_COUNTS = {"sll": 0, "ll": 0}


def _install_two_stage_latex_parsing() -> bool:
    """Make Math-Verify's LaTeX parser (``latex2sympy2_extended``, an ANTLR grammar run by the pure-Python ANTLR
    runtime) use ANTLR's two-stage parsing strategy instead of full LL prediction on every input.

    Stage 1 parses in SLL prediction mode, whose decisions the runtime caches in its DFA, and bails out on the
    first syntax error. Stage 2 runs only if stage 1 raised anything at all (a bail-out, a lexer error, a failed
    sympy conversion): it converts the input exactly as before (LL mode, the original error listeners). ANTLR's
    contract for SLL mode is that it either returns the parse tree that LL mode returns or reports a syntax
    error (the grammar's ``math`` rule ends in ``EOF``, so both modes read the whole input); a stage-1 result is
    therefore the plain parser's result, and every failure is the plain parser's own failure. It matters because
    the grammar is ambiguous around sets and relations, and LL's full-context prediction is never cached: it was
    about half the CPU time of the rule on typical answers.

    Patches ``_Latex2Sympy`` of the installed ``latex2sympy2_extended`` (pinned by math-verify) in this process.
    Returns ``False``, patching nothing, if that class does not look as expected.
    """
    try:
        from antlr4.atn.PredictionMode import PredictionMode
        from antlr4.error.ErrorListener import ErrorListener
        from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
    except ImportError:
        return False
    if getattr(_Latex2Sympy, "_or1_two_stage", False):
        return True
    ll_create_parser = getattr(_Latex2Sympy, "create_parser", None)
    ll_parse = getattr(_Latex2Sympy, "parse", None)
    if not callable(ll_create_parser) or not callable(ll_parse):
        return False

    class SLLBailOut(Exception):
        pass

    class BailOnError(ErrorListener):
        def syntaxError(self, recognizer, offendingSymbol, line, column, msg, e):
            raise SLLBailOut

    def two_stage_parse(self, latex_str):
        def sll_create_parser(latex):
            parser = ll_create_parser(self, latex)
            parser._interp.predictionMode = PredictionMode.SLL
            parser.removeErrorListeners()
            parser.addErrorListener(BailOnError())
            return parser

        self.create_parser = sll_create_parser  # this converter only; one is made per latex2sympy call
        try:
            result = ll_parse(self, latex_str)
            TWO_STAGE_COUNTS["sll"] += 1
            return result
        except Exception:
            pass
        finally:
            del self.create_parser
        TWO_STAGE_COUNTS["ll"] += 1
        return ll_parse(self, latex_str)

    _Latex2Sympy.parse = two_stage_parse
    _Latex2Sympy._or1_two_stage = True
    return True


class _VerifyMemo:
    """Bounded memo of step (d): ``verify(parse("\\boxed{gold}"), parsed)`` is a pure function of the gold
    string and of the parsed prediction, which the samples of a group often share (same value, other words).
    The prediction's key is its exact structure (``sympy.srepr``: type, arguments, assumptions, precision) and
    extracted string. A comparison that timed out is remembered as failed, as it would fail again."""

    def __init__(self, maxsize: int = 8192):
        from collections import OrderedDict

        from sympy import srepr

        self._srepr = srepr
        self._items: OrderedDict = OrderedDict()
        self._maxsize = maxsize

    def key(self, parsed: list, verify_timeout: int | None) -> tuple | None:
        try:
            return (verify_timeout, *(x if isinstance(x, str) else (type(x).__name__, self._srepr(x)) for x in parsed))
        except Exception:  # an object srepr cannot print: no memo for this sample
            return None

    def get(self, key: tuple) -> bool | None:
        ok = self._items.get(key)
        if ok is not None:
            self._items.move_to_end(key)
        return ok

    def put(self, key: tuple, ok: bool) -> None:
        self._items[key] = ok
        if len(self._items) > self._maxsize:
            self._items.popitem(last=False)


_VERIFY_MEMO: _VerifyMemo | None = None


def _install_fast_paths() -> bool:
    """All of the above, in this process. Returns whether the two-stage parser is active."""
    global _VERIFY_MEMO
    two_stage = _install_two_stage_latex_parsing()
    _VERIFY_MEMO = _VerifyMemo()
    return two_stage


def _quiet_math_verify_logs() -> None:
    # Math-Verify logs a warning with the *whole input* on a parse timeout and one per comparison timeout;
    # the statuses above carry that information instead.
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------------------------

# Run by ``python -c`` in each worker: load this file as a stand-alone module (no ``or1_trl`` package import,
# no ``__main__`` re-import) and serve requests on the inherited socket.
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_or1_trl_math_reward_worker', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._worker_main(int(sys.argv[2]))\n"
)


#: Typical answers (and a few wrong ones, to exercise ``verify``) parsed by each worker at start-up.
_WARMUP = (
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The final answer is $\\boxed{42}$.", "42"),
    ("So the answer is \\boxed{-7}.", "7"),
    ("\\[\n\\boxed{\\dfrac{3}{4}}\n\\]", "\\frac{3}{4}"),
    ("Therefore, the answer is \\(\\boxed{2\\sqrt{3}}\\).", "\\sqrt{12}"),
    ("$\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{3\\pi}", "3\\pi"),
    ("\\boxed{25\\%}", "0.25"),
    ("\\boxed{0.75}", "\\frac{3}{4}"),
    ("\\boxed{45^\\circ}", "45"),
    ("\\boxed{[-2, 5)}", "[-2,5)"),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]"),
    ("\\boxed{x \\in (0, 1)}", "(0,1)"),
    ("\\boxed{(3, -1)}", "(3,-1)"),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}"),
    ("\\boxed{1, 2}", "1,2"),
    ("\\boxed{x^2 - 4}", "(x-2)(x+2)"),
    ("\\boxed{y = 2x + 3}", "y=3+2x"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{x > 2}", "(2,\\infty)"),
    ("\\boxed{\\text{(B)}}", "B"),
    ("\\boxed{12{,}345}", "12345"),
    ("\\boxed{\\log_2 8}", "3"),
    ("\\boxed{\\binom{6}{2}}", "15"),
    ("\\boxed{2^{10}}", "1024"),
    ("\\boxed{a_{n+1} = 2a_n + 1}", "2a_n+1"),
    ("\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
    ("Let $x = \\frac{a+b}{2}$ and $x^{3} + 3x - 1 = 0$, so $$a_{n+1} = 3 a_n - 2$$ and $7 + 8 = 15$.", "15"),
    ("**Answer:** 17", "17"),
    ("The answer is $\\frac{5}{6}$.", "\\frac{5}{6}"),
)


def _watch_parent(parent_pid: int) -> None:
    # Exit if the parent disappears while this worker is busy (an idle worker sees EOF on its socket).
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(fd: int) -> None:
    """Serve ``("task", id, text, golds)`` requests until EOF or ``None``; answer ``("result", id, score, status)``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us on the way out
    conn = Connection(fd)
    try:
        _, sys_path, fn_bytes, parsing_timeout, verify_timeout, memory_limit_mb, warmup, fast_paths = conn.recv()
        sys.path[:] = sys_path
        if memory_limit_mb:
            import resource

            limit = int(memory_limit_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        score_fn = pickle.loads(fn_bytes) if fn_bytes is not None else score_answer
        _quiet_math_verify_logs()
        if fast_paths:
            _install_fast_paths()
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
        # Warm up before declaring ourselves ready: the first parses compile Math-Verify's regexes, fill sympy's
        # caches and, above all, the DFA cache of the (pure-Python) ANTLR LaTeX parser, which makes later
        # parses of similar LaTeX several times faster. Each worker sees only its share of the samples, so it
        # would otherwise stay colder than a single process for a long time.
        for text, gold in _WARMUP if warmup else _WARMUP[:1]:
            score_answer(text, (gold,), parsing_timeout, verify_timeout)
        conn.send(("ready", os.getpid()))
    except (EOFError, OSError):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, task_id, text, golds = msg
        try:
            score, status = score_fn(text, golds, parsing_timeout, verify_timeout)
            result = ("result", task_id, float(score), str(status))
        except BaseException:  # noqa: BLE001 - a sample's failure is that sample's 0, never the worker's
            result = ("result", task_id, 0.0, STATUS_ERROR)
        try:
            conn.send(result)
        except (EOFError, OSError):
            return


# --------------------------------------------------------------------------------------------------------------
# Worker pool (parent side)
# --------------------------------------------------------------------------------------------------------------


class WorkerStartupError(RuntimeError):
    """A worker process failed to start (broken environment): raised instead of silently scoring 0."""


def _pickle_score_fn(score_fn: Callable) -> bytes:
    """``score_fn`` as the bytes the workers unpickle; raises ``TypeError`` if a worker could not load it.

    Pickle stores a function (or a class) by reference, ``module.qualname``, and each worker is a fresh interpreter
    that imports that module: a lambda or a nested function cannot be pickled at all, and anything defined in the
    parent's ``__main__`` (the script being run, a notebook, ``python -c``) is not importable in a worker, whose
    ``__main__`` is its own bootstrap. Checked in the parent, before any worker starts."""
    what = getattr(score_fn, "__qualname__", None) or type(score_fn).__qualname__
    try:
        data = pickle.dumps(score_fn, protocol=2)  # protocol 2 names every global in a GLOBAL opcode, see below
    except Exception as exc:
        raise TypeError(
            f"MathReward(score_fn={what!r}): score_fn cannot be pickled ({exc}); the worker processes receive it "
            "by reference, so it must be a module-level function (or picklable object) defined in an importable "
            "module, e.g. `from my_rewards import my_score`, not a lambda or a nested function. "
            "MathReward(num_workers=0) runs it in-process instead."
        ) from exc
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL" and arg.split(" ", 1)[0] == "__main__":
            name = arg.split(" ", 1)[1]
            raise TypeError(
                f"MathReward(score_fn={what!r}): {name!r} is defined in __main__ (the script or notebook being "
                "run). The worker processes are fresh interpreters that import score_fn by reference and cannot "
                "import your __main__: define it in an importable module (e.g. my_rewards.py next to your script, "
                "then `from my_rewards import ...`), or use MathReward(num_workers=0) to score in-process."
            )
    return data


class _Worker:
    """Parent-side handle of one worker process. Tasks are pipelined: ``inflight`` holds the ids sent to the
    worker, in order; the first is being scored (since ``since``), the others wait in the socket, so that the
    worker never waits for a busy parent to hand it the next sample."""

    __slots__ = ("proc", "conn", "ready", "inflight", "queued_bytes", "key", "since")

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc = proc
        self.conn = conn
        self.ready = False  # set by the worker's "ready" message
        self.inflight: deque[tuple[int, int]] = deque()  # (task id, message size)
        self.queued_bytes = 0  # bytes of the waiting (not yet started) messages
        self.key: tuple[str, ...] | None = None  # golds of the last task: see _WorkerPool.run
        self.since = time.monotonic()  # start of the current task (or of the process)

    @property
    def task(self) -> int | None:
        """The task being scored, if any."""
        return self.inflight[0][0] if self.inflight else None

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)  # reap: no zombies
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered in 10 s
            logger.error("math_reward: worker %d did not exit after SIGKILL", self.proc.pid)


def _shutdown_workers(workers: list[_Worker], owner_pid: int, grace: float = 2.0) -> None:
    """Ask idle workers to exit, then kill whatever is left; always reap. In a forked copy of the owner
    process, only drop our copies of the sockets: the workers belong to the owner."""
    if os.getpid() != owner_pid:
        for w in workers:
            try:
                w.conn.close()
            except OSError:
                pass
        workers.clear()
        return
    for w in workers:
        try:
            if not w.inflight:
                w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    for w in workers:
        if not w.inflight:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        w.kill()
    workers.clear()


class _WorkerPool:
    """Worker processes that score samples, with a per-sample hard deadline and crash recovery."""

    #: At most this many samples wait in a worker's socket behind the one being scored, and at most this many
    #: bytes: a busy worker does not read, and the parent must never block on a send (it enforces deadlines).
    PREFETCH = 2
    PREFETCH_BYTES = 128 * 1024

    def __init__(
        self,
        size: int,
        score_fn: Callable | None,
        parsing_timeout: int | None,
        verify_timeout: int | None,
        memory_limit_mb: int | None,
        startup_timeout: float,
        warmup: bool = True,
        fast_paths: bool = True,
    ):
        self.pid = os.getpid()
        self._init = (
            "init",
            list(sys.path),
            _pickle_score_fn(score_fn) if score_fn is not None else None,
            parsing_timeout,
            verify_timeout,
            memory_limit_mb,
            warmup,
            fast_paths,
        )
        self._score_fn_module = None if score_fn is None else getattr(score_fn, "__module__", type(score_fn).__module__)
        self._startup_timeout = startup_timeout
        self._env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _shutdown_workers, self.workers, self.pid)
        for _ in range(size):
            self.workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        if not sys.executable:
            raise WorkerStartupError("math_reward: sys.executable is unknown; use MathReward(num_workers=0)")
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__), str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=self._env,
            )
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        worker = _Worker(proc, conn)
        try:
            conn.send(self._init)
        except OSError:
            pass  # the worker already died: noticed as a startup failure below
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = self._spawn()
        self.restarts += 1

    def close(self) -> None:
        self._finalizer()

    def run(self, tasks: list[tuple[str, tuple[str, ...]]], timeout: float) -> list[tuple[float, str]]:
        """Score ``tasks`` (answer text, golds); returns ``(score, status)`` per task, in order."""
        results: list[tuple[float, str] | None] = [None] * len(tasks)
        # Tasks are queued per gold answer, and a worker keeps taking samples of the gold it worked on last:
        # the samples of one prompt (TRL puts a group's samples next to each other) then share the worker's
        # caches (the parsed gold; Math-Verify's cache of recently parsed LaTeX, which the group's repeated
        # final answers hit).
        queues: dict[tuple[str, ...], deque[int]] = {}
        for i, (_, golds) in enumerate(tasks):
            queues.setdefault(golds, deque()).append(i)
        messages: dict[int, bytes] = {}
        remaining = len(tasks)

        def requeue(worker: _Worker, keep_first: bool) -> None:
            # Give back the samples that were waiting behind the failed one: not their fault.
            for i, _ in reversed(list(worker.inflight)[1:] if keep_first else list(worker.inflight)):
                queues.setdefault(tasks[i][1], deque()).appendleft(i)
            worker.inflight.clear()

        while remaining:
            # Dispatch: fill each ready worker's pipeline.
            for w in list(self.workers):
                while w.ready and queues and len(w.inflight) <= self.PREFETCH:
                    key = self._pick_queue(w, queues)
                    i = queues[key][0]
                    msg = messages.get(i)
                    if msg is None:
                        msg = messages[i] = pickle.dumps(("task", i, tasks[i][0], tasks[i][1]), protocol=5)
                    if w.inflight and w.queued_bytes + len(msg) > self.PREFETCH_BYTES:
                        break  # too big to wait in the socket: send it when the worker is idle
                    queues[key].popleft()
                    if not queues[key]:
                        del queues[key]
                    try:
                        w.conn.send_bytes(msg)
                    except OSError:  # died (e.g. killed from outside) with nothing of ours running
                        queues.setdefault(key, deque()).appendleft(i)
                        if w.inflight:
                            break  # its death is noticed below, where the running sample gets its 0
                        self._replace(w)
                        break
                    if not w.inflight:
                        w.since = time.monotonic()
                    else:
                        w.queued_bytes += len(msg)
                    w.inflight.append((i, len(msg)))
                    w.key = key
            # Wait for a result, a death, or the nearest deadline.
            waiting = [w for w in self.workers if w.inflight or not w.ready]
            now = time.monotonic()
            nearest = min(w.since + (timeout if w.ready else self._startup_timeout) for w in waiting)
            by_conn = {w.conn: w for w in waiting}
            for conn in wait(list(by_conn), timeout=max(0.0, nearest - now)):
                w = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:  # the worker died
                    code = w.proc.wait()
                    if not w.ready:
                        self._startup_failed(w, f"exited with code {code}")
                    if w.inflight:
                        i = w.task
                        logger.warning(
                            "math_reward: worker %d died (exit code %s) while scoring sample %d; it scores 0",
                            w.proc.pid, code, i,
                        )
                        results[i] = (0.0, STATUS_CRASHED)
                        remaining -= 1
                        requeue(w, keep_first=True)
                    self._replace(w)
                elif msg[0] == "ready":
                    w.ready, w.since = True, time.monotonic()
                else:
                    _, i, score, status = msg
                    if w.inflight and w.inflight[0][0] == i:
                        w.inflight.popleft()
                        if w.inflight:  # the next one starts now
                            w.queued_bytes -= w.inflight[0][1]
                            w.since = time.monotonic()
                    if results[i] is None:
                        results[i] = (score, status)
                        remaining -= 1
            # Enforce deadlines.
            now = time.monotonic()
            for w in list(self.workers):
                if w.inflight and now - w.since > timeout:
                    i = w.task
                    logger.warning(
                        "math_reward: sample %d exceeded the %.1f s deadline; worker %d killed, sample scores 0",
                        i, timeout, w.proc.pid,
                    )
                    results[i] = (0.0, STATUS_KILLED)
                    remaining -= 1
                    requeue(w, keep_first=True)
                    self._replace(w)
                elif not w.ready and now - w.since > self._startup_timeout:
                    self._startup_failed(w, f"not ready after {self._startup_timeout:.0f} s")
        return results  # type: ignore[return-value]

    def _pick_queue(self, worker: _Worker, queues: dict) -> tuple[str, ...]:
        if worker.key in queues:
            return worker.key
        others = {w.key for w in self.workers if w is not worker}
        for key in queues:  # the first group nobody is working on ...
            if key not in others:
                return key
        return next(iter(queues))  # ... else help with one

    def _startup_failed(self, worker: _Worker, why: str) -> None:
        worker.kill()
        needs = "math-verify"
        if self._score_fn_module is not None:
            needs += f" and the module of score_fn ({self._score_fn_module!r}, with everything it imports)"
        raise WorkerStartupError(
            f"math_reward: a worker process failed to start ({why}); see its traceback above. "
            f"Check that {needs} can be imported by a fresh `{sys.executable}` with this process's sys.path, "
            "or use MathReward(num_workers=0)."
        )


# --------------------------------------------------------------------------------------------------------------
# The reward function
# --------------------------------------------------------------------------------------------------------------


def _default_num_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_world = 1
    return max(1, min(8, cpus // max(1, local_world)))


def _check_alarm_timeout(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive whole number of seconds (SIGALRM) or None, got {value!r}")
    return value


class MathReward:
    """Math reward of Skywork-OR1 (paper §7.1) with TRL's reward-function signature.

    ``reward(completions, answer, **kwargs) -> list[float]``: ``completions`` are strings or conversations
    (the last message's ``content`` is scored); ``answer`` is the dataset column with, per sample, a gold string
    or a list of acceptable gold strings. Each score is 1.0 or 0.0 by the rule in :func:`score_answer`.

    Args:
        num_workers: worker processes (default: usable CPUs / ``LOCAL_WORLD_SIZE``, at most 8). ``0`` scores
            in-process and synchronously (debugging): no crash isolation and no hard deadline; Math-Verify's
            timeouts then only work when called from the main thread (disabled otherwise).
        timeout: hard wall-clock deadline in seconds per sample, enforced by killing the worker.
        parsing_timeout / verify_timeout: Math-Verify's own timeouts (whole seconds, SIGALRM; paper: 5 and 5).
        max_answer_chars: keep only the last this-many characters of the answer text before parsing (input
            guard, see the module docstring); ``None`` keeps everything.
        memory_limit_mb: optional address-space limit (RLIMIT_AS) per worker; a sample exceeding it scores 0.
        score_fn: per-sample rule ``(text, golds, parsing_timeout, verify_timeout) -> (score, status)`` run in
            the workers; default :func:`score_answer`. The workers are fresh interpreters that import it by
            reference (pickle), so it must be defined at module level in an importable module, not in the script
            being run (``__main__``), a notebook, a lambda or a nested function: ``TypeError`` otherwise, raised
            here. With ``num_workers=0`` any callable works. Importing ``or1_trl.rewards.math`` from that module
            is cheap (it does not import torch, TRL or transformers).
        name: ``__name__`` used by TRL for logging (``rewards/<name>/mean``).
        startup_timeout: seconds a new worker may take to import Math-Verify and report ready.
        warmup: each worker scores ~30 typical answers before it takes samples (~3 s, in parallel), which
            warms Math-Verify's LaTeX parser; ``False`` starts workers faster (tests, short scripts).
        fast_paths: in the workers, parse LaTeX with ANTLR's two-stage (SLL, then LL) strategy and remember the
            outcomes of step (d) per (gold, parsed prediction). Scores are unchanged; scoring takes about half
            the CPU time. ``num_workers=0`` always runs the plain rule. See the module docstring.
    """

    #: Dataset columns TRL must pass (checked by `OR1Trainer` at construction): the gold answer(s).
    required_columns = ("answer",)

    def __init__(
        self,
        num_workers: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        parsing_timeout: int | None = DEFAULT_PARSING_TIMEOUT,
        verify_timeout: int | None = DEFAULT_VERIFY_TIMEOUT,
        max_answer_chars: int | None = DEFAULT_MAX_ANSWER_CHARS,
        memory_limit_mb: int | None = None,
        score_fn: Callable[..., tuple[float, str]] | None = None,
        name: str = "math_reward",
        startup_timeout: float = 120.0,
        warmup: bool = True,
        fast_paths: bool = True,
    ):
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
            raise ValueError(f"num_workers must be None or an int >= 0, got {num_workers!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if max_answer_chars is not None and max_answer_chars <= 0:
            raise ValueError(f"max_answer_chars must be None or > 0, got {max_answer_chars!r}")
        self.num_workers = _default_num_workers() if num_workers is None else num_workers
        self.timeout = float(timeout)
        self.parsing_timeout = _check_alarm_timeout("parsing_timeout", parsing_timeout)
        self.verify_timeout = _check_alarm_timeout("verify_timeout", verify_timeout)
        self.max_answer_chars = max_answer_chars
        self.memory_limit_mb = memory_limit_mb
        if score_fn is not None and not callable(score_fn):
            raise TypeError(f"score_fn must be callable, got {score_fn!r}")
        if score_fn is not None and self.num_workers > 0:
            _pickle_score_fn(score_fn)  # fail here, with the reason, rather than in the workers
        self.score_fn = score_fn
        self.startup_timeout = float(startup_timeout)
        self.warmup = bool(warmup)
        self.fast_paths = bool(fast_paths)
        self.__name__ = name
        self._pool: _WorkerPool | None = None
        self._lock = threading.Lock()
        #: Number of samples per status (see STATUS_*), since creation.
        self.stats: dict[str, int] = {}

    # ---- pickling (TRL may ship reward functions to a spawned process): the pool stays behind -----------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"MathReward(num_workers={self.num_workers}, timeout={self.timeout}, "
            f"parsing_timeout={self.parsing_timeout}, verify_timeout={self.verify_timeout}, "
            f"max_answer_chars={self.max_answer_chars}, fast_paths={self.fast_paths})"
        )

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker processes (they are restarted on the next call). Also runs at interpreter exit."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get_pool(self) -> _WorkerPool:
        if self._pool is not None and self._pool.pid != os.getpid():
            # We are a forked copy of the process that owns these workers: leave them alone.
            self._pool = None
        if self._pool is None:
            self._pool = _WorkerPool(
                self.num_workers,
                self.score_fn,
                self.parsing_timeout,
                self.verify_timeout,
                self.memory_limit_mb,
                self.startup_timeout,
                self.warmup,
                self.fast_paths,
            )
        return self._pool

    # ---- scoring ------------------------------------------------------------------------------------------------
    def prepare(self, completion: Any) -> str:
        """Step (a) plus the input guard: the text that is given to Math-Verify."""
        text = extract_final_answer(completion_text(completion))
        if self.max_answer_chars is not None and len(text) > self.max_answer_chars:
            text = text[-self.max_answer_chars :]
        return text

    def score_with_status(self, completions: Sequence[Any], answer: Sequence[Any]) -> list[tuple[float, str]]:
        """Like ``__call__`` but returns ``(score, status)`` per sample."""
        if len(completions) != len(answer):
            raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
        tasks = [(self.prepare(c), normalize_golds(a)) for c, a in zip(completions, answer)]
        # Identical (answer text, golds) pairs - common within a group of samples - are scored once.
        unique: dict[tuple[str, tuple[str, ...]], int] = {}
        index = [unique.setdefault(t, len(unique)) for t in tasks]
        unique_tasks = list(unique)
        with self._lock:
            if self.num_workers == 0:
                unique_results = self._run_in_process(unique_tasks)
            else:
                pool = self._get_pool()
                try:
                    unique_results = pool.run(unique_tasks, self.timeout)
                except BaseException:
                    # Interrupted (Ctrl-C) or a worker could not start: tear down, the next call starts afresh.
                    pool.close()
                    self._pool = None
                    raise
            results = [unique_results[j] for j in index]
            for _, status in results:
                self.stats[status] = self.stats.get(status, 0) + 1
        return results

    def _run_in_process(self, tasks: list[tuple[str, tuple[str, ...]]]) -> list[tuple[float, str]]:
        fn = self.score_fn or score_answer
        pt, vt = self.parsing_timeout, self.verify_timeout
        if threading.current_thread() is not threading.main_thread():
            pt = vt = None  # SIGALRM is unavailable outside the main thread
            logging.getLogger("math_verify").setLevel(logging.ERROR)
        out = []
        for text, golds in tasks:
            try:
                score, status = fn(text, golds, pt, vt)
                out.append((float(score), str(status)))
            except Exception:
                out.append((0.0, STATUS_ERROR))
        return out

    def __call__(self, completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs) -> list[float]:
        if answer is None:
            raise ValueError(
                f"{self.__name__} needs the gold answers in a dataset column named 'answer' "
                "(a string or a list of acceptable strings per sample)"
            )
        results = self.score_with_status(completions, answer)
        log_extra = kwargs.get("log_extra")
        if log_extra is not None:
            log_extra(f"{self.__name__}_status", [status for _, status in results])
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and results:
            failures = sum(status in (STATUS_KILLED, STATUS_CRASHED) for _, status in results)
            log_metric(f"{self.__name__}/worker_failures", float(failures))
        return [score for score, _ in results]


#: Default instance: ``GRPOTrainer(reward_funcs=[math_reward], ...)``. Workers start on the first call.
math_reward = MathReward()
