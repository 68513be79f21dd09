"""The non-finite sentinel (`OR1Config.nonfinite_stop_after`): a gradient holding a NaN or an infinity never reaches
the weights, and a run that keeps producing them stops with its last finite weights saved and one line saying why.

A NaN that enters the weights is not seen where it enters: the next sampling step dies in a device-side assert
(`torch.multinomial`), or the run trains on garbage. So, every optimizer step, on every rank:

- **Seen before it is clipped.** Once the step's last backward has run (the micro-step whose gradients are
  synchronised), before transformers clips them (`clip_grad_norm_` multiplies every gradient by a factor that a single
  NaN makes NaN), each trainable parameter's gradient on this rank is reduced to one number: its L1 norm, all of them
  in one fused call (`torch._foreach_norm`, what `clip_grad_norm_` itself uses), kept in a `[P + 1]` tensor on the
  device (no host sync). A norm is finite exactly when every element is (a NaN or an infinity makes it NaN or
  infinite; so would finite values whose sum passes the dtype's range, about 3.4e38 in fp32 and bf16, a gradient as
  broken). Gradients accumulate over micro-steps, and a NaN or an infinity stays non-finite in the sum, so one look
  per step sees every micro-step's. Under DDP the gradients are then averaged across ranks: a NaN on one rank is seen
  on all. Under DeepSpeed, whose ZeRO stages keep gradients in partitions of their own (`param.grad` is empty), a
  tensor hook per parameter (`Tensor.register_hook`) sums each gradient as the backward produces it, before ZeRO
  reduces it. Under FSDP2, whose module parameters are shards autograd never differentiates, each rank's reduced
  shard is summed before the optimizer step. Each micro-step's loss is added to the last entry (`count_loss`).
- **One decision on every rank.** At the step's boundary (`on_pre_optimizer_step`, after the last backward) each rank
  marks its non-finite entries (1 or 0) and one all-reduce sums the marks of all ranks (`[P + 1]` values), read once:
  per parameter, the ranks where its gradient held a NaN/inf; last, the ranks where a loss did.
- **Not applied.** A step with any marked gradient is not applied on any rank, the way a fully rejected step
  is not (`sharding.UpdateSkip`): the optimizer does not step (Adam's moments and step counts unchanged), the
  learning-rate schedule does not move, `global_step` counts the step (it consumed a rollout), and the gradients are
  dropped (transformers' `model.zero_grad()`). Under DeepSpeed the engine steps inside the last backward, and ZeRO
  has already skipped the step itself (its global gradient norm is not finite: `overflow`, its gradients cleared, the
  engine's `skipped_steps` counted); the sentinel checks that it did, and stops the run at once if it did not (a
  bf16 config with `check_grad_overflow: false`), since the weights may then hold the values.
- **Stopped.** After `stop_after` such steps in a row the run stops at that step's end: transformers logs the step
  and saves a complete checkpoint (the weights of the last applied update, all finite), and once it is saved
  (`on_save`) every rank raises `NonFiniteStop`, one line naming the step, the first parameters whose gradients held
  the values and how to resume (`--resume_from_checkpoint true`).

Logged at every step (counts since the run began, kept across a resume by the checkpoint's OR1 state, never averaged;
`trainer_state.json`'s log history keeps them): `nonfinite_steps` (steps not applied), `nonfinite_grads` (gradients
that held a NaN/inf, one per parameter and step, whichever ranks saw it), `nonfinite_losses` (ranks and steps whose
loss did). Under DeepSpeed a gradient that is finite on every rank and overflows only in the sum across ranks is not
seen by the hooks (DeepSpeed's own check covers it).

Cost (`benchmarks/nonfinite_sentinel.py`): one fused norm of the gradients and one all-reduce of `P + 1` values a
step. The first design, a tensor hook per parameter in every backward, cost 8.8 ms of a 154 ms update on an H200
(SmolLM2-135M's 272 parameters: two kernel launches and a Python call each).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from .sharding import UpdateSkip

#: The counters logged at every step, as `trainer_state.json` and W&B (`train/...`) show them.
STEPS_METRIC, GRAD_METRIC, LOSS_METRIC = "nonfinite_steps", "nonfinite_grads", "nonfinite_losses"
NAMES_SHOWN = 3  # parameters named in the stop line


class NonFiniteStop(RuntimeError):
    """The run stopped after `OR1Config.nonfinite_stop_after` steps in a row whose gradients held NaN or inf."""


def gradient_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s sum as a 0-d fp32 tensor on its device (no host sync): not finite when any element is not."""
    return tensor.detach().sum().float()


