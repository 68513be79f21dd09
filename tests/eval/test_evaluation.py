"""`or1-trl eval` (`or1_trl/eval/evaluation.py`): the metrics against hand computations, the intervals, the command
end to end on the tiny answer model (conftest `answer_model_dir`) with a local 10-problem file, resume, bad input."""

import itertools
import json
import math
import os
import re

import numpy as np
import pytest

from or1_trl.cli import main
from or1_trl.demos.tiny import addition_dataset
from or1_trl.eval.evaluation import (
    SUMMARY_JSON,
    SUMMARY_MD,
    Problem,
    bootstrap_intervals,
    check_ks,
    default_ks,
    evaluate,
    majority_correct,
    pass_at_k,
    per_problem_scores,
    sampling_standard_error,
    summarize,
)
from or1_trl.rewards import MathReward
from or1_trl.generation.sampling import HFBackend, SamplingSettings


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of k-subsets of the n samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 3, 2), (4, 4, 4), (5, 2, 3), (6, 1, 4)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one(n, c, k):
    correct = [True] * c + [False] * (n - c)
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(correct, k))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_ks_majority_and_sampling_error_by_hand():
    assert default_ks(1) == [1] and default_ks(4) == [1, 2, 4] and default_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match=r"k=\[8\] with n=4"):
        check_ks([1, 8], 4)
    assert majority_correct(["7", "5", "7", None], [False, True, False, False]) is False  # "7" wins 2:1
    assert majority_correct(["5", "7", "7", "5"], [True, False, False, True]) is True  # tie: the first answer
    assert majority_correct([None, None], [False, True]) is False  # nothing parsable: no vote
    correct = [[1, 0, 0, 0], [1, 1, 0, 0]]  # p = 0.25, 0.5
    assert sampling_standard_error(correct) == pytest.approx(math.sqrt((0.25 * 0.75 + 0.5 * 0.5) / 3) / 2)
    assert sampling_standard_error([[1], [0]]) is None
    scores = per_problem_scores(correct, [1, 2, 4], keys=[["3", "4", "4", "5"], ["2", "2", "1", "1"]])
    assert {k: v.tolist() for k, v in scores.items()} == {
        "avg@4": [0.25, 0.5], "pass@1": [0.25, 0.5], "pass@2": [0.5, 1 - 1 / 6], "pass@4": [1.0, 1.0],
        "maj@4": [0.0, 1.0]}
    with pytest.raises(ValueError, match="same number of samples"):
        per_problem_scores([[1, 0], [1]], [1])


def test_bootstrap_interval_contains_the_estimate_and_shrinks_with_more_problems_and_samples():
    rng = np.random.default_rng(1)
    p_true = rng.uniform(0.1, 0.9, size=20)
    correct = [list(rng.random(8) < p) for p in p_true]  # 20 problems x 8 samples
    small = summarize([{"correct": c, "num_tokens": [1] * 8, "truncated": [False] * 8} for c in correct])
    for name, metric in small["metrics"].items():
        low, high = metric["ci"]
        assert low <= metric["value"] <= high, name
        assert low < high
    # Four times the problems (the same ones, replicated): the bootstrap interval about halves (1/sqrt(4)).
    many = summarize([{"correct": c, "num_tokens": [1] * 8, "truncated": [False] * 8} for c in correct * 4])
    width = lambda s: s["metrics"]["avg@8"]["ci"][1] - s["metrics"]["avg@8"]["ci"][0]  # noqa: E731
    assert many["metrics"]["avg@8"]["value"] == pytest.approx(small["metrics"]["avg@8"]["value"])
    assert 0.4 < width(many) / width(small) < 0.6
    # Four times the samples per problem (same correct fractions): the sampling error shrinks by sqrt(7/31).
    more = [c * 4 for c in correct]
    assert sampling_standard_error(more) / sampling_standard_error(correct) == pytest.approx(math.sqrt(7 / 31))
    # Fixed seed: the same intervals; another seed, others; a constant score, a point.
    values = {"m": rng.random(20)}
    assert bootstrap_intervals(values, 500, seed=0) == bootstrap_intervals(values, 500, seed=0)
    assert bootstrap_intervals(values, 500, seed=0) != bootstrap_intervals(values, 500, seed=1)
    assert bootstrap_intervals({"m": np.full(5, 0.25)})["m"] == (0.25, 0.25)


