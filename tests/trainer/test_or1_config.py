"""OR1Config: the paper's defaults, presets, and clear errors on bad input."""

import dataclasses
import os
import re
import warnings

import pytest
from trl import GRPOConfig

from or1_trl import OR1Config
from or1_trl.testing import tiny_training_args

from ..helpers import ROOT



def config(tmp_path, **overrides):
    return OR1Config(**tiny_training_args(tmp_path, **overrides))


def test_magic_defaults(tmp_path):
    c = OR1Config(output_dir=str(tmp_path), use_cpu=True)
    assert (c.loss_type, c.beta, c.epsilon, c.temperature, c.learning_rate) == ("dapo", 0.0, 0.2, 1.0, 1e-6)
    assert str(c.lr_scheduler_type.value if hasattr(c.lr_scheduler_type, "value") else c.lr_scheduler_type) == "constant"
    assert c.use_adaptive_entropy and c.entropy_coef == 0.0
    assert (c.entropy_target, c.entropy_coef_delta, c.entropy_coef_min) == (0.2, 0.005, 0.0)
    assert c.rejection_sampling == "compact" and c.entropy_estimator == "full"
    assert c.sgd_steps_per_rollout == 1 and c.num_iterations == 1
    assert c.mask_truncated_completions is False


def test_released_preset_and_explicit_fields_win(tmp_path):
    c = config(tmp_path, entropy_preset="released")
    assert (c.entropy_target, c.entropy_coef_delta, c.entropy_coef_max) == (0.2, 1e-4, 5e-3)
    c = config(tmp_path, entropy_preset="released", entropy_coef_delta=0.002)
    assert c.entropy_coef_delta == 0.002 and c.entropy_coef_max == 5e-3


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(rejection_sampling="drop"), "rejection_sampling='drop' is not one of"),
        (dict(entropy_estimator="vocab"), "entropy_estimator='vocab'"),
        (dict(top_entropy_normalization="top"), "top_entropy_normalization='top'"),
        (dict(entropy_preset="skywork"), "entropy_preset='skywork'"),
        (dict(top_entropy_quantile=1.5), r"top_entropy_quantile=1.5 must be in \[0, 1\]"),
        (dict(entropy_target=0.0), "entropy_target=0.0 must be > 0"),
        (dict(entropy_coef_delta=-1.0), "entropy_coef_delta=-1.0 must be >= 0 and finite"),
        (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "must not exceed entropy_coef_max"),
        (dict(entropy_coef=2.0), r"entropy_coef=2.0 \(c_0\) lies outside"),
        (dict(loss_type="grpo", top_entropy_quantile=0.2, top_entropy_normalization="selected"),
         "loss_type='grpo' has no such count"),
        (dict(beta=0.04, top_entropy_quantile=0.2, top_entropy_normalization="selected"), "rescale TRL's KL term"),
    ],
)
def test_bad_config_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **overrides)


def test_every_choice_field_is_checked_with_its_choices(tmp_path):
    """`FIELD_CHOICES` is the one table of fixed values: each field the command line limits to choices is in it with
    the same values, and a value outside them is one `ValueError` naming the field, the value and the choices."""
    from or1_trl.trainer.or1_config import FIELD_CHOICES

    limited = {f.name: f.metadata["choices"] for f in dataclasses.fields(OR1Config)
               if "choices" in f.metadata and f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}}
    assert {name: list(FIELD_CHOICES[name]) for name in limited} == limited
    for name, allowed in FIELD_CHOICES.items():
        with pytest.raises(ValueError, match=re.escape(f"{name}='bogus' is not one of {list(allowed)}.")):
            config(tmp_path, **{name: "bogus"})


def test_every_or1_field_has_the_value_that_reproduces_grpo_trainer(tmp_path):
    """`TRL_BEHAVIOUR` is the one table of what TRL would do: every OR1 field (every `OR1Config` field `GRPOConfig`
    lacks) is in it, with a value its choices allow; `from_grpo` gives a plain `GRPOConfig` exactly those values and
    keeps each of its own, and returns an `OR1Config` as it is."""
    from or1_trl.trainer.or1_config import FIELD_CHOICES, TRL_BEHAVIOUR

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    or1_fields = {f.name for f in dataclasses.fields(OR1Config)} - trl_fields
    assert set(TRL_BEHAVIOUR) == or1_fields
    for name, allowed in FIELD_CHOICES.items():
        assert name not in TRL_BEHAVIOUR or TRL_BEHAVIOUR[name] in allowed + (None,), name
    grpo = GRPOConfig(**tiny_training_args(tmp_path, lr_scheduler_type="constant", use_adaptive_entropy=True))
    converted = OR1Config.from_grpo(grpo)
    assert type(converted) is OR1Config and converted is not grpo
    assert {name: getattr(converted, name) for name in or1_fields} == TRL_BEHAVIOUR
    assert all(getattr(converted, name) == getattr(grpo, name) for name in trl_fields)
    assert not converted.or1_loss_enabled and converted.changed_defaults() == [] and converted.stage_list == []
    assert not hasattr(grpo, "rejection_sampling")  # the user's config is left as it was
    or1 = config(tmp_path)
    assert OR1Config.from_grpo(or1) is or1 and or1.recipe == "magic"


