"""The non-finite sentinel (`or1_trl/trainer/nonfinite.py`) on the tiny model in one process: a NaN planted in one
parameter's gradient at chosen steps never reaches the weights, the step moves nothing (Adam's moments, step counts
and the learning rate included), several in a row stop the run with its last finite weights saved and a line naming
the parameter, and the run resumes from there. (Two processes, ZeRO-2 and ZeRO-3: `tests/trainer/test_sharding.py`,
whose runs plant a NaN on one rank.)"""

import json
import math
import os

import pytest
import torch
from transformers import TrainerCallback

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from or1_trl.trainer import checkpoint
from or1_trl.trainer.nonfinite import GRAD_METRIC, LOSS_METRIC, STEPS_METRIC, NonFiniteStop, gradient_sum

from ..helpers import logged, parity_reward, tagged_dataset

PLANTED = "model.norm.weight"  # the parameter whose gradient gets the NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_sum_is_finite_exactly_when_every_element_is(dtype):
    """The sentinel's test of a gradient: its sum, a 0-d tensor (no host read), against the plain reference
    `torch.isfinite(...).all()`; a NaN, +inf, -inf, both infinities; large finite values stay finite."""
    finite = torch.tensor([[0.0, 1e38, -1e38], [3.0, -2.5, 1e-30]], dtype=dtype)
    for value in (float("nan"), float("inf"), -float("inf")):
        broken = finite.clone()
        broken[1, 1] = value
        total = gradient_sum(broken)
        assert isinstance(total, torch.Tensor) and total.dim() == 0
        assert torch.isfinite(total).item() == torch.isfinite(broken).all().item() is False
    both = finite.clone()
    both[0, 0], both[1, 0] = float("inf"), -float("inf")  # their sum is NaN: not finite either
    assert not torch.isfinite(gradient_sum(both)).item()
    assert torch.isfinite(gradient_sum(finite)).item() and torch.isfinite(finite).all().item()


class Planted(TrainerCallback):
    """Records each step's weights, Adam state and learning rate; `steps`: the (1-based) steps whose gradient of
    `PLANTED` becomes NaN, through a tensor hook registered before the sentinel's (hooks run in that order)."""

    def __init__(self, trainer, steps):
        self.trainer, self.steps, self.states = trainer, set(steps), {}
        param = dict(trainer.model.named_parameters())[PLANTED]
        param.register_hook(lambda grad: torch.full_like(grad, float("nan")) if self.current in self.steps else grad)

    @property
    def current(self) -> int:
        return self.trainer.state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        optimizer = self.trainer.optimizer.optimizer  # accelerate's wrapper, then torch's AdamW
        adam = {name: {key: value.clone() for key, value in optimizer.state[param].items()}
                for name, param in self.trainer.model.named_parameters() if param in optimizer.state}
        self.states[state.global_step] = {
            "params": {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}, "adam": adam,
            "lr": optimizer.param_groups[0]["lr"]}
        return control


def planted_run(tmp_path, steps, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    settings = dict(max_steps=5, learning_rate=1e-2, lr_scheduler_type="linear", gradient_accumulation_steps=2)
    args = OR1Config(**tiny_training_args(tmp_path, **{**settings, **overrides}))
    trainer = OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 40),
                         processing_class=tokenizer)
    planted = Planted(trainer, steps)
    trainer.add_callback(planted)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, planted, initial


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_nonfinite_step_is_not_applied_and_moves_nothing(tmp_path):
    trainer, planted, initial = planted_run(tmp_path, steps=[2, 4])
    trainer.train()
    states = planted.states
    for step in (2, 4):  # weights, Adam's moments and step counts, the learning rate: as the step before left them
        assert_same(states[step]["params"], states[step - 1]["params"])
        for name in states[step]["adam"]:
            assert_same(states[step]["adam"][name], states[step - 1]["adam"][name])
        assert states[step]["lr"] == states[step - 1]["lr"]
    for step in (3, 5):  # the others do update, and the schedule moves on them only
        assert not torch.equal(states[step]["params"][PLANTED], states[step - 1]["params"][PLANTED])
        assert states[step]["lr"] < states[step - 1]["lr"]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert logged(trainer, STEPS_METRIC) == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert logged(trainer, GRAD_METRIC) == [0.0, 1.0, 1.0, 2.0, 2.0]  # one gradient (one parameter, one rank) a step
    assert logged(trainer, LOSS_METRIC) == [0.0] * 5  # the loss itself stayed finite
    assert trainer.state.global_step == 5 and trainer.or1_skipped_steps == 0  # counted apart from rejected steps


def test_without_the_sentinel_the_nan_reaches_the_weights(tmp_path):
    """The reference the sentinel is measured against: `nonfinite_stop_after=None` (TRL's behaviour)."""
    trainer, planted, _ = planted_run(tmp_path, steps=[2], max_steps=2, nonfinite_stop_after=None)
    trainer.train()
    assert torch.isnan(dict(trainer.model.named_parameters())[PLANTED]).all()
    assert logged(trainer, STEPS_METRIC) == []


def test_steps_in_a_row_stop_with_the_last_finite_weights_and_resume(tmp_path):
    trainer, planted, _ = planted_run(tmp_path, steps=[3, 4, 5], nonfinite_stop_after=2, save_strategy="no")
    with pytest.raises(NonFiniteStop) as stop:
        trainer.train()
    line = str(stop.value)
    assert "\n" not in line and "step 4" in line and PLANTED in line and "--resume_from_checkpoint true" in line
    assert "checkpoint-4 holds the weights of step 2" in line
    folder = os.path.join(tmp_path, "checkpoint-4")
    assert checkpoint.find_problems(folder, trainer._checkpoint_files()) == []  # complete: it can be resumed
    saved = checkpoint.read_state(folder, checkpoint.OR1_STATE_FILE)["nonfinite"]
    assert saved == {"steps": 2, "grads": 2, "losses": 0}
    with open(os.path.join(folder, "trainer_state.json")) as f:  # the log it keeps holds the counts
        history = json.load(f)["log_history"]
    assert [entry[STEPS_METRIC] for entry in history if STEPS_METRIC in entry] == [0.0, 0.0, 1.0, 2.0]
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, "model.safetensors"))
    assert all(torch.isfinite(value).all() for value in weights.values())
    assert torch.equal(weights[PLANTED], planted.states[2]["params"][PLANTED])

    # Resumed with the cause gone: steps 5 on train, the counts go on from the checkpoint's.
    resumed, planted_again, _ = planted_run(tmp_path, steps=[], nonfinite_stop_after=2, save_strategy="no")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 5 and resumed.sentinel.steps == 2
    assert not torch.equal(planted_again.states[5]["params"][PLANTED], weights[PLANTED])
    assert math.isfinite(planted_again.states[5]["params"][PLANTED].sum().item())
