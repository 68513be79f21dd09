"""`benchmarks/regime.py` (issue 50), the recipe's claims where reasoning comes before the answer: each arm changes
what its claim names and nothing else, the benchmark's 80/20 figures and random-mask control against plain counts,
the goals' verdicts on hand-made results, and a `--quick` launch (the 1-shot arm ranks the `magic` run's prompts; a
relaunch runs nothing). The runs' numbers are not tested: they are the benchmark's."""

import dataclasses
import sys
import json
import math

import pytest
import torch

from .test_learning_benchmarks import load

regime = load("regime")
SETTINGS = regime.REGIME


def _config(tmp_path, arm, seed=0, url=None, **kwargs):
    return regime.regime_config(arm, seed, str(tmp_path / arm), SETTINGS, url, **kwargs)


def test_every_arm_changes_only_what_its_claim_names(tmp_path):
    magic = _config(tmp_path, "magic", seed=2).to_dict()
    assert (magic["stop_pattern"], magic["rollout_seed"], magic["bf16"], magic["prompt_id_column"]) == (
        regime.ANSWER_LINE, regime.ROLLOUT_SEED + 2, False, "prompt_id")
    assert magic["stages"] == [{"until_step": 20, "max_completion_length": 96},
                               {"until_step": 60, "max_completion_length": 128}]
    assert magic["use_adaptive_entropy"] and magic["rejection_sampling"] == "compact"
    controller = {"entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"}  # its settings
    allowed = {  # arm: (the fields it may change of magic's, the ones it must)
        "grpo": ({"rejection_sampling", "use_adaptive_entropy", "online_filter_threshold", "stages", *controller},
                 {"rejection_sampling", "use_adaptive_entropy", "stages"}),
        "bonus": ({"use_adaptive_entropy", "entropy_coef", *controller}, {"use_adaptive_entropy", "entropy_coef"}),
        "bonus_no_rejection": ({"use_adaptive_entropy", "entropy_coef", "rejection_sampling", *controller},
                               {"use_adaptive_entropy", "entropy_coef", "rejection_sampling"}),
        "top20_all": ({"top_entropy_quantile"},) * 2,
        "top20_selected": ({"top_entropy_quantile", "top_entropy_normalization"},) * 2,
        "one_shot": ({"rejection_sampling", "online_filter_threshold", "use_adaptive_entropy", "entropy_coef",
                      *controller}, {"rejection_sampling", "online_filter_threshold", "entropy_coef"}),
    }
    ignored = {"output_dir", "logging_dir", "run_name", "hub_model_id"}
    for arm, (may, must) in allowed.items():
        config = _config(tmp_path, arm, seed=2).to_dict()
        changed = {k for k, v in config.items() if v != magic[k] and k not in ignored}
        assert must <= changed <= may, (arm, changed)
    same = {k: v for k, v in _config(tmp_path, "random20").to_dict().items() if k not in ignored}
    assert same == {k: v for k, v in _config(tmp_path, "top20_all").to_dict().items() if k not in ignored}
    assert regime.ARMS["random20"].mask == "random" and regime.ARMS["top20_all"].mask == "top"
    bonus, one_shot = _config(tmp_path, "bonus"), _config(tmp_path, "one_shot")
    assert (bonus.entropy_coef, bonus.use_adaptive_entropy) == (regime.FIXED_BONUS, False)
    assert (one_shot.entropy_coef, one_shot.rejection_sampling) == (regime.ONE_SHOT_BONUS, "off")
    grpo = _config(tmp_path, "grpo")
    assert (grpo.rejection_sampling, grpo.use_adaptive_entropy, grpo.entropy_coef, grpo.stages) == ("off", False, 0.0,
                                                                                                     None)
    assert grpo.max_completion_length == 128
    assert grpo.rollout_correction == _config(tmp_path, "magic").rollout_correction


