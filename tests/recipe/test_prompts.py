"""The prompt pool and its statistics (`recipe/prompts.py`, paper §3.1's online filter and the rejection refill) as pure
pieces: prompt ids, the filter from statistics, per-prompt outcomes, the sampler's layout, the statistics log, and
`PromptSchedule`. Wired into `OR1Trainer`: `test_stages.py`."""

import json
import os

import pytest
from datasets import Dataset

from or1_trl.recipe.prompts import (PROMPT_PREVIEW, Outcome, PromptPool, PromptSampler, PromptSchedule, PromptStats,
                                    StatsLog, batch_outcomes, content_id, prompt_ids, prompt_preview)


def test_prompt_ids_from_column_or_content():
    ds = Dataset.from_dict({"prompt": ["a", "b", "a"], "id": ["x", "y", "z"]})
    assert prompt_ids(ds) == ["x", "y", "z"]
    shared = prompt_ids(ds, "uid")  # no such column: content hashes; identical prompts share their id
    assert shared[0] == shared[2] == content_id("a") != shared[1]
    assert content_id([{"role": "user", "content": "a"}]) == content_id([{"content": "a", "role": "user"}])
    with pytest.raises(ValueError, match=r"1 duplicate prompt id\(s\) in column 'id': 'x' \(rows 0 and 2\)"):
        prompt_ids(Dataset.from_dict({"prompt": ["a", "b", "c"], "id": ["x", "y", "x"]}))


def test_online_filter_from_statistics():
    ids = ["p0", "p1", "p2", "p3", "p4"]
    stats = PromptStats()
    stats.add(0, "p0", Outcome(samples=4, correct=4))  # mastered in stage 0: leaves
    stats.add(0, "p1", Outcome(samples=4, correct=3))  # 0.75: stays
    stats.add(0, "p2", Outcome(samples=4, correct=0))  # never solved in 4 samples
    stats.add(0, "p3", Outcome(samples=2, correct=0))  # never solved, only 2 samples
    pool = PromptPool(ids)
    assert pool.apply_online_filter(stats, 1, threshold=1.0, unsolved_after=4) == {"solved": 1, "unsolved": 1}
    assert [ids[i] for i in pool.active] == ["p1", "p3", "p4"] and pool.stage == 1
    assert pool.removed == {"p0": {"stage": 1, "reason": "solved"}, "p2": {"stage": 1, "reason": "unsolved"}}
    stats.add(1, "p1", Outcome(samples=8, correct=6))  # 0.75 ≥ 0.7
    stats.add(1, "p3", Outcome(samples=8, correct=0))  # now 10 samples, never solved
    assert pool.apply_online_filter(stats, 2, threshold=0.7, unsolved_after=None) == {"solved": 1, "unsolved": 0}
    assert [ids[i] for i in pool.active] == ["p3", "p4"]
    restored = PromptPool(ids)
    restored.load_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert (restored.active, restored.removed, restored.stage) == (pool.active, pool.removed, pool.stage)
    again = PromptStats()
    again.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    assert again.total("p3") == Outcome(samples=10, correct=0) and again.stage(1)["p1"].accuracy == 0.75


def test_batch_outcomes_count_per_prompt():
    out = batch_outcomes([3, 3, 3, 5, 5, 5], [1.0, 0.0, 1.0, 0.5, float("nan"), 1.2], [0, 1, 0, 1, 1, 0], [4, 6, 2, 6, 6, 3])
    assert out == {3: Outcome(3, 2, 1, 12), 5: Outcome(3, 1, 2, 15)}


