"""`OR1Config`: TRL's `GRPOConfig` with the Skywork-OR1 (MAGIC) recipe as defaults."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import warnings
from dataclasses import dataclass, field

import torch
from transformers.utils import logging
from trl import GRPOConfig

from ..recipe.advantages import TRUNCATED_ADVANTAGE_MASKS
from ..recipe.entropy import ENTROPY_PRESETS
from .logprobs import LOGPROB_BACKENDS, liger_available
from ..recipe.loss import TOKEN_SUM_LOSSES
from .packing import attention_problem
from .sharding import SHARDING_FALLBACKS
from ..paths import output_dir_problem
from ..recipe.ranges import check_ranges
from ..recipe.rollout_correction import DEFAULT_CAP, DEFAULT_ROLLOUT_CORRECTION, ROLLOUT_CORRECTIONS
from ..generation.serve import SYNC_DTYPES, SYNC_PEFT_MODES, WEIGHT_SYNC_BACKENDS, default_weight_sync
from ..recipe.stages import Stage, parse_stages, validate_stages

logger = logging.get_logger(__name__)

REJECTION_MODES = ("compact", "mask", "off")
ENTROPY_ESTIMATORS = ("full", "sampled")
TOP_ENTROPY_NORMALIZATIONS = ("all", "selected")
VLLM_WEIGHT_SYNC = WEIGHT_SYNC_BACKENDS
NONFINITE_REWARD_MODES = ("error", "zero")
#: The values each OR1 field with a fixed set of them accepts, checked once by `check_choices` (first thing in
#: `__post_init__`, with the ranges). The fields made with `choice_field` give the same tuples to the command line's
#: parser (`tests/trainer/test_or1_config.py` checks that they agree).
FIELD_CHOICES = {
    "rejection_sampling": REJECTION_MODES,
    "entropy_preset": tuple(sorted(ENTROPY_PRESETS)),
    "entropy_estimator": ENTROPY_ESTIMATORS,
    "top_entropy_normalization": TOP_ENTROPY_NORMALIZATIONS,
    "truncated_advantage_mask": TRUNCATED_ADVANTAGE_MASKS,
    "rollout_correction": ROLLOUT_CORRECTIONS,
    "vllm_weight_sync": VLLM_WEIGHT_SYNC,
    "vllm_sync_dtype": SYNC_DTYPES,
    "vllm_sync_peft": SYNC_PEFT_MODES,
    "logprob_backend": LOGPROB_BACKENDS,
    "nonfinite_rewards": NONFINITE_REWARD_MODES,
    "sharding_fallback": SHARDING_FALLBACKS,
}
#: What `to_dict`, `str` and `or1-trl train`'s `sys.argv` show in place of `vllm_server_api_key`.
API_KEY_PLACEHOLDER = "<VLLM_SERVER_API_KEY>"
#: Every OR1 field (every `OR1Config` field `GRPOConfig` lacks) and the value that reproduces TRL's `GRPOTrainer`:
#: what `OR1Config.from_grpo` gives a plain `GRPOConfig`, so that `OR1Trainer` reads one object. With these,
#: `OR1Trainer` trains, generates and logs as `GRPOTrainer` (TRL's loss and entropy control, TRL's vLLM backend),
#: and keeps OR1's checks of the inputs (a non-finite reward is an error, an `output_dir` holding a previous run is
#: refused, a launch that got another sharding backend than it asked for warns).
TRL_BEHAVIOUR = {
    "recipe": "trl",  # TRL's objective; no prompt pool; over-long prompts warned about; no OR1 defaults announced
    # Rejection sampling (§3.1), the adaptive entropy (eq. 3.2; TRL's own fields hold its settings), the loss
    "rejection_sampling": "off",
    "rejection_refill_rounds": 0,
    "entropy_preset": "paper",  # TRL's entropy defaults are the paper's preset
    "entropy_estimator": "full",
    "entropy_collapse_fraction": 0.5,
    "entropy_collapse_steps": 10,
    "top_entropy_normalization": "all",
    "truncated_advantage_mask": "none",
    # Stages and the prompt pool (§3.2.2, §3.1)
    "stages": None,
    "prompt_id_column": "id",
    "online_filter_threshold": 1.0,
    "online_filter_unsolved_after": None,
    # The rollout correction, asynchronous generation and the vLLM server's weight sync
    "rollout_correction": "trl",
    "rollout_correction_cap": DEFAULT_CAP,
    "async_generation": False,
    "max_staleness": 1,
    "rollout_seed": None,
    "stop_pattern": None,
    "vllm_weight_sync": None,  # TRL's `VLLMGeneration` (an `OR1Config` resolves None in `__post_init__`)
    "vllm_sync_dtype": "server",
    "vllm_sync_dir": None,
    "vllm_sync_peft": "auto",
    "vllm_server_api_key": None,
    # Performance
    "logprob_backend": "trl",
    "padding_free": False,
    "max_tokens_per_microbatch": None,
    "sharding_fallback": "allow",
    # The output directory and the checks on prompts and rewards
    "max_prompt_length": None,
    "nonfinite_rewards": "error",
    "skipped_steps_warning": 5,
    "overwrite_output_dir": False,
    # Non-finite values
    "cudnn_sdpa_guard": False,  # TRL leaves PyTorch's cuDNN attention on, on Hopper too
    "nonfinite_stop_after": None,  # TRL applies an update whatever its gradients hold
}
#: Fields of `TRL_BEHAVIOUR` not announced as changed defaults (`OR1Config.changed_defaults`): `sharding_fallback`
#: only says what a launch is refused or warned about; the attention guard says so itself, once, where it acts; the
#: non-finite sentinel changes nothing while the gradients are finite, and says so itself when it acts.
_NOT_ANNOUNCED = ("sharding_fallback", "cudnn_sdpa_guard", "nonfinite_stop_after")
# TRL's `vllm_importance_sampling_*` defaults (GRPOConfig), to tell whether a user changed them.
_TRL_IS_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                  "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")


def check_liger_layer_kernels(args) -> None:
    """`use_liger_kernel=True` patches Liger's Triton layer kernels (RMSNorm, SwiGLU, RoPE) into the model: CUDA only.
    Refuse it before training elsewhere (Triton would fail at the first forward, after generation)."""
    if getattr(args, "use_liger_kernel", False) and (args.use_cpu or not torch.cuda.is_available()):
        raise ValueError(
            "use_liger_kernel=True runs Liger's layer kernels (RMSNorm, SwiGLU, RoPE), which are Triton kernels for "
            f"CUDA GPUs only; this run is on the CPU (use_cpu={args.use_cpu}, "
            f"CUDA available: {torch.cuda.is_available()}). "
            "Set use_liger_kernel=False. The memory-saving part of Liger, its fused log-prob/entropy head, runs on "
            "CPU too: logprob_backend='liger' (or 'auto')."
        )


def choice_field(default, choices, help: str):
    """A config field limited to `choices`: TRL's `field(metadata={"help", "choices"})`, which `HfArgumentParser`
    turns into an argparse option with those choices."""
    return field(default=default, metadata={"help": help, "choices": list(choices)})


def _field_default(dataclass_type, name: str):
    f = {f.name: f for f in dataclasses.fields(dataclass_type)}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_choices(config) -> None:
    """A `ValueError` for the first field of `FIELD_CHOICES` whose value is not one of its choices. `None` passes
    where it is the field's default (unset: `vllm_weight_sync` is chosen in `__post_init__`)."""
    for name, allowed in FIELD_CHOICES.items():
        value = getattr(config, name)
        if value is None and _field_default(type(config), name) is None:
            continue
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {list(allowed)}.")