def gradient_norms(gradients: list[torch.Tensor]) -> torch.Tensor:
    """`[len(gradients)]` fp32 on their device (no host sync): each gradient's L1 norm, in one fused call
    (`torch._foreach_norm`, as `clip_grad_norm_` computes its norms); not finite where any element is not."""
    if not gradients:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm([g.detach() for g in gradients], 1)).float()


class NonFiniteSentinel(TrainerCallback):
    """The sentinel of one trainer (module docstring), one of its callbacks: `attach` builds it; the trainer calls
    `count_loss` after each micro-step.

    Args:
        trainer: the `OR1Trainer` (its accelerator, model, optimizer and `update_skip`).
        stop_after: the run stops after this many non-finite steps in a row (`OR1Config.nonfinite_stop_after`);
            `None`: the sentinel is off (not a callback of the trainer, counts nothing: TRL's behaviour).
    """

    def __init__(self, trainer, stop_after: int | None):
        self.trainer, self.stop_after = trainer, stop_after
        self.steps = self.grads = self.losses = 0  # since the run began (checkpointed)
        self.in_a_row = 0
        self.stop_line: str | None = None
        self.first_bad = ""  # the parameters named for the last non-finite step
        self._names: list[str] = []
        self._params: list[torch.nn.Parameter] = []
        self._hooks: list = []
        self._sums: torch.Tensor | None = None  # [P + 1]: per parameter, then the losses, this rank, this step
        self._indices: tuple[tuple, torch.Tensor | None] = ((), None)  # the parameters with a gradient, when not all
        self._bad_step = False

    # --- Counting
    def on_train_begin(self, args, state, control, **kwargs):
        """Hook the parameters the prepared model trains (each pass of transformers' loop prepares it anew)."""
        self.remove_hooks()
        named = [(name, p) for name, p in self.trainer.model.named_parameters() if p.requires_grad]
        self._names, self._params = [name for name, _ in named], [p for _, p in named]
        self._sums = torch.zeros(len(named) + 1, dtype=torch.float32, device=self.trainer.accelerator.device)
        if _is_deepspeed(self.trainer.accelerator):  # ZeRO keeps no `param.grad`: each gradient as it is produced
            self._hooks = [param.register_hook(self._counter(index)) for index, param in enumerate(self._params)]
        return control

    def remove_hooks(self) -> None:
        """Take the counting hooks off the parameters (`on_train_begin` puts them on again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _counter(self, index: int):
        def count(grad: torch.Tensor) -> None:
            self._sums[index] += gradient_sum(grad)

        return count

    def count_loss(self, loss: torch.Tensor) -> None:
        """After each micro-step's backward (the trainer calls it with what `training_step` returns): add the loss to
        the losses' entry and, once the step's gradients are complete and not yet clipped, their norms (but under
        DeepSpeed, counted by the hooks, and FSDP2, before the optimizer step)."""
        if self._sums is None:
            return
        self._sums[-1] += gradient_sum(loss)
        if _is_deepspeed(self.trainer.accelerator) or not self.trainer.accelerator.sync_gradients:
            return
        local = [(index, param.grad) for index, param in enumerate(self._params)
                 if param.grad is not None and not isinstance(param.grad, DTensor)]
        if len(local) == len(self._params):  # every parameter has a gradient (the usual step)
            self._sums[:-1] += gradient_norms([grad for _, grad in local])
        elif local:  # some were not used this step: their entries stay 0
            indices = tuple(index for index, _ in local)
            if indices != self._indices[0]:  # copied to the device once per set, not every step
                self._indices = (indices, torch.tensor(indices, device=self._sums.device))
            self._sums.index_add_(0, self._indices[1], gradient_norms([grad for _, grad in local]))

    # --- The step's decision
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        for index, param in enumerate(self._params):
            if isinstance(param, DTensor) and param.grad is not None:  # FSDP2: this rank's reduced shard
                self._sums[index] += gradient_sum(param.grad.to_local())
        marks = torch.isfinite(self._sums).logical_not_().long()  # [P + 1]: 1 where this rank saw a NaN/inf
        counts = self.trainer.accelerator.reduce(marks, reduction="sum").tolist()  # [P + 1], the same on every rank
        self._sums.zero_()
        per_param, losses = counts[:-1], counts[-1]  # per parameter: the ranks that saw a NaN/inf in its gradient
        self.losses += losses
        bad = [name for name, count in zip(self._names, per_param) if count > 0]
        self._bad_step = bool(bad)
        if not bad:
            return control
        self.steps += 1
        self.grads += len(bad)
        step = state.global_step + 1
        self.first_bad = ", ".join(bad[:NAMES_SHOWN]) + (f" and {len(bad) - NAMES_SHOWN} more" if
                                                         len(bad) > NAMES_SHOWN else "")
        update_skip: UpdateSkip = self.trainer.update_skip
        if not _is_deepspeed(self.trainer.accelerator):
            update_skip.skip()  # the optimizer is not stepped, the schedule stays, the gradients are dropped
        elif not self.trainer.optimizer.step_was_skipped:
            raise NonFiniteStop(
                f"Step {step}: the gradients of {self.first_bad} held NaN/inf values and "
                "DeepSpeed applied the update (its overflow check is off: bf16 with check_grad_overflow false?); the "
                "weights may hold them. Turn DeepSpeed's check on, then resume from the last checkpoint "
                "(--resume_from_checkpoint true).")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        metrics = self.trainer._metrics["train"]
        for key, value in ((STEPS_METRIC, self.steps), (GRAD_METRIC, self.grads), (LOSS_METRIC, self.losses)):
            metrics[key] = [float(value)]  # counts since the run began: never averaged
        if not self._bad_step:
            self.in_a_row = 0
            return control
        self._bad_step, self.in_a_row = False, self.in_a_row + 1
        control.should_log = True  # the step's counts reach the log now
        if self.in_a_row >= self.stop_after:
            last_applied = state.global_step - self.in_a_row
            self.stop_line = (
                f"Training stopped at step {state.global_step}: the gradients of {self.in_a_row} steps in a row "
                f"held NaN/inf values (in this one: {self.first_bad}), and none was applied "
                f"(nonfinite_stop_after={self.stop_after}). checkpoint-{state.global_step} holds the weights of "
                f"step {last_applied}, all finite. Remove the cause (a lower learning rate, fp32 or the attention "
                "guard, cudnn_sdpa_guard), then resume with --resume_from_checkpoint true.")
            control.should_save = control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        """The stop's checkpoint is complete (`checkpoint.save_complete` wrote its marker): stop with the line."""
        if self.stop_line is not None:
            line, self.stop_line = self.stop_line, None
            raise NonFiniteStop(line)
        return control

    # --- Checkpointed counters (`checkpoint.or1_state`)
    def state(self) -> dict[str, int]:
        return {"steps": self.steps, "grads": self.grads, "losses": self.losses}

    def load_state(self, state: dict[str, int]) -> None:
        self.steps, self.grads, self.losses = state["steps"], state["grads"], state["losses"]
        self.in_a_row = 0  # a resumed run starts a new streak


def _is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type.value == "DEEPSPEED"


def attach(trainer, stop_after: int | None) -> NonFiniteSentinel:
    """The trainer's sentinel, added as its callback; with `stop_after=None` an idle one (TRL's behaviour: every
    update applied, nothing counted or logged)."""
    sentinel = NonFiniteSentinel(trainer, stop_after=stop_after)
    if stop_after is not None:
        trainer.add_callback(sentinel)
    return sentinel
