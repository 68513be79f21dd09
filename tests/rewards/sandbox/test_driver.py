"""The sandbox's driver (`or1_trl/rewards/sandbox/driver.py`): a standalone file, with the judge beside it."""

import ast
import json
import os
import shutil
import subprocess
import sys
import uuid

from or1_trl.rewards.sandbox import driver, encode_value, judge


def _frame(message: dict) -> str:
    data = json.dumps(message)
    return f"{len(data.encode()):016x}" + data


def test_driver_is_a_standalone_file(scratch):
    """The driver runs inside the sandbox as a file of its own, with the judge beside it: both import the standard
    library only (nothing of or1_trl, no relative import outside the package branch of the judge), and copies of the
    two alone, where no or1_trl exists, speak the whole protocol (a function-call job and an asserts job, each with
    its tests in a second frame, for the judge)."""
    for module in (driver, judge):
        imported = set()
        for node in ast.walk(ast.parse(open(module.__file__).read())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom):  # the judge's package branch: the driver, nothing else
                assert module is judge and node.module == "driver", f"line {node.lineno}: a relative import"
        allowed = set(sys.stdlib_module_names) | {"__future__", "__main__"}
        assert "or1_trl" not in imported and imported <= allowed, (module.__name__, imported)
        assert {"json", "os"} <= imported  # the walk saw the imports

    alone = os.path.join(scratch, "alone")
    os.mkdir(alone)
    shutil.copy(driver.__file__, alone)
    shutil.copy(judge.__file__, alone)
    nonce = uuid.uuid4().hex * 2  # 64 hex characters
    # own_pidns is left out: outside a PID namespace of its own, the driver must not kill(-1) the host's processes
    limits = {"timeout": 5, "memory_bytes": 1 << 30, "max_output": 1 << 16, "max_file": 1 << 20}
    call = {"kind": "judge", "code": "def f(x, ys):\n    return (x * 2, sorted(ys))\n", "tests": [{}, {}], **limits}
    calls = {"entries": [{"call": "f", "args": encode_value([3, {2, 1}]), "expected": encode_value([6, [1, 2]])},
                         {"call": "f", "args": encode_value([1.5, "ba"]), "expected": encode_value([3.0, "ab"])}]}
    asserts = {"kind": "judge", "code": "def f(x):\n    return 2 * x\n", "prefix": "import math\n",
               "tests": [{}, {}], **limits}
    entries = {"entries": ["assert f(2) == 4", "assert math.isclose(f(0.5), 2.0)"]}
    runs = []
    for stdin in (nonce + _frame(call) + _frame(calls), nonce + _frame(asserts) + _frame(entries)):
        out = subprocess.run([sys.executable, "-I", "-B", os.path.join(alone, "driver.py")], input=stdin.encode(),
                             capture_output=True, cwd=alone, timeout=60)
        assert out.returncode == 0, out.stderr
        tags, records = zip(*(line.split(" ", 1) for line in out.stdout.decode().splitlines()))
        assert tags == (nonce,) * 4
        runs.append(list(map(json.loads, records)))
    (ready, first, second, done), (a_ready, a_first, a_second, a_done) = runs
    assert ready == a_ready == {"ready": 2} and done == a_done == {"done": 2}
    assert (first["i"], first["status"], first["verdict"]) == (0, "ok", "pass"), first
    assert (second["i"], second["status"], second["verdict"]) == (1, "ok", "wrong"), second  # ["a", "b"] != "ab"
    assert (a_first["i"], a_first["status"], a_first["verdict"]) == (0, "ok", "pass")
    assert (a_second["i"], a_second["status"], a_second["verdict"]) == (1, "ok", "wrong"), a_second
