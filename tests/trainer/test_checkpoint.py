"""Checkpoints and the output directory (`or1_trl/trainer/checkpoint.py`).

- A run killed while saving resumes from the last complete checkpoint. The kill is simulated by an exception raised
  at the exact point on disk where a SIGKILL would leave the folder: right after transformers wrote
  `trainer_state.json` (before TRL's and our state files), or in the middle of our own state files. Nothing runs
  after it (no `finally` writes state in either code path).
- A checkpoint whose model or optimizer file was truncated, emptied or removed after its marker is skipped by
  `resume_from_checkpoint=True`, which says which one and why; a full disk (a real one: a tmpfs) is one line and
  leaves the previous checkpoint the one to resume from.
- Relaunching into an output directory holding a previous run is refused unless the user says continue or start over.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import zlib

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState

from or1_trl import OR1Config, OR1Trainer, cli
from or1_trl.trainer import checkpoint
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import logged, parity_reward, tagged_dataset

COMMON = dict(max_steps=6, learning_rate=1e-3, entropy_target=100.0, save_strategy="steps", save_steps=2, save_total_limit=1)
# Two steps, a checkpoint after each: checkpoint-1 and checkpoint-2, and 2 prompts x 2 steps in prompt_stats.jsonl.
TWO_STEPS = dict(max_steps=2, learning_rate=1e-3, entropy_target=100.0, save_strategy="steps", save_steps=1,
                 save_total_limit=None)


class Killed(BaseException):
    pass


def make_trainer(output_dir, callbacks=None, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(output_dir, **{**COMMON, **overrides}))
    return OR1Trainer(model, parity_reward, args=args, train_dataset=tagged_dataset(["MIX"] * 16), processing_class=tokenizer,
                      callbacks=callbacks)


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
    assert checkpoint.find_problems(str(tmp_path / "checkpoint-4"), ["or1_state.json"])

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
    assert checkpoint.find_problems(str(tmp_path / "checkpoint-6"), resumed._checkpoint_files()) == []


def test_resume_with_no_complete_checkpoint_is_an_error(tmp_path):
    os.makedirs(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match=r"No complete checkpoint to resume from .*incomplete: \['checkpoint-2'\]"):
        make_trainer(tmp_path).train(resume_from_checkpoint=True)




# ---------------------------------------------------------------------------------------------------------------
# The marker: every file, its size and the checksum of its ends
# ---------------------------------------------------------------------------------------------------------------


def crc_of_ends(data: bytes) -> str:
    """The reference: CRC-32 of the first MiB, continued over the last MiB (the whole file up to 2 MiB)."""
    mib = 1 << 20
    head, tail = data[:mib], (data[max(mib, len(data) - mib):] if len(data) > mib else b"")
    return f"{zlib.crc32(tail, zlib.crc32(head)):08x}"


def test_marker_lists_every_file_with_its_size_and_checksum(tmp_path):
    """Pure functions: the marker, written last, fingerprints every file (sub-folders too); `verify` names the file
    and what is wrong with it; a flipped byte in the middle of a large file is, as documented, not covered."""
    folders = {}
    for step in (2, 4, 10):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
        folders[step] = str(folder)
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint name
    (tmp_path / "checkpoint-12").write_text("")  # not a folder
    assert checkpoint.checkpoints(str(tmp_path)) == [folders[2], folders[4], folders[10]]

    shard = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB + 1792 bytes: head, middle and tail differ
    os.makedirs(os.path.join(folders[4], "global_step4"))
    with open(os.path.join(folders[4], "global_step4", "shard.bin"), "wb") as f:
        f.write(shard)
    required = ["trainer_state.json", "pool.json"]
    checkpoint.write_state(folders[2], {"pool.json": {"ids": [1, 2]}}, required)
    checkpoint.write_state(folders[4], {"pool.json": {"ids": [1]}}, required)
    assert checkpoint.read_state(folders[4], "pool.json") == {"ids": [1]}
    files = checkpoint.read_state(folders[4], checkpoint.MARKER_FILE)["files"]
    pool = open(os.path.join(folders[4], "pool.json"), "rb").read()
    assert files == {
        "global_step4/shard.bin": {"size": len(shard), "crc32": crc_of_ends(shard)},
        "pool.json": {"size": len(pool), "crc32": f"{zlib.crc32(pool):08x}"},
        "trainer_state.json": {"size": 2, "crc32": f"{zlib.crc32(b'{}'):08x}"},
    }
    assert checkpoint.find_problems(folders[4], required) == []
    assert checkpoint.find_problems(folders[10], required) == [
        "pool.json is missing", "or1_checkpoint.json is missing (the run stopped before the checkpoint was complete)"]
    assert checkpoint.find_problems(folders[4], [*required, "optimizer.pt"]) == ["optimizer.pt is missing"]  # not listed
    assert checkpoint.last_complete_checkpoint(str(tmp_path), required) == (folders[4], [(folders[10], "; ".join(
        checkpoint.find_problems(folders[10], required)))])

    path = os.path.join(folders[4], "global_step4", "shard.bin")
    damaged = bytearray(shard)
    damaged[len(shard) // 2] ^= 1  # the middle: not covered (size and ends unchanged)
    open(path, "wb").write(damaged)
    assert checkpoint.find_problems(folders[4], required) == []
    damaged[-10] ^= 1  # the last MiB
    open(path, "wb").write(damaged)
    assert checkpoint.find_problems(folders[4], required) == ["global_step4/shard.bin differs from its checksum in the marker (corrupted)"]
    os.truncate(path, 1000)
    assert checkpoint.find_problems(folders[4], required) == [
        f"global_step4/shard.bin is 1000 bytes, the marker says {len(shard)} (truncated or changed)"]
    os.remove(os.path.join(folders[4], "pool.json"))
    assert "pool.json is missing" in checkpoint.find_problems(folders[4], required)
    assert checkpoint.last_complete_checkpoint(str(tmp_path), required)[0] == folders[2]
    assert checkpoint.last_complete_checkpoint(str(tmp_path / "nowhere"), required) == (None, [])

    with pytest.raises(RuntimeError, match="lacks"):  # never mark a folder complete that is not
        checkpoint.write_state(folders[10], {}, ["trainer_state.json", "optimizer.pt"])
    assert not os.path.exists(os.path.join(folders[10], checkpoint.MARKER_FILE))


# ---------------------------------------------------------------------------------------------------------------
# Real runs: damaged checkpoints, relaunch safety, full disk
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run: checkpoint-1, checkpoint-2 (both complete) and 4 lines of prompt_stats.jsonl."""
    out = tmp_path_factory.mktemp("two_steps")
    trainer = make_trainer(out, **TWO_STEPS)
    trainer.train()
    assert names(out) == ["checkpoint-1", "checkpoint-2"] and len(stats_lines(out)) == 4
    return trainer, out


