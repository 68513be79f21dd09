"""Re-measure the documented figures: run benchmarks and rewrite their blocks in the documentation.

    python benchmarks/update_readme.py demo                 # one benchmark (see --list)
    python benchmarks/update_readme.py --all                # all (memory: ~32 min and 20 GB of RAM; learning: ~30 min;
                                                            # learning_ladder: the finished runs' report; others minutes)
    python benchmarks/update_readme.py demo --quick --page /tmp/benchmarks.md    # tiny settings, into a copy

Each benchmark has one block in the documentation (`docs/benchmarks.md`; any page of `docs/`, or README.md, may hold
it) between `<!-- benchmarks/NAME.py -->` and `<!-- /benchmarks/NAME.py -->`, each marker a line of its own. This
script finds the page that holds the block, runs the benchmark with the settings below and `--markdown FILE`, and
replaces the block's content with a line saying when, where (CPUs, CPU model, torch version, load average) and with
which command it was measured, followed by what the benchmark wrote. Text outside the markers is left alone.
`--quick` runs each benchmark with tiny settings (to test this machinery: the numbers mean nothing) and refuses to
write the repository's pages.
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
DOCS = os.path.join(ROOT, "docs")


@dataclass(frozen=True)
class Benchmark:
    script: str  # relative to the repository root; also names the block, unless `block` does
    args: tuple[str, ...]  # the documented settings
    quick: tuple[str, ...]  # seconds, for tests
    block: str = ""  # the block's name, where one script writes two blocks (default: `script`)
    report: bool = False  # the block reports runs made earlier: their dates and load are in it, not this command's

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
    "real_step_time": Benchmark("benchmarks/real_step_time.py", (), ("--quick",)),
    "real_demo": Benchmark("benchmarks/real_demo.py", (), ("--quick",)),
    "learning": Benchmark("benchmarks/learning.py", (), ("--quick",)),
    # the real-model arms: the runs take hours and go in the background (`python benchmarks/learning.py --ladder`, each
    # result kept in benchmarks/results/learning_ladder, a relaunch skips it); this writes the block and the plot from
    # the runs finished so far, without running anything (the block says which runs and under what load they ran)
    "learning_ladder": Benchmark("benchmarks/learning.py",
                                 ("--ladder", "--report-only", "--plot", "docs/learning_ladder.png"),
                                 ("--ladder", "--quick"), block="benchmarks/learning.py ladder", report=True),
    # what common random numbers buy (issue 48): its runs go in the background too (`learning.py --pairing`, results
    # in benchmarks/results/learning_pairing)
    "learning_pairing": Benchmark("benchmarks/learning.py", ("--pairing", "--report-only"), ("--pairing", "--quick"),
                                  block="benchmarks/learning.py pairing", report=True),
    # the same experiment on an fp32 server with fp32 trainers (`learning.py --pairing --server-dtype float32`, results
    # in benchmarks/results/learning_pairing-fp32): a server whose numerics do not depend on its batching
    "learning_pairing_fp32": Benchmark("benchmarks/learning.py", ("--pairing", "--server-dtype", "float32",
                                                                  "--report-only"),
                                       ("--pairing", "--quick"), block="benchmarks/learning.py pairing fp32",
                                       report=True),
    # issue 50's regime probe: a finished probe (benchmarks/results/regime_probe) is reported from its file
    "regime_probe": Benchmark("benchmarks/regime_probe.py", (), ("--quick",), report=True),
    # the same probe with each completion cut after its answer line, as the arms train (`stop_pattern`)
    "regime_probe_stop": Benchmark("benchmarks/regime_probe.py", ("--stop-at-answer-line",),
                                   ("--quick", "--stop-at-answer-line"), block="benchmarks/regime_probe.py stop",
                                   report=True),
    # issue 50's arms: the finished runs (benchmarks/results/regime) reported from their files, with their plot
    "regime": Benchmark("benchmarks/regime.py", ("--report-only", "--plot", "docs/regime.png"),
                        ("--quick", "--claims", "4"), report=True),
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
        raise ValueError(f"the page needs one line {begin!r} followed by one line {end!r} (found {counts[0]} "
                         f"and {counts[1]}{', in the wrong order' if counts == [1, 1] else ''})")
    content = content.strip("\n")
    return block.sub(lambda _: "\n".join([begin, content, end] if content else [begin, end]), text)


def doc_pages() -> list[str]:
    """The pages a block may live in: README.md and every Markdown file under docs/."""
    pages = [README]
    for folder, _, files in sorted(os.walk(DOCS)):
        pages += [os.path.join(folder, name) for name in sorted(files) if name.endswith(".md")]
    return pages


def find_page(script: str, pages: list[str] | None = None) -> str:
    """The one page of `pages` (default: `doc_pages()`) with the begin marker of `script` on a line of its own.

    Raises `ValueError` naming the pages when none or several hold it."""
    begin = markers(script)[0]
    found = []
    for page in doc_pages() if pages is None else pages:
        with open(page) as f:
            if re.search(rf"^{re.escape(begin)}$", f.read(), flags=re.M):
                found.append(page)
    if len(found) != 1:
        where = ", ".join(os.path.relpath(page, ROOT) for page in found) or "none of README.md, docs/**/*.md"
        raise ValueError(f"the block {begin!r} must be in exactly one page of the documentation, found in: {where}")
    return found[0]


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
    """Run benchmark `name`; returns its block (the provenance line, then what it wrote)."""
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
    where = ("_Reported {when} from the runs finished earlier (where, when and under what load they ran: in the "
             "block); " if bench.report and not quick else
             f"_Measured {when} on {machine()}; 1-min load average up to {load:.1f} during the run; ").format(when=when)
    provenance = (f"{where}`{command}`, written here by `python benchmarks/update_readme.py {name}"
                  f"{' --quick` (numbers meaningless)' if quick else '`'}._")
    return f"{provenance}\n\n{body.strip()}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    parser.add_argument("--all", action="store_true", help="run every benchmark")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and their commands")
    parser.add_argument("--quick", action="store_true", help="tiny settings; needs --page (a copy)")
    parser.add_argument("--page", "--readme", dest="page", default=None,
                        help="the file to rewrite (default: the page of the documentation that holds each block)")
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
    repository_pages = {os.path.abspath(page) for page in doc_pages()}
    if args.quick and (args.page is None or os.path.abspath(args.page) in repository_pages):
        parser.error("--quick numbers mean nothing: write them to a copy with --page PATH")
    pages = {}
    for name in names:  # check every block exists before spending minutes on a benchmark
        marker = BENCHMARKS[name].marker
        pages[name] = args.page if args.page is not None else find_page(marker)
        with open(pages[name]) as f:
            replace_block(f.read(), marker, "")
    for name in names:
        block = run(name, args.quick)
        with open(pages[name]) as f:  # again: edits made while the benchmark ran (minutes) are kept
            text = f.read()
        text = replace_block(text, BENCHMARKS[name].marker, block)
        with open(pages[name], "w") as f:  # after each benchmark: a later failure keeps the earlier ones
            f.write(text)
        print(f"{pages[name]}: rewrote the block of {BENCHMARKS[name].marker}", file=sys.stderr)


if __name__ == "__main__":
    main()
