"""`OR1Trainer`: Skywork-OR1's MAGIC objective (§3.1) wired into TRL's `GRPOTrainer` hooks.

What TRL 1.16 already does and we use as it is: generation (local or vLLM server), Math-/code-reward calls,
group-normalised advantages (eq. 2.5), its loss (every `loss_type`, "dapo" by default), PPO clipping, the
fused LM head that returns log-probs and entropies without materialising `[B, T, V]` logits, the 80/20
high-entropy token mask (`get_high_entropy_mask`), and the checkpointing of the entropy-controller state.

What this class adds, hook by hook (one step k = one generation batch, on-policy):

0. `train` — **stages** (§3.2.2, `stages.py`): one pass of transformers' loop per stage, each resuming from the
   previous stage's last (complete, `checkpoint.py`) checkpoint with the stage's length, group and batch shape;
   at each stage start the **online filter** (§3.1, `prompts.py`) shrinks the prompt pool that
   `_get_train_sampler` draws from.
0. `__init__` — **pre-flight** (`data.py`): the columns the rewards need, no empty dataset, gold answers the
   verifiers can read (before the model loads); then prompts that do not fit the context (TRL's own tokenisation),
   cut by `_tokenize_prompts` to `max_prompt_length` where set.
1. `_calculate_rewards`  — keeps the rewards of all ranks, and each row's prompt, truncation and length; a reward
   function's `inf`/NaN is an error, or scored 0 and counted (`reward_checks.py`).
2. `_generate_and_score_completions` — **per-prompt statistics** (`prompts.py`, `prompt_stats.jsonl`); **rejection
   sampling** (`rejection.py`): groups whose rewards are all equal leave the batch (T~_k), optionally refilled from
   the pool; the normaliser T_k is recounted over the kept tokens of all ranks; rows are compacted (or masked)
   before TRL shuffles and splits the batch into micro-steps. In evaluation (TRL's `eval_dataset` path) it only
   adds avg@n and pass@k per eval prompt (`evaluation.py`), logged as `eval_avg@n` / `eval_pass@k`.
3. `_compute_loss` — **eq. 3.1**: TRL's own loss (PPO-clip per token for "dapo", or any other `loss_type`, β·KL,
   GSPO, the off-policy mask; the 80/20 mask) on the kept tokens, its count of kept groups fixed (`loss.py`), plus
   α_k·H over every kept token normalised like the loss (α Σ H / T_k for "dapo"); then **eq. 3.2**: the entropy
   controller (`entropy.py`) measures e_k over all kept tokens of the step and updates c at the optimizer-step boundary.
4. `_get_per_token_logps_and_entropies` — **log-prob backend** (`logprobs.py`): TRL's fused LM head computes the
   log-probs and entropies of every pass; with `logprob_backend` resolved to `"liger"`, Liger's chunked kernel runs
   inside it instead of TRL's.
5. `training_step` — a step with no trainable token on any rank (every group rejected, or every completion
   masked) drops its (zero-weight) gradients, so the optimizer does not move (neither Adam's momentum nor weight
   decay); it is counted, and a run of `skipped_steps_warning` such steps is warned about (`observability.py`).
5. What the run shows (`observability.py`): `_generate`, `_calculate_rewards`, `_prepare_inputs` and `training_step`
   open the phases of the step's **time split** (rollout / reward / update / other; CPU clocks, no device sync);
   training **accuracy** over all and over non-truncated samples; the **entropy-collapse and low-start warnings**;
   the final `trainer_state.json` in `output_dir` for `or1-trl plot`.

Generation on a vLLM server (`vllm_mode="server"`) is TRL's, with one addition: `vllm_weight_sync="disk"`
(`weight_sync.py`) sends the weights through a shared directory where TRL only has NCCL.

With every OR1 feature off (`rejection_sampling="off"`, `use_adaptive_entropy=False`, `entropy_coef=0`,
`logprob_backend="trl"`) or with a plain `GRPOConfig`, the trainer is `GRPOTrainer` unchanged.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
from datasets import Dataset
from transformers import ProgressCallback, TrainerCallback
from transformers import trainer as hf_trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, get_config_model_id

from . import checkpoint, model_card
from .config import OR1Config, check_liger_layer_kernels
from .data import check_datasets, check_prompt_lengths, prompt_lengths, released_format_inputs
from .entropy import AdaptiveEntropyController
from .evaluation import group_pass_at_k
from .evaluation import read_summary as read_eval_summary
from .logprobs import liger_lm_head, resolve_logprob_backend
from .loss import Normaliser, sampled_token_entropy, selected_tokens_normaliser, share
from .observability import (
    EntropyWatch,
    SaveFinalState,
    SkippedStepWatch,
    StepTimer,
    StepTimerCallback,
    accuracy_metrics,
)
from .prompts import PromptPool, PromptSampler, PromptStats, StatsLog, batch_outcomes, prompt_ids
from .reward_checks import NONFINITE_METRIC, nonfinite_mask, nonfinite_message, record_abstentions
from .rejection import (
    WEIGHT_KEY,
    cap_kept_groups,
    compact_batch,
    concat_batches,
    group_outcomes,
    mask_batch,
    row_gathers_padded,
)
from .stages import StageShape, set_base_learning_rate, stage_index, stage_shapes
from .weight_sync import generation_backend

logger = logging.get_logger(__name__)

OR1_STATE_FILE = "or1_state.json"
TRL_ENTROPY_STATE_FILE = "entropy_ctrl_state.json"  # written by GRPOTrainer._save_checkpoint
KEPT_ROWS_KEY = "or1_kept_rows"  # rows with at least one trainable token, over all ranks (batch-level scalar)
KEPT_GROUP_ROWS_KEY = "or1_kept_group_rows"  # rows of kept groups, over all ranks (with rejection; batch-level scalar)
INDEX_COLUMN = "or1_index"  # added to the train dataset: the row's index, for per-prompt statistics
PROMPTS_STATE_FILE = "or1_prompts.json"  # pool, sampler position, size of prompt_stats.jsonl
PROMPT_STATS_STATE_FILE = "or1_prompt_stats.json"  # the aggregate per-prompt statistics
PROMPT_STATS_LOG = checkpoint.PROMPT_STATS_LOG  # per-prompt outcomes, one record per prompt and step


class _StageEnd(TrainerCallback):
    """Ends `Trainer.train` at the current stage's last step, saving a checkpoint the next stage starts from."""

    def __init__(self, trainer: "OR1Trainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        stage = self.trainer._stage
        if stage is not None and state.global_step >= stage.until_step and state.global_step < args.max_steps:
            control.should_save = True
            control.should_training_stop = True
        return control


class OR1Trainer(GRPOTrainer):
    """Drop-in replacement for [`~trl.GRPOTrainer`] that trains with the Skywork-OR1 MAGIC objective.

    Same constructor and usage as `GRPOTrainer`; pass an [`OR1Config`] to get the recipe (a plain `GRPOConfig`
    runs TRL's objective unchanged).

    Args:
        model, reward_funcs, train_dataset, eval_dataset, processing_class, reward_processing_classes,
        callbacks, optimizers, peft_config, ...: exactly as [`~trl.GRPOTrainer`].
        args ([`OR1Config`], *optional*): defaults to `OR1Config("<model>-OR1")`, the MAGIC recipe.
        train_dataset, eval_dataset: also in the paper's released (verl) format (`reward_model.ground_truth`,
            `ability`; `data.py`): they get the `answer` / `tests` columns our rewards read, and with
            `reward_funcs=None` each row is scored by its own verifier (`rewards.mixed_rewards`).

    Attributes:
        entropy_controller ([`AdaptiveEntropyController`]): state of eq. 3.2 (`entropy_coef` mirrors its c).
        or1_rows_forwarded (`int`): rows that went through the policy forward/backward on this rank.
        or1_skipped_steps (`int`): optimizer steps skipped because no token was trainable (e.g. every group rejected).
        prompt_stats ([`PromptStats`]): per-stage, per-prompt outcome counts (`OR1Config` with a `datasets.Dataset`).
        prompt_pool ([`PromptPool`]): the rows the sampler may draw, and the prompts the online filter removed.
        logprob_backend (`str`): `"trl"` or `"liger"`, what `OR1Config.logprob_backend` resolved to for this device
            and model (`logprobs.resolve_logprob_backend`).
    """

    _tag_names = ["trl", "grpo", "or1"]
    _policy_pass = None  # inside `_compute_loss`: the outputs of TRL's policy pass
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
        self._rollout_outcomes = None  # GroupOutcomes of the current rollout (rejection sampling)
        self._warned_nonfinite = False
        self.or1_rows_forwarded = 0
        self.or1_skipped_steps = 0
        self.logprob_backend = "trl"  # resolved for the device and model below, once the model is loaded

        # What the trainer trains on, and when (paper §3.1, §3.2.2): per-prompt statistics, the prompt pool and the
        # stage schedule. Everything that can be wrong with them fails here, before the model loads.
        self.prompt_stats = self.prompt_pool = self._stats_log = self._sampler = None
        self._prompt_ids: list[str] = []
        self._stages = args.stage_list if is_or1 else []
        self._stage_shapes: list[StageShape] = []
        self._stage: StageShape | None = None
        self._sampler_position = {"stage": 0, "consumed": 0, "refill": 0}  # rollout batches drawn in the stage
        self._refill: PromptSampler | None = None  # refill rounds draw from their own stream (rejection_refill_rounds)
        self._rows_all_ranks = None  # [B*G, 3] (dataset index, truncated, length) over all ranks
        self._rng_to_restore = None  # checkpoint whose RNG state to restore after the first batch fetch
        if is_or1 and isinstance(train_dataset, Dataset):
            self._prompt_ids = prompt_ids(train_dataset, args.prompt_id_column)
            train_dataset = train_dataset.add_column(INDEX_COLUMN, list(range(len(train_dataset))))
            self.prompt_pool, self.prompt_stats = PromptPool(self._prompt_ids), PromptStats()
            self._stats_log = StatsLog(os.path.join(args.output_dir, PROMPT_STATS_LOG))
        elif self._stages or (is_or1 and args.rejection_refill_rounds):
            raise ValueError(
                "stages and rejection_refill_rounds need a map-style `datasets.Dataset` as train_dataset (the prompt pool "
                "indexes it)."
            )
        if self._stages:
            self._stage_shapes = stage_shapes(self._stages, args, args.world_size)
            self._apply_stage_to_args(args, self._stage_shapes[0])
            if len(self.prompt_pool) < self._stage_shapes[0].batch_size:
                raise ValueError(
                    f"train_dataset holds {len(self.prompt_pool)} prompts, fewer than stage 0's batch of "
                    f"{self._stage_shapes[0].batch_size} prompts per rollout step."
                )
        # vLLM server mode: TRL's NCCL weight transfer, or safetensors through a shared directory (weight_sync.py).
        backend = generation_backend(args) if is_or1 else nullcontext()
        with backend:
            super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kwargs)
        if is_or1:
            self.logprob_backend, why = resolve_logprob_backend(
                args.logprob_backend, self.accelerator.unwrap_model(self.model), self.accelerator.device
            )
            logger.info(f"Log-probs and entropies: logprob_backend={self.logprob_backend!r} ({why}).")
        self._check_prompt_lengths()
        # What the run shows (`observability.py`): the time split of each step, the final trainer_state.json for
        # `or1-trl plot`, the entropy warnings.
        self._step_timer = StepTimer()
        self.add_callback(StepTimerCallback(self._step_timer, self._log_step_split))
        self.add_callback(SaveFinalState())
        self._step_entropy = [0.0, 0.0]  # [Σ H·m, Σ m] over the micro-steps of the current optimizer step
        self._entropy_watch = EntropyWatch.for_config(args) if is_or1 else None
        self._skipped_watch = SkippedStepWatch.for_config(args)
        if self._stages:
            self.args.ignore_data_skip = True  # the prompt sampler restores its own position on resume
            self.add_callback(_StageEnd(self))
            self._check_stage_lengths_fit_vllm()
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
        with self._timed("reward"), record_abstentions(self) as abstained:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards_per_func = self._check_nonfinite_rewards(rewards_per_func, abstained, inputs, prompts, completions)
        self._rewards_all_ranks = rewards_per_func  # [B*G over all ranks, n_funcs]
        if self.model.training:
            # Per row: dataset index (-1 without a pool), truncated (TRL's rule: no EOS/pad at the end), length —
            # gathered like the rewards.
            eos_and_pad = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            local = torch.tensor(
                [[row.get(INDEX_COLUMN, -1), not ids or ids[-1] not in eos_and_pad, len(ids)]
                 for row, ids in zip(inputs, completion_ids_list)],
                dtype=torch.long,
                device=rewards_per_func.device,
            )  # [b, 3]
            self._rows_all_ranks = self.accelerator.gather(local)  # [B*G, 3]
            for key, value in accuracy_metrics(self._scalar_rewards(), self._rows_all_ranks[:, 1]).items():
                self._metrics["train"][key].append(value)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            self._log_eval_pass_at_k()
            return batch
        rewards = self._scalar_rewards()  # [B*G] all ranks
        if self.prompt_stats is not None:
            self._record_prompt_stats(rewards)
        if not self._or1_loss_enabled:
            return batch

        if self._rejection_mode != "off":
            outcomes = self._rollout_outcomes = group_outcomes(rewards, self.num_generations)
            for name, value in outcomes.fractions().items():
                self._metrics["train"][f"rejection/{name}"].append(value)
            keep, num_groups = outcomes.keep, outcomes.num_groups  # [B] over all ranks
            keep_rows = self._local_rows(keep, len(inputs))  # [b]
            rounds = 0
            while rounds < self.args.rejection_refill_rounds and int(keep.sum()) < num_groups:
                # Refill (DAPO's dynamic sampling): another rollout batch from the pool, all ranks in lockstep; its
                # informative groups fill the batch up, and the rest of it is discarded.
                rounds += 1
                extra = super()._generate_and_score_completions(self._refill_inputs(num_groups, len(inputs)))
                extra_rewards = self._scalar_rewards()
                self._record_prompt_stats(extra_rewards, refill=True)
                extra_keep = group_outcomes(extra_rewards, self.num_generations).keep
                extra_keep = cap_kept_groups(extra_keep, num_groups - int(keep.sum()))
                batch = concat_batches(batch, extra, self._tokenizer.pad_token_id)
                keep, keep_rows = torch.cat([keep, extra_keep]), torch.cat([keep_rows, self._local_rows(extra_keep, len(inputs))])
            if self.args.rejection_refill_rounds:
                self._metrics["train"]["refill/rounds"].append(float(rounds))
                self._metrics["train"]["refill/generated_rows"].append(float(rounds * num_groups * self.num_generations))
                self._metrics["train"]["refill/batch_fill"].append(int(keep.sum()) / num_groups)
            if self._rejection_mode == "compact":
                batch = compact_batch(batch, keep_rows.to(batch["completion_ids"].device), self.args.steps_per_generation)
            else:
                batch = mask_batch(batch, keep_rows)

        # T_k: every trainable token of the kept groups, over all ranks (eq. 3.1's normaliser); the rows that hold
        # them (the 80/20 "selected" normaliser weighs micro-steps by their share of these rows); the kept groups' rows
        # (what the row-mean loss types count, `loss.Normaliser`).
        mask = self._loss_mask(batch)  # [b, T]
        weight = batch.get(WEIGHT_KEY, torch.ones_like(mask[:, 0]))  # [b]
        local = torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().float(), weight.sum()])  # [3]
        kept_tokens, kept_rows, group_rows = self.accelerator.gather(local).view(-1, 3).sum(dim=0)
        batch["num_items_in_batch"], batch[KEPT_ROWS_KEY] = kept_tokens, kept_rows
        if WEIGHT_KEY in batch:
            batch[KEPT_GROUP_ROWS_KEY] = group_rows
        # Nothing to train on anywhere (every group rejected, or every completion masked, e.g. all truncated with
        # mask_truncated_completions): the step runs its zero-weight backward passes and then skips the update.
        self._skip_update = kept_tokens.item() == 0
        return batch

    def _check_nonfinite_rewards(self, rewards_per_func, abstained, inputs, prompts, completions):
        """`[N, F]` rewards with no inf/NaN a function returned (`reward_checks.py`): an error naming the function and
        the sample, or with `nonfinite_rewards="zero"` scored 0, counted in `reward/nonfinite`, warned about once."""
        bad = nonfinite_mask(rewards_per_func, abstained, len(prompts), self.accelerator.gather)  # [N, F]
        zero = getattr(self.args, "nonfinite_rewards", "error") == "zero"
        if zero:
            self._metrics["train" if self.model.training else "eval"][NONFINITE_METRIC].append(float(bad.sum()))
        if not bad.any():
            return rewards_per_func
        message = nonfinite_message(
            bad, rewards_per_func, self.reward_func_names, self.accelerator.process_index * len(prompts), prompts,
            completions, [row.get(INDEX_COLUMN, -1) for row in inputs], self.state.global_step + 1,
            "Scored 0 (nonfinite_rewards='zero'; counted in reward/nonfinite); this warning is not repeated." if zero
            else "Fix the reward function, or set nonfinite_rewards='zero' to score such samples 0 (counted in "
            "reward/nonfinite).",
        )
        if not zero:
            raise ValueError(message)
        if not self._warned_nonfinite and self.accelerator.is_main_process:
            logger.warning(message)
        self._warned_nonfinite = True
        return rewards_per_func.masked_fill(bad, 0.0)

    def _log_eval_pass_at_k(self) -> None:
        """Evaluation (TRL's `eval_dataset` path): avg@n and unbiased pass@k per eval prompt, n = `num_generations_eval`,
        over all ranks; TRL's `log` averages them over the prompts of the evaluation (`eval_avg@n`, `eval_pass@k`)."""
        for name, values in group_pass_at_k(self._scalar_rewards().tolist(), self.num_generations_eval).items():
            self._metrics["eval"][name].extend(values)

    def _scalar_rewards(self) -> torch.Tensor:
        """`[B*G]` reward of each row of the last rollout over all ranks, as TRL sums it (NaN: every function abstained)."""
        rewards_per_func = self._rewards_all_ranks
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _local_rows(self, keep_groups: torch.Tensor, num_local: int) -> torch.Tensor:
        """`[b]` this rank's rows of the groups `keep_groups` (`[B]` over all ranks; TRL's row layout)."""
        start = self.accelerator.process_index * num_local
        return keep_groups.repeat_interleave(self.num_generations)[start : start + num_local]

    def _refill_inputs(self, num_groups: int, num_local: int) -> list[dict]:
        """This rank's rows of the next refill batch: `num_groups` prompts from the pool, each G times."""
        stage = self._stage.index if self._stage is not None else 0
        if self._refill is None or self._refill.stage != stage or self._refill.batch_size != num_groups:
            self._refill = PromptSampler(self.prompt_pool.active, num_groups, self.num_generations, 1,
                                         seed=self.args.seed + 1, stage=stage, consumed=self._sampler_position.get("refill", 0))
        prompts = self._refill.batch(self._refill.consumed)
        self._refill.consumed += 1
        self._sampler_position["refill"] = self._refill.consumed
        rows = [index for index in prompts for _ in range(self.num_generations)]
        start = self.accelerator.process_index * num_local
        return [self.train_dataset[index] for index in rows[start : start + num_local]]

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
        """`[b, T]` weight of each completion token: padding, tool output and rejected rows are 0."""
        mask = inputs["completion_mask"].float()
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        if WEIGHT_KEY in inputs:
            mask = mask * inputs[WEIGHT_KEY].unsqueeze(1)
        return mask

    def _record_prompt_stats(self, rewards: torch.Tensor, refill: bool = False) -> None:
        """Per-prompt outcomes of this rollout (all ranks) into the statistics and `prompt_stats.jsonl` (main process);
        for a regular rollout also the `stage` / `pool/size` metrics and one rollout batch of sampler position.

        A record's `epoch` is the pass over the pool (within its stage) its rollout batch belongs to: the sampler
        draws `len(pool) // prompts per rollout` batches per pass, every prompt at most once (TRL's `RepeatSampler`
        and our `PromptSampler` alike); refill batches count in the epoch of the rollout they refill."""
        index, truncated, lengths = self._rows_all_ranks.T.tolist()
        stage = self._stage.index if self._stage is not None else 0
        step = self.state.global_step + 1
        batches_per_pass = max(1, len(self.prompt_pool) // (self.args.generation_batch_size // self.num_generations))
        epoch = (self._sampler_position["consumed"] - (1 if refill else 0)) // batches_per_pass
        records = []
        for row, outcome in batch_outcomes(index, rewards.tolist(), truncated, lengths).items():
            pid = self._prompt_ids[row]
            self.prompt_stats.add(stage, pid, outcome)
            records.append({"prompt_id": pid, "stage": stage, "epoch": epoch, "step": step, "samples": outcome.samples,
                            "correct": outcome.correct, "truncated": outcome.truncated,
                            "mean_length": outcome.length_sum / outcome.samples})
        if self.accelerator.is_main_process:
            self._stats_log.append(records)
        if refill:
            return
        self._sampler_position["consumed"] += 1  # rollout batches drawn in this stage (with or without stages)
        if self._sampler is not None:
            self._sampler.consumed = self._sampler_position["consumed"]
        self._metrics["train"]["stage"].append(float(stage))
        self._metrics["train"]["pool/size"].append(float(len(self.prompt_pool)))

    def training_step(self, model, inputs, num_items_in_batch):
        with self._step_timer.phase("update"):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self._skip_update and self.accelerator.sync_gradients:
            # No trainable token in the step: the backward passes ran with weight 0 (keeping ranks in step); now make
            # the optimizer skip the update entirely (torch optimizers skip parameters whose grad is None), so that
            # neither Adam's momentum nor weight decay moves the weights.
            model.zero_grad(set_to_none=True)
            self.or1_skipped_steps += 1
        if self.accelerator.sync_gradients and self._or1_loss_enabled:
            self._metrics["train"]["skipped_steps"].append(float(self.or1_skipped_steps))
            self._watch_entropy()
            for message in self._skipped_watch.observe(self._skip_update, self._rollout_outcomes):
                if self.accelerator.is_main_process:
                    logger.warning(message)
        return loss

    # ---------------------------------------------------------------------------------------------------------
    # Log-probs and entropies (`logprobs.py`): TRL's fused LM head, with Liger's kernel inside it if chosen. Every
    # pass goes through here: the policy's, the old policy's and the reference model's.
    # ---------------------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        with liger_lm_head() if self.logprob_backend == "liger" else nullcontext():
            outputs = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._policy_pass is not None:  # inside `_compute_loss`: TRL's policy pass, for the entropy term
            self._policy_pass.append(outputs)
        return outputs

    # ---------------------------------------------------------------------------------------------------------
    # The MAGIC loss (eq. 3.1) and adaptive entropy control (eq. 3.2)
    # ---------------------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        if not self._or1_loss_enabled:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        mask = self._loss_mask(inputs)  # [b, T] kept tokens
        if mode == "train":
            self.or1_rows_forwarded += mask.size(0)
        # TRL's policy loss, whatever its loss_type / β / GSPO / off-policy mask, on the kept tokens (TRL's mask is
        # completion_mask · tool_mask); its own entropy bonus off, ours below. The policy pass is kept for the bonus.
        self._entropy_bonus_enabled, self._policy_pass = False, []
        with row_gathers_padded(self.accelerator):  # compacted ranks hold different numbers of rows
            loss = super()._compute_loss(model, {**inputs, "tool_mask": mask})
        (logps, entropies, aux_loss), self._policy_pass = self._policy_pass[0], None  # [b, T], [b, T], scalar

        # Counted over the kept groups only (T~_k): T_k for token-level types, the kept rows for row means.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        steps = self.args.steps_per_generation if mode == "train" else 1
        num_processes = self.accelerator.num_processes
        norm = Normaliser.for_micro_step(
            self.loss_type, inputs["num_items_in_batch"], inputs.get(KEPT_GROUP_ROWS_KEY), mask.size(0), num_processes,
            accumulation, steps, self.max_completion_length,
        )
        scale = norm.trl_factor()
        if self.top_entropy_quantile < 1.0 and self.args.top_entropy_normalization == "selected":
            # 80/20, the official code's normaliser: the selected tokens (TRL's mask, recomputed) instead of T_k.
            selected = mask * self.get_high_entropy_mask(entropies.detach(), mask, 1 - self.top_entropy_quantile)
            local = torch.stack([selected.sum(), (mask.sum(dim=1) > 0).sum().float()]).detach()  # [2]
            selected, with_tokens = self.accelerator.reduce(local, reduction="sum")
            kept_rows = share(inputs.get(KEPT_ROWS_KEY, with_tokens), num_processes, accumulation, steps)
            scale = norm.tokens / selected_tokens_normaliser(selected, with_tokens, kept_rows)
        aux = self.router_aux_loss_coef * aux_loss / accumulation if self.aux_loss_enabled else 0.0
        policy_loss = (loss - aux) * scale
        alpha = self.entropy_controller.coefficient()
        loss = policy_loss + aux
        if alpha != 0.0:  # α = 0 (the controller's usual state): no entropy term, so no entropy gradient either
            loss = loss - alpha * norm(entropies, mask)  # α·H over every kept token, normalised like the policy term

        if mode == "train" and self.args.use_adaptive_entropy:
            old_logps = inputs.get("old_per_token_logps")
            self._update_entropy_controller(logps.detach() if old_logps is None else old_logps, entropies, mask)
        self._log_loss_metrics(mode, norm.per_micro_batch(policy_loss.detach()), alpha, entropies, mask)
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

    def _log_loss_metrics(self, mode, policy_loss, alpha, entropies, mask):
        """Ours besides TRL's (`entropy`, `clip_ratio/*`, `kl` over the kept tokens): α, the policy part of the loss,
        and the step's entropy over kept tokens (all ranks) for the entropy watch."""
        metrics = self._metrics[mode]
        metrics["entropy/alpha"].append(alpha)
        metrics["entropy/active"].append(float(alpha != 0.0))
        metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if mode == "train":
            metrics["rejection/rows_forwarded"].append(float(mask.size(0)))
            local = torch.stack([(entropies.detach() * mask).sum(), mask.sum()])  # [2]
            total, kept = self.accelerator.reduce(local, "sum").tolist()
            self._step_entropy = [self._step_entropy[0] + total, self._step_entropy[1] + kept]

    # ---------------------------------------------------------------------------------------------------------
    # What the run shows (`observability.py`): time split, entropy warnings
    # ---------------------------------------------------------------------------------------------------------
    def _timed(self, phase: str):
        """Charge the block to `phase` of the step's time split (training only: evaluation counts as "other")."""
        return self._step_timer.phase(phase) if self.model.training else nullcontext()

    def _generate(self, prompts):
        with self._timed("rollout"):
            return super()._generate(prompts)

    def _prepare_inputs(self, generation_batch):
        with self._timed("other"):  # the rollout's bookkeeping; generation and rewards inside it are timed as such
            return super()._prepare_inputs(generation_batch)

    def _log_step_split(self, split: dict[str, float]) -> None:
        for key, value in split.items():
            self._metrics["train"][key].append(value)

    def _watch_entropy(self) -> None:
        """End of an optimizer step: the step's entropy over kept tokens (all ranks) to the collapse/low-start watch."""
        total, count = self._step_entropy
        self._step_entropy = [0.0, 0.0]
        self._metrics["train"]["entropy/target"].append(self.entropy_controller.target)
        for message in self._entropy_watch.observe(total / count if count > 0 else None, self.entropy_controller.coef):
            if self.accelerator.is_main_process:
                logger.warning(message)

    # ---------------------------------------------------------------------------------------------------------
    # Checkpointing (`checkpoint.py`): TRL saves the controller (entropy_ctrl_state.json); we add our state, then
    # the completeness marker; only then may transformers rotate old checkpoints away.
    # ---------------------------------------------------------------------------------------------------------
    def _or1_state_files(self) -> list[str]:
        return [OR1_STATE_FILE] + ([PROMPTS_STATE_FILE, PROMPT_STATS_STATE_FILE] if self.prompt_stats is not None else [])

    def _or1_state(self) -> dict[str, dict]:
        """`{file name: JSON state}` that a checkpoint holds besides transformers' and TRL's files."""
        states = {OR1_STATE_FILE: {"skipped_steps": self.or1_skipped_steps, "rows_forwarded": self.or1_rows_forwarded}}
        if self.prompt_stats is not None:
            states[PROMPTS_STATE_FILE] = {
                "pool": self.prompt_pool.state_dict(),
                "sampler": dict(self._sampler_position),
                "stats_log_size": self._stats_log.size,
            }
            states[PROMPT_STATS_STATE_FILE] = self.prompt_stats.state_dict()
        return states

    def _load_or1_state(self, folder: str) -> None:
        """Restore our state from a complete checkpoint, before `Trainer.train` builds the data loader."""
        counters = checkpoint.read_state(folder, OR1_STATE_FILE)
        self.or1_skipped_steps, self.or1_rows_forwarded = counters["skipped_steps"], counters["rows_forwarded"]
        if self.prompt_stats is not None:
            prompts = checkpoint.read_state(folder, PROMPTS_STATE_FILE)
            self.prompt_pool.load_state_dict(prompts["pool"])
            self._sampler_position = dict(prompts["sampler"])
            self.prompt_stats.load_state_dict(checkpoint.read_state(folder, PROMPT_STATS_STATE_FILE))
            if self.accelerator.is_main_process:  # drop what was logged after the checkpoint
                self._stats_log.truncate(prompts["stats_log_size"])

    def _checkpoint_files(self) -> list[str]:
        """Every file a checkpoint of this trainer must hold to be resumed from."""
        files = [hf_trainer.TRAINER_STATE_NAME, *self._or1_state_files()]
        if self.use_adaptive_entropy:
            files.append(TRL_ENTROPY_STATE_FILE)
        return files

    def _save_checkpoint(self, model, trial):
        save_total_limit = self.args.save_total_limit
        self.args.save_total_limit = None  # hold back transformers' rotation until this checkpoint is complete
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
        hf_trainer.rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, resuming only from complete checkpoints, and running every stage of `OR1Config.stages`.

        `resume_from_checkpoint=True` (or `"true"`) takes the newest checkpoint of `output_dir` that verifies against
        its marker (`checkpoint.py`), saying which newer ones it skipped and why; an explicit folder that is missing
        or incomplete is an error naming why. An `output_dir` holding a previous run is refused unless
        `resume_from_checkpoint` or `overwrite_output_dir=True` (start over: its checkpoints and
        `prompt_stats.jsonl` are removed) says what to do with it.

        Stages: each stage is one pass of transformers' training loop, from the previous stage's last step to its own
        `until_step`, with the stage's generation length, group size, batch shape, temperature and learning rate. A
        stage ends with a checkpoint and the next one resumes from it — the same path as resuming after a crash — so
        the global step, optimizer, scheduler, RNG, entropy controller, prompt pool and statistics carry over. At
        each stage start the online filter shrinks the pool (paper §3.1).
        """
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
            self._enter_stage(stage_index(self._stages, step))
            final = self._stage.until_step >= self.args.max_steps
            self._rng_to_restore = folder
            train_end = self.callback_handler.on_train_end
            if not final:  # trackers and the like stay open across stages; only the progress bar closes
                self.callback_handler.on_train_end = self._close_progress_bars
            try:
                output = super().train(resume_from_checkpoint=folder, trial=trial, **kwargs)
            finally:
                self.callback_handler.on_train_end = train_end
            if final or self.state.global_step < self._stage.until_step:  # done, or stopped early by a callback
                return output
            self.accelerator.wait_for_everyone()
            folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._rng_to_restore is not None:
            # transformers restores the checkpoint's RNG before creating the data loader iterator, which draws a seed
            # from it, unless it skips batches (our sampler restores its own position). Restore it after the first
            # fetch, as transformers does on its skipping path, so a resumed run samples what the uninterrupted did.
            self._load_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        return batches

    def _close_progress_bars(self, args, state, control):
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback):
                callback.on_train_end(args, state, control)
        return control

    # ---------------------------------------------------------------------------------------------------------
    # Model card (`model_card.py`): TRL writes it; we add the OR1 section (recipe, settings, metrics, eval results)
    # ---------------------------------------------------------------------------------------------------------
    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        self._card_dataset_name = dataset_name or getattr(self, "_card_dataset_name", None)
        section = model_card.or1_section(
            self.args,
            self.state,
            base_model=get_config_model_id(self.accelerator.unwrap_model(self.model).config) or None,
            dataset_name=self._card_dataset_name,
            num_prompts=len(self.train_dataset) if isinstance(self.train_dataset, Dataset) else None,
            eval_summary=read_eval_summary(os.path.join(self.args.output_dir, model_card.EVAL_SUBDIR)),
            stage_shapes=self._stage_shapes,
        )
        path = os.path.join(self.args.output_dir, "README.md")
        with open(path, encoding="utf-8") as f:
            card = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(model_card.insert_section(card, section))

    # ---------------------------------------------------------------------------------------------------------
    # Stages (§3.2.2, `stages.py`) and the prompt pool (§3.1, `prompts.py`)
    # ---------------------------------------------------------------------------------------------------------
    @staticmethod
    def _apply_stage_to_args(args, shape: StageShape) -> None:
        args.max_completion_length = shape.max_completion_length
        args.num_generations = shape.num_generations
        args.gradient_accumulation_steps = shape.gradient_accumulation_steps
        args.steps_per_generation = shape.steps_per_generation
        args.generation_batch_size = shape.generation_batch_size
        args.temperature = shape.temperature
        args.learning_rate = shape.learning_rate

    def _check_prompt_lengths(self) -> None:
        """Prompts that do not fit the context (`data.check_prompt_lengths`), measured with TRL's own tokenisation:
        an error, or with `max_prompt_length` one warning counting the prompts `_tokenize_prompts` will cut. With a
        plain `GRPOConfig` (no truncation to offer) over-long prompts are a warning."""
        limit = getattr(self.args, "max_prompt_length", None)
        if self._is_vlm:
            if limit is not None:
                raise ValueError("max_prompt_length cuts token ids, which would cut image tokens too: it supports "
                                 "text-only models; unset it.")
            return  # measuring would process every image of the dataset
        if self.rollout_func is not None or self.environment_factories is not None:
            return  # prompts are tokenised elsewhere (or per environment)
        config = self.accelerator.unwrap_model(self.model).config
        context = getattr(config.get_text_config(), "max_position_embeddings", None)
        source = "the model's max_position_embeddings"
        if self.use_vllm and self.args.vllm_max_model_length:
            context, source = self.args.vllm_max_model_length, "vllm_max_model_length"
        completion = max([self.args.max_completion_length] + [s.max_completion_length for s in self._stage_shapes])
        datasets = {"train_dataset": self.train_dataset}
        evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {None: self.eval_dataset}
        datasets.update({"eval_dataset" if k is None else f"eval_dataset[{k!r}]": v for k, v in evals.items()})
        for name, dataset in datasets.items():
            if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
                continue
            lengths = prompt_lengths(dataset["prompt"], lambda batch: super(OR1Trainer, self)._tokenize_prompts(batch)[0])
            try:
                message = check_prompt_lengths(lengths, context, completion, limit, name, source)
            except ValueError as exc:
                if isinstance(self.args, OR1Config):
                    raise
                message = str(exc)
            if message and self.accelerator.is_main_process:
                logger.warning(message)

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = getattr(self.args, "max_prompt_length", None)
        if limit is not None:  # keep the last `max_prompt_length` tokens (left truncation, as TRL's SDPO trainer)
            prompt_ids = [ids[-limit:] for ids in prompt_ids]
        return prompt_ids, images, multimodal_fields

    def _check_stage_lengths_fit_vllm(self) -> None:
        limit = self.args.vllm_max_model_length if self.use_vllm else None
        if self.use_vllm and self.vllm_mode == "server" and self.accelerator.is_main_process:
            limit = self.vllm_generation.vllm_client.get_server_info()["model_config"].get("max_model_len", limit)
        for shape in self._stage_shapes:
            if limit is not None and shape.max_completion_length >= limit:
                raise ValueError(
                    f"stages[{shape.index}].max_completion_length={shape.max_completion_length} does not fit the vLLM "
                    f"max model length {limit} (prompt + completion). Start vLLM with a larger --max-model-len."
                )

    def _enter_stage(self, index: int) -> None:
        """Make stage `index` current: online filter if the pool was built for an earlier stage, then TRL's settings."""
        shape = self._stage_shapes[index]
        pool = self.prompt_pool
        if pool.stage < index:
            for new_stage in range(pool.stage + 1, index + 1):
                removed = pool.apply_online_filter(
                    self.prompt_stats, new_stage, self.args.online_filter_threshold, self.args.online_filter_unsolved_after
                )
                if self.accelerator.is_main_process:
                    logger.warning(
                        f"Stage {new_stage} starts at step {shape.start_step}: the online filter removed "
                        f"{removed['solved']} solved and {removed['unsolved']} never-solved prompts; pool: {len(pool)} rows."
                    )
            self._sampler_position = {"stage": index, "consumed": 0, "refill": 0}
            if len(pool) < shape.batch_size:
                raise ValueError(
                    f"Stage {index}: the online filter left {len(pool)} prompts in the pool, fewer than one batch of "
                    f"{shape.batch_size} — {removed['solved']} left for accuracy >= online_filter_threshold="
                    f"{self.args.online_filter_threshold} in stage {index - 1}, {removed['unsolved']} for "
                    f"online_filter_unsolved_after={self.args.online_filter_unsolved_after}. Raise the threshold (or "
                    "set it to None), unset online_filter_unsolved_after, add prompts, or lower the stage's batch_size."
                )
        self._stage = shape
        args = self.args
        self._apply_stage_to_args(args, shape)
        self.max_completion_length, self.num_generations = shape.max_completion_length, shape.num_generations
        if shape.temperature != self.temperature:  # log-probs are taken at the sampling temperature: re-patch the head
            self.temperature = shape.temperature
            model = self.accelerator.unwrap_model(self.model)
            add_fused_lm_head(
                model.get_base_model() if hasattr(model, "get_base_model") else model,
                temperature=shape.temperature,
                cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
                outputs=("log_probs", "entropy"),
            )
        if self.use_vllm:
            self.vllm_generation.max_completion_length = shape.max_completion_length
            self.vllm_generation.temperature = shape.temperature
        else:
            self.generation_kwargs.update(max_new_tokens=shape.max_completion_length, temperature=shape.temperature)
            self.generation_config.max_new_tokens = shape.max_completion_length
            self.generation_config.temperature = shape.temperature
        self._step, self._buffered_inputs = 0, None  # TRL's generation counter restarts with the new shape

    def _get_train_sampler(self, dataset=None):
        if not self._stages:
            return super()._get_train_sampler(dataset)
        shape = self._stage  # `_enter_stage` set the sampler's position for it (restored, or 0 at a stage start)
        self._sampler = PromptSampler(
            self.prompt_pool.active,
            batch_size=shape.batch_size,
            num_generations=shape.num_generations,
            repeat_count=self.num_iterations * shape.steps_per_generation,
            seed=self.args.seed,
            stage=shape.index,
            consumed=self._sampler_position["consumed"],
        )
        return self._sampler

    def _load_optimizer_and_scheduler(self, checkpoint_folder):
        super()._load_optimizer_and_scheduler(checkpoint_folder)  # TRL restores the controller
        if self._stage is not None and checkpoint_folder is not None:
            set_base_learning_rate(self.optimizer, self.lr_scheduler, self._stage.learning_rate)
