"""1-shot RLVR: the epoch of each statistics record, the historical variance ranking against a hand computation, and
the whole chain on the tiny model — a normal run, `or1-trl select-examples`, the 1-shot run with the recipe."""

import json
import math
import os
import statistics

import pytest
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.cli import main
from or1_trl.demos.tiny import addition_dataset
from or1_trl.data.one_shot import epoch_accuracies, rank_prompts, replicate, select_examples
from or1_trl.recipe.prompts import content_id
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import ROOT

RECIPE = os.path.join(ROOT, "examples", "recipes", "one_shot_rlvr.yaml")


def record(pid, epoch, samples, correct, stage=0, step=1):
    return {"prompt_id": pid, "stage": stage, "epoch": epoch, "step": step, "samples": samples, "correct": correct,
            "truncated": 0, "mean_length": 4.0}


def test_ranking_by_historical_variance_matches_a_hand_computation():
    records = [
        record("a", 0, 8, 2), record("b", 0, 8, 0), record("c", 0, 8, 8), record("d", 0, 4, 1),
        record("a", 1, 8, 6), record("b", 1, 8, 0), record("c", 1, 8, 8), record("d", 0, 4, 3),  # d twice in epoch 0
        record("b", 2, 8, 8), record("d", 1, 8, 0), record("e", 0, 8, 4),
        record("e", 0, 8, 0, stage=1),  # another stage: another epoch
    ]
    accuracies = epoch_accuracies(records)
    assert accuracies == {"a": [0.25, 0.75], "b": [0.0, 0.0, 1.0], "c": [1.0, 1.0], "d": [0.5, 0.0], "e": [0.5, 0.0]}
    ranking = rank_prompts(records)
    # population standard deviation, as np.std in the released data_selection.py
    expected = {"a": 0.25, "b": math.sqrt(((0 - 1 / 3) ** 2 * 2 + (1 - 1 / 3) ** 2) / 3), "c": 0.0, "d": 0.25, "e": 0.25}
    assert [r.prompt_id for r in ranking] == ["b", "a", "d", "e", "c"]  # ties keep the order of first appearance
    for r in ranking:
        assert r.score == pytest.approx(expected[r.prompt_id]) == pytest.approx(statistics.pstdev(accuracies[r.prompt_id]))


def test_replicate_cycles_the_chosen_rows_and_renames_the_id_column():
    dataset = Dataset.from_dict({"id": ["p0", "p1", "p2"], "prompt": ["x", "y", "z"], "answer": ["1", "2", "3"]})
    assert replicate(dataset, [2, 0], 5)["prompt"] == ["z", "x", "z", "x", "z"]
    ranking = rank_prompts([record("p1", 0, 4, 1), record("p1", 1, 4, 3), record("p2", 0, 4, 0)])
    out, chosen = select_examples(dataset, ranking, top=1, size=4)
    assert [r.prompt_id for r in chosen] == ["p1"] and out["prompt"] == ["y"] * 4 and out["source_id"] == ["p1"] * 4
    with pytest.raises(ValueError, match="--top 3: the statistics rank 2 prompts"):
        select_examples(dataset, ranking, top=3, size=4)
    with pytest.raises(ValueError, match=r"prompt id\(s\) \['p1'\] of the statistics are not in the dataset"):
        select_examples(dataset.remove_columns("id"), ranking, top=1, size=4)


