"""Padding-free log-prob passes (`or1_trl/trainer/packing.py`, `OR1Config.padding_free`): the same per-token log-probs and
entropies as TRL's padded pass, the same training run, fewer token slots."""

from contextlib import nullcontext

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from or1_trl import OR1Config, OR1Trainer
from or1_trl.trainer.logprobs import liger_available, use_liger_head
from or1_trl.trainer.packing import build_pack, fused_head_forward, packed_logps_and_entropies, plan_forwards
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import logged, parity_reward, tagged_dataset


def test_plan_forwards_packs_first_fit_decreasing_under_the_budget():
    lengths = [3, 4, 2, 9, 1, 1]
    # sdpa/eager: packed rows at most the longest sequence wide (9), forwards of at most `budget` slots
    assert plan_forwards(lengths, budget=None, one_row=False) == [[[3], [1, 0, 2], [4, 5]]]
    assert plan_forwards(lengths, budget=18, one_row=False) == [[[3], [1, 0, 2]], [[4, 5]]]
    # a budget below the longest sequence: rows at most the budget wide; the longer sequence alone
    assert plan_forwards(lengths, budget=7, one_row=False) == [[[3]], [[1, 0]], [[2, 4, 5]]]
    # flash-attention's varlen path: one packed row per forward, up to the budget
    assert plan_forwards(lengths, budget=None, one_row=True) == [[[3, 1, 0, 2, 4, 5]]]
    assert plan_forwards(lengths, budget=10, one_row=True) == [[[3, 4]], [[1, 0, 2, 5]]]
    assert plan_forwards([10], budget=4, one_row=False) == [[[0]]]
    for budget, one_row in [(None, False), (18, False), (7, False), (10, True)]:  # every row exactly once
        rows = [r for forward in plan_forwards(lengths, budget, one_row) for packed in forward for r in packed]
        assert sorted(rows) == list(range(len(lengths)))


def padded_batch(prompt_lengths, completion_lengths, vocab, seed=0):
    """TRL's layout: prompts left-padded to P, completions right-padded to C; `[B, P+C]` ids and attention mask."""
    g = torch.Generator().manual_seed(seed)
    P, C = max(prompt_lengths), max(completion_lengths)
    ids = torch.zeros(len(prompt_lengths), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        ids[row, P - p : P + c] = torch.randint(1, vocab, (p + c,), generator=g)
        mask[row, P - p : P + c] = 1
    return ids, mask, C


def test_build_pack_lays_real_tokens_end_to_end_with_restarting_positions():
    ids, mask, C = padded_batch([2, 3, 2], [1, 2, 4], vocab=50)
    pack = build_pack(ids, mask, [[0, 1], [2]], C)
    real = lambda row: ids[row][mask[row].bool()].tolist()
    assert pack.input_ids[0].tolist() == real(0) + real(1) and pack.input_ids[1, :6].tolist() == real(2)
    assert pack.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]  # tail continues
    assert pack.real.tolist() == [[True] * 8, [True] * 6 + [False] * 2]
    assert (pack.labels[0] != -100).tolist() == [False, False, True, False, False, False, True, True]
    assert (pack.labels[1] != -100).tolist() == [False, False, True, True, True, True, False, False]
    assert ids.reshape(-1)[pack.source].tolist() == pack.input_ids[pack.real].tolist()


@pytest.mark.parametrize("backend", ["trl", "liger"])
@pytest.mark.parametrize("budget", [None, 12])
def test_packed_logps_and_entropies_equal_the_padded_pass(backend, budget):
    if backend == "liger" and not liger_available():
        pytest.skip("Liger is not installed")
    model, _ = tiny_model_and_tokenizer(seed=0)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    if backend == "liger":
        use_liger_head(model)
    ids, mask, C = padded_batch([3, 7, 2, 5], [1, 9, 30, 4], vocab=model.config.vocab_size)  # very different lengths
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-C] = -100
    padded = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)  # TRL's padded pass
    logps, entropies, slots = packed_logps_and_entropies(fused_head_forward(model, nullcontext), ids, mask, C, budget,
                                                         compute_entropy=True)
    scored = mask[:, -C:].bool()  # [B, C] the completions' real tokens
    assert torch.allclose(logps[scored], padded.log_probs[:, -C:][scored], atol=1e-5, rtol=0)
    assert torch.allclose(entropies[scored], padded.entropy[:, -C:][scored], atol=1e-5, rtol=0)
    assert (logps[~scored] == 0).all()
    # sequences of 4, 16, 32, 9 tokens: rows 32 | 16+9+4 (width 32); with a budget of 12, one forward each
    assert slots == {None: 64, 12: 61}[budget] < ids.numel() and int(mask.sum()) == 61
    logps.sum().backward()  # differentiable through the scatter
    assert model.lm_head.weight.grad is not None


