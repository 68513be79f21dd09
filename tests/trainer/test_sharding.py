"""Sharded training (`or1_trl/trainer/sharding.py`): DeepSpeed ZeRO-2/3 and FSDP2 with every OR1 feature, each run
compared with one process training the same global batch, and no silent downgrade.

The runs are `tests/distributed/sharded_run.py` under `accelerate launch` with the project's configs: on CPUs two
processes (gloo) with `cpu_2proc.yaml` (DDP), `deepspeed_zero2.yaml` and `fsdp2.yaml` (`--num_processes 2
--mixed_precision no`) and `cpu_2proc_zero3.yaml` (every parameter partitioned); FSDP2 on CPUs is forced
(`tests/helpers.force_fsdp2`: accelerate runs DDP there, which `test_fsdp2_on_cpus_is_refused_in_one_line` checks is
refused). With `OR1_TEST_DEVICE=cuda` the launches run on this machine's GPUs instead, one process per GPU, with the
GPU configs (`multi_gpu.yaml`, `deepspeed_zero2.yaml`, `deepspeed_zero3.yaml`, `fsdp2.yaml`, fp32): with one GPU,
world size 1 still runs DeepSpeed's engine and FSDP's wrapping (`scripts/gpu_matrix.sh`).

Tolerance: the launched runs sum gradients in another order than one process (over ranks, over micro-steps), so
parameters agree to `PARAMS_ATOL` (their steps are ~1e-3: learning rate 1e-3) and Adam's moments to `MOMENT_ATOL`;
what must not move at all (a skipped step; a resume against the run it resumes) is compared bit for bit.
"""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from or1_trl.trainer import checkpoint
from or1_trl.trainer.nonfinite import GRAD_METRIC, STEPS_METRIC
from or1_trl.trainer.logprobs import liger_available
from or1_trl.trainer.sharding import (
    check_before_loading, checkpoint_layout, downgrade, requested_backend, UpdateSkip,
)

from ..helpers import ENV, ROOT, accelerate_launch

PARAMS_ATOL, MOMENT_ATOL = 2e-5, 1e-6
DEVICE = os.environ.get("OR1_TEST_DEVICE", "cpu")
SCRIPT = "tests/distributed/sharded_run.py"
PROCESSES = torch.cuda.device_count() if DEVICE == "cuda" else 2
# backend -> (accelerate config, launch options); the FSDP2 run on CPUs is forced (module docstring)
CPU_LAUNCHES = {
    "ddp": ("cpu_2proc.yaml", []),
    "zero2": ("deepspeed_zero2.yaml", ["--num_processes", "2", "--mixed_precision", "no"]),
    "zero3": ("cpu_2proc_zero3.yaml", []),
    "fsdp2": ("fsdp2.yaml", ["--num_processes", "2", "--mixed_precision", "no"]),
}
GPU_LAUNCHES = {
    name: (config, ["--num_processes", str(PROCESSES), "--mixed_precision", "no"])
    for name, config in {"ddp": "multi_gpu.yaml", "zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml",
                         "fsdp2": "fsdp2.yaml"}.items()
}
LAUNCHES = GPU_LAUNCHES if DEVICE == "cuda" else CPU_LAUNCHES
SHARDED = ("zero2", "zero3", "fsdp2")
PARALLEL = DEVICE == "cuda"  # the all-features runs at once (`Runs`)
# backend -> what the trainer may get: (accelerate's distributed type, the trainer's wrapped model); DDP of one process
# (torchrun of one) may or may not wrap the model
EXPECTED = {"ddp": {("MULTI_GPU" if DEVICE == "cuda" else "MULTI_CPU", "DistributedDataParallel")},
            "zero2": {("DEEPSPEED", "DeepSpeedEngine")}, "zero3": {("DEEPSPEED", "DeepSpeedEngine")},
            "fsdp2": {("FSDP", "FSDPQwen2ForCausalLM")}}
