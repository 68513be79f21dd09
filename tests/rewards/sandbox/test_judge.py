"""The judge of the asserts and function-call formats (issue 45): no completion can stop, hang or grow the trainer;
honest test suites in every shape score 1; no exception or mutation of the program's forges a verdict.

Each attack of the issue, and variants of its class, is run through the real bwrap sandbox in a batch with honest
samples, while the test process watches itself: a background thread must keep ticking (a GIL held by `sum` over a
returned `range(10**15)` stopped every thread of the old trainer) and its peak memory must stay within a bound (a
returned `range(10**12)` under `set` grew it past 4 GiB). Statuses, never durations, are asserted; the only clock is a
generous deadline that a hung call would miss.
"""

from __future__ import annotations

import collections
import resource
import threading
import time

import pytest

from or1_trl.rewards.code import CodeReward
from or1_trl.rewards.sandbox import SandboxUnavailable
from or1_trl.rewards.sandbox.judge import Plan, ProgramError, _program_exception, data_equal

TIMEOUT = 3.0
reward = CodeReward(timeout_per_test=TIMEOUT, total_timeout=30.0, memory_mb=256, max_processes=16,
                    max_output_bytes=1 << 16, num_workers=2, tmpfs_mb=16, min_isolation="bwrap")
partial = CodeReward(timeout_per_test=TIMEOUT, total_timeout=30.0, memory_mb=256, max_processes=16,
                     max_output_bytes=1 << 16, num_workers=2, tmpfs_mb=16, min_isolation="bwrap", partial=True)


@pytest.fixture(scope="module", autouse=True)
def bwrap(sandbox_missing):
    """Both rewards' sandbox, probed once: bwrap, or the module skips (fails under OR1_REQUIRE_SANDBOX=1)."""
    try:
        return reward.sandbox, partial.sandbox
    except SandboxUnavailable as e:
        sandbox_missing(str(e))


def block(program: str) -> str:
    return "```python\n" + program + "\n```"


class Watched:
    """Run the reward while a background thread ticks; the trainer's peak memory growth (MiB) and the ticks."""

    def __init__(self):
        self.ticks = 0
        self._stop = threading.Event()

    def _tick(self):
        while not self._stop.wait(0.01):
            self.ticks += 1

    def __call__(self, fn, *args, **kwargs):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ticker = threading.Thread(target=self._tick, daemon=True)
        ticker.start()
        start = time.monotonic()
        try:
            out = fn(*args, **kwargs)
        finally:
            self._stop.set()
            ticker.join()
        self.elapsed = time.monotonic() - start
        self.grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
        return out


def run_watched(rewarder, completions, tests):
    """The rewards and statuses of a batch, asserting the trainer stayed well: it ticked, stayed small, returned."""
    logged = {}
    watch = Watched()
    out = watch(rewarder, completions, tests, log_extra=logged.__setitem__, log_metric=logged.__setitem__)
    assert watch.ticks > 0, "every thread of the trainer stopped"
    assert watch.grown_mb < 200, f"the trainer grew by {watch.grown_mb:.0f} MiB"
    assert watch.elapsed < 120, f"the batch took {watch.elapsed:.0f} s"  # generous: a hang would never return
    return out, logged["code_reward_status"]


# ---------------------------------------------------------------------------------------------------------------
# 1. Nothing of a completion runs, or is iterated, in the trainer
# ---------------------------------------------------------------------------------------------------------------

HONEST_F = "def f(x):\n    return 2 * x\n"


