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

import json
import os
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .config import OR1Config
from .entropy import AdaptiveEntropyController
from .loss import ppo_clip_per_token_loss, sampled_token_entropy
from .rejection import WEIGHT_KEY, compact_batch, group_outcomes, mask_batch

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

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = OR1Config(f"{model_name.split('/')[-1]}-OR1")
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
        self._skip_update = False  # every group of the current rollout was rejected
        self.or1_rows_forwarded = 0
        self.or1_skipped_steps = 0
        super().__init__(model, reward_funcs, args, *rest, **kwargs)

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
        if self._rejection_mode == "off" or not self.model.training:
            return batch

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
        self._skip_update = not bool(outcomes.keep.any())

        if self._rejection_mode == "compact":
            batch = compact_batch(batch, keep_rows.to(batch["completion_ids"].device), self.args.steps_per_generation)
        else:
            batch = mask_batch(batch, keep_rows)
        # T_k: every token of the kept groups, over all ranks (eq. 3.1's normaliser).
        kept_tokens = self._loss_mask(batch).sum()
        batch["num_items_in_batch"] = self.accelerator.gather(kept_tokens).sum()
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
            # Every group was rejected: the backward passes ran with weight 0 (keeping ranks in step); now make the
            # optimizer skip the update entirely (torch optimizers skip parameters whose grad is None).
            model.zero_grad(set_to_none=True)
            self.or1_skipped_steps += 1
        if self.accelerator.sync_gradients and self._rejection_mode != "off":
            self._metrics["train"]["rejection/skipped_steps"].append(float(self.or1_skipped_steps))
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

        # 80/20 rule: policy gradient only on the top-ρ entropy tokens (quantile over all ranks, TRL's mask).
        policy_mask, policy_norm = mask, tokens_share
        if self.top_entropy_quantile < 1.0:
            policy_mask = mask * self.get_high_entropy_mask(entropies.detach(), mask, 1 - self.top_entropy_quantile)
            if self.args.top_entropy_normalization == "selected":
                selected = self.accelerator.reduce(policy_mask.sum().detach(), reduction="sum")
                policy_norm = selected.clamp(min=1.0) / num_processes * accumulation

        policy_loss = (per_token_loss * policy_mask).sum() / policy_norm
        alpha = self.entropy_controller.coefficient()
        entropy_term = (entropies * mask).sum() / tokens_share  # H summed over every kept token, / T_k
        loss = policy_loss - alpha * entropy_term
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
    # Checkpointing: TRL saves the controller (entropy_ctrl_state.json); we add our counters.
    # ---------------------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, OR1_STATE_FILE), "w") as f:
                json.dump({"skipped_steps": self.or1_skipped_steps, "rows_forwarded": self.or1_rows_forwarded}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, OR1_STATE_FILE) if checkpoint is not None else None
        if path is not None and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.or1_skipped_steps = state["skipped_steps"]
            self.or1_rows_forwarded = state["rows_forwarded"]