def test_the_n_sgd_4_arms_cut_one_rollout_into_four_updates(tmp_path):
    on = _config(tmp_path, "nsgd4", entropy_target=0.15)
    off = _config(tmp_path, "nsgd4_off", entropy_target=0.15)
    pilot = _config(tmp_path, "nsgd4_pilot", seed=regime.PILOT_SEED)
    assert [(s["batch_size"], s["mini_batch_size"]) for s in on.stages] == [(16, 4), (16, 4)] == [
        (s["batch_size"], s["mini_batch_size"]) for s in off.stages]  # prompts per rollout, per update: N_SGD 4
    assert pilot.sgd_steps_per_rollout == 4 and pilot.per_device_train_batch_size == 32  # TRL's own N_SGD, no stages
    assert (on.use_adaptive_entropy, on.entropy_target, off.use_adaptive_entropy) == (True, 0.15, False)
    assert pilot.stages is None and not pilot.use_adaptive_entropy and pilot.rejection_sampling == "off"


def test_the_entropy_target_comes_from_the_pilot():
    log = [{"step": s, "entropy": 1.0 - 0.01 * s} for s in range(1, 61)]
    assert regime.entropy_target_from_pilot({"log": log}, SETTINGS) == {
        "target": 0.8, "pilot_min": pytest.approx(0.4), "pilot_at_third": pytest.approx(0.8)}  # never below 0.1
    falls = [{"step": s, "entropy": 1.0 / s} for s in range(1, 61)]
    assert regime.entropy_target_from_pilot({"log": falls}, SETTINGS)["target"] == 0.2


def test_selected_places_counts_the_tagged_rows_only_before_the_tag_in_it_and_in_the_number():
    selected = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    places = [regime.AnswerPlaces(tag=2, number=3, number_end=4), None,
              regime.AnswerPlaces(tag=1, number=2, number_end=4)]
    assert regime.selected_places(selected, places) == regime.SelectedPlaces(before=1 + 0, tag=1 + 1, number=1 + 2,
                                                                             total=3 + 4)


