"""The code reward's verdict cannot be influenced by the program (issue 32, point 1).

Asserts format: the test code runs in the sandbox's judge on pristine builtins and modules; only calls of the
program's names cross to the program's process, and only data comes back (:mod:`or1_trl.rewards.sandbox.judge`). A
generated family of attacks — every builtin name and every
public attribute of `math`, `operator` and `functools` that an assert could name, rebound by the program — must
all score 0 against a wrong solution (they scored 1 with the previous verifier, which ran the assert's operands in
the program's namespace), and honest solutions in the same shapes must all score 1. The stdin/stdout and
function-call formats get the same hostile programs. Real bwrap sandbox throughout (no mocks).
"""

from __future__ import annotations

import builtins
import functools
import keyword
import math
import operator

import pytest

from or1_trl.data.released import SKYWORK_IMPORT_PROMPT, code_tests
from or1_trl.rewards.code import CodeReward
from or1_trl.rewards.sandbox import SandboxUnavailable

reward = CodeReward(timeout_per_test=4.0, total_timeout=30.0, memory_mb=256, max_processes=16,
                    max_output_bytes=1 << 16, num_workers=2, tmpfs_mb=16, min_isolation="bwrap")
explain = reward.evaluate


@pytest.fixture(scope="module", autouse=True)
def isolated(sandbox_missing):
    try:
        return reward.sandbox
    except SandboxUnavailable as e:
        sandbox_missing(str(e))


def block(code: str) -> str:
    return f"```python\n{code}\n```"


#: An object a naive verifier (one that evaluates the assert where the program ran) would accept anywhere.
ANY = ("class _Any:\n"
       "    def __eq__(s, o): return True\n"
       "    def __ne__(s, o): return False\n"
       "    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n"
       "    def __bool__(s): return True\n"
       "    def __hash__(s): return 0\n"
       "    def __call__(s, *a, **k): return s\n"
       "    def __getattr__(s, n): return s\n"
       "_any = _Any()\n")
WRONG_F = "def f(x):\n    return 0\n"  # the honest f(2) is 4
HONEST_F = "def f(x):\n    return 2 * x\n"
#: Builtins the family only compares, never calls, in the judge (they would read stdin, open fd 0, start pdb...).
NOT_CALLED = {"input", "open", "breakpoint", "help", "exit", "quit", "print", "copyright", "credits", "license"}


PREFIX_NAMES: dict = {}
exec(SKYWORK_IMPORT_PROMPT, PREFIX_NAMES)


def _family():
    """(name, rebinding, test) for every name an assert could use: the program rebinds the name (its global, the
    builtins/module attribute) to something that satisfies the assert; its f returns a wrong value."""
    cases = []
    for name in sorted(n for n in dir(builtins) if not n.startswith("_") and not keyword.iskeyword(n)):
        rebind = f"import builtins\n{name} = {{v}}\nbuiltins.{name} = {{v}}\n"
        cases.append((name, rebind.format(v="_any"), f"assert f(2) == 4 or {name} == 'x'"))
        if name not in NOT_CALLED:
            cases.append((name + "()", rebind.format(v="lambda *a, **k: 'x'"),
                          f"assert f(2) == 4 or {name}(f(2)) == 'x'"))
    for mod in (math, operator, functools):
        for name in sorted(n for n in dir(mod) if not n.startswith("_")):
            rebind = f"import {mod.__name__}\n{mod.__name__}.{name} = {{v}}\n{name} = {{v}}\n"
            cases.append((f"{mod.__name__}.{name}", rebind.format(v="_any"),
                          f"import {mod.__name__}\nassert f(2) == 4 or {mod.__name__}.{name} == 'x'"))
            cases.append((f"{mod.__name__}.{name}()", rebind.format(v="lambda *a, **k: 'x'"),
                          f"import {mod.__name__}\nassert f(2) == 4 or {mod.__name__}.{name}(f(2)) == 'x'"))
            if name in PREFIX_NAMES:  # the bare name, bound by the test's prefix (Skywork's `from math import *`...)
                cases.append((f"{name} (prefix)", rebind.format(v="lambda *a, **k: 'x'"),
                              f"assert f(2) == 4 or {name}(f(2)) == 'x'"))
    return cases


FAMILY = _family()
GROUP = 24  # attacks per program (one sandbox, one process per assert): keeps the family fast on 2 cores


