"""The valid range of every numeric `OR1Config` field the trainer reads — OR1's own, TRL's `GRPOConfig`'s and
transformers' `TrainingArguments`' — in one table, `FIELD_RANGES`, checked by `OR1Config.__post_init__` before
anything else (TRL's own checks divide by `num_generations` and `gradient_accumulation_steps`; a bad value that gets
past them stops a run after the model has loaded, or trains on in silence: `top_p=2`, `max_steps=-5`).

A value is valid when it is a number (`bool` is not), finite, an integer where the entry says so, and inside the
entry's interval — or `None` where the field may be unset, or one of the entry's `special` values (`max_steps=-1`:
"train `num_train_epochs` epochs"). `check_ranges(config)` raises one `ValueError` naming the field, its value, the
valid range and why; `tests/trainer/test_or1_config.py` walks the table (each bound refused one step outside, accepted
on it).

Relations between fields (`entropy_coef_min <= entropy_coef_max`, a batch divisible by `num_generations`) are checked
where they are used (`OR1Config._validate_or1`, TRL's `GRPOConfig.__post_init__`), after these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

#: `numpy.random.seed` takes [0, 2**32 - 1]; transformers' `set_seed` passes the seed to it.
MAX_SEED = 2**32 - 1


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The valid values of one numeric field: `low`/`high` bounds (`None`: unbounded; `*_open`: the bound itself is
    refused), `integer`, `optional` (`None` allowed), `special` (values allowed outside the interval, e.g. -1), and
    `elements` (the value is a list of such numbers, each checked), and `reason`, the why that ends the error
    message. Infinite values and NaN are always refused."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    optional: bool = False
    special: tuple = ()
    elements: bool = False
    reason: str = ""

    def describe(self) -> str:
        """The valid range in words: "an integer >= 1", "in (0, 1]", "> 0 and finite", "an integer >= 1, or -1"."""
        if self.low is not None and self.high is not None:
            low, high = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {low}{_num(self.low)}, {_num(self.high)}{high}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = ""
        if self.integer:
            text = f"an integer {text}".rstrip()
        elif self.low is None or self.high is None:  # an unbounded side: say that inf is refused too
            text = f"{text} and finite" if text else "a finite number"
        if self.elements:
            text = f"a list of numbers {text}" if text != "a finite number" else "a list of finite numbers"
        alternatives = [repr(v) for v in self.special] + (["None"] if self.optional else [])
        return ", or ".join([text, *alternatives])

    def contains(self, value) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if value in self.special:
            return True
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, name: str, value) -> str | None:
        """`None` if `value` is valid for field `name`, else the one-line error."""
        if self.elements and isinstance(value, (list, tuple)):  # the first bad element, against one number's range
            one = replace(self, optional=False, elements=False)
            bad = next((i for i, element in enumerate(value) if not one.contains(element)), None)
            return None if bad is None else one.problem(f"{name}[{bad}]", value[bad])
        if self.contains(value) and not self.elements:
            return None
        if self.elements and value is None and self.optional:
            return None
        return f"{name}={value!r} must be {self.describe()}" + (f" ({self.reason})." if self.reason else ".")


def _positive_int(reason: str, optional: bool = False) -> Range:
    return Range(low=1, integer=True, optional=optional, reason=reason)


def _count(reason: str, optional: bool = False) -> Range:
    return Range(low=0, integer=True, optional=optional, reason=reason)


def _positive(reason: str, optional: bool = False) -> Range:
    return Range(low=0, low_open=True, optional=optional, reason=reason)


def _non_negative(reason: str, optional: bool = False) -> Range:
    return Range(low=0, optional=optional, reason=reason)


def _fraction(reason: str, optional: bool = False, low_open: bool = False) -> Range:
    return Range(low=0, high=1, low_open=low_open, optional=optional, reason=reason)


_PORT = Range(low=1, high=65535, integer=True, reason="a TCP port")

#: field → its valid range. Every numeric field of `OR1Config` that the trainer (OR1's, TRL's or transformers') reads;
#: the others are in `UNCHECKED`, with why.
FIELD_RANGES: dict[str, Range] = {
    # --- transformers' TrainingArguments -------------------------------------------------------------------------
    "per_device_train_batch_size": _positive_int("rows per device per micro-step"),
    "per_device_eval_batch_size": _positive_int("rows per device per evaluation step"),
    "gradient_accumulation_steps": _positive_int("micro-steps per optimizer step"),
    "num_train_epochs": _positive("passes over the prompts when max_steps=-1"),
    "max_steps": Range(low=1, integer=True, special=(-1,),
                       reason="optimizer steps; -1: as many as num_train_epochs take"),
    "learning_rate": Range(low=0, high=10, low_open=True, reason=(
        "a step size: 0 trains nothing, above 10 is a typo; the recipe uses 1e-6")),
    "warmup_steps": _non_negative("optimizer steps, or a fraction of them when < 1"),
    "weight_decay": _non_negative("decoupled weight decay of AdamW"),
    "adam_beta1": Range(low=0, high=1, high_open=True, reason="Adam's first-moment decay"),
    "adam_beta2": Range(low=0, high=1, high_open=True, reason="Adam's second-moment decay"),
    "adam_epsilon": _non_negative("added to Adam's denominator"),
    "max_grad_norm": _non_negative("gradient clipping norm; 0: no clipping", optional=True),
    "logging_steps": _positive("optimizer steps between logs, or a fraction of the run when < 1"),
    "save_steps": _positive("optimizer steps between checkpoints, or a fraction of the run when < 1"),
    "eval_steps": _positive("optimizer steps between evaluations, or a fraction of the run when < 1", optional=True),
    "save_total_limit": _positive_int("checkpoints kept; None keeps all", optional=True),
    "seed": Range(low=0, high=MAX_SEED, integer=True, reason="numpy takes seeds in [0, 2**32 - 1]"),
    "data_seed": Range(low=0, high=MAX_SEED, integer=True, optional=True,
                       reason="numpy takes seeds in [0, 2**32 - 1]"),
    "dataloader_num_workers": _count("worker processes; 0 loads in the main process"),
    "dataloader_prefetch_factor": _positive_int("batches each worker loads ahead", optional=True),
    "eval_delay": _non_negative("steps or epochs before the first evaluation"),
    "eval_accumulation_steps": _positive_int("evaluation steps between moves to the CPU", optional=True),
    "torch_empty_cache_steps": _positive_int("steps between torch's cache releases", optional=True),
    "neftune_noise_alpha": _positive("NEFTune's embedding noise; None: off", optional=True),
    "ddp_timeout": _positive_int("seconds a collective may wait"),
    "ddp_bucket_cap_mb": _positive_int("MB per DDP gradient bucket", optional=True),
    # --- TRL's GRPOConfig: generation ----------------------------------------------------------------------------
    "num_generations": Range(low=2, integer=True, reason=(
        "GRPO requires at least 2 generations per prompt to calculate the advantages")),
    "num_generations_eval": _positive_int("generations per prompt in evaluation; None: num_generations",
                                          optional=True),
    "generation_batch_size": _positive_int("completions per generation", optional=True),
    "steps_per_generation": _positive_int("micro-steps per generation", optional=True),
    "max_completion_length": _positive_int("tokens per completion", optional=True),
    "temperature": _positive("sampling temperature; the loss divides the logits by it"),
    "top_p": _fraction("nucleus sampling mass; 1: off", low_open=True),
    "top_k": _count("top-k sampling; 0: off"),
    "min_p": _fraction("minimum token probability relative to the most likely one", optional=True),
    "repetition_penalty": _positive("sampling divides or multiplies logits by it; 1: off"),
    "vllm_server_port": _PORT,
    "vllm_group_port": _PORT,
    "vllm_server_timeout": _positive("seconds to wait for the vLLM server"),
    "vllm_gpu_memory_utilization": _fraction("share of the GPU memory vLLM takes", low_open=True),
    "vllm_max_model_length": _positive_int("tokens of context", optional=True),
    "vllm_tensor_parallel_size": _positive_int("GPUs per vLLM engine"),
    "max_tool_calling_iterations": _count("tool-calling turns; None: no limit", optional=True),
    "num_completions_to_print": _count("completions printed; None: all", optional=True),
    # --- TRL's GRPOConfig: the loss ------------------------------------------------------------------------------
    "beta": _non_negative("KL coefficient; 0: no KL term, as MAGIC"),
    "num_iterations": _positive_int("passes over each rollout batch"),
    "epsilon": _positive("lower clipping range of the ratio, 1 - epsilon"),
    "epsilon_high": _positive("upper clipping range of the ratio, 1 + epsilon_high; None: epsilon", optional=True),
    "delta": Range(low=1, low_open=True, optional=True, reason="upper bound of the ratio in two-sided clipping"),
    "sapo_temperature_neg": _positive("SAPO's gate temperature"),
    "sapo_temperature_pos": _positive("SAPO's gate temperature"),
    "vespo_k_pos": _non_negative("VESPO's power exponent"),
    "vespo_k_neg": _non_negative("VESPO's power exponent"),
    "vespo_lambda_pos": _positive("VESPO's decay factor"),
    "vespo_lambda_neg": _positive("VESPO's decay factor"),
    "ref_model_mixup_alpha": _fraction("TR-DPO's mix of policy and reference"),
    "ref_model_sync_steps": _positive_int("optimizer steps between reference syncs"),
    "vllm_importance_sampling_cap": _positive("deprecated: vllm_importance_sampling_clip_max", optional=True),
    "router_aux_loss_coef": _non_negative("MoE load-balancing loss weight", optional=True),
    "off_policy_mask_threshold": _positive("KL threshold of the off-policy mask; None: off", optional=True),
    "vllm_importance_sampling_clip_min": _non_negative("lower bound of the rollout ratio", optional=True),
    "vllm_importance_sampling_clip_max": _positive("upper bound of the rollout ratio", optional=True),
    "reward_weights": Range(optional=True, elements=True, reason="one weight per reward function"),
    "top_entropy_quantile": _fraction("share of the highest-entropy tokens kept; 0.2 for the 80/20 rule"),
    # --- entropy control (TRL's fields, OR1's presets) -----------------------------------------------------------
    "entropy_coef": Range(reason="the entropy term's coefficient c"),
    "entropy_coef_min": Range(optional=True, reason="lower clip of c; None: from entropy_preset"),
    "entropy_coef_max": Range(optional=True, reason="upper clip of c; None: from entropy_preset"),
    "entropy_coef_delta": _non_negative("step of c per optimizer step; None: from entropy_preset", optional=True),
    "entropy_target": _positive("target entropy in nats, 0.2 in the paper; None: from entropy_preset",
                                optional=True),
    # --- OR1Config -----------------------------------------------------------------------------------------------
    "online_filter_threshold": _fraction("accuracy; None: off", optional=True, low_open=True),
    "online_filter_unsolved_after": _positive_int("samples; None: off", optional=True),
    "rejection_refill_rounds": _count("extra generation rounds; 0: off"),
    "entropy_collapse_fraction": _fraction("a fraction of entropy_target", low_open=True),
    "entropy_collapse_steps": _count("consecutive steps; 0: no warning"),
    "max_prompt_length": _positive_int("tokens; None: no truncation", optional=True),
    "skipped_steps_warning": _count("consecutive skipped steps; 0: no warning"),
    "max_tokens_per_microbatch": _positive_int("token slots per packed forward; None: one forward", optional=True),
    "rollout_correction_cap": Range(low=1, low_open=True, reason="the ratio cap c; the geometric mask keeps [1/c, c]"),
    "max_staleness": _positive_int("updates a rollout may lag"),
    "rollout_seed": Range(low=0, integer=True, optional=True,
                          reason="hashed with the step and the prompt into each row's key; None: TRL's sampling"),
    "nonfinite_stop_after": _positive_int("non-finite steps in a row before the run stops; None: no sentinel",
                                          optional=True),
}


#: Numeric fields of `OR1Config` left out of `FIELD_RANGES`, and why.
UNCHECKED: dict[str, str] = {
    "local_rank": "set by the launcher (torchrun, accelerate), not by the user",
    "pad_to_multiple_of": "an int or 'auto', parsed by TRL's GRPOConfig",
    "label_smoothing_factor": "transformers' default loss only; GRPOTrainer computes its own",
}


def check_ranges(config) -> None:
    """`ValueError` (one line) for the first field of `FIELD_RANGES` whose value in `config` is out of range."""
    for name, entry in FIELD_RANGES.items():
        problem = entry.problem(name, getattr(config, name))
        if problem:
            raise ValueError(problem)