def copy_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run[1], out)
    return out


def stats_lines(output_dir) -> list[str]:
    with open(os.path.join(output_dir, checkpoint.PROMPT_STATS_LOG)) as f:
        return f.read().splitlines()


def snapshot(output_dir) -> dict[str, bytes]:
    found = {}
    for root, _, files in os.walk(output_dir):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, output_dir)] = open(path, "rb").read()
    return found


def zero_last_kib(path):
    with open(path, "r+b") as f:
        f.seek(-1024, os.SEEK_END)
        f.write(b"\0" * 1024)


DAMAGES = {
    "truncated_model": ("model.safetensors", lambda p: os.truncate(p, 1000), r"model\.safetensors is 1000 bytes, the marker says \d+"),
    "empty_optimizer": ("optimizer.pt", lambda p: os.truncate(p, 0), r"optimizer\.pt is 0 bytes, the marker says \d+"),
    "missing_optimizer": ("optimizer.pt", os.remove, r"optimizer\.pt is missing"),
    "zeroed_tail_of_model": ("model.safetensors", zero_last_kib, r"model\.safetensors differs from its checksum"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_skips_a_checkpoint_whose_files_do_not_match_its_marker(tmp_path, two_step_run, caplog, damage):
    """checkpoint-2's model or optimizer damaged after its marker was written (the defect: resume took it and
    crashed): an explicit resume from it is an error saying why; `resume_from_checkpoint=True` skips it, says which
    and why, and trains step 2 from checkpoint-1 exactly as the original run did."""
    original, _ = two_step_run
    out = copy_run(two_step_run, tmp_path)
    name, damage_file, reason = DAMAGES[damage]
    damage_file(str(out / "checkpoint-2" / name))
    with pytest.raises(ValueError, match=rf"Checkpoint {out}/checkpoint-2 is incomplete: {reason}"):
        make_trainer(out, **TWO_STEPS).train(resume_from_checkpoint=str(out / "checkpoint-2"))

    resumed = make_trainer(out, **TWO_STEPS)
    with caplog.at_level(logging.WARNING, logger="or1_trl.trainer.checkpoint"):
        resumed.train(resume_from_checkpoint=True)
    messages = [r.getMessage() for r in caplog.records if r.name == "or1_trl.trainer.checkpoint"]
    assert len(messages) == 2
    assert messages[0].startswith(f"Skipping {out}/checkpoint-2 for resume: ")
    assert re.search(reason, messages[0]), messages[0]
    assert messages[1] == f"Resuming from {out}/checkpoint-1, the newest complete checkpoint."
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2]
    assert logged(resumed, "loss") == pytest.approx(logged(original, "loss"), abs=1e-6)
    assert checkpoint.find_problems(str(out / "checkpoint-2"), resumed._checkpoint_files()) == []  # saved again, complete


def test_missing_resume_path_says_it_does_not_exist(tmp_path):
    trainer = make_trainer(tmp_path / "out", **TWO_STEPS)
    with pytest.raises(ValueError, match=rf"^resume_from_checkpoint {tmp_path}/nowhere/checkpoint-3 does not exist\.$"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere" / "checkpoint-3"))
    assert trainer.state.global_step == 0


REFUSAL = (r"holds a previous run \(checkpoint-1, checkpoint-2, prompt_stats\.jsonl\): pass --resume_from_checkpoint "
           r"true to continue it \(train\(resume_from_checkpoint=True\)\), or --overwrite_output_dir true to start over")


def test_relaunch_into_a_previous_run_is_refused_and_touches_nothing(tmp_path, two_step_run):
    """The defect: a relaunch without --resume_from_checkpoint rotated the earlier checkpoints away and cut
    prompt_stats.jsonl. Now it is refused before training, naming both ways on, and every byte stays."""
    out = copy_run(two_step_run, tmp_path)
    before = snapshot(out)
    trainer = make_trainer(out, **{**TWO_STEPS, "save_total_limit": 1})
    with pytest.raises(ValueError, match=rf"^{out} {REFUSAL}"):
        trainer.train()
    assert trainer.state.global_step == 0 and snapshot(out) == before
    with pytest.raises(ValueError, match="contradict each other: pass one of them"):
        make_trainer(out, **{**TWO_STEPS, "overwrite_output_dir": True}).train(resume_from_checkpoint=True)
    assert snapshot(out) == before


def test_fresh_empty_or_unrelated_output_dirs_are_not_refused(tmp_path):
    checkpoint.check_output_dir(str(tmp_path / "new"), None, False)
    checkpoint.check_output_dir(str(tmp_path), None, False)  # empty
    (tmp_path / "sft").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / checkpoint.PROMPT_STATS_LOG).write_text("")  # empty statistics: nothing to lose
    checkpoint.check_output_dir(str(tmp_path), None, False)
    (tmp_path / checkpoint.PROMPT_STATS_LOG).write_text("{}\n")  # a run killed before its first checkpoint
    with pytest.raises(ValueError, match=r"holds a previous run's prompt_stats\.jsonl but no checkpoint, so "
                                         r"--resume_from_checkpoint true cannot continue it: pass --overwrite_output_dir true"):
        checkpoint.check_output_dir(str(tmp_path), None, False)
    (tmp_path / checkpoint.PROMPT_STATS_LOG).write_text("")
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(ValueError, match=r"holds a previous run \(checkpoint-3\)"):
        checkpoint.check_output_dir(str(tmp_path), None, False)
    with pytest.raises(ValueError, match=r"^--resume_from_checkpoint true: .* holds no checkpoint-N folder"):
        checkpoint.check_output_dir(str(tmp_path / "new"), "true", False)


def test_cli_refuses_a_relaunch_before_the_model_loads(tmp_path, two_step_run, capsys):
    """`or1-trl train` (no model or dataset: the demo's, which would run an SFT warm-up first) exits 2 with the
    reason, before loading anything; `--overwrite_output_dir true` is a flag of the command."""
    out = copy_run(two_step_run, tmp_path)
    before = snapshot(out)
    for argv, message in (
        ([], rf"error: {out} {REFUSAL}"),
        (["--resume_from_checkpoint", str(tmp_path / "nowhere")], rf"error: resume_from_checkpoint {tmp_path}/nowhere does not exist"),
        (["--resume_from_checkpoint", "true", "--overwrite_output_dir", "true"], "contradict each other"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.train(["--output_dir", str(out), "--use_cpu", "true", "--max_steps", "1", *argv])
        assert exited.value.code == 2
        assert re.search(message, capsys.readouterr().err.strip().splitlines()[-1])
    assert snapshot(out) == before
    parsed = cli.train_parser().parse_args_and_config(["--output_dir", str(out), "--use_cpu", "true", "--overwrite_output_dir", "true"])
    assert parsed[1].overwrite_output_dir is True
    assert "--overwrite_output_dir" in cli.train_parser().format_help()


def test_resume_true_continues_and_keeps_the_earlier_statistics(tmp_path, two_step_run):
    out = copy_run(two_step_run, tmp_path)
    earlier = stats_lines(out)
    resumed = make_trainer(out, **{**TWO_STEPS, "max_steps": 3})
    resumed.train(resume_from_checkpoint="true")  # as `--resume_from_checkpoint true` passes it
    lines = stats_lines(out)
    assert lines[:4] == earlier and len(lines) == 6
    assert [json.loads(line)["step"] for line in lines] == [1, 1, 2, 2, 3, 3]
    assert names(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_overwrite_output_dir_starts_over(tmp_path, two_step_run, caplog):
    out = copy_run(two_step_run, tmp_path)
    trainer = make_trainer(out, **{**TWO_STEPS, "max_steps": 1, "overwrite_output_dir": True})
    with caplog.at_level(logging.WARNING, logger="or1_trl.trainer.checkpoint"):
        trainer.train()
    assert (f"overwrite_output_dir=True: starting over in {out}, removed the previous run's "
            "['checkpoint-1', 'checkpoint-2', 'prompt_stats.jsonl'].") in caplog.messages
    assert names(out) == ["checkpoint-1"]
    assert [json.loads(line)["step"] for line in stats_lines(out)] == [1, 1]
    assert TrainerState.load_from_json(str(out / "checkpoint-1" / "trainer_state.json")).max_steps == 1  # the new run's


# A real full disk: a 16 MiB tmpfs (needs root to mount). After checkpoint-1 is saved, a filler file leaves `free`
# bytes: too few for checkpoint-2's model (safetensors says "No space left on device"), or enough for the model but
# not the optimizer (torch.save says only "unexpected pos ...").
DISK_FULL_AT = {"model.safetensors": (64 << 10, "SafetensorError"), "optimizer.pt": (2 << 20, "RuntimeError")}


class FillTheDisk(TrainerCallback):
    def __init__(self, free: int):
        self.free = free

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 1:
            filler = os.path.join(os.path.dirname(args.output_dir), "filler")
            with open(filler, "wb") as f:
                f.write(b"\1" * (shutil.disk_usage(args.output_dir).free - self.free))


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"a real full disk needs a tmpfs, which needs root: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)  # detached now, freed once nothing holds it


@pytest.mark.parametrize("failing_file", list(DISK_FULL_AT))
def test_full_disk_is_one_line_and_the_previous_checkpoint_stays(small_disk, failing_file):
    free, original_error = DISK_FULL_AT[failing_file]
    out = small_disk / "run"
    trainer = make_trainer(out, callbacks=[FillTheDisk(free)], **TWO_STEPS)
    with pytest.raises(checkpoint.DiskFullError) as raised:
        trainer.train()
    message = str(raised.value)
    assert message == (f"no space left on {out}: checkpoint-2 was not saved (its partial folder is removed); free "
                       "space, then --resume_from_checkpoint true (resume from checkpoint-1).")
    assert type(raised.value.__context__).__name__ == original_error  # what it failed in (hidden from the user)
    assert names(out) == ["checkpoint-1"]
    assert checkpoint.resolve_resume(str(out), True, trainer._checkpoint_files()) == str(out / "checkpoint-1")

    os.remove(small_disk / "filler")  # space freed: the run resumes from checkpoint-1 and finishes
    resumed = make_trainer(out, **TWO_STEPS)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and names(out) == ["checkpoint-1", "checkpoint-2"]
    assert checkpoint.find_problems(str(out / "checkpoint-2"), resumed._checkpoint_files()) == []


def test_demo_starts_over_in_its_own_directory_and_says_so(tmp_path, two_step_run, capsys):
    """The README's first command is the exception: run again, it replaces its previous run (a 2-step demo, then a
    1-step one: one checkpoint and one step of statistics left) and says so — the second time only, when there is
    something to replace; another run's directory is refused."""
    from or1_trl.demos.tiny import run_demo

    out = tmp_path / "demo"
    demo = dict(sft_steps=1, save_strategy="steps", save_steps=1, per_device_train_batch_size=16)
    run_demo(str(out), max_steps=2, **demo)
    assert names(out) == ["checkpoint-1", "checkpoint-2"]
    run_demo(str(out), max_steps=1, **demo)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Starting over")]
    assert said == [f"Starting over in {out}: each demo run replaces the previous one there."]  # the second run
    assert names(out) == ["checkpoint-1"]
    assert {json.loads(line)["step"] for line in stats_lines(out)} == {1}

    other = copy_run(two_step_run, tmp_path)
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"holds a training run that is not the demo's \(checkpoint-1, checkpoint-2, "):
        run_demo(str(other), max_steps=1, **demo)
    assert snapshot(other) == before
