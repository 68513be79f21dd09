"""OR1Trainer end to end on the tiny model: drop-in equivalence, rejection, skipped steps, controller, resume."""

import math
import os

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from or1_trl import OR1Config, OR1Trainer
from or1_trl.generation.finite_logits import NonFiniteLogitsError
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from ..helpers import TOL, ScriptedReward, logged, parity_reward, tagged_dataset, tied_trainer

def train(trainer_cls, config_cls, tmp_path, reward=parity_reward, dataset=None, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = config_cls(**tiny_training_args(tmp_path, **overrides))
    trainer = trainer_cls(
        model, reward, args=args, train_dataset=dataset or tagged_dataset(["MIX"] * 16), processing_class=tokenizer
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, before


OR1_OFF = dict(rejection_sampling="off", use_adaptive_entropy=False, entropy_coef=0.0, logprob_backend="trl",
               rollout_correction="trl")


def test_drop_in_equivalence_with_grpo_trainer(tmp_path):
    """Every OR1 feature off: same losses and same parameters as TRL's GRPOTrainer, step for step."""
    common = dict(max_steps=3, learning_rate=1e-3, lr_scheduler_type="constant", gradient_accumulation_steps=2)
    trl_trainer, _ = train(GRPOTrainer, GRPOConfig, tmp_path / "trl", **common)
    or1_trainer, before = train(OR1Trainer, OR1Config, tmp_path / "or1", **common, **OR1_OFF)
    assert logged(or1_trainer, "loss") == logged(trl_trainer, "loss")
    changed = False
    for (name, p_or1), (_, p_trl) in zip(or1_trainer.model.named_parameters(), trl_trainer.model.named_parameters()):
        assert torch.equal(p_or1, p_trl), name
        changed |= not torch.equal(p_or1, before[name])
    assert changed


def test_a_plain_grpo_config_trains_as_grpo_trainer(tmp_path):
    """A plain GRPOConfig (`OR1Config.from_grpo`: every OR1 field at `TRL_BEHAVIOUR`), TRL's own adaptive entropy
    control on: same losses, entropy coefficients and parameters as GRPOTrainer, step for step; no prompt pool."""
    common = dict(max_steps=3, learning_rate=1e-3, gradient_accumulation_steps=2, use_adaptive_entropy=True,
                  entropy_target=7.0, entropy_coef_delta=0.01)  # the tiny model's entropy is about 6.1: c grows
    trl_trainer, _ = train(GRPOTrainer, GRPOConfig, tmp_path / "trl", **common)
    or1_trainer, before = train(OR1Trainer, GRPOConfig, tmp_path / "or1", **common)
    assert logged(or1_trainer, "loss") == logged(trl_trainer, "loss")
    assert logged(or1_trainer, "entropy_coef") == logged(trl_trainer, "entropy_coef") != [0.0, 0.0, 0.0]
    for (name, p_or1), (_, p_trl) in zip(or1_trainer.model.named_parameters(), trl_trainer.model.named_parameters()):
        assert torch.equal(p_or1, p_trl), name
    assert or1_trainer.args.recipe == "trl" and or1_trainer.prompt_schedule is None
    assert not os.path.exists(tmp_path / "or1" / "prompt_stats.jsonl")


def test_magic_defaults_train_and_log(tmp_path):
    trainer, before = train(OR1Trainer, OR1Config, tmp_path, learning_rate=1e-3)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    for key in ("rejection/kept_group_frac", "rejection/solve_none_frac", "rejection/solve_all_frac", "entropy_coef", "entropy"):
        assert len(logged(trainer, key)) == 2, key


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_rejection_compacts_rows_and_logs_outcomes(tmp_path, steps_per_generation):
    reward = ScriptedReward()
    tags = ["ALL", "MIX", "NONE", "MIX", "NONE", "NONE", "MIX", "ALL"] * 2
    trainer, _ = train(
        OR1Trainer, OR1Config, tmp_path, reward=reward, dataset=tagged_dataset(tags), max_steps=3,
        gradient_accumulation_steps=steps_per_generation, learning_rate=1e-3,
    )
    rows_per_step = 8 * steps_per_generation
    assert len(reward.informative_rows) == 3
    # kept rows padded with zero-weight rows to a multiple of the micro-steps (at least one row each); a step with
    # nothing kept runs no pass at all
    expected = sum(max(steps_per_generation, math.ceil(k / steps_per_generation) * steps_per_generation)
                   for k in reward.informative_rows if k > 0)
    assert trainer.or1_rows_forwarded == expected
    assert expected < 3 * rows_per_step  # rejected rows really were not forwarded
    kept = [k / rows_per_step for k in reward.informative_rows]
    assert logged(trainer, "rejection/kept_group_frac") == pytest.approx(kept)


def test_mask_mode_forwards_everything(tmp_path):
    reward = ScriptedReward()
    tags = ["ALL", "MIX", "NONE", "MIX"] * 4
    trainer, _ = train(OR1Trainer, OR1Config, tmp_path, reward=reward, dataset=tagged_dataset(tags), rejection_sampling="mask")
    # every row of a step with something to train (masked, not removed); a step with nothing kept runs no pass
    assert 0 < trainer.or1_rows_forwarded == 8 * sum(k > 0 for k in reward.informative_rows)


def test_compact_and_mask_give_the_same_update(tmp_path):
    """Skywork's masking and our compaction are the same gradient; compaction just runs fewer rows."""
    tags = ["ALL", "MIX", "NONE", "MIX"] * 4
    results = {}
    for mode in ("compact", "mask"):
        trainer, before = train(
            OR1Trainer, OR1Config, tmp_path / mode, reward=ScriptedReward(), dataset=tagged_dataset(tags),
            rejection_sampling=mode, max_steps=1, learning_rate=1e-2, optim="sgd", gradient_accumulation_steps=2,
        )
        results[mode] = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer.or1_rows_forwarded)
    (compact, n_compact), (masked, n_masked) = results["compact"], results["mask"]
    assert n_compact < n_masked
    moved = 0.0
    for name in compact:
        torch.testing.assert_close(compact[name], masked[name], atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, (compact[name] - before[name]).abs().max().item())
    assert moved > 1e-4


def test_all_rejected_step_is_skipped(tmp_path):
    """Every group solved (or failed) everywhere: no parameter moves, not even through Adam's momentum."""
    tags = ["ALL", "NONE"] * 8
    trainer, before = train(
        OR1Trainer, OR1Config, tmp_path, reward=ScriptedReward(), dataset=tagged_dataset(tags), max_steps=3,
        learning_rate=1e-2, weight_decay=0.1, gradient_accumulation_steps=2, entropy_target=100.0,
    )
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert trainer.or1_skipped_steps == 3
    assert logged(trainer, "skipped_steps") == [1.0, 2.0, 3.0]
    assert trainer.or1_rows_forwarded == 0  # no log-prob pass, no backward: nothing to train on (issue 49)
    assert trainer.entropy_controller.coef == 0.0  # nothing measured: c unchanged although tgt is huge
    assert logged(trainer, "entropy") == [None] * 3  # nothing measured: not TRL's 0.0 (a collapse on a dashboard)


def test_skipped_steps_is_logged_as_a_count_never_averaged(tmp_path):
    """`skipped_steps` counts the run's skipped steps: a logging window of 3 steps (all skipped) logs 3, not the mean
    1, 2, 3 = 2 that TRL gives its metrics."""
    trainer, _ = train(OR1Trainer, OR1Config, tmp_path, reward=ScriptedReward(), dataset=tagged_dataset(["ALL"] * 16),
                       max_steps=3, logging_steps=3)
    assert trainer.or1_skipped_steps == 3 and logged(trainer, "skipped_steps") == [3.0]


def test_skip_applies_only_to_rejected_steps(tmp_path):
    """A mixed run: exactly the steps with no informative group are skipped; the others move the weights."""
    reward = ScriptedReward()
    tags = ["ALL", "MIX", "ALL", "NONE"] * 4
    trainer, before = train(
        OR1Trainer, OR1Config, tmp_path, reward=reward, dataset=tagged_dataset(tags), learning_rate=1e-3, max_steps=6
    )
    skipped = sum(k == 0 for k in reward.informative_rows)
    assert 0 < skipped < 6  # this seed draws both kinds of step
    assert trainer.or1_skipped_steps == skipped
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    # the entropy of a step is logged where it measured kept tokens, and only there (1 micro-step per step)
    entropy = logged(trainer, "entropy")
    assert [h is None for h in entropy] == [k == 0 for k in reward.informative_rows]
    assert all(h > 0 for h in entropy if h is not None)


def test_controller_follows_eq_3_2_during_training(tmp_path):
    """Logged coefficients equal eq. 3.2 applied to the logged entropies (the target sits inside their range)."""
    from ..helpers import reference_eq_3_2

    probe, _ = train(OR1Trainer, OR1Config, tmp_path / "probe", max_steps=1)
    target = logged(probe, "entropy/measured")[0] - 0.01  # first steps above tgt, later ones (lr high) below
    trainer, _ = train(
        OR1Trainer, OR1Config, tmp_path / "run", max_steps=6, learning_rate=3e-2, entropy_target=target,
        entropy_coef_delta=0.01,
    )
    measured = logged(trainer, "entropy/measured")
    assert len(measured) == 6
    assert min(measured) < target < max(measured)
    expected = reference_eq_3_2(measured, target, 0.01, 0.0, 1.0)
    assert logged(trainer, "entropy_coef") == pytest.approx([c for _, c in expected], abs=1e-6)
    assert logged(trainer, "entropy/alpha") == pytest.approx([a for a, _ in expected], abs=1e-6)


def test_controller_window_sums_micro_steps_and_skips_empty_windows(tmp_path, tiny):
    """Scripted per-token entropies through the trainer's own window logic (2 micro-steps per step)."""
    from ..helpers import reference_eq_3_2

    model, tokenizer = tiny
    args = OR1Config(**tiny_training_args(tmp_path, entropy_target=0.2, entropy_coef_delta=0.01))
    trainer = OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 8), processing_class=tokenizer)
    state = trainer.accelerator.gradient_state
    # each step: two micro-batches of (entropy value, number of kept tokens)
    script = [((0.5, 3), (0.1, 1)), ((0.1, 2), (0.1, 2)), ((0.0, 0), (0.0, 0)), ((0.05, 4), (0.3, 4)), ((0.3, 1), (0.1, 3))]
    window_means = []
    for micro in script:
        tokens = sum(n for _, n in micro)
        window_means.append(None if tokens == 0 else sum(e * n for e, n in micro) / tokens)
        for i, (value, n) in enumerate(micro):
            mask = torch.zeros(1, 4)
            mask[0, :n] = 1.0
            entropies = torch.full((1, 4), value)
            state._set_sync_gradients(i == len(micro) - 1)
            trainer._update_entropy_controller(None, entropies, mask)
    state._set_sync_gradients(True)
    expected = reference_eq_3_2(window_means, 0.2, 0.01, 0.0, 1.0)
    assert trainer.entropy_controller.coef == pytest.approx(expected[-1][1], abs=1e-12)
    assert logged_metrics(trainer, "entropy_coef") == pytest.approx([c for _, c in expected], abs=1e-12)