def test_program_imports_are_not_replayed_in_the_trainer():
    # `from unittest.__main__ import *` made the old trainer exit while it prepared the sample (its imports were
    # replayed there). Now they run in the program process (which exits: the sample is an error) and, where the
    # test names one of their names, in an entry process of the judge: never here.
    exiting = ["from unittest.__main__ import *", "import venv.__main__", "import this\nimport sys\nsys.exit(0)"]
    names_them = "assert f(2) == 4 and main is not None"  # `main` is bound by nothing but the program's imports
    harmless = ["import this", "from pydoc import *\nhelp()", "from unittest import *", "from json.tool import *"]
    completions = [block(head + "\n" + HONEST_F) for head in exiting + harmless]
    tests = [{"asserts": ["assert f(2) == 4", names_them]}] * len(exiting) + [{"asserts": ["assert f(2) == 4"]}] * 4
    out, statuses = run_watched(reward, completions, tests)
    assert out == [0.0] * len(exiting) + [1.0] * len(harmless), statuses
    assert statuses[:len(exiting)] == ["error"] * len(exiting)
    # the test names a name only an un-replayable import binds: unusable there, never imported in the trainer
    out, statuses = run_watched(reward, [block("def f(x):\n    return 2 * x\nfrom unittest import main")],
                                [{"asserts": [names_them]}])
    assert out == [1.0], statuses  # `from unittest import main` is a plain stdlib import: replayed in the judge


#: Returned data that drives unbounded work in whoever consumes it: (program, test, statuses it may end with).
BOMBS = {
    "range(10**12) under set (the issue's MBPP 2)": (
        "def similar_elements(a, b):\n    return range(10**12)",
        "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))", {"memory_limit", "timeout"}),
    "range(10**15) under sum": ("def f(x):\n    return range(10**15)", "assert sum(f(3)) == 6", {"timeout"}),
    "range under sorted": ("def f(x):\n    return range(10**12)", "assert sorted(f(3)) == [1, 2]",
                           {"memory_limit", "timeout"}),
    "range under len(list())": ("def f(x):\n    return range(10**12)", "assert len(list(f(3))) == 2",
                                {"memory_limit", "timeout"}),
    "range under in (a list)": ("def f(x):\n    return range(10**12)", "assert -1 in list(f(3))",
                                {"memory_limit", "timeout"}),
    "huge string": ("def f(x):\n    return 'x' * (1 << 26)", "assert f(3) == 'xxx'",
                    {"output_limit", "unjudgeable", "wrong"}),
    "deeply nested list": ("def f(x):\n    a = []\n    for _ in range(10**5):\n        a = [a]\n    return a",
                           "assert f(3) == [[]]", {"unjudgeable"}),
    "cyclic list": ("def f(x):\n    a = []\n    a.append(a)\n    return a", "assert f(3) == [[]]", {"unjudgeable"}),
    "endless generator": ("def f(x):\n    while True:\n        yield x", "assert list(f(3)) == [3]",
                          {"unjudgeable", "timeout"}),
    "test loops on a returned value": ("def f(x):\n    return 1", "while f(3):\n    pass", {"timeout"}),
}

LINKED_PREFIX = ("class ListNode:\n    def __init__(self, val=0, next=None):\n        self.val = val\n"
                 "        self.next = next\n"
                 "def to_list(head):\n    out = []\n    while head:\n        out.append(head.val)\n"
                 "        head = head.next\n    return out\n")


def test_returned_bombs_end_in_the_sandbox():
    names = list(BOMBS)
    completions = [block(BOMBS[n][0]) for n in names]
    tests = [{"asserts": [BOMBS[n][1]]} for n in names]
    # a one-node cycle returned to the prefix's `to_list` (it grew the old trainer to 3.7 GiB), beside honest ones
    cycle = block("class Solution:\n    def loop(self, head):\n        head.next = head\n        return head")
    honest = block("class Solution:\n    def loop(self, head):\n        return head")
    linked = {"asserts": ["assert to_list(Solution().loop(ListNode(1))) == [1]"], "import_prefix": LINKED_PREFIX}
    out, statuses = run_watched(reward, completions + [cycle, honest, block(HONEST_F)],
                                tests + [linked, linked, {"asserts": ["assert f(2) == 4"]}])
    assert out == [0.0] * (len(names) + 1) + [1.0, 1.0], dict(zip(names + ["cycle"], statuses))
    for name, status in zip(names, statuses):
        assert status in BOMBS[name][2], (name, status)
    assert statuses[len(names)] in {"memory_limit", "timeout"}


