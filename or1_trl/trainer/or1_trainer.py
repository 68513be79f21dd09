"""`OR1Trainer`: Skywork-OR1's MAGIC objective (§3.1) wired into TRL's `GRPOTrainer` hooks.

TRL 1.16 does, and we use as it is: generation, reward calls, advantages (eq. 2.5), its loss (any `loss_type`) with
PPO clipping, the fused LM head (no `[B, T, V]` logits), the 80/20 mask, checkpointing the entropy controller.
One step k = one generation batch, on-policy; each hook wraps TRL's (super(), then a few lines calling a module):

0. `__init__`: **pre-flight** (`data/preflight.py`, `packing.py`) before the model loads. `train`: **stages**
   (§3.2.2, `stage_run.StageRun`), one pass of transformers' loop each, resuming from the previous stage's last
   complete checkpoint (`trainer/checkpoint.py`); at a stage start the **online filter** shrinks the pool
   (`recipe/prompts.PromptSchedule`) that `_get_train_sampler` draws from.
1. `_calculate_rewards`: the rollout's record (`rollout_record.Rollout`): rewards of all ranks, each row's prompt,
   truncation and length, handed to the `_scored` call it belongs to; a returned inf/NaN is an error, or scored 0
   and counted (`trainer/reward_checks.py`).
2. `_generate_and_score_completions`: the **rollout correction** toward the generator replaces TRL's
   `importance_sampling_ratio` of every rollout batch (`recipe/rollout_correction.py`); the **advantage masks for
   truncated responses** (§3.2.3, `recipe/advantages.py`), if chosen; **per-prompt statistics**
   (`PromptSchedule.record`); **rejection sampling** (`recipe/rejection.reject`): all-equal groups leave the batch
   (T~_k), optionally refilled from the pool; T_k recounted over the kept tokens of all ranks. In evaluation: avg@n
   and pass@k (`eval/evaluation.py`).
3. `_compute_loss`: **eq. 3.1** (`recipe/loss.magic_loss`): TRL's loss on the kept tokens, normalised over the kept
   groups, plus α_k·H normalised alike; **eq. 3.2**: the entropy controller (`recipe/entropy.py`) sets c from e_k.
4. `_get_per_token_logps_and_entropies`: keeps TRL's policy pass for the entropy term (`logprob_backend="liger"`
   binds Liger's kernel into the fused head of this trainer's models, `trainer/logprobs.py`); with `padding_free`,
   every pass forwards the rows packed without padding (`trainer/packing.py`).
5. `training_step`: a step with no trainable token on any rank has its update skipped as if it had not happened
   (`trainer/sharding.py`; counted, warned about); so is a step whose gradients hold NaN/inf on any rank (the
   **non-finite sentinel**, `trainer/nonfinite.py`; several in a row stop the run with a checkpoint). With
   `_generate`, `_calculate_rewards`, `_prepare_inputs` it times the step's phases (`observability.RunWatch`).
   `_generate`: paired rollouts (`rollout_seed`, `generation/seeded.py`); one-step-off ones, with `get_batch_samples`
   (`async_generation`, `generation/overlap.py`); `_generate_single_turn`: NaN/inf logits stop it (`finite_logits`);
   completions end at `stop_pattern`, if set (`generation/stop.cut_rollout`).

Patches, each scoped and commented where it is made, are listed in docs/architecture.md ("Process-wide patches").
Not scoped: on Hopper GPUs, PyTorch's cuDNN SDPA backend off for the process (`__init__`, `attention_guard.py`).

With every OR1 feature off (`rejection_sampling="off"`, `use_adaptive_entropy=False`, `entropy_coef=0`,
`logprob_backend="trl"`, `rollout_correction="trl"`) or with a plain `GRPOConfig` (`OR1Config.from_grpo`: every OR1
field at `or1_config.TRL_BEHAVIOUR`, the one table of them), the trainer is `GRPOTrainer` unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer

from ..data.released import released_format_inputs
from ..eval import model_card
from ..eval.evaluation import group_pass_at_k
from ..generation import finite_logits, seeded, stop as stopping
from ..generation.overlap import OverlappedRollouts
from ..generation.vllm_generation import generation_backend
from ..recipe.advantages import leave_group_statistics, zero_truncated
from ..recipe.entropy import AdaptiveEntropyController, StepWindow
from ..recipe.loss import Normaliser, magic_loss, sampled_token_entropy, selected_normaliser
from ..recipe.rejection import KEPT_GROUP_ROWS_KEY, KEPT_ROWS_KEY, count_kept, loss_mask, reject
from ..recipe.rollout_correction import RolloutCorrection
from . import attention_guard, checkpoint, logprobs, nonfinite, sharding, stage_run
from .inputs import INDEX_COLUMN, check_prompt_lengths, keep_last_tokens, preflight, prompt_schedule
from .observability import RunWatch, accuracy_metrics, changed_defaults
from .or1_config import OR1Config
from .packing import check_packable, packed_pass
from .reward_checks import record_abstentions, screen_rewards
from .rollout_record import Rollout, row_facts, scalar_rewards

logger = logging.get_logger(__name__)

class OR1Trainer(GRPOTrainer):
    """Drop-in replacement for [`~trl.GRPOTrainer`] that trains with the Skywork-OR1 MAGIC objective.

    Same constructor and usage as `GRPOTrainer`; an [`OR1Config`] gets the recipe, a `GRPOConfig` TRL's objective.

    Args:
        model, reward_funcs, train_dataset, eval_dataset, processing_class, ...: exactly as [`~trl.GRPOTrainer`];
            the datasets also in the paper's released (verl) format (`data/released.py`; `reward_funcs=None`: each row
            scored by its own verifier, `rewards.mixed_rewards`).
        args ([`OR1Config`], *optional*): defaults to `OR1Config("<model>-OR1")`, the MAGIC recipe.

    Attributes:
        entropy_controller ([`AdaptiveEntropyController`]): state of eq. 3.2 (`entropy_coef` mirrors its c).
        or1_rows_forwarded (`int`): rows that went through the policy forward/backward on this rank.
        or1_skipped_steps (`int`): optimizer steps skipped because no token was trainable (e.g. every group rejected).
        sentinel ([`~trainer.nonfinite.NonFiniteSentinel`]): steps not applied for NaN/inf gradients, and their counts.
        prompt_schedule ([`PromptSchedule`]): the prompt pool, per-prompt statistics, sampler position and refill
            stream (`OR1Config` with a `datasets.Dataset`; else `None`); `prompt_pool` and `prompt_stats` are its.
        logprob_backend (`str`): `"trl"` or `"liger"`, what `OR1Config.logprob_backend` resolved to here.
    """

    _tag_names = ["trl", "grpo", "or1"]
    _policy_pass = None  # inside `_compute_loss`: TRL's policy pass ("outputs") and 80/20 mask ("high_entropy")
    _name = "OR1"
    # The card TRL writes cites the seed papers, then GRPO's (DeepSeekMath).
    _paper = {**model_card.PAPER, "citation": f"{model_card.CITATIONS}\n\n{GRPOTrainer._paper['citation']}"}

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, *rest, **kwargs):
        args = OR1Config.from_grpo(args, model)  # a plain GRPOConfig: every OR1 field at TRL's behaviour
        # The released (verl) format gets our columns, and each row its verifier when none is given.
        reward_funcs, train_dataset, eval_dataset = released_format_inputs(reward_funcs, train_dataset, eval_dataset)
        preflight(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)
        self.entropy_controller = AdaptiveEntropyController.for_config(args)
        self._or1_loss_enabled = args.or1_loss_enabled
        self._entropy_window = StepWindow()  # e_k over the micro-steps of the current optimizer step
        self._rollout = Rollout(torch.empty(0))  # the record of the step's rollout (`_generate_and_score_completions`)
        self._scoring: Rollout | None = None  # `_calculate_rewards`' record, until the `_scored` call it belongs to
        self.or1_rows_forwarded = self.or1_skipped_steps = 0
        self.logprob_backend = "trl"  # resolved for the device and model below, once the model is loaded
        # What the trainer trains on, and when (§3.1, §3.2.2): the prompt schedule and the stages, checked here.
        self.prompt_schedule, train_dataset = prompt_schedule(args, train_dataset)
        pool_size = len(self.prompt_pool) if self.prompt_schedule else 0
        self._stages = stage_run.StageRun(args.stage_list, args, num_processes=args.world_size, pool_size=pool_size)
        sharding.check_before_loading(args, self._stages.shapes)  # what DeepSpeed cannot run
        # vLLM server mode: TRL's NCCL weight transfer, or safetensors through a shared directory (disk_sync.py).
        # Process-wide: the module-level name TRL builds its backend by is swapped during this call only.
        with generation_backend(args) if args.vllm_weight_sync is not None else nullcontext():  # None: TRL's
            super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kwargs)
        policy = self.accelerator.unwrap_model(self.model)
        self.logprob_backend = logprobs.attach(self)  # resolved for the device and model, said, bound (`logprobs.py`)
        attention_guard.guard(args.cudnn_sdpa_guard, policy, announce=self.accelerator.is_main_process)
        check_prompt_lengths(self, super()._tokenize_prompts, warn=self._warn, completion_length=max(
            [args.max_completion_length] + [shape.max_completion_length for shape in self._stages.shapes]))
        self._watch = RunWatch.attach(self, args, sink=self._log_metrics)  # time split, final state, warnings
        self.update_skip = sharding.attach(self)  # the backend asked for, or one line; skipped updates (`sharding.py`)
        self.sentinel = nonfinite.attach(self, stop_after=args.nonfinite_stop_after)  # NaN/inf never applied
        self._rollout_correction = RolloutCorrection.for_config(args, use_vllm=self.use_vllm)  # MAGIC on vLLM only
        self._overlap = OverlappedRollouts.for_trainer(self) if args.async_generation else None  # one-step-off
        self.rollout_seeds = seeded.RolloutSeeds.for_trainer(self)  # paired rollouts (`rollout_seed`)
        self.completion_stop = stopping.for_trainer(args, self._tokenizer)  # completions end at `stop_pattern`
        if self._stages:  # the sampler's own resume, each stage's end, every stage fits vLLM
            self._stages.attach(self)
        self._warn(*changed_defaults(args))  # what OR1Config changes of GRPOConfig's defaults, said once

    @property
    def prompt_pool(self):
        return self.prompt_schedule.pool if self.prompt_schedule else None

    @property
    def prompt_stats(self):
        return self.prompt_schedule.stats if self.prompt_schedule else None

    # TRL's own controller state (`entropy_coef`, `_last_world_entropy`) is our controller's state, so TRL's
    # checkpointing (`entropy_ctrl_state.json`) saves and restores it unchanged.
    @property
    def entropy_coef(self) -> float:
        return self.entropy_controller.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.entropy_controller.coef = value

    @property
    def _last_world_entropy(self):
        return self.entropy_controller.last_entropy

    @_last_world_entropy.setter
    def _last_world_entropy(self, value) -> None:
        self.entropy_controller.last_entropy = value

    # --- 1-2. Rewards, per-prompt statistics and rejection sampling (§3.1): T~_k = { i : some A_ij != 0 }
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self._watch.timed("reward", self.model.training), record_abstentions(self) as abstained:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions=completions,
                                                          completion_ids_list=completion_ids_list)
        # A reward function's inf/NaN: an error naming it and the sample, or scored 0 and counted (`reward_checks.py`).
        rewards_per_func = screen_rewards(
            self, self._watch.nonfinite, rewards_per_func=rewards_per_func, abstained=abstained, inputs=inputs,
            prompts=prompts, completions=completions, index_column=INDEX_COLUMN)
        rollout = Rollout(scalar_rewards(rewards_per_func, self.reward_weights))  # [B*G over all ranks]
        if self.model.training:  # per row, gathered like the rewards: dataset index, truncated, length
            stop = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            facts = row_facts(inputs, completion_ids_list, stop_ids=stop, index_column=INDEX_COLUMN,
                              stopped=stopping.stopped_rows(self.completion_stop, completion_ids_list))
            local = torch.tensor(facts, dtype=torch.long, device=rewards_per_func.device)  # [b, 3]
            rollout.rows = self.accelerator.gather(local)  # [B*G, 3]
            self._log_metrics(accuracy_metrics(rollout.rewards, rollout.rows[:, 1]))
            if self.args.truncated_advantage_mask == "before":  # truncated rows leave the group statistics
                rewards_per_func = leave_group_statistics(rewards_per_func, rollout.rows[:, 1])
                rollout.group_rewards = scalar_rewards(rewards_per_func, self.reward_weights)
        self._scoring = rollout  # taken by the `_scored` call this rollout batch belongs to
        return rewards_per_func

    def _scored(self, inputs) -> tuple[dict, Rollout]:
        """TRL's rollout batch, with our rollout correction toward the generator (`recipe/rollout_correction.py`) and
        the truncated responses' advantage mask (`recipe/advantages.py`), and the rollout's record."""
        batch = super()._generate_and_score_completions(inputs)
        rollout, self._scoring = self._scoring, None
        if self.args.truncated_advantage_mask != "none" and self.model.training:
            start = self.accelerator.process_index * len(batch["advantages"])  # this rank's rows: 0 where truncated
            truncated = rollout.rows[start : start + len(batch["advantages"]), 1]  # [b]
            batch["advantages"] = zero_truncated(batch["advantages"], truncated)
        if self._rollout_correction is not None:
            mode = "train" if self.model.training else "eval"
            self._warn(*self._rollout_correction.apply(batch, self.accelerator.gather, metrics=self._metrics[mode],
                                                       training=mode == "train"))
        return batch, rollout

    def _generate_and_score_completions(self, inputs):
        if self._overlap is not None:  # the step's own rollout is generated next (refills come later, in `more`)
            self._overlap.step_rollout_next(self.model.training)
        batch, rollout = self._scored(inputs)
        if not self.model.training:  # evaluation: avg@n and unbiased pass@k per eval prompt, over all ranks
            for name, values in group_pass_at_k(rollout.rewards.tolist(), self.num_generations_eval).items():
                self._metrics["eval"][name].extend(values)
            return batch
        self._rollout = rollout
        self._record_prompt_stats(rollout)
        if not self._or1_loss_enabled:
            return batch
        if (mode := self.args.rejection_sampling) != "off":
            def more():  # a refill: another rollout batch from the pool, all ranks in lockstep
                rows = self.prompt_schedule.refill_rows(self._stages.index, num_groups, self.num_generations)
                start = self.accelerator.process_index * len(inputs)
                extra, record = self._scored([self.train_dataset[i] for i in rows[start : start + len(inputs)]])
                self._record_prompt_stats(record, refill=True)  # a refill's record is only for the statistics
                return extra, record.judged_rewards

            num_groups = len(rollout.rewards) // self.num_generations
            rejection = reject(
                batch, rollout.judged_rewards, num_generations=self.num_generations, mode=mode,
                rank=self.accelerator.process_index, steps_per_generation=self.args.steps_per_generation,
                pad_token_id=self._tokenizer.pad_token_id, refill_rounds=self.args.rejection_refill_rounds, more=more)
            batch, rollout.outcomes = rejection.batch, rejection.outcomes
            self._log_metrics(rejection.metrics)

        # T_k (eq. 3.1's normaliser) and the kept rows, over all ranks, into the batch. Nothing to train on anywhere
        # (every group rejected, or every completion masked): the step runs zero-weight backward passes, no update.
        rollout.skip_update = count_kept(batch, self.accelerator.gather).item() == 0
        return batch

    def _record_prompt_stats(self, rollout: Rollout, refill: bool = False) -> None:
        """The rollout's per-prompt outcomes (all ranks) into the schedule; a regular rollout's stage and pool size."""
        if self.prompt_schedule is None:
            return
        self.prompt_schedule.record(
            self._stages.index, step=self.state.global_step + 1, rows=rollout.rows.tolist(),
            rewards=rollout.rewards.tolist(),
            prompts_per_batch=self.args.generation_batch_size // self.num_generations,
            refill=refill, write_log=self.accelerator.is_main_process)
        if not refill:
            self._log_metrics({"stage": float(self._stages.index), "pool/size": float(len(self.prompt_pool))})

    # --- 3-4. The MAGIC loss (eq. 3.1) and adaptive entropy control (eq. 3.2); log-probs and entropies (`logprobs.py`)
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if self.args.padding_free:  # every pass (policy, old policy, reference) packed (`packing.py`)
            check_packable(compute_aux_loss, multimodal)
            logps, entropies, slots = packed_pass(
                model, self.accelerator, input_ids=input_ids, attention_mask=attention_mask,
                logits_to_keep=logits_to_keep, budget=self.args.max_tokens_per_microbatch,
                compute_entropy=compute_entropy)
            outputs = (logps, entropies, None)
        else:
            outputs = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep=logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
            slots = input_ids.numel()
        if self._policy_pass is not None and "outputs" not in self._policy_pass:  # inside `_compute_loss`: TRL's
            # policy pass, kept for the entropy term; its token fill of this rank's micro-batch (no collective on the
            # hot path; the main process logs its own)
            self._policy_pass["outputs"] = outputs
            self._metrics["train" if self.model.training else "eval"]["update/token_fill"].append(
                attention_mask.sum().item() / slots)
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
        if mode == "train" and self._rollout.skip_update and self.update_skip.without_passes():  # nothing to train on
            self._watch.log_skipped_micro_step(self._metrics[mode], controller=self.entropy_controller)  # any rank:
            return self.update_skip.empty_micro_step()  # no log-prob pass, no backward (`sharding.py`)
        mask = loss_mask(inputs)  # [b, T] kept tokens
        self.or1_rows_forwarded += mask.size(0) if mode == "train" else 0
        # TRL's policy loss, whatever its loss_type / β / GSPO / off-policy mask, on the kept tokens (TRL's mask is
        # completion_mask · tool_mask); its own entropy bonus off, ours below. The policy pass is kept for the bonus.
        self._entropy_bonus_enabled, self._policy_pass = False, {}
        # Compacted ranks hold different row counts: this trainer's `accelerator.gather` NaN-pads TRL's per-row
        # metric gathers while TRL's loss runs (an instance attribute, removed on exit; other trainers untouched).
        compact = mode == "train" and self.args.rejection_sampling == "compact"
        with sharding.row_gathers_padded(self.accelerator, active=compact):
            trl_loss = super()._compute_loss(model, {**inputs, "tool_mask": mask})
        policy_pass, self._policy_pass = self._policy_pass, None
        logps, entropies, aux_loss = policy_pass["outputs"]  # [b, T], [b, T], scalar

        # Counted over the kept groups only (T~_k): T_k for token-level types, the kept rows for row means.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        steps = self.args.steps_per_generation if mode == "train" else 1
        num_processes = self.accelerator.num_processes
        norm = Normaliser.for_micro_step(
            self.loss_type, num_items=inputs["num_items_in_batch"], kept_group_rows=inputs.get(KEPT_GROUP_ROWS_KEY),
            num_rows=mask.size(0), num_processes=num_processes, accumulation=accumulation, steps_per_generation=steps,
            max_completion_length=self.max_completion_length)
        selected = None  # 80/20, the official code's normaliser: the selected tokens instead of T_k
        if self.top_entropy_quantile < 1.0 and self.args.top_entropy_normalization == "selected":
            selected = selected_normaliser(
                mask, policy_pass["high_entropy"], kept_rows=inputs.get(KEPT_ROWS_KEY), reduce=self._sum_over_ranks,
                num_processes=num_processes, accumulation=accumulation, steps_per_generation=steps)
        aux = self.router_aux_loss_coef * aux_loss / accumulation if self.aux_loss_enabled else 0.0
        alpha = self.entropy_controller.coefficient()
        out = magic_loss(trl_loss, aux_loss=aux, entropies=entropies, mask=mask, norm=norm, alpha=alpha,
                         selected=selected)

        if mode == "train" and self.args.use_adaptive_entropy:
            old_logps = inputs.get("old_per_token_logps")
            self._update_entropy_controller(logps.detach() if old_logps is None else old_logps, entropies, mask)
        self._watch.log_loss(self._metrics[mode], self.accelerator.gather, policy_loss=out.policy_loss, alpha=alpha,
                             entropies=entropies, mask=mask, training=mode == "train")
        if mode == "train" and self._rollout.skip_update and self.accelerator.sync_gradients:
            self.update_skip.skip()  # DeepSpeed, FSDP: the backward of zero-weight rows, then no update
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

    # --- 5. The update, and what the run shows (`observability.py`): skipped steps, time split, entropy warnings
    def training_step(self, model, inputs, num_items_in_batch):
        with self._watch.timer.phase("update"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.sentinel.count_loss(loss)  # a non-finite step is not applied; several in a row stop (`nonfinite.py`)
        rollout, skipped = self._rollout, self.update_skip.skipping  # no trainable token: no update (`sharding.py`)
        self.or1_skipped_steps += skipped
        if (self.accelerator.sync_gradients or skipped) and self._or1_loss_enabled:
            self._metrics["train"]["skipped_steps"] = [float(self.or1_skipped_steps)]  # a count: never averaged
            self._metrics["train"]["entropy/target"].append(self.entropy_controller.target)
            self._warn(*self._watch.end_step(self.entropy_controller.coef, self._sum_over_ranks, rollout))
        return loss

    def _generate(self, prompts):
        overlap = self._overlap  # one-step-off: the next step's prompts go to the server while this step trains
        regular = overlap is not None and overlap.before_generation(self.state.global_step, self._last_loaded_step)
        # vLLM server down past `vllm_server_timeout`: a complete checkpoint, then one line (`server_health.py`)
        with self._watch.timed("rollout", self.model.training), checkpoint.stop_with_checkpoint(self):
            output = self.rollout_seeds.generate(self, lambda: super(OR1Trainer, self)._generate(prompts))
            if regular:
                self._log_metrics(overlap.request_next(self.state.global_step,
                                                       end_step=self._stages.end_step(self.state.max_steps),
                                                       tokenize=self._tokenize_prompts,
                                                       num_generations=self.num_generations))
        return output

    def _generate_single_turn(self, *args, **kw):  # a NaN/inf at sampling: one line (`finite_logits.checked_rollout`)
        completion_ids, logprobs = finite_logits.checked_rollout(
            self, lambda: super(OR1Trainer, self)._generate_single_turn(*args, **kw))
        return stopping.cut_rollout(self, completion_ids=completion_ids, logprobs=logprobs)  # `stop_pattern`

    def _prepare_inputs(self, generation_batch):  # the rollout's bookkeeping (generation, rewards: timed as such)
        with self._watch.timed("other", self.model.training):
            return super()._prepare_inputs(generation_batch)

    def _log_metrics(self, metrics: dict[str, float], mode: str = "train") -> None:
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _warn(self, *messages: str) -> None:
        for message in messages if self.accelerator.is_main_process else ():
            logger.warning(message)

    # --- Checkpoints (`trainer/checkpoint.py`): TRL's files, our state, the completeness marker, then the rotation
    def _checkpoint_files(self) -> list[str]:
        return checkpoint.required_files(self)

    def _save_checkpoint(self, model, trial):
        checkpoint.save_complete(self, lambda: super(OR1Trainer, self)._save_checkpoint(model, trial), trial)

    def _issue_warnings_after_load(self, load_result):  # at every resume and stage start: a tied head is not missing
        super()._issue_warnings_after_load(checkpoint.without_tied_keys(self.accelerator.unwrap_model(self.model),
                                                                        load_result))

    # --- 0. Stages (§3.2.2, `stage_run.py`) over the prompt schedule (§3.1, `prompts.py`)
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train` from complete checkpoints only (`checkpoint.py`; a previous run's `output_dir` needs
        `resume_from_checkpoint` or `overwrite_output_dir=True`), over every stage of `OR1Config.stages`: one pass of
        transformers' loop each, ending with a checkpoint the next resumes from, so all state carries over."""
        def one_pass(folder):  # transformers' loop, from `folder` (`None`: a fresh start)
            return super(OR1Trainer, self).train(resume_from_checkpoint=folder, trial=trial, **kwargs)

        try:
            args = self.args
            checkpoint.prepare_output_dir(args.output_dir, resume_from_checkpoint,
                                          overwrite_output_dir=args.overwrite_output_dir,
                                          main_process=self.accelerator.is_main_process)
            self.accelerator.wait_for_everyone()
            folder = checkpoint.resolve_resume(args.output_dir, resume_from_checkpoint, self._checkpoint_files())
            return self._stages.walk(self, folder, train_pass=one_pass, enter_stage=self._enter_stage)
        finally:  # a rollout requested ahead is not trained on after the run (nor saved: `overlap.py`)
            if self._overlap is not None:
                self._overlap.reset()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        def fetch():
            return super(OR1Trainer, self).get_batch_samples(epoch_iterator, num_batches, device)

        batches = self._overlap.batches(epoch_iterator, fetch) if self._overlap is not None else fetch()
        if (folder := self._stages.take_resumed_from()) is not None:  # after the first fetch (`StageRun`)
            self._load_rng_state(folder)
        return batches

    def _enter_stage(self, index: int) -> None:
        """Make stage `index` current (`StageRun.start`: the online filter, TRL's settings for its shape; log-probs are
        taken at the sampling temperature, so a new one re-patches the head)."""
        self._stages.start(self, index, warn=self._warn, repatch=partial(logprobs.use_for_trainer, self))
        self._step, self._buffered_inputs = 0, None  # TRL's generation counter restarts with the new shape
        if self._overlap is not None:  # the rollout in flight had the previous stage's shape: discarded
            self._overlap.reset()

    def _get_train_sampler(self, dataset=None):
        if not self._stages:
            return super()._get_train_sampler(dataset)
        shape = self._stages.current  # `_enter_stage` set the schedule's position (restored, or 0 at a stage start)
        return self.prompt_schedule.new_sampler(shape.index, batch_size=shape.batch_size,
                                                num_generations=shape.num_generations,
                                                repeat_count=self.num_iterations * shape.steps_per_generation)

    def _load_optimizer_and_scheduler(self, checkpoint_folder):
        super()._load_optimizer_and_scheduler(checkpoint_folder)  # TRL restores the controller
        if self._stages.current is not None and checkpoint_folder is not None:
            stage_run.set_base_learning_rate(self.optimizer, self.lr_scheduler, self._stages.current.learning_rate)

    # --- Pre-flight and the model card
    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        return keep_last_tokens(prompt_ids, self.args.max_prompt_length), images, multimodal_fields

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        """TRL's card, plus the OR1 section (recipe, settings, stages, final metrics, eval results)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            self._card_dataset_name = dataset_name or getattr(self, "_card_dataset_name", None)
            model_card.write_for_trainer(self, self._card_dataset_name, stage_shapes=self._stages.shapes)