@pytest.mark.parametrize("stages", [None, [{"until_step": 3, "batch_size": 2}, {"until_step": 5, "batch_size": 2}]])
def test_statistics_records_carry_the_epoch(tmp_path, stages):
    """4 prompts, 2 per rollout step: 2 steps per pass over the pool. TRL's sampler (no stages): epochs 0, 0, 1, 1, 2,
    every prompt once in each whole epoch. Our sampler (two stages, nothing filtered): the count restarts with stage 1
    at step 4."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    dataset = Dataset.from_dict({"prompt": [f"Q: {i}+1=? A:" for i in range(4)], "answer": ["1", "2", "3", "4"]})
    settings = dict(max_steps=5, max_completion_length=2, stages=stages, online_filter_threshold=None)
    args = OR1Config(**tiny_training_args(tmp_path, **settings))
    OR1Trainer(model, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=dataset,
               processing_class=tokenizer).train()
    records = [json.loads(line) for line in (tmp_path / "prompt_stats.jsonl").read_text().splitlines()]
    epochs = [0, 0, 1, 1, 2] if stages is None else [0, 0, 1, 0, 0]
    assert [(r["step"], r["epoch"]) for r in records] == [(step, epochs[step - 1]) for step in range(1, 6) for _ in "ab"]
    everyone = {content_id(p) for p in dataset["prompt"]}
    whole = [(0, 0), (0, 1)] if stages is None else [(0, 0), (1, 0)]  # (stage, epoch) sampled in full
    for stage, epoch in whole:
        assert sorted(r["prompt_id"] for r in records if (r["stage"], r["epoch"]) == (stage, epoch)) == sorted(everyone)


def recipe_on_cpu(model, data, out, steps):
    """The recipe's flags, shrunk to the tiny model on CPU: 3 prompts x 8 samples per step."""
    return ["train", "--config", RECIPE, "--model_name_or_path", model, "--dataset_name", str(data),
            "--output_dir", str(out), "--max_steps", str(steps), "--use_vllm", "false", "--bf16", "false",
            "--use_cpu", "true", "--dtype", "float32", "--gradient_checkpointing", "false",
            "--per_device_train_batch_size", "24", "--gradient_accumulation_steps", "1", "--max_completion_length", "8",
            "--learning_rate", "2e-4", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def test_one_shot_chain_normal_run_select_one_shot_run(tmp_path, answer_model_dir, capsys):
    """The tiny chat model of conftest (a short SFT on additions: some answers right, some wrong) on 6 addition
    prompts."""
    data = addition_dataset(6, seed=1, max_operand=9)
    pool = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in data["prompt"]],
                              "answer": data["answer"]})
    (tmp_path / "pool").mkdir()
    pool.to_json(tmp_path / "pool" / "train.jsonl")

    # 1. a normal run over the pool: 6 prompts, 3 per step, 6 steps = 3 epochs
    main(recipe_on_cpu(answer_model_dir, tmp_path / "pool", tmp_path / "normal", steps=6))
    records = [json.loads(line) for line in (tmp_path / "normal" / "prompt_stats.jsonl").read_text().splitlines()]
    assert sorted({r["epoch"] for r in records}) == [0, 1, 2] and len(records) == 18

    # the ranking, by hand: population std of each prompt's accuracy in each epoch
    per_epoch = {}
    for r in records:
        per_epoch.setdefault(r["prompt_id"], {})[r["epoch"]] = r["correct"] / r["samples"]
    scores = {pid: statistics.pstdev(list(accs.values())) for pid, accs in per_epoch.items()}
    best = max(scores.values())
    assert best > 0, "the answering model must give the prompts different accuracies across epochs"
    first_seen = list(dict.fromkeys(r["prompt_id"] for r in records))
    top = next(pid for pid in first_seen if scores[pid] == best)

    # 2. select the top prompt, replicated to 6 rows
    capsys.readouterr()
    main(["select-examples", "--stats", str(tmp_path / "normal" / "prompt_stats.jsonl"), "--dataset_name",
          str(tmp_path / "pool"), "--top", "1", "--replicate", "6", "--output_dir", str(tmp_path / "pi1")])
    printed = capsys.readouterr().out
    selection = json.loads((tmp_path / "pi1" / "selection.json").read_text())
    assert [c["prompt_id"] for c in selection["chosen"]] == [top]
    assert selection["chosen"][0]["score"] == pytest.approx(best)
    assert selection["chosen"][0]["accuracies"] == [per_epoch[top][e] for e in (0, 1, 2)]
    line = next(line for line in printed.splitlines() if top in line)
    assert line.split()[:3] == ["1", f"{best:.4f}", top] and line.split()[3:6] == [
        f"{per_epoch[top][e]:.2f}" for e in (0, 1, 2)]
    prompt = next(p for p in pool["prompt"] if content_id(p) == top)
    assert f"wrote 6 rows (1 prompt cycled) to {tmp_path / 'pi1' / 'data' / 'train-00000-of-00001.parquet'}" in printed

    # 3. the 1-shot run on the replicated example, with the recipe's loss: constant entropy bonus, no rejection
    main(recipe_on_cpu(answer_model_dir, tmp_path / "pi1", tmp_path / "one-shot", steps=2))
    one_shot = [json.loads(line) for line in (tmp_path / "one-shot" / "prompt_stats.jsonl").read_text().splitlines()]
    assert {r["prompt_id"] for r in one_shot} == {content_id(prompt)}
    assert [(r["step"], r["samples"]) for r in one_shot] == [(1, 8)] * 3 + [(2, 8)] * 3  # 3 copies x 8 samples a step
    state = json.loads((tmp_path / "one-shot" / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]  # `or1-trl train` prints a line a step
    assert len(logs) == 2 and all(entry["entropy/alpha"] == pytest.approx(0.001) for entry in logs)
    assert not any("rejection/kept_group_frac" in entry for entry in logs)
