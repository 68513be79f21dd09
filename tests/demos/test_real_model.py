"""The real-model demo (`or1_trl/demos/real_model.py`, `or1-trl demo --model smollm2`): its growing context and report
against a plain reference, and its server's lifetime. The demo end to end on its own vLLM CPU server is tested with its
benchmark (`tests/test_benchmarks.py::test_the_real_model_demo_end_to_end_and_its_benchmark`: one run of it for both)."""

import os


def test_the_real_demo_schedule_and_report_against_a_plain_reference():
    """`--model smollm2`'s growing context, and its report: means per rung and over the ladder, and the gain's
    interval, against a plain paired percentile bootstrap over the held-out prompts."""
    import numpy as np

    from or1_trl.demos.real_model import CONTEXT, FIRST_CONTEXT, demo_stages, gain_report, summary_line

    assert demo_stages(30) == [{"until_step": 10, "max_completion_length": FIRST_CONTEXT},
                               {"until_step": 30, "max_completion_length": CONTEXT}]
    assert demo_stages(2) is None
    rng = np.random.default_rng(1)
    ids = [f"{rung}-{i}-0" for rung in ("add1", "add2") for i in range(30)]
    before = {pid: float(rng.integers(0, 5)) / 4 for pid in ids}
    after = {pid: min(1.0, before[pid] + float(rng.integers(0, 3)) / 4) for pid in ids}
    report = gain_report(before, after, seed=7)
    assert report["before"] == sum(before.values()) / 60 and report["after"] == sum(after.values()) / 60
    assert report["rungs"]["add2"] == {"before": np.mean([before[p] for p in ids[30:]]),
                                       "after": np.mean([after[p] for p in ids[30:]]), "prompts": 30}
    gains = np.array([after[p] - before[p] for p in ids])
    draws = np.random.default_rng(7).integers(0, 60, size=(10_000, 60))
    means = [gains[row].mean() for row in draws]
    assert report["gain_ci"] == [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
    line = summary_line("smollm2", report, 570.0)
    assert line == (f"OR1 demo (smollm2): held-out accuracy {report['before']:.2f} -> {report['after']:.2f} (gain 95% "
                    f"interval {report['gain_ci'][0]:.2f}-{report['gain_ci'][1]:.2f}), 9.5 min")


def test_the_demo_server_dies_with_the_demo(monkeypatch, tmp_path):
    """The demo's own vLLM server is started with `with_parent`: a demo killed outright (SIGTERM, SIGKILL), which never
    runs its context managers' exits, does not leave the server running (and holding its memory)."""
    import contextlib

    import or1_trl.generation.serve as serve
    import or1_trl.testing as testing
    from or1_trl.demos.real_model import SERVER_ARGS, generation_server

    started = []

    @contextlib.contextmanager
    def recorded(model, weight_sync, **options):
        started.append((model, weight_sync, options))
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(serve, "running_server", recorded)
    monkeypatch.setattr(testing, "vllm_python", lambda: "/venv/bin/python")
    with generation_server(str(tmp_path), "vllm", str(tmp_path / "server.log")) as url:
        assert url == "http://127.0.0.1:1"
    [(model, weight_sync, options)] = started
    assert (model, weight_sync, options["with_parent"], options["extra_args"]) == (str(tmp_path), "disk", True,
                                                                                    SERVER_ARGS)


def test_the_demo_trains_in_bf16_only_where_bf16_is_fast(tmp_path):
    """`bf16_is_fast` against the CPU's own flags (Linux, x86, no CUDA): oneDNN's bf16 kernels need AVX-512 BW, VL and
    DQ; on a CPU with AVX2 only a bf16 matmul is many times slower than fp32, and the demo's config trains in fp32."""
    import platform

    import pytest
    import torch

    from or1_trl.demos.real_model import bf16_is_fast, demo_config

    if torch.cuda.is_available() or platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the reference is an x86 Linux CPU's flags")
    flags = set(open("/proc/cpuinfo").read().split())
    expected = {"avx512bw", "avx512vl", "avx512dq"} <= flags
    assert bf16_is_fast() == expected
    assert demo_config(str(tmp_path / "out"), max_steps=3).bf16 == expected
