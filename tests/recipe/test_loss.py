"""`loss.magic_loss`: OR1's part of eq. 3.1 around TRL's policy loss, as a pure function, against the equation."""

import pytest
import torch

from or1_trl.recipe.loss import Normaliser, magic_loss, selected_tokens_normaliser

ENTROPIES = torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.4, 0.0], [0.3, 0.3, 0.3]])  # [b=3, T=3]
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 2 rejected


def test_dapo_adds_alpha_h_over_the_kept_tokens_of_the_step():
    """'dapo': L = TRL's loss (its normaliser T_k already counts only kept tokens) − α Σ H·m / T_k's share."""
    norm = Normaliser.for_micro_step("dapo", torch.tensor(10.0), None, 3, num_processes=1, accumulation=2,
                                     steps_per_generation=2, max_completion_length=3)  # T_k share: 10
    entropies = ENTROPIES.clone().requires_grad_()
    out = magic_loss(torch.tensor(0.7), torch.tensor(0.05), entropies, MASK, norm, alpha=0.1)
    h = (ENTROPIES * MASK).sum() / 10.0
    assert out.loss.item() == pytest.approx(0.7 - 0.1 * h.item(), abs=1e-7)
    assert out.policy_loss.item() == pytest.approx(0.65, abs=1e-7)  # TRL's loss without its auxiliary part
    (grad,) = torch.autograd.grad(out.loss, entropies)
    torch.testing.assert_close(grad, -0.1 * MASK / 10.0)


def test_row_mean_types_count_the_kept_groups_rows():
    """'grpo' (a mean over rows): TRL's row count (3 rows × 1 step) becomes the kept groups' rows (2); α·H is a mean
    of sequence means over those rows; `policy_loss` is logged per micro-batch."""
    norm = Normaliser.for_micro_step("grpo", torch.tensor(5.0), torch.tensor(2.0), 3, num_processes=1,
                                     accumulation=1, steps_per_generation=1, max_completion_length=3)
    out = magic_loss(torch.tensor(0.6), 0.0, ENTROPIES, MASK, norm, alpha=0.2)
    per_row = (ENTROPIES * MASK).sum(1) / MASK.sum(1).clamp(min=1)
    assert out.loss.item() == pytest.approx(0.6 * 3 / 2 - 0.2 * per_row.sum().item() / 2, abs=1e-7)
    assert out.policy_loss.item() == pytest.approx(0.9, abs=1e-7)


def test_selected_normaliser_and_no_entropy_gradient_at_alpha_zero():
    """80/20 'selected': the policy term divided by the selected tokens (weighted by the micro-step's kept rows)
    instead of T_k; at α = 0 the loss does not depend on the entropies at all."""
    norm = Normaliser.for_micro_step("dapo", torch.tensor(5.0), None, 3, 1, 1, 1, 3)
    selected = (torch.tensor(2.0), torch.tensor(2.0), torch.tensor(2.0))  # 2 selected tokens, 2 rows of 2
    entropies = ENTROPIES.clone().requires_grad_()
    trl_loss = torch.tensor(0.4, requires_grad=True)
    out = magic_loss(trl_loss, 0.0, entropies, MASK, norm, alpha=0.0, selected=selected)
    assert out.loss.item() == pytest.approx(0.4 * 5.0 / selected_tokens_normaliser(*selected).item(), abs=1e-7)
    grads = torch.autograd.grad(out.loss, [trl_loss, entropies], allow_unused=True)
    assert grads[0].item() == pytest.approx(5.0 / 2.0) and grads[1] is None
