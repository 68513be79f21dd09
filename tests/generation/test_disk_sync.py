"""The disk weight sync at memory speed and adapter-only (issue 26): the streaming safetensors writer, the sync
dtype, the tmpfs default directory, the per-phase breakdown and its metrics, and LoRA adapters pushed alone to a
real vLLM CPU server started with `--enable-lora` (their log-probs equal the merged model's)."""

import hashlib
import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import requests
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from or1_trl.generation.server_health import WeightsRefusedError
from or1_trl.generation.disk_sync import SYNC_PHASES, DiskWeightSync
from or1_trl.generation.weight_files import RUN_RECORD, private_dir, user_dir, write_safetensors

from ..conftest import _start_server
from ..helpers import ScriptedReward, logged, tagged_dataset
from ..helpers import DIFF, TOL, model_logprobs, server_args, tied_trainer

LORA_RANK = 4


def test_push_in_the_server_dtype_with_a_breakdown_on_tmpfs(vllm_server, tmp_path):
    """dtype="server" writes what the server computes in (fp32 here: 4 bytes a parameter); "bfloat16" writes half,
    and the server then scores exactly as the bf16-rounded weights do. The breakdown's phases sum to the push."""
    model, tokenizer = tiny_model_and_tokenizer(seed=5, tie_word_embeddings=True)
    tokens = tokenizer("12 + 30 = 42 and 7 + 5 = 12")["input_ids"]
    params = sum(p.numel() for p in model.parameters())
    sync = DiskWeightSync(vllm_server.url, str(tmp_path / "unused"), api_key=vllm_server.api_key, dtype="server")
    sync.check_server()
    assert sync.server_info["dtype"] == "float32" and sync.server_info["max_lora_rank"] == 0
    # Another user planted a link at the name the directory used to have (sha1 of the output dir): not followed.
    victim = tmp_path / "victim"
    victim.mkdir()
    planted = os.path.join("/dev/shm", predictable_name(tmp_path / "_vllm_sync"))
    os.symlink(victim, planted)
    line = sync.use_default_dir(str(tmp_path / "_vllm_sync"), needed_bytes=4 * params)
    assert sync.sync_dir.startswith(f"{user_dir()}/or1-trl-vllm-sync-") and "tmpfs" in line, line
    try:
        assert sync.sync_dir != planted and stat.S_IMODE(os.lstat(sync.sync_dir).st_mode) == 0o700
        sync.push(model.named_parameters())
        files = [os.path.join(root, name) for root, _, names in os.walk(sync.sync_dir) for name in names]
        assert files and {stat.S_IMODE(os.stat(f).st_mode) for f in files} == {0o600}  # the server read them
        assert os.listdir(victim) == []
        assert sync.last_bytes == 4 * params and sync.dtype == torch.float32
        assert set(sync.last_breakdown) == set(SYNC_PHASES) and min(sync.last_breakdown.values()) >= 0
        assert abs(sum(sync.last_breakdown.values()) - sync.last_seconds) < 1e-6
        assert sync.last_breakdown["load"] > 0 and sync.last_breakdown["write"] > 0
        assert (server_logprobs(vllm_server, tokens) - model_logprobs(model, tokens)).abs().max().item() < TOL

        sync.dtype_setting = "bfloat16"
        sync.push(model.named_parameters())
        assert sync.last_bytes == 2 * params
        rounded = tiny_model_and_tokenizer(seed=5, tie_word_embeddings=True)[0]
        rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
        diff = (server_logprobs(vllm_server, tokens) - model_logprobs(rounded, tokens)).abs().max().item()
        moved = (model_logprobs(rounded, tokens) - model_logprobs(model, tokens)).abs().max().item()
        assert diff < TOL < moved, (diff, moved)  # the server holds the rounded weights, and rounding shows
        assert sorted(os.listdir(sync.sync_dir)) == [RUN_RECORD, "weights-000002"]  # only the latest version
    finally:
        import shutil

        shutil.rmtree(sync.sync_dir, ignore_errors=True)
        os.unlink(planted)


