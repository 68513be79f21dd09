"""Rollout correction (`or1_trl/recipe/rollout_correction.py`): the weights against plain-Python references of their
formulas, the length-independence of the geometric mask against TRL's sum, the diagnostics and their warning. On a
real bf16 vLLM CPU server against the fp32 trainer, the hook that replaces TRL's ratio:
`tests/trainer/test_rollout_correction_server.py`."""

import math
from collections import defaultdict

import pytest
import torch

from or1_trl import OR1Config
from or1_trl.recipe import rollout_correction as rc
from or1_trl.recipe.rejection import WEIGHT_KEY, compact_batch


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
