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

Execution model. Math-Verify's timeouts (``signal.alarm``) work only in a process's main thread and cannot
interrupt a C routine, so the rule runs in a pool of worker processes (``rewards/math_pool.py``): fresh
interpreters that load this file on its own, without importing the rest of ``or1_trl``, one sample at a time in
their main thread, each under a hard wall-clock deadline (``timeout``); a sample whose worker is killed at the
deadline or dies scores 0, the other samples of the batch keep their scores.

Throughput. Nearly all the time goes to Math-Verify itself (its pure-Python ANTLR LaTeX parser, then sympy),
so the pool aims at keeping every worker busy: samples are pipelined, samples with the same gold go to the same
worker (the samples of one prompt share its caches), identical (answer, gold) pairs in a batch are scored once,
step (c) skips ``verify``, gold parses are cached, and each worker warms the LaTeX parser on ~30 typical answers
when it starts. Two exact fast paths (``fast_paths=True``, workers only) halve the CPU per sample: Math-Verify's
LaTeX grammar is parsed with ANTLR's two-stage strategy (SLL prediction, whose decisions are cached, and the
original LL parse only after an SLL syntax error; ANTLR guarantees the same tree), and the outcome of step (d) is
remembered per (gold, exact structure of the parsed prediction). Both return what the plain rule returns;
``num_workers=0`` runs the plain rule, and the tests and ``benchmarks/rewards.py`` compare the two.

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
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from .math_pool import (  # noqa: F401 - WorkerStartupError: raised to MathReward's callers, named here too
    STATUS_CRASHED,
    STATUS_ERROR,
    STATUS_KILLED,
    WorkerPool,
    WorkerStartupError,
    pickle_score_fn,
    serve,
)

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
# ... and the pool's own (`math_pool.py`): STATUS_ERROR (the scoring function raised), STATUS_KILLED (the parent's
# hard deadline expired; the worker was killed), STATUS_CRASHED (the worker process died while scoring the sample).


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
# Worker process (the pool, `math_pool.py`, starts it on this file)
# --------------------------------------------------------------------------------------------------------------

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


def _ready_worker(parsing_timeout: int | None, verify_timeout: int | None, warmup: bool, fast_paths: bool) -> None:
    """Ready the rule in a worker, before it takes samples: Math-Verify's logs quiet, the fast paths, the warm-up."""
    _quiet_math_verify_logs()
    if fast_paths:
        _install_fast_paths()
    # Warm up before declaring ourselves ready: the first parses compile Math-Verify's regexes, fill sympy's
    # caches and, above all, the DFA cache of the (pure-Python) ANTLR LaTeX parser, which makes later
    # parses of similar LaTeX several times faster. Each worker sees only its share of the samples, so it
    # would otherwise stay colder than a single process for a long time.
    for text, gold in _WARMUP if warmup else _WARMUP[:1]:
        score_answer(text, (gold,), parsing_timeout, verify_timeout)


def _worker_main(fd: int) -> None:
    """A worker process's entry point (``math_pool._BOOTSTRAP`` loads this file and calls it): the pool's serve loop
    with this rule."""
    serve(fd, score_answer, _ready_worker)


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
            pickle_score_fn(score_fn)  # fail here, with the reason, rather than in the workers
        self.score_fn = score_fn
        self.startup_timeout = float(startup_timeout)
        self.warmup = bool(warmup)
        self.fast_paths = bool(fast_paths)
        self.__name__ = name
        self._pool: WorkerPool | None = None
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

    def _get_pool(self) -> WorkerPool:
        if self._pool is not None and self._pool.pid != os.getpid():
            # We are a forked copy of the process that owns these workers: leave them alone.
            self._pool = None
        if self._pool is None:
            self._pool = WorkerPool(
                __file__,
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
