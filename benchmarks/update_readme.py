"""Re-measure the README's figures: run benchmarks and rewrite their blocks in README.md.

    python benchmarks/update_readme.py demo                 # one benchmark (see --list)
    python benchmarks/update_readme.py --all                # all (memory: ~29 min and 20 GB of RAM; learning: ~30 min;
                                                            # learning_ladder: hours, resumable; others minutes)
    python benchmarks/update_readme.py demo --quick --readme /tmp/README.md    # tiny settings, into a copy

Each benchmark has a block in README.md between `<!-- benchmarks/NAME.py -->` and `<!-- /benchmarks/NAME.py -->`
(a second block of one script has a name of its own: `<!-- benchmarks/learning.py ladder -->`).
This script runs the benchmark with the settings below and `--markdown FILE`, and replaces the block's content with
a line saying when, where (CPUs, CPU model, torch version, load average) and with which command it was measured,
followed by what the benchmark wrote. Text outside the markers is left alone. `--quick` runs each benchmark with
tiny settings (to test this machinery: the numbers mean nothing) and refuses to write the repository's README.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(ROOT, "README.md")


@dataclass(frozen=True)
class Benchmark:
    script: str  # relative to the repository root; also names the README block, unless `block` does
    args: tuple[str, ...]  # the README's settings
    quick: tuple[str, ...]  # seconds, for tests
    block: str = ""  # the README block's name, where one script writes two blocks (default: `script`)

    @property
    def marker(self) -> str:
        return self.block or self.script


BENCHMARKS = {
    "demo": Benchmark("benchmarks/demo.py", ("--runs", "2"), ("--runs", "1", "--quick")),
    "rejection": Benchmark("benchmarks/rejection.py", (), ("--steps", "1", "--completion-length", "8")),
    "rewards": Benchmark("benchmarks/rewards.py", ("--n", "1000", "--only", "math"),
                         ("--n", "64", "--group", "16", "--rounds", "2", "--only", "math", "--workers", "1")),
    "code_sandbox": Benchmark("benchmarks/code_sandbox_bench.py", ("64",), ("2",)),
    "generation": Benchmark("benchmarks/generation.py", ("--reps", "3"), ("--quick",)),
    "memory": Benchmark("benchmarks/memory.py", (), ("--quick",)),
    "step_time": Benchmark("benchmarks/step_time.py", (), ("--quick",)),
    "learning": Benchmark("benchmarks/learning.py", (), ("--quick",)),
    # the real-model arms: each run's result is kept in benchmarks/results/learning_ladder and a relaunch skips it, so
    # once the matrix has run (hours) this writes the block from the results without running anything
    "learning_ladder": Benchmark("benchmarks/learning.py", ("--ladder", "--plot", "docs/learning_ladder.png"),
                                 ("--ladder", "--quick"), block="benchmarks/learning.py ladder"),
    "rollout_correction": Benchmark("benchmarks/rollout_correction.py", (), ("--quick",)),
    "packing": Benchmark("benchmarks/packing.py", (), ("--quick",)),
    "async_generation": Benchmark("benchmarks/async_generation.py", (), ("--quick",)),
}


def markers(script: str) -> tuple[str, str]:
    return f"<!-- {script} -->", f"<!-- /{script} -->"


def replace_block(text: str, script: str, content: str) -> str:
    """`text` with the lines between the markers of `script` replaced by `content` (the markers stay).

    Raises `ValueError` unless each marker is a line of its own, occurring once, the begin marker first."""
    begin, end = markers(script)
    counts = [len(re.findall(rf"^{re.escape(m)}$", text, flags=re.M)) for m in (begin, end)]
    block = re.compile(rf"^{re.escape(begin)}\n.*?^{re.escape(end)}$", flags=re.M | re.S)
    if counts != [1, 1] or not block.search(text):
        raise ValueError(f"the README needs one line {begin!r} followed by one line {end!r} (found {counts[0]} "
                         f"and {counts[1]}{', in the wrong order' if counts == [1, 1] else ''})")
    content = content.strip("\n")
    return block.sub(lambda _: "\n".join([begin, content, end] if content else [begin, end]), text)


def machine() -> str:
    """CPUs, CPU model, torch version: what the figures depend on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count()
    try:
        import importlib.metadata as md

        torch = md.version("torch")
    except Exception:  # pragma: no cover - torch is a dependency
        torch = "?"
    return f"{cpus} CPUs ({model}), torch {torch}, Python {platform.python_version()}"


def run(name: str, quick: bool = False) -> str:
    """Run benchmark `name`; returns its README block (the provenance line, then what it wrote)."""
    bench = BENCHMARKS[name]
    args = bench.quick if quick else bench.args
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "block.md")
        argv = [sys.executable, os.path.join(ROOT, bench.script), *args, "--markdown", out]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        load = os.getloadavg()[0]
        # The benchmark's own output goes to our stderr: progress for the reader, not part of the block.
        subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=sys.stderr)
        load = max(load, os.getloadavg()[0])
        with open(out) as f:
            body = f.read()
    command = shlex.join(["python", bench.script, *args])
    when = datetime.date.today().isoformat()
    provenance = (f"_Measured {when} on {machine()}; 1-min load average up to {load:.1f} during the run; "
                  f"`{command}`, written here by `python benchmarks/update_readme.py {name}"
                  f"{' --quick` (numbers meaningless)' if quick else '`'}._")
    return f"{provenance}\n\n{body.strip()}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    parser.add_argument("--all", action="store_true", help="run every benchmark")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and their commands")
    parser.add_argument("--quick", action="store_true", help="tiny settings; needs --readme (a copy)")
    parser.add_argument("--readme", default=README, help="the file to rewrite (default: the repository's README.md)")
    args = parser.parse_args(argv)
    if args.list:
        for name, bench in BENCHMARKS.items():
            print(f"{name:18s} python {shlex.join([bench.script, *bench.args])}")
        return
    names = list(BENCHMARKS) if args.all else args.names
    if not names:
        parser.error("name at least one benchmark (or --all, --list)")
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if args.quick and os.path.abspath(args.readme) == README:
        parser.error("--quick numbers mean nothing: write them to a copy with --readme PATH")
    with open(args.readme) as f:
        text = f.read()
    for name in names:  # check every block exists before spending minutes on a benchmark
        replace_block(text, BENCHMARKS[name].marker, "")
    for name in names:
        block = run(name, args.quick)
        with open(args.readme) as f:  # again: edits made while the benchmark ran (minutes) are kept
            text = f.read()
        text = replace_block(text, BENCHMARKS[name].marker, block)
        with open(args.readme, "w") as f:  # after each benchmark: a later failure keeps the earlier ones
            f.write(text)
        print(f"{args.readme}: rewrote the block of {BENCHMARKS[name].marker}", file=sys.stderr)


if __name__ == "__main__":
    main()
