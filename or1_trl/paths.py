"""Checks of the paths a user gives, made before anything loads (importing this loads nothing heavy): an output
directory (`output_dir_problem`), a model (`model_path_problem`, `local_model_path`), and the Hub a run publishes
to (`hub_push_problem`)."""

from __future__ import annotations

import os
import tempfile


def output_dir_problem(output_dir: str) -> str | None:
    """Why a run cannot write to `output_dir`, or `None`: it (or, if it does not exist yet, its nearest existing
    parent) must be a directory where a file can be created. Tested by creating a temporary file, which is removed."""
    path = os.path.abspath(os.path.expanduser(output_dir))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"cannot be created: {existing!r} is a file"
        return f"output_dir {output_dir!r} {where}; pass a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        where = "is" if existing == path else f"cannot be created: {existing!r} is"
        return f"output_dir {output_dir!r} {where} not writable ({exc.strerror}); pass a directory you can write to"
    return None


def local_model_path(name: str) -> str:
    """`name` with `~` expanded when that names an existing directory (a local model), else `name` unchanged (a Hub
    id, which `~` cannot start)."""
    path = os.path.expanduser(name)
    return path if os.path.isdir(path) else name


def model_path_problem(name: str, flag: str = "--model_name_or_path") -> str | None:
    """Why `name` can be neither a local model directory nor a Hugging Face Hub id, or `None` if it can be one.

    Checked before anything is loaded, so that a mistyped path says so instead of failing later with the Hub's
    "Repo id must be in the form ..." (or a network error, after the Hub's retries). A name that looks like a
    filesystem path (absolute, `./`, `../`, `~`, more than one separator, or a first part that is a directory here:
    `outputs/run` where `./outputs` exists) must exist; anything else must be a valid Hub id. `flag` names the
    argument in the message."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return f"model path {name!r} is a file; pass the model's directory (the one with config.json)"
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    first = name.replace(os.altsep or os.sep, os.sep).split(os.sep)[0]
    looks_like_path = (
        name.startswith(("~", "./", "../", ".\\", "..\\"))
        or os.path.isabs(name)
        or name in (".", "..")
        or sum(name.count(s) for s in separators) > 1
        or name.endswith(tuple(separators))
        or (first != name and os.path.isdir(first))  # `outputs/nope` where ./outputs exists: a path, not a Hub id
    )
    if looks_like_path:
        return (
            f"model path {name!r} does not exist (resolved to {os.path.abspath(path)!r}); pass an existing local "
            "model directory or a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        return f"{flag} {name!r} is neither an existing local directory nor a valid Hub id ({exc})"
    return None


def hub_push_problem(timeout: float = 10.0) -> str | None:
    """Why a run with `push_to_hub=True` could not publish, or `None`: checked before training (issue 49), so that
    a run does not end, after hours, in a traceback from the Hub client. In order: `HF_HUB_OFFLINE` set; no token
    (`hf auth login`, or `HF_TOKEN`); the Hub (`HF_ENDPOINT`, default huggingface.co) unreachable within `timeout`
    seconds, or the token refused. One `GET /api/whoami-v2`."""
    import requests
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return ("push_to_hub=True, but HF_HUB_OFFLINE is set: the Hub cannot be reached. Unset it, or train without "
                "--push_to_hub and publish the output_dir later (`hf upload REPO OUTPUT_DIR`)")
    token = get_token()
    if token is None:
        return ("push_to_hub=True needs a Hugging Face token with write access: run `hf auth login` (or set "
                "HF_TOKEN), or train without --push_to_hub and publish later (`hf upload REPO OUTPUT_DIR`)")
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    try:
        answer = requests.get(f"{endpoint}/api/whoami-v2", headers={"Authorization": f"Bearer {token}"},
                              timeout=timeout)
    except requests.RequestException as error:
        return (f"push_to_hub=True, but the Hub at {endpoint} cannot be reached ({type(error).__name__}): check the "
                "network, or train without --push_to_hub and publish later (`hf upload REPO OUTPUT_DIR`)")
    if answer.status_code == 401:
        return f"push_to_hub=True, but the Hub at {endpoint} refused the token (401): run `hf auth login` again"
    return None