def test_sampler_layout_pool_only_and_resumable():
    pool = [1, 4, 6, 9, 11, 12, 15]
    sampler = PromptSampler(pool, batch_size=3, num_generations=2, repeat_count=2, seed=0)
    stream = iter(sampler)
    first = [next(stream) for _ in range(12)]
    prompts = first[::2][:3]
    assert first == [p for p in prompts for _ in range(2)] * 2  # G in a row, the batch repeated for its micro-steps
    assert set(prompts) <= set(pool) and len(set(prompts)) == 3
    assert prompts == sampler.batch(0)
    # one pass = 2 full batches (7 // 3); the last incomplete batch is dropped, and pass 2 is a new permutation
    assert len(set(sampler.batch(0) + sampler.batch(1))) == 6
    assert sampler.batch(2) != sampler.batch(0) or sampler.batch(3) != sampler.batch(1)
    assert len(sampler) == 2 * 3 * 2 * 2
    resumed = PromptSampler(pool, batch_size=3, num_generations=2, repeat_count=2, seed=0, consumed=5)
    assert next(iter(resumed)) == sampler.batch(5)[0]
    other_stage = PromptSampler(pool, batch_size=3, num_generations=2, repeat_count=2, seed=0, stage=1)
    assert [other_stage.batch(k) for k in range(4)] != [sampler.batch(k) for k in range(4)]
    with pytest.raises(ValueError, match="holds 2 prompts, fewer than one batch of 3"):
        PromptSampler([1, 2], batch_size=3, num_generations=2, repeat_count=1, seed=0)


def test_stats_log_appends_and_truncates(tmp_path):
    log = StatsLog(str(tmp_path / "prompt_stats.jsonl"))
    log.append([{"step": 1}, {"step": 1}])
    size = log.size
    log.append([{"step": 2}])
    log.truncate(size)
    log.append([{"step": 2, "again": True}])
    lines = [json.loads(line) for line in open(log.path)]
    assert lines == [{"step": 1}, {"step": 1}, {"step": 2, "again": True}]


def _rows(indices, group, correct, truncated=0, length=5):
    """`[N, 3]` rows and `[N]` rewards of a rollout: each prompt `group` times, `correct[i]` of them with reward 1."""
    rows, rewards = [], []
    for index, hits in zip(indices, correct):
        rows += [[index, int(k < truncated), length] for k in range(group)]
        rewards += [1.0] * hits + [0.0] * (group - hits)
    return rows, rewards


def test_prompt_schedule_records_epochs_and_counts_batches(tmp_path):
    """6 prompts, 2 per rollout batch: 3 batches per pass, so batch k belongs to epoch k // 3; a refill counts in the
    epoch of the rollout it refills and draws nothing from the data loader's position."""
    schedule = PromptSchedule([f"p{i}" for i in range(6)], seed=0, log_path=str(tmp_path / "stats.jsonl"))
    sampler = schedule.new_sampler(stage=0, batch_size=2, num_generations=2, repeat_count=1)
    epochs = []
    for k in range(4):
        rows, rewards = _rows(sampler.batch(k), 2, [2, 1], truncated=1)
        epochs.append({r["epoch"] for r in schedule.record(0, k + 1, rows, rewards, prompts_per_batch=2)})
        if k == 2:  # a refill of batch 2 (the third, epoch 0): no position advance
            refill = schedule.record(0, k + 1, *_rows([5], 2, [0]), prompts_per_batch=2, refill=True)
            assert [r["epoch"] for r in refill] == [0] and schedule.position["consumed"] == 3
    assert epochs == [{0}, {0}, {0}, {1}]
    assert schedule.position["consumed"] == 4 and sampler.consumed == 4  # the sampler follows the position
    first = sampler.batch(0)
    assert schedule.stats.stage(0)[f"p{first[0]}"].correct >= 2 and schedule.stats.stage(0)[f"p{first[1]}"].samples >= 2
    records = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    assert len(records) == 4 * 2 + 1
    assert records[0] == {"prompt_id": f"p{first[0]}", "stage": 0, "epoch": 0, "step": 1, "samples": 2, "correct": 2,
                          "truncated": 1, "mean_length": 5.0}
    # Given the prompts' texts (as `PromptSchedule.over` gives them), each record carries its prompt's preview.
    named = PromptSchedule(["a", "b"], seed=0, log_path=str(tmp_path / "named.jsonl"), texts=["What is 2+2?", "x"])
    assert [r["prompt"] for r in named.record(0, 1, *_rows([1, 0], 2, [1, 0]), prompts_per_batch=2)] == ["x",
                                                                                                      "What is 2+2?"]
    quiet = PromptSchedule(["a", "b"], seed=0, log_path=str(tmp_path / "other.jsonl"))
    quiet.record(0, 1, *_rows([0], 2, [1]), prompts_per_batch=1, write_log=False)  # not the main process
    assert not os.path.exists(tmp_path / "other.jsonl") and quiet.stats.stage(0)["a"].samples == 2