def logged_metrics(trainer, key):
    return trainer._metrics["train"][key]


def test_sampled_estimator_measures_negative_logprob(tmp_path):
    trainer, _ = train(OR1Trainer, OR1Config, tmp_path, entropy_estimator="sampled", max_steps=1)
    full = logged(trainer, "entropy")[0]
    sampled = logged(trainer, "entropy/measured")[0]
    assert sampled != pytest.approx(full, rel=1e-3)  # a different estimator of the same quantity
    assert 0 < sampled < 3 * full


def test_sampled_estimator_is_negative_mean_logprob_of_kept_tokens(tmp_path, tiny):
    """The released code's e_k: −mean log π_old(a_t) over the kept tokens of the whole step (2 micro-steps)."""
    model, tokenizer = tiny
    args = OR1Config(**tiny_training_args(tmp_path, entropy_estimator="sampled", entropy_target=10.0))
    trainer = OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 8), processing_class=tokenizer)
    state = trainer.accelerator.gradient_state
    g = torch.Generator().manual_seed(0)
    micro = [(-torch.rand(2, 5, generator=g) * 3, (torch.rand(2, 5, generator=g) > 0.3).float()) for _ in range(2)]
    for i, (old_logps, mask) in enumerate(micro):
        state._set_sync_gradients(i == 1)
        trainer._update_entropy_controller(old_logps, torch.full((2, 5), 99.0), mask)  # full entropy ignored
    state._set_sync_gradients(True)
    expected = -sum((lp * m).sum() for lp, m in micro) / sum(m.sum() for _, m in micro)
    assert trainer.entropy_controller.last_entropy == pytest.approx(expected.item(), abs=1e-6)


