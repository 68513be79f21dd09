"""Tests of the Math-Verify reward (paper §7.1) in ``or1_trl/rewards/math.py``.

Every expected score below is what the paper's rule gives with the installed Math-Verify (0.9): (a) text after
the last ``</think>``, (b) ``parse`` -> fewer than 2 items is 0, (c) ``parsed[1]`` equal to a gold string is 1,
(d) ``verify(parse("\\boxed{gold}"), parsed)`` is 1. Where Math-Verify's behaviour is surprising the comment says
why the rule gives that number. The expected status names which step decided.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest

from or1_trl.rewards import MathReward, extract_final_answer, math_reward, score_answer
from or1_trl.rewards import math as math_module

from ..helpers import ROOT

MB = 1_000_000

# (label, completion, gold(s), expected score, expected status)
CASES = [
    # --- integers, plain and boxed -------------------------------------------------------------------------------
    ("int boxed", r"\boxed{5}", "5", 1.0, "string_match"),
    ("int boxed in sentence", r"The answer is \boxed{5}.", "5", 1.0, "string_match"),
    ("int boxed wrong", r"\boxed{6}", "5", 0.0, "wrong"),
    ("negative int", r"\boxed{-5}", "-5", 1.0, "string_match"),
    ("sign error", r"\boxed{-5}", "5", 0.0, "wrong"),
    ("leading zero", r"\boxed{012}", "12", 1.0, "verified"),
    ("trailing .0", r"\boxed{12.0}", "12", 1.0, "verified"),
    ("thousands separator pred", r"\boxed{1,000}", "1000", 1.0, "verified"),
    ("thousands separator gold", r"\boxed{1000}", "1,000", 1.0, "verified"),
    ("text-wrapped number", r"\boxed{\text{12}}", "12", 1.0, "verified"),
    # --- fractions / decimals / percent ----------------------------------------------------------------------------
    # Math-Verify normalises the extracted string: 0.5 is reported as "\frac{1}{2}", so step (c) already matches.
    ("decimal vs frac gold", r"\boxed{0.5}", r"\frac{1}{2}", 1.0, "string_match"),
    ("frac vs decimal gold", r"\boxed{\frac{1}{2}}", "0.5", 1.0, "verified"),
    ("slash fraction", r"\boxed{1/2}", r"\frac12", 1.0, "verified"),
    ("dfrac normalised to frac", r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0, "string_match"),
    ("tfrac vs decimal", r"\boxed{\tfrac{3}{4}}", "0.75", 1.0, "verified"),
    ("negative fraction forms", r"\boxed{\frac{-1}{2}}", r"-\frac12", 1.0, "verified"),
    ("percent vs decimal gold", r"\boxed{50\%}", "0.5", 1.0, "verified"),
    # Surprising but Math-Verify's choice: a percentage also matches its bare number (50% ~ 50).
    ("percent vs bare number gold", r"\boxed{50\%}", "50", 1.0, "verified"),
    ("decimal vs percent gold", r"\boxed{0.5}", r"50\%", 1.0, "verified"),
    ("bare number vs percent gold", r"\boxed{50}", r"50\%", 1.0, "verified"),
    ("small percent", r"\boxed{7\%}", "0.07", 1.0, "verified"),
    # Floats are compared after rounding to 6 decimals: 0.333 and 1.4142 are wrong, 6-digit forms are right.
    ("truncated decimal of 1/3", r"\boxed{0.333}", r"\frac13", 0.0, "wrong"),
    ("6-digit decimal of 1/3", r"\boxed{0.333333}", r"\frac13", 1.0, "verified"),
    ("1/3 vs 4-digit gold", r"\boxed{1/3}", "0.3333", 0.0, "wrong"),
    ("division by zero", r"\boxed{\frac{1}{0}}", "1", 0.0, "wrong"),
    # --- roots, constants, functions -------------------------------------------------------------------------------
    ("sqrt simplification", r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0, "verified"),
    ("sqrt forms", r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1.0, "verified"),
    ("sqrt vs power", r"\boxed{\sqrt{2}}", r"2^{1/2}", 1.0, "verified"),
    ("sqrt 4 decimals", r"\boxed{1.4142}", r"\sqrt{2}", 0.0, "wrong"),
    ("sqrt 6 decimals", r"\boxed{1.414214}", r"\sqrt{2}", 1.0, "verified"),
    ("pi", r"\boxed{\pi}", r"\pi", 1.0, "string_match"),
    ("pi decimal", r"\boxed{3.14159}", r"\pi", 0.0, "wrong"),
    ("log", r"\boxed{\log_2 8}", "3", 1.0, "verified"),
    ("binomial", r"\boxed{\binom{5}{2}}", "10", 1.0, "verified"),
    ("factorial", r"\boxed{5!}", "120", 1.0, "verified"),
    ("power", r"\boxed{2^{10}}", "1024", 1.0, "verified"),
    # Math-Verify parses i as a plain symbol, so e^{i pi} does not simplify to -1: the rule gives 0.
    ("euler identity", r"\boxed{e^{i\pi}}", "-1", 0.0, "wrong"),
    ("complex number", r"\boxed{2+3i}", "2+3i", 1.0, "string_match"),
    ("infinity", r"\boxed{\infty}", r"\infty", 1.0, "string_match"),
    ("degrees pred", r"\boxed{10^\circ}", "10", 1.0, "verified"),
    ("degrees gold", r"\boxed{10}", r"10^\circ", 1.0, "verified"),
    ("units stripped", r"\boxed{100 \text{ cm}}", "100", 1.0, "string_match"),
    ("dollar sign stripped", r"\boxed{\$5}", "5", 1.0, "string_match"),
    # --- intervals, tuples, sets -----------------------------------------------------------------------------------
    ("half-open interval", r"\boxed{[0, 1)}", r"[0,1)", 1.0, "verified"),
    ("wrong interval ends", r"\boxed{(0,1]}", r"[0,1)", 0.0, "wrong"),
    ("infinite interval", r"\boxed{(-\infty, 2)}", r"(-\infty,2)", 1.0, "verified"),
    ("x in interval", r"\boxed{x \in (0, 1)}", r"(0,1)", 1.0, "verified"),
    ("left/right parens", r"\boxed{\left(1,2\right)}", "(1,2)", 1.0, "string_match"),
    # (2, 1) cannot be an interval, so it is a tuple and differs from the interval (1, 2).
    ("reversed pair", r"\boxed{(2, 1)}", "(1,2)", 0.0, "wrong"),
    ("tuple", r"\boxed{(1,2,3)}", "(1,2,3)", 1.0, "string_match"),
    ("tuple order matters", r"\boxed{(3,2,1)}", "(1,2,3)", 0.0, "wrong"),
    ("set order does not", r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", 1.0, "verified"),
    ("comma list vs set", r"\boxed{1, 2, 3}", r"\{1,2,3\}", 1.0, "verified"),
    # An inequality is compared with an interval only when the *prediction* is the set (verify is asymmetric).
    ("inequality vs interval gold", r"\boxed{x > 2}", r"(2,\infty)", 0.0, "wrong"),
    ("interval vs inequality gold", r"\boxed{(2,\infty)}", "x>2", 1.0, "verified"),
    ("matrix", r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0,
     "string_match"),
    # --- expressions, equations ------------------------------------------------------------------------------------
    ("expanded polynomial", r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0, "verified"),
    ("commuted sum", r"\boxed{2x+1}", "1+2x", 1.0, "verified"),
    ("braced exponent", r"\boxed{x^{2}}", "x^2", 1.0, "verified"),
    ("symbolic fraction", r"\boxed{\frac{a}{b}}", "a/b", 1.0, "verified"),
    ("equation vs rhs", r"\boxed{y=2x+1}", "2x+1", 1.0, "verified"),
    ("assignment vs value", r"\boxed{x=3}", "3", 1.0, "verified"),
    ("value vs assignment gold", r"\boxed{3}", "x=3", 1.0, "verified"),
    ("inline assignment", r"The answer is $x = \frac{\pi}{2}$", r"\frac{\pi}{2}", 1.0, "verified"),
    # --- multiple-choice letters -----------------------------------------------------------------------------------
    ("letter", r"\boxed{A}", "A", 1.0, "string_match"),
    ("letter in text", r"\boxed{\text{(A)}}", "A", 1.0, "verified"),
    ("wrong letter", r"\boxed{B}", "A", 0.0, "wrong"),
    # --- unboxed answers -------------------------------------------------------------------------------------------
    ("plain number after 'answer is'", "The answer is 42", "42", 1.0, "string_match"),
    ("final answer inline math", "The final answer is $42$.", "42", 1.0, "string_match"),
    ("bare number", "42", "42", 1.0, "string_match"),
    ("markdown answer", "**Answer:** 7", "7", 1.0, "string_match"),
    ("answer with unit word", "Answer: 7 apples", "7", 1.0, "string_match"),
    ("display math", r"\[ \boxed{12} \]", "12", 1.0, "string_match"),
    ("inline parens math", r"The answer is \(\boxed{12}\)", "12", 1.0, "string_match"),
    ("minerva format", r"Final Answer: The final answer is $\frac{3}{4}$. I hope it is correct.", "0.75", 1.0,
     "verified"),
    # --- several boxed answers ---------------------------------------------------------------------------------------
    # Math-Verify collects *all* boxed expressions of the answer into one set: {5, 6} equals neither 5 nor 6.
    ("two boxed joined", r"\boxed{5} and \boxed{6}", "5", 0.0, "wrong"),
    ("two boxed, gold is the last", r"First \boxed{5}. Then, correcting, \boxed{6}", "6", 0.0, "wrong"),
    ("two boxed, gold is the first", r"First \boxed{5}. Then, correcting, \boxed{6}", "5", 0.0, "wrong"),
    ("same answer boxed twice", r"So \boxed{5}. Double-check: \boxed{5}", "5", 1.0, "string_match"),
    # {1/2, 0.5} is one value, so the set matches 0.5.
    ("equal values boxed twice", r"\boxed{\frac{1}{2}} \boxed{0.5}", "0.5", 1.0, "verified"),
    ("nested boxed", r"\boxed{\boxed{5}}", "5", 1.0, "string_match"),
    # --- </think> handling (step a) ----------------------------------------------------------------------------------
    ("answer after think", r"<think>I think \boxed{5}</think> The answer is \boxed{6}", "6", 1.0, "string_match"),
    ("answer only inside think", r"<think>I think \boxed{5}</think> The answer is \boxed{6}", "5", 0.0, "wrong"),
    # No </think> (e.g. truncated reasoning): the rule scores the whole text, so the boxed 5 counts.
    ("unfinished think", r"<think>I think \boxed{5}", "5", 1.0, "string_match"),
    ("text after the last of two </think>", r"<think>a</think>\boxed{3}</think> \boxed{7}", "7", 1.0,
     "string_match"),
    ("nothing after </think>", r"<think>\boxed{5}</think>", "5", 0.0, "no_answer"),
    # --- no answer / malformed LaTeX ---------------------------------------------------------------------------------
    ("empty completion", "", "5", 0.0, "no_answer"),
    ("no math at all", "I don't know.", "5", 0.0, "no_answer"),
    ("empty boxed", r"\boxed{}", "5", 0.0, "no_answer"),
    ("unclosed boxed", r"\boxed{5", "5", 0.0, "no_answer"),
    # Math-Verify returns only its string fallback for unparsable LaTeX: one item, so step (b) gives 0.
    ("unclosed frac", r"\boxed{\frac{1}{2", r"\frac12", 0.0, "no_answer"),
    ("broken inline math", r"$\frac{1}{$", "1", 0.0, "no_answer"),
    ("lone backslash", r"\boxed{\}", "1", 0.0, "no_answer"),
    # --- several acceptable golds / odd gold types -------------------------------------------------------------------
    ("list of golds, second matches", r"\boxed{7}", ["5", "7"], 1.0, "string_match"),
    ("list of golds, verify", r"\boxed{\frac12}", ["0.5", "1/2"], 1.0, "verified"),
    ("list of golds, none", r"\boxed{8}", ["5", "7"], 0.0, "wrong"),
    ("integer gold", r"\boxed{7}", 7, 1.0, "string_match"),
    ("no gold", r"\boxed{7}", [], 0.0, "no_gold"),
    # --- huge / pathological input ----------------------------------------------------------------------------------
    ("1 MB think then answer", "<think>" + "Let me compute. " * 62_500 + r"</think>So \boxed{12}.", "12", 1.0,
     "string_match"),
    ("1 MB without think, answer at end", "Let me compute. " * 62_500 + r"So \boxed{12}.", "12", 1.0,
     "string_match"),
    # Input guard: only the last 8,192 characters are parsed, so an answer at the *start* of 1 MB is not seen.
    ("1 MB, answer at start (guard)", r"The answer is \boxed{12}. " + "Let me compute. " * 62_500, "12", 0.0,
     "no_answer"),
    ("1 MB of '$1+' then answer", "$1+" * 333_333 + r" \boxed{3}", "3", 1.0, "string_match"),
    # 8,192 digits: sympify refuses integers beyond Python's 4,300-digit str limit -> exception -> 0.
    ("1 MB of digits", "1" * MB, "1", 0.0, "parse_error"),
    ("50 nested boxed", "\\boxed{" * 50 + "7" + "}" * 50, "7", 1.0, "string_match"),
    ("50 unclosed boxed", "\\boxed{" * 50 + "7", "7", 0.0, "no_answer"),
]

IDS = [c[0] for c in CASES]
assert len(CASES) >= 60 and len(set(IDS)) == len(IDS)


@pytest.fixture(scope="module")
def pooled():
    reward = MathReward(num_workers=2, timeout=30)  # default warm-up on
    yield reward
    reward.close()


@pytest.fixture(scope="module")
def inproc():
    return MathReward(num_workers=0)


# ------------------------------------------------------------------------------------------------------------------
# The rule
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label,completion,gold,score,status", CASES, ids=IDS)
def test_rule_in_process(inproc, label, completion, gold, score, status):
    assert inproc.score_with_status([completion], [gold]) == [(score, status)]


def test_rule_table_in_worker_pool_one_batch(pooled):
    completions = [c[1] for c in CASES]
    golds = [c[2] for c in CASES]
    got = pooled.score_with_status(completions, golds)
    wrong = [(c[0], (c[3], c[4]), g) for c, g in zip(CASES, got) if (c[3], c[4]) != g]
    assert not wrong, f"(label, expected, got): {wrong}"
    assert pooled(completions, answer=golds) == [c[3] for c in CASES]


def test_extract_final_answer():
    assert extract_final_answer("a</think>b") == "b"
    assert extract_final_answer("a</think>b</think>c") == "c"
    assert extract_final_answer("no think") == "no think"
    assert extract_final_answer("<think>unfinished") == "<think>unfinished"
    assert extract_final_answer("x</think>") == ""


def test_score_answer_directly():
    assert score_answer(r"\boxed{\frac{2}{4}}", ("0.5",)) == (1.0, "verified")
    assert score_answer(r"\boxed{3}", ("3",)) == (1.0, "string_match")
    assert score_answer("nothing", ("3",)) == (0.0, "no_answer")


def test_input_guard_is_configurable(inproc):
    text = r"The answer is \boxed{12}. " + "Let me compute. " * 1_000  # 16 kB
    assert inproc([text], answer=["12"]) == [0.0]
    assert MathReward(num_workers=0, max_answer_chars=None)([text], answer=["12"]) == [1.0]
    assert inproc.prepare("x" * 10_000) == "x" * 8_192


# ------------------------------------------------------------------------------------------------------------------
# Input formats and the TRL interface
# ------------------------------------------------------------------------------------------------------------------


def test_conversational_completions(pooled):
    completions = [
        [{"role": "assistant", "content": r"<think>hmm</think>\boxed{4}"}],
        [{"role": "assistant", "content": r"\boxed{3}"}],
        # several messages: the last one is scored
        [{"role": "assistant", "content": r"\boxed{4}"}, {"role": "assistant", "content": r"\boxed{5}"}],
        # content parts
        [{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{"}, {"type": "text", "text": "4}"}]}],
        [{"role": "assistant", "content": None}],
    ]
    assert pooled(completions, answer=["4", "4", "4", "4", "4"]) == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_list_of_golds_per_sample(pooled):
    completions = [r"\boxed{0.5}", r"\boxed{2}", r"\boxed{x=2}", r"\boxed{9}"]
    answer = [["1/2", "0.5"], ["-2", "2"], ("2",), ["1", "3"]]
    assert pooled(completions, answer=answer) == [1.0, 1.0, 1.0, 0.0]


def test_trl_signature_and_logging_hooks(pooled):
    extra, metrics = {}, {}
    rewards = pooled(
        prompts=["p1", "p2"],
        completions=[r"\boxed{1}", "none"],
        completion_ids=[[1], [2]],
        answer=["1", "1"],
        trainer_state=None,
        log_extra=lambda k, v: extra.__setitem__(k, v),
        log_metric=lambda k, v: metrics.__setitem__(k, v),
    )
    assert rewards == [1.0, 0.0]
    assert extra == {"math_reward_status": ["string_match", "no_answer"]}
    assert metrics == {"math_reward/worker_failures": 0.0}


def test_name_pickle_and_errors():
    from trl.trainer.utils import get_callable_name

    assert math_reward.__name__ == "math_reward"
    assert get_callable_name(math_reward) == "math_reward"
    clone = pickle.loads(pickle.dumps(MathReward(num_workers=0, timeout=7)))
    assert clone.__name__ == "math_reward" and clone.timeout == 7.0
    assert clone([r"\boxed{2}"], answer=["2"]) == [1.0]
    with pytest.raises(ValueError, match="answer"):
        clone([r"\boxed{2}"])
    with pytest.raises(ValueError):
        clone([r"\boxed{2}", "x"], answer=["2"])
    with pytest.raises(ValueError):
        MathReward(parsing_timeout=0.5)  # SIGALRM takes whole seconds
    assert clone([], answer=[]) == []


def test_duplicates_are_scored_once_and_consistently(pooled):
    completions = [r"\boxed{3}", r"\boxed{4}"] * 8
    assert pooled(completions, answer=["3"] * 16) == [1.0, 0.0] * 8


# ------------------------------------------------------------------------------------------------------------------
# Isolation: hangs, crashes, pathological input
# ------------------------------------------------------------------------------------------------------------------

GOOD = [r"\boxed{1}", r"<think>\boxed{9}</think>\boxed{2}", r"\boxed{\frac{6}{2}}", r"\boxed{5}"]
GOOD_GOLD = ["1", "2", "3", "4"]
GOOD_SCORES = [1.0, 1.0, 1.0, 0.0]
# 120 kB of "$1+": Math-Verify's extraction regexes are quadratic on it (~30 s). With Math-Verify's own
# timeouts and our input guard disabled, nothing but the parent's hard deadline can stop it.
SLOW = "$1+" * 40_000


def _unbounded_reward(timeout: float) -> MathReward:
    return MathReward(num_workers=2, timeout=timeout, parsing_timeout=None, verify_timeout=None, warmup=False,
                      max_answer_chars=None)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_hung_sample_is_killed_and_scores_zero():
    reward = _unbounded_reward(timeout=2.0)
    try:
        t0 = time.monotonic()
        got = reward.score_with_status(GOOD[:2] + [SLOW] + GOOD[2:], GOOD_GOLD[:2] + ["1"] + GOOD_GOLD[2:])
        elapsed = time.monotonic() - t0
        assert [s for s, _ in got] == GOOD_SCORES[:2] + [0.0] + GOOD_SCORES[2:]
        assert got[2][1] == "killed_timeout"
        assert elapsed < 15, elapsed  # worker start-up (~2 s) + the 2 s deadline, not the ~30 s of the sample
        assert reward._pool.restarts == 1
        # The pool keeps working after the kill.
        assert reward(GOOD, answer=GOOD_GOLD) == GOOD_SCORES
        pids = [w.proc.pid for w in reward._pool.workers]
    finally:
        reward.close()
    assert all(_gone(p) for p in pids)  # shut down and reaped: no zombies


def test_crashed_worker_only_zeroes_its_sample():
    reward = _unbounded_reward(timeout=60.0)
    slow_index = 1  # position of SLOW among the (deduplicated) tasks
    crashed = []

    def segfault_the_worker_scoring_slow():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not crashed:
            pool = reward._pool
            for w in list(pool.workers) if pool is not None else []:
                if w.task == slow_index:
                    time.sleep(0.2)  # well inside the ~30 s parse
                    os.kill(w.proc.pid, signal.SIGSEGV)
                    crashed.append(w.proc.pid)
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=segfault_the_worker_scoring_slow)
    killer.start()
    try:
        t0 = time.monotonic()
        got = reward.score_with_status([GOOD[0], SLOW] + GOOD[1:], [GOOD_GOLD[0], "1"] + GOOD_GOLD[1:])
        elapsed = time.monotonic() - t0
        killer.join()
        assert crashed, "the slow sample was never seen in a worker"
        assert [s for s, _ in got] == [GOOD_SCORES[0], 0.0] + GOOD_SCORES[1:]
        assert got[1][1] == "worker_crashed"
        assert elapsed < 20, elapsed
        assert reward(GOOD, answer=GOOD_GOLD) == GOOD_SCORES
    finally:
        reward.close()
    assert _gone(crashed[0])


def test_pathological_batch_is_bounded_with_defaults(pooled):
    batch = [
        ("$1+" * 333_333, "3", 0.0),  # 1 MB of a regex-quadratic pattern, no answer
        ("\\boxed{" * 50 + "7" + "}" * 50, "7", 1.0),
        ("\\frac{" * 200 + "1" + "}{2}" * 200, "1", 0.0),
        ("(" * MB, "1", 0.0),
        ("1" * MB, "1", 0.0),
        ("<think>" + "$x$ " * 250_000 + r"</think>\boxed{8}", "8", 1.0),
        (r"\boxed{9^{9^{9}}}", "1", 0.0),  # a comparison Math-Verify itself times out (5 s)
        (r"\boxed{2}", "2", 1.0),
    ]
    t0 = time.monotonic()
    got = pooled([b[0] for b in batch], answer=[b[1] for b in batch])
    elapsed = time.monotonic() - t0
    assert got == [b[2] for b in batch]
    assert elapsed < 25, elapsed


def test_worker_startup_failure_is_loud():
    # A 50 MB address-space cap cannot even hold the interpreter + sympy: the worker dies before it is ready.
    reward = MathReward(num_workers=1, memory_limit_mb=50)
    with pytest.raises(math_module.WorkerStartupError):
        reward([r"\boxed{1}"], answer=["1"])
    assert reward._pool is None


def test_pool_is_not_shared_with_a_forked_child(pooled):
    pooled([r"\boxed{1}"], answer=["1"])
    parent_pool = pooled._pool
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must build its own pool rather than talk to the parent's workers
        try:
            ok = pooled([r"\boxed{1}"], answer=["1"]) == [1.0] and pooled._pool is not parent_pool
            pooled.close()
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    result = os.read(r, 1)
    os.waitpid(pid, 0)
    assert result == b"1"
    assert pooled._pool is parent_pool and pooled([r"\boxed{1}"], answer=["1"]) == [1.0]


def _always_half(text, golds, parsing_timeout, verify_timeout):
    return 0.5, "custom"


def test_custom_score_fn_in_process():
    reward = MathReward(num_workers=0, score_fn=_always_half)
    assert reward.score_with_status([r"\boxed{1}", "x"], ["1", "2"]) == [(0.5, "custom"), (0.5, "custom")]


HEAVY = ("torch", "trl", "transformers")


def _python(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_importing_the_math_reward_does_not_import_torch_trl_or_transformers():
    # A user's score_fn module imports this in every worker: it must not pull in the trainer (7 s per worker).
    result = _python("-c", "import sys, or1_trl.rewards.math, or1_trl.rewards, or1_trl; "
                           f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    # ... and the package's public names still resolve, on first use.
    result = _python("-c", "import sys, or1_trl; from or1_trl import OR1Config, OR1Trainer; print(OR1Trainer.__module__, "
                           "OR1Config.__module__, or1_trl.AdaptiveEntropyController.__name__)")
    last = result.stdout.strip().splitlines()[-1]  # (the trainer's import may log a line first)
    assert last.split() == ["or1_trl.trainer.or1_trainer", "or1_trl.trainer.or1_config", "AdaptiveEntropyController"], result.stderr


USER_MODULE = """
import sys
from or1_trl.rewards.math import score_answer


