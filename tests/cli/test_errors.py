"""Wrong input to any command ends it with exit status 2 and one line `or1-trl CMD: error: WHAT` under a one-line
usage (not the 200-option list), before the model loads: bad flag values, a missing or malformed `--config`, an
output directory that is a file or read-only, data that is empty, not UTF-8, not JSON or whose prompts are not text,
a Hub dataset offline, abbreviated flags."""

import json
import os
import stat
import subprocess
import sys

import pytest

import or1_trl
from or1_trl.cli import DEBUG_ENV, main

from ..helpers import ROOT

TINY = os.path.join(ROOT, "examples", "recipes", "tiny_cpu.yaml")


def run_main(capsys, argv):
    """`main(argv)` in-process: exit status and stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


def assert_one_line_error(code, err, command, message):
    """Exit 2; the last two stderr lines are the short usage and the error; no other line says `error`."""
    lines = err.strip().splitlines()
    assert code == 2, err[-2000:]
    assert lines[-1].startswith(f"or1-trl {command}: error: ") and message in lines[-1], lines[-3:]
    assert lines[-2].startswith(f"usage: or1-trl {command} ") and lines[-2].endswith("--help: all of them)"), lines[-2]
    assert len(lines[-2]) < 160  # the required arguments only, not the option list
    assert sum("error" in line.lower() for line in lines) == 1, lines
    assert "Traceback" not in err


@pytest.fixture
def files(tmp_path):
    """An empty model directory (loading it would fail with another error: an expected error proves that nothing
    was loaded) and data files, each wrong in one way."""
    (tmp_path / "model").mkdir()
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "café", "answer": "1"}\n'.encode("latin-1"))
    (tmp_path / "notjson.jsonl").write_text("prompt: 1+1, answer: 2\n")
    (tmp_path / "numbers.jsonl").write_text(json.dumps({"prompt": 7, "answer": "7"}) + "\n")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "train.txt").write_text("1+1\n")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.yaml").write_text("learning_rate: [1e-6\n")
    (tmp_path / "list.yaml").write_text("- use_cpu\n- bf16\n")
    return tmp_path


def read_only_dir(tmp_path):
    """A directory nobody may write to: chmod 555, or /sys where chmod does not stop root."""
    if os.geteuid() == 0:
        return "/sys"
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return str(path)


TRAIN = ["train", "--config", TINY]
DATA_CASES = [
    ("empty.jsonl", "dataset file 'EMPTY' is empty"),
    ("latin1.jsonl", "not UTF-8 text"),
    ("notjson.jsonl", "JSON parse error"),
    ("numbers.jsonl", "column 'prompt' holds Value('int64') values, not prompts"),
    ("blank.jsonl", "no rows"),
    ("train.txt", "is not .jsonl, .json, .parquet, .csv"),
    ("emptydir", "doesn't contain any data files"),
    ("missing.jsonl", "does not exist"),
]


@pytest.mark.parametrize("name,message", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_train_data_errors_before_the_model_loads(capsys, files, name, message):
    dataset = str(files / name)
    code, err = run_main(capsys, [*TRAIN, "--model_name_or_path", str(files / "model"), "--dataset_name", dataset,
                                  "--output_dir", str(files / "out")])
    assert_one_line_error(code, err, "train", message.replace("EMPTY", dataset))


def test_data_files_errors_name_the_file(capsys, files):
    code, err = run_main(capsys, [*TRAIN, "--model_name_or_path", str(files / "model"), "--dataset_name", "json",
                                  "--data_files", str(files / "missing.jsonl"), "--output_dir", str(files / "out")])
    assert_one_line_error(code, err, "train", f"data file {str(files / 'missing.jsonl')!r} does not exist")


ARGUMENT_CASES = [
    (["--num_generations", "1"], "at least 2 generations per prompt"),
    (["--max_completion_length", "0"], "max_completion_length=0 must be an integer >= 1"),
    (["--entropy_target", "-0.2"], "entropy_target=-0.2 must be > 0"),
    (["--output_dir", "FILES/a_file"], "output_dir 'FILES/a_file' is a file"),
    (["--output_dir", "FILES/a_file/run"], "cannot be created: 'FILES/a_file' is a file"),
    (["--output_dir", "READONLY/run"], "cannot be created: 'READONLY' is not writable"),
    # not taken for --max_steps, but named (issue 49)
    (["--max_step", "3"], "unrecognized arguments: --max_step 3; did you mean --max_steps?"),
    (["--learning_rat", "0.1"], "unrecognized arguments: --learning_rat 0.1; did you mean --learning_rate?"),
]


# Issue 32: each accepted and run to exit 0 (or 192 steps for max_steps -5), or a traceback before or during
# training; now one line naming the field before the model loads.
RANGE_CASES = [
    (["--top_p", "2"], "top_p=2.0 must be in (0, 1]"),
    (["--beta", "-1"], "beta=-1.0 must be >= 0 and finite"),
    (["--epsilon", "-1"], "epsilon=-1.0 must be > 0 and finite"),
    (["--epsilon_high", "-1"], "epsilon_high=-1.0 must be > 0 and finite, or None"),
    (["--learning_rate", "1e308"], "learning_rate=1e+308 must be in (0, 10]"),
    (["--learning_rate", "-1"], "learning_rate=-1.0 must be in (0, 10]"),
    (["--save_total_limit", "-1"], "save_total_limit=-1 must be an integer >= 1, or None"),
    (["--entropy_coef_delta", "nan"], "entropy_coef_delta=nan must be >= 0 and finite, or None"),
    (["--max_steps", "-5"], "max_steps=-5 must be an integer >= 1, or -1"),
    (["--num_generations", "0"], "num_generations=0 must be an integer >= 2"),
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps=0 must be an integer >= 1"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size=0 must be an integer >= 1"),
    (["--temperature", "0"], "temperature=0.0 must be > 0 and finite"),
    (["--temperature", "-1"], "temperature=-1.0 must be > 0 and finite"),
]


@pytest.mark.parametrize("flags,message", ARGUMENT_CASES + RANGE_CASES,
                         ids=["num_generations", "max_completion_length", "entropy_target", "output_dir-file",
                              "output_dir-under-a-file", "output_dir-read-only", "abbreviation", "typo",
                              *(" ".join(flags) for flags, _ in RANGE_CASES)])
def test_train_argument_errors(capsys, files, tmp_path, flags, message):
    readonly = read_only_dir(tmp_path)
    flags = [f.replace("FILES", str(files)).replace("READONLY", readonly) for f in flags]
    message = message.replace("FILES", str(files)).replace("READONLY", readonly)
    code, err = run_main(capsys, [*TRAIN, "--model_name_or_path", str(files / "model"), "--dataset_name",
                                  str(files / "missing.jsonl"), "--output_dir", str(files / "out"), *flags])
    assert_one_line_error(code, err, "train", message)  # not the dataset's error: the flags are checked first


CONFIG_CASES = [
    (["--config", "FILES/nope.yaml"], "--config 'FILES/nope.yaml': no such file"),
    (["--config", "FILES/bad.yaml"], "--config 'FILES/bad.yaml' is not valid YAML"),
    (["--config", "FILES/list.yaml"], "must be a YAML mapping (flag: value lines), not list"),
    (["--config", "FILES/latin1.jsonl"], "cannot be read: 'utf-8' codec can't decode"),
    (["--output_dir", "x", "--config"], "--config needs a YAML file"),
]


@pytest.mark.parametrize("argv,message", CONFIG_CASES, ids=["missing", "malformed", "list", "binary", "no-path"])
def test_config_file_errors(capsys, files, argv, message):
    argv = [a.replace("FILES", str(files)) for a in argv]
    code, err = run_main(capsys, ["train", *argv])
    assert_one_line_error(code, err, "train", message.replace("FILES", str(files)))


def test_eval_on_an_empty_file(capsys, files):
    code, err = run_main(capsys, ["eval", "--model", str(files / "model"), "--benchmarks", str(files / "empty.jsonl"),
                                  "--output_dir", str(files / "eval")])
    assert_one_line_error(code, err, "eval", f"benchmark {str(files / 'empty.jsonl')!r}: dataset file")
    assert not (files / "eval").exists()


def test_prepare_and_demo_errors(capsys, files):
    code, err = run_main(capsys, ["prepare", "--dataset_name", str(files / "notjson.jsonl"), "--output_dir",
                                  str(files / "p")])
    assert_one_line_error(code, err, "prepare", "JSON parse error")
    code, err = run_main(capsys, ["demo", "--output_dir", str(files / "a_file")])
    assert_one_line_error(code, err, "demo", "is a file; pass a directory")
    code, err = run_main(capsys, ["demo", "--max_step", "3"])
    assert_one_line_error(code, err, "demo", "unrecognized arguments: --max_step 3")
    code, err = run_main(capsys, ["eval", "--model", "m", "--benchmark", "aime24"])
    assert_one_line_error(code, err, "eval", "unrecognized arguments: --benchmark aime24")


def cli(*args, tmp_path, **env):
    """`or1-trl ARGS` in a fresh interpreter, offline, with an empty Hugging Face cache."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **env}
    return subprocess.run([sys.executable, "-m", "or1_trl.cli", *args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env=env)


def test_offline_hub_benchmarks_are_one_line_errors(tmp_path):
    result = cli("eval", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--benchmarks", "aime24", tmp_path=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, "eval",
                          "benchmark 'aime24': cannot load dataset 'HuggingFaceH4/aime_2024': it is not in the local "
                          "cache and the Hub cannot be reached (HF_HUB_OFFLINE is set)")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    result = cli("prepare", "--dataset_name", "train.jsonl", "--output_dir", "p", "--eval_sets", "aime24",
                 tmp_path=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, "prepare", "evaluation set 'aime24': cannot load dataset")
    assert not (tmp_path / "p").exists()


def test_version_and_debug(tmp_path):
    result = cli("--version", tmp_path=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"or1-trl {or1_trl.__version__}"
    result = cli("--debug", "train", "--config", TINY, "--max_completion_length", "0", tmp_path=tmp_path)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("ValueError: max_completion_length=0 must be an integer >= 1")


def test_debug_env_shows_the_traceback(monkeypatch, files):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="is empty"):
        main([*TRAIN, "--model_name_or_path", str(files / "model"), "--dataset_name", str(files / "empty.jsonl"),
              "--output_dir", str(files / "out")])


def test_training_script_errors_are_one_line_too(tmp_path):
    """examples/train_or1.py calls `train()` without `main()`: the same one line, its usage naming the script."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_or1.py"), "--config", TINY,
                             "--num_generations", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("train_or1.py: error: num_generations=1 must be an integer >= 2 (GRPO requires at least 2 generations")
    assert lines[-2].startswith("usage: train_or1.py [options]")


@pytest.mark.parametrize("argv", [
    ["prepare", "--dataset_name", "FILES/empty.jsonl"],
    ["select-examples", "--stats", "FILES/stats.jsonl", "--dataset_name", "FILES/empty.jsonl"],
    ["difficulty", "--dataset_name", "FILES/empty.jsonl", "--model", "FILES/model"],
    ["eval", "--model", "FILES/model", "--benchmarks", "FILES/empty.jsonl"],
    ["demo"],
], ids=lambda argv: argv[0])
def test_every_command_checks_its_output_dir_first(capsys, files, argv):
    argv = [a.replace("FILES", str(files)) for a in argv]
    code, err = run_main(capsys, [*argv, "--output_dir", str(files / "a_file")])
    assert_one_line_error(code, err, argv[0], f"output_dir {str(files / 'a_file')!r} is a file")


STATS_CASES = [  # prompt_stats.jsonl lines after a good one: what select-examples said before, in the comment
    ({"prompt_id": "a", "stage": 0, "step": 2, "samples": 4, "correct": 1},  # ranked, epochs mixed up silently
     "stats.jsonl:2 has no 'epoch' field, line 1 has one: the file mixes two logs' schemas"),
    ({"step": 2, "loss": 0.1}, "stats.jsonl:2 has no prompt_id, stage, samples, correct"),  # KeyError
    ([1, 2], "stats.jsonl:2 is a JSON list, not a record"),  # TypeError
    ({"prompt_id": "a", "stage": 0, "epoch": None, "step": 2, "samples": 4, "correct": 1},  # TypeError in sort
     "stats.jsonl:2 has epoch=None, not an integer"),
    ({"prompt_id": "a", "stage": 0, "epoch": 1, "step": 2, "samples": "4", "correct": 1},  # TypeError
     "stats.jsonl:2 has samples='4', not an integer"),
    ({"prompt_id": "a", "stage": 0, "epoch": 1, "step": 2, "samples": 4, "correct": 5},  # accuracy 1.25 ranked
     "stats.jsonl:2 has correct=5 outside [0, samples=4]"),
]


@pytest.mark.parametrize("line,message", STATS_CASES, ids=["mixed-epoch", "other-log", "list", "epoch-null",
                                                           "samples-text", "correct-above-samples"])
def test_select_examples_names_the_bad_stats_line(capsys, files, line, message):
    good = {"prompt_id": "a", "stage": 0, "epoch": 0, "step": 1, "samples": 4, "correct": 2}
    (files / "stats.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    (files / "pool.jsonl").write_text(json.dumps({"id": "a", "prompt": "1+1", "answer": "2"}) + "\n")
    code, err = run_main(capsys, ["select-examples", "--stats", str(files / "stats.jsonl"), "--dataset_name",
                                  str(files / "pool.jsonl"), "--output_dir", str(files / "pi1")])
    assert_one_line_error(code, err, "select-examples", f"{files}/{message}")
    assert not (files / "pi1").exists()


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (needs root to mount): room for a run's logs, not for the tiny model's weights."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"a real full disk needs a tmpfs, which needs root: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


@pytest.mark.parametrize("save,what", [(["--save_strategy", "steps", "--save_steps", "1"], "checkpoint-1 was not saved"),
                                       (["--save_strategy", "no"], "the final model was not saved")],
                         ids=["checkpoint", "final-model"])
def test_full_disk_while_saving_is_one_line(capsys, tmp_path, full_disk, save, what):
    """Was a 59-line traceback (the checkpoint's DiskFullError, or safetensors' error of the final save)."""
    from or1_trl.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) + "\n"
                                                  for i in range(4)))
    with pytest.raises(SystemExit) as exc:
        main([*TRAIN, "--model_name_or_path", model, "--dataset_name", str(tmp_path / "train.jsonl"), "--output_dir",
              str(full_disk / "run"), "--max_steps", "1", *save])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 1, err[-2000:]
    assert lines[-1].startswith(f"or1-trl train: error: no space left on {full_disk / 'run'}: {what}"), lines[-3:]
    assert "Traceback" not in err and sum("no space left" in line for line in lines) == 1


def test_nan_logits_at_sampling_are_one_line(capsys, tmp_path):
    """A model whose weights hold a NaN: `or1-trl train` stops at step 1's rollout with one line (was a traceback
    from `torch.multinomial`, a device-side assert on CUDA), exit 1, and nothing saved."""
    import torch

    from or1_trl.testing import save_tiny_model, tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    path = save_tiny_model(tmp_path / "model", model=model, tokenizer=tokenizer)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) + "\n"
                                                  for i in range(4)))
    with pytest.raises(SystemExit) as exc:
        main([*TRAIN, "--model_name_or_path", path, "--dataset_name", str(tmp_path / "train.jsonl"), "--output_dir",
              str(tmp_path / "run"), "--max_steps", "1"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 1, err[-2000:]
    assert lines[-1].startswith(
        "or1-trl train: error: non-finite logits (NaN/inf) at sampling, training step 1 (the step was not trained "
        "on): rows [0, 1, 2, 3, 4, 5, 6, 7] of the 8-row batch; "), lines[-3:]
    assert "Traceback" not in err and not (tmp_path / "run" / "model.safetensors").exists()


def test_unreachable_vllm_server_says_what_it_waits_for_then_one_line(tmp_path):
    """Was: silence for vllm_server_timeout (240 s by default), then TRL's line naming `vllm serve` and no flag."""
    import socket

    from or1_trl.testing import save_tiny_model

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    model = save_tiny_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1=?", "answer": "2"}) + "\n")
    result = cli("train", "--config", TINY, "--model_name_or_path", model, "--dataset_name", "train.jsonl",
                 "--output_dir", "out", "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", url,
                 "--vllm_server_timeout", "2", tmp_path=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, "train",
                          f"no vLLM server answered at {url} within vllm_server_timeout=2 s: start one (`or1-trl serve "
                          "MODEL`) or point --vllm_server_base_url at it")
    waiting = [line for line in result.stderr.splitlines() if line.startswith("Waiting up to")]
    assert waiting == [f"Waiting up to 2 s (vllm_server_timeout) for the vLLM server at {url} to answer /health."]
