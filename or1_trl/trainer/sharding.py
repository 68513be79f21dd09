"""What `OR1Trainer` does differently across processes (DDP, DeepSpeed ZeRO and FSDP2), in one place.

- **No silent downgrade** (`check_backend`): accelerate quietly trains with something else than the launch asked
  for in some set-ups — FSDP is selected only for GPU-type process groups (`accelerate/state.py`,
  `AcceleratorState.__init__`), so `fsdp2.yaml` on CPUs runs DDP. When the launch (accelerate's environment, or
  `TrainingArguments.fsdp` / `deepspeed`) asked for FSDP or DeepSpeed and the trainer got something else, one line
  before training says what was asked, what was obtained and why: an error, unless `OR1Config.sharding_fallback`
  is `"allow"` (then a warning).
- **A skipped update** (a step with no trainable token on any rank, `trainer/rollout_record.Rollout.skip_update`,
  `UpdateSkip`) runs no log-prob pass and no backward on one process and under DDP (`empty_micro_step`: a zero loss
  that reaches no parameter). Under DeepSpeed and FSDP, whose engines count every micro-step's backward, the
  zero-weight rows still run. On every backend the update is skipped the way accelerate skips one after a gradient
  overflow: the step's last backward runs with `accelerator.sync_gradients` off (DeepSpeed's engine steps *inside*
  `accelerator.backward`, only when syncing; accelerate's optimizer wrapper steps only when syncing), and
  `accelerator.optimizer_step_was_skipped` reads true until the step ends, so transformers leaves the learning-rate
  schedule where it was. Weights, optimizer moments, Adam's step counts, DeepSpeed's engine counters and the schedule
  are as if the step had not happened; the trainer's `global_step` counts it (it consumed a rollout). The step's
  gradients are exact zeros (every row has weight 0), so what ZeRO keeps in its partitions adds nothing to the next
  step's.
- **Stages under DeepSpeed** (`enter_stage`, `check_before_loading`): transformers builds DeepSpeed's engine once per
  `Trainer.train` for one batch shape (`gradient_accumulation_steps`, `train_batch_size`), and a second `train`
  would reuse the first one's engine without its accelerate wrapper. Each stage after the first is such a `train`
  pass (`trainer/stage_run.py`), so at its start the previous engine is destroyed (DeepSpeed's own `destroy`: its ZeRO
  hooks removed), the DeepSpeed config takes the stage's shape, and transformers builds a fresh engine that loads the
  stage-end checkpoint. A DeepSpeed config that fixes `gradient_accumulation_steps` (not "auto") cannot follow stages
  that change it: refused before the model loads.
- **Checkpoints** (`checkpoint_layout`): every rank's shard files (DeepSpeed's `global_step*/`, FSDP's
  `SHARDED_STATE_DICT` folders, the per-rank RNG states) are files the verified marker must list
  (`trainer/checkpoint.py`), so a checkpoint missing one rank's shard is never resumed from.
- **Memory per GPU** (`training_state_gb`, `gathered_gb`): what each backend keeps on each GPU for a model of a given
  size, computed (`benchmarks/sharded_memory.py` writes the table of the recipes in docs/benchmarks.md).

- **Ranks with unequal rows** (`row_gathers_padded`): after rejection's `"compact"` (`recipe/rejection.py`) the
  ranks hold different numbers of rows; TRL's metric gathers in `_compute_loss` need equal shapes, so while the loss
  runs this trainer's `accelerator.gather` NaN-pads per-row tensors first.

Packing under ZeRO-3 and FSDP (every forward gathers parameters) is `packing.same_forward_count`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

SHARDING_FALLBACKS = ("error", "allow")
_GPU_ONLY_FSDP = ("accelerate selects FSDP only for GPU-type process groups (accelerate/state.py, "
                  "AcceleratorState.__init__), and this one is on the CPU")


def _env_true(name: str, environ) -> bool:
    return environ.get(name, "false").lower() in ("1", "true", "yes")


def requested_backend(args, environ=os.environ) -> tuple[str, str] | None:
    """What the launch asked for, `("DEEPSPEED" | "FSDP", where it was asked)`, or `None` (nothing sharded)."""
    if _env_true("ACCELERATE_USE_DEEPSPEED", environ):
        return "DEEPSPEED", "accelerate launch's config (ACCELERATE_USE_DEEPSPEED=true)"
    if getattr(args, "deepspeed", None):
        return "DEEPSPEED", "TrainingArguments.deepspeed"
    if _env_true("ACCELERATE_USE_FSDP", environ):
        return "FSDP", "accelerate launch's config (ACCELERATE_USE_FSDP=true)"
    if getattr(args, "fsdp", None):
        return "FSDP", "TrainingArguments.fsdp"
    return None


def downgrade(requested: tuple[str, str] | None, obtained: str, device_type: str) -> str | None:
    """The line saying what was asked, what was obtained and why, when they differ (`None`: no downgrade)."""
    if requested is None or requested[0] == obtained:
        return None
    asked, where = requested
    why = (_GPU_ONLY_FSDP if asked == "FSDP" and device_type == "cpu" else
           f"accelerate's state was built as {obtained} (a pre-configured state, or the CPU flag of its state)")
    return f"Sharded training: {where} asked for {asked}, but this trainer runs {obtained}: {why}."


def check_backend(trainer) -> None:
    """`downgrade` for `trainer`'s launch: a `ValueError` with the line (`OR1Config.sharding_fallback="error"`, the
    default), or a warning on the main process (`"allow"`; a plain `GRPOConfig` also warns: TRL's behaviour)."""
    line = downgrade(requested_backend(trainer.args), trainer.accelerator.distributed_type.value,
                     trainer.accelerator.device.type)
    if line is None:
        return
    if trainer.args.sharding_fallback == "error":
        raise ValueError(f"{line} Set sharding_fallback='allow' to train with "
                         f"{trainer.accelerator.distributed_type.value} anyway, or launch where the asked backend "
                         "runs.")
    if trainer.accelerator.is_main_process:
        logger.warning(f"{line} Training with it (sharding_fallback='allow').")


def _mark_skipped(optimizer, skipped: bool) -> None:
    """Make `optimizer.step_was_skipped` (accelerate's wrapper) read `skipped`: DeepSpeed's wrapper reads its ZeRO
    optimizer's overflow flag, accelerate's own wrapper the flag its gradient scaler sets. (accelerate exports
    `DeepSpeedOptimizerWrapper` only where DeepSpeed is installed: without it, no optimizer is one.)"""
    import accelerate.utils

    wrapper = getattr(accelerate.utils, "DeepSpeedOptimizerWrapper", None)
    if wrapper is not None and isinstance(optimizer, wrapper):
        optimizer.optimizer.overflow = skipped
    else:
        optimizer._is_overflow = skipped
    if optimizer.step_was_skipped != skipped:
        raise RuntimeError(f"{type(optimizer).__name__}.step_was_skipped does not follow the skip mark (accelerate "
                           "changed): a skipped step would move the learning-rate schedule.")


class UpdateSkip(TrainerCallback):
    """The skipped update of one trainer: `skip()` at the step's last micro-step, before its backward; `skipping`:
    whether the current step's update is skipped. A callback of the trainer: the marks go at the step's end."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.skipping = False

    def skip(self) -> None:
        """Skip the update of the step whose last micro-step is running (call it before that micro-step's backward)."""
        # no DeepSpeed engine step, no optimizer step
        self.trainer.accelerator.gradient_state._set_sync_gradients(False)
        _mark_skipped(self.trainer.optimizer, True)  # transformers then leaves the LR scheduler alone
        self.skipping = True

    def without_passes(self) -> bool:
        """Whether a skipped step's micro-steps run no log-prob pass and no backward: yes on one process and under
        DDP (no forward, no gradient hook, nothing to reduce); no under DeepSpeed and FSDP, whose engines count and
        reduce every micro-step's backward: there the zero-weight rows run, and their gradients are exact zeros."""
        return not (self.trainer.is_deepspeed_enabled or self.trainer.is_fsdp_enabled)

    def empty_micro_step(self) -> torch.Tensor:
        """A micro-step of a skipped step without the model (`without_passes`): a zero loss on a leaf of its own, whose
        backward (transformers') reaches no parameter; at the step's last micro-step the update is skipped (`skip`)."""
        if self.trainer.accelerator.sync_gradients:
            self.skip()
        return torch.zeros((), device=self.trainer.accelerator.device, requires_grad=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.skipping:
            _mark_skipped(self.trainer.optimizer, False)
            self.skipping = False
        return control


def attach(trainer) -> UpdateSkip:
    """After TRL's `__init__`: the backend is the one asked for (`check_backend`); the trainer's `UpdateSkip`."""
    check_backend(trainer)
    skip = UpdateSkip(trainer)
    trainer.add_callback(skip)
    return skip


def check_before_loading(args, shapes) -> None:
    """What DeepSpeed cannot run, as a `ValueError` before the model loads: stages that change the accumulation steps
    with a config that fixes `gradient_accumulation_steps` (not "auto"); `logprob_backend="liger"` under ZeRO-3
    (`logprobs.py`: ZeRO-3 re-partitions the LM head before Liger's backward recomputes with it)."""
    plugin = args.deepspeed_plugin
    if plugin is not None and plugin.zero_stage == 3 and args.logprob_backend == "liger":
        raise ValueError("logprob_backend='liger' cannot run under DeepSpeed ZeRO-3 (it re-partitions the LM head "
                         "before Liger's backward recomputes with it): use logprob_backend 'trl' or 'auto'.")
    fixed = None if plugin is None else plugin.deepspeed_config.get("gradient_accumulation_steps", "auto")
    steps = sorted({shape.gradient_accumulation_steps for shape in shapes})
    if fixed not in (None, "auto") and len(steps) > 1:
        raise ValueError(f"The stages train with gradient_accumulation_steps {steps}, but the DeepSpeed config fixes "
                         f"gradient_accumulation_steps={fixed}: set it to \"auto\" (each stage sets it).")


def enter_stage(trainer, shape) -> None:
    """Before stage `shape`'s `train` pass: under DeepSpeed, the previous pass's engine is destroyed and the config
    takes the stage's batch shape (transformers then builds the stage's engine and loads its checkpoint)."""
    if not trainer.is_deepspeed_enabled:
        return
    if trainer.model_wrapped is not trainer.model:  # the previous stage's engine (none yet in a resumed process)
        trainer.model_wrapped.destroy()  # its ZeRO hooks off the module
        trainer.model_wrapped, trainer.deepspeed = trainer.model, None
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    config["gradient_accumulation_steps"] = shape.gradient_accumulation_steps
    config["train_batch_size"] = (trainer.args.per_device_train_batch_size * shape.gradient_accumulation_steps
                                  * trainer.accelerator.num_processes)


def checkpoint_layout(accelerator) -> list[str]:
    """The files of every rank a checkpoint must hold under this backend, as glob patterns over the checkpoint
    folder (`checkpoint.find_problems`): DeepSpeed's `latest` and each rank's ZeRO shards, FSDP's `SHARDED_STATE_DICT`
    shards, each rank's RNG state."""
    from accelerate.utils import DistributedType

    ranks = range(accelerator.num_processes)
    files = [f"rng_state_{rank}.pth" for rank in ranks] if accelerator.num_processes > 1 else []
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        stage3 = accelerator.state.deepspeed_plugin.zero_stage == 3
        files.append("latest")
        for rank in ranks:
            files.append(f"global_step*/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            if stage3:
                files.append(f"global_step*/zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        if not stage3:
            files.append("global_step*/mp_rank_00_model_states.pt")
    elif accelerator.distributed_type == DistributedType.FSDP:
        if "SHARDED_STATE_DICT" in str(accelerator.state.fsdp_plugin.state_dict_type):
            for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
                files += [f"{folder}/.metadata", *(f"{folder}/__{rank}_*.distcp" for rank in ranks)]
    return files


#: Bytes of training state per parameter on each of `n` GPUs, bf16 compute with fp32 AdamW, as the ZeRO paper counts
#: them (Rajbhandari et al. 2020, §3.1): bf16 weights 2 and gradients 2, fp32 master weights and Adam's two moments
#: 12 (K = 12). DDP keeps all of it on every GPU; ZeRO-2 shards the gradients and the 12; ZeRO-3 everything. FSDP2
#: under accelerate's bf16 keeps the parameters, gradients and moments in fp32, sharded (4 + 4 + 8), and casts a unit
#: to bf16 while it computes (`gathered_gb`).
STATE_BYTES = {
    "ddp": lambda n: 2 + 2 + 12,
    "zero2": lambda n: 2 + (2 + 12) / n,
    "zero3": lambda n: (2 + 2 + 12) / n,
    "fsdp2": lambda n: (4 + 4 + 8) / n,
}
ZERO3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters


def training_state_gb(num_params: int, backend: str, gpus: int) -> float:
    """GB (1e9 bytes) of weights, gradients and AdamW states each GPU holds, training `num_params` parameters on
    `gpus` GPUs with `backend` (`STATE_BYTES`); activations, the gathered parameters (`gathered_gb`) and the vLLM
    engine (on its own GPUs in server mode) come on top."""
    return num_params * STATE_BYTES[backend](gpus) / 1e9


def gathered_gb(backend: str, embeddings: int, layer: int) -> float:
    """GB of bf16 parameters a sharding backend holds whole while it computes, besides `training_state_gb`:
    FSDP2 (`TRANSFORMER_BASED_WRAP`) the root unit — `embeddings`, the input embedding and LM head, which the root
    keeps unsharded from its forward to its backward — and two decoder layers of `layer` parameters (the one computing,
    the one prefetched); ZeRO-3 at most `stage3_max_live_parameters`; DDP and ZeRO-2 none (their weights are whole)."""
    if backend == "fsdp2":
        return 2 * (embeddings + 2 * layer) / 1e9
    if backend == "zero3":
        return 2 * min(ZERO3_MAX_LIVE_PARAMETERS, embeddings + 2 * layer) / 1e9
    return 0.0


@contextmanager
def row_gathers_padded(accelerator, active: bool = True):
    """While open (and `active`), `accelerator.gather` NaN-pads floating per-row tensors to the longest rank's row
    count first.

    After `"compact"` the ranks hold different numbers of rows, but TRL's `_compute_loss` gathers two per-row
    metrics (`clip_ratio/low_min`, `clip_ratio/high_max`) with a plain all-gather, which needs equal shapes: with
    unequal rows gloo aborts ("Received data size doesn't match expected size"). TRL reduces both with `nanmin` /
    `nanmax`, and rows with no kept token are already NaN there, so NaN padding changes no metric. Scalars and
    integer tensors are gathered as they are. Scoped to this accelerator object (an instance attribute, removed on
    exit), so other trainers in the process are untouched. Each padded gather costs one more collective (the sizes),
    so the trainer sets `active` only for a batch from `"compact"`: otherwise every rank holds the same rows.
    """
    if not active or accelerator.num_processes == 1:
        yield
        return
    gather = accelerator.gather

    def padded_gather(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.ndim > 0 and tensor.is_floating_point():
            tensor = accelerator.pad_across_processes(tensor, dim=0, pad_index=float("nan"))
        return gather(tensor)

    accelerator.gather = padded_gather
    try:
        yield
    finally:
        del accelerator.gather  # the class's method again