def saved_activation_bytes(model, ids, mask, C, budget):
    """Bytes of the tensors autograd keeps for the backward of one packed policy pass (parameters excluded)."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in params:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, entropies, _ = packed_logps_and_entropies(fused_head_forward(model, nullcontext), ids, mask, C, budget,
                                                         compute_entropy=True)
    (logps.sum() + entropies.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return sum(saved), grads


def test_a_budget_bounds_the_activations_kept_for_the_backward():
    """Under a budget, every forward but the last is checkpointed: the micro-batch's backward keeps one forward's
    activations, not every row's, and recomputes the others to the same gradients."""
    model, _ = tiny_model_and_tokenizer(seed=0)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    ids, mask, C = padded_batch([4] * 8, [28] * 8, vocab=model.config.vocab_size)  # 8 sequences of 32 tokens
    whole, grads = saved_activation_bytes(model, ids, mask, C, budget=None)  # one forward: 8 rows
    bounded, bounded_grads = saved_activation_bytes(model, ids, mask, C, budget=64)  # 4 forwards of 2 rows
    assert bounded < 0.4 * whole
    for name, grad in grads.items():  # float rounding of sums over 8 rows, relative to the gradient's scale
        assert (bounded_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def train_run(tmp_path, peft=False, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    overrides = {"learning_rate": 1e-3, **overrides}
    args = OR1Config(**tiny_training_args(tmp_path, max_completion_length=12,
                                          generation_kwargs={"sequence_bias": [[[0], 3.0]]}, **overrides))
    trainer = OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 16),
                         processing_class=tokenizer, peft_config=peft_config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, before


@pytest.mark.parametrize("setting", [dict(rejection_sampling="compact"), dict(rejection_sampling="off"),
                                     dict(gradient_checkpointing=True), dict(peft=True, learning_rate=5.0)],
                         ids=["compact", "no-rejection", "gradient-checkpointing", "lora"])
def test_two_steps_packed_end_with_the_padded_runs_parameters(tmp_path, setting):
    """Completions of very different lengths (EOS biased up: some end at once, some run to the cap); the packed run
    with a small budget ends where the padded run ends, and fills its forwards with real tokens only."""
    # SGD: Adam would turn float-rounding gradients of unused embeddings (~1e-10) into steps of the learning rate
    setting = {"learning_rate": 0.5, "optim": "sgd", "gradient_accumulation_steps": 2, **setting}
    padded, before = train_run(tmp_path / "padded", **setting)
    packed, _ = train_run(tmp_path / "packed", padding_free=True, max_tokens_per_microbatch=24, **setting)
    moved = 0.0
    assert len(before) == len(dict(packed.model.named_parameters()))
    for (name, a), (_, b) in zip(padded.model.named_parameters(), packed.model.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
        moved = max(moved, (a - before[name]).abs().max().item())
    assert moved > 1e-3  # far above the tolerance
    assert logged(packed, "loss") == pytest.approx(logged(padded, "loss"), rel=1e-5, abs=1e-7)
    fill_padded, fill_packed = logged(padded, "update/token_fill"), logged(packed, "update/token_fill")
    assert len(fill_packed) == len(fill_padded) == 2  # the same micro-batches, fewer slots packed
    assert all(0 < padded_fill < packed_fill <= 1 for padded_fill, packed_fill in zip(fill_padded, fill_packed))


def test_packing_settings_are_checked_before_training(tmp_path):
    with pytest.raises(ValueError, match="set padding_free=True with it"):
        OR1Config(**tiny_training_args(tmp_path, max_tokens_per_microbatch=64))
    with pytest.raises(ValueError, match="needs an attention that reads packed position_ids"):
        OR1Config(**tiny_training_args(tmp_path, padding_free=True,
                                       model_init_kwargs={"attn_implementation": "flex_attention"}))


def test_ranks_with_fewer_forwards_run_zero_weight_ones_to_stay_in_step():
    """ZeRO-3 and FSDP gather the parameters in every forward: a rank runs as many forwards as the rank with most
    (`forwards`), the extra ones entering with weight 0, and ZeRO-3's forwards are not checkpointed (`recompute`).
    Same log-probs, entropies and gradients either way; the extra forwards are counted in the slots."""
    model, _ = tiny_model_and_tokenizer(seed=0)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    ids, mask, C = padded_batch([3, 7, 2, 5], [1, 9, 30, 4], vocab=model.config.vocab_size)
    forward = fused_head_forward(model, nullcontext)
    results = {}
    for name, options in {"plain": {}, "lockstep": {"forwards": lambda n: n + 2},
                          "lockstep, not recomputed": {"forwards": lambda n: n + 2, "recompute": False}}.items():
        logps, entropies, slots = packed_logps_and_entropies(forward, ids, mask, C, 12, True, **options)
        (logps.sum() + entropies.sum()).backward()
        results[name] = (logps.detach(), entropies.detach(), slots, {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    logps, entropies, slots, grads = results["plain"]
    for name in ("lockstep", "lockstep, not recomputed"):
        assert torch.equal(results[name][0], logps) and torch.equal(results[name][1], entropies), name
        assert results[name][2] == slots + 2 * int(mask[0].sum()), name  # two more forwards of row 0
        for param, grad in grads.items():
            torch.testing.assert_close(results[name][3][param], grad, rtol=1e-5, atol=1e-7, msg=f"{name}: {param}")


def test_only_parameter_gathering_backends_count_forwards_across_ranks():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from or1_trl.trainer.packing import same_forward_count

    def accelerator(kind, processes=2, stage=None):
        plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(distributed_type=kind, num_processes=processes, device=torch.device("cpu"),
                               state=SimpleNamespace(deepspeed_plugin=plugin), gather=lambda t: torch.cat([t, t + 3]))

    for kind, stage in [(DistributedType.MULTI_GPU, None), (DistributedType.NO, None), (DistributedType.DEEPSPEED, 2)]:
        assert same_forward_count(accelerator(kind, stage=stage)) is None, kind
    assert same_forward_count(accelerator(DistributedType.FSDP, processes=1)) is None
    for kind, stage in [(DistributedType.DEEPSPEED, 3), (DistributedType.FSDP, None)]:
        assert same_forward_count(accelerator(kind, stage=stage))(4) == 7, kind  # the largest count over the ranks


def test_a_stage_sets_its_own_budget(tmp_path):
    from or1_trl.recipe.stages import stage_shapes
    from or1_trl.trainer.stage_run import apply_to_args

    args = OR1Config(**tiny_training_args(tmp_path, padding_free=True, max_tokens_per_microbatch=64, max_steps=-1,
                                          stages=[{"until_step": 1}, {"until_step": 2, "max_tokens_per_microbatch": 16}]))
    shapes = stage_shapes(args.stage_list, args, 1)
    assert [shape.max_tokens_per_microbatch for shape in shapes] == [64, 16]
    apply_to_args(args, shapes[1])
    assert args.max_tokens_per_microbatch == 16
    with pytest.raises(ValueError, match="a stage sets max_tokens_per_microbatch"):
        OR1Config(**tiny_training_args(tmp_path, max_steps=-1, stages=[{"until_step": 1, "max_tokens_per_microbatch": 8}]))


def test_a_model_whose_attention_cannot_read_packed_sequences_is_refused(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        OR1Trainer(model, parity_reward, args=OR1Config(**tiny_training_args(tmp_path, padding_free=True)),
                   train_dataset=tagged_dataset(["MIX"] * 4), processing_class=tokenizer)
