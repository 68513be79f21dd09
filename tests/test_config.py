"""OR1Config: the paper's defaults, presets, and clear errors on bad input."""

import os
import warnings

import pytest

from or1_trl import OR1Config
from or1_trl.testing import tiny_training_args


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
        (dict(entropy_coef_delta=-1.0), "entropy_coef_delta=-1.0 must be >= 0"),
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


def test_vllm_weight_sync_defaults_to_disk_off_cuda(tmp_path):
    args = OR1Config(output_dir=str(tmp_path), use_cpu=True)
    assert args.vllm_weight_sync == "disk"
    assert args.vllm_sync_dir is None  # the trainer picks tmpfs or <output_dir>/_vllm_sync (tests/test_disk_sync.py)
    assert OR1Config(output_dir="rel", use_cpu=True, vllm_sync_dir="shared/sync").vllm_sync_dir == os.path.abspath("shared/sync")
    assert OR1Config(output_dir=str(tmp_path), use_cpu=True, vllm_weight_sync="nccl").vllm_weight_sync == "nccl"
    with pytest.raises(ValueError, match="vllm_weight_sync='shm' is not one of"):
        OR1Config(output_dir=str(tmp_path), use_cpu=True, vllm_weight_sync="shm")


def readme_config_line() -> str:
    """The README's drop-in `OR1Config(...)` line, as a user copies it."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
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
        (dict(max_completion_length=0), "max_completion_length=0 must be at least 1"),
        (dict(output_dir=__file__), "is a file; pass a directory"),
        (dict(output_dir=os.path.join(__file__, "run")), "cannot be created: .* is a file"),
    ],
)
def test_bad_lengths_and_output_dirs(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        OR1Config(**{**tiny_training_args(tmp_path), **overrides})
