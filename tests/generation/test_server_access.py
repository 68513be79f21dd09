"""Who may steer a vLLM server started by `or1-trl serve`, and what a killed run leaves behind (issue 45, points 4 and
5): web pages (Host, Origin) and callers without the key are refused before any route, reloads come only from folders
no other user could write, sync roots others can write to are refused in one line, and the sync folders of runs
that ended without cleaning up are removed by the next run — only those provably ours and of a dead process.

The middleware is called directly (plain ASGI, no server); the real vLLM CPU server (`vllm_server`, started without
a key as `or1-trl serve MODEL` is) shows the same end to end, with requests sent as another user (`runuser -u
nobody`)."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import requests
import torch

from or1_trl.generation.vllm_ext.or1_private import read_key
from or1_trl.generation.vllm_ext.or1_vllm_auth import API_KEY_ENV
from or1_trl.generation.weight_files import RUN_RECORD, private_dir, remove_ended_runs, run_identity, write_safetensors

from ..helpers import NOBODY, needs_root, private


# --- where the server loads weights from ------------------------------------------------------------------------


def test_a_reload_from_a_folder_another_user_could_write_is_refused(tmp_path, monkeypatch):
    """`check_weights_dir` (the server's check before `or1_reload_weights`): complete weights in a folder of another
    user's, one group or others may write to or enter, under a folder others may write to, or holding a file of
    another user's, are refused in one line naming the reason; the same weights in a 0700 folder of ours load."""
    from or1_trl.generation.vllm_ext.or1_vllm_auth import lora_path_problem
    from or1_trl.generation.vllm_ext.or1_vllm_worker import SYNC_ROOTS_ENV, check_weights_dir

    needs_root()
    monkeypatch.setenv(SYNC_ROOTS_ENV, private(tmp_path))
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, 2)}

    def weights(*parts):
        write_safetensors(tensors.items(), str(tmp_path.joinpath(*parts)))
        return private(tmp_path.joinpath(*parts))

    assert check_weights_dir(weights("good"), {"a", "b"}) == (str(tmp_path / "good"), {"a", "b"})
    refused = {}
    theirs = weights("theirs")
    os.chown(theirs, NOBODY, NOBODY)
    for name in os.listdir(theirs):
        os.chown(os.path.join(theirs, name), NOBODY, NOBODY)
    refused[theirs] = f"{theirs} belongs to uid {NOBODY}, not to this user"
    for mode, reach in ((0o770, "write to"), (0o707, "write to"), (0o750, "enter")):
        folder = weights(f"mode-{mode:o}")
        os.chmod(folder, mode)
        refused[folder] = f"has mode {mode:04o}, not 0700: other users can {reach} it"
    os.makedirs(tmp_path / "open")
    os.chmod(tmp_path / "open", 0o777)
    refused[weights("open", "inner")] = f"{tmp_path / 'open'} has mode 0777: other users can write to it"
    planted = weights("planted")
    os.chown(os.path.join(planted, "model-00001.safetensors"), NOBODY, NOBODY)  # as if moved in by them
    refused[planted] = f"belongs to uid {NOBODY}, not to the server's user"
    for folder, reason in refused.items():
        with pytest.raises(ValueError) as refusal:
            check_weights_dir(folder, {"a", "b"})
        assert reason in str(refusal.value) and "\n" not in str(refusal.value), (folder, refusal.value)
        if folder != planted:  # LoRA adapters are loaded from the same kind of folder only
            assert reason in lora_path_problem(json.dumps({"lora_path": folder}).encode()), folder
    assert lora_path_problem(json.dumps({"lora_path": str(tmp_path / "good")}).encode()) is None


ROOTS_OTHERS_WRITE = ["/", "/tmp", "/dev", "/dev/shm"]


@pytest.mark.parametrize("root", ROOTS_OTHERS_WRITE + ["open", "group", "theirs", "under-open"])
def test_serve_refuses_a_sync_root_others_can_write_to_in_one_line(capsys, tmp_path, root):
    """`--sync-root /` (or `/tmp`, `/dev`, `/dev/shm`, a folder of another user's, one others may write to or
    enter, one under a folder anyone may rename things in) was accepted silently: anyone who can write somewhere
    under it could have the server load their weights. Exit 2 and one line, before vLLM starts."""
    from or1_trl.cli.serve import serve

    if root in ("open", "group", "theirs", "under-open"):
        needs_root()
        folder = tmp_path / root / "sync" if root == "under-open" else tmp_path / root
        folder.mkdir(parents=True)
        os.chmod(folder, {"open": 0o777, "group": 0o750}.get(root, 0o700))
        if root == "theirs":
            os.chown(folder, NOBODY, NOBODY)
        if root == "under-open":
            os.chmod(folder.parent, 0o777)
        root = str(folder)
    with pytest.raises(SystemExit) as exit:
        serve([str(tmp_path), "--weight-sync", "disk", "--sync-root", root, "--python", "/bin/false"])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == "", out  # nothing started ("or1-trl serve: <command>" comes first)
    usage, error = err.splitlines()
    assert usage.startswith("usage: ") and error.startswith(f"or1-trl serve: error: --sync-root {root}: ")
    assert "A sync root must be a folder of yours with mode 0700" in err


