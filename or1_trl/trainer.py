"""`OR1Trainer`: Skywork-OR1's MAGIC objective (§3.1) wired into TRL's `GRPOTrainer` hooks.

What TRL 1.16 already does and we use as it is: generation (local or vLLM server), Math-/code-reward calls,
group-normalised advantages (eq. 2.5), the token-level "dapo" normaliser, PPO clipping with ε_low/ε_high, the
fused LM head that returns log-probs and entropies without materialising `[B, T, V]` logits, the 80/20
high-entropy token mask (`get_high_entropy_mask`), and the checkpointing of the entropy-controller state.

What this class adds, hook by hook (one step k = one generation batch, on-policy):

1. `_calculate_rewards`  — keeps the rewards of all ranks for step 2.
2. `_generate_and_score_completions` — **rejection sampling** (`rejection.py`): groups whose rewards are all
   equal leave the batch (T~_k); the normaliser T_k is recounted over the kept tokens of all ranks; rows are
   compacted (or masked) before TRL shuffles and splits the batch into micro-steps.
3. `_compute_loss` — **eq. 3.1**: PPO-clip per token (`loss.py`), optionally restricted to the top-ρ entropy tokens
   (80/20 rule), plus α_k·H over every kept token, all divided by T_k; then **eq. 3.2**: the entropy controller
   (`entropy.py`) measures e_k over all kept tokens of the step and updates c at the optimizer-step boundary.
4. `training_step` — a step whose groups were all rejected drops its (zero-weight) gradients, so the optimizer
   does not move (Adam's momentum would otherwise still move the weights); it is counted.

With every OR1 feature off (`rejection_sampling="off"`, `use_adaptive_entropy=False`, `entropy_coef=0`) or with a
plain `GRPOConfig`, the trainer is `GRPOTrainer` unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import trainer as hf_trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from . import checkpoint
from .config import OR1Config
from .data import check_reward_columns
from .entropy import AdaptiveEntropyController
from .loss import ppo_clip_per_token_loss, sampled_token_entropy
from .rejection import WEIGHT_KEY, compact_batch, group_outcomes, mask_batch

logger = logging.get_logger(__name__)

# Batch entries TRL forwards to the model besides ids and masks (multimodal models).
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
OR1_STATE_FILE = "or1_state.json"
TRL_ENTROPY_STATE_FILE = "entropy_ctrl_state.json"  # written by GRPOTrainer._save_checkpoint
KEPT_ROWS_KEY = "or1_kept_rows"  # rows with at least one trainable token, over all ranks (batch-level scalar)


class OR1Trainer(GRPOTrainer):
    """Drop-in replacement for [`~trl.GRPOTrainer`] that trains with the Skywork-OR1 MAGIC objective.

    Same constructor and usage as `GRPOTrainer`; pass an [`OR1Config`] to get the recipe (a plain `GRPOConfig`
    runs TRL's objective unchanged).

    Args:
        model, reward_funcs, train_dataset, eval_dataset, processing_class, reward_processing_classes,
        callbacks, optimizers, peft_config, ...: exactly as [`~trl.GRPOTrainer`].
        args ([`OR1Config`], *optional*): defaults to `OR1Config("<model>-OR1")`, the MAGIC recipe.

    Attributes:
        entropy_controller ([`AdaptiveEntropyController`]): state of eq. 3.2 (`entropy_coef` mirrors its c).
        or1_rows_forwarded (`int`): rows that went through the policy forward/backward on this rank.
        or1_skipped_steps (`int`): optimizer steps skipped because every group was rejected.
    """

    _tag_names = ["trl", "grpo", "or1"]
    _name = "OR1"

    def __init__(
        self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None, *rest, **kwargs
    ):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = OR1Config(f"{model_name.split('/')[-1]}-OR1")
        # Bad input fails here, before the model is loaded or anything is generated.
        check_reward_columns(reward_funcs, train_dataset, "train_dataset")
        check_reward_columns(reward_funcs, eval_dataset, "eval_dataset")
        is_or1 = isinstance(args, OR1Config)
        self.entropy_controller = AdaptiveEntropyController(
            target=args.entropy_target,
            delta=args.entropy_coef_delta,
            coef_min=args.entropy_coef_min,
            coef_max=args.entropy_coef_max,
            coef=args.entropy_coef,
            adaptive=args.use_adaptive_entropy,
        )
        self._or1_loss_enabled = is_or1 and args.or1_loss_enabled
        self._rejection_mode = args.rejection_sampling if is_or1 else "off"
        self._entropy_window = None  # [Σ e·m, Σ m] over the micro-steps of the current optimizer step
        self._rewards_all_ranks = None  # [B*G, n_funcs], stashed by _calculate_rewards for rejection
        self._skip_update = False  # no trainable token in the current rollout, on any rank
        self.or1_rows_forwarded = 0
        self.or1_skipped_steps = 0
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kwargs)
        if is_or1 and self.accelerator.is_main_process:
            changed = args.changed_defaults()
            if changed:
                logger.warning(
                    "OR1Config runs the MAGIC recipe; these defaults differ from GRPOConfig's (set them to change): "
                    + ", ".join(f"{name}={value!r} (GRPOConfig: {trl!r})" for name, value, trl in changed)
                )

    # TRL's own controller state (`entropy_coef`, `_last_world_entropy`) is our controller's state, so TRL's
    # checkpointing (`entropy_ctrl_state.json`) saves and restores it unchanged.
    @property
    def entropy_coef(self) -> float:
        return self.entropy_controller.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float):
        self.entropy_controller.coef = value

    @property
    def _last_world_entropy(self) -> float:
        return self.entropy_controller.last_entropy

    @_last_world_entropy.setter
    def _last_world_entropy(self, value: float):
        self.entropy_controller.last_entropy = value

    # ---------------------------------------------------------------------------------------------------------
    # Rejection sampling (§3.1): T~_k = { i : some A_ij != 0 }
    # ---------------------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_all_ranks = rewards_per_func  # [B*G over all ranks, n_funcs]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self._or1_loss_enabled or not self.model.training:
            return batch

        if self._rejection_mode != "off":
            # The scalar reward of each row over all ranks, as TRL sums it (NaN where every function abstained).
            rewards_per_func = self._rewards_all_ranks
            rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)  # [B*G]
            rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
            outcomes = group_outcomes(rewards, self.num_generations)
            for name, value in outcomes.fractions().items():
                self._metrics["train"][f"rejection/{name}"].append(value)

            num_local = len(inputs)
            start = self.accelerator.process_index * num_local
            keep_rows = outcomes.keep.repeat_interleave(self.num_generations)[start : start + num_local]  # [b]
            if self._rejection_mode == "compact":
                batch = compact_batch(batch, keep_rows.to(batch["completion_ids"].device), self.args.steps_per_generation)
            else:
                batch = mask_batch(batch, keep_rows)

        # T_k: every trainable token of the kept groups, over all ranks (eq. 3.1's normaliser); and the rows that
        # hold them (the 80/20 "selected" normaliser weighs micro-steps by their share of these rows).
        mask = self._loss_mask(batch)  # [b, T]
        local = torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().float()])  # [2]
        kept_tokens, kept_rows = self.accelerator.gather(local).view(-1, 2).sum(dim=0)
        batch["num_items_in_batch"] = kept_tokens
        batch[KEPT_ROWS_KEY] = kept_rows
        # Nothing to train on anywhere (every group rejected, or every completion masked, e.g. all truncated with
        # mask_truncated_completions): the step runs its zero-weight backward passes and then skips the update.
        self._skip_update = kept_tokens.item() == 0
        return batch

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
        """`[b, T]` weight of each completion token: padding, tool output and rejected rows are 0."""
        mask = inputs["completion_mask"].float()
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        if WEIGHT_KEY in inputs:
            mask = mask * inputs[WEIGHT_KEY].unsqueeze(1)
        return mask

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._skip_update and self.accelerator.sync_gradients:
            # No trainable token in the step: the backward passes ran with weight 0 (keeping ranks in step); now make
            # the optimizer skip the update entirely (torch optimizers skip parameters whose grad is None), so that
            # neither Adam's momentum nor weight decay moves the weights.
            model.zero_grad(set_to_none=True)
            self.or1_skipped_steps += 1
        if self.accelerator.sync_gradients and self._or1_loss_enabled:
            self._metrics["train"]["skipped_steps"].append(float(self.or1_skipped_steps))
        return loss

    # ---------------------------------------------------------------------------------------------------------
    # The MAGIC loss (eq. 3.1) and adaptive entropy control (eq. 3.2)
    # ---------------------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        if not self._or1_loss_enabled:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # [b, P+T]
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [b, P+T]
        mask = self._loss_mask(inputs)  # [b, T] kept tokens
        if mode == "train":
            self.or1_rows_forwarded += completion_ids.size(0)

        # Log-probs and full-vocabulary entropies from TRL's fused LM head (no [b, T, V] logits).
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(  # [b, T], [b, T]
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps  # on-policy: π_k = π_θ at this point

        per_token_loss, ratio = ppo_clip_per_token_loss(  # [b, T]
            logps, old_logps, inputs["advantages"], self.epsilon_low, self.epsilon_high, self.args.delta
        )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]

        # T_k, this rank's share for this micro-step (the "dapo" normaliser: DDP averages over ranks and the
        # micro-steps of one optimizer step add up).
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_processes = self.accelerator.num_processes
        tokens_share = inputs["num_items_in_batch"].clamp(min=1.0) / num_processes
        if mode == "train":
            tokens_share = tokens_share * accumulation / self.args.steps_per_generation

        # 80/20 rule: policy gradient only on the top-ρ entropy tokens of this micro-batch (quantile over all ranks,
        # TRL's mask and the official code's rule).
        policy_mask, policy_norm = mask, tokens_share
        if self.top_entropy_quantile < 1.0:
            policy_mask = mask * self.get_high_entropy_mask(entropies.detach(), mask, 1 - self.top_entropy_quantile)
            if self.args.top_entropy_normalization == "selected":
                # Mean over the selected tokens of the micro-batch (all ranks), weighted by the micro-batch's share of
                # the step's kept rows: equal weights when micro-batches hold equal kept rows (the official code's
                # average over micro-batches); a micro-batch of padding rows weighs 0 instead of diluting the others.
                local = torch.stack([policy_mask.sum(), (mask.sum(dim=1) > 0).sum().float()]).detach()  # [2]
                selected, rows = self.accelerator.reduce(local, reduction="sum")
                rows_share = inputs.get(KEPT_ROWS_KEY, rows) / num_processes  # eval: this one batch
                if mode == "train":
                    rows_share = rows_share * accumulation / self.args.steps_per_generation
                policy_norm = selected.clamp(min=1.0) * rows_share / rows.clamp(min=1.0)

        policy_loss = (per_token_loss * policy_mask).sum() / policy_norm
        alpha = self.entropy_controller.coefficient()
        loss = policy_loss
        if alpha != 0.0:  # α = 0 (the controller's usual state): no entropy term, so no entropy gradient either
            loss = loss - alpha * (entropies * mask).sum() / tokens_share  # α·H summed over every kept token, / T_k
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation

        if mode == "train" and self.args.use_adaptive_entropy:
            self._update_entropy_controller(old_logps, entropies, mask)
        self._log_loss_metrics(mode, policy_loss, alpha, entropies, ratio, mask, inputs["advantages"])
        return loss

    def _update_entropy_controller(self, old_logps, entropies, mask):
        """Accumulate e_k over the micro-steps of the optimizer step; update c at its boundary (eq. 3.2)."""
        if self.args.entropy_estimator == "sampled":
            per_token = sampled_token_entropy(old_logps.detach())  # [b, T]
        else:
            per_token = entropies.detach()  # [b, T]
        stats = torch.stack([(per_token * mask).sum(), mask.sum()])  # [2]
        self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
        if not self.accelerator.sync_gradients:
            return
        total, count = self.accelerator.reduce(self._entropy_window, reduction="sum").tolist()
        self._entropy_window = None
        measured = total / count if count > 0 else None  # no kept token: nothing measured, c unchanged
        self.entropy_controller.update(measured)
        self._metrics["train"]["entropy_coef"].append(self.entropy_controller.coef)
        if measured is not None:
            self._metrics["train"]["entropy/measured"].append(measured)

    def _log_loss_metrics(self, mode, policy_loss, alpha, entropies, ratio, mask, advantages):
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()  # [b, T]
        high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()  # [b, T]
        per_token = torch.stack([entropies.detach(), low, high, torch.maximum(low, high)])  # [4, b, T]
        loss_nan = torch.isnan(policy_loss.detach())
        local = torch.cat([
            (per_token * mask).sum(dim=(1, 2)),  # [4] token-weighted sums over the kept tokens
            mask.sum().view(1),  # [1] kept tokens
            torch.where(loss_nan, 0.0, policy_loss.detach()).view(1),  # [1] policy loss, NaN ranks left out
            (~loss_nan).float().view(1),  # [1] ranks with a policy loss
        ])
        totals = self.accelerator.reduce(local, "sum").tolist()  # one all-reduce for every metric below
        kept = totals[4]
        means = [t / kept for t in totals[:4]] if kept > 0 else [float("nan")] * 4
        metrics = self._metrics[mode]
        for key, value in zip(("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"), means):
            metrics[key].append(value)
        metrics["entropy/alpha"].append(alpha)
        metrics["policy_loss"].append(totals[5] / totals[6] if totals[6] > 0 else float("nan"))
        if mode == "train":
            metrics["rejection/rows_forwarded"].append(float(mask.size(0)))

    # ---------------------------------------------------------------------------------------------------------
    # Checkpointing (`checkpoint.py`): TRL saves the controller (entropy_ctrl_state.json); we add our state, then
    # the completeness marker; only then may transformers rotate old checkpoints away.
    # ---------------------------------------------------------------------------------------------------------
    def _or1_state(self) -> dict[str, dict]:
        """`{file name: JSON state}` that a checkpoint holds besides transformers' and TRL's files."""
        return {OR1_STATE_FILE: {"skipped_steps": self.or1_skipped_steps, "rows_forwarded": self.or1_rows_forwarded}}

    def _load_or1_state(self, states: dict[str, dict]) -> None:
        self.or1_skipped_steps = states[OR1_STATE_FILE]["skipped_steps"]
        self.or1_rows_forwarded = states[OR1_STATE_FILE]["rows_forwarded"]

    def _checkpoint_files(self) -> list[str]:
        """Every file a checkpoint of this trainer must hold to be resumed from."""
        files = [hf_trainer.TRAINER_STATE_NAME, *self._or1_state()]
        if self.use_adaptive_entropy:
            files.append(TRL_ENTROPY_STATE_FILE)
        return files

    def _save_checkpoint(self, model, trial):
        save_total_limit = self.args.save_total_limit
        self.args.save_total_limit = None  # hold back transformers' rotation until this checkpoint is complete
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit
        if not self.args.should_save:
            return
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        checkpoint.write_state(folder, self._or1_state(), self._checkpoint_files())
        hf_trainer.rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints (see `or1_trl/checkpoint.py`).

        `resume_from_checkpoint=True` takes the newest *complete* checkpoint of `output_dir`; an explicit folder that
        is incomplete (the run was killed while saving it) is an error naming what it lacks.
        """
        required = self._checkpoint_files()
        if resume_from_checkpoint is True:
            found = checkpoint.last_complete_checkpoint(self.args.output_dir, required)
            if found is None:
                incomplete = checkpoint.checkpoints(self.args.output_dir)
                raise ValueError(
                    f"No complete checkpoint to resume from in {self.args.output_dir}"
                    + (f" (incomplete: {[os.path.basename(c) for c in incomplete]})." if incomplete else ".")
                )
            if found != (checkpoint.checkpoints(self.args.output_dir) or [None])[-1]:
                logger.warning(f"Resuming from {found}, the newest complete checkpoint (newer ones are incomplete).")
            resume_from_checkpoint = found
        elif resume_from_checkpoint:
            missing = checkpoint.missing_files(resume_from_checkpoint, required)
            if missing:
                raise ValueError(
                    f"Checkpoint {resume_from_checkpoint} is incomplete: {missing[0]} is missing (the run was probably "
                    "stopped while saving it), so resuming from it would silently reset state. Resume from an earlier "
                    "checkpoint, or pass resume_from_checkpoint=True to take the newest complete one."
                )
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint_folder):
        super()._load_optimizer_and_scheduler(checkpoint_folder)  # TRL restores the controller
        if checkpoint_folder is not None:
            self._load_or1_state({name: checkpoint.read_state(checkpoint_folder, name) for name in self._or1_state()})