def test_default_dir_falls_back_when_tmpfs_has_no_room(vllm_server, tmp_path):
    sync = DiskWeightSync(vllm_server.url, str(tmp_path / "x"), api_key=vllm_server.api_key)
    line = sync.use_default_dir(str(tmp_path / "_vllm_sync"), needed_bytes=2**50)
    assert sync.sync_dir == str(tmp_path / "_vllm_sync") and "/dev/shm has" in line and "need" in line, line
    # the probe: a file written here is read back by the server (a server on another node reads nothing)
    assert sync.can_read(str(tmp_path / "probe")) and os.listdir(tmp_path / "probe") == []
    assert sync.info(str(tmp_path / "absent"), "0" * 32)["probe"] is False
    # A sync dir others can write to (a vllm_sync_dir of the user's choosing): what is planted at the names a push
    # writes, links to their directories, is removed, never written through. Files get the umask's modes there.
    victims = [tmp_path / "victim-partial", tmp_path / "victim-final"]
    for victim, name in zip(victims, ["weights-000001.partial", "weights-000001"]):
        victim.mkdir()
        (tmp_path / "_vllm_sync").mkdir(exist_ok=True)
        (tmp_path / "_vllm_sync" / name).symlink_to(victim)
    sync.check_server()
    sync.push(tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)[0].named_parameters())
    assert [os.listdir(victim) for victim in victims] == [[], []]
    pushed = tmp_path / "_vllm_sync" / "weights-000001"
    assert os.listdir(tmp_path / "_vllm_sync") == [pushed.name] and not pushed.is_symlink()
    umask = os.umask(0o022)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in pushed.iterdir()} == {0o666 & ~umask}


def server_logprobs(server, token_ids, model=None):
    response = requests.post(
        f"{server.url}/v1/completions",
        json={"model": model or server.model_path, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0},
        headers=server.headers,
    )
    response.raise_for_status()
    scored = response.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([scored[i][str(token_ids[i])]["logprob"] for i in range(1, len(token_ids))])


def test_trainer_logs_the_sync_breakdown_and_defaults_to_tmpfs(vllm_server, tmp_path):
    planted = os.path.join("/dev/shm", predictable_name(tmp_path / "_vllm_sync"))
    with open(planted, "w") as f:  # a plain file at the name the directory used to have crashed the trainer
        f.write("planted")
    try:
        trainer = tied_trainer(vllm_server, tmp_path, max_steps=2)
    finally:
        os.unlink(planted)
    sync = trainer.vllm_generation.disk_sync
    assert trainer.args.vllm_sync_dir is None and sync.sync_dir != planted
    assert sync.sync_dir.startswith(f"{user_dir()}/or1-trl-vllm-sync-")
    trainer.train()
    diffs = logged(trainer, DIFF)
    assert len(diffs) == 2 and max(diffs) < TOL, diffs
    for phase in SYNC_PHASES:
        seconds = logged(trainer, f"vllm/sync_seconds/{phase}")
        assert len(seconds) == 2 and min(seconds) >= 0, (phase, seconds)
    params = sum(p.numel() for p in trainer.model.parameters())
    assert logged(trainer, "vllm/sync_bytes") == [4 * params] * 2  # fp32: the server's dtype
    assert sorted(os.listdir(sync.sync_dir)) == [RUN_RECORD, "weights-000002"]
    assert not (tmp_path / "_vllm_sync").exists()


def test_a_config_rejects_unknown_sync_settings(tmp_path):
    args = OR1Config(**tiny_training_args(tmp_path))
    assert (args.vllm_sync_dir, args.vllm_sync_dtype, args.vllm_sync_peft) == (None, "server", "auto")
    with pytest.raises(ValueError, match=r"^vllm_sync_dtype='fp8' is not one of \['server', 'model'"):
        OR1Config(**tiny_training_args(tmp_path, vllm_sync_dtype="fp8"))
    with pytest.raises(ValueError, match=r"^vllm_sync_peft='lora' is not one of \['auto', 'adapter', 'merged'\]"):
        OR1Config(**tiny_training_args(tmp_path, vllm_sync_peft="lora"))


# --- LoRA adapters pushed alone -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_lora_server(tmp_path_factory):
    """The shared server's setup (tied tiny model, fp32, an API key) started with `or1-trl serve --enable-lora`."""
    server = _start_server(tmp_path_factory, "vllm_lora", ("--enable-lora", "--max-lora-rank", "8"))
    yield server
    server.stop()