# --- the sync folders of runs that ended (point 5) --------------------------------------------------------------
KILLED_RUN = """import os, sys
from or1_trl.generation.weight_files import private_dir
path = private_dir(sys.argv[1])
with open(os.path.join(path, "weights"), "wb") as f:
    f.write(b"w" * 1000)
print(path, flush=True)
os.kill(os.getpid(), 9)
"""


def killed_run(parent) -> str:
    """The sync folder of a run killed with SIGKILL (no exit hook ran) after it wrote 1000 bytes of weights."""
    result = subprocess.run([sys.executable, "-c", KILLED_RUN, str(parent)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == -9, result.stderr[-2000:]
    return result.stdout.strip()


def test_the_next_run_removes_only_folders_provably_ours_and_of_an_ended_run(tmp_path):
    """A run killed with `kill -9` leaves its folder (its weights, in RAM on tmpfs). The next run removes it, and one
    whose pid now belongs to a process started at another time (the pid was taken again); it leaves a live run's,
    another user's, a link (and what it points to), a folder others can enter, one without a record or whose record
    is a link, and one of a run in another pid namespace or boot."""
    needs_root()
    parent = tmp_path / "or1-trl-0"
    parent.mkdir(mode=0o700)
    dead = killed_run(parent)
    reused = private_dir(str(parent))
    reused_record = f"{os.getpid()} 1 {' '.join(run_identity().split()[2:])}"  # this pid, started at another time
    with open(os.path.join(reused, RUN_RECORD), "w") as f:
        f.write(reused_record)
    live = private_dir(str(parent))
    dead_record = open(os.path.join(dead, RUN_RECORD)).read()
    kept = {"live": live}
    for name in ("theirs", "wide", "no-record", "linked-record", "elsewhere"):
        folder = parent / f"or1-trl-vllm-sync-{name}"
        folder.mkdir(mode=0o700)
        if name != "no-record":
            (folder / ("real-record" if name == "linked-record" else RUN_RECORD)).write_text(
                dead_record.replace(dead_record.split()[2], "another-boot") if name == "elsewhere" else dead_record)
        kept[name] = str(folder)
    os.symlink(parent / "or1-trl-vllm-sync-linked-record" / "real-record",
               parent / "or1-trl-vllm-sync-linked-record" / RUN_RECORD)
    os.chown(kept["theirs"], NOBODY, NOBODY)
    os.chmod(kept["wide"], 0o755)
    target = tmp_path / "target"
    shutil.copytree(dead, target)
    os.symlink(target, parent / "or1-trl-vllm-sync-link")
    removed, freed = remove_ended_runs(str(parent))
    assert removed == sorted([dead, reused]) and freed == 1000 + len(dead_record) + len(reused_record)
    assert not os.path.exists(dead) and not os.path.exists(reused)
    assert all(os.path.isdir(folder) for folder in kept.values()) and (target / "weights").stat().st_size == 1000
    assert os.path.islink(parent / "or1-trl-vllm-sync-link")
    assert remove_ended_runs(str(parent)) == ([], 0)


def test_the_trainer_says_in_one_line_what_it_removed(tmp_path, caplog):
    """`DiskWeightSync.use_default_dir`, the trainer's choice of its sync folder: the folders of this user's ended
    runs go first, in one warning line with their count, size and paths (here tmpfs has no room left afterwards, so
    the server is never asked)."""
    import logging

    from or1_trl.generation.disk_sync import DiskWeightSync

    from or1_trl.generation.weight_files import user_dir

    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    ended = [killed_run(user_dir(base=str(shm))) for _ in range(2)]
    sync = DiskWeightSync("http://127.0.0.1:9", str(tmp_path / "unused"))
    with caplog.at_level(logging.WARNING, logger="or1_trl.generation.disk_sync"):
        sync.use_default_dir(str(tmp_path / "fallback"), needed_bytes=2**50, tmpfs=str(shm))
    lines = [r.getMessage() for r in caplog.records if r.name == "or1_trl.generation.disk_sync"]
    assert len(lines) == 1 and lines[0].startswith("removed 2 weight-sync folders of ended runs (0.0 GB): ")
    assert lines[0].split(": ", 1)[1] == ", ".join(sorted(ended))
    assert not any(os.path.exists(path) for path in ended)


# --- end to end, on the real server started without a key --------------------------------------------------------
AS_NOBODY = ["runuser", "-u", "nobody", "--"]


def curl_as_nobody(url, *args) -> str:
    """The HTTP status another local user (`nobody`) gets for `curl url args`."""
    result = subprocess.run([*AS_NOBODY, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *args, url],
                            capture_output=True, text=True, timeout=120)
    return result.stdout


def test_another_local_user_can_neither_read_the_key_nor_steer_the_server(vllm_server, tmp_path):
    """The attacks of issue 45, point 4, as `nobody`, on a server started without a key: the key file is not
    theirs to read; a reload of their weights answers 401 and leaves the weights version alone; a browser-style
    `POST /sleep?level=1` (another site's Host and Origin, `text/plain`) answers 403 and the server keeps
    generating. Their weights, placed under a sync root, are refused even to a caller holding the key."""
    from or1_trl.generation.disk_sync import DiskWeightSync
    from or1_trl.testing import tiny_model_and_tokenizer

    needs_root()
    if shutil.which("runuser") is None or shutil.which("curl") is None:
        pytest.skip("runuser and curl run a request as another user")
    assert read_key(vllm_server.key_file) == vllm_server.api_key  # the fixture's key is the one the server made
    assert stat.S_IMODE(os.stat(vllm_server.key_file).st_mode) == 0o600
    cat = subprocess.run([*AS_NOBODY, "cat", vllm_server.key_file], capture_output=True, text=True, timeout=60)
    assert cat.returncode != 0 and "Permission denied" in cat.stderr and vllm_server.api_key not in cat.stdout
    sync = DiskWeightSync(vllm_server.url, str(tmp_path / "sync"), api_key=vllm_server.api_key)
    before = sync.server_versions()
    reload = json.dumps({"method": "or1_reload_weights", "kwargs": {"weights_path": "/dev/shm/x", "version": 77}})
    rpc = ["-X", "POST", "-H", "Content-Type: application/json", "-d", reload]
    assert curl_as_nobody(f"{vllm_server.url}/collective_rpc", *rpc) == "401"
    page = ["-X", "POST", "-H", "Host: evil.example.com", "-H", "Origin: http://evil.example.com",
            "-H", "Content-Type: text/plain", "-d", "x"]
    assert curl_as_nobody(f"{vllm_server.url}/sleep?level=1", *page) == "403"
    assert curl_as_nobody(f"{vllm_server.url}/health", "-H", "Host: evil.example.com") == "403"
    assert curl_as_nobody(f"{vllm_server.url}/health") == "200"
    assert sync.server_versions() == before and 77 not in before
    keyed = {"headers": vllm_server.headers, "timeout": 120}
    assert requests.get(f"{vllm_server.url}/is_sleeping", **keyed).json()["is_sleeping"] is False
    completion = requests.post(f"{vllm_server.url}/v1/completions", **keyed,
                               json={"model": vllm_server.model_path, "prompt": "1", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2

    theirs = tmp_path / "theirs"  # under the server's sync root (pytest's base temp), complete, 0700: not ours
    tiny_model_and_tokenizer(seed=9, tie_word_embeddings=True)[0].save_pretrained(theirs, safe_serialization=True)
    os.chmod(theirs, 0o700)
    for path in [theirs, *theirs.iterdir()]:
        os.chown(path, NOBODY, NOBODY)
    [result] = sync._rpc("or1_reload_weights", weights_path=str(theirs), version=78)
    assert result["ok"] is False and f"belongs to uid {NOBODY}, not to this user" in result["error"], result
    assert sync.server_versions() == before


def test_the_trainer_finds_the_key_the_server_made(vllm_server, tmp_path, monkeypatch):
    """No key anywhere on the trainer's side (no flag, no variable): the trainer reads the key `or1-trl serve` made
    for the server's port and trains against it; the server's log-probs match the trainer's after each sync."""
    from ..helpers import DIFF, TOL, logged, tied_trainer

    for name in (API_KEY_ENV, "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert requests.get(f"{vllm_server.url}/v1/models", timeout=60).status_code == 401
    trainer = tied_trainer(vllm_server, tmp_path, vllm_server_api_key=None, max_steps=2)
    assert trainer.vllm_generation.vllm_client.api_key == vllm_server.api_key
    trainer.train()
    diffs = logged(trainer, DIFF)
    assert len(diffs) == 2 and max(diffs) < TOL, diffs