@dataclass
class OR1Config(GRPOConfig):
    r"""
    Configuration for [`OR1Trainer`]: every [`~trl.GRPOConfig`] field, with the MAGIC recipe as defaults
    (Skywork-OR1 §3.1, "Common" settings of Tables 10–12), plus the fields below.

    Defaults that realise the paper (inherited from TRL where TRL already has them):
    `loss_type="dapo"` (token-level mean over every token of the batch), `beta=0.0` (no KL), `epsilon=0.2`,
    `temperature=1.0`, `learning_rate=1e-6` with `lr_scheduler_type="constant"`, `num_iterations=1` and
    `steps_per_generation=gradient_accumulation_steps` (on-policy: one SGD step per rollout batch),
    `use_adaptive_entropy=True` with the `"paper"` preset (tgt 0.2, Δ 0.005, c₀ = `entropy_coef` = 0),
    `mask_truncated_completions=False` (truncated responses keep reward 0, paper §3.2.3),
    `rejection_sampling="compact"`.

    Parameters:
        > Parameters that control rejection sampling (§3.1)

        rejection_sampling (`str`, *optional*, defaults to `"compact"`):
            How groups whose rewards are all equal (zero advantage) leave the update: `"compact"` removes their rows
            before the policy forward/backward (every rank still runs the same number of backward calls);
            `"mask"` keeps the rows with weight 0 (Skywork's released code; same gradient, more compute);
            `"off"` keeps them (TRL's behaviour).
        rejection_refill_rounds (`int`, *optional*, defaults to `0`):
            When rejection leaves fewer informative groups than a rollout batch asks for, generate up to this many
            more rounds from the pool and keep informative groups until the batch is full (DAPO's dynamic
            sampling; not in Skywork's code). 0: off.

        > Parameters that control the adaptive entropy (eq. 3.2)

        use_adaptive_entropy (`bool`, *optional*, defaults to `True`):
            TRL's adaptive entropy control, on (TRL's default: off): eq. 3.2 raises the coefficient c while the
            entropy is below `entropy_target` and lowers it above.
        entropy_target (`float` or `None`, *optional*, defaults to `None`):
            tgt, in nats, over all kept response tokens. `None`: from `entropy_preset`.
        entropy_coef_delta (`float` or `None`, *optional*, defaults to `None`):
            Δ, the step of c. `None`: from `entropy_preset`.
        entropy_coef_min (`float` or `None`, *optional*, defaults to `None`):
            c_min. `None`: from `entropy_preset`.
        entropy_coef_max (`float` or `None`, *optional*, defaults to `None`):
            c_max. `None`: from `entropy_preset`.
        entropy_preset (`str`, *optional*, defaults to `"paper"`):
            Fills `entropy_target`, `entropy_coef_delta`, `entropy_coef_min` and `entropy_coef_max` where they are
            left unset: `"paper"` (tgt 0.2, Δ 0.005, c ∈ [0, 1]; equal to TRL's defaults) or `"released"` (the
            released scripts: tgt 0.2, Δ 1e-4, c ∈ [0, 0.005]).
        entropy_estimator (`str`, *optional*, defaults to `"full"`):
            Estimator of the entropy e_k the controller measures over all kept response tokens: `"full"` (mean
            full-vocabulary entropy, the quantity the loss term differentiates) or `"sampled"` (−mean log-prob of
            the sampled tokens, as the released code).
        entropy_collapse_fraction (`float`, *optional*, defaults to `0.5`):
            The entropy-collapse warning (`or1_trl/trainer/observability.py`) fires once when the entropy stays below
            this fraction of `entropy_target` for `entropy_collapse_steps` steps while the controller is saturated (c =
            c_max) or off.
        entropy_collapse_steps (`int`, *optional*, defaults to `10`):
            Consecutive steps for the entropy-collapse warning; 0 disables it.

        > Parameters that control the policy loss: the 80/20 rule and truncated responses (§3.2.3)

        top_entropy_normalization (`str`, *optional*, defaults to `"all"`):
            With `top_entropy_quantile < 1` (the 80/20 rule), what the policy term is divided by: `"all"` (every kept
            token, T_k — TRL) or `"selected"` (only the selected high-entropy tokens of the micro-batch — the official
            80/20 code, ≈1/ρ larger gradient). The entropy term and the controller always use all kept tokens.
        truncated_advantage_mask (`str`, *optional*, defaults to `"none"`):
            The advantage masks for truncated responses of the paper's ablation (§3.2.3,
            `or1_trl/recipe/advantages.py`): `"none"` (the paper's choice: truncated responses keep their reward and
            advantage), `"after"` (they stay in the group's mean and std, then get advantage 0) or `"before"` (they
            leave the group's statistics too and get advantage 0; rejection sampling then judges a group on its
            non-truncated rewards). Their tokens stay in T_k and the entropy term; TRL's `mask_truncated_completions`
            instead removes them from the loss altogether, group statistics untouched.

        > Parameters that control multi-stage training and the prompt pool (§3.2.2, §3.1)

        stages (`list[dict]` or `None`, *optional*, defaults to `None`):
            Multi-stage training (paper §3.2.2, `or1_trl/recipe/stages.py`): a list of `{until_step,
            max_completion_length, batch_size, mini_batch_size, num_generations, temperature, learning_rate}` (all but
            `until_step` optional; batch sizes are prompts over all ranks). Transitions happen at optimizer-step
            boundaries within one `train()`; optimizer, scheduler, controller, prompt pool and statistics carry over.
            `None`: one stage.
        prompt_id_column (`str`, *optional*, defaults to `"id"`):
            Dataset column with a unique id per prompt; without it, ids are a hash of the prompt's content.
        online_filter_threshold (`float` or `None`, *optional*, defaults to `1.0`):
            At each stage start, prompts whose accuracy over the previous stage was ≥ this leave the pool (paper
            §3.1; 1.0: solved in every sample). `None` keeps them.
        online_filter_unsolved_after (`int` or `None`, *optional*, defaults to `None`):
            If set, at each stage start prompts never solved in at least this many samples (all stages) leave too.

        > Parameters that control the rollout correction and asynchronous generation

        rollout_correction (`str`, *optional*, defaults to `"geo_mask_token_truncate"`):
            How a completion generated by vLLM is weighted for the mismatch between the generator's log-probs and the
            trainer's (`or1_trl/recipe/rollout_correction.py`; ratio r_t = π_trainer / π_vllm per token, c =
            `rollout_correction_cap`): `"off"` (no correction toward the generator, the paper: TRL's correction off),
            `"token_truncate"` (weight min(r_t, c)), `"geo_mask_token_truncate"` (a sequence is kept iff the geometric
            mean of its ratios lies in [1/c, c], independent of its length, then min(r_t, c)), or `"trl"` (TRL's
            `vllm_importance_sampling_*` fields exactly as set; its default masks sequences by exp(Σ_t log r_t),
            which grows with the length). Our two modes set TRL's fields so that TRL computes the trainer's log-probs
            of the rollout (`vllm_importance_sampling_correction=True`, `"token_truncate"`, clip_max c); `"off"` turns
            TRL's correction off. The default is chosen by `benchmarks/rollout_correction.py` (docs/benchmarks.md).
        rollout_correction_cap (`float`, *optional*, defaults to `2.0`):
            c > 1: the per-token truncation cap and the geometric mask's bound [1/c, c].
        async_generation (`bool`, *optional*, defaults to `False`):
            One-step-off rollouts (`or1_trl/generation/overlap.py`, `docs/async_generation.md`): while update k runs,
            the vLLM server generates the rollout of step k+1 from the weights update k−1 left, requested over HTTP
            from a background thread; the weights are pushed between updates. Needs `use_vllm=True, vllm_mode="server"`
            and a `rollout_correction` that weights by the generator's log-probs (not `"off"`): they are the behaviour
            policy of the stale rollout; one rollout per update (`num_iterations=1`, `steps_per_generation` =
            `gradient_accumulation_steps`); single-turn generation (no tools, environments or `rollout_func`). The
            first step, a stage's first and the first after a resume generate synchronously. Not the paper's recipe,
            which is on-policy (a warning says so).
        max_staleness (`int`, *optional*, defaults to `1`):
            With `async_generation`: the most updates between the weights that generated a rollout and the update
            that trains on it (logged as `async/staleness`); a staler rollout is an error. At least 1.
        rollout_seed (`int` or `None`, *optional*, defaults to `None`):
            Paired rollouts (`or1_trl/generation/seeded.py`, `docs/reproducible_runs.md`): every sample's randomness
            is a function of this seed, the global step, the prompt and the sample's index, not of the batch it
            travels in, the rank, the server's other requests or its restarts. Two runs of one config with one seed
            draw the same completions; two configs with one seed share their random numbers (common random numbers),
            which makes a comparison of them far less noisy. On the vLLM server (`vllm_mode="server"`: one seeded
            request per prompt) and on TRL's HF `generate` path (Gumbel-max with counter-based noise); not with
            in-process vLLM (`vllm_mode="colocate"`) or continuous batching. `None`: TRL's sampling.
        stop_pattern (`str` or `None`, *optional*, defaults to `None`):
            A regular expression that ends a completion (`or1_trl/generation/stop.py`): each completion is cut after
            the token that completes the first match in its decoded text, on every generation path (vLLM server,
            one-step-off, HF `generate`); the tokens after it leave the rollout (reward, loss, T_k, the 80/20 mask).
            E.g. `r"Answer:[^\n]*\n"` ends a completion with its answer line (`data.word_problems.ANSWER_LINE`).
            Logged: `completions/stopped_ratio`. A stopped completion is not truncated for
            `truncated_advantage_mask` and `accuracy/non_truncated`; TRL's `completions/clipped_ratio` counts it as
            clipped (its last token is no EOS, as with vLLM's stop strings). `None`: completions end as generated.

        > Parameters that control the vLLM server's weight sync (only used when `use_vllm=True, vllm_mode="server"`)

        vllm_weight_sync (`str` or `None`, *optional*, defaults to `None`):
            With `use_vllm=True, vllm_mode="server"`: how the policy's weights reach the server before each
            generation. `"nccl"`: TRL's NCCL weight transfer (CUDA trainer and CUDA vLLM, reachable over NCCL).
            `"disk"`: the main process writes safetensors to `vllm_sync_dir`, the server reloads them
            (`or1-trl serve --weight-sync disk`); works on any device and network. `None`: `"nccl"` on CUDA without
            `use_cpu`, `"disk"` otherwise (`serve.default_weight_sync`, the rule `or1-trl serve` uses too).
        vllm_sync_dtype (`str`, *optional*, defaults to `"server"`):
            What `vllm_weight_sync="disk"` writes the weights in: `"server"` (the dtype the server computes in, read
            from it: what vLLM's loader would cast them to anyway, so the server's weights are the same and a bf16
            server gets half the bytes of an fp32 trainer), `"model"` (as the policy holds them), or `"float32"`,
            `"bfloat16"`, `"float16"`.
        vllm_sync_dir (`str` or `None`, *optional*, defaults to `None`):
            Directory both the trainer and the server can read, for `vllm_weight_sync="disk"` (a shared filesystem
            when they run on different nodes). It holds one copy of the weights, replaced at each sync. `None`
            (stays `None` here; the trainer picks, and logs, the directory when it connects): on tmpfs, a new
            `/dev/shm/or1-trl-vllm-sync-<random>` only this user can enter (mode 0700, files 0600; memory speed;
            removed when training ends), when `/dev/shm` has room for two copies and the server reads it (same
            machine, same user); else `<output_dir>/_vllm_sync` (transformers' `push_to_hub` skips `_*`), with a
            warning if making the private directory failed. The server loads only from under its sync roots
            (`or1-trl serve --sync-root DIR ...`, default `/dev/shm`): a directory elsewhere (the fallback, shared
            storage) needs it there, else the trainer stops at start with one line saying so.
        vllm_sync_peft (`str`, *optional*, defaults to `"auto"`):
            With a PEFT (LoRA) policy and `vllm_weight_sync="disk"`: `"adapter"` pushes only the adapter each step,
            which the server loads as a LoRA adapter under a new name (`or1-trl serve --enable-lora`; the base
            weights are pushed once, first), `"merged"` pushes base + BA merged (TRL's iterator), `"auto"`:
            `"adapter"` where the server takes LoRA adapters and the adapter suits vLLM (LoRA, r ≤ the server's
            `--max-lora-rank`, no DoRA/`modules_to_save`/bias; no DeepSpeed/FSDP), `"merged"` otherwise.
        vllm_server_api_key (`str` or `None`, *optional*, defaults to `None`):
            Key of a vLLM server started with one (`or1-trl serve`, `$OR1_VLLM_API_KEY`), sent as `Authorization:
            Bearer` with every request to it, with either weight sync. `None`: `$OR1_VLLM_API_KEY`, else
            `$VLLM_API_KEY`, else, for a server on this machine, the key `or1-trl serve` made for its port (a file
            only this user can read), else no key. Never written by the trainer: a pickled config
            (`training_args.bin`) holds `None` in its place, and `str`, `repr`, `to_dict` (W&B, TensorBoard, model
            cards) show a placeholder; `or1-trl train --vllm_server_api_key K` removes K from `sys.argv` (which W&B
            records) once parsed. So a resume needs it again (the flag or the variable). Prefer the variable: a
            command line is visible in `ps`.

        > Parameters that control performance: the log-prob backend and padding-free packing

        logprob_backend (`str`, *optional*, defaults to `"auto"`):
            What computes the per-token log-probs and entropies of every pass (policy, old policy, reference), without
            `[B, T, V]` logits (`or1_trl/trainer/logprobs.py`): `"trl"` (TRL's fused LM head), `"liger"`
            (Liger-Kernel's fused linear scaled cross-entropy inside TRL's head; an error where Liger cannot run the
            model) or `"auto"` (`"liger"` on CPU, where `benchmarks/memory.py` measured it lowest; `"trl"` on GPUs, not
            measured, and wherever Liger cannot run). Same loss, gradient and metrics within float tolerance.
        padding_free (`bool`, *optional*, defaults to `False`):
            Forward the log-prob passes (policy, old policy, reference) without padding (`or1_trl/trainer/packing.py`):
            the rows' real tokens end to end in packed rows, `position_ids` restarting per sequence (transformers'
            block-diagonal mask); the per-token results go back to TRL's padded layout, so the loss and metrics are
            unchanged. Text-only, attention `"sdpa"`, `"eager"` or flash-attention; one process, DDP, DeepSpeed ZeRO or
            FSDP2 (under ZeRO-3 and FSDP every rank runs as many forwards; under ZeRO-3 they are not checkpointed).
        max_tokens_per_microbatch (`int` or `None`, *optional*, defaults to `None`):
            With `padding_free`: at most this many token slots per forward (a sequence longer gets a forward of its
            own); every forward but the last is activation-checkpointed, so the policy pass's activation memory is set
            by this budget, not by the micro-batch's rows × length (one more forward of those tokens). `None`: one
            forward per micro-batch. A stage may set its own (`stages[i].max_tokens_per_microbatch`).
        sharding_fallback (`str`, *optional*, defaults to `"error"`):
            When the launch asked for DeepSpeed or FSDP (accelerate's config, or `deepspeed` / `fsdp`) and the trainer
            got something else — accelerate runs `fsdp2.yaml` as DDP on CPUs — one line says what was asked, what was
            obtained and why: `"error"` stops there, before training; `"allow"` warns and trains with what was
            obtained (`or1_trl/trainer/sharding.py`).

        > Parameters that keep non-finite values out of the weights

        cudnn_sdpa_guard (`bool`, *optional*, defaults to `True`):
            Turn PyTorch's cuDNN scaled-dot-product-attention backend off where its backward returns NaN
            (pytorch/pytorch#196678; `or1_trl/trainer/attention_guard.py`): on a CUDA device of compute capability
            9.x (H100, H200), with the model's attention `"sdpa"` and torch 2.11 or later, cuDNN's backward puts NaN
            in the query gradient when a padding mask is passed and the sequence length is 64 more than a multiple
            of 128; the NaN reaches the weights, and a later sampling step dies in a device-side assert. Measured on
            one H200 (`scripts/gpu_sdpa_guard.sh`, `docs/distributing_training.md`): NaN at 704, 832, 960 and 1088,
            none at 640 and 768; with the guard SDPA runs its memory-efficient kernel, with no NaN at any of them,
            and SmolLM2-135M's forward+backward of 32 rows of 704 tokens took 1.126× as long as with cuDNN (the
            update only, not the whole RL step, which generation dominates). The switch is process-wide and not
            undone; one warning says when it acts. `False` keeps cuDNN (TRL's behaviour).
        nonfinite_stop_after (`int` or `None`, *optional*, defaults to `3`):
            The non-finite sentinel (`or1_trl/trainer/nonfinite.py`): every step checks the loss and each
            parameter's gradient for NaN/inf on every rank (logged as `nonfinite_steps`,
            `nonfinite_grads`, `nonfinite_losses`); a step whose gradients hold any is not applied on any
            rank (no optimizer step, the schedule unmoved, as a fully rejected step), and after this many such steps
            in a row the run stops with a complete checkpoint of its last finite weights and one line naming the
            step and the parameters. `None`: no sentinel, every update applied (TRL's behaviour).

        > Parameters that control the output directory, resuming, and the checks on prompts and rewards

        output_dir (`str`, *optional*, defaults to `"trainer_output"`):
            Where the checkpoints (`checkpoint-N`), the per-prompt statistics (`prompt_stats.jsonl`) and the final
            model go; it must exist or be creatable, and be writable (checked before anything loads).
        resume_from_checkpoint (`str` or `None`, *optional*, defaults to `None`):
            `or1-trl train --resume_from_checkpoint true` continues the run in `output_dir` from its newest complete
            checkpoint (a folder: from that one, which must be complete; `or1_trl/trainer/checkpoint.py`).
        max_prompt_length (`int` or `None`, *optional*, defaults to `None`):
            TRL 1.16 generates from whole prompts. `None`: a prompt longer than the context leaves after
            `max_completion_length` (the model's `max_position_embeddings`, or `vllm_max_model_length`) is an error
            when the trainer is built. An int: prompts longer than it are cut to their last `max_prompt_length`
            tokens at generation (left truncation, as TRL's SDPO trainer), with one warning counting them.
        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            A reward function returning `inf`, `-inf` or NaN (`None`, TRL's "not scored", is fine): `"error"` stops
            the run naming the function and the sample; `"zero"` scores it 0, counts it in `reward/nonfinite` and
            warns once.
        skipped_steps_warning (`int`, *optional*, defaults to `5`):
            Warn once when this many consecutive optimizer steps were skipped (no trainable token: every group
            rejected, or every completion masked), saying why and what to check; 0 disables it.
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            Start over in an `output_dir` that holds a previous run (its `checkpoint-N` folders or
            `prompt_stats.jsonl`): they are removed when training starts. Without it (or `resume_from_checkpoint`,
            which continues the run) such an `output_dir` is refused, so nothing of a previous run is lost silently.
            (transformers 5 dropped `TrainingArguments.overwrite_output_dir`; this is OR1's,
            `or1_trl/trainer/checkpoint.py`.)

    Every numeric field the trainer reads — these, TRL's and transformers' — must lie in its range
    (`or1_trl/recipe/ranges.py`, `FIELD_RANGES`: e.g. `top_p` in (0, 1], `temperature` > 0, `max_steps` >= 1 or -1,
    `0 < learning_rate <= 10`; no NaN or inf), checked before anything else: a `ValueError` names the field, its value,
    the range and why (one line and exit status 2 on the command line, before the model loads). So must every field
    with a fixed set of values hold one of them (`FIELD_CHOICES`, the one table of them).

    `use_liger_kernel=True` (TRL's field: Liger's Triton layer kernels, as Skywork trained with them) is CUDA-only;
    on CPU it is an error. `bf16` left unset (TRL turns it on) is `False` on a machine without CUDA (one log line says
    so). `output_dir` must be a directory that exists or can be created, and be writable (checked here, before
    anything loads).

    TRL's loss settings compose with every OR1 part: another `loss_type`, `beta > 0` and `sync_ref_model`, GSPO
    (`importance_sampling_level="sequence"`), `off_policy_mask_threshold` — TRL's loss of that type on the kept
    groups, plus α·H normalised like it (`or1_trl/recipe/loss.py`); such a run warns once that it is not the paper's
    objective (`magic_departures`). Refused, as undefined: `top_entropy_normalization="selected"` with a loss type that
    has no token count to replace, or with `beta > 0`.
    """

    # Parameters whose default values are overridden from GRPOConfig (the entropy ones: adaptive entropy control)
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Learning-rate schedule. The paper trains with a constant learning rate of 1e-6."},
    )
    use_adaptive_entropy: bool = field(
        default=True,
        metadata={"help": "Adaptive entropy control of Skywork-OR1 eq. 3.2 (on by default in the MAGIC recipe)."},
    )
    entropy_target: float | None = field(
        default=None,
        metadata={"help": "Target entropy tgt (nats) over all kept response tokens. Unset: from `entropy_preset`."},
    )
    entropy_coef_delta: float | None = field(
        default=None, metadata={"help": "Step Δ of the entropy coefficient. Unset: from `entropy_preset`."}
    )
    entropy_coef_min: float | None = field(
        default=None, metadata={"help": "Lower clip c_min of the entropy coefficient. Unset: from `entropy_preset`."}
    )
    entropy_coef_max: float | None = field(
        default=None, metadata={"help": "Upper clip c_max of the entropy coefficient. Unset: from `entropy_preset`."}
    )

    # Parameters that control rejection sampling (§3.1)
    rejection_sampling: str = choice_field("compact", REJECTION_MODES, help=(
        "How zero-advantage groups leave the update: 'compact' (removed before forward/backward), "
        "'mask' (kept with weight 0, as Skywork's code), or 'off' (TRL's behaviour)."))
    rejection_refill_rounds: int = field(
        default=0,
        metadata={
            "help": "When rejection leaves fewer informative groups than the batch asks for, generate up to this "
            "many more rounds from the pool to fill it (DAPO dynamic sampling). 0: off."
        },
    )

    # Parameters that control the adaptive entropy (eq. 3.2)
    entropy_preset: str = field(
        default="paper",
        metadata={
            "help": "Entropy-control preset filling unset entropy_* fields: 'paper' (tgt 0.2, Δ 0.005) or "
            "'released' (tgt 0.2, Δ 1e-4, c_max 5e-3).",
        },
    )
    entropy_estimator: str = choice_field("full", ENTROPY_ESTIMATORS, help=(
        "Entropy the controller measures: 'full' (vocabulary entropy) or 'sampled' (−mean log-prob "
        "of the sampled tokens, as the released code)."))
    entropy_collapse_fraction: float = field(
        default=0.5,
        metadata={
            "help": "Warn once (entropy collapse) when the entropy stays below this fraction of entropy_target for "
            "entropy_collapse_steps steps while the controller is saturated (c = c_max) or off."
        },
    )
    entropy_collapse_steps: int = field(
        default=10, metadata={"help": "Consecutive steps for the entropy-collapse warning; 0 disables it."}
    )

    # Parameters that control the policy loss: the 80/20 rule and truncated responses (§3.2.3)
    top_entropy_normalization: str = choice_field("all", TOP_ENTROPY_NORMALIZATIONS, help=(
        "With top_entropy_quantile < 1: divide the policy term by all kept tokens ('all', TRL) or by "
        "the selected high-entropy tokens ('selected', the official 80/20 code)."))
    truncated_advantage_mask: str = choice_field("none", TRUNCATED_ADVANTAGE_MASKS, help=(
        "Advantage mask for truncated responses (paper §3.2.3): 'none' (the paper's choice), 'after' "
        "(they stay in the group mean/std, then get advantage 0) or 'before' (they leave the group mean/std "
        "too and get advantage 0)."))

    # Parameters that control multi-stage training and the prompt pool (§3.2.2, §3.1)
    stages: list[dict] | str | None = field(
        default=None,
        metadata={
            "help": "Training stages (YAML/JSON list of {until_step, max_completion_length, batch_size, "
            "mini_batch_size, num_generations, temperature, learning_rate}); batch sizes are prompts over all ranks."
        },
    )
    prompt_id_column: str = field(
        default="id", metadata={"help": "Dataset column with unique prompt ids (else: a hash of the prompt)."}
    )
    online_filter_threshold: float | None = field(
        default=1.0,
        metadata={
            "help": "At each stage start, drop prompts whose accuracy over the previous stage was >= this "
            "(1.0: solved in every sample). None: keep them."
        },
    )
    online_filter_unsolved_after: int | None = field(
        default=None,
        metadata={"help": "If set, at each stage start also drop prompts never solved in at least this many samples."},
    )

    # Parameters that control the rollout correction and asynchronous generation
    rollout_correction: str = choice_field(DEFAULT_ROLLOUT_CORRECTION, ROLLOUT_CORRECTIONS, help=(
        "Correction for the vLLM/trainer log-prob mismatch: 'off' (none, the paper), 'token_truncate' "
        "(per-token ratio capped at rollout_correction_cap), 'geo_mask_token_truncate' (sequence kept iff the "
        "geometric mean of its ratios is in [1/c, c], length-independent, then per-token truncation), or 'trl' "
        "(TRL's vllm_importance_sampling_* as set)."))
    rollout_correction_cap: float = field(
        default=DEFAULT_CAP,
        metadata={"help": "c > 1: per-token truncation cap and geometric-mask bound [1/c, c] of rollout_correction."},
    )
    async_generation: bool = field(
        default=False,
        metadata={"help": "One-step-off rollouts: the vLLM server generates step k+1's rollout (weights of update "
                  "k-1) while update k runs. Needs use_vllm, vllm_mode='server', rollout_correction != 'off'. Not the "
                  "paper's on-policy recipe."},
    )
    max_staleness: int = field(
        default=1,
        metadata={"help": "With async_generation: the most updates a rollout may lag the update that trains on it "
                  "(>= 1; a staler one is an error)."},
    )
    rollout_seed: int | None = field(
        default=None,
        metadata={"help": "Paired rollouts: each sample's randomness is a function of this seed, the step, the prompt "
                  "and the sample's index (the vLLM server or HF generate). Two runs with one seed draw the same "
                  "completions; two configs share their random numbers. Unset: TRL's sampling."},
    )
    stop_pattern: str | None = field(
        default=None,
        metadata={"help": "A regular expression that ends a completion: each is cut after the token completing its "
                  "first match, on every generation path; the tokens after it leave the rollout (reward, loss, the "
                  "80/20 mask). E.g. 'Answer:[^\\n]*\\n'. Unset: completions end as generated."},
    )

    # Parameters that control the vLLM server's weight sync (only used when `use_vllm=True, vllm_mode="server"`)
    vllm_weight_sync: str | None = choice_field(None, WEIGHT_SYNC_BACKENDS, help=(
        "vLLM server mode: how weights reach the server. 'nccl' (TRL's, CUDA), 'disk' (safetensors in "
        "vllm_sync_dir, reloaded by a server started with `or1-trl serve --weight-sync disk`; any device). "
        "Default: nccl on CUDA without use_cpu, disk otherwise."))
    vllm_sync_dtype: str = choice_field("server", SYNC_DTYPES, help=(
        "dtype the disk sync writes weights in: 'server' (the server's dtype, read from it), 'model' (the "
        "policy's), 'float32', 'bfloat16' or 'float16'."))
    vllm_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory the trainer writes weights to and the server reads them from (vllm_weight_sync='disk'; "
            "shared storage across nodes). Default: a private /dev/shm/or1-trl-vllm-sync-<random> when tmpfs has room "
            "and the server reads it, else <output_dir>/_vllm_sync (push_to_hub skips it); the trainer logs which. "
            "The server loads only from under its `or1-trl serve --sync-root` folders (default /dev/shm)."
        },
    )
    vllm_sync_peft: str = choice_field("auto", SYNC_PEFT_MODES, help=(
        "PEFT policy + disk sync: 'adapter' (push only the LoRA adapter; or1-trl serve --enable-lora), "
        "'merged' (base + BA, every weight) or 'auto' (adapter where the server takes LoRA, else merged)."))
    vllm_server_api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "Key of the vLLM server (`or1-trl serve` with $OR1_VLLM_API_KEY), sent with every request. "
            "Default: $OR1_VLLM_API_KEY, else $VLLM_API_KEY, else the key file of a server on this machine started "
            "without a key. Never saved (a resume needs it again). Prefer the "
            "variable (a command line is visible in ps)."
        },
    )

    # Parameters that control performance: the log-prob backend and padding-free packing
    logprob_backend: str = choice_field("auto", LOGPROB_BACKENDS, help=(
        "What computes per-token log-probs and entropies without [B, T, V] logits: 'trl' (TRL's fused LM "
        "head), 'liger' (Liger-Kernel's fused linear cross-entropy) or 'auto' (liger on CPU, trl on GPUs)."))
    padding_free: bool = field(
        default=False,
        metadata={"help": "Forward the log-prob passes without padding: rows packed end to end, position_ids "
                  "restarting per sequence (text-only; sdpa, eager or flash attention)."},
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={"help": "With padding_free: token slots per packed forward at most (a longer sequence gets its "
                  "own); forwards but the last are checkpointed, so this bounds the activation memory. None: one "
                  "forward."},
    )
    sharding_fallback: str = choice_field("error", SHARDING_FALLBACKS, help=(
        "The launch asked for DeepSpeed or FSDP and the trainer got something else (accelerate runs FSDP as DDP on "
        "CPUs): 'error' (stop with one line saying what was asked, obtained and why) or 'allow' (warn, train)."))

    # Parameters that keep non-finite values out of the weights
    cudnn_sdpa_guard: bool = field(
        default=True,
        metadata={"help": "Turn PyTorch's cuDNN SDPA backend off for the process on compute capability 9.x GPUs "
                  "(H100, H200) with sdpa attention and torch >= 2.11: its backward returns NaN in grad_q with a "
                  "padding mask at lengths 64 more than a multiple of 128 (704, 832, ...; pytorch/pytorch#196678). "
                  "On one H200 the update's forward+backward then took 1.126x as long, with no NaN. False: keep "
                  "cuDNN."},
    )

    nonfinite_stop_after: int | None = field(
        default=3,
        metadata={"help": "Non-finite sentinel: a step whose gradients hold NaN/inf on any rank is not applied "
                  "(counted in nonfinite_steps); after this many such steps in a row the run stops with a checkpoint "
                  "of its last finite weights and one line naming the step and the parameters. None: every update "
                  "applied (TRL's behaviour)."},
    )

    # Parameters that control the output directory, resuming, and the checks on prompts and rewards
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Cut prompts longer than this to their last max_prompt_length tokens (one warning counts them). "
            "None: prompts that do not fit the context with max_completion_length are an error at start."
        },
    )
    nonfinite_rewards: str = choice_field("error", NONFINITE_REWARD_MODES, help=(
        "A reward of inf or NaN: 'error' (stop, naming the reward function and the sample) or 'zero' "
        "(score it 0, count it in reward/nonfinite, warn once)."))
    skipped_steps_warning: int = field(
        default=5,
        metadata={"help": "Warn once after this many consecutive skipped steps (every group rejected); 0: never."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an output_dir holding a previous run: its checkpoint-N folders and "
            "prompt_stats.jsonl are removed. Without it, or --resume_from_checkpoint true to continue the run, such "
            "an output_dir is refused."
        },
    )

    # Not a parameter: what `from_grpo` sets for a plain GRPOConfig (`TRL_BEHAVIOUR`)
    recipe: str = field(default="magic", init=False, metadata={"help": (
        "'magic': OR1's recipe (OR1Config). 'trl': a plain GRPOConfig (OR1Config.from_grpo): TRL's objective, no "
        "prompt pool, over-long prompts a warning, no OR1 default announced or in the model card.")})

    @classmethod
    def from_grpo(cls, args: GRPOConfig | None, model=None) -> "OR1Config":
        """`args` itself if it is an `OR1Config`; for a plain `GRPOConfig`, an `OR1Config` holding its values, with
        every OR1 field at the value that reproduces `GRPOTrainer` (`TRL_BEHAVIOUR`). `args` is validated already
        (by TRL's `__post_init__`): its values are taken as they are, none of OR1's defaults or checks applied.
        `None` (a trainer given no config): OR1's defaults, in an output dir named after `model` as `GRPOTrainer`
        names its own ("<model name>-OR1")."""
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            return cls(f"{name.split('/')[-1]}-OR1")
        if isinstance(args, cls):
            return args
        config = cls.__new__(cls)
        config.__dict__.update(vars(args))
        config.__dict__.update(TRL_BEHAVIOUR)
        return config

    def __post_init__(self):
        check_ranges(self)  # every numeric field in its range (`ranges.FIELD_RANGES`), before TRL divides by any
        check_choices(self)  # every field with fixed values holds one of them (`FIELD_CHOICES`)
        self._apply_entropy_preset()
        self._apply_stages()
        self._default_bf16_off_without_cuda()
        self._use_cpu_for_a_multi_process_launch_without_gpus()
        self._activation_checkpointing_from_trls_name()
        super().__post_init__()
        self._apply_weight_sync()
        self._apply_rollout_correction()
        self._validate_or1()

    def to_dict(self):
        """TRL's, with `vllm_server_api_key` as a placeholder (this dict goes to W&B, TensorBoard, model cards)."""
        d = super().to_dict()
        if d.get("vllm_server_api_key"):
            d["vllm_server_api_key"] = API_KEY_PLACEHOLDER
        return d

    def __str__(self):
        text = super().__str__()
        if not self.vllm_server_api_key:
            return text
        placeholder = f"vllm_server_api_key={API_KEY_PLACEHOLDER},"
        return text.replace(f"vllm_server_api_key={self.vllm_server_api_key},", placeholder)

    def __getstate__(self):
        """What pickling saves (`Trainer` writes `torch.save(args)` as `training_args.bin` in every checkpoint and
        the output directory, which `push_to_hub` uploads): everything but the API key (`None` in its place)."""
        return {**self.__dict__, "vllm_server_api_key": None}

    def __copy__(self):  # a copy in this process keeps the key (`copy` would go through `__getstate__`)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __deepcopy__(self, memo):
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _apply_stages(self):
        """Parse `stages` (a YAML/JSON string on the command line) and size the run: `max_steps` unset (-1) means
        "until the last stage ends"; a last stage ending before `max_steps` is an error."""
        if isinstance(self.stages, str):
            import yaml

            self.stages = yaml.safe_load(self.stages)
        if self.stages is None:
            return
        stages = parse_stages(self.stages)
        self.max_steps = validate_stages(stages, self.max_steps)
        self.stages = [{k: v for k, v in vars(stage).items() if v is not None} for stage in stages]

    def _default_bf16_off_without_cuda(self):
        """TRL defaults `bf16` to on (`bf16=None`: not `fp16`), which transformers refuses on a machine with no bf16
        device unless `use_cpu` is set. There, an unset `bf16` becomes `False` (32-bit), said in one line, so that
        `OR1Config(output_dir="out")` runs on CPU as written; on CUDA nothing changes."""
        from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

        if self.bf16 is not None or self.fp16 or torch.cuda.is_available():
            return
        if is_torch_bf16_gpu_available() or is_torch_xla_available():
            return
        self.bf16 = False
        logger.warning("No CUDA GPU: OR1Config trains in 32-bit (bf16=False); set bf16 explicitly to choose.")

    def _use_cpu_for_a_multi_process_launch_without_gpus(self):
        """`accelerate launch --num_processes N` (or `torchrun`) on a machine with no accelerator: transformers
        joins the processes into one distributed job only with `use_cpu=True`; without it each process trains alone
        on its share of the data, into the same `output_dir`, and nothing says so (issue 49). Here a launch of
        several processes (`WORLD_SIZE` > 1) with no accelerator gets `use_cpu=True`, said in one line by the first
        process."""
        if self.use_cpu or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.accelerator.is_available():
            return
        self.use_cpu = True
        if os.environ.get("RANK", "0") == "0":
            logger.warning(f"No GPU: the {os.environ['WORLD_SIZE']} launched processes train as one distributed job "
                           "on the CPU (use_cpu=True, gloo); set --use_cpu true to say so yourself.")

    def _activation_checkpointing_from_trls_name(self):
        """TRL's configs set `gradient_checkpointing` (default `True`), the name transformers 5 deprecates for
        `activation_checkpointing`, so transformers warns at every config though nobody chose the old name. Where the
        new names are unset, they take the old ones' values here — what transformers' own resolution does, without
        its FutureWarning."""
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if getattr(self, new, None) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))

    def _apply_weight_sync(self):
        if self.vllm_weight_sync is None:
            self.vllm_weight_sync = default_weight_sync(self.use_cpu)
        if self.vllm_sync_dir is not None:  # None: chosen by the trainer (disk_sync.DiskWeightSync.use_default_dir)
            self.vllm_sync_dir = os.path.abspath(os.path.expanduser(self.vllm_sync_dir))

    def _apply_rollout_correction(self):
        """Set TRL's `vllm_importance_sampling_*` for `rollout_correction` (left as set with "trl")."""
        if self.rollout_correction == "trl":
            return
        ours = {"vllm_importance_sampling_correction": False} if self.rollout_correction == "off" else {
            "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_min": None,
            "vllm_importance_sampling_clip_max": self.rollout_correction_cap}
        current = {name: getattr(self, name) for name in _TRL_IS_FIELDS}
        trl_defaults = {name: _field_default(GRPOConfig, name) for name in _TRL_IS_FIELDS}
        if current != trl_defaults and current != {**current, **ours}:
            changed = ", ".join(f"{k}={v!r}" for k, v in current.items() if v != trl_defaults[k])
            warnings.warn(f"{changed} is replaced by rollout_correction={self.rollout_correction!r}; set "
                          "rollout_correction='trl' to use TRL's vllm_importance_sampling_* fields as set.",
                          UserWarning, stacklevel=4)
        for name, value in ours.items():
            setattr(self, name, value)

    def _validate_async_generation(self):
        if not self.async_generation:
            return
        if not self.use_vllm or self.vllm_mode != "server":
            raise ValueError(f"async_generation=True overlaps requests to a vLLM server with training; this run has "
                             f"use_vllm={self.use_vllm}, vllm_mode={self.vllm_mode!r}: set use_vllm=True, "
                             "vllm_mode='server' (or1-trl serve), or async_generation=False.")
        if self.num_iterations != 1 or self.steps_per_generation != self.gradient_accumulation_steps:
            raise ValueError(f"async_generation=True requests one rollout per update; this run has num_iterations="
                             f"{self.num_iterations}, steps_per_generation={self.steps_per_generation} and "
                             f"gradient_accumulation_steps={self.gradient_accumulation_steps}: set num_iterations=1 "
                             "and steps_per_generation=gradient_accumulation_steps (the recipe's N_SGD=1).")
        if not self.vllm_importance_sampling_correction:
            raise ValueError(f"async_generation=True trains on rollouts of older weights, whose log-probs reach the "
                             f"loss only through the rollout correction, which rollout_correction="
                             f"{self.rollout_correction!r} turns off: set "
                             "rollout_correction='geo_mask_token_truncate' or 'token_truncate'.")

    def _validate_stop_pattern(self):
        if self.stop_pattern is None:
            return
        try:
            pattern = re.compile(self.stop_pattern)
        except re.error as error:
            raise ValueError(f"stop_pattern={self.stop_pattern!r} is not a regular expression: {error}.") from None
        if pattern.search(""):
            raise ValueError(f"stop_pattern={self.stop_pattern!r} matches the empty text, so it would cut every "
                             "completion to nothing: give a pattern that needs at least one character.")

    def _validate_rollout_seed(self):
        if self.rollout_seed is None:  # its range (an integer >= 0) is checked with the others (`ranges.py`)
            return
        if self.use_vllm and self.vllm_mode != "server":
            raise ValueError(f"rollout_seed seeds each prompt's samples on a vLLM server or in HF generate; this run "
                             f"has use_vllm=True, vllm_mode={self.vllm_mode!r}: set vllm_mode='server' (or1-trl "
                             "serve), use_vllm=False, or rollout_seed=None.")
        if getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError("rollout_seed does not seed transformers' continuous batching: set "
                             "use_transformers_continuous_batching=False or rollout_seed=None.")

    @property
    def stage_list(self) -> list[Stage]:
        """`stages` as `Stage` objects (empty without stages)."""
        return parse_stages(self.stages)

    def _apply_entropy_preset(self):
        for name, value in ENTROPY_PRESETS[self.entropy_preset].items():
            if getattr(self, name) is None:  # fields the user set explicitly win over the preset
                setattr(self, name, value)

    @property
    def or1_loss_enabled(self) -> bool:
        """Whether any OR1 part of the objective is on. If not, OR1Trainer computes exactly TRL's loss."""
        return self.recipe == "magic" and (
            self.rejection_sampling != "off"
            or self.use_adaptive_entropy
            or self.entropy_coef != 0.0
            or (self.top_entropy_quantile < 1.0 and self.top_entropy_normalization == "selected")
        )

    def changed_defaults(self) -> list[tuple[str, object, object]]:
        """`(field, value, GRPOConfig's default)` for every field left at an OR1 default that differs from TRL's.

        "Left at" is judged by value (a field set explicitly to the OR1 default is listed too). `OR1Trainer` logs
        these once at start, so that swapping `GRPOConfig` for `OR1Config` changes nothing unannounced (e.g. the
        learning-rate schedule: constant, the paper's, instead of TRL's linear decay).
        """
        if self.recipe == "trl":  # a plain GRPOConfig (`from_grpo`): its values are the user's, none OR1's default
            return []
        changed = []
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            default = _field_default(OR1Config, f.name)
            if default is None and f.name in ENTROPY_PRESETS["paper"]:
                default = ENTROPY_PRESETS["paper"][f.name]
            if f.name in _NOT_ANNOUNCED:
                continue
            if f.name in TRL_BEHAVIOUR:
                trl = TRL_BEHAVIOUR[f.name]
            elif f.name in {g.name for g in dataclasses.fields(GRPOConfig)}:
                trl = _field_default(GRPOConfig, f.name)
            else:
                continue
            value = getattr(self, f.name)
            value = getattr(value, "value", value)  # enums (e.g. SchedulerType) as their plain value
            if value == default and value != trl:
                changed.append((f.name, value, trl))
        return changed

    @property
    def sgd_steps_per_rollout(self) -> float:
        """N_SGD: optimizer steps taken on one rollout batch (1 = on-policy, the paper's default)."""
        return self.num_iterations * self.steps_per_generation / self.gradient_accumulation_steps

    def largest_sgd_steps_per_rollout(self) -> float:
        """The largest N_SGD of the run: its own shape's, or a stage's (`batch_size / mini_batch_size` prompts, what
        the stage leaves out taken from this config over `world_size` processes, as `stages.stage_shapes` does)."""
        rows = self.per_device_train_batch_size * self.world_size  # rows per micro-step, all ranks
        run_batch = self.generation_batch_size / self.num_generations  # prompts per rollout
        run_mini = rows * self.gradient_accumulation_steps / self.num_generations  # prompts per optimizer step
        stage_steps = [
            self.num_iterations * (stage.batch_size or run_batch) / (stage.mini_batch_size or run_mini)
            for stage in self.stage_list
        ]
        return max([self.sgd_steps_per_rollout, *stage_steps])

    def magic_departures(self) -> list[str]:
        """The TRL settings of this config that change the MAGIC objective (eq. 3.1), each with what MAGIC has.

        OR1's parts (rejection and refill, adaptive entropy, stages, the prompt pool) still apply with each of them:
        TRL's loss of that type on the kept groups, plus α·H normalised like it (`or1_trl/recipe/loss.py`)."""
        departures = []
        if self.loss_type != "dapo":
            departures.append(f"loss_type={self.loss_type!r} (MAGIC: 'dapo', one token-level mean over T_k)")
        if self.beta != 0.0:
            departures.append(f"beta={self.beta} (MAGIC: no KL term)")
        if self.sync_ref_model:
            departures.append("sync_ref_model=True (MAGIC: no reference model)")
        if self.importance_sampling_level != "token":
            departures.append(f"importance_sampling_level={self.importance_sampling_level!r} (MAGIC: per-token "
                              "ratios)")
        if self.off_policy_mask_threshold is not None:
            departures.append(f"off_policy_mask_threshold={self.off_policy_mask_threshold} (MAGIC: no off-policy "
                              "mask)")
        if self.async_generation:
            departures.append(f"async_generation=True (MAGIC: on-policy; here a rollout is up to {self.max_staleness} "
                              "update(s) older than the weights it updates)")
        return departures

    def _validate_or1(self):
        problem = output_dir_problem(self.output_dir)
        if problem:
            raise ValueError(problem)
        if self.max_tokens_per_microbatch is not None and not self.padding_free:
            raise ValueError("max_tokens_per_microbatch is the packed forwards' budget: set padding_free=True with "
                             "it.")
        if not self.padding_free and any(stage.max_tokens_per_microbatch is not None for stage in self.stage_list):
            raise ValueError("a stage sets max_tokens_per_microbatch, the packed forwards' budget: set "
                             "padding_free=True.")
        problem = attention_problem((self.model_init_kwargs or {}).get("attn_implementation"))
        if self.padding_free and problem:
            raise ValueError(problem)
        if self.logprob_backend == "liger" and not liger_available():
            raise ValueError("logprob_backend='liger' needs liger-kernel: pip install liger-kernel==0.8.5 (Linux "
                             "only).")
        check_liger_layer_kernels(self)
        if self.rejection_refill_rounds and self.rejection_sampling == "off":
            raise ValueError("rejection_refill_rounds refills rejected groups: it needs rejection_sampling != 'off'.")
        if not self.entropy_coef_min <= self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min={self.entropy_coef_min} must not exceed entropy_coef_max={self.entropy_coef_max}."
            )
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ValueError(
                f"The initial entropy coefficient entropy_coef={self.entropy_coef} (c_0) lies outside "
                f"[entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min}, {self.entropy_coef_max}]."
            )
        if self.or1_loss_enabled and self.top_entropy_quantile < 1.0 and self.top_entropy_normalization == "selected":
            # The only OR1 part that is not defined with every TRL setting: it replaces a token count.
            if self.loss_type not in TOKEN_SUM_LOSSES:
                raise ValueError(
                    f"top_entropy_normalization='selected' replaces the token count T_k of a token-level loss by the "
                    f"selected tokens; loss_type={self.loss_type!r} has no such count (it averages per row or per "
                    f"micro-batch). Use top_entropy_normalization='all', or loss_type in {list(TOKEN_SUM_LOSSES)}."
                )
            if self.beta != 0.0:
                raise ValueError(
                    f"top_entropy_normalization='selected' would also rescale TRL's KL term (beta={self.beta}), which "
                    "covers every token, not the selected ones. Use top_entropy_normalization='all', or beta=0.0."
                )
        self._validate_async_generation()
        self._validate_rollout_seed()
        self._validate_stop_pattern()
        departures = self.magic_departures()
        if departures:
            warnings.warn(f"not the paper's objective: {'; '.join(departures)}.", UserWarning, stacklevel=3)
        sgd_steps = self.largest_sgd_steps_per_rollout()
        if self.use_adaptive_entropy and sgd_steps > 2:
            warnings.warn(
                f"Adaptive entropy control with {sgd_steps:g} SGD steps per rollout batch: the "
                "Skywork-OR1 report (§4.5) finds the controller unstable when N_SGD > 2. Keep "
                "steps_per_generation == gradient_accumulation_steps (a stage's batch_size == mini_batch_size) and "
                "num_iterations == 1 (on-policy).",
                UserWarning,
                stacklevel=3,
            )