def test_trl_losses_allowed_with_or1_off(tmp_path):
    c = config(tmp_path, loss_type="grpo", beta=0.04, rejection_sampling="off", use_adaptive_entropy=False)
    assert not c.or1_loss_enabled


def test_warns_when_adaptive_entropy_meets_many_sgd_steps(tmp_path):
    with pytest.warns(UserWarning, match="N_SGD > 2"):
        config(tmp_path, num_iterations=3)
    with pytest.warns(UserWarning, match="N_SGD > 2"):
        config(tmp_path, steps_per_generation=4, gradient_accumulation_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config(tmp_path, num_iterations=2)  # 2 is still fine (§4.5)
        config(tmp_path, num_iterations=3, use_adaptive_entropy=False)
        config(tmp_path, stages=[{"until_step": 2, "batch_size": 4, "mini_batch_size": 2}])  # N_SGD = 2


def test_the_n_sgd_warning_reads_every_stage(tmp_path):
    """A staged run warns when any stage takes more than 2 optimizer steps per rollout (batch_size / mini_batch_size
    prompts), what the stage leaves out coming from the config, as the trainer sizes it."""
    with pytest.warns(UserWarning, match="Adaptive entropy control with 4 SGD steps"):
        config(tmp_path, stages=[{"until_step": 2}, {"until_step": 4, "batch_size": 8, "mini_batch_size": 2}])
    shape = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2)  # 2 prompts a step
    with pytest.warns(UserWarning, match="Adaptive entropy control with 3 SGD steps"):
        config(tmp_path, **shape, stages=[{"until_step": 2, "batch_size": 6}])  # 6 prompts a rollout / 2 a step
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        c = config(tmp_path, **shape, stages=[{"until_step": 2, "batch_size": 4}])
    assert c.largest_sgd_steps_per_rollout() == 2 and c.sgd_steps_per_rollout == 1


def test_vllm_weight_sync_defaults_to_disk_off_cuda(tmp_path):
    args = OR1Config(output_dir=str(tmp_path), use_cpu=True)
    assert args.vllm_weight_sync == "disk"
    assert args.vllm_sync_dir is None  # the trainer picks tmpfs or <output_dir>/_vllm_sync (tests/generation/test_disk_sync.py)
    assert OR1Config(output_dir="rel", use_cpu=True, vllm_sync_dir="shared/sync").vllm_sync_dir == os.path.abspath("shared/sync")
    assert OR1Config(output_dir=str(tmp_path), use_cpu=True, vllm_weight_sync="nccl").vllm_weight_sync == "nccl"
    with pytest.raises(ValueError, match="vllm_weight_sync='shm' is not one of"):
        OR1Config(output_dir=str(tmp_path), use_cpu=True, vllm_weight_sync="shm")


def test_trls_gradient_checkpointing_default_raises_no_future_warning(tmp_path):
    """TRL's configs set `gradient_checkpointing` (default True), the name transformers 5 deprecates: OR1Config resolves
    it to `activation_checkpointing` itself, so nobody sees a FutureWarning for a field they never set; the value is
    what transformers' own resolution gives."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        default = OR1Config(output_dir=str(tmp_path), use_cpu=True, bf16=False)
        off = OR1Config(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False)
        new = OR1Config(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=False)
    assert (default.activation_checkpointing, default.gradient_checkpointing) == (True, True)
    assert (off.activation_checkpointing, off.gradient_checkpointing) == (False, False)
    assert (new.activation_checkpointing, new.gradient_checkpointing) == (False, False)


def readme_config_line() -> str:
    """The README's drop-in `OR1Config(...)` line, as a user copies it."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    line = next(line for line in readme.splitlines() if line.startswith("+args = OR1Config("))
    return line[1:].split("#")[0].strip()


def test_readme_config_runs_as_written_and_bf16_follows_cuda(tmp_path, monkeypatch, caplog):
    """TRL turns bf16 on unless fp16; on a machine without CUDA an unset bf16 is off (one line says so) instead of
    transformers' "Your setup doesn't support bf16/gpu" error. Explicit values and CUDA machines are unchanged."""
    import torch
    from transformers.utils import is_torch_bf16_gpu_available

    monkeypatch.chdir(tmp_path)
    namespace = {"OR1Config": OR1Config}
    exec(readme_config_line(), namespace)  # args = OR1Config(output_dir="out")
    args = namespace["args"]
    cuda = torch.cuda.is_available() or is_torch_bf16_gpu_available()
    assert args.bf16 is cuda and args.output_dir == "out"
    said = [r.getMessage() for r in caplog.records if "bf16=False" in r.getMessage()]
    assert len(said) == (0 if cuda else 1), said
    assert OR1Config(output_dir="out", use_cpu=True, bf16=True).bf16 is True  # bf16 on CPU, asked for
    assert OR1Config(output_dir="out", use_cpu=True, fp16=False, bf16=False).bf16 is False
    assert os.listdir(tmp_path) == []  # building a config writes nothing


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_completion_length=0), "max_completion_length=0 must be an integer >= 1"),
        (dict(output_dir=__file__), "is a file; pass a directory"),
        (dict(output_dir=os.path.join(__file__, "run")), "cannot be created: .* is a file"),
    ],
)
def test_bad_lengths_and_output_dirs(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        OR1Config(**{**tiny_training_args(tmp_path), **overrides})