def test_generated_attack_family_scores_zero():
    # Each program rebinds GROUP names; each of its asserts uses one. partial=True: every assert must fail on its
    # own, as a wrong answer judged by the judge (the program process encodes with the pristine builtins, so rebinding
    # `isinstance` or `str` does not turn a judgment into a crash).
    assert len(FAMILY) > 500
    partial = CodeReward(timeout_per_test=4.0, total_timeout=60.0, memory_mb=256, max_processes=16, num_workers=2,
                         partial=True, min_isolation="bwrap")
    groups = [FAMILY[k:k + GROUP] for k in range(0, len(FAMILY), GROUP)]
    programs = [block(ANY + "".join(r for _, r, _ in g) + WRONG_F) for g in groups]
    tests = [{"asserts": [t for _, _, t in g], "import_prefix": SKYWORK_IMPORT_PROMPT} for g in groups]
    logged = {}
    out = partial(programs, tests, log_extra=logged.__setitem__)
    passed = [g for g, r in zip(groups, out) if r != 0.0]
    assert not passed, f"attacks that passed: {[[n for n, _, _ in g] for g in passed]}"
    assert set(logged["code_reward_status"]) == {"wrong"}, logged


def test_same_shapes_with_an_honest_function_score_one():
    # The family's asserts, with a correct f and no rebinding: every one passes.
    groups = [FAMILY[k:k + GROUP] for k in range(0, len(FAMILY), GROUP)]
    tests = [{"asserts": [t for _, _, t in g], "import_prefix": SKYWORK_IMPORT_PROMPT} for g in groups]
    assert reward([block(HONEST_F)] * len(groups), tests) == [1.0] * len(groups)


#: The issue's four attacks, verbatim (each scored 1.0 with the previous verifier), and honest solutions of the
#: same tests.
ISSUE_ATTACKS = [
    ("set = lambda *a: 0\ndef similar_elements(a, b):\n    return None",
     "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"),
    ("import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0",
     "assert math.isclose(f(2), 1.41421356, rel_tol=1e-6)"),
    ("abs = lambda x: 0\ndef f(x):\n    return 0", "assert abs(f(2) - 1.41421356) < 1e-6"),
    ("import math\nmath.sqrt = lambda x: 0\ndef f(x):\n    return 0", "assert f(2) == math.sqrt(2)"),
]
ISSUE_HONEST = [
    "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
    "import math\ndef f(x):\n    return math.sqrt(x)",
    "def f(x):\n    return x ** 0.5",
    "import math\ndef f(x):\n    return math.sqrt(x)",
]


def test_the_issue_attacks_fail_and_honest_solutions_pass():
    tests = [{"asserts": [t]} for _, t in ISSUE_ATTACKS]
    assert reward([block(p) for p, _ in ISSUE_ATTACKS] + [block(p) for p in ISSUE_HONEST], tests + tests) == \
        [0.0] * 4 + [1.0] * 4


#: Hostile return values and harness tampering, each against `assert f(2) == 4`.
HOSTILE = {
    "always-equal object": ANY + "def f(x):\n    return _any",
    "int subclass": "class I(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
                    "def f(x):\n    return I(0)",
    "str subclass": "class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\n"
                    "def f(x):\n    return S('0')",
    "list subclass": "class L(list):\n    def __eq__(s, o): return True\ndef f(x):\n    return L()",
    "raising __eq__": "class R:\n    def __eq__(s, o): raise AssertionError\n    def __bool__(s): raise TypeError\n"
                      "def f(x):\n    return R()",
    "custom __bool__/__hash__": "class B:\n    def __bool__(s): return True\n    def __hash__(s): return 4\n"
                                "def f(x):\n    return B()",
    "early exit": "import os\nos._exit(0)\ndef f(x):\n    return 4",
    "forged results": "import os\nos.write(3, b'{\"results\": [{\"v\": 9}]}')\nos._exit(0)\ndef f(x):\n    return 0",
    # (whatever the program makes the harness send is data: forged data equal to the answer would be the answer)
    "patched json and encoder": "import json, sys\njson.dumps = lambda *a, **k: '{\"results\": [{\"v\": 4}]}'\n"
                                "m = sys.modules['__main__']\nm.encode_value = lambda *a, **k: {'d': 'junk'}\n"
                                "def f(x):\n    return 0",
    "patched AssertionError": "import builtins\nbuiltins.AssertionError = KeyError\ndef f(x):\n    return 0",
    "raises": "def f(x):\n    raise ValueError('no')",
    "exits": "import sys\ndef f(x):\n    sys.exit(0)",
}


def test_hostile_values_and_tampering_fail():
    names = list(HOSTILE)
    out = [explain(block(HOSTILE[n]), {"asserts": ["assert f(2) == 4"]}) for n in names]
    assert [r["reward"] for r in out] == [0.0] * len(names), {n: r["status"] for n, r in zip(names, out)}
    status = {n: r["status"] for n, r in zip(names, out)}
    for n in ("always-equal object", "int subclass", "str subclass", "list subclass", "raising __eq__"):
        assert status[n] == "unjudgeable", status
    assert status["early exit"] == "no_result" and status["raises"] == "wrong", status


