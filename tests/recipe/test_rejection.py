"""Rejection sampling as pure functions: group verdicts and batch compaction."""

import math

import pytest
import torch

from or1_trl.recipe.rejection import WEIGHT_KEY, compact_batch, group_outcomes, mask_batch


def test_group_outcomes_binary_and_constant():
    nan = math.nan
    rewards = torch.tensor(
        [1, 1, 1, 1,  # solve_all
         0, 0, 0, 0,  # solve_none
         0, 1, 0, 0,  # informative
         0.3, 0.3, 0.3, 0.3,  # constant, neither
         nan, 1, 1, nan,  # NaN ignored: constant 1 -> solve_all
         nan, 0, 1, nan,  # informative among the scored
         nan, nan, nan, nan]  # nothing scored: uninformative
    )
    out = group_outcomes(rewards, 4)
    assert out.keep.tolist() == [False, False, True, False, False, True, False]
    assert out.solve_all.tolist() == [True, False, False, False, True, False, False]
    assert out.solve_none.tolist() == [False, True, False, False, False, False, False]
    assert out.fractions() == pytest.approx({"kept_group_frac": 2 / 7, "solve_none_frac": 1 / 7, "solve_all_frac": 2 / 7})


def _batch(rows=6, t=3):
    return {
        "prompt_ids": torch.arange(rows * 2).view(rows, 2),
        "completion_ids": torch.arange(rows * t).view(rows, t),
        "completion_mask": torch.ones(rows, t, dtype=torch.long),
        "advantages": torch.arange(rows, dtype=torch.float),
        "num_items_in_batch": torch.tensor(rows * t),
        "names": [f"r{i}" for i in range(rows)],
        "absent": None,
    }


@pytest.mark.parametrize("keep,multiple_of,expected_rows", [
    ([1, 0, 1, 1, 0, 0], 2, 4),  # 3 kept -> padded to 4
    ([1, 1, 1, 1, 1, 1], 3, 6),  # nothing to drop, no padding
    ([0, 0, 0, 0, 0, 0], 2, 2),  # nothing kept -> one zero-weight row per micro-step
    ([0, 1, 0, 0, 0, 0], 4, 4),
])
def test_compact_batch(keep, multiple_of, expected_rows):
    keep = torch.tensor(keep, dtype=torch.bool)
    batch = _batch()
    out = compact_batch(batch, keep, multiple_of)
    n_kept = int(keep.sum())
    assert len(out["completion_ids"]) == expected_rows and len(out["names"]) == expected_rows
    assert out[WEIGHT_KEY].tolist() == [1.0] * n_kept + [0.0] * (expected_rows - n_kept)
    kept_idx = keep.nonzero().flatten().tolist()
    assert out["advantages"][:n_kept].tolist() == [float(i) for i in kept_idx]
    assert out["names"][:n_kept] == [f"r{i}" for i in kept_idx]
    # padding rows are copies of rejected rows when there are any
    if n_kept < len(keep):
        assert all(not keep[int(a)] for a in out["advantages"][n_kept:].tolist())
    assert out["num_items_in_batch"] is batch["num_items_in_batch"] and out["absent"] is None


def test_compact_rejects_rows_it_cannot_index():
    batch = {**_batch(), "pixel_values": torch.zeros(11, 3)}
    with pytest.raises(ValueError, match="rejection_sampling='mask'"):
        compact_batch(batch, torch.ones(6, dtype=torch.bool), 2)


def test_mask_batch_keeps_rows():
    keep = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    out = mask_batch(_batch(), keep)
    assert len(out["completion_ids"]) == 6 and out[WEIGHT_KEY].tolist() == keep.float().tolist()