def score_and_report_imports(text, golds, parsing_timeout, verify_timeout):
    score, status = score_answer(text, golds, parsing_timeout, verify_timeout)
    heavy = [m for m in {heavy!r} if m in sys.modules]
    return score, status + " heavy=" + (",".join(heavy) or "none")
"""


def test_score_fn_from_an_importable_user_module_runs_in_light_workers(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_or1_test.py").write_text(USER_MODULE.format(heavy=HEAVY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_rewards_or1_test

    with MathReward(num_workers=1, warmup=False, score_fn=my_rewards_or1_test.score_and_report_imports) as reward:
        got = reward.score_with_status([r"\boxed{2}", r"\boxed{3}", r"\boxed{0.5}"], ["2", "2", r"\frac{1}{2}"])
    assert got == [(1.0, "string_match heavy=none"), (0.0, "wrong heavy=none"), (1.0, "string_match heavy=none")]


def test_score_fn_defined_in_main_is_refused_before_any_worker_starts(tmp_path):
    script = tmp_path / "train_with_my_score.py"
    script.write_text(
        "from or1_trl.rewards import MathReward\n\n"
        "def my_score(text, golds, parsing_timeout, verify_timeout):\n"
        "    return 1.0, 'mine'\n\n"
        "reward = MathReward(num_workers=1, warmup=False, score_fn=my_score)\n"
        "print(reward(['x'], answer=['1']))\n"
    )
    result = _python(str(script), cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("TypeError: MathReward(score_fn='my_score'): 'my_score' is defined in __main__"), last
    assert "define it in an importable module" in last and "WorkerStartupError" not in result.stderr
    # In-process scoring needs no pickling: the same function works with num_workers=0.
    script.write_text(script.read_text().replace("num_workers=1", "num_workers=0"))
    result = _python(str(script), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "[1.0]", result.stderr


def test_score_fn_that_cannot_be_pickled_is_refused():
    def nested(text, golds, parsing_timeout, verify_timeout):
        return 1.0, "nested"

    for fn in (nested, lambda *args: (1.0, "lambda")):
        with pytest.raises(TypeError, match=r"score_fn cannot be pickled .* must be a module-level function"):
            MathReward(num_workers=1, score_fn=fn)
        assert MathReward(num_workers=0, score_fn=fn)(["x"], answer=["1"]) == [1.0]
    with pytest.raises(TypeError, match="score_fn must be callable"):
        MathReward(num_workers=0, score_fn="score_answer")


# ------------------------------------------------------------------------------------------------------------------
# Exact fast paths of the workers: same results as the plain rule
# ------------------------------------------------------------------------------------------------------------------

# LaTeX that Math-Verify hands to latex2sympy: answers of every kind, strings whose SLL parse bails out but which
# LL parses (the ambiguous ``x^{3}``, relations), and strings that fail in both modes (malformed).
LATEX_CORPUS = [
    "5", "-7", "0.75", "12{,}345", "1,000", "\\frac{3}{4}", "\\dfrac{3}{4}", "3/4", "2\\sqrt{3}", "\\sqrt{12}",
    "3\\pi", "25\\%", "45^\\circ", "[-2, 5)", "(-\\infty, 3]", "x \\in (0, 1)", "(3, -1)", "\\{1, 2, 3\\}", "1, 2",
    "x^2 - 4", "(x-2)(x+2)", "y = 2x + 3", "x = 5", "x > 2", "\\text{(B)}", "\\log_2 8", "\\binom{6}{2}", "2^{10}",
    "a_{n+1} = 2a_n + 1", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "x^{3}", "x^{6}", "x^2 - 16",
    "x^{2}-16", "x^2 + 16", "a_{n+1} = 46 a_n - 5", "\\frac{a+b}{2}", "x^{3} + 3x - 1 = 0", "7 + 8 = 15",
    "\\{-3, 4\\}", "\\{4,-3\\}", "\\left(2, 5\\right)", "\\pi \\cdot 4", "4 \\pi", "x \\leq 3 \\text{ or } x > 5",
    "\\frac{1}{\\sqrt{2}}", "\\sin^2 x + \\cos^2 x", "\\int_0^1 x\\,dx", "\\sum_{k=1}^{n} k", "f(x) = x^2",
    "{\\frac{471}{2}", "{\\frac{y = 6x + 6}{2}", "{\\frac{[-6, 2)}{2}", "\\frac{", "}{", "x^", "((1)", "\\sqrt",
    "1 2 3 (", "\\boxed{", "a = b = c = 3", "3 \\times 10^{5}", "\\overline{AB}", "|x - 1| < 2", "\\infty",
]


def _fast_paths_differential(latex: list[str], cases: list[tuple[str, str]]) -> dict:
    """In a fresh interpreter: convert ``latex`` and score ``cases`` with the plain code, install the fast paths,
    do it again. Returns both results and the two-stage parser's counts."""
    import json
    import subprocess
    import sys

    script = r"""
import json, sys
from sympy import srepr
from latex2sympy2_extended.latex2sympy2 import latex2sympy
from or1_trl.rewards import math as m

m._quiet_math_verify_logs()
latex, cases = json.load(sys.stdin)

def convert(s):
    try:
        return "ok " + srepr(latex2sympy(s, normalization_config=None))
    except Exception as e:
        return "error " + type(e).__name__

def run():
    return [convert(s) for s in latex], [list(m.score_answer(t, tuple(g))) for t, g in cases]

plain = run()
assert m._install_fast_paths()
print(json.dumps({"plain": plain, "fast": run(), "fast_again": run(), "counts": m.TWO_STAGE_COUNTS}))
"""
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps([latex, cases]), capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fast_paths_give_the_plain_results():
    prepare = MathReward(num_workers=0).prepare  # step (a) and the input guard, as the workers get them
    cases = [(prepare(c[1]), list(math_module.normalize_golds(c[2]))) for c in CASES]
    got = _fast_paths_differential(LATEX_CORPUS, cases)
    plain_latex, plain_scores = got["plain"]
    fast_latex, fast_scores = got["fast"]
    diff = [(s, p, f) for s, p, f in zip(LATEX_CORPUS, plain_latex, fast_latex) if p != f]
    assert not diff, f"(latex, plain, two-stage): {diff}"
    assert fast_scores == plain_scores
    assert got["fast_again"] == got["plain"]  # second pass: memoised verify outcomes, warm DFA
    # Both stages were exercised: SLL decided most inputs; LL re-ran the malformed ones and the ambiguous ones.
    assert got["counts"]["sll"] > got["counts"]["ll"] > 0
    by_input = dict(zip(LATEX_CORPUS, plain_latex))
    assert by_input["x^{3}"].startswith("ok") and by_input["{\\frac{471}{2}"].startswith("error")