if PROCESSES == 1:
    EXPECTED["ddp"] |= {("MULTI_GPU", "Qwen2ForCausalLM"), ("NO", "Qwen2ForCausalLM")}


def launch(backend: str, output_dir, log=None, **options):
    """`sharded_run.py` launched with `backend`'s config (its `CompletedProcess`, or with `log` its `Popen`)."""
    config, launch_options = LAUNCHES[backend]
    options = {"features": "all", "device": DEVICE, **options,
               "force_fsdp2": backend == "fsdp2" and DEVICE == "cpu"}
    return accelerate_launch(config, SCRIPT, output_dir, json.dumps(options), options=launch_options, log=log)


def sharded_run(backend: str, output_dir, **options) -> dict:
    """`launch`, then its `result.json`."""
    result = launch(backend, output_dir, **options)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads((output_dir / "result.json").read_text())


def one_process(output_dir, log, **options):
    """The reference: the same global batch in one plain process, running (`Popen`), its output into the file `log`."""
    command = [sys.executable, os.path.join(ROOT, SCRIPT), str(output_dir),
               json.dumps({"features": "all", "device": DEVICE, **options})]
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**ENV, "OMP_NUM_THREADS": "1"})


class Runs:
    """`runs(key)`: `(folder, result.json, states)` of a run made once for the module; `key` is a backend (its
    all-features launch) or `"one process <features>"`. On CPUs a run starts when first asked (2 cores); on GPUs the
    first call starts the all-features run of every backend and the reference at once (tiny models sharing the GPU:
    the matrix fits the few minutes a lent GPU gives)."""

    def __init__(self, factory):
        self.factory, self.done = factory, {}

    def start(self, key: str):
        folder = self.factory.mktemp(key.replace(" ", "_"))
        log = folder.parent / f"{folder.name}.log"
        if key.startswith("one process "):
            return folder, log, one_process(folder, log, features=key.split()[-1])
        return folder, log, launch(key, folder, log)

    def __call__(self, key: str):
        if key not in self.done:
            keys = [key] + ([k for k in [*LAUNCHES, "one process all"] if k not in self.done and k != key]
                            if PARALLEL else [])
            started = {k: self.start(k) for k in keys}
            for k, (folder, log, process) in started.items():  # a failed run fails the tests that read it, only
                process.wait(timeout=900)
                self.done[k] = (f"{k}: {log.read_text()[-6000:]}" if process.returncode else
                                (folder, json.loads((folder / "result.json").read_text()), states(folder)))
        assert not isinstance(self.done[key], str), self.done[key]
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def record(backend: str, **figures) -> None:
    """One line of the GPU matrix's summary (`$OR1_MATRIX_SUMMARY`, set by scripts/gpu_matrix.sh)."""
    path = os.environ.get("OR1_MATRIX_SUMMARY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"backend": backend, "device": DEVICE, "processes": PROCESSES, **figures}) + "\n")


def states(output_dir) -> dict[int, dict]:
    return {int(name[len("state_step"):-3]): torch.load(output_dir / name, weights_only=False)
            for name in os.listdir(output_dir) if name.startswith("state_step")}


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a if a[name] is not None or b[name] is not None)


def assert_same_training(run: dict[int, dict], reference: dict[int, dict]):
    """Each step's parameters and Adam moments within tolerance of the reference; the rest exactly."""
    assert run.keys() == reference.keys() == {1, 2, 3, 4}
    for step in run:
        assert largest_difference(run[step]["params"], reference[step]["params"]) < PARAMS_ATOL, step
        for moment in ("exp_avg", "exp_avg_sq"):
            assert largest_difference(run[step][moment], reference[step][moment]) < MOMENT_ATOL, (step, moment)
        assert run[step]["adam_steps"] == reference[step]["adam_steps"], step
        assert run[step]["lr"][0] == pytest.approx(reference[step]["lr"][0], rel=1e-12), step
    assert largest_difference(reference[4]["params"], reference[1]["params"]) > 1e-4  # the runs learn (at step 4)


