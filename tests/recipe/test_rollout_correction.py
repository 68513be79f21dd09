"""Rollout correction (`or1_trl/recipe/rollout_correction.py`): the weights against plain-Python references of their formulas,
the length-independence of the geometric mask against TRL's sum, the diagnostics and their warning, and, on a real
bf16 vLLM CPU server against the fp32 trainer, the hook that replaces TRL's ratio and logs the diagnostics."""

import math
from collections import defaultdict

import pytest
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.recipe import rollout_correction as rc
from or1_trl.recipe.rejection import WEIGHT_KEY, compact_batch
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import fixed_batch, reference_logps_entropy
from ..helpers import ScriptedReward, logged, tagged_dataset


def _batch(rows=6, width=9, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(rows, width, generator=g) * 3  # [B, T]
    rollout = trainer - spread * torch.randn(rows, width, generator=g)
    lengths = torch.tensor([9, 4, 1, 7, 9, 2][:rows])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rollout[1, 2] = float("nan")  # a token vLLM could not score: ratio 1
    return trainer, rollout, mask


def _reference(trainer, rollout, mask, mode, cap):
    """Plain Python, row by row, from the module's table."""
    out = []
    for a, b, m in zip(trainer.tolist(), rollout.tolist(), mask.tolist()):
        logs = [(x - y) if (k and not math.isnan(y)) else 0.0 for x, y, k in zip(a, b, m)]
        n = sum(m)
        keep = mode != "geo_mask_token_truncate" or n == 0 or 1 / cap <= math.exp(sum(logs) / n) <= cap
        out.append([min(math.exp(v), cap) * keep for v in logs])
    return torch.tensor(out)


@pytest.mark.parametrize("mode", ["token_truncate", "geo_mask_token_truncate"])
@pytest.mark.parametrize("cap", [1.2, 2.0])
def test_weights_match_plain_reference(mode, cap):
    trainer, rollout, mask = _batch()
    weights = rc.correction_weights(trainer, rollout, mask, mode, cap)
    torch.testing.assert_close(weights, _reference(trainer, rollout, mask, mode, cap), rtol=1e-6, atol=1e-7)
    assert weights.max() == cap  # the cap binds somewhere
    if mode == "geo_mask_token_truncate" and cap == 1.2:
        masked = (weights == 0).all(dim=1)
        assert 0 < masked.sum() < len(masked)  # some sequences masked, not all
    assert torch.equal(rc.correction_weights(trainer, rollout, mask, "off", cap), torch.ones_like(mask))


def test_geometric_mask_is_length_independent_and_trls_sum_is_not():
    """The same per-token ratios repeated to twice the length: the geometric mean is unchanged, so is the decision;
    TRL's sequence ratio exp(Σ) squares, and its decision flips (kept at n tokens, masked at 2n)."""
    logs = torch.tensor([0.30, -0.05, 0.25, 0.10, 0.40])  # Σ = 1.0: exp 2.72 ≤ 3 kept by TRL; 2n: exp 7.39 > 3
    trainer_one, trainer_two = torch.zeros(1, 5), torch.zeros(1, 10)
    rollout_one, rollout_two = -logs[None], -logs.repeat(2)[None]  # log r_t = trainer − rollout = logs
    one, two = torch.ones(1, 5), torch.ones(1, 10)
    for cap in (1.2, 2.0):  # geometric mean exp(0.2) = 1.22: masked at c = 1.2, kept at c = 2, at both lengths
        short = rc.correction_weights(trainer_one, rollout_one, one, "geo_mask_token_truncate", cap)
        long = rc.correction_weights(trainer_two, rollout_two, two, "geo_mask_token_truncate", cap)
        assert bool((short == 0).all()) == bool((long == 0).all()) == (cap == 1.2)
    # TRL's semantics (grpo_trainer.py, sequence_mask): ratio = exp(Σ_t log r_t), 0 outside [clip_min, clip_max]
    def trl_reference(total, clip_max=3.0):
        ratio = math.exp(total)
        return 0.0 if ratio > clip_max else ratio

    assert trl_reference(logs.sum().item()) > 0 and trl_reference(2 * logs.sum().item()) == 0
    assert rc.trl_weights(trainer_one, rollout_one, one).item() == pytest.approx(trl_reference(logs.sum().item()))
    assert rc.trl_weights(trainer_two, rollout_two, two).item() == 0.0


def test_trl_weights_follow_trls_four_modes():
    trainer, rollout, mask = _batch()
    logs = torch.nan_to_num((trainer - rollout) * mask, nan=0.0)
    seq = torch.exp(logs.sum(-1, keepdim=True))
    tok = torch.exp(logs)
    cases = {
        ("sequence_mask", 0.5, 3.0): torch.where((seq < 0.5) | (seq > 3.0), 0.0, seq),
        ("sequence_truncate", 0.5, 3.0): seq.clamp(0.5, 3.0),
        ("token_mask", None, 1.5): torch.where(tok > 1.5, 0.0, tok),
        ("token_truncate", None, 1.5): tok.clamp(max=1.5),
    }
    for (mode, low, high), expected in cases.items():
        torch.testing.assert_close(rc.trl_weights(trainer, rollout, mask, mode, low, high), expected)


def test_summary_by_length_quartile_against_a_count():
    # 8 rows: lengths 1..8 (q1 = lengths 1-2 ... q4 = 7-8); rows 7 and 8 masked; log-ratio per token = row index / 100
    lengths = torch.arange(1, 9)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()  # [8, 8]
    weights = torch.ones(8, 8)
    weights[6:] = 0.0
    log_ratios = (torch.arange(8).float()[:, None] / 100).expand(8, 8) * mask
    out = rc.summarise(rc.row_stats(weights, log_ratios, mask))
    assert out["rollout_correction/masked_frac"] == 0.25
    assert [out[f"rollout_correction/masked_frac_q{q}"] for q in range(1, 5)] == [0.0, 0.0, 0.0, 1.0]
    assert out["rollout_correction/log_ratio_q1"] == pytest.approx((0 * 1 + 0.01 * 2) / 3)
    assert out["rollout_correction/log_ratio_q4"] == pytest.approx((0.06 * 7 + 0.07 * 8) / 15)
    assert out["rollout_correction/log_ratio"] == pytest.approx(sum(i / 100 * (i + 1) for i in range(8)) / 36)
    # TRL's sequence modes give [B, 1] weights: the same rows are masked
    assert rc.summarise(rc.row_stats(weights[:, :1], log_ratios, mask)) == out


def test_watch_warns_once_with_the_remedy():
    watch = rc.MismatchWatch("trl", 2.0)
    calm = {"rollout_correction/masked_frac": 0.05, "rollout_correction/masked_frac_q1": 0.04,
            "rollout_correction/masked_frac_q4": 0.1}
    assert watch.observe(calm) == []  # q4 ≤ 3 × q1 and ≤ 20% overall
    long = {**calm, "rollout_correction/masked_frac_q4": 0.13}
    (message,) = watch.observe(long)
    assert "longest 13%" in message and "rollout_correction='geo_mask_token_truncate'" in message and "--dtype" in message
    assert watch.observe(long) == []  # once per run
    overall = rc.MismatchWatch("geo_mask_token_truncate", 2.0)
    assert overall.observe({**calm, "rollout_correction/masked_frac": 0.21})
    assert not rc.MismatchWatch("off", 2.0).observe({"rollout_correction/masked_frac": math.nan})


def test_replaced_ratio_goes_through_compaction_like_trls():
    """The hook replaces TRL's ratio `[b, T]` before rejection: compaction keeps and pads its rows like any other."""
    trainer, rollout, mask = _batch()
    batch = {"completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
             "old_per_token_logps": trainer, "sampling_per_token_logps": rollout,
             "importance_sampling_ratio": torch.ones(len(mask), 1)}
    metrics = defaultdict(list, {key: [0.5] for key in rc.TRL_RATIO_KEYS})  # what TRL logged for its own ratio
    correction = rc.RolloutCorrection("geo_mask_token_truncate", 1.2)
    (warning,) = correction.apply(batch, lambda t: t, metrics)  # half the rows masked: over 20%
    assert warning.startswith("Rollout correction: 50% of this rollout's completions got weight 0")
    expected = rc.correction_weights(trainer, rollout, mask, "geo_mask_token_truncate", 1.2)
    assert torch.equal(batch["importance_sampling_ratio"], expected)
    on_tokens = expected[mask.bool()]
    (low,), (mean,), (high,) = (metrics[key] for key in rc.TRL_RATIO_KEYS)  # TRL's entries replaced, not added
    assert (low, high) == (on_tokens.min().item(), on_tokens.max().item()) == (0.0, pytest.approx(1.2))
    assert mean == pytest.approx(on_tokens.mean().item())
    assert metrics["rollout_correction/masked_frac"] == [pytest.approx(float((expected == 0).all(dim=1).sum()) / 6)]
    keep = torch.tensor([False, True, False, True, True, False])
    compacted = compact_batch(batch, keep, multiple_of=4)
    assert torch.equal(compacted["importance_sampling_ratio"][:3], expected[keep])
    assert compacted[WEIGHT_KEY].tolist() == [1, 1, 1, 0]


def test_config_sets_trls_fields_and_refuses_unknown_modes(tmp_path):
    args = OR1Config(output_dir=str(tmp_path))
    assert args.rollout_correction == "geo_mask_token_truncate" and args.rollout_correction_cap == 2.0
    assert (args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) == (True, "token_truncate", None, 2.0)
    assert not OR1Config(output_dir=str(tmp_path), rollout_correction="off").vllm_importance_sampling_correction
    trl = OR1Config(output_dir=str(tmp_path), rollout_correction="trl", vllm_importance_sampling_mode="token_mask")
    assert trl.vllm_importance_sampling_mode == "token_mask"  # as the user set it
    with pytest.warns(UserWarning, match="vllm_importance_sampling_mode='token_mask' is replaced by rollout_correction"):
        OR1Config(output_dir=str(tmp_path), vllm_importance_sampling_mode="token_mask")
    with pytest.raises(ValueError, match=r"rollout_correction='seq' is not one of \['off', 'token_truncate'"):
        OR1Config(output_dir=str(tmp_path), rollout_correction="seq")
    with pytest.raises(ValueError, match="rollout_correction_cap=1.0 must be > 1"):
        OR1Config(output_dir=str(tmp_path), rollout_correction_cap=1.0)
    from or1_trl.eval.model_card import or1_settings  # the model card says which correction a vLLM run used

    card = dict(or1_settings(OR1Config(output_dir=str(tmp_path), use_vllm=True)))
    assert card["rollout correction (vLLM)"] == "`geo_mask_token_truncate`, cap 2"
    assert dict(or1_settings(OR1Config(output_dir=str(tmp_path), use_vllm=True, rollout_correction="trl"))
                )["rollout correction (vLLM)"] == "TRL's: `sequence_mask`, clip [—, 3]"
    assert "rollout correction (vLLM)" not in dict(or1_settings(args))  # no vLLM: no correction


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