def lora_model(seed=0):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    peft = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:  # B = 0 at init: give the adapter an effect
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft, tokenizer


def merged_logprobs(peft, tokens):
    peft.merge_adapter()
    try:
        return model_logprobs(peft, tokens)
    finally:
        peft.unmerge_adapter()


def test_serve_enable_lora_sets_vllms_flags_and_runtime_updates(monkeypatch):
    from or1_trl.generation.serve import build_command

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    argv, env = build_command("m", "disk", enable_lora=True, max_lora_rank=32)
    assert argv[argv.index("--enable-lora"):][:3] == ["--enable-lora", "--max-lora-rank", "32"]
    middleware = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--middleware"]
    # adapters only from the sync roots; vLLM adds middleware in order, the last added runs first: the key outermost
    assert middleware == ["or1_vllm_auth.LoRAPathGuard", "or1_vllm_auth.APIKeyMiddleware"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    argv, env = build_command("m", "disk")
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    with pytest.raises(ValueError, match="need weight_sync='disk'"):
        build_command("m", "nccl", enable_lora=True)


def test_serve_refuses_lora_and_sync_root_flags_that_cannot_work_in_one_line(tmp_path):
    serve = [sys.executable, "-m", "or1_trl.cli", "serve", str(tmp_path), "--python", "/bin/false"]
    for flags, message in [(["--weight-sync", "nccl", "--enable-lora"], "need weight_sync='disk' (--weight-sync disk"),
                           (["--weight-sync", "disk", "--max-lora-rank", "8"], "needs enable_lora (--enable-lora)"),
                           (["--weight-sync", "nccl", "--sync-root", "/tmp"], "need weight_sync='disk' (--weight-sync"),
                           (["--weight-sync", "disk", "--sync-root", str(tmp_path / "no")], "not an existing directory")]:
        result = subprocess.run([*serve, *flags], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert message in result.stderr.splitlines()[-1] and "or1-trl serve:" not in result.stdout  # nothing started


def test_adapter_loaded_by_the_server_scores_as_the_merged_model(vllm_lora_server, tmp_path):
    """The adapter alone (PEFT's state dict + adapter_config.json), loaded with /v1/load_lora_adapter under a new
    name per push: the server's log-probs with it equal the merged model's (< 1e-4); the previous one is unloaded."""
    from peft import get_peft_model_state_dict

    server = vllm_lora_server
    sync = DiskWeightSync(server.url, str(tmp_path), api_key=server.api_key, dtype="server")
    sync.check_server()
    assert sync.server_info["max_lora_rank"] == 8 and sync.server_info["runtime_lora"]
    tokens = tiny_model_and_tokenizer()[1]("12 + 30 = 42 and 7 + 5 = 12")["input_ids"]
    for push, seed in enumerate((1, 2), start=1):
        peft, _ = lora_model(seed)
        config = peft.peft_config["default"].to_dict()
        base = None
        if push == 1:
            base = ((n.removeprefix("base_model.model.").replace(".base_layer", ""), p.data)
                    for n, p in peft.named_parameters() if "lora_" not in n)
        sync.push_adapter(get_peft_model_state_dict(peft).items(), config, base=base)
        assert sync.adapter_name == f"or1-lora-{push}" and sync.server_versions() == {push}
        lora_params = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
        assert sync.last_bytes == 4 * lora_params
        served = server_logprobs(server, tokens, model=sync.adapter_name)
        diff = (served - merged_logprobs(peft, tokens)).abs().max().item()
        with peft.disable_adapter():
            base_logprobs = model_logprobs(peft, tokens)
        effect = (merged_logprobs(peft, tokens) - base_logprobs).abs().max().item()
        assert diff < TOL < 100 * TOL < effect, (diff, effect)
    models = requests.get(f"{server.url}/v1/models", headers=server.headers).json()["data"]
    assert sorted(m["id"] for m in models) == sorted([server.model_path, "or1-lora-2"])  # or1-lora-1 unloaded
    assert sorted(os.listdir(tmp_path)) == ["adapter-000002", "base"]
    with open(tmp_path / "adapter-000002" / "adapter_config.json") as f:
        assert json.load(f)["r"] == LORA_RANK


def test_adapters_load_only_from_under_the_sync_roots(vllm_lora_server, tmp_path, outside_dir):
    """vLLM's `/v1/load_lora_adapter` loads an adapter from any path it can read, or from the Hub: a server started
    with `--enable-lora` answers 403 unless `lora_path` is a folder under its sync roots, without links in it."""
    server = vllm_lora_server
    peft, _ = lora_model(1)
    peft.save_pretrained(outside_dir)
    (tmp_path / "link").symlink_to(outside_dir)
    (tmp_path / "linked").mkdir()
    for name in os.listdir(outside_dir):
        os.symlink(os.path.join(outside_dir, name), tmp_path / "linked" / name)
    load = f"{server.url}/v1/load_lora_adapter"
    for path in [outside_dir, str(tmp_path / "link"), str(tmp_path / "linked"), "someone/an-adapter",
                 str(tmp_path / os.path.relpath(outside_dir, tmp_path)), "/etc"]:
        response = requests.post(load, json={"lora_name": "theirs", "lora_path": path}, headers=server.headers)
        assert response.status_code == 403 and "Forbidden" in response.text, (path, response.status_code, response.text)
    peft.save_pretrained(tmp_path / "ours")
    os.chmod(tmp_path / "ours", 0o750)  # others may enter: not a folder the server loads from
    response = requests.post(load, json={"lora_name": "ours", "lora_path": str(tmp_path / "ours")}, headers=server.headers)
    assert response.status_code == 403 and "has mode 0750, not 0700" in response.text, response.text
    os.chmod(tmp_path / "ours", 0o700)
    response = requests.post(load, json={"lora_name": "ours", "lora_path": str(tmp_path / "ours")},
                             headers=server.headers)
    assert response.status_code == 200, response.text
    models = [m["id"] for m in requests.get(f"{server.url}/v1/models", headers=server.headers).json()["data"]]
    assert "ours" in models and "theirs" not in models
    requests.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "ours"}, headers=server.headers)