def assert_step_2_not_applied(run: dict[int, dict], log_history: list[dict]):
    """Step 2 (its gradient of `NAN_PARAM` NaN on the last rank, `sharded_run.plant_nan`) left weights, moments, Adam's
    step counts and the learning rate exactly as step 1 left them, on every rank; the sentinel counted one non-finite
    gradient (the one parameter, seen on one rank or, averaged by DDP, on all), and no weight is ever non-finite."""
    before, after = run[1], run[2]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert largest_difference(after[key], before[key]) == 0.0, key
    assert (after["adam_steps"], after["lr"]) == (before["adam_steps"], before["lr"])
    assert all(torch.isfinite(value).all() for state in run.values() for value in state["params"].values())
    assert [e[GRAD_METRIC] for e in log_history if GRAD_METRIC in e] == [0.0, 1.0, 1.0, 1.0]
    assert [e[STEPS_METRIC] for e in log_history if STEPS_METRIC in e] == [0.0, 1.0, 1.0, 1.0]


def assert_step_3_skipped(run: dict[int, dict]):
    """Step 3 (every group rejected) left weights, moments, Adam's step counts, the learning rate and DeepSpeed's
    engine counters exactly as step 2 left them."""
    before, after = run[2], run[3]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert largest_difference(after[key], before[key]) == 0.0, key
    assert (after["adam_steps"], after["lr"], after["engine"]) == (before["adam_steps"], before["lr"], before["engine"])
    assert run[4]["adam_steps"] == [s + 1 for s in after["adam_steps"]]  # the next step updates again


@pytest.mark.parametrize("backend", list(LAUNCHES))
def test_every_feature_trains_as_one_process_does(backend, runs):
    """A NaN gradient on one rank not applied (the non-finite sentinel), rejection with compaction and refill, an
    all-rejected step skipped, the entropy controller (α on from step 2), packing, two stages (4-token then 6-token
    completions; 1 then 2 micro-steps per optimizer step: DeepSpeed's engine rebuilt for the second), a verified
    checkpoint each step; the parameters are really sharded."""
    folder, result, run = runs(backend)
    _, reference, reference_states = runs("one process all")
    record(backend, distributed_type=result["distributed_type"], model_class=result["model_class"],
           params_vs_one_process=largest_difference(run[4]["params"], reference_states[4]["params"]),
           skipped_step_moved=largest_difference(run[3]["params"], run[2]["params"]),
           adam_steps=[run[step]["adam_steps"] for step in sorted(run)], local_fraction=result["local_fraction"])
    assert (result["distributed_type"], result["model_class"]) in EXPECTED[backend]
    if backend in ("zero3", "fsdp2") and PROCESSES > 1:  # parameters partitioned: each rank holds about half
        assert 0.45 < result["local_fraction"] < 0.55
    assert result["skipped_steps"] == reference["skipped_steps"] == 1
    # "auto": the Liger head where it runs (CPU, installed), TRL's under ZeRO-3 (test_what_deepspeed_cannot_run...)
    liger = DEVICE == "cpu" and liger_available() and backend != "zero3"
    assert result["logprob_backend"] == ("liger" if liger else "trl")
    assert_step_2_not_applied(run, result["log_history"])
    assert_step_2_not_applied(reference_states, reference["log_history"])
    assert_step_3_skipped(run)
    assert_step_3_skipped(reference_states)
    assert_same_training(run, reference_states)
    logged = [e for e in result["log_history"] if "stage" in e]
    assert [e["stage"] for e in logged] == [0, 0, 1, 1]
    assert [e["entropy/alpha"] for e in logged] == pytest.approx([0.0, 0.05, 0.1, 0.1])  # none measured at step 3
    assert any(e.get("refill/rounds", 0) >= 1 for e in logged) and any(e["rejection/kept_group_frac"] < 1 for e in logged)
    for step in range(1, 5):  # each checkpoint verified, its marker listing every rank's shards
        assert checkpoint.find_problems(str(folder / f"checkpoint-{step}"), []) == []


