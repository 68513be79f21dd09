"""`or1-trl difficulty` (paper §6.2): counts of correct samples per prompt against a scripted generator (the real
math and code rewards score its outputs), resume without rework (generate calls counted), the released data's
layout for the counts, and the whole command on the tiny chat model."""

import json
import re

import pytest
from datasets import Dataset, load_dataset

from or1_trl.cli import main
from or1_trl.data.released import filter_by_difficulty, prompt_text
from or1_trl.demos.tiny import addition_dataset
from or1_trl.data.difficulty import estimate_difficulty
from or1_trl.rewards import CodeReward, MathReward
from or1_trl.rewards.sandbox import SandboxUnavailable
from or1_trl.generation.sampling import Completion
from tests.helpers import released_features, released_row

MATH_REWARD = MathReward(num_workers=0)  # in-process: the scripted answers are short


class ScriptedBackend:
    """A generator whose samples the test decides: `script[problem text]` is the list of completions of that prompt.
    `batch_size` prompts per `generate` step (one "call"); `fail_after` calls it raises KeyboardInterrupt (Ctrl-C)."""

    name = "scripted"

    def __init__(self, script, batch_size=2, fail_after=None):
        self.script, self.batch_size, self.fail_after = script, batch_size, fail_after
        self.calls = 0
        self.prompts_generated = []

    def generate(self, prompts, settings, seeds):
        for start in range(0, len(prompts), self.batch_size):
            if self.fail_after is not None and self.calls == self.fail_after:
                raise KeyboardInterrupt
            self.calls += 1
            batch = []
            for i in range(start, min(start + self.batch_size, len(prompts))):
                texts = self.script[prompt_text(prompts[i])]
                assert len(texts) == settings.n
                self.prompts_generated.append(prompt_text(prompts[i]))
                batch.append((i, [Completion(text, 3, truncated=False) for text in texts]))
            yield batch


def math_script(questions, golds, correct, n):
    """`correct[i]` of the n samples of question i answer its gold, the others a wrong number."""
    return {q: [f"<think>hm</think> \\boxed{{{g}}}"] * c + [f"\\boxed{{{int(g) + 1}}}"] * (n - c)
            for q, g, c in zip(questions, golds, correct)}


QUESTIONS = [f"What is {i}+{i}?" for i in range(7)]
GOLDS = [str(2 * i) for i in range(7)]
CORRECT = [0, 3, 16, 15, 1, 8, 16]  # correct of 16: one at 0/16, two at 16/16, four kept


def released_math():
    rows = [released_row(q, [g], "math", i, difficulty={"7B": 5}) for i, (q, g) in enumerate(zip(QUESTIONS, GOLDS))]
    return Dataset.from_list(rows, features=released_features())


def test_counts_match_the_script_and_go_where_the_released_data_keeps_them(tmp_path):
    backend = ScriptedBackend(math_script(QUESTIONS, GOLDS, CORRECT, 16))
    result = estimate_difficulty(released_math(), backend, "my-model", str(tmp_path), rewards={"math": MATH_REWARD},
                                 progress=False)
    assert result.counts == CORRECT and result.samples == [16] * 7
    assert result.kept_rows() == [1, 3, 4, 5]  # 1..15 of 16
    assert result.summary().splitlines() == [
        "my-model: correct samples per prompt",
        "  math: 7 prompts x 16 samples: 1 at 0/16, 2 at 16/16, 4 kept (1..15)",
        "  kept 4 of 7 prompts"]
    counts = [row["model_difficulty"] for row in result.dataset["extra_info"]]
    assert counts[1] == {"DeepSeek-R1-Distill-Qwen-1.5B": None, "DeepSeek-R1-Distill-Qwen-32B": None,
                         "DeepSeek-R1-Distill-Qwen-7B": 5, "my-model": 3}  # the released counts stay
    assert [c["my-model"] for c in counts] == CORRECT
    kept, _ = filter_by_difficulty(result.dataset, "my-model", 1, 15)  # what `train --difficulty_model` does
    assert [p[0]["content"] for p in kept["prompt"]] == [QUESTIONS[i] for i in (1, 3, 4, 5)]
    records = [json.loads(line) for line in (tmp_path / "samples-math.jsonl").read_text().splitlines()]
    assert [sum(r["rewards"]) for r in records] == CORRECT and all(r["sampling"]["n"] == 16 for r in records)