# --------------------------------------------------------------------------------------------------------------
# The command on the tiny answer model
# --------------------------------------------------------------------------------------------------------------

DATA = addition_dataset(10, seed=1, max_operand=9)


@pytest.fixture
def problems_file(tmp_path):
    """10 addition problems in a local JSONL with non-default column names."""
    path = tmp_path / "add10.jsonl"
    with open(path, "w") as f:
        for i, (prompt, answer) in enumerate(zip(DATA["prompt"], DATA["answer"])):
            f.write(json.dumps({"question": prompt, "solution": answer, "uid": f"add-{i}"}) + "\n")
    return str(path)


EVAL_ARGS = ["--problem_column", "question", "--answer_column", "solution", "--id_column", "uid", "--n", "4",
             "--max_tokens", "6", "--prompt_template", "{problem}", "--batch_size", "16", "--resamples", "2000"]


def test_eval_command_summary_recomputed_by_hand_from_the_jsonl(answer_model_dir, problems_file, tmp_path, capsys):
    out = tmp_path / "eval"
    main(["eval", "--model", answer_model_dir, "--benchmarks", problems_file, *EVAL_ARGS, "--output_dir", str(out)])
    printed = capsys.readouterr().out
    summary = json.loads((out / SUMMARY_JSON).read_text())
    records = [json.loads(line) for line in open(out / "add10.jsonl")]
    assert [r["id"] for r in records] == [f"add-{i}" for i in range(10)]

    n, result = 4, summary["benchmarks"]["add10"]
    assert (result["problems"], result["n"], summary["settings"]["temperature"], summary["settings"]["top_p"]) == (10, 4, 1.0, 1.0)
    counts = []
    for record, gold in zip(records, DATA["answer"]):
        assert record["answer"] == gold and len(record["completions"]) == n
        for text, reward, correct in zip(record["completions"], record["rewards"], record["correct"]):
            boxed = re.fullmatch(r"\s*\\boxed\{(\d+)\}", text)
            assert reward == float(boxed is not None and boxed.group(1) == gold) and correct == (reward >= 1), text
        counts.append(sum(record["correct"]))
    metrics = result["metrics"]
    assert metrics["avg@4"]["value"] == pytest.approx(sum(counts) / (10 * n))
    for k in (1, 2, 4):
        by_hand = np.mean([brute_force_pass_at_k(r["correct"], k) for r in records])
        assert metrics[f"pass@{k}"]["value"] == pytest.approx(by_hand)
    majority = []
    for record in records:
        keys = [k for k in record["answer_keys"] if k is not None]
        top = max(keys, key=keys.count)  # max/count keeps the first of the most frequent answers
        majority.append(any(c for k, c in zip(record["answer_keys"], record["correct"]) if k == top))
    assert metrics["maj@4"]["value"] == pytest.approx(np.mean(majority))
    assert 0 < metrics["avg@4"]["value"] < metrics["pass@4"]["value"]  # a mix of right and wrong answers
    for metric in metrics.values():
        assert metric["ci"][0] <= metric["value"] <= metric["ci"][1]
    assert result["truncated_frac"] == pytest.approx(np.mean([t for r in records for t in r["truncated"]]))
    table = (out / SUMMARY_MD).read_text()
    assert table in printed and "| add10 | 10 |" in table
    assert f"{100 * metrics['avg@4']['value']:.1f} [{100 * metrics['avg@4']['ci'][0]:.1f}," in table

    # The same output with other sampling settings: refused before the model loads, the samples are kept.
    with pytest.raises(SystemExit):
        main(["eval", "--model", answer_model_dir, "--benchmarks", problems_file, *EVAL_ARGS, "--output_dir", str(out),
              "--max_tokens", "8"])
    assert "Delete the file" in capsys.readouterr().err
    assert len(open(out / "add10.jsonl").readlines()) == 10