@pytest.mark.parametrize("backend", SHARDED)
def test_a_killed_run_resumes_exactly_from_its_last_complete_checkpoint(backend, runs, tmp_path):
    """The all-features run as if killed while saving checkpoint-4 (its shards written, its marker not): a new
    launch skips checkpoint-4, resumes from checkpoint-3 (stage 1, after the skipped step) and ends bit for bit where
    the uninterrupted run did. A checkpoint missing one rank's shard is refused by name."""
    folder, _, run = runs(backend)
    killed = tmp_path / "run"
    shutil.copytree(folder, killed)
    os.remove(killed / "checkpoint-4" / checkpoint.MARKER_FILE)
    for name in ("state_step4.pt", "result.json"):
        os.remove(killed / name)
    result = sharded_run(backend, killed, resume=True)
    resumed, uninterrupted = states(killed)[4], run[4]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert largest_difference(resumed[key], uninterrupted[key]) == 0.0, key
    assert (resumed["adam_steps"], resumed["lr"], resumed["engine"]) == (
        uninterrupted["adam_steps"], uninterrupted["lr"], uninterrupted["engine"])
    assert result["skipped_steps"] == 1  # restored from the checkpoint

    layout = checkpoint_layout(layout_accelerator(backend))
    shard = next(name for name in sorted(checkpoint._files(str(killed / "checkpoint-3")))
                 if "rank_1" in name or "__1_" in name)
    os.remove(killed / "checkpoint-3" / shard)
    problems = checkpoint.find_problems(str(killed / "checkpoint-3"), layout)
    assert f"{shard} is missing" in problems


def layout_accelerator(backend: str, processes: int = 2):
    """What `checkpoint_layout` reads of an accelerator, for `backend` with `processes` ranks."""
    kind = {"ddp": DistributedType.MULTI_GPU, "zero2": DistributedType.DEEPSPEED, "zero3": DistributedType.DEEPSPEED,
            "fsdp2": DistributedType.FSDP}[backend]
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=int(backend[-1])) if "zero" in backend else None,
                            fsdp_plugin=SimpleNamespace(state_dict_type="StateDictType.SHARDED_STATE_DICT"))
    return SimpleNamespace(distributed_type=kind, num_processes=processes, state=state)