def test_controller_state_survives_resume(tmp_path):
    """Controller c and last entropy are restored from the checkpoint; the resumed run continues identically."""
    common = dict(max_steps=4, learning_rate=1e-3, entropy_target=100.0, save_strategy="steps", save_steps=2)
    full, _ = train(OR1Trainer, OR1Config, tmp_path / "full", **common)
    coefs = logged(full, "entropy_coef")
    assert coefs == pytest.approx([0.005, 0.01, 0.015, 0.02])

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(tmp_path / "full", **common))
    resumed = OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 16), processing_class=tokenizer)
    checkpoint = os.path.join(tmp_path / "full", "checkpoint-2")
    assert os.path.exists(os.path.join(checkpoint, "entropy_ctrl_state.json"))
    resumed.train(resume_from_checkpoint=checkpoint)
    assert logged(resumed, "entropy_coef")[-2:] == pytest.approx(coefs[2:])
    assert resumed.entropy_controller.coef == pytest.approx(full.entropy_controller.coef)
    assert resumed.entropy_controller.last_entropy == pytest.approx(full.entropy_controller.last_entropy, abs=1e-6)


def test_eighty_twenty_selected_normalisation_trains(tmp_path):
    trainer, before = train(
        OR1Trainer, OR1Config, tmp_path, top_entropy_quantile=0.2, top_entropy_normalization="selected", learning_rate=1e-3
    )
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_step_without_trainable_tokens_is_skipped(tmp_path):
    """Informative groups, but every completion is truncated and masked (mask_truncated_completions): no token is
    trained, so — like an all-rejected step — the optimizer does not move the weights (not even weight decay)."""
    trainer, before = train(
        OR1Trainer, OR1Config, tmp_path, reward=ScriptedReward(), dataset=tagged_dataset(["MIX"] * 16), max_steps=2,
        learning_rate=1e-2, weight_decay=0.1, mask_truncated_completions=True, max_completion_length=2,
        generation_kwargs={"suppress_tokens": [tiny_model_and_tokenizer()[1].eos_token_id]},  # never stops early
    )
    assert logged(trainer, "completions/clipped_ratio") == [1.0, 1.0]
    assert logged(trainer, "rejection/kept_group_frac") == [1.0, 1.0]
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert trainer.or1_skipped_steps == 2
    assert logged(trainer, "skipped_steps") == [1.0, 2.0]


