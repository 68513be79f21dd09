"""`or1_trl/trainer/attention_guard.py`: cuDNN SDPA off on Hopper with SDPA attention and torch >= 2.11, said once;
each condition failing in turn, or the field off, leaves it on (the device query faked: no GPU here); `OR1Trainer`
acts on `OR1Config.cudnn_sdpa_guard` when it is built."""

import logging

import pytest
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from or1_trl.trainer import attention_guard
from or1_trl.trainer.attention_guard import GuardDecision, decide

from ..helpers import parity_reward, tagged_dataset

HOPPER = (9, 0)


@pytest.fixture
def cudnn_sdpa_restored():
    """The process-wide switch as it was, after the test."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def fake_device(monkeypatch, capability):
    """`torch.cuda` reports one device of `capability` (`None`: no CUDA device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_the_guard_acts_only_where_all_four_conditions_hold():
    acting = decide(HOPPER, "sdpa", "2.11.0+cu130", enabled=True)
    assert acting.disable_cudnn_sdpa
    assert acting.reason.startswith("compute capability 9.0 (Hopper), attn_implementation='sdpa', torch 2.11.0+cu130: ")
    assert "pytorch/pytorch#196678" in acting.reason
    assert decide((9, 0), "sdpa", "2.13.0", True).disable_cudnn_sdpa  # no fixed release known: every later one
    assert decide((9, 0), "sdpa", "2.11.0.dev20260101+cu130", True).disable_cudnn_sdpa  # nightlies as their release
    # Each condition failing in turn, the others held; the reason names it.
    assert decide(HOPPER, "sdpa", "2.11.0", enabled=False) == GuardDecision(False, "cudnn_sdpa_guard=False")
    assert decide(None, "sdpa", "2.11.0", True) == GuardDecision(False, "no CUDA device")
    for capability in ((8, 0), (8, 9), (10, 0), (12, 0)):  # A100, L40/4090, B200, RTX 50xx
        assert decide(capability, "sdpa", "2.11.0", True) == GuardDecision(
            False, f"compute capability {capability[0]}.{capability[1]}, not Hopper (9.x)")
    for attention in ("eager", "flash_attention_2", "flex_attention", None):
        assert decide(HOPPER, attention, "2.11.0", True) == GuardDecision(
            False, f"attn_implementation={attention!r}, not 'sdpa'")
    for version in ("2.10.1+cu128", "2.5.0", "1.13.1"):
        assert decide(HOPPER, "sdpa", version, True) == GuardDecision(
            False, f"torch {version} predates the bug (torch 2.11)")
    with pytest.raises(ValueError, match="not a torch version: 'nightly'"):
        decide(HOPPER, "sdpa", "nightly", True)


def test_apply_switches_cudnn_sdpa_off_once_and_says_why(cudnn_sdpa_restored, caplog):
    acting = decide(HOPPER, "sdpa", "2.11.0", True)
    with caplog.at_level(logging.INFO, logger=attention_guard.__name__):
        assert not attention_guard.apply(decide(HOPPER, "eager", "2.11.0", True))
        assert torch.backends.cuda.cudnn_sdp_enabled() and not caplog.records  # nothing done, nothing said
        assert attention_guard.apply(acting)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not attention_guard.apply(acting)  # already off: said once
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    line = caplog.records[0].getMessage()
    assert acting.reason in line and "cudnn_sdpa_guard=False" in line and "enable_cudnn_sdp(False)" in line


@pytest.mark.parametrize("capability,attention,acts", [
    (HOPPER, "sdpa", True), (None, "sdpa", False), ((8, 0), "sdpa", False), (HOPPER, "eager", False)])
def test_guard_reads_the_device_and_the_model(monkeypatch, cudnn_sdpa_restored, capability, attention, acts):
    """`guard`: this process's CUDA device and torch's version (both faked) and the model's
    `config._attn_implementation`."""
    fake_device(monkeypatch, capability)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    model = type("Model", (), {"config": type("Config", (), {"_attn_implementation": attention})()})()
    decision = attention_guard.guard(True, model, announce=False)
    assert decision.disable_cudnn_sdpa is acts
    assert torch.backends.cuda.cudnn_sdp_enabled() is not acts
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert not attention_guard.guard(False, model).disable_cudnn_sdpa  # the field off: never
    assert torch.backends.cuda.cudnn_sdp_enabled()


def build_trainer(args: OR1Config, caplog, hopper: pytest.MonkeyPatch | None = None) -> list[str]:
    """An `OR1Trainer` on the tiny model (SDPA attention) built with `args`, on a faked Hopper GPU and torch 2.11
    where `hopper` is given (`args` is built before: its bf16 default reads the device); the guard's log lines."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    assert model.config._attn_implementation == "sdpa"
    if hopper is not None:
        fake_device(hopper, HOPPER)
        hopper.setattr(torch, "__version__", "2.11.0+cu130")
    with caplog.at_level(logging.INFO, logger=attention_guard.__name__):
        OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 4),
                   processing_class=tokenizer)
    return [r.getMessage() for r in caplog.records if r.name == attention_guard.__name__]


def test_the_trainer_turns_cudnn_sdpa_off_on_hopper_and_says_so(tmp_path, monkeypatch, cudnn_sdpa_restored, caplog):
    lines = build_trainer(OR1Config(**tiny_training_args(tmp_path)), caplog, hopper=monkeypatch)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert len(lines) == 1
    assert lines[0].startswith("cuDNN scaled-dot-product attention is off for this process "
                               "(torch.backends.cuda.enable_cudnn_sdp(False)): compute capability 9.0 (Hopper), "
                               "attn_implementation='sdpa', torch 2.11.0+cu130: ")
    assert lines[0].endswith("Set cudnn_sdpa_guard=False to keep cuDNN.")


def test_the_field_off_keeps_cudnn_sdpa_on_hopper(tmp_path, monkeypatch, cudnn_sdpa_restored, caplog):
    args = OR1Config(**tiny_training_args(tmp_path, cudnn_sdpa_guard=False))
    assert build_trainer(args, caplog, hopper=monkeypatch) == []
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine as it is, without a CUDA device")
def test_the_trainer_changes_nothing_without_a_gpu(tmp_path, cudnn_sdpa_restored, caplog):
    """This machine as it is (no CUDA device, nothing faked): the switch stays on, nothing is said."""
    assert build_trainer(OR1Config(**tiny_training_args(tmp_path)), caplog) == []
    assert torch.backends.cuda.cudnn_sdp_enabled()
