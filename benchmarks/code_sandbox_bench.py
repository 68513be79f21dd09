"""Throughput of the code reward's sandbox (paper §7.2) vs. running the program bare.

``run(n_samples)`` returns a Markdown table: samples/s and tests/s of :class:`or1_trl.rewards.code.CodeReward`
(serial and with one worker per CPU), for stdin/stdout, function-call and assert tests (five one-assert entries; and
one HumanEval-style ``def check(candidate)`` entry of 40 straight-line asserts, ``check40``), and the overhead per
sample compared with a bare ``subprocess.run([sys.executable, "-c", code])`` per test (no isolation, no limits).

    python benchmarks/code_sandbox_bench.py [n_samples] [--markdown FILE]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from or1_trl.rewards.code import CodeReward  # noqa: E402
from or1_trl.rewards.sandbox import available_backend  # noqa: E402

TESTS_PER_SAMPLE = 5
STDIO_CODE = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs) * n)\n"
CALL_CODE = ("class Solution:\n    def scaled(self, n: int, xs: List[int]) -> int:\n"
             "        return sum(xs) * n\n")


def _stdio_tests(seed: int) -> dict:
    ins, outs = [], []
    for k in range(TESTS_PER_SAMPLE):
        n, xs = seed + k + 1, list(range(seed, seed + 50))
        ins.append(f"{n}\n{' '.join(map(str, xs))}\n")
        outs.append(f"{sum(xs) * n}\n")
    return {"inputs": ins, "outputs": outs}


def _call_tests(seed: int) -> dict:
    ins, outs = [], []
    for k in range(TESTS_PER_SAMPLE):
        n, xs = seed + k + 1, list(range(seed, seed + 50))
        ins.append([n, xs])
        outs.append(sum(xs) * n)
    return {"fn_name": "scaled", "inputs": ins, "outputs": outs}


def _assert_tests(seed: int) -> dict:
    tests = _call_tests(seed)
    return {"asserts": [f"assert Solution().scaled({n}, {xs}) == {out}"
                        for (n, xs), out in zip(tests["inputs"], tests["outputs"])]}


CHECK_ASSERTS = 40


def _check_tests(seed: int) -> dict:
    """One entry: ``def check(candidate)`` with 40 straight-line asserts, then ``check(Solution().scaled)``."""
    lines = []
    for k in range(CHECK_ASSERTS):
        n, xs = seed + k + 1, list(range(seed, seed + 50))
        lines.append(f"    assert candidate({n}, {xs}) == {sum(xs) * n}\n")
    return {"asserts": ["def check(candidate):\n" + "".join(lines) + "check(Solution().scaled)\n"]}


def _bare(n_samples: int) -> float:
    t0 = time.perf_counter()
    for s in range(n_samples):
        tests = _stdio_tests(s)
        for inp, out in zip(tests["inputs"], tests["outputs"]):
            r = subprocess.run([sys.executable, "-c", STDIO_CODE], input=inp, capture_output=True, text=True,
                               timeout=30)
            assert r.stdout.strip() == out.strip(), r.stderr
    return time.perf_counter() - t0


def _sandboxed(n_samples: int, kind: str, workers: int, n_tests: int = TESTS_PER_SAMPLE) -> float:
    reward = CodeReward(num_workers=workers)
    code, make = {"stdio": (STDIO_CODE, _stdio_tests), "call": (CALL_CODE, _call_tests),
                  "asserts": (CALL_CODE, _assert_tests), "check40": (CALL_CODE, _check_tests)}[kind]
    completions = [f"```python\n{code}```"] * n_samples
    tests = [{k: v[:n_tests] if isinstance(v, list) else v for k, v in make(s).items()} for s in range(n_samples)]
    reward(completions[:1], tests[:1])  # choose the backend (one probe sandbox) outside the timing
    t0 = time.perf_counter()
    out = reward(completions, tests)
    elapsed = time.perf_counter() - t0
    assert out == [1.0] * n_samples, out
    return elapsed


def run(n_samples: int = 16) -> str:
    n_samples = max(1, int(n_samples))
    cpus = os.cpu_count() or 1
    rows = [("bare `subprocess.run([python, -c, code])` per test", "stdio", 1, _bare(n_samples))]
    for kind in ("stdio", "call", "asserts", "check40"):
        for workers in sorted({1, cpus}):
            rows.append((f"sandbox ({available_backend()})", kind, workers, _sandboxed(n_samples, kind, workers)))
    bare_per_sample = rows[0][3] / n_samples
    lines = [
        f"Code sandbox throughput: {n_samples} samples × {TESTS_PER_SAMPLE} tests ({CHECK_ASSERTS} asserts for "
        f"`check40`), {cpus} CPU(s), backend `{available_backend()}`, Python {sys.version.split()[0]}.",
        "",
        "| runner | tests | workers | wall s | samples/s | tests/s | ms/sample | overhead vs bare (ms/sample, serial) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, kind, workers, t in rows:
        per = t / n_samples
        n_tests = n_samples * (CHECK_ASSERTS if kind == "check40" else TESTS_PER_SAMPLE)
        over = f"{(per - bare_per_sample) * 1e3:+.0f}" if workers == 1 and not name.startswith("bare") else "—"
        lines.append(f"| {name} | {kind} | {workers} | {t:.2f} | {n_samples / t:.1f} | {n_tests / t:.1f} | "
                     f"{per * 1e3:.0f} | {over} |")
    one = _sandboxed(n_samples, "stdio", 1, n_tests=1) / n_samples
    one_assert = _sandboxed(n_samples, "asserts", 1, n_tests=1) / n_samples
    check40 = next(t for _, kind, workers, t in rows if kind == "check40" and workers == 1) / n_samples
    lines.append("")
    lines.append(f"The `check40` row is one test (one entry) of {CHECK_ASSERTS} asserts, each a call of the program: "
                 f"{check40 * 1e3:.0f} ms per sample (serial), against {one_assert * 1e3:.0f} ms for a sample of a "
                 f"single one-assert entry ({CHECK_ASSERTS} of those: {CHECK_ASSERTS * one_assert * 1e3:.0f} ms).")
    lines.append("")
    lines.append(f"Fixed cost of isolation: a 1-test stdio sample takes {one * 1e3:.0f} ms in the sandbox (serial) vs "
                 f"{bare_per_sample / TESTS_PER_SAMPLE * 1e3:.0f} ms for one bare `subprocess.run`, i.e. "
                 f"{(one - bare_per_sample / TESTS_PER_SAMPLE) * 1e3:+.0f} ms per sample; each further test "
                 f"costs {max(0.0, (rows[1][3] / n_samples - one) / (TESTS_PER_SAMPLE - 1)) * 1e3:.1f} ms (fork) instead of a new "
                 f"interpreter.")
    lines.append("")
    lines.append("The sandbox starts one isolated interpreter per sample and forks one process per test (assert "
                 "and call tests: one judge process, one program process answering its calls, one fork of the judge "
                 "per entry); "
                 "the bare baseline starts one unisolated interpreter per test.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n_samples", nargs="?", type=int, default=16)
    parser.add_argument("--markdown", metavar="FILE", help="also write the table to FILE (for the README)")
    args = parser.parse_args(argv)
    table = run(args.n_samples)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            command = f"`python benchmarks/code_sandbox_bench.py {args.n_samples}`"
            f.write(table.replace("Code sandbox throughput:", f"Code sandbox throughput, {command}:", 1) + "\n")
    return table


if __name__ == "__main__":
    main()
