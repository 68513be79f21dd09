"""Drop-in: OR1's parts compose with TRL's loss settings (loss types, β > 0 and `sync_ref_model`, GSPO, the
off-policy mask).

Each combination is checked against a plain-PyTorch reference of TRL's loss for that setting, written from TRL's
equations, on the KEPT rows only (a batch whose last group is rejected), plus α·H aggregated like the loss:

    grpo     L = (1/K) Σ_i (1/|y_i|) Σ_t [ℓ_it − α H_it]            K: kept rows
    bnpo     L = Σ_it [ℓ_it − α H_it] / Σ_it 1                      (the micro-batch's kept tokens)
    dr_grpo  L = Σ_it [ℓ_it − α H_it] / (K · L_max)
    ℓ_it     = −min(ρ A, clip(ρ, 1−ε, 1+ε) A) [· 1{A ≥ 0 or mean_t(log π_old − log π_θ) ≤ δ}] + β KL_t
    KL_t     = ρ · (exp(r − l) − (r − l) − 1),  r = log π_ref, l = log π_θ  (TRL's `use_bias_correction_kl`)
    GSPO     ρ_i = exp(mean_t log ρ_it) for every token of row i
"""

import os
import warnings

import pytest
import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.recipe.rejection import WEIGHT_KEY
from or1_trl.testing import save_tiny_model, tiny_training_args
from or1_trl.trainer.or1_trainer import KEPT_GROUP_ROWS_KEY, KEPT_ROWS_KEY
from tests.helpers import fixed_batch, reference_logps_entropy
from tests.helpers import ScriptedReward, logged, tagged_dataset

