"""`python -m or1_vllm_serve [vLLM server flags]`: the server `or1-trl serve` starts — vLLM's own OpenAI-compatible
server (`python -m vllm.entrypoints.openai.api_server`'s `main`, unchanged), which first checks the flags that decide
who can reach the server *as vLLM resolved them*.

vLLM's parser (`FlexibleArgumentParser`) takes abbreviations (`--ho=0.0.0.0` is `--host`), `_` for `-`
(`--api_key`), dotted JSON keys, repeats (the last wins) and `=` forms, so no reading of the command line outside it
can be sure what it will do. Here the namespace vLLM's `main` goes on with is compared, field by field, with what
`or1-trl serve` decided (`$OR1_VLLM_SERVE_EXPECT`, JSON): `host`, `port`, `uds`, `api_key`, `middleware`,
`worker_extension_cls`. Any difference ends the process with one line and exit status 2, before the socket is bound
or the engine starts. The check wraps vLLM's own `validate_parsed_serve_args`, which `main` calls right after parsing,
so the namespace checked is the one served.

When `or1-trl serve` made the server's key (the user gave none), `$OR1_VLLM_KEY_FILE` names the file it goes into
(`or1_private.write_key`: mode 0600, in this user's private folder): the server writes it once its port is bound
(wrapping vLLM's `setup_server`), so a second server that fails to bind the same port never replaces the key of the
one that listens there. The file stays when the server stops: a server started again on that port takes the same
key (`serve.build_command`), and a trainer waiting for it to come back goes on with the key it holds.

Standard library only at import (the server's environment has vLLM, not or1_trl); `or1-trl serve` puts this
directory on the server's `PYTHONPATH`.
"""

from __future__ import annotations

import json
import os
import sys

EXPECT_ENV = "OR1_VLLM_SERVE_EXPECT"
#: Exit status of a refusal (argparse's for a usage error).
REFUSED = 2
#: The namespace fields checked, and the `or1-trl serve` flag that sets each.
CHECKED = {"host": "--host", "port": "--port", "uds": None, "api_key": "--api-key", "middleware": None,
           "worker_extension_cls": None}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def problem(args, expected: dict) -> str | None:
    """Why the parsed `args` (vLLM's namespace) differ from `expected` (the values `or1-trl serve` decided), or
    `None`. Unset values (`None`, `""`, `[]`) are equal."""
    for name, ours in CHECKED.items():
        got, want = getattr(args, name, None) or None, expected.get(name) or None
        if isinstance(got, tuple):
            got = list(got)
        if got != want:
            how = f"set it with or1-trl serve's own {ours}" if ours else "or1-trl serve sets it itself"
            return (f"the vLLM flags given would set {_flag(name)} to {got!r}, not {want!r} (vLLM reads "
                    f"abbreviations, '_' for '-' and repeats): {how}, not through the flags passed to vLLM")
    return None


def main() -> None:
    expected = os.environ.get(EXPECT_ENV)
    if not expected:
        print(f"or1-trl serve: error: ${EXPECT_ENV} is unset: start the server with `or1-trl serve`", file=sys.stderr)
        raise SystemExit(REFUSED)
    expected = json.loads(expected)
    from or1_private import KEY_FILE_ENV, write_key
    from or1_vllm_auth import API_KEY_ENV
    from vllm.entrypoints.launchers import cli_args
    from vllm.entrypoints.launchers.api_server import entry

    validate = cli_args.validate_parsed_serve_args

    def checked(args):
        reason = problem(args, expected)
        if reason:
            print(f"or1-trl serve: error: {reason}", file=sys.stderr, flush=True)
            raise SystemExit(REFUSED)
        return validate(args)

    cli_args.validate_parsed_serve_args = checked  # `entry.main` imports it by name when it runs
    key_path = os.environ.get(KEY_FILE_ENV)
    if key_path:
        bind = entry.setup_server

        def bind_then_publish(*args, **kwargs):
            bound = bind(*args, **kwargs)
            write_key(key_path, os.environ[API_KEY_ENV])
            return bound

        entry.setup_server = bind_then_publish  # `run_server` calls it by its name in `entry`
    entry.main()


if __name__ == "__main__":
    main()
