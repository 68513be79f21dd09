"""`benchmarks/step_time.py` and `benchmarks/learning.py`: their pieces against hand computations, and their `--quick`
runs (the tables are consistent with themselves; the numbers of a quick run mean nothing)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


learning = load("learning")
step_time = load("step_time")


def run_quick(script, tmp_path):
    out = tmp_path / f"{script}.md"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"), "--quick", "--markdown",
                             str(out)], capture_output=True, text=True, timeout=900, env=ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return out.read_text()


def test_held_out_split_and_toy_data():
    train, held_out = learning.split_pairs()
    assert len(train) == 70 and len(held_out) == 30 and not set(train) & set(held_out)
    assert sorted(train + held_out) == [(a, b) for a in range(10) for b in range(10)]
    assert learning.split_pairs() == (train, held_out)  # fixed, whatever the run's seed
    held_out_prompts = {learning.PROMPT.format(a=a, b=b) for a, b in held_out}
    for toy in learning.TOYS.values():
        sft, rl, evaluation, unseen = learning.toy_data(toy, seed=3)
        assert held_out_prompts <= set(sft["prompt"])  # SFT sees every problem ...
        assert not held_out_prompts & set(rl["prompt"])  # ... RL never the held-out ones
        assert set(unseen["prompt"]) == held_out_prompts
        train_prompts = {learning.PROMPT.format(a=a, b=b) for a, b in train}
        assert set(evaluation["prompt"]) == train_prompts <= set(rl["prompt"])  # the target: the RL additions
        for data in (rl, evaluation, unseen):
            assert all(str(eval(p[3:-5])) == a for p, a in zip(data["prompt"], data["answer"]))  # noqa: S307
        assert len(rl) == 70 + toy.easy_prompts and len(set(rl["prompt"])) == len(rl)  # unique prompts: a pool
        long = [c for c in sft["completion"] if ", so " in c]
        if toy.long_forms:  # about half of the additions' answers in the long form, the copy prompts never
            additions = [p for p in sft["prompt"] if "+" in p]
            assert 0.4 < len(long) / len(additions) < 0.6
            assert all("+" in p for p, c in zip(sft["prompt"], sft["completion"]) if ", so " in c)
        else:
            assert not long
    assert learning.sft_completion("Q: 3+4=? A:", "7", long=True) == " 3+4=7, so \\boxed{7}"
    assert learning.sft_completion("Q: 42=? A:", "42", long=True) == " \\boxed{42}"


def test_correct_reads_the_last_boxed_number():
    assert learning.correct(" 3+4=7, so \\boxed{7}", "7")
    assert learning.correct(" \\boxed{07}", "7")
    assert not learning.correct(" \\boxed{1} then \\boxed{8}", "1")
    assert not learning.correct(" 3+4=7, so \\box", "7")  # truncated


def test_target_is_the_start_plus_the_gain_on_a_moving_mean():
    def points(*accuracies):
        return [{"step": 10 * i, "accuracy": a} for i, a in enumerate(accuracies)]

    # start 0.30, target 0.40: means of the last 3 (fewer at first) 0.45 at step 10 (a lucky spike of 0.60 alone)
    assert learning.target_reached(points(0.30, 0.60), 0.10)["step"] == 10
    # 0.30 0.42 0.35 0.45 0.44: means 0.36, 0.357, 0.407 -> step 30
    assert learning.target_reached(points(0.30, 0.42, 0.35, 0.45, 0.44), 0.10)["step"] == 30
    # a single high evaluation among low ones does not reach it
    assert learning.target_reached(points(0.30, 0.31, 0.50, 0.30, 0.31), 0.10) is None


def test_bootstrap_ratio_by_hand():
    # Two seeds: resamples {0,0} -> 2/4, {1,1} -> 4/4, mixed -> 3/4 (probabilities 1/4, 1/4, 1/2).
    ratio, low, high = learning.bootstrap_ratio([1.0, 2.0], [2.0, 2.0])
    assert (ratio, low, high) == (0.75, 0.5, 1.0)
    assert learning.bootstrap_ratio([3.0] * 5, [2.0] * 5) == (1.5, 1.5, 1.5)


def test_arm_configs(tmp_path):
    toy = learning.TOYS["magic"]
    grpo = learning.arm_config(toy, "grpo_offpolicy", 0, str(tmp_path), 160, 60)
    assert (grpo.steps_per_generation, grpo.gradient_accumulation_steps, grpo.max_completion_length) == (4, 1, 16)
    assert grpo.learning_rate == 2e-4 and grpo.lr_scheduler_type.value == "constant"
    or1 = learning.arm_config(toy, "or1_offpolicy", 0, str(tmp_path), 160, 60)
    assert or1.max_steps == 160 and or1.rejection_sampling == "compact" and or1.use_adaptive_entropy
    assert [(s["until_step"], s["max_completion_length"], s["batch_size"], s["mini_batch_size"]) for s in or1.stages] == [
        (60, 8, 64, 16), (160, 16, 64, 16)]
    plain = learning.arm_config(learning.TOYS["plain"], "or1", 0, str(tmp_path), 200, None)
    assert plain.stages is None and plain.max_completion_length == 12 and plain.sgd_steps_per_rollout == 1


def test_evaluation_measures_entropy_and_leaves_training_rng_alone(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    _, rl, evaluation, _ = learning.toy_data(learning.TOYS["plain"], seed=0)
    trainer = learning.counting(GRPOTrainer)(model, lambda completions, **kw: [0.0] * len(completions),
                                             args=GRPOConfig(**tiny_training_args(tmp_path)), train_dataset=rl,
                                             processing_class=tokenizer)
    evaluator = learning.Evaluation([trainer], evaluation.select(range(3)), context=5, every=1, samples=2,
                                    train_problems=evaluation.select(range(3)), train_samples=2)
    state = torch.get_rng_state()
    accuracy, entropy = evaluator.evaluate(trainer, 7, evaluation.select(range(3)), 2)
    assert torch.equal(torch.get_rng_state(), state)
    assert 0.0 <= accuracy <= 1.0
    # By hand: the same samples (same seed), scored again by a forward pass over prompt + completion.
    encoded = tokenizer(list(evaluation.select(range(3))["prompt"]), return_tensors="pt")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10_000 + 7)
        sequences = model.generate(**encoded, **{**trainer.generation_kwargs, "max_new_tokens": 5,
                                                 "num_return_sequences": 2})
    prompt_length = encoded["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(sequences).logits[:, prompt_length - 1 : -1].float()  # [6, T, V] predicting each new token
    p = logits.softmax(-1)
    per_token = -(p * p.log()).sum(-1)  # [6, T]
    total, count = 0.0, 0
    for row, tokens in enumerate(sequences[:, prompt_length:].tolist()):
        for t, token in enumerate(tokens):
            total, count = total + per_token[row, t].item(), count + 1
            if token == tokenizer.eos_token_id:
                break
    assert entropy == pytest.approx(total / count, rel=1e-4)
    assert trainer.bench_tokens == 0  # evaluation generates outside the trainer's count


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def agrees_with_printed(ratio, a, b, half_unit, ratio_half_unit):
    """Whether `ratio` (printed to `ratio_half_unit`) can be a / b for a, b printed to `half_unit`."""
    return (a - half_unit) / (b + half_unit) - ratio_half_unit <= ratio <= (a + half_unit) / (b - half_unit) + ratio_half_unit


def test_learning_quick(tmp_path):
    text = run_quick("learning", tmp_path)
    learning = load("learning")
    for toy in ("plain", "magic"):
        run = [arm for arm in learning.TOYS[toy].arms if arm not in learning.SERVER_ARMS]  # those only when named
        arms = [learning.NAMES[arm] for arm in run]
        pairs = [(learning.NAMES[ours], learning.NAMES[theirs]) for ours, theirs in learning.PAIRS[toy]
                 if ours in run and theirs in run]
        section = text.split(f"**Toy {toy}**")[1].split("**Toy")[0]
        rows = {cells(line)[0]: cells(line) for line in section.splitlines() if line.startswith("| ") and "/1 |" in line}
        assert list(rows) == arms
        for row in rows.values():
            assert row[1] in ("0/1", "1/1") and int(row[2]) <= 4 and float(row[3]) > 0 and int(row[4].replace(",", "")) > 0
        ratios = [cells(line) for line in section.splitlines() if line.startswith("| OR1 recipe") and "×" in line]
        assert [ratio[0] for ratio in ratios] == [f"{ours} / {theirs}" for ours, theirs in pairs]
        for ratio, (ours, theirs) in zip(ratios, pairs):
            # One seed: the interval is the point, and the point is the ratio of the two rows (rounded there).
            for column, key, half_unit in ((1, 2, 0.5), (2, 3, 0.05), (3, 4, 0.5)):  # the rows' printed precision
                value, low, high = map(float, re.fullmatch(r"(\S+)× \((\S+)–(\S+)\)", ratio[column]).groups())
                assert value == low == high
                a, b = (float(rows[arm][key].replace(",", "")) for arm in (ours, theirs))
                assert agrees_with_printed(value, a, b, half_unit, 0.005)


def test_step_time_quick(tmp_path):
    text = run_quick("step_time", tmp_path)
    arms = {cells(line)[0]: cells(line) for line in text.splitlines() if line.startswith("| `")}
    trl, or1 = arms["`GRPOTrainer`, scripted reward"], arms["`OR1Trainer`, scripted reward"]
    half, demo = arms["`OR1Trainer`, half the groups constant"], arms["`OR1Trainer`, `math_reward` (demo)"]
    assert or1[-1] == "1.00" and half[-1] == "0.50"  # nothing rejected / half the groups rejected
    for row in (or1, half, demo):
        assert sum(float(share.rstrip("%")) for share in row[3:7]) == pytest.approx(100, abs=0.3)
    measures = {cells(line)[0][:3]: cells(line) for line in text.splitlines() if line.startswith("| (")}
    a = float(measures["(a)"][1].split(" / ")[1].rstrip("×"))
    b = float(measures["(b)"][1].split(" / ")[1].rstrip("×"))
    assert agrees_with_printed(a, float(or1[1]), float(trl[1]), 0.0005, 0.0005)
    assert agrees_with_printed(b, float(half[2]), float(or1[2]), 0.0005, 0.0005)
    other = [cells(line) for line in text.splitlines() if line.startswith("| (c)")]
    assert other[0][1].split(" / ")[1] == demo[6]  # the demo arm's `other` share