def test_interrupted_run_resumes_without_redoing_finished_prompts(tmp_path):
    script = math_script(QUESTIONS, GOLDS, CORRECT, 16)
    full = estimate_difficulty(released_math(), ScriptedBackend(script), "m", str(tmp_path / "full"),
                               rewards={"math": MATH_REWARD}, progress=False)
    crashing = ScriptedBackend(script, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        estimate_difficulty(released_math(), crashing, "m", str(tmp_path / "resumed"), rewards={"math": MATH_REWARD},
                            progress=False)
    store = (tmp_path / "resumed" / "samples-math.jsonl").read_text().splitlines()
    assert len(store) == 4  # two calls of 2 prompts finished and were written
    again = ScriptedBackend(script)
    resumed = estimate_difficulty(released_math(), again, "m", str(tmp_path / "resumed"),
                                  rewards={"math": MATH_REWARD}, progress=False)
    assert again.calls == 2 and again.prompts_generated == QUESTIONS[4:]  # 3 prompts left: calls of 2 and 1
    assert resumed.counts == full.counts and resumed.dataset.to_list() == full.dataset.to_list()
    done = ScriptedBackend(script)
    estimate_difficulty(released_math(), done, "m", str(tmp_path / "resumed"), rewards={"math": MATH_REWARD},
                        progress=False)
    assert done.calls == 0


def test_code_prompts_get_8_samples_scored_in_the_sandbox(tmp_path, sandbox_missing):
    code_reward = CodeReward(timeout_per_test=5, num_workers=2)
    try:
        code_reward.sandbox
    except SandboxUnavailable as exc:
        sandbox_missing(str(exc))
    tests = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\nprint(3)\n```"
    rows = [released_row("Add two numbers.", tests, "code", 0), released_row("Add them again.", tests, "code", 1),
            released_row("What is 1+1?", ["2"], "math", 2)]
    script = {"Add two numbers.": [right] * 5 + [wrong] * 3, "Add them again.": [right] * 8,
              "What is 1+1?": ["\\boxed{2}"] * 2 + ["\\boxed{3}"] * 14}
    result = estimate_difficulty(Dataset.from_list(rows, features=released_features()), ScriptedBackend(script), "m",
                                 str(tmp_path), rewards={"math": MATH_REWARD, "code": code_reward}, progress=False)
    assert result.counts == [5, 8, 2] and result.samples == [8, 8, 16] and result.kept_rows() == [0, 2]
    assert "  code: 2 prompts x 8 samples: 0 at 0/8, 1 at 8/8, 1 kept (1..7)" in result.summary()


def test_difficulty_command_on_the_tiny_chat_model(tmp_path, answer_model_dir, capsys):
    """The command end to end: HF generate on the tiny chat model, counts checked by hand from the stored samples."""
    data = addition_dataset(6, seed=3, max_operand=9)
    (tmp_path / "data").mkdir()
    Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in data["prompt"]],
                       "answer": data["answer"]}).to_json(tmp_path / "data" / "train.jsonl")
    out = tmp_path / "out"
    argv = ["difficulty", "--dataset_name", str(tmp_path / "data"), "--model", answer_model_dir,
            "--output_dir", str(out), "--n_math", "4", "--max_tokens", "8", "--batch_size", "24",
            "--model_name", "tiny"]
    main(argv)
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in (out / "samples-math.jsonl").read_text().splitlines()]
    by_hand = []
    for record, gold in zip(records, data["answer"]):
        by_hand.append(sum(re.fullmatch(r"\s*\\boxed\{(\d+)\}", text) is not None
                           and re.fullmatch(r"\s*\\boxed\{(\d+)\}", text).group(1) == gold
                           for text in record["completions"]))
    assert [r["rewards"].count(1.0) for r in records] == by_hand
    kept = load_dataset(str(out), split="train")
    assert [e["model_difficulty"]["tiny"] for e in kept["extra_info"]] == [c for c in by_hand if 1 <= c <= 3]
    none, every = by_hand.count(0), by_hand.count(4)
    assert f"  math: 6 prompts x 4 samples: {none} at 0/4, {every} at 4/4, {6 - none - every} kept (1..3)" in printed
    main(argv)  # again: everything is in the store, nothing is generated
    assert "wrote" in capsys.readouterr().out


def test_difficulty_usage_errors(capsys, tmp_path):
    for argv, message in (
        (["--dataset_name", "x", "--output_dir", str(tmp_path)], "give --model (sampled in this process) or --server_url"),
        (["--dataset_name", "x", "--output_dir", str(tmp_path), "--model", "./nowhere"], "model path './nowhere' does"),
        (["--dataset_name", "x", "--output_dir", str(tmp_path), "--model", "m", "--n_math", "0"],
         "--n_math must be at least 1"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["difficulty", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    data = tmp_path / "bad"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"prompt": "q", "answer": ""}) + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["difficulty", "--dataset_name", str(data), "--output_dir", str(tmp_path / "o"), "--model", str(data)])
    assert exc.value.code == 2 and "1 of 1 rows cannot be scored: 1 no gold answer" in capsys.readouterr().err