#: The function-call format's bombs: what the program returns to ``f(3)`` (expected ``[3]``), and how it may end. The
#: judge decodes and compares the value in the sandbox; the trainer only gets the record.
CALL_BOMBS = {
    "range(10**12)": ("return range(10**12)", {"wrong"}),  # a range is not the expected list, whatever its length
    "huge flat list": ("return [[0] * 1000] * 10**6", {"timeout", "memory_limit", "output_limit"}),
    "deeply nested list": ("a = []\n    for _ in range(10**5):\n        a = [a]\n    return a", {"unjudgeable"}),
    "cyclic list": ("a = [x]\n    a.append(a)\n    return a", {"unjudgeable"}),
    "cyclic dict": ("d = {}\n    d[0] = d\n    return [d]", {"unjudgeable"}),
    "endless generator": ("while True:\n        yield x", {"unjudgeable", "timeout"}),
}


def test_function_call_bombs_end_in_the_sandbox():
    names = list(CALL_BOMBS)
    call = {"fn_name": "f", "inputs": [[3]], "outputs": [[3]]}
    completions = [block(f"def f(x):\n    {CALL_BOMBS[n][0]}") for n in names]
    # a one-node cycle of the prefix's ListNode: rebuilt by reference in the judge, then not the expected list
    cycle = block("class Solution:\n    def f(self, x):\n        h = ListNode(x)\n        h.next = h\n"
                  "        return h")
    linked = dict(call, import_prefix=LINKED_PREFIX)
    honest = [block("def f(x):\n    return [x]"), block("class Solution:\n    def f(self, x):\n        return (x,)")]
    out, statuses = run_watched(reward, completions + [cycle] + honest, [call] * len(names) + [linked] + [call] * 2)
    assert out == [0.0] * (len(names) + 1) + [1.0, 1.0], dict(zip(names + ["cycle"], statuses))
    for name, status in zip(names, statuses):
        assert status in CALL_BOMBS[name][1], (name, status)
    assert statuses[len(names)] == "wrong"


def test_a_sample_never_costs_more_than_its_deadline():
    # Many entries, each one a bomb: the sample is cut at its total deadline, not at entries x timeout.
    short = CodeReward(timeout_per_test=TIMEOUT, total_timeout=8.0, memory_mb=256, max_processes=16, num_workers=1,
                       tmpfs_mb=16, min_isolation="bwrap", partial=True)
    watch = Watched()
    result = watch(short.evaluate, block("def f(x):\n    return range(10**15)"),
                   {"asserts": ["assert sum(f(3)) == 6"] * 10})
    assert result["reward"] == 0.0 and result["status"] in ("timeout", "total_timeout"), result
    assert watch.elapsed < 60, watch.elapsed


# ---------------------------------------------------------------------------------------------------------------
# 2. Honest test suites in every shape: many asserts, loops, randomness, state
# ---------------------------------------------------------------------------------------------------------------

CHECK_40 = "def check(candidate):\n" + "".join(f"    assert candidate({k}, {k + 1}) == {2 * k + 1}\n"
                                              for k in range(40))
HUMANEVAL_53 = ("import random\n\ndef check(candidate):\n    assert candidate(0, 1) == 1\n"
                "    assert candidate(1, 0) == 1\n    assert candidate(2, 3) == 5\n"
                "    assert candidate(5, 7) == 12\n    assert candidate(7, 5) == 12\n\n"
                "    for i in range(100):\n        x, y = random.randint(0, 1000), random.randint(0, 1000)\n"
                "        assert candidate(x, y) == x + y\n\ncheck(add)\n")
RANDOM = ["import random\nx = random.random()\nassert add(x, 1) == x + 1"] * 3
NEXT_ID = "_n = 0\ndef next_id():\n    global _n\n    _n += 1\n    return _n\n"