def test_prompt_schedule_stage_entry_filters_and_refuses_an_empty_pool(tmp_path):
    """Stage entry applies the online filter (and says so), restarts the position; a pool below one batch is the
    error naming both reasons' counts."""
    ids = ["solved", "mixed", "never", "also"]
    schedule = PromptSchedule(ids, seed=0, log_path=str(tmp_path / "s.jsonl"))
    schedule.record(0, 1, *_rows([0, 1, 2, 3], 4, [4, 2, 0, 1]), prompts_per_batch=4)
    messages = []
    schedule.enter_stage(1, start_step=3, batch_size=2, threshold=1.0, unsolved_after=4, warn=messages.append)
    assert schedule.pool.active == [1, 3] and schedule.position == {"stage": 1, "consumed": 0, "refill": 0}
    assert messages == ["Stage 1 starts at step 3: the online filter removed 1 solved and 1 never-solved prompts; "
                        "pool: 2 rows."]
    schedule.enter_stage(1, start_step=3, batch_size=2, threshold=1.0, unsolved_after=4, warn=messages.append)
    assert len(messages) == 1  # already in stage 1: nothing happens
    schedule.record(1, 4, *_rows([1, 3], 2, [2, 2]), prompts_per_batch=2)
    with pytest.raises(ValueError, match=r"Stage 2: the online filter left 0 prompts in the pool, fewer than one batch "
                                         r"of 2 — 2 left for accuracy >= online_filter_threshold=1.0 in stage 1, 0 for"):
        schedule.enter_stage(2, start_step=6, batch_size=2, threshold=1.0, unsolved_after=4)


def test_prompt_schedule_refill_stream_and_state_round_trip(tmp_path):
    """Refill batches come from their own stream (seed + 1, each prompt G times), resumed from a saved state; the
    state restores pool, position and statistics and truncates the log back to the checkpoint."""
    ids = [f"p{i}" for i in range(8)]
    schedule = PromptSchedule(ids, seed=3, log_path=str(tmp_path / "s.jsonl"))
    stream = PromptSampler(list(range(8)), 2, 3, 1, seed=4)
    first = schedule.refill_rows(stage=0, num_groups=2, num_generations=3)
    assert first == [i for i in stream.batch(0) for _ in range(3)] and schedule.position["refill"] == 1
    schedule.record(0, 1, *_rows(stream.batch(0), 3, [1, 3]), prompts_per_batch=2)
    state = json.loads(json.dumps(schedule.state()))  # as checkpoint files hold it
    assert set(state) == set(PromptSchedule.STATE_FILES)
    schedule.record(0, 2, *_rows([5], 3, [0]), prompts_per_batch=2)  # logged after the checkpoint
    second = schedule.refill_rows(stage=0, num_groups=2, num_generations=3)

    resumed = PromptSchedule(ids, seed=3, log_path=str(tmp_path / "s.jsonl"))
    resumed.load_state(state)
    assert resumed.refill_rows(stage=0, num_groups=2, num_generations=3) == second
    assert resumed.position["consumed"] == 1 and resumed.stats.state_dict() == state[PromptSchedule.STATE_FILES[1]]
    assert [json.loads(line)["step"] for line in open(tmp_path / "s.jsonl")] == [1, 1]  # step 2 dropped


# ------------------------------------------------------------------------------------------------------------
# Through the trainer
# ------------------------------------------------------------------------------------------------------------


def test_a_prompt_preview_is_the_text_a_user_recognises():
    assert prompt_preview("  What   is\n 2+2?  ") == "What is 2+2?"
    conversation = [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": "Solve x+1=3."}]
    assert prompt_preview(conversation) == "Solve x+1=3."  # the user's turn, not the system prompt
    assert prompt_preview([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}]) == "Count."
    long = "a" * 300
    assert prompt_preview(long) == "a" * (PROMPT_PREVIEW - 1) + "…" and len(prompt_preview(long)) == PROMPT_PREVIEW