def test_missing_reward_column_fails_before_the_model_loads(tmp_path):
    """A dataset without the reward's gold column is an error at construction — before the (here nonexistent) model
    is loaded, long before the first generation."""
    from or1_trl.rewards import code_reward, math_reward

    args = OR1Config(**tiny_training_args(tmp_path))
    prompts = Dataset.from_dict({"prompt": ["Q: 1+1=? A:"] * 4, "solution": ["2"] * 4})
    for reward, column in ((math_reward, "answer"), (code_reward, "tests")):
        with pytest.raises(ValueError, match=rf"'{reward.__name__}' needs the dataset column\(s\) \['{column}'\]"):
            OR1Trainer("/nonexistent/model", reward, args=args, train_dataset=prompts)

    def user_reward(completions, solution, reference, **kwargs):  # TRL fills `solution`, `reference` from columns
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"'user_reward' needs the dataset column\(s\) \['reference'\]"):
        OR1Trainer("/nonexistent/model", user_reward, args=args, train_dataset=prompts)
    with pytest.raises(ValueError, match="eval_dataset has no 'prompt' column"):
        OR1Trainer("/nonexistent/model", parity_reward, args=args, train_dataset=prompts,
                   eval_dataset=prompts.rename_column("prompt", "question"))


def test_no_entropy_gradient_when_alpha_is_zero(tmp_path, monkeypatch):
    """α = 0 (controller gate closed, the usual state): the entropy term is left out, so TRL's fused head skips its
    entropy-gradient branch (as in GRPOTrainer), and the update equals GRPOTrainer's; with α > 0 the branch runs."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    backward = ChunkedLogProbFunction.backward
    calls = []

    def spy(ctx, grad_logprobs, grad_entropy, *rest):
        calls.append(grad_entropy is not None)
        return backward(ctx, grad_logprobs, grad_entropy, *rest)

    monkeypatch.setattr(ChunkedLogProbFunction, "backward", staticmethod(spy))
    common = dict(max_steps=3, learning_rate=1e-3, lr_scheduler_type="constant")
    grpo, _ = train(GRPOTrainer, GRPOConfig, tmp_path / "trl", **common)
    assert calls and not any(calls)
    calls.clear()
    common["logprob_backend"] = "trl"  # the spy is on TRL's kernel
    gated, _ = train(OR1Trainer, OR1Config, tmp_path / "gated", **common, rejection_sampling="off", entropy_target=1e-6)
    assert logged(gated, "entropy/alpha") == [0.0, 0.0, 0.0]
    assert calls and not any(calls)
    for (name, p_or1), (_, p_trl) in zip(gated.model.named_parameters(), grpo.model.named_parameters()):
        torch.testing.assert_close(p_or1, p_trl, atol=1e-7, rtol=1e-6, msg=name)
    calls.clear()
    train(OR1Trainer, OR1Config, tmp_path / "on", **common, use_adaptive_entropy=False, entropy_coef=0.01)
    assert calls and all(calls)


def test_changed_defaults_are_announced_once_at_start(tmp_path, caplog):
    """Swapping GRPOConfig for OR1Config changes defaults (e.g. the LR schedule): one line at start lists them."""
    from transformers.utils import logging as hf_logging

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING", logger="or1_trl.trainer.or1_trainer"):
            OR1Trainer(model, parity_reward, args=OR1Config(**tiny_training_args(tmp_path, rejection_sampling="mask")),
                       train_dataset=tagged_dataset(["MIX"] * 4), processing_class=tokenizer)
    finally:
        hf_logging.disable_propagation()
    lines = [r.getMessage() for r in caplog.records if "not GRPOConfig's" in r.getMessage()]
    assert len(lines) == 1
    assert "lr_scheduler_type='constant'" in lines[0] and "use_adaptive_entropy=True" in lines[0]
    assert "rejection_sampling" not in lines[0]  # set by the user
    default = OR1Config(**tiny_training_args(tmp_path)).changed_defaults()
    assert ("rejection_sampling", "compact", "off") in default
    assert ("logprob_backend", "auto", "trl") in default
    assert ("rollout_correction", "geo_mask_token_truncate", "trl") in default
    assert OR1Config(**tiny_training_args(tmp_path, lr_scheduler_type="linear", use_adaptive_entropy=False,
                                          rejection_sampling="off", logprob_backend="trl",
                                          rollout_correction="trl")).changed_defaults() == []


class NaNAfterStep(TrainerCallback):
    """Once step `after` is done: its weights kept (`weights`), and the next LM head forward (the next rollout's
    first sampling step) returns NaN in row `row`'s logits."""

    def __init__(self, model, after: int, row: int):
        self.model, self.after, self.row, self.weights, self.armed = model, after, row, None, False
        model.lm_head.register_forward_hook(self.plant)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.after:
            self.weights = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            self.armed = True

    def plant(self, module, inputs, output):
        if self.armed:
            self.armed = False
            output = output.clone()
            output[self.row] = float("nan")
        return output