def test_verify_memo_calls_verify_once_per_distinct_prediction(monkeypatch):
    parse, verify, timeout_exc = math_module._math_verify()
    calls = []

    def counting_verify(gold, pred, **kwargs):
        calls.append(pred[1])
        return verify(gold, pred, **kwargs)

    monkeypatch.setattr(math_module, "_math_verify", lambda: (parse, counting_verify, timeout_exc))
    group = [r"So \boxed{2.0}.", r"Thus \boxed{2.0}", r"\boxed{2.00}", r"\boxed{\sqrt{4}}", r"\boxed{3}",
             r"Hence \boxed{3}.", r"\boxed{2}", r"\boxed{x}", r"\boxed{\sqrt{4}}"]
    plain = [score_answer(t, ("2",)) for t in group]
    n_plain = len(calls)
    monkeypatch.setattr(math_module, "_VERIFY_MEMO", math_module._VerifyMemo())
    memo = [score_answer(t, ("2",)) for t in group]
    assert plain == [(1.0, "verified")] * 4 + [(0.0, "wrong")] * 2 + [(1.0, "string_match"), (0.0, "wrong"),
                                                                     (1.0, "verified")]
    assert memo == plain
    # Verify ran once per distinct parsed prediction: 2.0, 2.00 (another Float precision: another key), sqrt(4),
    # 3 and x; the repeats of 2.0, 3 and sqrt(4) came from the memo.
    assert n_plain == 8 and calls[n_plain:] == ["2.0", "2.00", "\\sqrt{4}", "3", "x"]