def test_honest_suites_score_one_and_their_wrong_twins_zero():
    add = block("def add(x, y):\n    return x + y")
    off = block("def add(x, y):\n    return x + y if x < 39 else 0")  # fails the 40th assert only
    samples = [
        (add, {"asserts": [CHECK_40 + "check(add)"]}),
        (add, {"asserts": [CHECK_40 + "check(add)"] * 2}),
        (add, {"asserts": [HUMANEVAL_53]}),
        (add, {"asserts": RANDOM}),
        (block(NEXT_ID), {"asserts": ["assert next_id() == 1\nassert next_id() == 2"]}),
        (block(NEXT_ID), {"asserts": ["assert next_id() == 1", "assert next_id() == 2"]}),  # state across entries
        (off, {"asserts": [CHECK_40 + "check(add)"]}),
        (block("def add(x, y):\n    return x + y + (x == 999)"), {"asserts": [HUMANEVAL_53.replace(
            "for i in range(100)",  # every x once: the wrong one is met
            "for x in range(1001):\n        assert candidate(x, 0) == x\n    for i in range(1)")]}),
        (block("def next_id():\n    return 1"), {"asserts": ["assert next_id() == 1", "assert next_id() == 2"]}),
    ]
    out, statuses = run_watched(reward, [c for c, _ in samples], [t for _, t in samples])
    assert out == [1.0] * 6 + [0.0] * 3, statuses
    assert statuses[6:] == ["wrong"] * 3


def test_the_first_entry_needs_the_program_loaded():
    # Every entry is judged against a program that loaded without error (it ran once): a test with no call still
    # fails when the program cannot load.
    out, statuses = run_watched(reward, [block("raise ValueError('no')\n" + HONEST_F), block(HONEST_F)],
                                [{"asserts": ["assert True"]}] * 2)
    assert out == [0.0, 1.0] and statuses == ["error", "pass"]


def test_partial_credit_survives_a_hung_entry():
    # An entry that leaves the program mid-call (it loops): the next entry gets a fresh program process.
    code = block("def f(x):\n    while x < 0:\n        pass\n    return 2 * x")
    out, statuses = run_watched(partial, [code], [{"asserts": ["assert f(-1) == 0", "assert f(2) == 4",
                                                               "assert f(3) == 6"]}])
    assert out == [pytest.approx(2 / 3)], statuses


# ---------------------------------------------------------------------------------------------------------------
# 3. Verdicts a program cannot forge
# ---------------------------------------------------------------------------------------------------------------

STOPPING = ["StopIteration", "StopAsyncIteration"]
STOP_TESTS = ["assert all(map(f, [2, 3, 5, 7]))", "assert list(filter(f, [1, 3, 5])) == []",
              "assert not any(map(f, [1, 2]))", "assert [y for y in map(f, [1, 2])] == []",
              "assert next(map(f, [1]), 'none') == 'none'", "assert list(iter(lambda: f(1), 5)) == []",
              "assert sum(map(f, [1, 2])) == 0", "assert dict(zip([1], map(f, [1]))) == {}"]


def test_a_program_exception_never_steers_the_judges_iteration():
    programs, tests = [], []
    for exc in STOPPING:
        for test in STOP_TESTS:
            programs.append(block(f"def f(x):\n    raise {exc}"))
            tests.append({"asserts": [test]})
    expecting = block("def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x")
    expected_exception = ("try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False\n"
                          "assert list(filter(f, [0, 1, 2])) == [1, 2]")
    out, statuses = run_watched(reward, programs + [expecting], tests + [{"asserts": [expected_exception]}])
    assert out == [0.0] * len(programs) + [1.0], statuses
    assert set(statuses[:-1]) == {"wrong"}


