"""Rollout correction in the trainer (`recipe/rollout_correction.RolloutCorrection` from `OR1Trainer`'s hooks), on a real
bf16 vLLM CPU server against the fp32 trainer: the hook that replaces TRL's ratio and logs the diagnostics, refill
batches corrected before rejection, and the loss with the correction off (the paper) or on. The pure pieces:
`tests/recipe/test_rollout_correction.py`."""

import pytest
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.recipe import rollout_correction as rc
from or1_trl.recipe.rejection import WEIGHT_KEY
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import fixed_batch, reference_logps_entropy
from ..helpers import ScriptedReward, logged, tagged_dataset


# --- On a real bf16 vLLM CPU server, against the fp32 trainer -----------------------------------------------------
def _server_trainer(server, output_dir, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_weight_sync="disk",
                    vllm_server_api_key=server.api_key, learning_rate=1e-2, max_completion_length=12,
                    generation_kwargs={"ignore_eos": True})
    settings.update(overrides)
    return OR1Trainer(model, ScriptedReward(), args=OR1Config(**tiny_training_args(output_dir, **settings)),
                      train_dataset=tagged_dataset(["MIX", "ALL", "MIX", "NONE"] * 4), processing_class=tokenizer)


def test_bf16_server_against_fp32_trainer_logs_the_diagnostics(vllm_server_bf16, tmp_path):
    trainer = _server_trainer(vllm_server_bf16, tmp_path)
    trainer.train()
    gap = logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(gap) == 2 and all(1e-5 < g < 0.05 for g in gap), gap  # bf16 against fp32: a real, small mismatch
    for q in ("", "_q1", "_q2", "_q3", "_q4"):
        assert logged(trainer, f"rollout_correction/masked_frac{q}") == [0.0, 0.0]  # nothing near [1/2, 2]
        log_ratio = logged(trainer, f"rollout_correction/log_ratio{q}")
        assert len(log_ratio) == 2 and all(0 < abs(v) < 0.05 for v in log_ratio), (q, log_ratio)
    low, mean, high = (logged(trainer, key) for key in rc.TRL_RATIO_KEYS)
    assert len(low) == len(mean) == len(high) == 2
    assert all(0.8 < a <= m <= b < 1.25 for a, m, b in zip(low, mean, high))  # the per-token weights, near 1


NEAR_ONE = 1.00001  # a cap just above 1: the geometric mask drops nearly every row (TRL's token ratio would not)


def _expected(batch, mode, cap):
    args = (batch["old_per_token_logps"], batch["sampling_per_token_logps"], batch["completion_mask"].float())
    return rc.trl_weights(*args) if mode == "trl" else rc.correction_weights(*args, mode, cap)


@pytest.mark.parametrize("mode", ["geo_mask_token_truncate", "trl"])
def test_the_batch_holds_the_modes_weights(vllm_server_bf16, tmp_path, mode):
    """One rollout batch, as TRL builds it against the bf16 server: with our mode the ratio is our weights of TRL's own
    log-probs (masked rows included, which TRL's ratio would keep); with "trl" it is TRL's ratio, which `trl_weights`
    reproduces (its `sequence_mask`, summed)."""
    trainer = _server_trainer(vllm_server_bf16, tmp_path, rollout_correction=mode, rollout_correction_cap=NEAR_ONE,
                              max_completion_length=64)
    trainer.model.train()
    batch, _ = trainer._scored([trainer.train_dataset[i] for i in (0, 0, 0, 0, 2, 2, 2, 2)])  # 2 groups of G = 4
    expected = _expected(batch, mode, NEAR_ONE)
    torch.testing.assert_close(batch["importance_sampling_ratio"], expected, rtol=1e-6, atol=1e-7)
    masked = (expected == 0).all(dim=1).float().mean().item()
    assert trainer._metrics["train"]["rollout_correction/masked_frac"] == [pytest.approx(masked)]
    if mode == "trl":
        assert batch["importance_sampling_ratio"].shape == (8, 1) and masked == 0.0  # a bf16 gap: exp(Σ) near 1
        sums = rc.token_log_ratios(batch["old_per_token_logps"], batch["sampling_per_token_logps"],
                                   batch["completion_mask"].float()).sum(dim=1)
        assert sums.abs().max() > 1e-3  # a sum and a mean of the log-ratios would differ visibly
    else:
        assert masked > 0


def test_refill_batches_are_corrected_before_rejection(vllm_server_bf16, tmp_path):
    """Both groups of the first rollout are rejected (ALL, NONE): a refill batch joins, and every row that survives
    compaction carries our weights of its own log-probs; the diagnostics were logged for both rollouts."""
    trainer = _server_trainer(vllm_server_bf16, tmp_path, rollout_correction_cap=NEAR_ONE, rejection_refill_rounds=1)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in (1, 1, 1, 1, 3, 3, 3, 3)])
    metrics = trainer._metrics["train"]
    assert metrics["refill/rounds"] == [1.0] and len(metrics["rollout_correction/masked_frac"]) == 2
    expected = _expected(batch, "geo_mask_token_truncate", NEAR_ONE)
    torch.testing.assert_close(batch["importance_sampling_ratio"], expected, rtol=1e-6, atol=1e-7)
    assert (expected == 0).all(dim=1).any()


def test_off_loss_is_the_plain_equation(vllm_server_bf16, tmp_path):
    """With "off" (the paper) a vLLM trainer's loss is eq. 3.1 on its own log-probs, whatever the generator's were;
    with our default the same batch's loss has each token's term weighted by the batch's ratio."""
    def loss(mode, batch):
        trainer = _server_trainer(vllm_server_bf16, tmp_path / mode, rollout_correction=mode, rejection_sampling="mask",
                                  use_adaptive_entropy=False)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        return trainer._compute_loss(trainer.model, batch).item(), trainer.model

    model, _ = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    batch = fixed_batch(model, model.config.vocab_size)
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + 0.5  # a generator far off: ignored by "off"
    off, model = loss("off", batch)
    weights = rc.correction_weights(batch["old_per_token_logps"], batch["sampling_per_token_logps"],
                                    batch["completion_mask"], "token_truncate", 2.0)
    corrected, _ = loss("token_truncate", {**batch, "importance_sampling_ratio": weights})

    def reference(w):
        with torch.no_grad():
            logps, _ = reference_logps_entropy(model, batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"])
        kept = batch["completion_mask"].float() * batch[WEIGHT_KEY][:, None]
        ratio, A = torch.exp(logps - batch["old_per_token_logps"]), batch["advantages"][:, None]
        surrogate = torch.min(ratio * A, torch.clamp(ratio, 0.8, 1.2) * A)
        return (-(kept * w * surrogate).sum() / kept.sum()).item()

    assert off == pytest.approx(reference(1.0), abs=1e-6)
    assert corrected == pytest.approx(reference(weights), abs=1e-6) and abs(corrected - off) > 1e-3