def test_a_nan_logit_at_sampling_stops_the_run_naming_the_step_and_row_before_training_on_it(tmp_path):
    """HF `generate` path: a NaN in row 3's logits at step 2's rollout ends the run with `NonFiniteLogitsError`
    naming step 2 and row 3 (not `torch.multinomial`'s error); step 1 trained, step 2 changed no weight."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(tmp_path, learning_rate=1e-2, max_steps=3))
    trainer = OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 16),
                         processing_class=tokenizer)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    nan = NaNAfterStep(trainer.model, after=1, row=3)
    trainer.add_callback(nan)
    with pytest.raises(NonFiniteLogitsError) as error:
        trainer.train()
    assert error.value.rows == [3] and error.value.batch_size == 8
    assert str(error.value).startswith("non-finite logits (NaN/inf) at sampling, training step 2 (the step was not "
                                       "trained on): rows [3] of the 8-row batch; ")
    assert trainer.state.global_step == 1 and not nan.armed
    assert any(not torch.equal(nan.weights[n], initial[n]) for n in initial)  # step 1 trained
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, nan.weights[name]), name  # step 2 did not
    assert "generate" not in vars(trainer.model)


def test_nan_logprobs_from_the_vllm_server_stop_the_run_before_training_on_them(vllm_server, tmp_path):
    """vLLM server path (disk sync): a NaN pushed in one weight makes the server sample with NaN logits. vLLM 0.32
    cannot write their NaN log-probs in JSON and answers 400; the run ends with `NonFiniteLogitsError` naming step 1
    (the rows unknown: the answer was refused whole), before any update.

    The server is then fit for the next run: the KV cache the NaN weights wrote is zeroed with the next push (before
    extension version 5, the next run's first requests sampled NaN through the masked slots of those blocks and stopped
    too). A fresh run trains its step on the same server, which samples with the log-probs of its pushed weights."""
    trainer = tied_trainer(vllm_server, tmp_path, max_steps=2)
    with torch.no_grad():
        trainer.model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(NonFiniteLogitsError) as error:
        trainer.train()
    assert str(error.value).startswith(
        "non-finite vLLM log-probs (NaN/inf) at sampling, training step 1 (the step was not trained on): rows unknown "
        "(the vLLM server refused its whole answer: it cannot write a NaN log-prob in JSON, 'Out of range float "
        "values are not JSON compliant') of the batch; ")
    assert error.value.rows is None
    assert trainer.state.global_step == 0
    for name, param in trainer.model.named_parameters():
        assert torch.allclose(param, initial[name], rtol=0, atol=0, equal_nan=True), name

    fresh = tied_trainer(vllm_server, tmp_path / "next_run", max_steps=1, logging_steps=1)
    fresh.train()
    assert fresh.state.global_step == 1
    sampled = next(log for log in fresh.state.log_history if "sampling/sampling_logp_difference/max" in log)
    assert sampled["sampling/sampling_logp_difference/max"] < TOL  # finite, and the trainer's own log-probs