#: Honest solutions in the shapes of MBPP, HumanEval and LeetCode tests.
HONEST = [
    ("import math\ndef hyp(a, b):\n    return math.hypot(a, b)",
     ["assert math.isclose(hyp(1, 1), 1.41421356, rel_tol=1e-6)", "assert abs(hyp(3, 4) - 5) < 1e-9"]),
    ("def common(a, b):\n    return list(set(a) & set(b))",
     ["assert set(common([1, 2, 3], [2, 3, 4])) == {2, 3}", "assert sorted(common([5, 1], [1, 5])) == [1, 5]"]),
    ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
     ["assert fib(fib(5)) == 5", "assert fib(10) == 55"]),
    ("from collections import Counter\ndef freq(s):\n    return Counter(s)",
     ["assert freq('aab') == {'a': 2, 'b': 1}", "assert freq('ab').most_common(1)[0][1] == 1"]),
    ("def squares(n):\n    return (i * i for i in range(n))\n"
     "def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)",
     ["assert list(squares(4)) == [0, 1, 4, 9]", "assert list(evens(range(5))) == [0, 2, 4]"]),
    ("def sort_in_place(xs):\n    xs.sort()", ["a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]"]),
    ("def safe_div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b is 0')\n    return a / b",
     ["try:\n    safe_div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    assert False",
      "assert safe_div(1, 4) == 0.25"]),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n"
     "    def push(self, x):\n        self.items.append(x)\n"
     "    def pop(self):\n        return self.items.pop()\n    def size(self):\n        return len(self.items)",
     ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.size() == 1"]),
    ("def pairs(d):\n    return sorted(d.items())\ndef keys(d):\n    return d.keys()",
     ["assert pairs({'b': 2, 'a': 1}) == [('a', 1), ('b', 2)]", "assert keys({1: 2}) == {1}"]),
    ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",  # named like the prefix's math.gcd
     ["assert gcd(12, 8) == 4"]),
    ("import itertools\ndef perms(xs):\n    return [list(p) for p in itertools.permutations(xs)]",
     ["assert len(perms([1, 2, 3])) == 6 and [3, 2, 1] in perms([1, 2, 3])"]),
]


def test_honest_solutions_in_every_shape_pass():
    out = [explain(block(code), {"asserts": tests, "import_prefix": SKYWORK_IMPORT_PROMPT}) for code, tests in HONEST]
    assert [r["reward"] for r in out] == [1.0] * len(HONEST), [r["reason"] for r in out if r["reward"] != 1.0]


def test_released_layouts_humaneval_and_leetcode():
    # The data converters' specs: HumanEval-style check(candidate) and LeetCode's `Solution().method` entry point.
    humaneval = code_tests({"import_prefix": "import math\n", "entry_point": "add",
                            "test_code": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
                                         "    assert math.isclose(candidate(0.1, 0.2), 0.3)\n"})
    leetcode = code_tests({"import_prefix": "from typing import *\n", "entry_point": "Solution().twoSum",
                           "test_code": "def check(candidate):\n"
                                        "    assert candidate(nums = [2,7,11,15], target = 9) == [0,1]\n"
                                        "    assert candidate(nums = [3,2,4], target = 6) == [1,2]\n"})
    two_sum = ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        seen = {}\n"
               "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
               "                return [seen[target - x], i]\n            seen[x] = i\n")
    cheat_check = ANY + "def check(candidate):\n    pass\nimport math\nmath.isclose = _any\n" \
                        "def add(a, b):\n    return _any"
    cheat_solution = ANY + "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"
    out = reward([block("def add(a, b):\n    return a + b"), block(two_sum), block(cheat_check), block(cheat_solution)],
                 [humaneval, leetcode, humaneval, leetcode])
    assert out == [1.0, 1.0, 0.0, 0.0]


LEETCODE_PREFIX = """from typing import *
class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next
def list_node(values: list):
    head = None
    for val in reversed(values):
        head = ListNode(val, head)
    return head
def is_same_list(p1, p2):
    while p1 and p2:
        if p1.val != p2.val:
            return False
        p1, p2 = p1.next, p2.next
    return p1 is None and p2 is None
"""