def test_concat_batches_pads_prompts_left_and_completions_right():
    from or1_trl.recipe.rejection import concat_batches

    first = {"prompt_ids": torch.tensor([[5, 6, 7]]), "prompt_mask": torch.tensor([[1, 1, 1]]),
             "completion_ids": torch.tensor([[8, 9]]), "completion_mask": torch.tensor([[1, 1]]),
             "advantages": torch.tensor([0.5]), "num_items_in_batch": torch.tensor(2.0), "old_per_token_logps": None}
    second = {"prompt_ids": torch.tensor([[4]]), "prompt_mask": torch.tensor([[1]]),
              "completion_ids": torch.tensor([[1, 2, 3]]), "completion_mask": torch.tensor([[1, 1, 0]]),
              "advantages": torch.tensor([-0.5]), "num_items_in_batch": torch.tensor(2.0), "old_per_token_logps": None}
    out = concat_batches(first, second, pad_token_id=0)
    assert list(out) == list(first)  # TRL sizes a batch by its first entry: the order is kept
    assert out["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 4]] and out["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out["completion_ids"].tolist() == [[8, 9, 0], [1, 2, 3]] and out["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 0]]
    assert out["advantages"].tolist() == [0.5, -0.5] and out["old_per_token_logps"] is None
    with pytest.raises(ValueError, match="multimodal"):
        concat_batches({**first, "pixel_values": torch.zeros(1, 3)}, {**second, "pixel_values": torch.zeros(1, 3)}, 0)


def _rollout(rows, first, t=2):
    """This rank's part of a rollout batch: `rows` rows, their ids `first, first + 1, ...` in `completion_ids`."""
    ids = torch.arange(first, first + rows)
    return {"prompt_ids": ids[:, None], "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
            "completion_ids": ids[:, None].repeat(1, t), "completion_mask": torch.ones(rows, t, dtype=torch.long),
            "advantages": ids.float(), "num_items_in_batch": torch.tensor(rows * t)}


def test_reject_without_refill_is_outcomes_then_compaction():
    """2 ranks × 4 rows, G = 2: groups [informative, all 1 | all 0, informative]; rank 1 keeps its second group."""
    from or1_trl.recipe.rejection import reject

    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # [B*G] over both ranks
    out = reject(_rollout(4, 4), rewards, num_generations=2, mode="compact", rank=1, steps_per_generation=2,
                 pad_token_id=0)
    assert out.outcomes.keep.tolist() == [True, False, False, True]
    assert out.metrics == {"rejection/kept_group_frac": 0.5, "rejection/solve_none_frac": 0.25,
                           "rejection/solve_all_frac": 0.25}
    assert out.batch["advantages"].tolist() == [6.0, 7.0] and out.batch[WEIGHT_KEY].tolist() == [1.0, 1.0]
    masked = reject(_rollout(4, 0), rewards, 2, "mask", rank=0, steps_per_generation=2, pad_token_id=0)
    assert masked.batch[WEIGHT_KEY].tolist() == [1.0, 1.0, 0.0, 0.0] and len(masked.batch["advantages"]) == 4


def test_reject_refills_until_the_batch_is_full():
    """4 groups, 1 informative; each refill brings 4 groups: the first brings 1 informative, the second 3, of which
    only the first 2 fill the batch; then no third refill is asked for although 5 rounds are allowed."""
    from or1_trl.recipe.rejection import reject

    G = 2
    first = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # groups: all 1, informative, all 0, all 1
    refills = [torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]),  # informative: group 2
               torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])]  # informative: groups 0, 1, 3
    asked = []

    def more():
        asked.append(len(asked))
        return _rollout(8, 100 * len(asked)), refills[len(asked) - 1]

    out = reject(_rollout(8, 0), first, G, "compact", rank=0, steps_per_generation=2, pad_token_id=0,
                 refill_rounds=5, more=more)
    assert asked == [0, 1]
    # kept rows: group 1 of the rollout, group 2 of refill 1, groups 0 and 1 of refill 2
    assert out.batch["advantages"].tolist() == [2.0, 3.0, 104.0, 105.0, 200.0, 201.0, 202.0, 203.0]
    assert out.batch[WEIGHT_KEY].tolist() == [1.0] * 8
    assert out.outcomes.keep.tolist() == [False, True, False, False]  # the first rollout's verdicts
    assert out.metrics["rejection/kept_group_frac"] == 0.25
    assert (out.metrics["refill/rounds"], out.metrics["refill/generated_rows"], out.metrics["refill/batch_fill"]) == (
        2.0, 16.0, 1.0)
    # out of refills: the batch stays part-filled, and says so
    short = reject(_rollout(8, 0), first, G, "compact", rank=0, steps_per_generation=2, pad_token_id=0,
                   refill_rounds=1, more=lambda: (_rollout(8, 100), torch.zeros(8)))
    assert short.metrics["refill/batch_fill"] == 0.25 and short.batch[WEIGHT_KEY].tolist() == [1.0, 1.0]