ALPHA = 0.03


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model on disk: with β > 0 TRL loads the reference model from the policy's path."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def _trainer(model_dir, tmp_path, perturb=False, **overrides):
    from transformers import AutoTokenizer

    args = OR1Config(**tiny_training_args(tmp_path, rejection_sampling="mask", epsilon=0.2, **overrides))
    trainer = OR1Trainer(model_dir, lambda completions, **kw: [0.0] * len(completions), args=args,
                         train_dataset=Dataset.from_dict({"prompt": ["Q: 1+1=? A:"] * 8}),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    trainer.model.train()
    trainer.entropy_controller.coef, trainer.entropy_controller.last_entropy = ALPHA, 0.0  # gate open: α = c
    if perturb:  # the policy moves away from the reference model, so that the KL term is not 0
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return trainer


def _batch(trainer):
    """8 rows; rows 4-7 are a rejected group (weight 0); ref log-probs from the trainer's reference model."""
    batch = fixed_batch(trainer.model, trainer.model.config.vocab_size)
    batch[KEPT_GROUP_ROWS_KEY] = batch[KEPT_ROWS_KEY] = torch.tensor(4.0)
    if trainer.ref_model is not None:
        with torch.no_grad():
            batch["ref_per_token_logps"], _ = reference_logps_entropy(
                trainer.ref_model, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"])
    return batch


def _kept(batch):
    rows = batch[WEIGHT_KEY].bool()
    return {k: v[rows] for k, v in batch.items() if v.ndim > 0 and k != WEIGHT_KEY}


def _reference(model, batch, loss_type, alpha=ALPHA, eps=0.2, beta=0.0, sequence=False, opsm=None, max_len=6):
    """TRL's loss of `loss_type` on the kept rows, from the equations in the module docstring; plain torch."""
    kept = _kept(batch)
    logps, entropy = reference_logps_entropy(model, kept["prompt_ids"], kept["completion_ids"], kept["completion_mask"])
    m = kept["completion_mask"].float()  # [K, T]
    A = kept["advantages"][:, None]  # [K, 1]
    log_ratio = logps - kept["old_per_token_logps"]  # [K, T]
    if sequence:
        log_ratio = ((log_ratio * m).sum(1) / m.sum(1))[:, None]  # [K, 1]
    ratio = torch.exp(log_ratio)
    loss = -torch.min(ratio * A, torch.clamp(ratio, 1 - eps, 1 + eps) * A)  # [K, T] or [K, 1]
    if opsm is not None:
        mean_kl = ((kept["old_per_token_logps"] - logps.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
        loss = loss * ((A >= 0) | (mean_kl <= opsm)).float()
    if beta:
        d = kept["ref_per_token_logps"] - logps
        loss = loss + beta * (torch.exp(d) - d - 1) * ratio  # TRL's use_bias_correction_kl=True (its default)
    x = (loss - alpha * entropy) * m  # [K, T]
    K = m.size(0)
    if loss_type == "grpo":
        return (x.sum(1) / m.sum(1)).sum() / K
    if loss_type in ("bnpo", "dapo"):  # one micro-batch: its kept tokens are T_k
        return x.sum() / m.sum()
    assert loss_type == "dr_grpo"
    return x.sum() / (K * max_len)


def _assert_loss_and_gradient(trainer, batch, reference, **kwargs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    expected = reference(trainer.model, batch, **kwargs)
    expected.backward()
    assert abs(expected.item()) > 1e-3  # not degenerate
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


CASES = {
    "grpo": (dict(loss_type="grpo"), dict(loss_type="grpo")),
    "bnpo": (dict(loss_type="bnpo"), dict(loss_type="bnpo")),
    "dr_grpo": (dict(loss_type="dr_grpo"), dict(loss_type="dr_grpo")),
    "beta_dapo": (dict(beta=0.04), dict(loss_type="dapo", beta=0.04)),
    "beta_grpo": (dict(loss_type="grpo", beta=0.04), dict(loss_type="grpo", beta=0.04)),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence"), dict(loss_type="grpo", sequence=True)),
    "gspo_beta": (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
                  dict(loss_type="grpo", sequence=True, beta=0.04)),
    "off_policy_mask": (dict(off_policy_mask_threshold=0.05), dict(loss_type="dapo", opsm=0.05)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_match_trl_reference_on_kept_rows(model_dir, tmp_path, case):
    config, reference = CASES[case]
    trainer = _trainer(model_dir, tmp_path, perturb="beta" in config, **config)
    batch = _batch(trainer)
    _assert_loss_and_gradient(trainer, batch, _reference, **reference)
    if case == "off_policy_mask":  # the mask really drops a kept row here (negative advantage, drifted)
        kept = _kept(batch)
        logps, _ = reference_logps_entropy(trainer.model, kept["prompt_ids"], kept["completion_ids"], kept["completion_mask"])
        m = kept["completion_mask"].float()
        mean_kl = ((kept["old_per_token_logps"] - logps) * m).sum(1) / m.sum(1)
        assert ((kept["advantages"] < 0) & (mean_kl > 0.05)).any()


def test_sync_ref_model_reference_follows_the_policy(model_dir, tmp_path):
    """sync_ref_model (TRL's callback, β > 0): after a step with mix-up α 1 the reference IS the policy; the loss then
    matches the reference formula with π_ref = the synced model (KL 0 at the current policy, gradient non-zero)."""
    args = OR1Config(**tiny_training_args(
        tmp_path, loss_type="grpo", beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0,
        max_steps=1, learning_rate=1e-2))
    trainer = OR1Trainer(model_dir, ScriptedReward(), args=args, train_dataset=tagged_dataset(["MIX"] * 8))
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    ref = dict(trainer.ref_model.named_parameters())
    for name, param in trainer.model.named_parameters():
        assert torch.equal(ref[name], param), name
    assert any(not torch.equal(initial[n], p) for n, p in ref.items())
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer.entropy_controller.coef, trainer.entropy_controller.last_entropy = ALPHA, 0.0
    _assert_loss_and_gradient(trainer, _batch(trainer), _reference, loss_type="grpo", beta=0.04)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_row_mean_counts_kept_rows_not_padding(model_dir, tmp_path, loss_type):
    """Compaction pads micro-steps with zero-weight rows; the row-mean types count only the kept rows (K = 4 here), over
    the micro-steps of the step: [0, 1, pad] + [2, 3, pad] gives exactly the loss and gradient on rows 0-3."""
    trainer = _trainer(model_dir, tmp_path, loss_type=loss_type, gradient_accumulation_steps=2,
                       use_adaptive_entropy=False, entropy_coef=ALPHA)  # a constant α over both micro-steps
    batch = _batch(trainer)
    trainer.model.zero_grad()
    total = 0.0
    for rows in ([0, 1, 4], [2, 3, 5]):
        index = torch.tensor(rows)
        loss = trainer._compute_loss(trainer.model, {k: v if v.ndim == 0 else v[index] for k, v in batch.items()})
        loss.backward()
        total += loss.item()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    expected = _reference(trainer.model, batch, loss_type)
    expected.backward()
    assert total == pytest.approx(expected.item(), abs=1e-6)
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo"])
def test_every_group_rejected_gives_a_zero_loss_and_gradient(model_dir, tmp_path, loss_type):
    """A micro-step holding only a zero-weight padding row (every group rejected): loss and gradient exactly 0, not NaN."""
    trainer = _trainer(model_dir, tmp_path, loss_type=loss_type, beta=0.04)
    batch = {**_batch(trainer), WEIGHT_KEY: torch.zeros(8), KEPT_GROUP_ROWS_KEY: torch.tensor(0.0),
             KEPT_ROWS_KEY: torch.tensor(0.0), "num_items_in_batch": torch.tensor(0.0)}
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(p.grad) == 0 for p in trainer.model.parameters())


@pytest.mark.parametrize("loss_type,selected", [("cispo", False), ("sapo", False), ("luspo", False), ("vespo", False),
                                                ("cispo", True), ("vespo", True)])
def test_other_loss_types_are_trls_loss_on_kept_rows(model_dir, tmp_path, loss_type, selected):
    """TRL's other loss types: ours on the batch with a rejected group = TRL's own `_compute_loss` on the kept rows
    alone, minus α·H aggregated like the type (cispo, vespo: / T_k; sapo: per-sequence mean; luspo: sequence sum,
    mean over rows). The token-sum types also take the 80/20 rule's "selected" normaliser: the policy term divided
    by the selected tokens instead of T_k."""
    rule = dict(top_entropy_quantile=0.5, top_entropy_normalization="selected") if selected else {}
    trainer = _trainer(model_dir, tmp_path, loss_type=loss_type, **rule)
    batch = _batch(trainer)
    kept = {**_kept(batch), "num_items_in_batch": batch["num_items_in_batch"]}

    def reference(model, batch):
        trainer._or1_loss_enabled = False
        trl = trainer._compute_loss(model, kept)  # TRL's loss on the kept rows (its entropy bonus is off)
        trainer._or1_loss_enabled = True
        _, entropy = reference_logps_entropy(model, kept["prompt_ids"], kept["completion_ids"], kept["completion_mask"])
        m = kept["completion_mask"].float()
        h = entropy * m
        if selected:  # TRL's loss is Σ over the top-half entropy tokens / T_k; the official normaliser: / selected
            threshold = torch.quantile(entropy[m.bool()].detach(), 0.5)
            trl = trl * m.sum() / ((entropy.detach() >= threshold) & m.bool()).sum()
        if loss_type in ("cispo", "vespo"):
            bonus = h.sum() / m.sum()
        elif loss_type == "sapo":
            bonus = (h.sum(1) / m.sum(1)).mean()
        else:
            bonus = h.sum(1).mean()
        return trl - ALPHA * bonus

    _assert_loss_and_gradient(trainer, batch, reference)


def _rows_moved(trainer, before):
    return any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_grpo_with_kl_and_synced_reference_trains_with_rejection_and_entropy_control(model_dir, tmp_path):
    tags = ["ALL", "MIX", "NONE", "MIX"] * 4
    args = OR1Config(**tiny_training_args(
        tmp_path, loss_type="grpo", beta=0.04, sync_ref_model=True, ref_model_sync_steps=2, learning_rate=1e-3))
    reward = ScriptedReward()
    trainer = OR1Trainer(model_dir, reward, args=args, train_dataset=tagged_dataset(tags))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _rows_moved(trainer, before)
    assert 0 < sum(reward.informative_rows) < 2 * 8  # this seed's rollouts hold kept and rejected groups
    assert trainer.or1_rows_forwarded == sum(reward.informative_rows)  # rejected rows not forwarded
    assert logged(trainer, "rejection/kept_group_frac") == [k / 8 for k in reward.informative_rows]
    for key in ("entropy_coef", "entropy/alpha"):  # the controller's, on every step
        assert len(logged(trainer, key)) == 2, key
    trained = sum(k > 0 for k in reward.informative_rows)  # a step with nothing kept runs no pass: no loss to log
    for key in ("kl", "policy_loss", "clip_ratio/region_mean"):
        assert len(logged(trainer, key)) == trained, key


def test_gspo_dr_grpo_with_stages_refill_and_off_policy_mask_trains(model_dir, tmp_path):
    tags = ["NONE", "MIX", "ALL", "MIX"] * 4
    stages = [{"until_step": 1, "max_completion_length": 6}, {"until_step": 2, "max_completion_length": 4}]
    args = OR1Config(**tiny_training_args(
        tmp_path, loss_type="dr_grpo", importance_sampling_level="sequence", off_policy_mask_threshold=0.5,
        rejection_refill_rounds=1, stages=stages, learning_rate=1e-3))
    trainer = OR1Trainer(model_dir, ScriptedReward(), args=args, train_dataset=tagged_dataset(tags))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _rows_moved(trainer, before)
    assert logged(trainer, "stage") == [0.0, 1.0]
    kept, filled = logged(trainer, "rejection/kept_group_frac"), logged(trainer, "refill/batch_fill")
    assert any(f > k for k, f in zip(kept, filled))  # a refill round added informative groups
    assert trainer.or1_rows_forwarded == sum(max(1, round(f * 8)) for f in filled)  # only kept rows were forwarded
    for key in ("rejection/kept_group_frac", "entropy_coef", "policy_loss"):
        assert len(logged(trainer, key)) == 2, key


def test_leaving_magic_is_said_once(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OR1Config(**tiny_training_args(tmp_path, loss_type="grpo", beta=0.04, importance_sampling_level="sequence"))
    notes = [str(w.message) for w in caught if "not the paper's objective" in str(w.message)]
    assert notes == [
        "not the paper's objective: loss_type='grpo' (MAGIC: 'dapo', one token-level mean over T_k); beta=0.04 "
        "(MAGIC: no KL term); importance_sampling_level='sequence' (MAGIC: per-token ratios)."
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OR1Config(**tiny_training_args(tmp_path))  # the MAGIC defaults: no note
    assert not [w for w in caught if "not the paper's objective" in str(w.message)]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(loss_type="bnpo"), "loss_type='bnpo' has no such count"),
        (dict(loss_type="dapo", beta=0.1), "would also rescale TRL's KL term"),
    ],
)
def test_only_undefined_combinations_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        OR1Config(**tiny_training_args(tmp_path, top_entropy_quantile=0.2, top_entropy_normalization="selected", **overrides))
    OR1Config(**tiny_training_args(tmp_path, top_entropy_quantile=0.2, **overrides))  # 'all' is defined with both


# --- `or1-trl train --reward_funcs` ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,message",
    [
        ("no_such_reward", "--reward_funcs no_such_reward: neither one of TRL's reward names (accuracy_reward, "),
        ("no_such_module.fn", "--reward_funcs no_such_module.fn: cannot import 'fn' from 'no_such_module'"),
        ("json.nope", "--reward_funcs json.nope: cannot import 'nope' from 'json'"),
        ("json.__doc__", "--reward_funcs json.__doc__: str is not callable"),
    ],
)
def test_unknown_reward_funcs_fail_before_anything_loads(tmp_path, capsys, name, message):
    from tests.helpers import TINY, exit_code

    code, _, err = exit_code(capsys, "train", "--config", TINY, "--reward_funcs", "think_format_reward", name,
                             "--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", "none")
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"or1-trl train: error: {message}")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("beside", [False, True])
def test_train_with_reward_funcs_alone_or_beside_the_verifier(tmp_path, beside):
    """`--reward_funcs` alone: only they score (no verifier, no gold column needed); beside `--reward math`: added."""
    import json
    import subprocess
    import sys

    from tests.helpers import ENV, TINY

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"Q: {i}+1=? A:", "answer": str(i + 1)}) + "\n")
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n")
    with open(TINY) as f:
        config = [line for line in f if beside or not line.startswith("reward:")]
    (tmp_path / "run.yaml").write_text("".join(config))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "or1_trl.cli", "train", "--config", "run.yaml", "--prompt_column", "question",
         "--reward_funcs", "my_rewards.length_reward", "get_soft_overlong_punishment", "--max_steps", "1",
         "--model_name_or_path", save_tiny_model(tmp_path / "model"), "--dataset_name", str(data), "--output_dir", str(out)],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with open(out / "trainer_state.json") as f:
        logs = json.load(f)["log_history"][0]
    rewards = {key.split("/")[1] for key in logs if key.startswith("rewards/") and key.endswith("/mean")}
    assert rewards == {"length_reward", "soft_overlong_punishment_reward"} | ({"math_reward"} if beside else set())
    assert "rejection/kept_group_frac" in logs and "entropy_coef" in logs
