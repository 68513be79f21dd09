"""The stages as OR1Trainer runs them (`trainer/stage_run.py`, paper §3.2.2), with the prompt pool (`recipe/prompts.py`,
its pure pieces: `tests/recipe/test_prompts.py`) and rejection's refills wired into it; the schedule's pure pieces:
`tests/recipe/test_stages.py`."""

import json
import os

import pytest
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import G, ScriptedReward, logged, tagged_dataset

TAGS = ["ALL", "MIX", "NONE", "MIX"] * 4  # 16 prompts
STAGES = [
    {"until_step": 3, "max_completion_length": 4, "batch_size": 2, "mini_batch_size": 2, "num_generations": 4},
    {"until_step": 6, "max_completion_length": 6, "batch_size": 2, "mini_batch_size": 2, "num_generations": 8,
     "learning_rate": 5e-4},
]


def two_stage_trainer(output_dir, tags=TAGS, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    settings = dict(
        learning_rate=1e-3, max_steps=-1, stages=STAGES, online_filter_unsolved_after=4,
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]},  # every completion runs to the stage's length
    )
    settings.update(overrides)
    args = OR1Config(**tiny_training_args(output_dir, **settings))
    return OR1Trainer(model, ScriptedReward(), args=args, train_dataset=tagged_dataset(tags), processing_class=tokenizer)


