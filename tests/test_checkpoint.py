"""Complete checkpoints (`or1_trl/checkpoint.py`): a run killed while saving resumes from the last complete one.

The kill is simulated by an exception raised at the exact point on disk where a SIGKILL would leave the folder:
right after transformers wrote `trainer_state.json` (before TRL's and our state files), or in the middle of our
own state files. Nothing runs after it (no `finally` writes state in either code path).
"""

import os

import pytest
import torch
from transformers.trainer_callback import TrainerState

from or1_trl import OR1Config, OR1Trainer, checkpoint
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from .test_trainer import logged, parity_reward, tagged_dataset

COMMON = dict(max_steps=6, learning_rate=1e-3, entropy_target=100.0, save_strategy="steps", save_steps=2, save_total_limit=1)


class Killed(BaseException):
    pass


def make_trainer(output_dir):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(output_dir, **COMMON))
    return OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 16), processing_class=tokenizer)


def names(output_dir):
    return [os.path.basename(folder) for folder in checkpoint.checkpoints(str(output_dir))]


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("full"))
    trainer.train()
    return trainer


@pytest.mark.parametrize("kill_point", ["after_trainer_state", "in_or1_state"])
def test_kill_while_checkpointing_resumes_from_last_complete_checkpoint(tmp_path, monkeypatch, uninterrupted, kill_point):
    """Killed while writing checkpoint-4 (save_total_limit=1): checkpoint-2 must survive (rotation waits for the
    marker), `resume_from_checkpoint=True` must take it, and the resumed run must end exactly where the
    uninterrupted one did — controller, counters and weights (the defect: c 0.01 instead of 0.08 and weights off)."""
    if kill_point == "after_trainer_state":
        save_to_json = TrainerState.save_to_json

        def killing_save(self, path):
            save_to_json(self, path)
            if "checkpoint-4" in path:
                raise Killed

        monkeypatch.setattr(TrainerState, "save_to_json", killing_save)
    else:
        write_json_atomic = checkpoint.write_json_atomic

        def killing_write(path, data):
            if "checkpoint-4" in path and path.endswith("or1_state.json"):
                raise Killed
            write_json_atomic(path, data)

        monkeypatch.setattr(checkpoint, "write_json_atomic", killing_write)
    with pytest.raises(Killed):
        make_trainer(tmp_path).train()
    monkeypatch.undo()
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    assert checkpoint.missing_files(str(tmp_path / "checkpoint-4"), ["or1_state.json"])

    # An explicit resume from the incomplete folder is an error that names what is missing.
    with pytest.raises(ValueError, match=r"checkpoint-4 is incomplete: (entropy_ctrl_state|or1_state)\.json is missing"):
        make_trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))

    resumed = make_trainer(tmp_path)
    resumed.train(resume_from_checkpoint="true")  # as `--resume_from_checkpoint true` passes it
    # log_history = steps 1-2 from checkpoint-2, then the resumed steps 3-6: step for step the uninterrupted run's
    for key in ("entropy_coef", "entropy", "reward", "loss", "skipped_steps"):
        assert logged(resumed, key) == pytest.approx(logged(uninterrupted, key), abs=1e-6), key
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert resumed.entropy_controller.coef == pytest.approx(uninterrupted.entropy_controller.coef)
    assert resumed.or1_rows_forwarded == uninterrupted.or1_rows_forwarded
    expected = params(uninterrupted)
    for name, value in params(resumed).items():
        torch.testing.assert_close(value, expected[name], atol=1e-7, rtol=1e-6, msg=name)
    # The finished run left one complete checkpoint (rotation ran once it was complete).
    assert names(tmp_path) == ["checkpoint-6"]
    assert checkpoint.missing_files(str(tmp_path / "checkpoint-6"), resumed._checkpoint_files()) == []


def test_resume_with_no_complete_checkpoint_is_an_error(tmp_path):
    os.makedirs(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match=r"No complete checkpoint to resume from .*incomplete: \['checkpoint-2'\]"):
        make_trainer(tmp_path).train(resume_from_checkpoint=True)


def test_completeness_rules(tmp_path):
    """Pure functions: the marker is written last and lists the files; any listed file missing = incomplete."""
    folders = {}
    for step in (2, 4, 10):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
        folders[step] = str(folder)
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint name
    (tmp_path / "checkpoint-12").write_text("")  # not a folder
    assert checkpoint.checkpoints(str(tmp_path)) == [folders[2], folders[4], folders[10]]

    required = ["trainer_state.json", "pool.json"]
    checkpoint.write_state(folders[2], {"pool.json": {"ids": [1, 2]}}, required)
    checkpoint.write_state(folders[4], {"pool.json": {"ids": [1]}}, required)
    assert checkpoint.read_state(folders[4], "pool.json") == {"ids": [1]}
    assert checkpoint.missing_files(folders[10], required) == ["pool.json", checkpoint.MARKER_FILE]
    assert checkpoint.last_complete_checkpoint(str(tmp_path), required) == folders[4]

    os.remove(os.path.join(folders[4], "pool.json"))  # a listed file vanished
    assert checkpoint.missing_files(folders[4], ["trainer_state.json"]) == ["pool.json"]
    assert checkpoint.last_complete_checkpoint(str(tmp_path), required) == folders[2]
    assert checkpoint.last_complete_checkpoint(str(tmp_path / "nowhere"), required) is None

    with pytest.raises(RuntimeError, match="lacks"):  # never mark a folder complete that is not
        checkpoint.write_state(folders[10], {}, ["trainer_state.json", "optimizer.pt"])
    assert not os.path.exists(os.path.join(folders[10], checkpoint.MARKER_FILE))