def test_prefix_classes_cross_as_data():
    # LeetCode's linked lists: the test builds ListNode objects of its (pristine) prefix; the program's come back
    # as data rebuilt with that class, by reference (a 1000-node list needs no recursion).
    tests = code_tests({"import_prefix": LEETCODE_PREFIX, "entry_point": "Solution().reverseList",
                        "test_code": "def check(candidate):\n"
                                     "    assert is_same_list(candidate(head = list_node([1, 2, 3])), "
                                     "list_node([3, 2, 1]))\n"
                                     "    assert is_same_list(candidate(head = list_node(list(range(1000)))), "
                                     "list_node(list(range(999, -1, -1))))\n"
                                     "    assert candidate(head = None) is None\n"})
    honest = ("class Solution:\n    def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:\n"
              "        prev = None\n        while head:\n            head.next, prev, head = prev, head, head.next\n"
              "        return prev")
    wrong = "class Solution:\n    def reverseList(self, head):\n        return head"
    cheat = ("class ListNode:\n    def __init__(self, val=0, next=None):\n        self.val, self.next = val, next\n"
             "    def __eq__(s, o):\n        return True\n"
             "class Solution:\n    def reverseList(self, head):\n        return head")
    assert reward([block(honest), block(wrong), block(cheat)], [tests] * 3) == [1.0, 0.0, 0.0]


def test_loops_and_nested_calls():
    # A call that needs an earlier call's result (a loop, f(g(x))): each is a round trip to the program's process.
    tests = {"asserts": ["def check(candidate):\n    acc = 0\n    for x in range(6):\n        acc = candidate(acc)\n"
                         "    assert acc == 6\ncheck(inc)"]}
    assert reward([block("def inc(x):\n    return x + 1"), block("def inc(x):\n    return x + 2")],
                  [tests] * 2) == [1.0, 0.0]


def test_unjudgeable_is_scored_zero_and_counted():
    logged = {}
    opaque = block("import numpy as np\ndef f(x):\n    return 4")  # the test's `np` would be the program's
    ambiguous = block("def isclose(*a, **k):\n    return True\ndef sqrt(x):\n    return 0")
    out = reward([opaque, ambiguous, block(HONEST_F)],
                 [{"asserts": ["assert np.isclose(f(2), 4)"]},
                  {"asserts": ["assert isclose(sqrt(2), 1.41421356)"], "import_prefix": SKYWORK_IMPORT_PROMPT},
                  {"asserts": ["assert f(2) == 4"]}],
                 log_metric=lambda k, v: logged.__setitem__(k, v),
                 log_extra=lambda k, v: logged.__setitem__(k, v))
    assert out == [0.0, 0.0, 1.0]
    assert logged["code_reward_status"] == ["unjudgeable", "unjudgeable", "pass"]
    assert logged["code_reward/unjudgeable_frac"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------------------------
# stdin/stdout and function-call formats: the same hostile programs
# ---------------------------------------------------------------------------------------------------------------

STDIO = {"inputs": ["2\n"], "outputs": ["4\n"]}
STDIO_HOSTILE = [
    "import builtins\nreal = builtins.print\nbuiltins.print = lambda *a, **k: real('ok')\nprint(0)",
    "import sys, io\nsys.stdout = io.StringIO()\nprint(4)",  # output into a buffer is not output
    "import os\nos.write(1, b'0\\n')\nos._exit(3)",  # writes to the fd, then fails
    "import json\njson.dumps = lambda *a, **k: '4'\nprint(json.dumps(0) and 0)",
    ANY + "print(_any)",  # str() of an object is text: whatever it prints, it is compared as text
    "import os\nif os.fork() == 0:\n    import time; time.sleep(0.5); os.write(1, b'4\\n')\nelse:\n    print(0)",
]


def test_stdio_cannot_be_fooled():
    # The verdict is a comparison of stdout *text* in the trainer; no object of the program's reaches it.
    out = reward([block(p) for p in STDIO_HOSTILE] + [block("print(2 * int(input()))")], [STDIO] * 7)
    assert out == [0.0] * 6 + [1.0]


CALL = {"fn_name": "f", "inputs": [[2]], "outputs": [4]}
CALL_HOSTILE = [
    ANY + "def f(x):\n    return _any",
    "class I(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\ndef f(x):\n    return I(4)",
    "class S(str):\n    pass\ndef f(x):\n    return S('4')",
    "class L(list):\n    def __eq__(s, o): return True\ndef f(x):\n    return L([4])",
    "class R:\n    def __eq__(s, o): raise TypeError\ndef f(x):\n    return R()",
    "import builtins, json\nbuiltins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
    "json.dumps = lambda *a, **k: '{\"value\": 4}'\ndef f(x):\n    return 0",
    "import os\ndef f(x):\n    os.write(3, b'{\"value\": {\"x\": 1}}')\n    os._exit(0)",  # forged, malformed data
    "import os\ndef f(x):\n    os.write(1, b'4')\n    os._exit(0)",
    "def f(x):\n    return float('nan')",
]


def test_function_call_cannot_be_fooled():
    # Return values cross as data through a strict encoder (exact builtin types) and are compared in the trainer.
    out = reward([block(p) for p in CALL_HOSTILE] + [block(HONEST_F)], [CALL] * (len(CALL_HOSTILE) + 1))
    assert out == [0.0] * len(CALL_HOSTILE) + [1.0]
