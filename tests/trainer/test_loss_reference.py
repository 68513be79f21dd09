"""Eq. 3.1 — the trainer's loss on a fixed batch against a plain-PyTorch reference written from the paper.

The reference materialises the logits (fine for a test) and follows the equations literally:

    L = −(1/T_k) Σ_{kept rows} Σ_t [ min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + α H ]
"""

import pytest
import torch
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.recipe.rejection import WEIGHT_KEY
from or1_trl.trainer.or1_trainer import KEPT_ROWS_KEY
from or1_trl.testing import tiny_training_args as cpu_args
from ..helpers import B, T, fixed_batch, reference_logps_entropy



def _trainer(tiny, tmp_path, **overrides):
    model, tokenizer = tiny
    dataset = Dataset.from_dict({"prompt": ["Q: 1+1=? A:"] * 8})
    args = OR1Config(**cpu_args(tmp_path, **overrides))
    trainer = OR1Trainer(model, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _reference_loss(model, batch, alpha, eps_low, eps_high, rho=1.0, normalization="all"):
    logps, entropy = reference_logps_entropy(model, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"])
    kept = batch["completion_mask"].float() * batch[WEIGHT_KEY][:, None]  # tokens of kept groups
    T_k = kept.sum()
    A = batch["advantages"][:, None]
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
    if rho < 1.0:
        threshold = torch.quantile(entropy[kept.bool()], 1 - rho)
        selected = kept * (entropy >= threshold).float()
    else:
        selected = kept
    if normalization == "selected":
        policy = -(selected * surrogate).sum() / selected.sum()
    else:
        policy = -(selected * surrogate).sum() / T_k
    return policy - alpha * (kept * entropy).sum() / T_k


@pytest.mark.parametrize("backend", ["trl", "liger"])
@pytest.mark.parametrize(
    "alpha,rho,normalization",
    [(0.0, 1.0, "all"), (0.03, 1.0, "all"), (0.03, 0.2, "all"), (0.03, 0.2, "selected"), (0.0, 0.5, "selected")],
)
def test_loss_matches_paper_equation(tiny, tmp_path, alpha, rho, normalization, backend):
    trainer = _trainer(
        tiny, tmp_path, epsilon=0.2, epsilon_high=0.28, top_entropy_quantile=rho, top_entropy_normalization=normalization,
        rejection_sampling="mask", logprob_backend=backend,
    )
    trainer.entropy_controller.coef = alpha
    trainer.entropy_controller.last_entropy = 0.0  # gate open: α = c
    batch = fixed_batch(trainer.model, len(tiny[1]))
    loss = trainer._compute_loss(trainer.model, batch)
    expected = _reference_loss(trainer.model, batch, alpha, 0.2, 0.28, rho, normalization)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert abs(expected.item()) > 1e-3  # the batch is not degenerate


@pytest.mark.parametrize("backend", ["trl", "liger"])
def test_gradient_matches_reference(tiny, tmp_path, backend):
    trainer = _trainer(tiny, tmp_path, top_entropy_quantile=0.2, rejection_sampling="mask", logprob_backend=backend)
    trainer.entropy_controller.coef, trainer.entropy_controller.last_entropy = 0.05, 0.0
    batch = fixed_batch(trainer.model, len(tiny[1]))
    trainer._compute_loss(trainer.model, batch).backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    _reference_loss(trainer.model, batch, 0.05, 0.2, 0.2, 0.2).backward()
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_rejected_rows_change_nothing(tiny, tmp_path):
    """Rejected rows are out of the loss, the entropy term and T_k: their content does not matter."""
    trainer = _trainer(tiny, tmp_path, rejection_sampling="mask", use_adaptive_entropy=False, entropy_coef=0.05)
    batch = fixed_batch(trainer.model, len(tiny[1]))
    loss = trainer._compute_loss(trainer.model, batch)
    scrambled = {**batch, "completion_ids": batch["completion_ids"].clone()}
    scrambled["completion_ids"][4:] = torch.randint(5, 100, (4, T))
    assert trainer._compute_loss(trainer.model, scrambled).item() == pytest.approx(loss.item(), abs=1e-7)


def test_or1_loss_path_equals_trl_dapo(tiny, tmp_path):
    """With no entropy term and no rejected rows, our aggregation is TRL's 'dapo' loss exactly."""
    trainer = _trainer(tiny, tmp_path, top_entropy_quantile=0.2, use_adaptive_entropy=False, rejection_sampling="off")
    batch = fixed_batch(trainer.model, len(tiny[1]))
    batch[WEIGHT_KEY] = torch.ones(B)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    trainer._or1_loss_enabled = True
    ours = trainer._compute_loss(trainer.model, batch)
    trainer._or1_loss_enabled = False
    trl = trainer._compute_loss(trainer.model, {k: v for k, v in batch.items() if k != WEIGHT_KEY})
    assert ours.item() == pytest.approx(trl.item(), abs=1e-7)


@pytest.mark.parametrize("backend", ["trl", "liger"])
def test_no_full_vocabulary_logits(tiny, tmp_path, backend):
    """The OR1 loss takes log-probs and entropies from the fused head (either backend): the LM head never runs."""
    trainer = _trainer(tiny, tmp_path, rejection_sampling="mask", logprob_backend=backend)
    calls = []
    handle = trainer.model.lm_head.register_forward_hook(lambda *a: calls.append(a[2].shape))
    batch = fixed_batch(trainer.model, len(tiny[1]))  # builds the reference (calls lm_head) before the hook counts
    calls.clear()
    trainer._compute_loss(trainer.model, batch).backward()
    handle.remove()
    assert calls == []


def _micro_batch(batch, rows):
    index = torch.tensor(rows)
    return {k: v if v.ndim == 0 else v[index] for k, v in batch.items()}


@pytest.mark.parametrize("rho", [0.5, 0.2])
def test_selected_normalisation_weighs_micro_batches_by_their_kept_rows(tiny, tmp_path, rho):
    """80/20 "selected" over several micro-steps: Σ_j (R_j / R) · (mean over the selected tokens of micro-batch j),
    R_j its kept rows. A micro-step holding only a zero-weight padding row (compaction, then TRL's shuffle) weighs
    0: the micro-batches [R1, padding, R2] give exactly the loss and gradient of [R1, R2] (the old per-micro-step
    average scaled them by 2/3)."""
    grads, losses = {}, {}
    for name, micro_rows in {"with_padding_micro_step": [[0, 1], [4], [2, 3]], "two_micro_steps": [[0, 1], [2, 3]]}.items():
        steps = len(micro_rows)
        trainer = _trainer(
            tiny, tmp_path / name, top_entropy_quantile=rho, top_entropy_normalization="selected", rejection_sampling="mask",
            use_adaptive_entropy=False, gradient_accumulation_steps=steps,
        )
        trainer.current_gradient_accumulation_steps = steps
        batch = fixed_batch(trainer.model, len(tiny[1]))  # rows 0-3 kept, rows 4-7 a rejected group
        batch[KEPT_ROWS_KEY] = torch.tensor(4.0)
        trainer.model.zero_grad()
        losses[name] = 0.0
        for rows in micro_rows:
            loss = trainer._compute_loss(trainer.model, _micro_batch(batch, rows))
            loss.backward()
            losses[name] += loss.item()
        grads[name] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    model = trainer.model
    model.zero_grad()
    reference = sum(0.5 * _reference_loss(model, _micro_batch(batch, rows), 0.0, 0.2, 0.2, rho, "selected")
                    for rows in ([0, 1], [2, 3]))  # R_j / R = 2 / 4 each
    reference.backward()
    assert abs(reference.item()) > 1e-3
    for name in grads:
        assert losses[name] == pytest.approx(reference.item(), abs=1e-6), name
        for param_name, param in model.named_parameters():
            torch.testing.assert_close(grads[name][param_name], param.grad, atol=1e-6, rtol=1e-4, msg=param_name)
