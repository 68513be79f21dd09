"""Padding-free log-prob passes: the rows of a micro-batch packed into rows of real tokens under a token budget.

TRL 1.16's `GRPOTrainer` forwards every row of a micro-batch padded to the longest (`[B, P+C]`, prompts left-padded,
completions right-padded). With reasoning completions from a few hundred tokens to the stage's cap, most of those
slots are padding. Here each row's real tokens (prompt, then completion) are laid end to end, `position_ids`
restarting at 0 for each sequence and no attention mask: transformers then builds a block-diagonal causal mask
(`masking_utils.find_packed_sequence_indices`; sdpa and eager on CPU, flash-attention's varlen path on GPU), so no
token attends across sequences. The per-token log-probs and entropies are scattered back into TRL's padded `[B, C]`
layout: the loss, T_k, the entropy controller and every metric see the same tensors as on the padded path.

RoPE makes attention depend only on relative positions, so a sequence gives the same log-probs whether it starts at
position 0 (packed) or after its left padding (padded): equal to float rounding (`tests/test_packing.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Attention implementations that build the block-diagonal mask from packed `position_ids` (transformers 5).
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def plan_packs(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Rows in order, grouped greedily into packs of at most `budget` real tokens (`None`: one pack). A row longer
    than the budget gets a pack of its own."""
    packs: list[list[int]] = []
    used = 0
    for row, length in enumerate(lengths):
        if packs and (budget is None or used + length <= budget):
            packs[-1].append(row)
            used += length
        else:
            packs.append([row])
            used = length
    return packs


@dataclass
class Pack:
    """One packed row: `input_ids`, `position_ids`, `labels` `[1, N]` (N = the pack's real tokens); `source` `[N]`:
    each packed token's flat index into the padded `[B, L]` batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    source: torch.Tensor


def build_pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int], logits_to_keep: int) -> Pack:
    """The real tokens of `rows` of the padded batch (`input_ids`, `attention_mask` `[B, L]`), end to end. Labels are
    the completion tokens (the last `logits_to_keep` columns), -100 elsewhere, as TRL's padded pass scores them."""
    width = input_ids.size(1)
    real = attention_mask[rows].bool()  # [r, L]
    flat = (torch.tensor(rows, device=input_ids.device)[:, None] * width
            + torch.arange(width, device=input_ids.device)[None, :])[real]  # [N] indices into the flat [B*L] batch
    ids = input_ids.reshape(-1)[flat]  # [N]
    lengths = real.sum(dim=1)  # [r]
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # [N] each token's sequence start
    positions = torch.arange(len(flat), device=input_ids.device) - starts  # [N] 0.. per sequence
    scored = (flat % width) >= width - logits_to_keep  # [N] completion tokens
    labels = ids.masked_fill(~scored, -100)
    return Pack(ids[None], positions[None], labels[None], flat)


def packed_logps_and_entropies(
    forward: Callable[[Pack], tuple[torch.Tensor, torch.Tensor | None]],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    budget: int | None,
    compute_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Per-token log-probs (and entropies) of the completions, `[B, C]` as TRL's padded pass returns them (0 at
    padding), from one `forward` per pack; and the number of token slots the forwards computed.

    `forward(pack)` returns the pack's `[1, N]` log-probs and entropies (or `None`), position t scoring token t.
    """
    batch, width = input_ids.shape  # [B, L]
    logps = input_ids.new_zeros((batch * width,), dtype=torch.float32)  # [B*L]
    entropies = torch.zeros_like(logps) if compute_entropy else None
    out_logps, out_entropies, slots = [], [], 0
    for rows in plan_packs(attention_mask.sum(dim=1).tolist(), budget):
        pack = build_pack(input_ids, attention_mask, rows, logits_to_keep)
        pack_logps, pack_entropies = forward(pack)  # [1, N]
        slots += pack.input_ids.numel()
        out_logps.append((pack.source, pack_logps[0]))
        if compute_entropy:
            out_entropies.append((pack.source, pack_entropies[0]))
    # Scatter with index_put (differentiable): each packed token back to its padded slot.
    sources = torch.cat([source for source, _ in out_logps])  # [N_total]
    logps = logps.to(out_logps[0][1].dtype).index_put((sources,), torch.cat([v for _, v in out_logps]))
    if compute_entropy:
        entropies = entropies.to(out_entropies[0][1].dtype).index_put((sources,), torch.cat([v for _, v in out_entropies]))
        entropies = entropies.view(batch, width)[:, -logits_to_keep:]
    return logps.view(batch, width)[:, -logits_to_keep:], entropies, slots


def fused_head_forward(model, autocast) -> Callable[[Pack], tuple[torch.Tensor, torch.Tensor | None]]:
    """`forward` for `packed_logps_and_entropies` through TRL's fused LM head (`add_fused_lm_head`, or Liger's kernel
    bound into it): log-probs and entropies of a pack without `[N, V]` logits. The head scores position t+1 from
    position t; a zero in front aligns it to "position t scores token t" (token 0 of a pack is a prompt token)."""

    def forward(pack: Pack):
        with autocast():
            outputs = model(input_ids=pack.input_ids, position_ids=pack.position_ids, labels=pack.labels,
                            fused_lm_head=True)
        pad = torch.nn.functional.pad
        entropy = None if outputs.entropy is None else pad(outputs.entropy, (1, 0))
        return pad(outputs.log_probs, (1, 0)), entropy  # [1, N]

    return forward


def attention_problem(attention: str | None) -> str | None:
    """Why `padding_free=True` cannot run with this `attn_implementation` (`None`: it can, or it is not known yet)."""
    if attention is None or attention in PACKABLE_ATTENTION:
        return None
    return (f"padding_free=True needs an attention that reads packed position_ids ({', '.join(PACKABLE_ATTENTION)}); "
            f"attn_implementation={attention!r}: choose one of them or set padding_free=False.")


def check_packable(compute_aux_loss: bool, multimodal: dict) -> None:
    """Packing covers text-only dense models: images and MoE router losses are refused with the fix named."""
    if any(value is not None for value in multimodal.values()):
        raise ValueError("padding_free=True packs text-only batches; this batch has images or multimodal inputs: set "
                         "padding_free=False.")
    if compute_aux_loss:
        raise ValueError("padding_free=True does not compute the MoE router loss (router_aux_loss_coef): set "
                         "padding_free=False.")