def test_program_exceptions_as_the_test_sees_them():
    assert type(_program_exception("ValueError", "f")) is ValueError
    assert type(_program_exception("UnicodeDecodeError", "f")) is UnicodeDecodeError  # wants 5 arguments
    for name in ("StopIteration", "StopAsyncIteration", "SystemExit", "KeyboardInterrupt", "GeneratorExit",
                 "MyError", "__class__"):
        exc = _program_exception(name, "f")
        assert type(exc) is ProgramError and name in str(exc)


def test_data_equal_is_exact_but_for_float_expectations():
    # an integer expectation exactly, a float one within 1e-6 relative (1e-9 absolute), whichever side is a float
    assert not data_equal(10000001.0, 10000000) and not data_equal(10000003.0, 10000000)
    assert data_equal(10000000.0, 10000000) and data_equal(10000000, 10000000)
    assert data_equal(2, 2.0000000001) and data_equal(0.1 + 0.2, 0.3) and not data_equal(2.1, 2.0)
    assert data_equal(10000001.0, 10000000.0) and not data_equal(10000100.0, 10000000.0)  # 1e-7 in, 1e-5 out
    assert data_equal(1e-10, 0.0) and not data_equal(1e-8, 0.0)
    assert not data_equal(float("nan"), float("nan")) and data_equal(float("inf"), float("inf"))
    # bool only bool; tuples equal lists, nested; dicts by keys and values; other types exactly
    assert not data_equal([10000001.0], [10000000]) and not data_equal(True, 1) and not data_equal(1, True)
    assert data_equal((1, [2.0000000001, "a"]), [1, (2.0, "a")]) and not data_equal([1, 2], [1, 2, 3])
    assert data_equal({"a": [1.0000000001]}, {"a": (1.0,)}) and not data_equal({"a": 1}, {"b": 1})
    assert not data_equal(collections.Counter(a=1), {"a": 1}) and not data_equal(range(3), [0, 1, 2])
    assert not data_equal(iter([1]), [1]) and not data_equal("1", 1) and not data_equal(None, 0)
    assert data_equal({1, 2}, {2, 1}) and not data_equal({1, 2}, [1, 2]) and data_equal(None, None)
    with pytest.raises(OverflowError):  # an int beyond any float against a float expectation: the judge says wrong
        data_equal(10**400, 1.0)


def test_an_integer_expectation_is_matched_exactly():
    call = {"fn_name": "f", "inputs": [[1]], "outputs": [10000000]}
    close = {"fn_name": "f", "inputs": [[1]], "outputs": [[1.0, 10000000.0]]}
    codes = ["def f(x):\n    return 10000001.0", "def f(x):\n    return 10000003.0", "def f(x):\n    return 10000000",
             "def f(x):\n    return 10000000.0", "def f(x):\n    return [1.0000005, 10000005]",
             "def f(x):\n    return [1.00001, 10000000]", "def f(x):\n    return [1, 10**400]"]
    out, statuses = run_watched(reward, [block(c) for c in codes], [call] * 4 + [close] * 3)
    assert out == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0], statuses
    assert statuses[-1] == "wrong"


def test_no_sample_changes_what_another_is_judged_against():
    prefix = "NUMS = [1, 2, 3]\n"
    mutating = block("def total(a):\n    s = sum(a)\n    a[:] = [-100]\n    return s")
    honest = block("def total(a):\n    return sum(a)")
    tests = {"asserts": ["assert total(NUMS) == 6", "assert NUMS == [1, 2, 3] and total(NUMS) == 6"],
             "import_prefix": prefix}
    out, statuses = run_watched(reward, [mutating, honest, mutating, honest], [tests] * 4)
    assert out == [1.0] * 4, statuses  # every entry sees the prefix's own NUMS
    assert reward([honest], [tests]) == [1.0]
    # within an entry the write-back is the test's to see (a program sorting a list in place)
    seen = {"asserts": ["assert total(NUMS) == 6 and NUMS == [-100]"], "import_prefix": prefix}
    assert reward([mutating, honest], [seen] * 2) == [1.0, 0.0]