def test_the_checkpoint_layout_names_every_ranks_shards():
    assert checkpoint_layout(layout_accelerator("ddp", 1)) == []
    assert checkpoint_layout(layout_accelerator("ddp")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert checkpoint_layout(layout_accelerator("zero2"))[2:] == [
        "latest", "global_step*/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step*/zero_pp_rank_1_mp_rank_00_optim_states.pt", "global_step*/mp_rank_00_model_states.pt"]
    assert "global_step*/zero_pp_rank_1_mp_rank_00_model_states.pt" in checkpoint_layout(layout_accelerator("zero3"))
    assert checkpoint_layout(layout_accelerator("fsdp2"))[2:] == [
        "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_*.distcp", "pytorch_model_fsdp_0/__1_*.distcp",
        "optimizer_0/.metadata", "optimizer_0/__0_*.distcp", "optimizer_0/__1_*.distcp"]


@pytest.mark.parametrize("backend", SHARDED)
def test_lora_trains_as_one_process_does(backend, runs, tmp_path):
    """A LoRA adapter (base weights frozen) with rejection and refill, the controller, 80/20 and the skipped step."""
    result = sharded_run(backend, tmp_path, features="lora")
    _, reference, reference_states = runs("one process lora")
    run = states(tmp_path)
    assert set(run[1]["params"]) == set(reference_states[1]["params"]) and all("lora_" in n for n in run[1]["params"])
    assert_step_3_skipped(run)
    assert_same_training(run, reference_states)
    assert result["skipped_steps"] == 1


@pytest.mark.parametrize("backend", ("zero3", "fsdp2"))
def test_the_vllm_server_gets_the_weights_gathered_from_the_shards(backend, vllm_server, tmp_path):
    """Rollouts from the vLLM CPU server, weights pushed through a directory each step: TRL's iterator gathers the
    ZeRO-3 partitions (DeepSpeed's `GatheredParameters`) or FSDP2's `DTensor` shards (`full_tensor`). The server's
    log-probs of the sampled tokens match the trainer's at every step, and after a last push its log-probs of a text
    are those of the trained weights gathered whole."""
    if DEVICE == "cuda":
        pytest.skip("the vLLM server of these tests is the CPU build")
    result = sharded_run(backend, tmp_path, features="vllm", vllm_url=vllm_server.url,
                         vllm_model=vllm_server.model_path)
    diffs = [e["sampling/sampling_logp_difference/max"] for e in result["log_history"]
             if "sampling/sampling_logp_difference/max" in e]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs
    assert result["server_vs_trainer"] < 1e-4


def test_fsdp2_on_cpus_is_refused_in_one_line(tmp_path):
    """Without forcing, accelerate runs `fsdp2.yaml` as DDP on CPUs: the trainer stops before training, saying what
    was asked, what it got and why (sharding_fallback="allow" would train with DDP: test_a_downgrade_...)."""
    if DEVICE == "cuda":
        pytest.skip("on GPUs FSDP is what accelerate gives")
    config, launch_options = CPU_LAUNCHES["fsdp2"]
    result = accelerate_launch(config, SCRIPT, tmp_path, json.dumps({"features": "all"}), options=launch_options)
    assert result.returncode != 0
    assert ("Sharded training: accelerate launch's config (ACCELERATE_USE_FSDP=true) asked for FSDP, but this trainer "
            "runs MULTI_CPU: accelerate selects FSDP only for GPU-type process groups") in result.stderr
    assert "Set sharding_fallback='allow'" in result.stderr and not os.path.exists(tmp_path / "checkpoint-1")


def test_a_downgrade_is_named_and_an_error_unless_allowed(caplog):
    from or1_trl.trainer.sharding import check_backend

    args = SimpleNamespace(deepspeed=None, fsdp="")
    assert requested_backend(args, {}) is None
    assert requested_backend(args, {"ACCELERATE_USE_FSDP": "true"})[0] == "FSDP"
    assert requested_backend(args, {"ACCELERATE_USE_DEEPSPEED": "true"})[0] == "DEEPSPEED"
    assert requested_backend(SimpleNamespace(deepspeed="ds.json", fsdp=""), {}) == ("DEEPSPEED", "TrainingArguments.deepspeed")
    assert downgrade(("FSDP", "x"), "FSDP", "cpu") is None and downgrade(None, "MULTI_CPU", "cpu") is None
    line = downgrade(("DEEPSPEED", "TrainingArguments.deepspeed"), "NO", "cuda")
    assert line.startswith("Sharded training: TrainingArguments.deepspeed asked for DEEPSPEED, but this trainer runs NO")

    def trainer(fallback):
        accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, device=torch.device("cpu"),
                                      is_main_process=True)
        return SimpleNamespace(args=SimpleNamespace(deepspeed=None, fsdp=["full_shard"], sharding_fallback=fallback),
                               accelerator=accelerator)

    with pytest.raises(ValueError, match="TrainingArguments.fsdp asked for FSDP, but this trainer runs MULTI_CPU"):
        check_backend(trainer("error"))
    with caplog.at_level("WARNING"):
        check_backend(trainer("allow"))
    assert "Training with it (sharding_fallback='allow')" in caplog.text


