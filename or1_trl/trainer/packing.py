"""Padding-free log-prob passes: the rows of a micro-batch packed into rows of real tokens under a token budget.

TRL 1.16's `GRPOTrainer` forwards every row of a micro-batch padded to the longest (`[B, P+C]`, prompts left-padded,
completions right-padded). With reasoning completions from a few hundred tokens to the stage's cap, most of those
slots are padding. Here the rows' real tokens (prompt, then completion) are laid end to end into packed rows,
`position_ids` restarting at 0 for each sequence and no attention mask: transformers then builds a block-diagonal
causal mask (`masking_utils.find_packed_sequence_indices`; sdpa and eager on CPU, flash-attention's varlen path on
GPU), so no token attends across sequences. The per-token log-probs and entropies are scattered back into TRL's padded
`[B, C]` layout: the loss, T_k, the entropy controller, the 80/20 mask and every metric see the same tensors as on the
padded path, taken over the same micro-batch.

The token budget (`OR1Config.max_tokens_per_microbatch`) splits a micro-batch into forwards of at most that many token
slots (`plan_forwards`). With gradients on, every forward but the last is activation-checkpointed
(`torch.utils.checkpoint`, non-reentrant): the micro-batch's single backward recomputes one forward at a time, so the
activation memory is set by the budget, not by rows × cap, at the cost of one more forward of those tokens. Each rank
still runs one forward of its wrapped model (DDP) and one backward per micro-step, whatever its number of forwards:
ranks stay in lockstep and gradient accumulation is TRL's, unchanged.

RoPE makes attention depend only on relative positions, so a sequence gives the same log-probs whether it starts at
position 0 (packed) or after its left padding (padded): equal to float rounding (`tests/trainer/test_packing.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Attention implementations that build the block-diagonal mask from packed `position_ids` (transformers 5).
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def plan_forwards(lengths: list[int], budget: int | None, one_row: bool) -> list[list[list[int]]]:
    """The rows of a micro-batch (their real lengths) as forwards of packed rows: `[forward][packed row][row]`.

    Sequences go first-fit decreasing into packed rows of at most `capacity` tokens, then packed rows into forwards of
    at most `budget` token slots (`None`: no limit). `one_row` (flash-attention's varlen path, batch 1 only): each
    forward is one packed row of up to `budget` tokens. Otherwise (sdpa, eager: a dense mask per row) a packed row is
    at most the longest sequence wide, so no row's attention square exceeds the padded pass's, and a forward of k rows
    costs k × its widest row. A sequence longer than the budget gets a forward of its own."""
    total, longest = sum(lengths), max(lengths)
    capacity = (total if one_row else longest) if budget is None else min(budget, total if one_row else longest)
    rows: list[list[int]] = []
    fill: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # first-fit decreasing
        length = lengths[index]
        slot = next((r for r, used in enumerate(fill) if used + length <= capacity), None)
        if slot is None:
            rows.append([index])
            fill.append(length)
        else:
            rows[slot].append(index)
            fill[slot] += length
    forwards: list[list[list[int]]] = []
    width = 0  # the open forward's widest row (rows come widest first)
    for row, used in zip(rows, fill):
        if forwards and not one_row and (budget is None or (len(forwards[-1]) + 1) * max(width, used) <= budget):
            forwards[-1].append(row)
            width = max(width, used)
        else:
            forwards.append([row])
            width = used
    return forwards


@dataclass
class Pack:
    """One forward: `input_ids`, `position_ids`, `labels` `[k, W]` (k packed rows, each the real tokens of its
    sequences end to end, then a tail up to the forward's width W); `real` `[k, W]`: the sequences' tokens, not the
    tail; `source` `[N]`: each real token's flat index into the padded `[B, L]` batch, in the order of `real`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    real: torch.Tensor
    source: torch.Tensor


def build_pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[list[int]],
               logits_to_keep: int) -> Pack:
    """The forward of packed `rows` (each a list of rows of the padded batch `input_ids`, `attention_mask` `[B, L]`).

    Positions restart at 0 for each sequence; a row's tail continues its last sequence's positions (causal attention:
    no real token sees it, and a row holding one sequence keeps the plain causal mask). Labels are the completion
    tokens (the last `logits_to_keep` columns), -100 elsewhere, as TRL's padded pass scores them."""
    device, width = input_ids.device, input_ids.size(1)
    real_columns = [attention_mask[row].nonzero().flatten() for row in range(attention_mask.size(0))]  # [B][L_i]
    sources = [torch.cat([index * width + real_columns[index] for index in row]) for row in rows]  # [k][n_r]
    span = max(len(source) for source in sources)
    flat_ids = input_ids.reshape(-1)
    scored = torch.arange(width, device=device) >= width - logits_to_keep  # [L] completion columns
    ids = input_ids.new_zeros((len(rows), span))  # [k, W]
    positions = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    real = torch.zeros_like(ids, dtype=torch.bool)
    for r, (row, source) in enumerate(zip(rows, sources)):
        n = len(source)
        lengths = torch.tensor([len(real_columns[index]) for index in row], device=device)
        # [n] each token's sequence start
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        tail_start = int(starts[-1]) if n else 0
        positions[r] = torch.cat([torch.arange(n, device=device) - starts,
                                  torch.arange(n, span, device=device) - tail_start])
        ids[r, :n] = flat_ids[source]
        labels[r, :n] = flat_ids[source].masked_fill(~scored[source % width], -100)
        real[r, :n] = True
    return Pack(input_ids=ids, position_ids=positions, labels=labels, real=real, source=torch.cat(sources))


def packed_logps_and_entropies(
    forward: Callable[[Pack], tuple[torch.Tensor, torch.Tensor | None]],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    budget: int | None,
    compute_entropy: bool,
    one_row: bool = False,
    recomputed_forward: Callable[[Pack], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    forwards: Callable[[int], int] | None = None,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Per-token log-probs (and entropies) of the completions, `[B, C]` as TRL's padded pass returns them (0 at
    padding), from the forwards `plan_forwards` lays out; and the number of token slots the forwards computed.

    `forward(pack)` returns the pack's `[k, W]` log-probs and entropies (or `None`), position t scoring token t.
    With gradients on and more than one forward, every forward but the last runs through `recomputed_forward`
    (default `forward`) under activation checkpointing: its activations are recomputed during the backward, one
    forward's at a time, so the budget bounds the activation memory of the whole micro-batch, not of each forward only.

    `forwards(n)` (ZeRO-3, FSDP: every forward gathers the parameters, a collective) takes this rank's number of
    forwards and returns how many to run, the same on every rank: the missing ones forward the first row again and
    enter the result with weight 0 (their backward runs too), just before the last forward. `recompute=False` (ZeRO-3)
    keeps every forward's activations until the backward instead of checkpointing them.
    """
    batch, width = input_ids.shape  # [B, L]
    plan = plan_forwards(attention_mask.sum(dim=1).tolist(), budget, one_row)
    extra = (forwards(len(plan)) if forwards else len(plan)) - len(plan)
    plan = plan[:-1] + [None] * extra + plan[-1:]  # None: a zero-weight forward of row 0, keeping ranks in step
    checkpointed = recompute and torch.is_grad_enabled() and len(plan) > 1
    out_logps, out_entropies, sources, slots, idle = [], [], [], 0, []
    for number, rows in enumerate(plan):
        pack = build_pack(input_ids, attention_mask, rows=rows or [[0]], logits_to_keep=logits_to_keep)
        if checkpointed and number < len(plan) - 1:
            pack_logps, pack_entropies = torch.utils.checkpoint.checkpoint(
                recomputed_forward or forward, pack, use_reentrant=False)
        else:
            pack_logps, pack_entropies = forward(pack)  # [k, W]
        slots += pack.input_ids.numel()
        if rows is None:
            idle.append(pack_logps.sum() + (pack_entropies.sum() if compute_entropy else 0.0))
            continue
        sources.append(pack.source)
        out_logps.append(pack_logps[pack.real])  # [n]
        if compute_entropy:
            out_entropies.append(pack_entropies[pack.real])
    # Scatter with index_put (differentiable): each packed token back to its padded slot.
    source = torch.cat(sources)  # [N_total]
    values = torch.cat(out_logps)
    if idle:  # the zero-weight forwards join the graph (their backward gathers like the others')
        values = values + 0.0 * torch.stack(idle).sum()
    logps = values.new_zeros(batch * width).index_put((source,), values).view(batch, width)[:, -logits_to_keep:]
    entropies = None
    if compute_entropy:
        values = torch.cat(out_entropies)
        entropies = values.new_zeros(batch * width).index_put((source,), values).view(batch, width)
        entropies = entropies[:, -logits_to_keep:]
    return logps, entropies, slots


def fused_head_forward(model, autocast) -> Callable[[Pack], tuple[torch.Tensor, torch.Tensor | None]]:
    """`forward` for `packed_logps_and_entropies` through TRL's fused LM head (`add_fused_lm_head`, or Liger's kernel
    bound into it): log-probs and entropies of a pack without `[k, W, V]` logits. The head scores position t+1 from
    position t; a zero in front aligns it to "position t scores token t" (token 0 of a packed row is a prompt
    token)."""

    def forward(pack: Pack):
        with autocast():
            outputs = model(input_ids=pack.input_ids, position_ids=pack.position_ids, labels=pack.labels,
                            fused_lm_head=True)
        pad = torch.nn.functional.pad
        entropy = None if outputs.entropy is None else pad(outputs.entropy, (1, 0))
        return pad(outputs.log_probs, (1, 0)), entropy  # [k, W]

    return forward


def one_row_per_forward(attention: str | None) -> bool:
    """flash-attention reads packed `position_ids` as varlen sequences in a batch of one row only."""
    return attention is not None and attention.startswith("flash_attention")


def attention_problem(attention: str | None) -> str | None:
    """Why `padding_free=True` cannot run with this `attn_implementation` (`None`: it can, or it is not known yet)."""
    if attention is None or attention in PACKABLE_ATTENTION:
        return None
    return (f"padding_free=True needs an attention that reads packed position_ids ({', '.join(PACKABLE_ATTENTION)}); "
            f"attn_implementation={attention!r}: choose one of them or set padding_free=False.")


def check_model_attention(model, padding_free: bool) -> None:
    """With `padding_free`, a model instance whose attention cannot read packed `position_ids` is refused before
    training (`attention_problem`); a model given by name is not loaded yet (`OR1Config` checks
    `model_init_kwargs`' `attn_implementation`)."""
    if not padding_free or isinstance(model, str):
        return
    if problem := attention_problem(model.config._attn_implementation):
        raise ValueError(problem)


def _zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def same_forward_count(accelerator) -> Callable[[int], int] | None:
    """Under ZeRO-3 and FSDP every forward gathers the sharded parameters (a collective), so every rank must run as
    many forwards per pass: `n -> the largest n over the ranks`. `None` where forwards need no collective (one process,
    DDP, ZeRO-1/2: the parameters are whole on each rank)."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes == 1 or not (accelerator.distributed_type == DistributedType.FSDP
                                              or _zero3(accelerator)):
        return None
    return lambda count: int(accelerator.gather(torch.tensor([count], device=accelerator.device)).max())


def check_packable(compute_aux_loss: bool, multimodal: dict) -> None:
    """Packing covers text-only dense models: images and MoE router losses are refused with the fix named."""
    if any(value is not None for value in multimodal.values()):
        raise ValueError("padding_free=True packs text-only batches; this batch has images or multimodal inputs: set "
                         "padding_free=False.")
    if compute_aux_loss:
        raise ValueError("padding_free=True does not compute the MoE router loss (router_aux_loss_coef): set "
                         "padding_free=False.")


def packed_pass(model, accelerator, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                budget: int | None, compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """One pass of `OR1Trainer` (policy, old policy or reference) packed under `budget` tokens per forward:
    `packed_logps_and_entropies` through the fused head. Forwards but the last go around DDP's (or DeepSpeed's)
    wrapper, checkpointed (recomputed in the backward), so each rank runs one wrapped forward per policy pass, whatever
    its number of forwards. Under ZeRO-3 and FSDP every rank runs as many forwards (`same_forward_count`); under ZeRO-3
    they are not checkpointed: TRL's fused head gathers its weight in the backward only if it is the ZeRO parameter,
    which a recomputed forward's saved weight is not."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=True)
    return packed_logps_and_entropies(
        fused_head_forward(model if torch.is_grad_enabled() else unwrapped, accelerator.autocast),
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, budget=budget,
        compute_entropy=compute_entropy, one_row=one_row_per_forward(unwrapped.config._attn_implementation),
        recomputed_forward=fused_head_forward(unwrapped, accelerator.autocast),
        forwards=same_forward_count(accelerator), recompute=not _zero3(accelerator))