def stats_records(output_dir):
    with open(os.path.join(output_dir, "prompt_stats.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("two_stage")
    trainer = two_stage_trainer(output_dir)
    trainer.train()
    return trainer, output_dir


def test_two_stages_in_one_train_call(two_stage_run):
    trainer, output_dir = two_stage_run
    assert trainer.state.global_step == 6
    assert logged(trainer, "stage") == [0, 0, 0, 1, 1, 1]
    assert logged(trainer, "completions/max_length") == [4, 4, 4, 6, 6, 6]  # the stage's generation length
    assert logged(trainer, "learning_rate") == pytest.approx([1e-3] * 3 + [5e-4] * 3)
    records = stats_records(output_dir)
    assert sorted({r["step"] for r in records}) == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert r["samples"] == (G if r["stage"] == 0 else 8) and r["mean_length"] == (4 if r["stage"] == 0 else 6)
        assert r["stage"] == (0 if r["step"] <= 3 else 1)
        assert r["prompt"].split(":")[0] in {"ALL", "MIX", "NONE"}  # the prompt's text beside its id (issue 49)
        assert len([q for q in records if q["step"] == r["step"]]) == 2  # 2 prompts per rollout step
    # the stage boundary left a complete checkpoint the second stage started from
    assert os.path.exists(os.path.join(output_dir, "checkpoint-3", "or1_checkpoint.json"))


def test_online_filter_pool_matches_hand_computation(two_stage_run):
    trainer, output_dir = two_stage_run
    records = stats_records(output_dir)
    ids = trainer.prompt_schedule.ids
    first = {}
    for r in (r for r in records if r["stage"] == 0):
        total = first.setdefault(r["prompt_id"], [0, 0])
        total[0] += r["samples"]
        total[1] += r["correct"]
    solved = {pid for pid, (n, c) in first.items() if c == n}
    unsolved = {pid for pid, (n, c) in first.items() if c == 0 and n >= 4}
    assert solved and unsolved  # the filter really removes prompts here
    expected = [i for i, pid in enumerate(ids) if pid not in solved | unsolved]
    assert trainer.prompt_pool.active == expected
    assert {r["prompt_id"] for r in records if r["stage"] == 1} <= {ids[i] for i in expected}
    assert logged(trainer, "pool/size") == [16] * 3 + [len(expected)] * 3


def test_kill_in_stage_two_and_resume_matches_uninterrupted(tmp_path, monkeypatch, two_stage_run):
    """Killed at step 5 (stage 2) after checkpoint-4: resuming gives the uninterrupted run's metrics step for step, the
    same pool, controller and weights, and prompt_stats.jsonl without duplicated or missing steps."""
    full, full_dir = two_stage_run
    trainer = two_stage_trainer(tmp_path, save_strategy="steps", save_steps=2)
    original = OR1Trainer._record_prompt_stats

    def killed_at_step_5(self, rewards):
        original(self, rewards)  # the step's statistics reach the log first, as they would before a SIGKILL
        if self.state.global_step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(OR1Trainer, "_record_prompt_stats", killed_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    monkeypatch.undo()
    assert max(r["step"] for r in stats_records(tmp_path)) == 5  # logged after the last checkpoint (4)

    resumed = two_stage_trainer(tmp_path, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    for key in ("stage", "reward", "loss", "entropy", "entropy_coef", "pool/size", "completions/max_length", "learning_rate"):
        assert logged(resumed, key) == pytest.approx(logged(full, key), abs=1e-6), key
    assert resumed.prompt_pool.active == full.prompt_pool.active
    assert stats_records(tmp_path) == stats_records(full_dir)
    for (name, p), (_, q) in zip(resumed.model.named_parameters(), full.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6, msg=name)


def test_two_trainers_in_one_process_keep_their_patches_to_themselves(tmp_path):
    """Every process-wide change the trainer makes is scoped to one trainer (or one call): while trainer A runs its
    two stages (a stage end replaces A's `callback_handler.on_train_end`, `_save_checkpoint` holds A's
    `save_total_limit` back), trainer B, built beside it, keeps its own handler, args and accelerator, and TRL's
    module names are TRL's; A's handler and args are restored when it returns; then B trains and ends as usual."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import grpo_trainer
    from trl.trainer import utils as trl_utils

    a = two_stage_trainer(tmp_path / "a", save_total_limit=1)
    b = two_stage_trainer(tmp_path / "b", stages=None, max_steps=1)
    seen = []

    def handlers(trainer):  # is the trainer's `on_train_end` the class's own?
        return getattr(trainer.callback_handler.on_train_end, "__func__", None) is CallbackHandler.on_train_end

    class Observe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append({
                "a_handler_swapped": not handlers(a),
                "b_handler": handlers(b),
                "b_args": b.args.save_total_limit is None and b.args is not a.args,
                "b_gather": "gather" not in vars(b.accelerator) and "gather" not in vars(a.accelerator),
                "trl_names": grpo_trainer.VLLMGeneration is VLLMGeneration
                and trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction,
            })

    a.add_callback(Observe())
    a.train()
    assert len(seen) == 6 and all(step["b_handler"] and step["b_args"] and step["b_gather"] and step["trl_names"]
                                  for step in seen)
    assert [step["a_handler_swapped"] for step in seen] == [True] * 3 + [False] * 3  # only the non-final stage
    assert handlers(a) and a.args.save_total_limit == 1
    assert [d for d in os.listdir(tmp_path / "a") if d.startswith("checkpoint-")] == ["checkpoint-3"]  # stage end
    b.train()
    assert b.state.global_step == 1 and os.path.exists(tmp_path / "b" / "trainer_state.json")


def test_empty_pool_after_the_filter_is_a_clear_error(tmp_path):
    """4 prompts, all solved in every sample of stage 0 (each drawn there): the filter empties the pool."""
    with pytest.raises(ValueError, match=r"Stage 1: the online filter left 0 prompts in the pool, fewer than one batch "
                                         r"of 2 — 4 left for accuracy >= online_filter_threshold=1.0 in stage 0"):
        two_stage_trainer(tmp_path, tags=["ALL"] * 4).train()


def test_bad_stage_input_fails_before_the_model_loads(tmp_path):
    args = OR1Config(**tiny_training_args(tmp_path, stages=[{"until_step": 2, "batch_size": 3, "mini_batch_size": 3}]))
    with pytest.raises(ValueError, match=r"rows per optimizer step must be a multiple of"):
        OR1Trainer("/nonexistent/model", ScriptedReward(), args=args, train_dataset=tagged_dataset(TAGS))
    args = OR1Config(**tiny_training_args(tmp_path, stages=[{"until_step": 2, "batch_size": 32, "mini_batch_size": 32}],
                                          per_device_train_batch_size=8, num_generations=4))
    with pytest.raises(ValueError, match="holds 16 prompts, fewer than stage 0's batch of 32"):
        OR1Trainer("/nonexistent/model", ScriptedReward(), args=args, train_dataset=tagged_dataset(TAGS))
    with pytest.raises(ValueError, match="duplicate prompt id"):
        OR1Trainer("/nonexistent/model", ScriptedReward(), args=OR1Config(**tiny_training_args(tmp_path)),
                   train_dataset=tagged_dataset(TAGS[:4]).add_column("id", ["a", "b", "a", "c"]))
    with pytest.raises(ValueError, match="The last stage ends at step 2, before max_steps=5"):
        OR1Config(**tiny_training_args(tmp_path, stages=[{"until_step": 2}], max_steps=5))


def test_refill_fills_the_batch_with_informative_groups(tmp_path):
    """rejection_refill_rounds: when rejection keeps fewer than B groups, more rollout batches are drawn (at most N
    rounds) and their informative groups fill the batch; groups beyond B are discarded, never forwarded."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    reward = ScriptedReward()
    tags = ["ALL", "NONE", "ALL", "MIX"] * 4  # a quarter of the prompts is informative
    args = OR1Config(**tiny_training_args(tmp_path, max_steps=4, learning_rate=1e-3, rejection_refill_rounds=3))
    trainer = OR1Trainer(model, reward, args=args, train_dataset=tagged_dataset(tags), processing_class=tokenizer)
    trainer.train()
    B = 2  # prompts per rollout batch (8 rows / 4 samples)
    rounds, fills = logged(trainer, "refill/rounds"), logged(trainer, "refill/batch_fill")
    calls = iter(n // G for n in reward.informative_rows)  # informative groups of each generate call, in order
    forwarded = 0
    for step_rounds, fill in zip(rounds, fills):
        kept = next(calls)
        used = 0
        while used < 3 and kept < B:
            kept, used = kept + next(calls), used + 1
        assert step_rounds == used
        assert fill == min(kept, B) / B
        forwarded += min(kept, B) * G  # capped at the batch; an empty step runs no pass
    assert next(calls, None) is None  # every generate call is accounted for
    assert sum(rounds) > 0 and any(f == 1.0 for f in fills)
    assert trainer.or1_rows_forwarded == forwarded
    assert logged(trainer, "refill/generated_rows") == [r * B * G for r in rounds]
    records = stats_records(tmp_path)
    assert sum(r["samples"] for r in records) == (len(rounds) + sum(rounds)) * B * G  # refill rollouts are counted too


def test_a_tied_head_stays_tied_through_each_stage_reload_and_nothing_is_reported_missing(tmp_path, caplog):
    """Each stage resumes from the checkpoint that ended the previous one. A model whose head is its embeddings
    (SmolLM2's `tie_word_embeddings`) has the tensor saved once, so transformers reports `lm_head.weight` missing at
    every reload; `OR1Trainer` says nothing when the tie holds, and the head goes on being the embeddings."""
    from transformers.utils import logging as hf_logging

    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    embeddings_at_start = model.get_input_embeddings().weight.detach().clone()
    stages = [{**STAGES[0], "until_step": 1}, {**STAGES[1], "until_step": 2}]
    args = OR1Config(**tiny_training_args(tmp_path, learning_rate=1e-2, max_steps=-1, stages=stages))
    trainer = OR1Trainer(model, ScriptedReward(), args=args, train_dataset=tagged_dataset(["MIX"] * 16),
                         processing_class=tokenizer)  # every group informative: every step updates
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING", logger="transformers.trainer"):
            trainer.train()
    finally:
        hf_logging.disable_propagation()
    assert trainer.state.global_step == 2 and logged(trainer, "stage") == [0, 1]  # the second stage reloaded
    assert not [r for r in caplog.records if "missing keys" in r.getMessage()]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    head, embeddings = policy.get_output_embeddings().weight, policy.get_input_embeddings().weight
    assert head is embeddings  # still one tensor: the head moves with the embeddings
    assert not torch.equal(embeddings.detach(), embeddings_at_start)  # and they did move


def test_a_missing_weight_that_is_not_tied_is_still_reported():
    from torch.nn.modules.module import _IncompatibleKeys

    from or1_trl.trainer.checkpoint import without_tied_keys

    tied, _ = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    untied, _ = tiny_model_and_tokenizer(seed=0)
    result = _IncompatibleKeys(missing_keys=["lm_head.weight"], unexpected_keys=[])
    assert without_tied_keys(tied, result).missing_keys == []
    assert without_tied_keys(untied, result).missing_keys == ["lm_head.weight"]  # a separate tensor: really missing
    both = _IncompatibleKeys(missing_keys=["lm_head.weight", "model.embed_tokens.weight"], unexpected_keys=["x"])
    assert without_tied_keys(tied, both) == both  # neither name was loaded: the tensor is missing