def test_answer_places_are_the_tokens_of_the_tag_and_of_its_number():
    from or1_trl.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()

    def pieces(text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        place = regime.answer_places(tokenizer, ids)
        return place and [tokenizer.decode(ids[a:b]) for a, b in ((0, place.tag), (place.tag, place.number),
                                                                   (place.number, place.number_end),
                                                                   (place.number_end, len(ids)))]

    before, tag, number, rest = pieces("3 + 14 = 17\nAnswer: 17\n")
    assert before == "3 + 14 = 17\n" and tag.strip() == "Answer:" and number.strip() == "17" and rest == "\n"
    assert pieces("Answer: 3, no.\nAnswer: -12")[2].strip() == "-12"  # the last tag's number, its sign
    assert pieces("no tag: 7") is None
    _, tag, number, rest = pieces("17\nAnswer: none")  # a tag without a number: its line is tag and rest
    assert number == "" and "Answer:" in tag + rest


def test_the_random_mask_draws_the_count_among_the_valid_tokens_only():
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    for seed in range(20):
        chosen = regime.random_mask(valid, 3, torch.Generator().manual_seed(seed))
        assert int(chosen.sum()) == 3 and not (chosen & ~valid).any()
    draws = torch.stack([regime.random_mask(valid, 1, torch.Generator().manual_seed(s)) for s in range(500)])
    shares = draws.float().mean(0)[valid]  # each valid token drawn about a fifth of the time
    assert shares.min() > 0.13 and shares.max() < 0.27
    assert int(regime.random_mask(valid, 9, torch.Generator().manual_seed(0)).sum()) == 5  # at most every valid one


def test_random_examples_come_from_different_rungs():
    train, _ = regime.regime_data(SETTINGS)
    for seed in range(3):
        rows = [regime.stratified_example(train, k, seed) for k in range(regime.RANDOM_EXAMPLES)]
        assert len({train[row]["rung"] for row in rows}) == regime.RANDOM_EXAMPLES
        assert rows == [regime.stratified_example(train, k, seed) for k in range(regime.RANDOM_EXAMPLES)]


def test_the_judge_reads_a_held_out_sample_up_to_its_answer_line():
    text = "3 + 4 = 7.\nAnswer: 7\nAnswer: 8\n"
    assert regime.judge([text, "Answer: 8"], ["7", "7"]) == [1.0, 0.0]  # the reward alone reads the last tag, 8
    assert regime.tagged_answer_reward([text], ["7"]) == [0.0]


def _result(arm, seed, auc, claim=1, **extra):
    return {"arm": arm, "seed": seed, "claim": claim, "auc": auc, "start_accuracy": 0.1,
            "final_accuracy": 0.1 + auc, "train_entropy_last_third": float("nan"), "device": "2 CPUs", **extra}


def test_verdicts_follow_the_stated_goals():
    results = {arm: {s: _result(arm, s, auc) for s, auc in enumerate(values)} for arm, values in {
        "magic": [0.30, 0.32, 0.28, 0.35], "grpo": [0.20, 0.25, 0.22, 0.27],
        "bonus": [0.30, 0.31, 0.29, 0.30], "bonus_no_rejection": [0.31, 0.30, 0.30, 0.31],
        "top20_all": [0.25, 0.20, 0.24, 0.30], "top20_selected": [0.31, 0.33, 0.29, 0.36],
        "random20": [0.20, 0.21, 0.19, 0.22]}.items()}
    v = regime.verdicts(results, SETTINGS)
    assert v[1]["verdict"] == "met" and v[1]["figures"]["mean"] == pytest.approx((0.10 + 0.07 + 0.06 + 0.08) / 4)
    assert v[2]["verdict"] == "met"  # −0.005 on average, its interval's lower end above −0.03
    assert v[4]["verdict"] == {"a_all": "missed", "a_selected": "met", "b": "met"}
    assert v[4]["figures"]["mechanism"] is None  # no run measured where its selected tokens fall
    for seed, (before, in_tag, in_number) in enumerate([(0.9, 0.01, 0.05), (0.7, 0.05, 0.2)]):
        results["top20_all"][seed] |= {"selected_before_answer": before, "selected_answer_tag": in_tag,
                                       "selected_answer_number": in_number}
    figures = regime.verdicts(results, SETTINGS)[4]["figures"]
    assert figures["selected_before_answer"] == pytest.approx(0.8) and figures["mechanism"] is True
    assert figures["selected_answer_tag"] == pytest.approx(0.03)
    assert figures["selected_answer_number"] == pytest.approx(0.125)
    results["top20_all"][1]["finished"] = "2026-11-30 01:59"
    rows = regime.markdown(results, SETTINGS, quick=False).splitlines()
    assert ("| top20_all | 1 | 1 | 0.200 | 0.100 → 0.300 | — | — | 0.70 | 0.05 | 0.20 | 2 CPUs, 2026-11-30 01:59 |"
            in rows)  # no step times, no entropy measured: dashes
    assert v[3]["verdict"] == "not tested" and v[5]["verdict"] == {"a": "not tested", "b": "not tested",
                                                                   "c": "not tested"}
    pilot = {"log": [{"step": s, "entropy": 1.0 / s} for s in range(1, 61)]}  # target 0.2
    results |= {"nsgd4_pilot": {100: pilot}, "nsgd4": {s: _result("nsgd4", s, 0.3, train_entropy_last_third=h)
                                                       for s, h in enumerate([0.15, 0.12])},
                "nsgd4_off": {s: _result("nsgd4_off", s, 0.3, train_entropy_last_third=h)
                              for s, h in enumerate([0.05, 0.02])}}
    assert regime.verdicts(results, SETTINGS)[3]["verdict"] == "met"
    results["nsgd4_off"][1]["train_entropy_last_third"] = 0.11  # this control did not collapse below target/2
    assert regime.verdicts(results, SETTINGS)[3]["verdict"] == "missed"
    for seed in (0, 1):
        results["nsgd4_off"][seed]["train_entropy_last_third"] = 0.5  # no control collapsed: nothing to prevent
    assert regime.verdicts(results, SETTINGS)[3]["verdict"] == "not tested"


def test_the_plot_draws_each_seed_and_the_mean_over_the_seeds_that_reached_a_step(tmp_path):
    nan = float("nan")
    curve = {0: [0.1, 0.3, 0.5], 1: [0.2, 0.2]}  # seed 1 stopped after its first evaluation
    log = {seed: [{"step": 1, "entropy": 0.9 + seed, "regime/selected_before_answer": 0.8},
                  {"step": 2, "entropy": nan, "regime/selected_before_answer": 0.6 + 0.2 * seed}] for seed in curve}
    results = {"top20_all": {seed: _result("top20_all", seed, 0.3, claim=4, log=log[seed], curve=[
        {"step": 10 * i, "accuracy": a} for i, a in enumerate(values)]) for seed, values in curve.items()},
        "magic": {0: _result("magic", 0, 0.2, curve=[{"step": 0, "accuracy": 0.1}, {"step": 10, "accuracy": 0.4}],
                             log=[{"step": 1, "entropy": 1.0}, {"step": 2, "entropy": 0.5}])}}
    approx = pytest.approx
    png = tmp_path / "regime.png"
    drawn = regime.regime_plot(results, SETTINGS, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn["accuracy"]["top20_all"]["seeds"] == {0: [(0, 0.1), (10, 0.3), (20, 0.5)], 1: [(0, 0.2), (10, 0.2)]}
    assert drawn["accuracy"]["top20_all"]["mean"] == [(0, approx(0.15)), (10, approx(0.25)), (20, 0.5)]
    assert drawn["entropy"]["top20_all"]["mean"] == [(1, approx(1.4))]  # a NaN step is left out
    assert drawn["entropy"]["magic"]["mean"] == [(1, 1.0), (2, 0.5)]
    assert drawn["regime/selected_before_answer"] == {"top20_all": {
        "seeds": {0: [(1, 0.8), (2, 0.6)], 1: [(1, 0.8), (2, 0.8)]}, "mean": [(1, 0.8), (2, approx(0.7))]}}


def test_the_plan_runs_the_pilot_and_magic_first_and_each_run_once():
    plan = regime.plan([3, 5, 1], seeds=2, first_seed=0)
    assert plan[0] == ("nsgd4_pilot", regime.PILOT_SEED) and len(plan) == len(set(plan))
    assert plan.index(("magic", 0)) < plan.index(("one_shot", 0)) and ("magic", 1) in plan
    assert [run for run in plan if run[1] == 0][:3] == [("nsgd4", 0), ("nsgd4_off", 0), ("magic", 0)]


def test_regime_quick_ranks_the_magic_runs_prompts_and_resumes(tmp_path, capsys):
    """`--quick --claims 5`: `magic`, then the 1-shot arms (π₁ from `magic`'s `prompt_stats.jsonl`, the random
    examples, the format-only control), each result written, each step a line; a relaunch runs nothing and reports
    the same."""
    results = regime.main(["--quick", "--claims", "5", "--results", str(tmp_path)])
    printed = capsys.readouterr().out
    for step in (1, 2):  # every arm's steps, one line each
        assert printed.count(f"step   {step}/2 | reward ") == len(regime.CLAIMS[5]), printed[-2000:]
    assert set(results) == set(regime.CLAIMS[5]) and all(set(runs) == {0} for runs in results.values())
    one_shot = results["one_shot"][0]
    ranked = [json.loads(line)["prompt_id"] for line in open(tmp_path / "magic-seed0.prompt_stats.jsonl")]
    assert one_shot["selection"]["prompt_id"] in ranked
    assert {results[f"one_shot_random{k}"][0]["selection"]["prompt_id"] for k in range(3)}.isdisjoint(
        {None}) and results["format_only"][0]["selection"] is None
    for runs in results.values():
        r = runs[0]
        assert r["settings"] == dataclasses.asdict(regime.REGIME_QUICK) and len(r["curve"]) == 3
        assert r["auc"] == pytest.approx(regime.held_out_auc([(p["step"], p["accuracy"]) for p in r["curve"]]))
        assert all(entry.get("completions/stopped_ratio", 0.0) == 0.0 for entry in r["log"])  # tiny: no answer line
    written = {path.name: path.read_text() for path in tmp_path.glob("*-seed*.json")}
    again = regime.main(["--quick", "--claims", "5", "--results", str(tmp_path)])
    assert again == results and {p.name: p.read_text() for p in tmp_path.glob("*-seed*.json")} == written
    assert not math.isnan(results["magic"][0]["start_accuracy"])


class Killed(Exception):
    """The process dying (a kill, a crash, the machine taken back), raised where the test says."""


def without_clocks(result: dict) -> dict:
    """A result without what the clock and the machine's load decide (seconds, load samples, dates)."""
    timed = {"finished", "total_s", "seconds_per_step"}
    return {**{key: value for key, value in result.items() if key not in timed},
            "curve": [{k: v for k, v in point.items() if k not in ("wall_s", "load")} for point in result["curve"]],
            "log": [{k: v for k, v in entry.items() if not k.startswith("time/")} for entry in result["log"]]}


def test_a_run_stopped_midway_resumes_from_its_checkpoint_and_ends_as_if_never_stopped(tmp_path, monkeypatch):
    """`--quick` `magic` killed in step 2's rollout, after checkpoint-1: the relaunch resumes there and writes the
    result an uninterrupted run writes (the same held-out curve, training log, rollouts' digests, token counts and
    prompt statistics), generating step 2's rollout only; the run's checkpoints go once its result is written."""
    launch = ["--quick", "--claims", "1", "--arms", "magic", "--results"]
    uninterrupted = regime.main([*launch, str(tmp_path / "whole")])["magic"][0]

    generate = regime.RegimeTrainer._generate

    def dies_in_step_2(self, prompts):
        if self.model.training and self.state.global_step == 1:
            raise Killed
        return generate(self, prompts)

    stopped = tmp_path / "stopped"
    monkeypatch.setattr(regime.RegimeTrainer, "_generate", dies_in_step_2)
    with pytest.raises(Killed):
        regime.main([*launch, str(stopped)])
    monkeypatch.undo()
    run = stopped / "checkpoints" / "magic-seed0"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (stopped / "magic-seed0.json").exists()
    saved = json.loads((run / "checkpoint-1" / regime.RUN_STATE_FILE).read_text())
    assert [p["step"] for p in saved["evaluation"]["points"]] == [0, 1] and list(saved["digests"]) == ["0"]

    rollouts = []  # the steps the relaunch generates training rollouts for (global_step before the step)

    def counted(self, prompts):
        rollouts.append(self.state.global_step) if self.model.training else None
        return generate(self, prompts)

    monkeypatch.setattr(regime.RegimeTrainer, "_generate", counted)
    resumed = regime.main([*launch, str(stopped)])["magic"][0]
    assert rollouts and set(rollouts) == {1}  # step 2 only: resumed, not started over
    assert without_clocks(resumed) == without_clocks(uninterrupted)
    assert [p["step"] for p in resumed["curve"]] == [0, 1, 2] and set(resumed["rollout_digests"]) == {"0", "1"}
    assert ((stopped / "magic-seed0.prompt_stats.jsonl").read_text()
            == (tmp_path / "whole" / "magic-seed0.prompt_stats.jsonl").read_text())
    assert not run.exists()


def test_a_checkpoints_folder_that_cannot_be_written_is_one_line_before_any_run(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        regime.main(["--quick", "--results", str(tmp_path / "results"), "--checkpoints", str(tmp_path / "file")])
    assert str(stopped.value) == f"--checkpoints: output_dir {str(tmp_path / 'file')!r} is a file; pass a directory"
    assert not list((tmp_path / "results").glob("*.json"))  # nothing ran


def test_the_trainer_swaps_in_the_random_mask_and_logs_the_selected_share(tmp_path, monkeypatch):
    """One step of `RegimeTrainer` on the tiny model with the 80/20 rule (every answer tag placed at token 2, its
    number at token 3: the tiny model writes none): the random control selects as many tokens as TRL's mask, among
    the valid ones only, and is the mask the loss gets; the logged shares before the answer and in its number are the
    plain counts over the masks used."""
    from or1_trl import OR1Config
    from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

    from .helpers import ScriptedReward, tagged_dataset

    place = regime.AnswerPlaces(tag=2, number=3, number_end=4)
    monkeypatch.setattr(regime, "answer_places", lambda tokenizer, ids: place)
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(tmp_path, top_entropy_quantile=0.2, max_steps=1, rollout_seed=1,
                                          rejection_sampling="off"))
    trainer = regime.RegimeTrainer(model, ScriptedReward(), args=args, processing_class=tokenizer,
                                   train_dataset=tagged_dataset(["MIX", "ALL"] * 4))
    trainer.regime_mask = "random"
    seen = []
    top, benchmark = regime.OR1Trainer.get_high_entropy_mask, regime.RegimeTrainer.get_high_entropy_mask

    def spy(self, entropies, mask, threshold):
        trl_mask = top(self, entropies, mask, threshold)
        used = benchmark(self, entropies, mask, threshold)
        seen.append((trl_mask, used, mask.bool()))
        return used

    monkeypatch.setattr(regime.RegimeTrainer, "get_high_entropy_mask", lambda self, *a: spy(self, *a), raising=True)
    trainer.train()
    assert seen
    for trl_mask, used, valid in seen:
        assert int(used.sum()) == int(trl_mask.sum()) and not (used & ~valid).any()
    assert any(not torch.equal(trl_mask, used) for trl_mask, used, _ in seen)
    counts = [c for c in (regime.selected_places(used, [place] * len(used)) for _, used, _ in seen) if c.total]
    for place, key in regime.SELECTED_SHARE_KEYS.items():
        share = [getattr(c, place) / c.total for c in counts]
        logged = [e[key] for e in trainer.state.log_history if key in e]
        assert logged == [pytest.approx(sum(share) / len(share))]


def test_another_run_length_is_another_experiment_in_a_folder_of_its_own(capsys):
    assert regime.results_folder(regime.REGIME) == "benchmarks/results/regime"
    assert regime.results_folder(dataclasses.replace(regime.REGIME, generation="hf")) == "benchmarks/results/regime-hf"
    longer = dataclasses.replace(regime.REGIME, generation="hf", steps=200)
    assert regime.results_folder(longer) == "benchmarks/results/regime-hf-200steps"
    with pytest.raises(SystemExit):  # before any model loads
        regime.main(["--steps", "20", "--report-only"])
    assert "--steps 20: at least 30 (three evaluations, every 10 steps)" in capsys.readouterr().err


def test_a_plot_into_a_missing_folder_is_one_line_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        regime.main(["--quick", "--plot", str(tmp_path / "missing" / "regime.png")])
    assert f"--plot {tmp_path / 'missing' / 'regime.png'}: no folder {tmp_path / 'missing'}" in capsys.readouterr().err


def test_the_gpu_script_runs_the_pilot_before_the_arms_it_sets_the_target_of(tmp_path):
    """`scripts/gpu_regime.sh 3` with `QUICK=1` and `STEPS=3` (the tiny model on the CPU, 2 processes at once, one
    step more than `--quick`'s): the pilot's result is written before claim 3's arms start, the controller arm trains
    with the target the pilot gives, every run is as long as STEPS says, and the report's plot is written."""
    import os
    import subprocess

    from .test_learning_benchmarks import ENV, ROOT

    env = {**ENV, "QUICK": "1", "PARALLEL": "2", "SEEDS": "1", "STEPS": "3", "RESULTS": str(tmp_path),
           "PYTHON": sys.executable}
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_regime.sh"), "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    settings = dataclasses.replace(regime.REGIME_QUICK, steps=3)
    results = regime.load_results(str(tmp_path), settings)  # (exits on a result of other settings)
    assert {arm: set(runs) for arm, runs in results.items()} == {"nsgd4_pilot": {100}, "nsgd4": {0}, "nsgd4_off": {0}}
    assert all([p["step"] for p in runs[0 if arm != "nsgd4_pilot" else 100]["curve"]] == [0, 1, 2, 3]
               for arm, runs in results.items())
    target = regime.entropy_target_from_pilot(results["nsgd4_pilot"][100], settings)["target"]
    assert results["nsgd4"][0]["entropy_target"] == target and results["nsgd4_off"][0]["entropy_target"] is None
    pilot_done = os.path.getmtime(tmp_path / "nsgd4_pilot-seed100.json")
    assert all(os.path.getmtime(tmp_path / "logs" / f"{arm}-seed0.log") > pilot_done for arm in ("nsgd4", "nsgd4_off"))
    assert (tmp_path / "regime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the report's plot comes back too