def test_what_deepspeed_cannot_run_is_refused_before_the_model_loads():
    def args(zero_stage, accumulation="auto", backend="auto"):
        config = {"gradient_accumulation_steps": accumulation}
        return SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage, deepspeed_config=config),
                               logprob_backend=backend)

    shapes = [SimpleNamespace(gradient_accumulation_steps=n) for n in (1, 2)]
    check_before_loading(args(3), shapes)  # "auto": each stage sets it (test_every_feature...: stages 1 then 2)
    check_before_loading(args(2, accumulation=2), shapes[1:])  # one shape
    with pytest.raises(ValueError, match=r"stages train with gradient_accumulation_steps \[1, 2\], but the DeepSpeed "
                                         "config fixes gradient_accumulation_steps=2"):
        check_before_loading(args(2, accumulation=2), shapes)
    with pytest.raises(ValueError, match="logprob_backend='liger' cannot run under DeepSpeed ZeRO-3"):
        check_before_loading(args(3, backend="liger"), [])
    check_before_loading(args(2, backend="liger"), [])  # ZeRO-2 keeps the head whole


def test_a_skip_mark_that_accelerate_stops_reading_is_an_error():
    optimizer = SimpleNamespace(step_was_skipped=False)  # a wrapper that ignores the mark
    trainer = SimpleNamespace(optimizer=optimizer,
                              accelerator=SimpleNamespace(gradient_state=SimpleNamespace(_set_sync_gradients=print)))
    with pytest.raises(RuntimeError, match="would move the learning-rate schedule"):
        UpdateSkip(trainer).skip()


def test_a_fully_rejected_step_is_skipped_without_deepspeed_installed(tmp_path, monkeypatch):
    """Without DeepSpeed, accelerate exports no `DeepSpeedOptimizerWrapper` (its `utils` import it only where DeepSpeed
    is installed): a step whose every group is rejected is still skipped, the learning-rate schedule left alone (a
    first H200 run of the ladder benchmark, with no DeepSpeed there, stopped on that import)."""
    import accelerate.utils
    from datasets import Dataset

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import tiny_model, tiny_tokenizer, tiny_training_args

    monkeypatch.delattr(accelerate.utils, "DeepSpeedOptimizerWrapper", raising=False)
    monkeypatch.setattr(accelerate.utils, "is_deepspeed_available", lambda: False)
    tokenizer = tiny_tokenizer()
    args = OR1Config(**tiny_training_args(tmp_path, max_steps=2, lr_scheduler_type="linear"))
    data = Dataset.from_dict({"prompt": [f"Q: {i}+{i}=? A:" for i in range(8)]})
    trainer = OR1Trainer(tiny_model(tokenizer), lambda completions, **kw: [0.0] * len(completions), args=args,
                         train_dataset=data, processing_class=tokenizer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.or1_skipped_steps == 2
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert set(trainer.lr_scheduler.get_last_lr()) == {args.learning_rate}  # linear decay never stepped


def test_memory_per_gpu_follows_the_zero_papers_count():
    from or1_trl.trainer.sharding import gathered_gb, training_state_gb

    billion = 10**9  # 16 bytes a parameter: bf16 weights 2 and gradients 2, fp32 master weights and moments 12
    assert [training_state_gb(billion, backend, 8) for backend in ("ddp", "zero2", "zero3", "fsdp2")] == [
        16.0, 2 + 14 / 8, 2.0, 2.0]
    assert training_state_gb(billion, "zero3", 1) == 16.0  # world size 1 shards nothing
    assert gathered_gb("ddp", 10, 10) == gathered_gb("zero2", 10, 10) == 0.0
    assert gathered_gb("fsdp2", billion, billion // 10) == 2 * 1.2  # the root unit and two layers, in bf16
    assert gathered_gb("zero3", 3 * billion, billion) == 2.0  # capped by stage3_max_live_parameters
