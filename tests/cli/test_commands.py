"""The command line: `or1-trl` and its sub-commands (`--help`, errors), `examples/train_or1.py` with a model, a
dataset and a recipe YAML; the recipes parse into the paper's numbers."""

import json
import os
import re
import subprocess
import sys

import pytest
from trl import ModelConfig, TrlParser

from or1_trl import OR1Config
from or1_trl.cli import COMMANDS, ScriptArguments, parse_command, train_parser
from or1_trl.testing import save_tiny_model
from ..helpers import ENV, RECIPES, ROOT, TINY, exit_code


def or1_trl_cli(*args, cwd=None, timeout=120):
    """`or1-trl ARGS` in a fresh interpreter (the console script runs `or1_trl.cli:main`, see pyproject.toml)."""
    return subprocess.run([sys.executable, "-m", "or1_trl.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=ENV)


def test_console_script_is_main():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'or1-trl = "or1_trl.cli:main"' in f.read()


def test_top_level_help_lists_the_commands(tmp_path):
    result = or1_trl_cli("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = [command.name for command in COMMANDS]
    assert " ".join(result.stdout.split()).startswith(  # unwrapped
        f"usage: or1-trl [-h] [--version] [--debug] {{{','.join(names)}}} ...")
    commands = dict(re.findall(r"^    ([\w-]+)\s+(\S.*)$", result.stdout, flags=re.M))
    assert set(commands) == set(names) >= {"train", "demo", "serve", "prepare", "difficulty", "select-examples", "eval", "plot"}
    assert commands["demo"].startswith("the offline demo") and commands["train"].startswith("train with the MAGIC")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "the following arguments are required: command"),
        (["bogus"], "argument command: invalid choice: 'bogus' (choose from "
                    + ", ".join(repr(command.name) for command in COMMANDS) + ")"),
        (["--verbose", "demo"], "or1-trl: error: unrecognized arguments: --verbose"),
        (["demo", "--bogus"], "or1-trl demo: error: unrecognized arguments: --bogus"),
        (["demo", "--max_steps", "0"], "or1-trl demo: error: --max_steps must be at least 1"),
        (["train", "--config", TINY, "--bogus", "1"], "or1-trl train: error: unrecognized arguments: --bogus 1"),
        (["train", "--config", TINY, "--model_name_or_path", "some/model"],
         "error: training needs both --model_name_or_path and --dataset_name, or neither"),
        (["train", "--config", TINY, "--reward", "code"], "need --reward math"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(capsys, argv, message):
    code, out, err = exit_code(capsys, *argv)
    assert code == 2 and message in err


def test_unknown_key_in_the_recipe_is_a_usage_error(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_cpu: true\nbf16: false\nlearning_rat: 0.1\n")
    code, _, err = exit_code(capsys, "train", "--config", str(recipe))
    assert code == 2 and "error: unknown keys in the --config file: learning_rat" in err


#: Per command: its required arguments (FILES: a folder with a model directory, a benchmark file and a run), one
#: `--config` key with a non-default value, and the attribute of the parsed dataclasses that must carry it.
CONFIG_CASES = {
    "train": ([], "prompt_column: question\nuse_cpu: true\nbf16: false\n", lambda p: p[0].prompt_column, "question"),
    "demo": (["--output_dir", "FILES/demo"], "max_steps: 7\n", lambda p: p[0].max_steps, 7),
    "serve": (["FILES/model"], "port: 9123\nweight_sync: disk\n", lambda p: (p[0].port, p[0].weight_sync), (9123, "disk")),
    "prepare": (["--dataset_name", "d", "--output_dir", "FILES/p"], "ngram: 5\n", lambda p: p[0].ngram, 5),
    "difficulty": (["--dataset_name", "d", "--model", "FILES/model", "--output_dir", "FILES/d"], "n_math: 4\n",
                   lambda p: p[0].n_math, 4),
    "select-examples": (["--stats", "s.jsonl", "--dataset_name", "d", "--output_dir", "FILES/s"], "top: 3\n",
                        lambda p: p[0].top, 3),
    "eval": (["--model", "FILES/model", "--benchmarks", "FILES/bench.jsonl"], "n: 4\npreset: open-r1\n",
             lambda p: (p[0].settings.n, p[0].settings.temperature, p[0].output_dir), (4, 0.6, "FILES/model/eval")),
    "plot": (["FILES"], "smooth: 3\n", lambda p: p[0].smooth, 3),
    "model": (["smollm2"], "output_dir: models/smollm2\n", lambda p: (p[0].name, p[0].output_dir),
              ("smollm2", "models/smollm2")),
}


@pytest.fixture
def config_files(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "bench.jsonl").write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    return tmp_path


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_command_takes_a_config_file(config_files, command):
    """Each command's TRL parser reads `--config cmd.yaml` (as TRL's scripts do): the YAML value reaches the
    arguments dataclass, a flag on the command line wins over it, an unknown key is refused. Parsing only."""
    argv, yaml_text, value_of, expected = CONFIG_CASES[command]
    argv = [a.replace("FILES", str(config_files)) for a in argv]
    expected = tuple(e.replace("FILES", str(config_files)) if isinstance(e, str) else e for e in expected) \
        if isinstance(expected, tuple) else expected
    config = config_files / f"{command}.yaml"
    config.write_text(yaml_text)
    parser = next(c for c in COMMANDS if c.name == command).parser()
    parsed = parse_command(parser, [*argv, "--config", str(config)], vllm_args=command == "serve")
    assert value_of(parsed) == expected
    if command == "demo":
        assert parse_command(parser, [*argv, "--config", str(config), "--max_steps", "9"])[0].max_steps == 9
    config.write_text(yaml_text + "no_such_key: 1\n")
    with pytest.raises(SystemExit) as exited:
        parse_command(next(c for c in COMMANDS if c.name == command).parser(), [*argv, "--config", str(config)])
    assert exited.value.code == 2


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_command_checks_its_config_file(capsys, tmp_path, command):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    for config, message in ((tmp_path / "nope.yaml", "no such file"), (tmp_path / "list.yaml", "must be a YAML mapping")):
        code, _, err = exit_code(capsys, command, "--config", str(config))
        assert code == 2 and f"or1-trl {command}: error: --config {str(config)!r}" in err and message in err


def test_demo_help_prints_its_options_and_runs_nothing(tmp_path):
    result = or1_trl_cli("demo", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: or1-trl demo [-h] [--model {tiny,smollm2}] [--output_dir OUTPUT_DIR]")
    for option, default in (("--model", "tiny"), ("--output_dir", "outputs/or1-demo"), ("--seed", "0"),
                            ("--max_steps", "150"), ("--sft_steps", "60"), ("--generation", "auto")):
        assert re.search(rf"{option} \S+\s.*?\(default:\s+{re.escape(default)}[,) ]", result.stdout, flags=re.S), option
    assert "(default: None)" not in result.stdout  # the model-dependent defaults are said once, in words
    assert os.listdir(tmp_path) == []  # no directory named --help, no outputs/


def test_train_help_shows_the_training_flags(capsys):
    code, out, _ = exit_code(capsys, "train", "--help")
    assert code == 0 and out.startswith("usage: or1-trl train [-h]")
    for flag in ("--model_name_or_path", "--dataset_name", "--answer_column", "--reward {auto,math,code}", "--difficulty_model", "--difficulty_range", "--output_dir",
                 "--entropy_target", "--rejection_sampling", "--learning_rate", "--use_peft"):
        assert flag in out, flag
    assert "--config RECIPE.yaml sets any of these flags from a YAML file" in " ".join(out.split())


def help_groups(text: str) -> dict[str, list[str]]:
    """`{group title: [its flags]}` of an argparse `--help`, in order."""
    groups, title = {}, None
    for line in text.splitlines():
        if re.fullmatch(r"\S.*:", line):
            title = line[:-1]
            groups[title] = []
        elif title and (match := re.match(r"  (-[-\w]+)", line)):
            groups[title].append(match.group(1))
    return groups


def test_train_help_groups_the_flags_ours_first_by_paper_section(capsys):
    """`or1-trl train --help` lists its ~260 flags in groups: the everyday flags first (issue 49: `--max_steps` was at
    line 883), then as the config docstrings group them: the data (ScriptArguments), OR1Config's sections in its
    docstring's order (the paper's), TRL's ModelConfig, then GRPOConfig's and TrainingArguments' sections; each flag
    once (not also as its --dashed-alias, which still parses)."""
    from or1_trl.cli.parsing import docstring_sections
    from or1_trl.cli.train import EVERYDAY_FLAGS

    code, out, _ = exit_code(capsys, "train", "--help")
    assert code == 0 and out.startswith("usage: or1-trl train [-h] [--config RECIPE.yaml]")
    groups = help_groups(out)
    titles = list(groups)
    assert titles[:3] == ["options", "everyday flags", "ScriptArguments"] and groups["options"] == ["-h"]
    assert groups["everyday flags"] == [f"--{name}" for name in EVERYDAY_FLAGS]
    assert next(i for i, line in enumerate(out.splitlines()) if line.startswith("  --max_steps")) < 40
    or1_sections = list(dict.fromkeys(v for v in docstring_sections(OR1Config).values() if v))
    assert titles[3:3 + len(or1_sections)] == [f"OR1Config: {section}" for section in or1_sections]
    assert or1_sections[:2] == ["rejection sampling (§3.1)", "the adaptive entropy (eq. 3.2)"]
    assert titles[3 + len(or1_sections)] == "ModelConfig (TRL)"
    rest = titles[4 + len(or1_sections):]
    assert rest[0] == "GRPOConfig (TRL): the model and reference model"
    assert all(t.startswith("GRPOConfig (TRL)") for t in rest[:rest.index(next(t for t in rest if "transformers" in t))])
    flags = [flag for group in groups.values() for flag in group]
    assert len(flags) == len(set(flags)) > 250 and not any("-" in flag[2:] for flag in flags)  # once, no aliases
    where = {flag: title for title, group in groups.items() for flag in group}
    assert where["--dataset_name"] == where["--max_steps"] == "everyday flags" and where["--reward"] == "ScriptArguments"
    assert where["--rejection_sampling"] == "OR1Config: rejection sampling (§3.1)"
    assert where["--entropy_target"] == where["--use_adaptive_entropy"] == where["--no_use_adaptive_entropy"] == \
        "OR1Config: the adaptive entropy (eq. 3.2)"  # TRL's fields that OR1 documents anew
    assert where["--overwrite_output_dir"] == "OR1Config: the output directory, resuming, and the checks on prompts and rewards"
    assert where["--use_peft"] == "ModelConfig (TRL)"
    assert where["--num_generations_eval"] == "GRPOConfig (TRL): the data preprocessing"
    assert where["--lr_scheduler_type"] == "TrainingArguments (transformers): Learning Rate & Scheduler"
    parsed = train_parser().parse_args_and_config(["--max-steps", "3", "--output-dir", "o", "--use_cpu", "true"])
    assert parsed[1].max_steps == 3  # the alias still parses


@pytest.mark.parametrize("name", ["/nonexistent/or1/model", "./no-such-model", "../no-such-model",
                                  "~/no-such-or1-model", "outputs/run/checkpoint-100"])
def test_train_says_a_model_path_does_not_exist_before_loading_anything(capsys, tmp_path, name):
    code, out, err = exit_code(capsys, "train", "--config", TINY, "--model_name_or_path", name,
                               "--dataset_name", str(tmp_path / "no-dataset-either"))
    assert code == 2 and f"or1-trl train: error: model path {name!r} does not exist" in err


def test_answer_column_defaults_to_the_rewards_column():
    def answer_column(*flags):
        return parse("skywork_or1_math_7b.yaml", "--bf16", "false", "--use_cpu", "true", *flags)[0].answer_column

    assert answer_column() == "answer"
    assert answer_column("--reward", "code") == "tests"
    assert answer_column("--reward", "code", "--answer_column", "unit_tests") == "unit_tests"


def parse(recipe, *extra):
    parser = TrlParser((ScriptArguments, OR1Config, ModelConfig))
    return parser.parse_args_and_config(["--config", os.path.join(RECIPES, recipe), "--dataset_name", "d", *extra])


@pytest.mark.parametrize(
    "recipe,prompts_per_rollout,group,sgd_steps,context",
    [("skywork_or1_math_7b.yaml", 256, 16, 2, 8192), ("skywork_or1_7b.yaml", 256, 16, 1, 16384)],
)
def test_paper_recipes_parse(recipe, prompts_per_rollout, group, sgd_steps, context):
    _, args, model_args = parse(recipe, "--bf16", "false", "--use_cpu", "true")  # no GPU here; parsed as 1 process
    processes = 8  # the 7B recipes are written for configs/accelerate/fsdp2.yaml (one node of 8 GPUs)
    assert args.generation_batch_size * processes == prompts_per_rollout * group and args.num_generations == group
    assert args.sgd_steps_per_rollout == sgd_steps and args.max_completion_length == context
    assert (args.learning_rate, args.beta, args.epsilon, args.temperature, args.entropy_target) == (1e-6, 0.0, 0.2, 1.0, 0.2)
    assert args.rejection_sampling == "compact" and args.use_adaptive_entropy
    assert model_args.model_name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"


def test_dataset_name_reads_local_files_folders_and_trls_data_files(tmp_path):
    from datasets import Dataset

    from or1_trl.data.loading import load_data

    rows = [{"prompt": f"{i}+1=?", "answer": str(i + 1)} for i in range(5)]
    table = Dataset.from_list(rows)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.json").write_text(json.dumps(rows))
    table.to_parquet(str(tmp_path / "train.parquet"))
    table.to_csv(str(tmp_path / "train.csv"), index=False)
    folder = tmp_path / "folder" / "data"
    folder.mkdir(parents=True)
    table.to_parquet(str(folder / "train-00000-of-00001.parquet"))
    for source in ("train.jsonl", "train.json", "train.parquet"):
        assert load_data(str(tmp_path / source)).to_list() == rows, source
    csv = load_data(str(tmp_path / "train.csv")).to_list()  # CSV has no types: the answers are read as numbers
    assert [{k: str(v) for k, v in row.items()} for row in csv] == rows
    assert load_data(str(tmp_path / "folder")).to_list() == rows
    assert load_data("json", data_files=[str(tmp_path / "train.jsonl")]).to_list() == rows  # TRL's form
    assert load_data(None, data_files=[str(tmp_path / "train.jsonl"), str(tmp_path / "train.jsonl")]).to_list() == rows * 2
    assert load_data(str(tmp_path / "train.jsonl"), split="train[:2]").to_list() == rows[:2]
    args = parse("skywork_or1_math_7b.yaml", "--bf16", "false", "--use_cpu", "true", "--data_files", "a.jsonl", "b.jsonl")
    assert args[0].data_files == ["a.jsonl", "b.jsonl"]


def test_train_flags_need_no_bf16_or_use_cpu_without_cuda(tmp_path):
    """`or1-trl train --model_name_or_path M --dataset_name D` parses on a CPU machine (TRL's bf16 default on would be
    transformers' error there); on CUDA bf16 stays on."""
    import torch
    from transformers.utils import is_torch_bf16_gpu_available

    from or1_trl.cli import train_parser

    _, args, _ = train_parser().parse_args_and_config(["--dataset_name", "d", "--output_dir", str(tmp_path / "out")])
    assert args.bf16 is (torch.cuda.is_available() or is_torch_bf16_gpu_available()) and not args.use_cpu


def test_train_script_with_local_model_dataset_and_recipe(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"question": f"Q: {i % 5}+1=? A:", "solution": str(i % 5 + 1)}) + "\n")
    out = tmp_path / "out"
    result = subprocess.run(  # TRL's form of local files: a builder and --data_files
        [sys.executable, os.path.join(ROOT, "examples", "train_or1.py"), "--config", os.path.join(RECIPES, "tiny_cpu.yaml"),
         "--model_name_or_path", model_dir, "--dataset_name", "json", "--data_files", str(data_dir / "train.jsonl"),
         "--prompt_column", "question",
         "--answer_column", "solution", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def test_train_script_reports_missing_column(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text(json.dumps({"prompt": "x", "solution": "1"}) + "\n")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_or1.py"), "--config", os.path.join(RECIPES, "tiny_cpu.yaml"),
         "--model_name_or_path", save_tiny_model(tmp_path / "model"), "--dataset_name", str(data_dir),
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode != 0 and "has no column 'answer'" in result.stderr


def test_code_reward_trains_on_a_tests_column_without_answer_column(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:  # --dataset_name names the file itself
        for i in range(16):
            tests = {"inputs": [f"{i}\n"], "outputs": [f"{i + 1}\n"]}
            f.write(json.dumps({"prompt": f"Print n+1 for n={i}:", "tests": json.dumps(tests)}) + "\n")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "or1_trl.cli", "train", "--config", TINY, "--reward", "code",
         "--model_name_or_path", save_tiny_model(tmp_path / "model"), "--dataset_name", str(data_dir / "train.jsonl"),
         "--output_dir", str(out)],
        capture_output=True, text=True, timeout=600, env=ENV,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "model.safetensors").exists()
    # No checkpoint (save_strategy "no"), yet the card is there: `or1-trl eval --model out` reads its completion length.
    from or1_trl.eval.model_card import trained_completion_length

    assert trained_completion_length(str(out)) == 8  # examples/recipes/tiny_cpu.yaml


def test_tiny_two_stage_recipe_runs_offline_with_its_own_model_and_data(tmp_path):
    """The recipe's launch command, as written in its header: two stages, the demo's tiny model and prompts (none
    given), stage 2 with a longer context and a larger group, and an online filter that really removes prompts —
    the pool checked against the statistics of stage 1 by hand."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(ROOT, "examples", "train_or1.py"),
         "--config", os.path.join(RECIPES, "tiny_cpu_two_stage.yaml"), "--output_dir", str(out),
         "--save_strategy", "steps", "--save_steps", "30"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    state = json.loads((out / "checkpoint-30" / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "stage" in e]
    assert [e["stage"] for e in steps] == [0] * 20 + [1] * 10
    records = [json.loads(line) for line in (out / "prompt_stats.jsonl").read_text().splitlines()]
    assert {r["samples"] for r in records if r["stage"] == 0} <= {8, 16, 24, 32}  # groups of 8 (a prompt may repeat)
    assert all(r["samples"] % 16 == 0 for r in records if r["stage"] == 1)  # groups of 16
    assert max(r["mean_length"] for r in records if r["stage"] == 0) <= 8
    totals = {}
    for r in (r for r in records if r["stage"] == 0):
        n, c = totals.get(r["prompt_id"], (0, 0))
        totals[r["prompt_id"]] = (n + r["samples"], c + r["correct"])
    removed = {pid for pid, (n, c) in totals.items() if c / n >= 0.7}
    assert removed, "the filter must remove prompts in this recipe"
    assert not removed & {r["prompt_id"] for r in records if r["stage"] == 1}
    pool = json.loads((out / "checkpoint-30" / "or1_prompts.json").read_text())["pool"]
    assert set(pool["removed"]) == removed
    assert steps[-1]["pool/size"] < steps[0]["pool/size"] == 2000


def test_one_weight_sync_default_for_the_trainer_and_serve(monkeypatch, tmp_path):
    """`serve.default_weight_sync` decides both `OR1Config.vllm_weight_sync` and `or1-trl serve --weight-sync`:
    nccl only where CUDA is available and the trainer does not set use_cpu."""
    import torch

    from or1_trl.cli import ServeArguments
    from or1_trl.generation.serve import default_weight_sync

    assert OR1Config(output_dir=str(tmp_path), use_cpu=True).vllm_weight_sync == "disk" == default_weight_sync(True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rule's CUDA branch, on this CPU machine
    assert (default_weight_sync(), default_weight_sync(use_cpu=True)) == ("nccl", "disk")
    assert ServeArguments(model=str(tmp_path)).weight_sync == "nccl"
    assert ServeArguments(model=str(tmp_path), weight_sync="disk").weight_sync == "disk"