def test_evaluate_resumes_without_regenerating(answer_model_dir, tmp_path):
    problems = [Problem(f"add-{i}", p, a) for i, (p, a) in enumerate(zip(DATA["prompt"], DATA["answer"]))]
    settings = SamplingSettings(n=4, max_tokens=6)
    reward = MathReward(num_workers=0)
    first = HFBackend(answer_model_dir, batch_size=16)
    evaluate(first, {"add": problems[:6]}, settings, str(tmp_path), "tiny", reward_func=reward, template="{problem}",
             progress=False)
    assert first.sequences == 24
    backend = HFBackend(answer_model_dir, batch_size=16)
    summary = evaluate(backend, {"add": problems}, settings, str(tmp_path), "tiny", reward_func=reward,
                       template="{problem}", progress=False)
    assert backend.sequences == 16  # only the 4 problems not evaluated before
    assert summary["benchmarks"]["add"]["problems"] == 10
    assert len(open(tmp_path / "add.jsonl").readlines()) == 10


def test_a_training_format_file_is_evaluated_as_it_is_and_the_command_says_what_it_assumed(answer_model_dir, tmp_path,
                                                                                           capsys):
    """The file `or1-trl train` trained on (prompt/answer rows), given as it is to the output dir of an OR1 run: its
    prompts are the problems (no `--problem_column`), sent without the `\\boxed{}` instruction (no `--prompt_template`),
    for as many tokens as the run trained with (its card; no `--max_tokens`), each assumption said in one line."""
    import shutil

    from transformers.trainer_callback import TrainerState

    from or1_trl import OR1Config
    from or1_trl.cli.evaluate import eval_parser
    from or1_trl.cli.parsing import parse_command
    from or1_trl.eval.evaluation import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_TEMPLATE, load_problems
    from or1_trl.eval.model_card import insert_section, or1_section

    run = tmp_path / "run"  # the answer model as an OR1 run's output dir: its card says 6 completion tokens
    shutil.copytree(answer_model_dir, run)
    args = OR1Config(output_dir=str(tmp_path / "x"), use_cpu=True, bf16=False, max_completion_length=6)
    (run / "README.md").write_text(insert_section("# card\n", or1_section(args, TrainerState(), None, None, None, None)))
    train = tmp_path / "train.jsonl"
    rows = zip(DATA["prompt"], DATA["answer"])
    train.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))

    (parsed,) = parse_command(eval_parser(), ["--model", str(run), "--benchmarks", str(train)])
    assert parsed.templates == {"train": "{problem}"} and parsed.settings.max_tokens == 6
    (benchmark,) = parse_command(eval_parser(), ["--model", str(run), "--benchmarks", str(train), "aime24"])
    assert benchmark.templates == {"train": "{problem}", "aime24": DEFAULT_PROMPT_TEMPLATE}
    assert benchmark.settings.max_tokens == DEFAULT_MAX_TOKENS  # a named benchmark too: the paper's budget
    assert [p.problem for p in load_problems(str(train))] == DATA["prompt"]

    main(["eval", "--model", str(run), "--benchmarks", str(train), "--n", "2", "--batch_size", "20", "--resamples", "100"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("train: the training format (a 'prompt' column, no 'problem'): each prompt is sent as "
                                 "it is, no instruction added (--prompt_template to add one); a string prompt as a user "
                                 "turn through the chat template")
    assert printed[1] == (f"max_tokens: 6, the completion length {run} was trained with (its model card); "
                          "--max_tokens to change.")
    records = [json.loads(line) for line in open(run / "eval" / "train.jsonl")]
    assert [r["problem"] for r in records] == DATA["prompt"] and [r["answer"] for r in records] == DATA["answer"]
    assert all(r["sampling"]["max_tokens"] == 6 for r in records)
    assert json.loads((run / "eval" / SUMMARY_JSON).read_text())["benchmarks"]["train"]["metrics"]["avg@2"]["value"] > 0


def test_the_released_format_is_a_training_format_file_with_its_gold_from_the_ground_truth(tmp_path):
    from or1_trl.eval.evaluation import is_training_format, load_problems
    from ..helpers import released_row

    released = tmp_path / "released.jsonl"
    rows = [released_row("What is 1+2?", ["3"]), released_row("What is 2+2?", ["4", "4.0"], index=1)]
    released.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert is_training_format(str(released)) and not is_training_format(str(released), problem_column="prompt")
    problems = load_problems(str(released))
    assert [p.problem for p in problems] == [[{"content": "What is 1+2?", "role": "user"}],
                                             [{"content": "What is 2+2?", "role": "user"}]]
    assert [p.answer for p in problems] == [["3"], ["4", "4.0"]]
    code = tmp_path / "code.jsonl"
    code.write_text(json.dumps(released_row("print 1", {"inputs": [""], "outputs": ["1"]}, ability="code")) + "\n")
    with pytest.raises(ValueError, match="holds \\['code'\\] rows besides math: or1-trl eval scores math answers only"):
        load_problems(str(code))


@pytest.mark.parametrize("extra, message", [
    (["--answer_column", "gold"], "has no column(s) ['gold']"),
    (["--n", "2", "--k", "1", "4"], "k=[4] with n=2"),
    (["--n", "0"], "n must be an int >= 1"),
    (["--benchmarks", "aime23"], "unknown benchmark 'aime23'"),
    (["--benchmarks", "missing.jsonl"], "does not exist"),
    (["--model", "./no/such/model"], "does not exist"),
    (["--top_p", "0"], "top_p must be in (0, 1]"),
])
def test_bad_input_is_a_clear_error_before_anything_loads(problems_file, tmp_path, capsys, extra, message):
    argv = ["eval", "--model", str(tmp_path), "--benchmarks", problems_file, "--problem_column", "question",
            "--answer_column", "solution", "--output_dir", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


# --------------------------------------------------------------------------------------------------------------
# Evaluation during training (TRL's eval_dataset path)
# --------------------------------------------------------------------------------------------------------------


def test_trainer_evaluate_logs_avg_and_pass_at_k_over_eval_prompts(answer_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import tiny_training_args

    scorer, scored = MathReward(num_workers=0), []

    def recorded_math_reward(completions, answer, **kwargs):  # math_reward, keeping what it returned
        rewards = scorer(completions, answer)
        scored.append(rewards)
        return rewards

    data = addition_dataset(6, seed=2, max_operand=9)
    chats = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in data["prompt"]],
                               "answer": data["answer"]})
    args = OR1Config(**tiny_training_args(tmp_path, per_device_eval_batch_size=8, num_generations_eval=4,
                                          eval_strategy="steps", eval_steps=1))
    trainer = OR1Trainer(model=AutoModelForCausalLM.from_pretrained(answer_model_dir), reward_funcs=recorded_math_reward,
                         args=args, train_dataset=chats, eval_dataset=chats,
                         processing_class=AutoTokenizer.from_pretrained(answer_model_dir))
    metrics = trainer.evaluate()

    rewards = [r for call in scored for r in call]
    assert len(rewards) == 6 * 4  # 3 eval batches of 2 prompts x 4 samples
    groups = [[r >= 1 for r in rewards[i : i + 4]] for i in range(0, 24, 4)]
    assert metrics["eval_avg@4"] == pytest.approx(np.mean([sum(g) / 4 for g in groups]))
    for k in (1, 2, 4):
        assert metrics[f"eval_pass@{k}"] == pytest.approx(np.mean([brute_force_pass_at_k(g, k) for g in groups]))
    assert 0 < metrics["eval_avg@4"] < metrics["eval_pass@4"]
    assert metrics["eval_reward"] == pytest.approx(np.mean(rewards))  # TRL's own metric, unchanged


def test_eval_command_through_the_vllm_server(vllm_server, problems_file, tmp_path):
    out = tmp_path / "eval"
    main(["eval", "--server_url", vllm_server.url, "--benchmarks", problems_file, "--problem_column", "question",
          "--answer_column", "solution", "--id_column", "uid", "--n", "2", "--max_tokens", "4", "--resamples", "200",
          "--output_dir", str(out)])
    summary = json.loads((out / SUMMARY_JSON).read_text())
    assert summary["backend"] == "server" and summary["model"] == vllm_server.model_path  # the served model's name
    records = [json.loads(line) for line in open(out / "add10.jsonl")]
    assert len(records) == 10 and all(len(r["completions"]) == 2 and r["backend"] == "server" for r in records)
    counts = [sum(r["correct"]) for r in records]
    assert summary["benchmarks"]["add10"]["metrics"]["avg@2"]["value"] == pytest.approx(sum(counts) / 20)
