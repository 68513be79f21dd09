"""Reward benchmarks: the paper's Math-Verify reward (§7.1) against TRL's ``accuracy_reward``, and the code sandbox.

    python benchmarks/rewards.py [--n 1000] [--only math|code] [--workers N] [--think-chars 4000] [--group 16]
                                 [--rounds 8] [--no-fast-paths] [--code-n 64] [--markdown FILE]

Math: builds ``--n`` realistic completions offline (a ``<think>`` section of ~``--think-chars`` characters of
reasoning with inline LaTeX, then a summary with the answer in one of many formats, correct or not, boxed or not,
or no answer at all), scores them with ``or1_trl.rewards.MathReward`` (worker pool, warm) and with
``trl.rewards.accuracy_reward`` (in-process, as TRL runs it), and prints Markdown tables: throughput, the ratio,
the agreement rate, and per category where the two disagree, an example. The same rule also runs in-process
(``num_workers=0``: plain Math-Verify, without the workers' exact fast paths); the benchmark fails if its scores
differ from the pool's in any sample. ``--no-fast-paths`` turns the fast paths off in the pool too.

TRL is given what it expects: conversational completions ``[{"role": "assistant", "content": ...}]`` and a
``solution`` column; the gold is passed as ``\\boxed{gold}`` (the wrapping the paper uses in step (d); a bare
gold such as ``[0,1)`` or ``\\pi`` is unparsable for TRL, which then returns ``None``).

Code: calls ``run(--code-n)`` of ``benchmarks/code_sandbox_bench.py`` when that file exists (each sample runs
several sandboxed processes, hence a separate, smaller count).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import random
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

# --------------------------------------------------------------------------------------------------------------
# Synthetic problems: (kind, gold, equivalent forms, wrong forms)
# --------------------------------------------------------------------------------------------------------------


def _problems(rng: random.Random) -> list[tuple[str, str, list[str], list[str]]]:
    a, b = rng.randint(2, 99), rng.randint(2, 9)
    while a % b == 0:
        a += 1
    from math import gcd

    g = gcd(a, b)
    n, d = a // g, b // g
    k = rng.randint(2, 12)
    p = rng.randint(1, 95)
    lo, hi = rng.randint(-9, 0), rng.randint(1, 9)
    x, y = rng.randint(-9, 9), rng.randint(-9, 9)
    while y == x:
        y += 1
    s1, s2 = sorted(rng.sample(range(-9, 10), 2))
    c = rng.randint(1, 9)
    letter = rng.choice("ABCDE")
    other = rng.choice([ch for ch in "ABCDE" if ch != letter])
    big = rng.randint(1000, 99999)
    return [
        ("integer", str(big % 1000 + k), [str(big % 1000 + k), f"{big % 1000 + k}.0"], [str(big % 1000 + k + 1)]),
        ("negative", str(-k), [str(-k)], [str(k)]),
        ("big integer", f"{big}", [f"{big}", f"{big:,}"], [f"{big + 10}"]),
        ("fraction", rf"\frac{{{n}}}{{{d}}}", [rf"\frac{{{n}}}{{{d}}}", rf"\dfrac{{{n}}}{{{d}}}", f"{n}/{d}",
                                                 rf"\frac{{{2 * n}}}{{{2 * d}}}"], [rf"\frac{{{d}}}{{{n}}}"]),
        ("decimal", f"{p / 100:g}", [f"{p / 100:g}", rf"\frac{{{p}}}{{100}}", rf"{p}\%"], [f"{(p + 1) / 100:g}"]),
        ("percent", rf"{p}\%", [rf"{p}\%", f"{p}", f"{p / 100:g}"], [rf"{p + 5}\%"]),
        ("sqrt", rf"{k}\sqrt{{3}}", [rf"{k}\sqrt{{3}}", rf"\sqrt{{{3 * k * k}}}", rf"{k}\sqrt3"],
         [rf"{k}\sqrt{{2}}"]),
        ("pi", rf"{k}\pi", [rf"{k}\pi", rf"{k} \pi", rf"\pi \cdot {k}"], [f"{3.14 * k:.2f}"]),
        ("interval", rf"[{lo}, {hi})", [rf"[{lo}, {hi})", rf"[{lo},{hi})", rf"x \in [{lo}, {hi})"],
         [rf"({lo}, {hi})"]),
        ("tuple", f"({x}, {y})", [f"({x}, {y})", f"({x},{y})", rf"\left({x}, {y}\right)"], [f"({y}, {x})"]),
        ("set", rf"\{{{s1}, {s2}\}}", [rf"\{{{s1}, {s2}\}}", rf"\{{{s2},{s1}\}}", f"{s1}, {s2}"], [rf"\{{{s1}\}}"]),
        ("polynomial", f"x^2 - {c * c}", [f"x^2 - {c * c}", f"(x-{c})(x+{c})", f"x^{{2}}-{c * c}"],
         [f"x^2 + {c * c}"]),
        ("equation", f"y = {k}x + {c}", [f"y = {k}x + {c}", f"{k}x+{c}", f"y={c}+{k}x"], [f"y = {c}x + {k}"]),
        ("letter", letter, [letter, rf"\text{{({letter})}}"], [other]),
        ("degrees", rf"{p}^\circ", [rf"{p}^\circ", f"{p}"], [rf"{p + 1}^\circ"]),
    ]


_WORDS = ("so", "then", "hence", "note that", "we get", "which means", "now", "therefore", "wait,", "hmm,",
          "let me check", "substituting", "recall that", "it follows that", "alternatively,")


def _reasoning(rng: random.Random, chars: int, inject: str | None = None) -> str:
    """A think section: sentences with inline and display LaTeX and numbers, ~``chars`` characters long."""
    out, size = [], 0
    while size < chars:
        i, j = rng.randint(1, 60), rng.randint(1, 60)
        form = rng.random()
        if form < 0.3:
            s = f"{rng.choice(_WORDS).capitalize()} ${i} + {j} = {i + j}$, {rng.choice(_WORDS)} we continue."
        elif form < 0.5:
            s = rf"Consider $\frac{{{i}}}{{{j}}}$ and $x^{{{i % 5 + 2}}}$; {rng.choice(_WORDS)} the terms cancel."
        elif form < 0.65:
            s = rf"$$a_{{n+1}} = {i} a_n - {j}$$ {rng.choice(_WORDS).capitalize()} the recursion is linear."
        elif form < 0.8:
            s = f"Let me try n = {i}: that gives {i * j}, which is {'too big' if i > j else 'too small'}."
        else:
            s = f"{rng.choice(_WORDS).capitalize()} the case analysis; the count so far is {i + 2 * j}."
        out.append(s)
        size += len(s) + 1
        if inject is not None and rng.random() < 0.08:
            out.append(inject)
            inject = None
    if inject is not None:
        out.insert(rng.randrange(len(out) + 1), inject)
    return " ".join(out)


def _summary(rng: random.Random) -> str:
    i, j = rng.randint(2, 40), rng.randint(2, 40)
    parts = [
        f"We set up the problem and reduce it to a computation with ${i}$ and ${j}$.",
        rf"Using $\frac{{{i}}}{{{j}}}$ from the first step, the remaining cases follow.",
        f"Checking small cases (n = {i}, {j}) confirms the pattern.",
        "Combining the two constraints gives a single value.",
    ]
    rng.shuffle(parts)
    return "**Solution summary.** " + " ".join(parts[: rng.randint(1, 4)])


CATEGORIES = {
    # name: (weight, description)
    "boxed, canonical form": (24, r"`\boxed{gold}` after `</think>`"),
    "boxed, equivalent form": (16, r"`\boxed{0.75}` for gold `\frac{3}{4}`, etc."),
    "boxed, wrong": (20, "a wrong value, boxed"),
    "unboxed 'final answer is $X$'": (6, "no box; correct"),
    "unboxed 'Answer: X'": (4, "no box, no math delimiters; correct"),
    "unboxed, boxed scratch in think": (4, r"correct unboxed final answer; a wrong `\boxed{}` inside `<think>`"),
    "answer only inside think": (4, r"correct `\boxed{}` inside `<think>`, nothing after `</think>`"),
    "truncated think (no </think>)": (8, r"no `</think>`; a correct `\boxed{}` mid-reasoning"),
    "truncated, no answer": (5, "no `</think>`, no answer"),
    "two boxed answers": (4, r"`\boxed{gold}` and `\boxed{wrong}` after `</think>`"),
    "malformed LaTeX": (3, r"`\boxed{\frac{1}{2}` (unbalanced)"),
    "no think section": (2, r"plain `\boxed{gold}` answer, no `<think>`"),
}


def build_completions(n: int, seed: int, think_chars: int, group: int = 16) -> list[tuple[str, str, str]]:
    """``n`` (category, completion text, gold) triples, in groups of ``group`` samples of one prompt (as GRPO
    batches are laid out): each sample independently draws a category and, where it applies, an answer form."""
    rng = random.Random(seed)
    names = list(CATEGORIES)
    weights = [CATEGORIES[c][0] for c in names]
    out = []
    while len(out) < n:
        _, gold, equivalents, wrongs = rng.choice(_problems(rng))
        for _ in range(min(group, n - len(out))):
            out.append(_sample(rng, rng.choices(names, weights)[0], gold, equivalents, wrongs, think_chars))
    return out


def _sample(rng, cat, gold, equivalents, wrongs, think_chars) -> tuple[str, str, str]:
    chars = max(200, int(rng.gauss(think_chars, think_chars / 3)))
    think = _reasoning(rng, chars)
    summary = _summary(rng)
    closing = rng.choice(["The final answer is $\\boxed{%s}$.", "Therefore, the answer is \\(\\boxed{%s}\\).",
                          "\\[\n\\boxed{%s}\n\\]", "So the answer is \\boxed{%s}."])
    if cat == "boxed, canonical form":
        text = f"{think}\n</think>\n\n{summary}\n\n{closing % gold}"
    elif cat == "boxed, equivalent form":
        text = f"{think}\n</think>\n\n{summary}\n\n{closing % rng.choice(equivalents[1:] or equivalents)}"
    elif cat == "boxed, wrong":
        text = f"{think}\n</think>\n\n{summary}\n\n{closing % rng.choice(wrongs)}"
    elif cat == "unboxed 'final answer is $X$'":
        text = f"{think}\n</think>\n\n{summary}\n\nThe final answer is ${rng.choice(equivalents)}$."
    elif cat == "unboxed 'Answer: X'":
        text = f"{think}\n</think>\n\n{summary}\n\n**Answer:** {gold}"
    elif cat == "unboxed, boxed scratch in think":
        think = _reasoning(rng, chars, inject=rf"A first guess would be $\boxed{{{rng.choice(wrongs)}}}$.")
        text = f"{think}\n</think>\n\n{summary}\n\nThe final answer is ${gold}$."
    elif cat == "answer only inside think":
        think = _reasoning(rng, chars) + f" So the answer is $\\boxed{{{gold}}}$."
        text = f"{think}\n</think>\n\n{summary}\n\nI could not finish verifying this."
    elif cat == "truncated think (no </think>)":
        text = _reasoning(rng, chars, inject=f"This gives $\\boxed{{{gold}}}$ tentatively.")
    elif cat == "truncated, no answer":
        text = think
    elif cat == "two boxed answers":
        text = f"{think}\n</think>\n\n{summary}\n\nEither $\\boxed{{{gold}}}$ or $\\boxed{{{rng.choice(wrongs)}}}$."
    elif cat == "malformed LaTeX":
        text = f"{think}\n</think>\n\n{summary}\n\nThe answer is $\\boxed{{\\frac{{{gold}}}{{2}}$."
    else:  # no think section
        text = f"{summary}\n\n{closing % gold}"
    return cat, text, gold


# --------------------------------------------------------------------------------------------------------------
# Math benchmark
# --------------------------------------------------------------------------------------------------------------


def _workers_cpu(reward) -> dict[int, float]:
    """CPU seconds used so far by each of the pool's worker processes, by pid (Linux /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for w in reward._pool.workers:
        with open(f"/proc/{w.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[w.proc.pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _shorten(text: str, width: int = 90) -> str:
    text = text.replace("\n", "⏎").replace("|", "\\|")
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _scorer_process(kind: str, conn, conv, golds, warm_conv, warm_golds) -> None:
    """Serve ``(lo, hi)`` slices with one in-process scorer, in a process of its own: the ANTLR parser's DFA
    cache is per process, so two scorers sharing a process would warm it for each other on the same inputs."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if kind == "trl":
        from trl.rewards import accuracy_reward

        def score(c, g):
            return accuracy_reward(c, ["\\boxed{" + x + "}" for x in g])
    else:
        from or1_trl.rewards import MathReward

        single = MathReward(num_workers=0)

        def score(c, g):
            return single(c, answer=g)

    score(warm_conv, warm_golds)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        lo, hi = msg
        c0, t0 = time.process_time(), time.perf_counter()
        out = score(conv[lo:hi], golds[lo:hi])
        conn.send((out, time.perf_counter() - t0, time.process_time() - c0))


def bench_math(n: int, workers: int | None, think_chars: int, seed: int, group: int, rounds: int,
               fast_paths: bool = True, readme: list[str] | None = None, command: str = "") -> str:
    """The report (Markdown). With ``readme``, also appends to it the README's short version (``command`` is the
    command line to cite in it)."""
    import multiprocessing as mp

    from or1_trl.rewards import MathReward

    data = build_completions(n, seed, think_chars, group)
    warm_n = max(256, n // 2)
    warm = build_completions(warm_n, seed + 1, think_chars, group)
    conv = [[{"role": "assistant", "content": t}] for _, t, _ in data]
    golds = [g for _, _, g in data]
    warm_conv = [[{"role": "assistant", "content": t}] for _, t, _ in warm]
    warm_golds = [g for *_, g in warm]

    # Steady state of a long run: every process that parses LaTeX first sees ~``warm_n`` other completions
    # (the pure-Python ANTLR LaTeX parser inside Math-Verify gets several times faster as its DFA cache fills).
    # Each pool worker sees about half of what the pool is given, so the pool gets sets A and B.
    ctx = mp.get_context("spawn")
    servers = {}
    for kind in ("single", "trl"):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_scorer_process, args=(kind, there, conv, golds, warm_conv, warm_golds))
        proc.start()
        servers[kind] = (proc, here)
    pool = MathReward(num_workers=workers, fast_paths=fast_paths)
    t0 = time.perf_counter()
    pool(conv[:1], answer=golds[:1])
    startup = time.perf_counter() - t0
    warm_b = build_completions(warm_n, seed + 2, think_chars, group)
    for w in (warm, warm_b):
        pool([[{"role": "assistant", "content": t}] for _, t, _ in w], answer=[g for *_, g in w])
    for _, conn in servers.values():
        assert conn.recv() == "ready"

    def run_pool(lo, hi):
        w0 = _workers_cpu(pool)
        c0, t0 = time.process_time(), time.perf_counter()
        out = pool(conv[lo:hi], answer=golds[lo:hi])
        wall, parent = time.perf_counter() - t0, time.process_time() - c0
        deltas = [v - w0[pid] for pid, v in _workers_cpu(pool).items() if pid in w0]
        return out, wall, parent + sum(deltas), parent + max(deltas, default=0.0)

    def remote(kind):
        def run(lo, hi):
            conn = servers[kind][1]
            conn.send((lo, hi))
            out, wall, cpu_s = conn.recv()
            return out, wall, cpu_s, cpu_s
        return run

    scorers = {"pool": run_pool, "single": remote("single"), "trl": remote("trl")}

    # The machine may be shared: interleave the scorers over ``rounds`` slices (whole groups) so that they see
    # the same background load, rotating which one goes first. CPU time is measured too (load-independent);
    # for the pool, the critical path (parent + busiest worker, per slice) is its wall time on free cores.
    per_round = max(group, (n // rounds) // group * group)
    bounds = [(lo, min(n, lo + per_round)) for lo in range(0, n, per_round)]
    seconds = dict.fromkeys(scorers, 0.0)
    cpu = dict.fromkeys(scorers, 0.0)
    critical = dict.fromkeys(scorers, 0.0)
    scores: dict[str, list] = {k: [] for k in scorers}
    order = list(scorers)
    loads = []
    for r, (lo, hi) in enumerate(bounds):
        for name in order[r % 3 :] + order[: r % 3]:
            out, wall, cpu_s, crit = scorers[name](lo, hi)
            seconds[name] += wall
            cpu[name] += cpu_s
            critical[name] += crit
            scores[name].append(out)
        loads.append(os.getloadavg()[0])
    for proc, conn in servers.values():
        conn.send(None)
        proc.join()
    ours_scores = [x for chunk in scores["pool"] for x in chunk]
    single_scores = [x for chunk in scores["single"] for x in chunk]
    trl_scores = [x for chunk in scores["trl"] for x in chunk]
    assert single_scores == ours_scores, "the plain rule (in-process) and the worker pool give different scores"
    restarts = pool._pool.restarts
    pool.close()
    t_ours, t_single, t_trl = seconds["pool"], seconds["single"], seconds["trl"]
    c_ours, c_trl = critical["pool"], critical["trl"]

    mean_len = statistics.mean(len(t) for _, t, _ in data)
    distinct = len({(pool.prepare(c), g) for c, g in zip(conv, golds)})
    lines = [
        f"### Math reward vs `trl.rewards.accuracy_reward` ({n} completions in groups of {group}, mean "
        f"{mean_len:,.0f} chars, {distinct} distinct answer sections; {len(bounds)} interleaved rounds)",
        "",
        "| scorer | processes | wall s | completions/s | × accuracy_reward | CPU ms / completion |",
        "|---|---|---|---|---|---|",
        f"| `or1_trl.rewards.math_reward` (paper §7.1) | {pool.num_workers} workers, fast paths "
        f"{'on' if fast_paths else 'off'} | {t_ours:.2f} | "
        f"{n / t_ours:,.1f} | **{t_trl / t_ours:.2f}×** | {1000 * cpu['pool'] / n:.1f} |",
        f"| same rule, in-process (`num_workers=0`, plain) | 1 | {t_single:.2f} | {n / t_single:,.1f} | "
        f"{t_trl / t_single:.2f}× | {1000 * cpu['single'] / n:.1f} |",
        f"| `trl.rewards.accuracy_reward` | 1 | {t_trl:.2f} | {n / t_trl:,.1f} | 1.00× | "
        f"{1000 * cpu['trl'] / n:.1f} |",
        "",
        f"Projection for {pool.num_workers} free cores (from CPU time, not a wall-clock measurement): the pool's "
        f"critical path (parent + busiest worker, per slice) is {c_ours:.2f} s → {n / c_ours:,.1f} completions/s = "
        f"**{c_trl / c_ours:.2f}×** accuracy_reward at its CPU time ({c_trl:.2f} s → {n / c_trl:,.1f}/s).",
        "",
        f"Scores of the pool and of the plain in-process rule: identical on all {n} completions (checked).",
        "",
        f"Worker pool start-up (first call, {pool.num_workers} workers, in no row above): {startup:.2f} s; worker "
        f"restarts: {restarts}. Warm-up before timing: {warm_n} other completions per process (see the code). "
        f"1-min load average during the timed slices: {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} CPUs. "
        "CPU of the pool = parent + workers. TRL and the in-process rule each run in a process of their own.",
        "",
    ]

    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, (cat, _, _) in enumerate(data):
        by_cat[cat].append(i)
    agree = sum(o == t for o, t in zip(ours_scores, trl_scores))
    none = sum(t is None for t in trl_scores)
    lines += [
        f"Agreement: **{agree}/{n} = {agree / n:.1%}** (TRL returned `None` — unparsable gold — for {none}).",
        "",
        "| category | n | paper rule: mean | TRL: mean | disagree | example (end of completion → gold: paper / TRL) |",
        "|---|---|---|---|---|---|",
    ]
    for cat in CATEGORIES:
        idx = by_cat.get(cat, [])
        if not idx:
            continue
        o = statistics.mean(ours_scores[i] for i in idx)
        tv = [trl_scores[i] for i in idx if trl_scores[i] is not None]
        t = statistics.mean(tv) if tv else float("nan")
        diff = [i for i in idx if ours_scores[i] != trl_scores[i]]
        example = ""
        if diff:
            i = diff[0]
            example = (f"`{_shorten(data[i][1])}` → `{golds[i]}`: {ours_scores[i]:g} / "
                       f"{'None' if trl_scores[i] is None else format(trl_scores[i], 'g')}")
        lines.append(f"| {cat} | {len(idx)} | {o:.2f} | {t:.2f} | {len(diff)} | {example} |")
    if readme is not None:
        readme += [
            f"Math reward, `{command}` ({n} completions of ~{mean_len:,.0f} characters in groups of {group}; each "
            f"scorer warmed on {warm_n} other completions; the three scorers interleaved over {len(bounds)} batches "
            f"of ~{per_round} completions):",
            "",
            "| scorer | completions/s | × `accuracy_reward` | CPU ms / completion |",
            "|---|---:|---:|---:|",
            f"| `math_reward`, {pool.num_workers} worker processes (fast paths {'on' if fast_paths else 'off'}) | "
            f"{n / t_ours:,.1f} | **{t_trl / t_ours:.2f}×** | {1000 * cpu['pool'] / n:.1f} |",
            f"| same rule in-process, plain Math-Verify (`num_workers=0`) | {n / t_single:,.1f} | "
            f"{t_trl / t_single:.2f}× | {1000 * cpu['single'] / n:.1f} |",
            f"| `trl.rewards.accuracy_reward` (in-process, as TRL runs it) | {n / t_trl:,.1f} | 1.00× | "
            f"{1000 * cpu['trl'] / n:.1f} |",
            "",
            f"Projected from CPU time for {pool.num_workers} free cores (the pool's critical path: parent + busiest "
            f"worker): {n / c_ours:,.1f} completions/s = **{c_trl / c_ours:.2f}×** `accuracy_reward`. 1-min load "
            f"average during the timed batches: {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} CPUs.",
            "",
            f"The pool's scores equal the plain in-process rule's on all {n} completions (checked); agreement with "
            f"TRL's `accuracy_reward`: {agree / n:.1%} (the differences by category: run the command).",
        ]
    kinds = [kind for kind, *_ in _problems(random.Random(0))]
    lines += ["", f"Answer kinds (one per group, drawn uniformly): {', '.join(kinds)}."]
    return "\n".join(lines)


def bench_code(n: int) -> str:
    path = HERE / "code_sandbox_bench.py"
    if not path.exists():
        return f"_Code benchmark skipped: {path.relative_to(HERE.parent)} does not exist._"
    spec = importlib.util.spec_from_file_location("code_sandbox_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.run(n)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="number of completions (default 1000)")
    ap.add_argument("--only", choices=["math", "code"], help="run one benchmark only")
    ap.add_argument("--workers", type=int, default=None, help="math reward worker processes (default: auto)")
    ap.add_argument("--think-chars", type=int, default=4000, help="mean length of the <think> section")
    ap.add_argument("--group", type=int, default=16, help="samples per prompt (default 16, the paper's group size)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds (default 8)")
    ap.add_argument("--no-fast-paths", action="store_true", help="math reward workers without the exact fast paths")
    ap.add_argument("--code-n", type=int, default=64, help="samples for the code sandbox benchmark (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", metavar="FILE", help="also write the README's short version to FILE")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--markdown" in argv:  # the command to cite, without the output file
        i = argv.index("--markdown")
        argv = argv[:i] + argv[i + 2 :]
    command = shlex.join(["python", "benchmarks/rewards.py", *argv])
    readme: list[str] = []
    if args.only != "code":
        print(bench_math(args.n, args.workers, args.think_chars, args.seed, args.group, args.rounds,
                         fast_paths=not args.no_fast_paths, readme=readme, command=command))
        print()
    if args.only != "math":
        code = bench_code(args.code_n)
        print(code)
        readme += ["", code]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(readme).strip() + "\n")


if __name__ == "__main__":
    main()