def test_the_plan_runs_the_prefix_afresh():
    # Each sample's judge runs its prefix itself: no namespace is shared between two plans.
    a = Plan("def f(x):\n    return x", "NUMS = [1, 2, 3]\n", ["assert f(1) == 1"])
    b = Plan("def f(x):\n    return x", "NUMS = [1, 2, 3]\n", ["assert f(1) == 1"])
    a.prefix_ns["NUMS"][:] = [0]
    assert b.prefix_ns["NUMS"] == [1, 2, 3] and a.program == {"f": "def"}
    assert Plan("x", "raise ValueError('bad prefix')", []).error.startswith("the import prefix failed")


#: A program that looks for the test's expected value everywhere it can read while the judge runs: its own memory
#: (a fork of the driver), every process's memory, fds, command line and environment, its stdin and /tmp.
SNOOP = r'''
import os, re, sys

PATTERN = re.compile(rb"SECRET_TAG_(\d+)")


def _found(data):
    m = PATTERN.search(data)
    return int(m.group(1)) if m else None


def _read(path, limit=1 << 22):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _memory(pid):
    """Every readable mapping of ``pid``: its own through ctypes (a non-dumpable process cannot open its own
    /proc/self/mem), another's through /proc/<pid>/mem."""
    import ctypes

    out = []
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = None if pid == str(os.getpid()) else open(f"/proc/{pid}/mem", "rb", 0)
    except OSError:
        return out
    for line in maps:
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        named = fields[-1] if len(fields) > 5 else ""
        if "r" not in fields[1] or hi - lo > 1 << 28 or named not in ("", "[heap]", "[stack]"):
            continue  # the heap and anonymous memory (files mapped past their end fault when read)
        try:
            if mem is None:
                out.append(ctypes.string_at(lo, hi - lo))
            else:
                mem.seek(lo)
                out.append(mem.read(hi - lo))
        except (OSError, ValueError, OverflowError):
            pass
    return out


def snoop():
    seen = [_read("/dev/stdin"), _read("/proc/self/fd/0")]
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        seen += _memory(pid)
        for name in ("cmdline", "environ"):
            seen.append(_read(f"/proc/{pid}/{name}"))
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        seen += [_read(f"/proc/{pid}/fd/{fd}") for fd in fds]
    # The interpreter's own trees are the host's files, bound read-only (a venv in a clone under /tmp lies there):
    # the judge writes nothing into them, and reading its 60 000 files would only run the program out of time.
    interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for root, dirs, files in os.walk("/tmp"):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in interpreter]
        seen += [_read(os.path.join(root, f)) for f in files]
    for data in seen:
        value = _found(data)
        if value is not None:
            return value
    return 0


AT_LOAD = snoop()


def leak():
    return AT_LOAD or snoop()


def leak_tag():  # the function-call format's: the expected value is the tag itself
    value = leak()
    return "SECRET_TAG_%d" % value if value else ""
'''


def test_the_program_never_sees_the_tests():
    # The test's text (and its expected value) lives in the judge alone: a program reading every memory, fd and file
    # it can reach, at load and while the judge waits on its call, finds nothing. Its twin test (the tag in the
    # prefix, which the program runs) shows the scan does find what is readable. The same for a function-call test's
    # expected value.
    tag_prefix = "TAG = b'SECRET_TAG_31337271828'\n"
    hidden = {"asserts": ["# SECRET_TAG_31337271828\nassert leak() == 31337271828"] * 2}
    visible = {"asserts": ["assert leak() == 31337271828"], "import_prefix": tag_prefix}
    hidden_call = {"fn_name": "leak_tag", "inputs": [[], []], "outputs": ["SECRET_TAG_31337271828"] * 2}
    visible_call = dict(hidden_call, import_prefix=tag_prefix)
    out, statuses = run_watched(partial, [block(SNOOP)] * 4, [hidden, visible, hidden_call, visible_call])
    assert out == [0.0, 1.0, 0.0, 1.0], statuses