def test_the_adapter_route_tells_a_caller_without_the_key_nothing(vllm_lora_server, tmp_path, outside_dir):
    """Issue 45, point 4: the adapter route's path guard ran before the key check, so a caller without the key
    learnt the sync roots, whether a path exists, and the names of links in a folder. The key is checked first:
    the same 401, byte for byte, whatever the path."""
    server = vllm_lora_server
    peft, _ = lora_model(1)
    peft.save_pretrained(tmp_path / "ours")
    os.chmod(tmp_path / "ours", 0o700)
    (tmp_path / "linked").mkdir(mode=0o700)
    os.symlink("/etc/passwd", tmp_path / "linked" / "secret-link-name")
    answers = set()
    for path in [str(tmp_path / "ours"), str(tmp_path / "linked"), str(tmp_path / "absent"), outside_dir, "/etc",
                 "someone/an-adapter"]:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            response = requests.post(f"{server.url}/v1/load_lora_adapter", headers=headers, timeout=60,
                                     json={"lora_name": "theirs", "lora_path": path})
            answers.add((response.status_code, response.content, response.headers.get("www-authenticate")))
    [(status, body, _)] = answers
    assert status == 401 and b"secret-link-name" not in body and str(server.sync_root).encode() not in body


def test_peft_training_pushes_only_the_adapter(vllm_lora_server, tmp_path):
    """Two steps with LoRA and the disk sync against a server with --enable-lora: the base is pushed once, then the
    adapter alone each step (bytes far below the merged weights), generation names the adapter, and the server's
    log-probs equal the trainer's at every step."""
    from peft import LoraConfig

    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    merged_bytes = 4 * sum(p.numel() for p in model.parameters())
    trainer = OR1Trainer(
        model, ScriptedReward(),
        args=server_args(vllm_lora_server, tmp_path, learning_rate=5e-2, max_steps=2, vllm_sync_peft="adapter"),
        train_dataset=tagged_dataset(["MIX"] * 16), processing_class=tokenizer,
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    generation = trainer.vllm_generation
    assert generation.adapter_sync
    trainer.train()
    sync = generation.disk_sync
    assert sync.adapter_name == "or1-lora-2" and generation.vllm_client.model == "or1-lora-2"
    adapter_bytes = logged(trainer, "vllm/sync_bytes")
    lora_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert adapter_bytes == [4 * lora_params] * 2 and 4 * lora_params * 50 < merged_bytes
    assert any(p.abs().max() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)
    diffs = logged(trainer, DIFF)
    assert len(diffs) == 2 and max(diffs) < TOL, diffs
    assert sorted(os.listdir(sync.sync_dir)) == [RUN_RECORD, "adapter-000002", "base"]  # the run's record stays


def test_adapter_sync_required_from_a_server_without_lora_says_how_to_start_one(vllm_server, tmp_path):
    from peft import LoraConfig

    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="vllm_sync_peft='adapter': the server does not take LoRA.*--enable-lora"):
        OR1Trainer(model, ScriptedReward(), args=server_args(vllm_server, tmp_path, vllm_sync_peft="adapter"),
                   train_dataset=tagged_dataset(["MIX"] * 16), processing_class=tokenizer,
                   peft_config=LoraConfig(r=LORA_RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


# --- The tmpfs sync directory cannot be hijacked (issue 32, point 4) ------------------------------------------
OTHER_UID = 4242  # a user that is not us (the tests run as root or as a user: chown needs root)


def predictable_name(fallback) -> str:
    """The name the sync directory had before issue 32: computable by any local user from the output directory."""
    return "or1-trl-vllm-sync-" + hashlib.sha1(os.path.abspath(str(fallback)).encode()).hexdigest()[:12]


def shared_tmpfs(path):
    """A directory like /dev/shm: world-writable and sticky (others may add entries, only their owner removes them)."""
    path.mkdir()
    os.chmod(path, 0o1777)
    return path


def needs_root():
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")


def test_private_dir_is_new_0700_and_ignores_whatever_is_planted(tmp_path):
    """Another user plants, at every name they can compute, a symlink to their directory, a plain file, a directory
    of theirs: each call makes a new directory of its own (unpredictable name, created exclusively), mode 0700 even
    under a permissive umask, and writes nothing through what was planted."""
    needs_root()
    shm, victim = shared_tmpfs(tmp_path / "shm"), tmp_path / "victim"
    victim.mkdir()
    fallback = tmp_path / "out" / "_vllm_sync"
    (shm / predictable_name(fallback)).symlink_to(victim)
    (shm / "or1-trl-vllm-sync-").write_text("planted")
    (shm / "or1-trl-vllm-sync-theirs").mkdir()
    os.chown(shm / "or1-trl-vllm-sync-theirs", OTHER_UID, OTHER_UID)
    planted = sorted(os.listdir(shm))
    old_umask = os.umask(0)
    try:
        made = {private_dir(str(shm)) for _ in range(3)}
    finally:
        os.umask(old_umask)
    assert len(made) == 3 and not made & {str(shm / name) for name in planted}
    for path in made:
        info = os.lstat(path)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
        assert os.path.basename(path).startswith("or1-trl-vllm-sync-") and os.path.dirname(path) == str(shm)
    assert os.listdir(victim) == [] and (shm / "or1-trl-vllm-sync-").read_text() == "planted"


def test_private_dir_refuses_a_parent_others_could_tamper_with(tmp_path):
    """Where another user could rename the new directory away and put a link in its place: a parent they own, or
    one anyone may write to without the sticky bit. A link to a proper parent (as /dev/shm -> /run/shm) is fine."""
    needs_root()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}"):
        private_dir(str(theirs))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(PermissionError, match="writable by others and not sticky"):
        private_dir(str(open_dir))
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        private_dir(str(tmp_path / "file"))
    assert os.listdir(theirs) == os.listdir(open_dir) == []
    (tmp_path / "link").symlink_to(shared_tmpfs(tmp_path / "shm"))
    assert os.path.dirname(private_dir(str(tmp_path / "link"))) == str(tmp_path / "shm")


def test_default_dir_falls_back_to_the_output_dir_with_one_warning_on_any_error(tmp_path, caplog):
    """No private directory can be made on this tmpfs: the weights go to `<output_dir>/_vllm_sync` (written with the
    umask's modes, as any saved model), with one warning saying why; nothing is created on the tmpfs."""
    needs_root()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    fallback = tmp_path / "out" / "_vllm_sync"
    sync = DiskWeightSync("http://127.0.0.1:9", str(tmp_path / "unused"))  # the server is never asked
    with caplog.at_level(logging.WARNING, logger="or1_trl.generation.disk_sync"):
        line = sync.use_default_dir(str(fallback), needed_bytes=1, tmpfs=str(theirs))
    warnings = [r.getMessage() for r in caplog.records if r.name == "or1_trl.generation.disk_sync"]
    assert len(warnings) == 1 and f"belongs to uid {OTHER_UID}" in warnings[0] and str(fallback) in warnings[0]
    assert sync.sync_dir == str(fallback) and sync.file_mode == 0o666 and str(fallback) in line
    assert os.listdir(theirs) == []


# --- what a caller of the server's worker RPCs can make it read (issue 32, point 3) -------------------------------


@pytest.fixture
def outside_dir():
    """A directory under no sync root of the test servers (this user's /dev/shm folder and pytest's base temp)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(dir="/var/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_probe_confirms_only_the_trainers_own_file_and_never_returns_content(vllm_server, tmp_path, outside_dir):
    """`or1_server_info(probe_path=...)` used to return the first 256 characters of any file (`/etc/shadow`). It
    answers a boolean now: true only for a `.or1-probe-<32 hex>` regular file under a sync root holding the token."""
    import secrets

    sync = DiskWeightSync(vllm_server.url, str(tmp_path), api_key=vllm_server.api_key)
    token = secrets.token_hex(16)
    name = f".or1-probe-{secrets.token_hex(16)}"
    (tmp_path / name).write_text(token)
    (tmp_path / "secret.txt").write_text("hunter2-secret")
    with open(os.path.join(outside_dir, name), "w") as f:
        f.write(token)
    link = tmp_path / f".or1-probe-{secrets.token_hex(16)}"
    link.symlink_to(os.path.join(outside_dir, name))
    up = os.path.relpath(outside_dir, tmp_path)  # ../../../var/tmp/...: out of the root by traversal
    for path, sent in [("/etc/shadow", "root"), ("/etc/passwd", "root:x:0:0:root:/root:/bin/bash\n"),
                       (str(tmp_path / "secret.txt"), "hunter2-secret"), (os.path.join(outside_dir, name), token),
                       (str(tmp_path / up / name), token), (str(link), token), (str(tmp_path / name), token[::-1]),
                       (str(tmp_path / name), None)]:
        info = sync.info(path, sent)
        assert info["probe"] is False, path
        assert "root:" not in json.dumps(info) and "hunter2" not in json.dumps(info) and token not in json.dumps(info)
    assert sync.info(str(tmp_path / name), token)["probe"] is True
    assert sync.can_read(str(tmp_path / "probe")) and not sync.can_read(outside_dir)
    assert str(vllm_server.sync_root) in sync.info()["sync_roots"]


def test_a_folder_the_server_cannot_trust_is_refused_and_it_keeps_its_weights(vllm_server, tmp_path, outside_dir):
    """A reload from a folder without complete weights used to leave vLLM's parameters on the meta device (`/health`
    200, the next generation killed the engine). Every such folder is refused before the model is touched, a load
    that fails in vLLM's loader is undone, and the server goes on generating with the weights it had; the trainer
    asks twice, then stops (`WeightsRefusedError`, a `ServerDownError`: checkpoint and one line)."""
    pushed, tokenizer = tiny_model_and_tokenizer(seed=6, tie_word_embeddings=True)
    tokens = tokenizer("12 + 30 = 42")["input_ids"]
    sync = DiskWeightSync(vllm_server.url, str(tmp_path / "sync"), api_key=vllm_server.api_key)
    sync.check_server()
    sync.push(pushed.named_parameters())
    other = dict(tiny_model_and_tokenizer(seed=7, tie_word_embeddings=True)[0].named_parameters())
    names = list(other)
    write_safetensors(other.items(), outside_dir)
    (tmp_path / "empty").mkdir()
    write_safetensors([(n, other[n]) for n in names[: len(names) // 2]], str(tmp_path / "half"))
    write_safetensors(other.items(), str(tmp_path / "cut"))
    shard = tmp_path / "cut" / "model-00001.safetensors"
    os.truncate(shard, shard.stat().st_size - 64)
    write_safetensors(other.items(), str(tmp_path / "linked"))
    os.remove(tmp_path / "linked" / "model-00001.safetensors")
    os.symlink(os.path.join(outside_dir, "model-00001.safetensors"), tmp_path / "linked" / "model-00001.safetensors")
    (tmp_path / "link").symlink_to(outside_dir)
    # names and sizes right, one shape wrong: passes the folder check, fails in vLLM's loader, and is undone
    write_safetensors([(n, t[:64] if n == "model.norm.weight" else t) for n, t in other.items()],
                      str(tmp_path / "misshapen"))
    for folder in ("empty", "half", "cut", "linked", "misshapen"):  # 0700: refused for what they hold, not their mode
        os.chmod(tmp_path / folder, 0o700)
    refused = {
        outside_dir: "outside the server's sync roots", "/etc": "outside the server's sync roots",
        str(tmp_path / os.path.relpath(outside_dir, tmp_path)): "outside the server's sync roots",
        str(tmp_path / "link"): "outside the server's sync roots", str(tmp_path / "linked"): "not a regular file",
        str(tmp_path / "empty"): "no .safetensors file", str(tmp_path / "half"): f"lacks {len(names) - len(names) // 2} of",
        str(tmp_path / "cut"): "cut short", str(tmp_path / "misshapen"): "the server keeps its previous weights",
    }
    for path, reason in refused.items():
        result = sync._rpc("or1_reload_weights", weights_path=path, version=99)[0]
        assert result["ok"] is False and reason in result["error"], (path, result)
    assert sync.server_versions() == {1} and requests.get(f"{vllm_server.url}/health").status_code == 200
    assert (server_logprobs(vllm_server, tokens) - model_logprobs(pushed, tokens)).abs().max().item() < TOL

    with pytest.raises(WeightsRefusedError, match=r"weights-000002 \(2 tries; it keeps its previous ones\): .*lacks"):
        sync.push([(n, other[n]) for n in names[:3]])
    assert sync.server_versions() == {1}
    assert (server_logprobs(vllm_server, tokens) - model_logprobs(pushed, tokens)).abs().max().item() < TOL


def test_a_sync_dir_outside_the_servers_roots_stops_the_trainer_before_training(vllm_server, tmp_path, outside_dir):
    with pytest.raises(ValueError, match=r"cannot load from it\. It loads only from under its sync roots .*--sync-root"):
        tied_trainer(vllm_server, tmp_path, vllm_sync_dir=outside_dir)


def test_a_push_the_server_refuses_stops_training_with_a_checkpoint_in_one_line(vllm_server, tmp_path):
    """From step 2 on the trainer writes an incomplete folder (3 tensors): the server refuses it twice, keeps
    generating with the weights of step 1's rollout, and training stops with a complete checkpoint-1 and one line."""
    import itertools

    from transformers import AutoModelForCausalLM, TrainerCallback

    from or1_trl.trainer import checkpoint
    from or1_trl.generation.server_health import ServerDownError

    class CutsThePushesAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                write = sync._write
                sync._write = lambda tensors, final: write(itertools.islice(tensors, 3), final)

    trainer = tied_trainer(vllm_server, tmp_path, max_steps=3)
    sync = trainer.vllm_generation.disk_sync
    trainer.add_callback(CutsThePushesAfterStep1())
    with pytest.raises(ServerDownError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert "\n" not in message and f"The vLLM server at {vllm_server.url} did not load the weights in" in message
    assert "(2 tries; it keeps its previous ones): refused" in message and "lacks" in message
    assert "training stopped at step 1, checkpoint-1 is complete (nothing lost)" in message
    folder = os.path.join(tmp_path, "checkpoint-1")
    assert checkpoint.find_problems(folder, trainer._checkpoint_files()) == []
    tokens = trainer.processing_class("MIX: 3+3=? A: 6")["input_ids"]
    first = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)[0]  # pushed for step 1's rollout
    assert sync.server_versions() == {1}
    assert (server_logprobs(vllm_server, tokens) - model_logprobs(first, tokens)).abs().max().item() < TOL
    trained = AutoModelForCausalLM.from_pretrained(folder)  # step 1's update, refused as step 2's push
    assert (model_logprobs(trained, tokens) - model_logprobs(first, tokens)).abs().max().item() > 100 * TOL
