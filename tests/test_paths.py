"""Checks of user paths before anything loads (`or1_trl/paths.py`)."""

import os

from or1_trl.paths import model_path_problem
from .helpers import ROOT


def test_model_name_or_path_check():
    assert model_path_problem("Qwen/Qwen2.5-0.5B-Instruct") is None and model_path_problem("gpt2") is None
    assert model_path_problem(ROOT) is None  # an existing directory
    assert "is a file" in model_path_problem(os.path.join(ROOT, "pyproject.toml"))
    assert "neither an existing local directory nor a valid Hub id" in model_path_problem("my model")


def test_a_name_under_a_local_folder_is_a_path_that_must_exist(tmp_path, monkeypatch, capsys):
    """Issue 49: `outputs/nope` where ./outputs exists (one typo from `outputs/run`) is a path, not a Hub id: one error
    line (after the short usage line) at once, from `or1-trl eval` and `or1-trl train` alike, and no Hub request (none
    is reachable here: a request would retry, then end in a traceback)."""
    from .helpers import exit_code

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "run").mkdir(parents=True)
    expected = (f"model path 'outputs/nope' does not exist (resolved to '{tmp_path / 'outputs' / 'nope'}'); pass an "
                "existing local model directory or a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'")
    assert model_path_problem("outputs/nope") == expected
    assert model_path_problem("outputs/run") is None
    assert model_path_problem("someone/model") is None  # no folder `someone` here: a Hub id
    for argv in (["eval", "--model", "outputs/nope"],
                 ["train", "--model_name_or_path", "outputs/nope", "--dataset_name", "data.jsonl",
                  "--output_dir", "outputs/x"]):
        code, out, err = exit_code(capsys, *argv)
        lines = [line for line in err.splitlines() if line.strip()]  # the short usage line, then the error
        assert code == 2 and lines[-1] == f"or1-trl {argv[0]}: error: {expected}", (argv, err)
        assert len(lines) == 2 and lines[0].startswith(f"usage: or1-trl {argv[0]}"), err


def test_publishing_is_checked_before_training(tmp_path, monkeypatch, capsys):
    """Issue 49: `--push_to_hub true` without what publishing needs ends before training in one line saying what is
    missing: HF_HUB_OFFLINE set, no token, or no Hub at the endpoint (here a closed port on this machine)."""
    from or1_trl.paths import hub_push_problem

    from .helpers import exit_code, free_port

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_push_problem().startswith("push_to_hub=True, but HF_HUB_OFFLINE is set")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token file there
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    assert hub_push_problem().startswith("push_to_hub=True needs a Hugging Face token with write access")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    assert hub_push_problem(timeout=5) == (
        f"push_to_hub=True, but the Hub at {endpoint} cannot be reached (ConnectionError): check the network, or "
        "train without --push_to_hub and publish later (`hf upload REPO OUTPUT_DIR`)")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    code, out, err = exit_code(capsys, "train", "--model_name_or_path", "someone/model", "--dataset_name", "data.jsonl",
                               "--output_dir", "run", "--push_to_hub", "true", "--hub_model_id", "me/run")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines[-1] == f"or1-trl train: error: {hub_push_problem(timeout=5)}", err
    assert not (tmp_path / "run").exists()  # nothing was trained or written
