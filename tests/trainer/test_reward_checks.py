"""A reward function that returns inf/NaN (`trainer/reward_checks.py`): an error naming the function and the sample,
or, opted in (`nonfinite_rewards="zero"`), scored 0 and counted; `None` (TRL's abstention) is left alone."""

import math
import re

import pytest
import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.trainer.reward_checks import nonfinite_mask, record_abstentions
from or1_trl.testing import tiny_model, tiny_tokenizer, tiny_training_args

from ..helpers import TrainerLog


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def test_nonfinite_mask_leaves_none_alone():
    """NaN where the function returned None (TRL's "not scored") is fine; a returned NaN or inf, or a float that
    overflows float32, is not."""

    class Holder:
        reward_funcs = [lambda **kw: [1.0, None, math.nan, 1e39], lambda **kw: [None, math.inf, 2.0, -math.inf]]

    holder = Holder()
    originals = list(holder.reward_funcs)
    with record_abstentions(holder) as abstained:
        outputs = [f() for f in holder.reward_funcs]
    assert holder.reward_funcs == originals and abstained == [[1], [0]]
    rewards = torch.tensor([[math.nan if r is None else r for r in out] for out in outputs], dtype=torch.float32).T
    bad = nonfinite_mask(rewards, abstained, 4, gather=lambda t: t)
    assert bad.tolist() == [[False, False], [False, True], [True, False], [True, True]]


class PoisonedReward:
    """1.0 / 0.0 by parity, but NaN at the rows in `nan_at` and inf at `inf_at` (counting rows over all calls), and
    None (not scored) at the rows in `none_at`."""

    __name__ = "poisoned"

    def __init__(self, nan_at=(), inf_at=(), none_at=()):
        self.nan_at, self.inf_at, self.none_at = set(nan_at), set(inf_at), set(none_at)
        self.seen = 0
        self.returned = []  # per call

    def __call__(self, completions, **kwargs):
        out = []
        for c in completions:
            row, self.seen = self.seen, self.seen + 1
            out.append(math.nan if row in self.nan_at else math.inf if row in self.inf_at else
                       None if row in self.none_at else float(len(c) % 2))
        self.returned.append(out)
        return out


def nonfinite_run(tmp_path, reward, **overrides):
    tokenizer = tiny_tokenizer()
    args = OR1Config(**tiny_training_args(tmp_path, **overrides))
    data = Dataset.from_dict({"prompt": [f"Q: {i}+{i}=? A:" for i in range(8)]})
    trainer = OR1Trainer(tiny_model(tokenizer), [reward, parity_reward], args=args, train_dataset=data,
                         processing_class=tokenizer)
    return trainer


def test_nonfinite_reward_is_an_error_naming_the_function_and_the_sample(tmp_path):
    reward = PoisonedReward(inf_at=[5, 6], none_at=[1, 2])
    trainer = nonfinite_run(tmp_path, reward, max_steps=1)
    with pytest.raises(ValueError) as exc:
        trainer.train()
    message = str(exc.value)
    assert re.match(r"The reward function 'poisoned' returned inf for sample 5 of the rollout at step 1 \(dataset row "
                    r"\d\); prompt 'Q: \d\+\d=\? A:', completion '.*'; 1 more non-finite reward in this rollout\. "
                    r"A reward must be a finite number \(or None: not scored\)\. Fix the reward function, or set "
                    r"nonfinite_rewards='zero'", message), message
    assert trainer.state.global_step == 0  # stopped before the first update


def test_nonfinite_rewards_opted_in_score_zero_and_are_counted(tmp_path):
    """nonfinite_rewards='zero': `reward/nonfinite` equals the NaN/inf samples injected per step (Nones not counted),
    those samples score 0, and one warning names the first."""
    nan_at, inf_at, none_at = [0, 3, 9], [12], [1, 13]  # step 1: rows 0-7; step 2: rows 8-15
    reward = PoisonedReward(nan_at, inf_at, none_at)
    trainer = nonfinite_run(tmp_path, reward, max_steps=2, nonfinite_rewards="zero")
    with TrainerLog() as log:
        log.trainer = trainer
        trainer.train()
    history = [entry for entry in trainer.state.log_history if "reward/nonfinite" in entry]
    assert [entry["reward/nonfinite"] for entry in history] == [2.0, 2.0]
    for entry, returned in zip(history, reward.returned):
        # TRL's `rewards/poisoned/mean` is the mean over the rows it scored (NaN-ignoring): the zeros count, Nones not.
        scored = [0.0 if not math.isfinite(r) else r for r in returned if r is not None]
        assert entry["rewards/poisoned/mean"] == pytest.approx(sum(scored) / len(scored))
        assert math.isfinite(entry["reward"])
    warnings = log.matching("returned")
    assert len(warnings) == 1 and warnings[0][1].startswith("The reward function 'poisoned' returned nan for sample 0")
    assert "Scored 0 (nonfinite_rewards='zero'" in warnings[0][1]


# --- skipped steps ------------------------------------------------------------------------------------------------
