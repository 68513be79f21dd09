"""`OR1Trainer`: Skywork-OR1's MAGIC objective (§3.1) wired into TRL's `GRPOTrainer` hooks.

TRL 1.16 does, and we use as it is: generation, reward calls, advantages (eq. 2.5), its loss (any `loss_type`) with
PPO clipping, the fused LM head (no `[B, T, V]` logits), the 80/20 mask, checkpointing the entropy controller.
One step k = one generation batch, on-policy; each hook is a few lines calling a named module:

0. `__init__`: **pre-flight** (`data.py`) before the model loads. `train`: **stages** (§3.2.2, `stages.py`), one
   pass of transformers' loop each, resuming from the previous stage's last complete checkpoint (`checkpoint.py`);
   at a stage start the **online filter** shrinks the pool (`prompts.PromptSchedule`) `_get_train_sampler` draws.
1. `_calculate_rewards`: the rollout's record (`rollout.Rollout`): rewards of all ranks, each row's prompt,
   truncation and length; a returned inf/NaN is an error, or scored 0 and counted (`reward_checks.py`).
2. `_generate_and_score_completions`: the **rollout correction** toward the generator replaces TRL's
   `importance_sampling_ratio` of every rollout batch, with its diagnostics (`rollout_correction.py`); the
   **advantage masks for truncated responses** (§3.2.3, `advantages.py`), if chosen;
   **per-prompt statistics** (`PromptSchedule.record`); **rejection sampling**
   (`rejection.reject`): all-equal groups leave the batch (T~_k), optionally refilled from the pool; T_k recounted
   over the kept tokens of all ranks. In evaluation: avg@n and pass@k (`evaluation.py`).
3. `_compute_loss`: **eq. 3.1** (`loss.magic_loss`): TRL's loss on the kept tokens, normalised over the kept groups,
   plus α_k·H normalised like it; **eq. 3.2**: the entropy controller (`entropy.py`) measures e_k and updates c.
4. `_get_per_token_logps_and_entropies`: keeps TRL's policy pass for the entropy term (`logprob_backend="liger"`
   binds Liger's kernel into the fused head of this trainer's models, `logprobs.use_liger_head`); with
   `padding_free`, every pass forwards the rows packed without padding (`packing.py`).
5. `training_step`: a step with no trainable token on any rank skips the optimizer update (counted, warned about);
   with `_generate`, `_calculate_rewards` and `_prepare_inputs` it times the step's phases (`observability.py`).

Process-wide patches, each scoped and commented where it is made: `weight_sync.generation_backend` (a TRL module
name, during `GRPOTrainer.__init__`), and this trainer's own `callback_handler.on_train_end` (`train`),
`args.save_total_limit` (`_save_checkpoint`) and `accelerator.gather` (`_compute_loss`).

With every OR1 feature off (`rejection_sampling="off"`, `use_adaptive_entropy=False`, `entropy_coef=0`,
`logprob_backend="trl"`, `rollout_correction="trl"`) or with a plain `GRPOConfig`, the trainer is `GRPOTrainer` unchanged.
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext

import torch
from accelerate.utils import broadcast_object_list, gather_object
from datasets import Dataset
from transformers import trainer as hf_trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, get_config_model_id

from . import checkpoint
from ..eval import model_card
from ..recipe import stages
from ..recipe.advantages import leave_group_statistics, zero_truncated
from .or1_config import OR1Config, check_liger_layer_kernels
from ..data.preflight import check_datasets, check_prompts_fit
from ..data.released import released_format_inputs
from ..recipe.entropy import AdaptiveEntropyController, StepWindow
from ..eval.evaluation import group_pass_at_k
from ..eval.evaluation import read_summary as read_eval_summary
from .logprobs import resolve_logprob_backend, use_liger_head
from ..recipe.loss import Normaliser, magic_loss, sampled_token_entropy, share
from .packing import (attention_problem, check_packable, fused_head_forward, one_row_per_forward,
                      packed_logps_and_entropies, sharding_problem)
from ..generation.overlap import OverlappedRollouts, background_client
from .observability import (EntropyWatch, SaveFinalState, SkippedStepWatch, StepTimer, StepTimerCallback,
                            accuracy_metrics, close_progress_bars)
from ..recipe.prompts import PromptSchedule, prompt_ids
from .reward_checks import NONFINITE_METRIC, NonfiniteRewards, record_abstentions
from ..recipe.rejection import KEPT_GROUP_ROWS_KEY, KEPT_ROWS_KEY, count_kept, loss_mask, reject, row_gathers_padded
from ..recipe.rollout import Rollout, row_facts, scalar_rewards
from ..recipe.rollout_correction import RolloutCorrection
from ..recipe.stages import StageShape
from ..generation.weight_sync import generation_backend

logger = logging.get_logger(__name__)

OR1_STATE_FILE = "or1_state.json"
TRL_ENTROPY_STATE_FILE = "entropy_ctrl_state.json"  # written by GRPOTrainer._save_checkpoint
INDEX_COLUMN = "or1_index"  # added to the train dataset: the row's index, for per-prompt statistics


class OR1Trainer(GRPOTrainer):
    """Drop-in replacement for [`~trl.GRPOTrainer`] that trains with the Skywork-OR1 MAGIC objective.

    Same constructor and usage as `GRPOTrainer`; an [`OR1Config`] gets the recipe, a `GRPOConfig` TRL's objective.

    Args:
        model, reward_funcs, train_dataset, eval_dataset, processing_class, ...: exactly as [`~trl.GRPOTrainer`];
            the datasets also in the paper's released (verl) format (`data.py`; with `reward_funcs=None` each row is
            scored by its own verifier, `rewards.mixed_rewards`).
        args ([`OR1Config`], *optional*): defaults to `OR1Config("<model>-OR1")`, the MAGIC recipe.

    Attributes:
        entropy_controller ([`AdaptiveEntropyController`]): state of eq. 3.2 (`entropy_coef` mirrors its c).
        or1_rows_forwarded (`int`): rows that went through the policy forward/backward on this rank.
        or1_skipped_steps (`int`): optimizer steps skipped because no token was trainable (e.g. every group rejected).
        prompt_schedule ([`PromptSchedule`]): the prompt pool, per-prompt statistics, sampler position and refill
            stream (`OR1Config` with a `datasets.Dataset`; else `None`); `prompt_pool` and `prompt_stats` are its.
        logprob_backend (`str`): `"trl"` or `"liger"`, what `OR1Config.logprob_backend` resolved to here.
    """

    _tag_names = ["trl", "grpo", "or1"]
    _policy_pass = None  # inside `_compute_loss`: TRL's policy pass ("outputs") and 80/20 mask ("high_entropy")
    _name = "OR1"
    # The card TRL writes cites the seed papers, then GRPO's (DeepSeekMath).
    _paper = {**model_card.PAPER, "citation": f"{model_card.CITATIONS}\n\n{GRPOTrainer._paper['citation']}"}

    def __init__(
        self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None, *rest, **kwargs
    ):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = OR1Config(f"{model_name.split('/')[-1]}-OR1")
        # The released (verl) format gets our columns, and each row its verifier when none is given.
        reward_funcs, train_dataset, eval_dataset = released_format_inputs(reward_funcs, train_dataset, eval_dataset)
        # Bad input fails here, before the model is loaded or anything is generated.
        check_liger_layer_kernels(args)
        check_datasets(reward_funcs, train_dataset, eval_dataset)  # columns, rows, gold types (`data.py`)
        if getattr(args, "padding_free", False) and not isinstance(model, str):  # a model instance's attention
            if problem := attention_problem(model.config._attn_implementation):
                raise ValueError(problem)
        is_or1 = isinstance(args, OR1Config)
        self.entropy_controller = AdaptiveEntropyController.for_config(args)
        self._or1_loss_enabled = is_or1 and args.or1_loss_enabled
        self._rejection_mode = args.rejection_sampling if is_or1 else "off"
        self._truncated_mask = args.truncated_advantage_mask if is_or1 else "none"
        self._padding_free = is_or1 and args.padding_free
        self._entropy_window = StepWindow()  # e_k over the micro-steps of the current optimizer step
        self._rollouts: dict[str, Rollout] = {}  # the last rollout's side data, per mode ("train", "eval")
        self._nonfinite = NonfiniteRewards()  # inf/NaN rewards: warned about once per run
        self.or1_rows_forwarded = self.or1_skipped_steps = 0
        self.logprob_backend = "trl"  # resolved for the device and model below, once the model is loaded

        # What the trainer trains on, and when (§3.1, §3.2.2): the prompt schedule and the stages. Everything that
        # can be wrong with them fails here, before the model loads.
        self.prompt_schedule: PromptSchedule | None = None
        self._stages = args.stage_list if is_or1 else []
        self._stage_shapes: list[StageShape] = []
        self._stage: StageShape | None = None
        self._rng_to_restore = None  # checkpoint whose RNG state to restore after the first batch fetch
        if is_or1 and isinstance(train_dataset, Dataset):
            ids = prompt_ids(train_dataset, args.prompt_id_column)
            train_dataset = train_dataset.add_column(INDEX_COLUMN, list(range(len(train_dataset))))
            self.prompt_schedule = PromptSchedule(ids, args.seed, os.path.join(args.output_dir, checkpoint.PROMPT_STATS_LOG))
        elif self._stages or (is_or1 and args.rejection_refill_rounds):
            raise ValueError("stages and rejection_refill_rounds need a map-style `datasets.Dataset` as train_dataset (the "
                             "prompt pool indexes it).")
        if self._stages:  # their shapes in TRL's terms, stage 0's set on `args`
            self._stage_shapes = stages.plan(self._stages, args, args.world_size, len(self.prompt_pool))
        # vLLM server mode: TRL's NCCL weight transfer, or safetensors through a shared directory (weight_sync.py).
        # Process-wide: the module-level name TRL builds its backend by is swapped during this call only.
        with generation_backend(args) if is_or1 else nullcontext():
            super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kwargs)
        if self._padding_free and (problem := sharding_problem(self.accelerator.distributed_type)):
            raise ValueError(problem)
        if is_or1:
            policy = self.accelerator.unwrap_model(self.model)
            self.logprob_backend, why = resolve_logprob_backend(args.logprob_backend, policy, self.accelerator.device)
            logger.info(f"Log-probs and entropies: logprob_backend={self.logprob_backend!r} ({why}).")
            self._use_logprob_backend()
        self._check_prompt_lengths()
        # What the run shows (`observability.py`): time split, final trainer_state.json, entropy and skip warnings.
        self._step_timer = StepTimer()
        self.add_callback(StepTimerCallback(self._step_timer, self._log_metrics))
        self.add_callback(SaveFinalState())
        self._entropy_watch = EntropyWatch.for_config(args) if is_or1 else None
        self._skipped_watch = SkippedStepWatch.for_config(args)
        self._rollout_correction = RolloutCorrection.for_config(args) if is_or1 and self.use_vllm else None
        self._overlap = self._regular_rollout = None  # one-step-off rollouts (`overlap.py`), with async_generation
        if is_or1 and args.async_generation:
            if self.rollout_func is not None or self.tools or self.environment_factories is not None:
                raise ValueError("async_generation=True prefetches single-turn rollouts: it does not run with tools, "
                                 "environment_factory or rollout_func; set async_generation=False.")
            self._overlap = OverlappedRollouts(args.max_staleness, self.accelerator.is_main_process)
            if self.accelerator.is_main_process:
                client = self.vllm_generation.vllm_client
                self._overlap.attach(self.vllm_generation, background_client(client))
        if self._stages:
            self.args.ignore_data_skip = True  # the prompt sampler restores its own position on resume
            self.add_callback(stages.StageEnd(lambda: self._stage))  # saves and stops at the stage's last step
            limit = self.args.vllm_max_model_length if self.use_vllm else None
            if self.use_vllm and self.vllm_mode == "server" and self.accelerator.is_main_process:
                limit = self.vllm_generation.vllm_client.get_server_info()["model_config"].get("max_model_len", limit)
            stages.check_fits_vllm(self._stage_shapes, limit)
        if is_or1 and self.accelerator.is_main_process and (changed := args.changed_defaults()):
            logger.warning("OR1Config runs the MAGIC recipe; these defaults differ from GRPOConfig's (set them to change): "
                           + ", ".join(f"{name}={value!r} (GRPOConfig: {trl!r})" for name, value, trl in changed))

    prompt_pool = property(lambda self: self.prompt_schedule.pool if self.prompt_schedule else None)
    prompt_stats = property(lambda self: self.prompt_schedule.stats if self.prompt_schedule else None)

    # TRL's own controller state (`entropy_coef`, `_last_world_entropy`) is our controller's state, so TRL's
    # checkpointing (`entropy_ctrl_state.json`) saves and restores it unchanged.
    entropy_coef = property(lambda self: self.entropy_controller.coef,
                            lambda self, value: setattr(self.entropy_controller, "coef", value))
    _last_world_entropy = property(lambda self: self.entropy_controller.last_entropy,
                                   lambda self, value: setattr(self.entropy_controller, "last_entropy", value))

    # --- 1-2. Rewards, per-prompt statistics and rejection sampling (§3.1): T~_k = { i : some A_ij != 0 }
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self._timed("reward"), record_abstentions(self) as abstained:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # A reward function's inf/NaN: an error naming it and the sample, or scored 0 and counted (`reward_checks.py`).
        rewards_per_func, count, warning = self._nonfinite.screen(
            rewards_per_func, abstained, self.accelerator.gather,
            getattr(self.args, "nonfinite_rewards", "error") == "zero", self.reward_func_names,
            self.accelerator.process_index, prompts, completions, [row.get(INDEX_COLUMN, -1) for row in inputs],
            self.state.global_step + 1)
        if count is not None:
            self._metrics["train" if self.model.training else "eval"][NONFINITE_METRIC].append(count)
        self._warn(*filter(None, [warning]))
        rollout = Rollout(scalar_rewards(rewards_per_func, self.reward_weights))  # [B*G over all ranks]
        if self.model.training:  # per row, gathered like the rewards: dataset index, truncated, length
            stop = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            local = torch.tensor(row_facts(inputs, completion_ids_list, stop, INDEX_COLUMN), dtype=torch.long,
                                 device=rewards_per_func.device)  # [b, 3]
            rollout.rows = self.accelerator.gather(local)  # [B*G, 3]
            self._log_metrics(accuracy_metrics(rollout.rewards, rollout.rows[:, 1]))
            if self._truncated_mask == "before":  # truncated rows leave the group statistics (§3.2.3, `advantages.py`)
                rewards_per_func = leave_group_statistics(rewards_per_func, rollout.rows[:, 1])
                rollout.group_rewards = scalar_rewards(rewards_per_func, self.reward_weights)
        self._rollouts["train" if self.model.training else "eval"] = rollout
        return rewards_per_func

    def _scored(self, inputs):
        """TRL's rollout batch, with our rollout correction toward the generator (`rollout_correction.py`) and the
        truncated responses' advantage mask (`advantages.py`)."""
        batch = super()._generate_and_score_completions(inputs)
        if self._truncated_mask != "none" and self.model.training:  # this rank's rows: advantage 0 where truncated
            start = self.accelerator.process_index * len(batch["advantages"])
            truncated = self._rollouts["train"].rows[start : start + len(batch["advantages"]), 1]  # [b]
            batch["advantages"] = zero_truncated(batch["advantages"], truncated)
        if self._rollout_correction is not None:
            mode = "train" if self.model.training else "eval"
            self._warn(*self._rollout_correction.apply(batch, self.accelerator.gather, self._metrics[mode], mode == "train"))
        return batch

    def _generate_and_score_completions(self, inputs):
        self._regular_rollout = self.model.training  # the step's own rollout (refills come later, in `more`)
        batch = self._scored(inputs)
        if not self.model.training:  # evaluation: avg@n and unbiased pass@k per eval prompt, over all ranks
            for name, values in group_pass_at_k(self._rollouts["eval"].rewards.tolist(), self.num_generations_eval).items():
                self._metrics["eval"][name].extend(values)
            return batch
        rollout = self._rollouts["train"]
        self._record_prompt_stats(rollout)
        if not self._or1_loss_enabled:
            return batch
        if self._rejection_mode != "off":
            def more():  # a refill: another rollout batch from the pool, all ranks in lockstep
                rows = self.prompt_schedule.refill_rows(self._stage_index, num_groups, self.num_generations)
                start = self.accelerator.process_index * len(inputs)
                extra = self._scored([self.train_dataset[index] for index in rows[start : start + len(inputs)]])
                self._record_prompt_stats(self._rollouts["train"], refill=True)
                return extra, self._rollouts["train"].judged_rewards

            num_groups = len(rollout.rewards) // self.num_generations
            rejection = reject(batch, rollout.judged_rewards, self.num_generations, self._rejection_mode,
                               self.accelerator.process_index, self.args.steps_per_generation,
                               self._tokenizer.pad_token_id, self.args.rejection_refill_rounds, more)
            batch, rollout.outcomes = rejection.batch, rejection.outcomes
            self._log_metrics(rejection.metrics)
            self._rollouts["train"] = rollout  # the refills' records were only for their statistics

        # T_k (eq. 3.1's normaliser) and the kept rows, over all ranks, into the batch. Nothing to train on anywhere
        # (every group rejected, or every completion masked): the step runs zero-weight backward passes, no update.
        rollout.skip_update = count_kept(batch, self.accelerator.gather).item() == 0
        return batch

    def _record_prompt_stats(self, rollout: Rollout, refill: bool = False) -> None:
        """The rollout's per-prompt outcomes (all ranks) into the schedule; a regular rollout's `stage` and `pool/size`."""
        if self.prompt_schedule is None:
            return
        self.prompt_schedule.record(self._stage_index, self.state.global_step + 1, rollout.rows.tolist(),
                                    rollout.rewards.tolist(), self.args.generation_batch_size // self.num_generations,
                                    refill=refill, write_log=self.accelerator.is_main_process)
        if not refill:
            self._metrics["train"]["stage"].append(float(self._stage_index))
            self._metrics["train"]["pool/size"].append(float(len(self.prompt_pool)))

    # --- 3-4. The MAGIC loss (eq. 3.1) and adaptive entropy control (eq. 3.2); log-probs and entropies (`logprobs.py`)
    def _use_logprob_backend(self, temperature: float | None = None) -> None:
        """TRL's fused head on the policy (patched again at `temperature` if given); with `"liger"`, Liger's kernel
        bound into it and into the reference model's (`logprobs.use_liger_head`: these models only)."""
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        if temperature is not None:
            add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                              outputs=("log_probs", "entropy"))
        if self.logprob_backend == "liger":
            use_liger_head(model)
            if self.ref_model is not None:
                use_liger_head(self.accelerator.unwrap_model(self.ref_model))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if self._padding_free:  # every pass (policy, old policy, reference) packed under the budget (`packing.py`)
            check_packable(compute_aux_loss, multimodal)
            # Forwards but the last go around DDP's wrapper (checkpointed: recomputed in the backward), so each rank
            # runs one wrapped forward per policy pass, whatever its number of forwards.
            unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=True)
            logps, entropies, slots = packed_logps_and_entropies(
                fused_head_forward(model if torch.is_grad_enabled() else unwrapped, self.accelerator.autocast),
                input_ids, attention_mask, logits_to_keep, self.args.max_tokens_per_microbatch, compute_entropy,
                one_row_per_forward(unwrapped.config._attn_implementation),
                fused_head_forward(unwrapped, self.accelerator.autocast))
            outputs = (logps, entropies, None)
        else:
            outputs = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
            slots = input_ids.numel()
        if self._policy_pass is not None and "outputs" not in self._policy_pass:  # the policy pass: its token fill
            # this rank's micro-batch (no collective on the hot path; the main process logs its own)
            self._metrics["train" if self.model.training else "eval"]["update/token_fill"].append(
                attention_mask.sum().item() / slots)
        if self._policy_pass is not None:  # inside `_compute_loss`: TRL's policy pass, for the entropy term
            self._policy_pass.setdefault("outputs", outputs)
        return outputs

    def get_high_entropy_mask(self, entropies, mask, threshold):
        selected = super().get_high_entropy_mask(entropies, mask, threshold)  # [b, T] bool
        if self._policy_pass is not None:  # inside `_compute_loss`: TRL's 80/20 mask, for the "selected" normaliser
            self._policy_pass.setdefault("high_entropy", selected)
        return selected

    def _compute_loss(self, model, inputs):
        if not self._or1_loss_enabled:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        mask = loss_mask(inputs)  # [b, T] kept tokens
        if mode == "train":
            self.or1_rows_forwarded += mask.size(0)
        # TRL's policy loss, whatever its loss_type / β / GSPO / off-policy mask, on the kept tokens (TRL's mask is
        # completion_mask · tool_mask); its own entropy bonus off, ours below. The policy pass is kept for the bonus.
        self._entropy_bonus_enabled, self._policy_pass = False, {}
        # Compacted ranks hold different row counts: this trainer's `accelerator.gather` NaN-pads TRL's per-row
        # metric gathers while TRL's loss runs (an instance attribute, removed on exit; other trainers untouched).
        with row_gathers_padded(self.accelerator, active=mode == "train" and self._rejection_mode == "compact"):
            trl_loss = super()._compute_loss(model, {**inputs, "tool_mask": mask})
        policy_pass, self._policy_pass = self._policy_pass, None
        logps, entropies, aux_loss = policy_pass["outputs"]  # [b, T], [b, T], scalar

        # Counted over the kept groups only (T~_k): T_k for token-level types, the kept rows for row means.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        steps = self.args.steps_per_generation if mode == "train" else 1
        num_processes = self.accelerator.num_processes
        norm = Normaliser.for_micro_step(self.loss_type, inputs["num_items_in_batch"], inputs.get(KEPT_GROUP_ROWS_KEY),
                                         mask.size(0), num_processes, accumulation, steps, self.max_completion_length)
        selected = None
        if self.top_entropy_quantile < 1.0 and self.args.top_entropy_normalization == "selected":
            # 80/20, the official code's normaliser: the selected tokens (TRL's own mask of this pass) instead of T_k.
            chosen = mask * policy_pass["high_entropy"]
            local = torch.stack([chosen.sum(), (mask.sum(dim=1) > 0).sum().float()]).detach()  # [2]
            chosen, with_tokens = self.accelerator.reduce(local, reduction="sum")
            selected = (chosen, with_tokens, share(inputs.get(KEPT_ROWS_KEY, with_tokens), num_processes, accumulation, steps))
        aux = self.router_aux_loss_coef * aux_loss / accumulation if self.aux_loss_enabled else 0.0
        alpha = self.entropy_controller.coefficient()
        out = magic_loss(trl_loss, aux, entropies, mask, norm, alpha, selected)

        if mode == "train" and self.args.use_adaptive_entropy:
            old_logps = inputs.get("old_per_token_logps")
            self._update_entropy_controller(logps.detach() if old_logps is None else old_logps, entropies, mask)
        self._log_loss_metrics(mode, out.policy_loss, alpha, entropies, mask)
        return out.loss

    def _update_entropy_controller(self, old_logps, entropies, mask):
        """Accumulate e_k over the micro-steps of the optimizer step; update c at its boundary (eq. 3.2)."""
        sampled = self.args.entropy_estimator == "sampled"
        self._entropy_window.add(sampled_token_entropy(old_logps.detach()) if sampled else entropies.detach(), mask)
        if not self.accelerator.sync_gradients:
            return
        measured = self._entropy_window.close(self._sum_over_ranks)
        self.entropy_controller.update(measured)  # no kept token: nothing measured, c unchanged
        self._metrics["train"]["entropy_coef"].append(self.entropy_controller.coef)
        if measured is not None:
            self._metrics["train"]["entropy/measured"].append(measured)

    def _sum_over_ranks(self, stats: torch.Tensor) -> torch.Tensor:  # [n] -> [n], the same on every rank
        return self.accelerator.reduce(stats, reduction="sum")

    def _log_loss_metrics(self, mode, policy_loss, alpha, entropies, mask):
        """Ours besides TRL's (`entropy`, `clip_ratio/*`, `kl` over the kept tokens): α, the policy part of the loss,
        and the step's entropy over kept tokens (all ranks) for the entropy watch."""
        metrics = self._metrics[mode]
        metrics["entropy/alpha"].append(alpha)
        metrics["entropy/active"].append(float(alpha != 0.0))
        metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if mode == "train":
            metrics["rejection/rows_forwarded"].append(float(mask.size(0)))
            self._entropy_watch.add(entropies.detach(), mask)  # summed over ranks once, at the step's end

    # --- 5. The update, and what the run shows (`observability.py`): skipped steps, time split, entropy warnings
    def training_step(self, model, inputs, num_items_in_batch):
        with self._step_timer.phase("update"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        rollout = self._rollouts.get("train", Rollout(torch.empty(0)))
        if rollout.skip_update and self.accelerator.sync_gradients:
            # No trainable token: the backward passes ran with weight 0 (keeping ranks in step); the optimizer skips
            # parameters whose grad is None, so neither Adam's momentum nor weight decay moves the weights.
            model.zero_grad(set_to_none=True)
            self.or1_skipped_steps += 1
        if self.accelerator.sync_gradients and self._or1_loss_enabled:
            self._metrics["train"]["skipped_steps"].append(float(self.or1_skipped_steps))
            self._metrics["train"]["entropy/target"].append(self.entropy_controller.target)
            # collapse, low start
            self._warn(*self._entropy_watch.end_step(self.entropy_controller.coef, self._sum_over_ranks))
            self._warn(*self._skipped_watch.observe(rollout.skip_update, rollout.outcomes))
        return loss

    def _timed(self, phase: str):
        """Charge the block to `phase` of the step's time split (training only: evaluation counts as "other")."""
        return self._step_timer.phase(phase) if self.model.training else nullcontext()

    def _generate(self, prompts):
        regular, self._regular_rollout = self._overlap is not None and self._regular_rollout, False
        if self._overlap is not None:
            if self.state.global_step != self._last_loaded_step:  # TRL pushes weights next: no request in flight
                self._overlap.wait()
            if regular:
                self._overlap.step_request(self.state.global_step)
        # vLLM server down past `vllm_server_timeout`: a complete checkpoint, then one line (`server_health.py`)
        with self._timed("rollout"), checkpoint.stop_with_checkpoint(self):
            output = super()._generate(prompts)
            if regular:  # one-step-off: the next step's prompts go to the server while this step trains
                self._log_metrics(broadcast_object_list([self._overlap.metrics])[0])  # measured by the main process
                self._request_next_rollout()
        return output

    def _request_next_rollout(self) -> None:
        """Every rank: the next step's prompts, tokenized as TRL does, gathered; the main process sends them."""
        end = self._stage.until_step if self._stage is not None else self.state.max_steps
        prompts = self._overlap.next_prompts() if self.state.global_step + 1 < end else None
        if prompts is None:
            return
        prompt_ids = gather_object(self._tokenize_prompts(copy.deepcopy(prompts))[0])
        self._overlap.submit_next(self.state.global_step, prompt_ids, self.num_generations)

    def _prepare_inputs(self, generation_batch):
        with self._timed("other"):  # the rollout's bookkeeping; generation and rewards inside it are timed as such
            return super()._prepare_inputs(generation_batch)

    def _log_metrics(self, metrics: dict[str, float], mode: str = "train") -> None:
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _warn(self, *messages: str) -> None:
        if self.accelerator.is_main_process:
            for message in messages:
                logger.warning(message)

    # --- Checkpoints (`checkpoint.py`): TRL's files, our state, the completeness marker, then the rotation
    def _or1_state(self) -> dict[str, dict]:
        """`{file name: JSON state}` that a checkpoint holds besides transformers' and TRL's files."""
        return {OR1_STATE_FILE: {"skipped_steps": self.or1_skipped_steps, "rows_forwarded": self.or1_rows_forwarded},
                **(self.prompt_schedule.state() if self.prompt_schedule else {})}

    def _load_or1_state(self, folder: str) -> None:
        """Restore our state from a complete checkpoint, before `Trainer.train` builds the data loader."""
        counters = checkpoint.read_state(folder, OR1_STATE_FILE)
        self.or1_skipped_steps, self.or1_rows_forwarded = counters["skipped_steps"], counters["rows_forwarded"]
        if self.prompt_schedule is not None:
            states = {name: checkpoint.read_state(folder, name) for name in PromptSchedule.STATE_FILES}
            self.prompt_schedule.load_state(states, truncate_log=self.accelerator.is_main_process)

    def _checkpoint_files(self) -> list[str]:
        """Every file a checkpoint of this trainer must hold to be resumed from."""
        schedule = PromptSchedule.STATE_FILES if self.prompt_schedule else ()
        entropy = [TRL_ENTROPY_STATE_FILE] if self.use_adaptive_entropy else []
        return [hf_trainer.TRAINER_STATE_NAME, OR1_STATE_FILE, *schedule, *entropy]

    def _save_checkpoint(self, model, trial):
        # Scoped to this trainer's args during this call: transformers' rotation waits until the checkpoint is complete.
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with checkpoint.saving(folder):  # a full disk: one line, and the previous checkpoint stays the one to resume
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = save_total_limit
            self.accelerator.wait_for_everyone()  # every rank's files are written before the marker lists them
            if not self.args.should_save:
                return
            checkpoint.write_state(folder, self._or1_state(), self._checkpoint_files())
        hf_trainer.rotate_checkpoints(output_dir=run_dir, save_total_limit=save_total_limit,
                                      best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    # --- 0. Stages (§3.2.2, `stages.py`) over the prompt schedule (§3.1, `prompts.py`)
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train` from complete checkpoints only (`checkpoint.py`; a previous run's `output_dir` needs
        `resume_from_checkpoint` or `overwrite_output_dir=True`), over every stage of `OR1Config.stages`: one pass of
        transformers' loop each, ending with a checkpoint the next resumes from, so all state carries over."""
        try:
            return self._train_stages(resume_from_checkpoint, trial, **kwargs)
        finally:  # a rollout requested ahead is not trained on after the run (nor saved: `overlap.py`)
            if self._overlap is not None:
                self._overlap.reset()

    def _train_stages(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """The body of `train`, stage by stage."""
        overwrite = getattr(self.args, "overwrite_output_dir", False)  # OR1Config's (relaunch safety)
        checkpoint.prepare_output_dir(self.args.output_dir, resume_from_checkpoint, overwrite, self.accelerator.is_main_process)
        self.accelerator.wait_for_everyone()
        folder = checkpoint.resolve_resume(self.args.output_dir, resume_from_checkpoint, self._checkpoint_files())
        while True:
            if folder is not None:
                self._load_or1_state(folder)
            if not self._stages:
                return super().train(resume_from_checkpoint=folder, trial=trial, **kwargs)
            step = TrainerState.load_from_json(os.path.join(folder, hf_trainer.TRAINER_STATE_NAME)).global_step if folder else 0
            self._enter_stage(stages.stage_index(self._stages, step))
            final = self._stage.until_step >= self.args.max_steps
            self._rng_to_restore = folder
            # Scoped to this trainer's callback handler during one stage's loop: a stage that is not the last closes
            # only the progress bar at its end; trackers and the like stay open across stages.
            train_end = self.callback_handler.on_train_end
            if not final:
                self.callback_handler.on_train_end = close_progress_bars(self.callback_handler)
            try:
                output = super().train(resume_from_checkpoint=folder, trial=trial, **kwargs)
            finally:
                self.callback_handler.on_train_end = train_end
            if final or self.state.global_step < self._stage.until_step:  # done, or stopped early by a callback
                return output
            self.accelerator.wait_for_everyone()
            folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        def fetch():
            return super(OR1Trainer, self).get_batch_samples(epoch_iterator, num_batches, device)

        batches = self._overlap.batches(epoch_iterator, fetch) if self._overlap is not None else fetch()
        if self._rng_to_restore is not None:
            # transformers restores the checkpoint's RNG before the data loader iterator draws a seed from it (unless it
            # skips batches; our sampler restores its own position). Restore it after the first fetch, as transformers
            # does on its skipping path, so a resumed run samples what the uninterrupted did.
            self._load_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        return batches

    @property
    def _stage_index(self) -> int:
        return self._stage.index if self._stage is not None else 0

    def _enter_stage(self, index: int) -> None:
        """Make stage `index` current: the schedule's stage entry (online filter), then TRL's settings for its shape."""
        shape = self._stage = self._stage_shapes[index]
        self.prompt_schedule.enter_stage(index, shape.start_step, shape.batch_size, self.args.online_filter_threshold,
                                         self.args.online_filter_unsolved_after, warn=self._warn)
        stages.apply_to_args(self.args, shape)
        self.max_completion_length, self.num_generations = shape.max_completion_length, shape.num_generations
        if shape.temperature != self.temperature:  # log-probs are taken at the sampling temperature: re-patch the head
            self.temperature = shape.temperature
            self._use_logprob_backend(shape.temperature)
        if self.use_vllm:
            self.vllm_generation.max_completion_length = shape.max_completion_length
            self.vllm_generation.temperature = shape.temperature
        else:
            self.generation_kwargs.update(max_new_tokens=shape.max_completion_length, temperature=shape.temperature)
            self.generation_config.max_new_tokens = shape.max_completion_length
            self.generation_config.temperature = shape.temperature
        self._step, self._buffered_inputs = 0, None  # TRL's generation counter restarts with the new shape
        if self._overlap is not None:  # the rollout in flight had the previous stage's shape: discarded
            self._overlap.reset()

    def _get_train_sampler(self, dataset=None):
        if not self._stages:
            return super()._get_train_sampler(dataset)
        shape = self._stage  # `_enter_stage` set the schedule's position for it (restored, or 0 at a stage start)
        return self.prompt_schedule.new_sampler(shape.index, shape.batch_size, shape.num_generations,
                                                self.num_iterations * shape.steps_per_generation)

    def _load_optimizer_and_scheduler(self, checkpoint_folder):
        super()._load_optimizer_and_scheduler(checkpoint_folder)  # TRL restores the controller
        if self._stage is not None and checkpoint_folder is not None:
            stages.set_base_learning_rate(self.optimizer, self.lr_scheduler, self._stage.learning_rate)

    # --- Pre-flight and the model card
    def _check_prompt_lengths(self) -> None:
        """Prompts that do not fit the context, by TRL's own tokenisation: an error, or a warning (`data.py`)."""
        check_prompts_fit(
            self.train_dataset, self.eval_dataset, lambda batch: super(OR1Trainer, self)._tokenize_prompts(batch)[0],
            self.accelerator.unwrap_model(self.model).config.get_text_config(),
            max([self.args.max_completion_length] + [s.max_completion_length for s in self._stage_shapes]),
            getattr(self.args, "max_prompt_length", None), self.args.vllm_max_model_length if self.use_vllm else None,
            strict=isinstance(self.args, OR1Config), is_vlm=self._is_vlm,
            tokenised_elsewhere=self.rollout_func is not None or self.environment_factories is not None,
            warn=logger.warning if self.accelerator.is_main_process else lambda message: None,
        )

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = getattr(self.args, "max_prompt_length", None)
        if limit is not None:  # keep the last `max_prompt_length` tokens (left truncation, as TRL's SDPO trainer)
            prompt_ids = [ids[-limit:] for ids in prompt_ids]
        return prompt_ids, images, multimodal_fields

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        """TRL's card, plus the OR1 section (recipe, settings, stages, final metrics, eval results; `model_card.py`)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        self._card_dataset_name = dataset_name or getattr(self, "_card_dataset_name", None)
        model_card.write_section(os.path.join(self.args.output_dir, "README.md"), model_card.or1_section(
            self.args, self.state, get_config_model_id(self.accelerator.unwrap_model(self.model).config) or None,
            self._card_dataset_name, len(self.train_dataset) if isinstance(self.train_dataset, Dataset) else None,
            read_eval_summary(os.path.join(self.args.output_dir, model_card.EVAL_SUBDIR)), self._stage_shapes))