def test_verify_memo_keys_are_exact_and_bounded():
    from sympy import Float, Integer, Symbol

    parse, _, _ = math_module._math_verify()
    memo = math_module._VerifyMemo(maxsize=2)
    # Equal under sympy's ``==`` or equal strings, yet not the same prediction for ``verify``: different keys.
    preds = [[Integer(2), "2"], [Integer(2), "2.0"], [Float("2.0", 15), "2.0"], [Float("2.0", 30), "2.0"],
             [Symbol("x"), "x"], [Symbol("x", real=True), "x"], ["2"]]
    keys = [memo.key(p, 5) for p in preds]
    assert len(set(keys)) == len(preds)
    half = parse(r"\boxed{0.5}")
    assert memo.key(half, 5) == memo.key(parse(r"So \boxed{0.5}."), 5) != memo.key(half, 10)
    for k, ok in zip(keys[:3], (True, False, True)):
        memo.put(("g", k), ok)
    assert memo.get(("g", keys[0])) is None  # evicted, least recently used
    assert memo.get(("g", keys[1])) is False and memo.get(("g", keys[2])) is True


def _fast_path_probe(text, golds, parsing_timeout, verify_timeout):
    import sys

    from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy

    worker = sys.modules["_or1_trl_math_reward_worker"]
    return 0.0, f"two_stage={getattr(_Latex2Sympy, '_or1_two_stage', False)} memo={worker._VERIFY_MEMO is not None}"


@pytest.mark.parametrize("fast_paths", [True, False])
def test_workers_install_fast_paths_on_request(fast_paths):
    with MathReward(num_workers=1, warmup=False, fast_paths=fast_paths, score_fn=_fast_path_probe) as reward:
        assert reward.score_with_status(["x"], ["1"]) == [(0.0, f"two_stage={fast_paths} memo={fast_paths}")]
