"""The contract with TRL and transformers: every private name of theirs that `or1_trl` overrides, calls, reads or
writes, with the signature it relies on (issue 22.5); and the accelerate and DeepSpeed internals of sharded training
(`trainer/sharding.py`, issue 35).

`pyproject.toml` pins `trl==1.16.*`. A TRL (or transformers) release that renames a hook, changes its parameters or
drops an attribute fails here, in one place, with a message naming the symbol, how `or1_trl` uses it and the
installed versions — instead of in scattered places at run time.

`CONTRACT` is the table. Kinds:

- `method`: a method of a TRL/transformers class that OR1 overrides or calls; `params` is the parameter list it
  relies on (names; `*args`, `**kwargs`; `name=` has a default; a trailing `...` allows more after them);
- `attribute`: an instance attribute that the owner's own code sets (`self.name = ...` in its source) and OR1
  reads, writes or shadows with a property;
- `class attribute`: an attribute of the owner class itself;
- `module global`: a module-level name of a TRL/transformers module that OR1 reads, imports or swaps (`params` as
  for methods when it is a function OR1 calls).

`test_contract_table_is_complete` scans the package (`ast`, every module but `vllm_ext/`, which runs inside the vLLM
server) and fails when a use is missing from the table, so that a new private use must be registered here, and when
an entry is no longer used, so that the table stays the list of hooks the architecture doc describes. What it finds:

- in classes deriving from a TRL/transformers class: every method that overrides one of theirs (public hooks too),
  every `super().name(...)`, every `self._name` that is theirs, every `self.name = ...` that writes their state;
- anywhere: `x._name` where `_name` is a private name of a TRL/transformers class the package subclasses;
- anywhere: attributes of a TRL/transformers module bound to a name (`import trl.trainer.utils as trl_utils`,
  `from trl.trainer import grpo_trainer`), and `f(module, "name", ...)` (a swap by name);
- imports of names that the top-level `trl` / `transformers` packages do not export.

To add an entry: run this file; the failure lists the missing `(owner, name, kind)` and where each is used; add a
`Use(...)` line with the parameters relied on (copy TRL's signature) and one line on why.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
import textwrap
from dataclasses import dataclass

import pytest
import transformers
import trl

import or1_trl

PACKAGE = pathlib.Path(or1_trl.__file__).parent
EXTERNAL = ("trl", "transformers")
SKIPPED = ("vllm_ext",)  # runs inside the vLLM server (its own venv): not a TRL contract


@dataclass(frozen=True)
class Use:
    """One private (or hooked) TRL/transformers name `or1_trl` relies on.

    Args:
        owner: import path of the class or module holding it ("trl.GRPOTrainer", "trl.trainer.utils").
        name: the attribute.
        kind: "method", "attribute", "class attribute" or "module global".
        params: for methods and called functions, the parameters relied on (see the module docstring); else None.
        why: where and how `or1_trl` uses it (for the failure message and the architecture doc).
        scanned: False for a use the completeness scan cannot see (a public attribute of a TRL object the trainer
            holds, e.g. `self.vllm_generation.temperature = ...`): exempt from the "no longer used" check.
    """

    owner: str
    name: str
    kind: str
    params: str | None
    why: str
    scanned: bool = True


METHOD, ATTRIBUTE, CLASS_ATTRIBUTE, GLOBAL = "method", "attribute", "class attribute", "module global"
GRPO, TRAINER = "trl.GRPOTrainer", "transformers.Trainer"
VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"
VLLM_CLIENT = "trl.generation.vllm_client.VLLMClient"
CALLBACK = "transformers.TrainerCallback"
CALLBACK_PARAMS = "self, args, state, control, **kwargs"

CONTRACT: list[Use] = [
    # --- GRPOTrainer: the hooks OR1Trainer overrides (trainer.py) ----------------------------------------------
    Use(GRPO, "__init__", METHOD, "self, model, reward_funcs=, args=, train_dataset=, eval_dataset=, ...",
        "trainer.py: OR1Trainer.__init__ passes model, reward_funcs, args, train_dataset, eval_dataset positionally"),
    Use(GRPO, "_calculate_rewards", METHOD, "self, inputs, prompts, completions, completion_ids_list",
        "trainer.py overrides: rewards of all ranks [B*G, F] for rejection, per-prompt statistics, non-finite check"),
    Use(GRPO, "_generate_and_score_completions", METHOD, "self, inputs",
        "trainer.py overrides: the rollout correction replaces its importance_sampling_ratio (rollout_correction.py; "
        "refills too), per-prompt statistics, rejection sampling and refill, T_k over the kept tokens"),
    Use(GRPO, "_compute_loss", METHOD, "self, model, inputs",
        "trainer.py overrides: TRL's loss on the kept tokens (mask passed as tool_mask), + α·H, eq. 3.2 controller"),
    Use(GRPO, "_get_per_token_logps_and_entropies", METHOD,
        "self, model, input_ids, attention_mask, logits_to_keep, batch_size=, compute_entropy=, compute_aux_loss=, ...",
        "trainer.py overrides: Liger's kernel inside TRL's fused head; keeps the policy pass's (logps, entropies, aux)"),
    Use(GRPO, "_generate", METHOD, "self, prompts", "trainer.py overrides: times the rollout phase"),
    Use(GRPO, "_prepare_inputs", METHOD, "self, generation_batch", "trainer.py overrides: times the 'other' phase"),
    Use(GRPO, "_generate_single_turn", METHOD,
        "self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=",
        "trainer.py overrides: returns (completion_ids, logprobs); HF path: the policy's `generate` samples through "
        "FiniteLogits (finite_logits.py), vLLM path: the sampled tokens' log-probs read; NaN: NonFiniteLogitsError"),
    Use("transformers.LogitsProcessor", "__call__", METHOD, "self, input_ids, scores",
        "finite_logits.FiniteLogits overrides it: generate calls it with [B, L] ids and [B, V] scores, last in the list"),
    Use(GRPO, "training_step", METHOD, "self, model, inputs, num_items_in_batch",
        "trainer.py overrides: times the update, counts a step whose update sharding.UpdateSkip skipped"),
    Use(GRPO, "_tokenize_prompts", METHOD, "self, prompts",
        "trainer.py overrides (max_prompt_length cut) and calls TRL's to measure prompt lengths before training"),
    Use(GRPO, "_get_train_sampler", METHOD, "self, dataset=",
        "trainer.py overrides: the prompt pool's sampler (prompts.PromptSampler) when stages are set"),
    Use(GRPO, "_save_checkpoint", METHOD, "self, model, trial",
        "trainer.py overrides: OR1 state files and the completeness marker after TRL's files, then rotation"),
    Use(GRPO, "_issue_warnings_after_load", METHOD, "self, load_result",
        "trainer.py overrides: a tied weight a checkpoint holds once is not reported missing (checkpoint.py)"),
    Use(GRPO, "_load_optimizer_and_scheduler", METHOD, "self, checkpoint",
        "trainer.py overrides: a stage's learning rate after TRL restores the optimizer (and the controller)"),
    Use(GRPO, "create_model_card", METHOD, "self, model_name=, dataset_name=, tags=",
        "trainer.py overrides: the OR1 section inserted into the card TRL writes"),
    Use(GRPO, "get_high_entropy_mask", METHOD, "self, entropies, mask, threshold",
        "trainer.py overrides: keeps TRL's mask of the policy pass; the 80/20 'selected' normaliser counts its tokens"),
    Use(GRPO, "_paper", CLASS_ATTRIBUTE, None, "trainer.py: the model card cites GRPO's paper after OR1's"),
    Use(GRPO, "_name", CLASS_ATTRIBUTE, None, "trainer.py sets it: the model card's trainer name ('OR1')"),
    Use(GRPO, "_tag_names", CLASS_ATTRIBUTE, None, "trainer.py sets it: the Hub tags of the model card (+ 'or1')"),
    # --- GRPOTrainer: its state OR1Trainer reads or writes -------------------------------------------------------
    Use(GRPO, "_metrics", ATTRIBUTE, None, "trainer.py appends OR1's metrics to TRL's {'train'|'eval': {key: [..]}}; "
        "rollout_correction.py replaces the last sampling/importance_sampling_ratio/* entries TRL appended; "
        "trainer.py sets TRL's last `entropy` entry to NaN on a micro-step with no kept token (TRL's `log` drops NaN)"),
    Use(GRPO, "_step", ATTRIBUTE, None, "trainer.py resets TRL's generation counter at a stage start"),
    Use(GRPO, "_buffered_inputs", ATTRIBUTE, None, "trainer.py drops TRL's buffered rollout at a stage start"),
    Use(GRPO, "_last_loaded_step", ATTRIBUTE, None,
        "trainer.py (async_generation) reads it: TRL pushes weights when it differs from global_step, so the "
        "rollout in flight is waited for first"),
    Use(GRPO, "_last_world_entropy", ATTRIBUTE, None,
        "trainer.py shadows it with a property: TRL's controller state is OR1's (saved by TRL's checkpointing)"),
    Use(GRPO, "entropy_coef", ATTRIBUTE, None, "trainer.py shadows it with a class-level property (the controller's c)",
        scanned=False),
    Use(GRPO, "_entropy_bonus_enabled", ATTRIBUTE, None,
        "trainer.py switches TRL's own entropy bonus off inside _compute_loss (OR1 adds α·H itself)"),
    Use(GRPO, "_tokenizer", ATTRIBUTE, None, "trainer.py reads the pad token id (truncation rule, batch concat)"),
    Use(GRPO, "_is_vlm", ATTRIBUTE, None, "trainer.py: no prompt-length check for vision-language models"),
    Use(GRPO, "max_completion_length", ATTRIBUTE, None, "stage_run.apply_to_trainer writes it at a stage start",
        scanned=False),
    Use(GRPO, "num_generations", ATTRIBUTE, None, "stage_run.apply_to_trainer writes it at a stage start", scanned=False),
    Use(GRPO, "temperature", ATTRIBUTE, None,
        "stage_run.apply_to_trainer writes it at a stage start (the trainer re-patches the fused head)", scanned=False),
    Use(GRPO, "generation_kwargs", ATTRIBUTE, None,
        "stage_run.apply_to_trainer updates max_new_tokens and temperature at a stage start", scanned=False),
    Use(GRPO, "generation_config", ATTRIBUTE, None,
        "stage_run.apply_to_trainer writes max_new_tokens and temperature at a stage start",
        scanned=False),
    Use(GRPO, "reward_funcs", ATTRIBUTE, None,
        "reward_checks.record_abstentions swaps them for recorders around TRL's _calculate_rewards", scanned=False),
    Use(GRPO, "callback_handler", ATTRIBUTE, None,
        "observability.stage_loop_end replaces callback_handler.on_train_end during a stage that is not the last",
        scanned=False),
    # --- transformers.Trainer ----------------------------------------------------------------------------------
    Use(GRPO, "train", METHOD, "self, resume_from_checkpoint=, trial=, ignore_keys_for_eval=",
        "trainer.py overrides: verified resume, one pass of the loop per stage"),
    Use(GRPO, "get_batch_samples", METHOD, "self, epoch_iterator, num_batches, device",
        "trainer.py overrides: restores the checkpoint's RNG after the first fetch on a stage resume"),
    Use(GRPO, "_get_output_dir", METHOD, "self, trial",
        "checkpoint.save_complete and stop_with_checkpoint: the run dir of the checkpoint being saved", scanned=False),
    Use(GRPO, "_load_rng_state", METHOD, "self, checkpoint", "trainer.py: RNG of a resumed stage"),
    Use(GRPO, "model_wrapped", ATTRIBUTE, None,
        "sharding.enter_stage: the previous stage's DeepSpeed engine (destroyed), reset to the model so that the "
        "next train() builds the stage's engine", scanned=False),
    Use(GRPO, "deepspeed", ATTRIBUTE, None, "sharding.enter_stage resets it with model_wrapped", scanned=False),
    Use(GRPO, "is_deepspeed_enabled", ATTRIBUTE, None, "sharding.enter_stage: DeepSpeed runs", scanned=False),
    # --- accelerate and DeepSpeed internals (sharding.py; deepspeed comes with the dev and deepspeed extras) ----
    Use("accelerate.state.GradientState", "_set_sync_gradients", METHOD, "self, sync_gradients",
        "sharding.UpdateSkip.skip: a skipped step's last backward runs with sync_gradients off (no DeepSpeed engine "
        "step, no optimizer step), as transformers' loop sets it each micro-step", scanned=False),
    Use("accelerate.optimizer.AcceleratedOptimizer", "_is_overflow", ATTRIBUTE, None,
        "sharding._mark_skipped: step_was_skipped reads it; transformers then leaves the LR scheduler alone",
        scanned=False),
    Use("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "overflow", ATTRIBUTE, None,
        "sharding._mark_skipped: accelerate's DeepSpeedOptimizerWrapper.step_was_skipped reads it", scanned=False),
    Use("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "overflow", ATTRIBUTE, None,
        "sharding._mark_skipped, as for ZeRO-3", scanned=False),
    Use("deepspeed.runtime.engine.DeepSpeedEngine", "destroy", METHOD, "self",
        "sharding.enter_stage: the previous stage's engine removes its ZeRO hooks from the model", scanned=False),
    Use("transformers.trainer", "TRAINER_STATE_NAME", GLOBAL, None,
        "trainer.py and observability.py: the file a checkpoint must hold; the final trainer_state.json"),
    Use("transformers.trainer", "rotate_checkpoints", GLOBAL,
        "output_dir, save_total_limit=, best_model_checkpoint=, use_mtime=, checkpoint_prefix=",
        "checkpoint.save_complete calls it after the completeness marker is written (rotation held back until then)"),
    Use("transformers.trainer_utils", "PREFIX_CHECKPOINT_DIR", GLOBAL, None, "trainer.py: checkpoint-<step> folders"),
    Use("transformers.HfArgumentParser", "_parse_dataclass_field", METHOD, "parser, field",
        "cli/parsing.py overrides it (a static method) in the class command_parser builds: a field with "
        "metadata positional=True is a positional argument (serve MODEL, plot OUTPUT_DIR), every other field is "
        "HfArgumentParser's", scanned=False),
    Use("transformers.integrations.deepspeed", "is_deepspeed_zero3_enabled", GLOBAL, "",
        "logprobs.py: Liger cannot run under ZeRO-3"),
    # --- TRL helpers and module globals --------------------------------------------------------------------------
    Use("trl.trainer.utils", "add_fused_lm_head", GLOBAL,
        "model, temperature=, cast_lm_head_to_fp32=, outputs=",
        "trainer.py re-patches the head with a stage's temperature"),
    Use("trl.trainer.utils", "get_config_model_id", GLOBAL, "config", "trainer.py: default output dir, model card"),
    Use("trl.trainer.utils", "is_async_callable", GLOBAL, "func",
        "reward_checks.py: an async reward gets an async recorder (TRL awaits it)"),
    Use("trl.trainer.utils", "_ChunkedLogProbFunction", GLOBAL, None,
        "logprobs.use_liger_head rebinds this name, looked up by TRL's fused-head forward, to LigerLogProbFunction "
        "in one model's copy of that forward (same apply(...) outputs)", scanned=False),
    Use("trl.trainer.utils", "_use_triton", GLOBAL, "device",
        "logprobs.use_liger_head rebinds this name in one model's copy of TRL's forward: score only the valid "
        "positions", scanned=False),
    Use("trl.trainer.grpo_trainer", "VLLMGeneration", GLOBAL, None,
        "vllm_generation.generation_backend swaps it during GRPOTrainer.__init__ for OR1VLLMGeneration"),
    Use("trl.generation.vllm_generation", "VLLMClient", GLOBAL, None,
        "vllm_generation.py swaps it inside OR1VLLMGeneration._init_vllm for OR1VLLMClient (the API key)"),
    Use("trl.generation.vllm_client", "is_vllm_available", GLOBAL, None,
        "vllm_client.http_vllm_client lifts VLLMClient's vLLM check for its constructor (HTTP-only client)"),
    Use("trl.generation.vllm_client", "VLLMClient", GLOBAL, None, "vllm_client.py subclasses it (OR1VLLMClient)"),
    Use("trl.generation.vllm_generation", "VLLMGeneration", GLOBAL, None,
        "vllm_generation.py subclasses it (OR1VLLMGeneration)"),
    # --- VLLMGeneration / VLLMClient (vllm_generation.py, vllm_client.py) -----------------------------------
    Use(VLLM_GENERATION, "__init__", METHOD, "self, model, accelerator, processing_class, mode=, ...",
        "vllm_generation.py: OR1VLLMGeneration passes TRL's arguments through"),
    Use(VLLM_GENERATION, "_init_vllm", METHOD, "self",
        "vllm_generation.py overrides: TRL's with OR1VLLMClient, or an HTTP-only client for the disk sync"),
    Use(VLLM_GENERATION, "sync_weights", METHOD, "self", "vllm_generation.py overrides: the disk weight sync"),
    Use(VLLM_GENERATION, "_iter_named_params", METHOD, "self",
        "vllm_generation.py calls it: the weights to push (gathered on every rank)"),
    Use(VLLM_GENERATION, "_fix_param_name_to_vllm", METHOD, "self, name, extra_prefixes=",
        "vllm_generation.py calls it: the base weights of a PEFT policy under vLLM's names (adapter-only sync), as "
        "TRL's _iter_named_params names them"),
    Use(VLLM_GENERATION, "vllm_client", ATTRIBUTE, None, "vllm_generation.py sets the HTTP-only client; overlap.py "
        "wraps it on the main process (PrefetchedClient answers the request in flight, async_generation)"),
    Use(VLLM_GENERATION, "generate", METHOD, "self, prompts, images, num_generations, profiler=",
        "vllm_generation.py overrides: the main process's ServerDownError reaches every rank (server_health.py); it "
        "relies on TRL's server path broadcasting one 4-tuple (prompt_ids, completion_ids, logprobs, "
        "logprob_token_ids) from process 0 after the request, which the main process sends empty to release the others"),
    Use(VLLM_GENERATION, "server_timeout", ATTRIBUTE, None,
        "vllm_generation.py reads it (vllm_server_timeout): how long ServerWatch waits for a server that is down",
        scanned=False),
    Use(VLLM_GENERATION, "max_completion_length", ATTRIBUTE, None, "stage_run.apply_to_trainer writes it at a stage start",
        scanned=False),
    Use(VLLM_GENERATION, "temperature", ATTRIBUTE, None, "stage_run.apply_to_trainer writes it at a stage start",
        scanned=False),
    Use(VLLM_CLIENT, "__init__", METHOD, "self, base_url=, host=, server_port=, group_port=, connection_timeout=, ...",
        "vllm_client.py: OR1VLLMClient(base_url=, group_port=, connection_timeout=)"),
    Use(VLLM_CLIENT, "generate", METHOD, "self, prompts, ...",
        "vllm_client.py overrides: OR1VLLMClient sends it through ServerWatch (health, weights version, re-request)"),
    Use(VLLM_CLIENT, "chat", METHOD, "self, messages, ...", "vllm_client.py overrides: as generate"),
    Use(VLLM_CLIENT, "check_server", METHOD, "self, total_timeout=, retry_interval=",
        "vllm_client.py overrides: VLLMClient.__init__ calls it with connection_timeout (vllm_server_timeout); "
        "OR1VLLMClient says what it waits for and fails in one line, then calls TRL's (it reads the host)"),
    Use(VLLM_CLIENT, "session", ATTRIBUTE, None,
        "vllm_client.py shadows it with a property: the session VLLMClient.__init__ creates gets the API key"),
    Use(VLLM_CLIENT, "model", ATTRIBUTE, None,
        "vllm_client.py shadows it with a property: generate/chat send it as the request's model, the LoRA adapter "
        "of the last push (adapter-only sync) in place of the name VLLMClient.__init__ reads from /v1/models"),
    # --- OR1Config(GRPOConfig) -----------------------------------------------------------------------------------
    Use("trl.GRPOConfig", "__post_init__", METHOD, "self", "config.py overrides: stages, presets, validation"),
    Use("trl.GRPOConfig", "to_dict", METHOD, "self", "config.py overrides: the stages serialise as plain dicts"),
    Use("transformers.utils", "is_torch_bf16_gpu_available", GLOBAL, "",
        "config.py: bf16 defaults off where the device has none"),
    Use("trl.GRPOConfig", "__str__", METHOD, "self", "config.py overrides: the stages print in full"),
    # --- callbacks (trainer.py, observability.py, nonfinite.py, demos) ----------------------------------------------
    Use(CALLBACK, "on_step_end", METHOD, CALLBACK_PARAMS,
        "stage_run.StageEnd, observability.StepTimerCallback, nonfinite.NonFiniteSentinel (sets should_save/_stop)"),
    Use(CALLBACK, "on_train_end", METHOD, CALLBACK_PARAMS, "observability.SaveFinalState, trainer (stages)"),
    Use(CALLBACK, "on_log", METHOD, CALLBACK_PARAMS, "step_printer.StepPrinter, demos.tiny.SFTProgress (read logs=)"),
    Use(CALLBACK, "on_pre_optimizer_step", METHOD, CALLBACK_PARAMS,
        "observability.StepTimerCallback; nonfinite.NonFiniteSentinel (after the last backward, before the step)"),
    Use(CALLBACK, "on_save", METHOD, CALLBACK_PARAMS,
        "nonfinite.NonFiniteSentinel (raises once the stop's checkpoint is complete)"),
    Use(CALLBACK, "on_optimizer_step", METHOD, CALLBACK_PARAMS, "observability.StepTimerCallback"),
    Use(CALLBACK, "on_train_begin", METHOD, CALLBACK_PARAMS,
        "observability.StepTimerCallback; observability.PromptFormatCheck (reads processing_class=, train_dataloader=)"),
]


# ---------------------------------------------------------------------------------------------------------------
# Checking an entry against the installed TRL / transformers
# ---------------------------------------------------------------------------------------------------------------

def _resolve(path: str):
    """The class or module at import path `path` ("trl.GRPOTrainer", "trl.trainer.utils")."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(module), attr)


def _params(fn) -> str:
    """`fn`'s parameters as the table spells them: names, `*args`, `**kwargs`, `name=` for a default."""
    spelled = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        spelled.append(prefix + p.name + ("=" if p.default is not p.empty else ""))
    return ", ".join(spelled)


def _params_match(expected: str, actual: str) -> bool:
    if expected.endswith(", ..."):
        head = expected[: -len(", ...")]
        return actual == head or actual.startswith(head + ", ")
    return actual == expected


@functools.lru_cache(maxsize=None)
def _assigned(cls) -> frozenset[str]:
    """Names the class's own source assigns as `self.name = ...` (its instance attributes)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
    return frozenset(names)


def _versions() -> str:
    return f"TRL {trl.__version__}, transformers {transformers.__version__}"


def check(use: Use) -> str | None:
    """What is wrong with `use` in the installed TRL / transformers (None: it holds)."""
    where = f"{use.owner}.{use.name}"
    try:
        owner = _resolve(use.owner)
    except (ImportError, AttributeError) as exc:
        return f"{_versions()}: {use.owner} is gone ({exc}); or1_trl uses {use.name} of it: {use.why}"
    if use.kind == ATTRIBUTE:
        holders = [c for c in owner.__mro__ if use.name in _assigned(c)]
        if not holders:
            return (f"{_versions()}: {where} is no longer set by {use.owner} (no `self.{use.name} = ...` in its "
                    f"source or its bases'): {use.why}")
        return None
    if not hasattr(owner, use.name):
        return f"{_versions()}: {where} ({use.kind}) is gone: {use.why}"
    value = inspect.getattr_static(owner, use.name)
    if use.kind == METHOD and not callable(getattr(owner, use.name)):
        return f"{_versions()}: {where} is no longer a method ({type(value).__name__}): {use.why}"
    if use.params is not None:
        actual = _params(getattr(owner, use.name))
        if not _params_match(use.params, actual):
            return (f"{_versions()}: {where}({use.params}) changed: {use.why} (got {where}({actual}))")
    return None


@pytest.mark.parametrize("use", CONTRACT, ids=[f"{u.owner.rsplit('.', 1)[-1]}.{u.name}" for u in CONTRACT])
def test_trl_still_has_it(use):
    problem = check(use)
    assert problem is None, problem


def test_a_changed_signature_is_named_with_the_versions():
    """The message names the symbol, how OR1 uses it, the installed versions and what TRL has now."""
    changed = Use(GRPO, "_compute_loss", METHOD, "self, model, inputs, extra", "trainer.py overrides it")
    message = check(changed)
    assert message == (f"TRL {trl.__version__}, transformers {transformers.__version__}: "
                       "trl.GRPOTrainer._compute_loss(self, model, inputs, extra) changed: trainer.py overrides it "
                       "(got trl.GRPOTrainer._compute_loss(self, model, inputs))")
    assert "is gone" in check(Use(GRPO, "_no_such_hook", METHOD, "self", "x"))
    assert "no longer set by" in check(Use(GRPO, "_no_such_state", ATTRIBUTE, None, "x"))
    assert check(Use(GRPO, "__init__", METHOD, "self, model, reward_funcs=, ...", "x")) is None  # a prefix
    assert check(Use(GRPO, "__init__", METHOD, "self, model, ...", "x")) is None
    assert check(Use(GRPO, "__init__", METHOD, "self, reward_funcs, ...", "x")) is not None


# ---------------------------------------------------------------------------------------------------------------
# Completeness: what the package really uses
# ---------------------------------------------------------------------------------------------------------------

def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _external(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in EXTERNAL


def _owner_of(cls, name: str):
    """`(the TRL/transformers class that cls subclasses, kind)` if one of the TRL/transformers classes in `cls`'s MRO
    defines `name` (a method or class attribute, else an instance attribute its source sets); `(None, None)` if none.
    The owner is the class OR1 subclasses (GRPOTrainer, not the base that happens to define the name today), so a
    method moving between TRL's own classes changes nothing here."""
    bases = [b for b in cls.__mro__ if _external(b)]
    for base in bases:
        if name in vars(base):
            value = vars(base)[name]
            kind = METHOD if callable(value) or isinstance(value, (staticmethod, classmethod)) else CLASS_ATTRIBUTE
            if isinstance(value, property):
                kind = ATTRIBUTE
            return bases[0], kind
    for base in bases:
        if name in _assigned(base):
            return bases[0], ATTRIBUTE
    return None, None


def _defined_by_trl(cls, name: str) -> bool:
    """`name` is a method TRL itself defines for `cls` (not transformers' public `Trainer` API)."""
    return any(name in vars(b) and b.__module__.startswith("trl.") for b in cls.__mro__ if _external(b))


def _public_path(obj) -> str:
    """How the table spells a class or module: the shortest of `trl.X` / `transformers.X` if exported there."""
    if inspect.ismodule(obj):
        return obj.__name__
    top = importlib.import_module(obj.__module__.split(".")[0])
    if getattr(top, obj.__name__, None) is obj:
        return f"{top.__name__}.{obj.__name__}"
    return f"{obj.__module__}.{obj.__name__}"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if any(part in SKIPPED for part in rel.parts):
            continue
        name = ".".join(rel.with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def _imports_external(tree) -> bool:
    """Whether the file imports TRL or transformers anywhere (a module that does not cannot hook them)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in EXTERNAL for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in EXTERNAL:
            return True
    return False


def _module_aliases(tree) -> tuple[dict[str, str], list[tuple[str, str, int]]]:
    """`{local name: TRL/transformers module}` bound anywhere in the file, and the names imported from such modules
    that their top-level package does not export: `[(module, name, line)]`."""
    aliases, private_imports = {}, []

    def bind(local: str, module: str) -> None:
        top, _, short = module.rpartition(".")
        exported = getattr(importlib.import_module(module.split(".")[0]), short, None)
        if exported is not importlib.import_module(module) or module.count(".") == 1:  # `transformers.logging`: public
            aliases[local] = module

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in EXTERNAL and alias.asname:
                    bind(alias.asname, alias.name)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in EXTERNAL:
            top = importlib.import_module(node.module.split(".")[0])
            for alias in node.names:
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                    bind(alias.asname or alias.name, f"{node.module}.{alias.name}")
                    continue
                except ImportError:
                    pass
                if node.module.count(".") and getattr(top, alias.name, None) is not getattr(
                        importlib.import_module(node.module), alias.name, None):
                    private_imports.append((node.module, alias.name, node.lineno))
    return aliases, private_imports


def _class_node(cls) -> tuple[pathlib.Path, ast.ClassDef]:
    """The file and the `ast` node of a package class (top-level or nested)."""
    path = pathlib.Path(inspect.getsourcefile(cls))
    tree = ast.parse(path.read_text(), str(path))
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    return path, next(n for n in nodes if n.lineno == inspect.getsourcelines(cls)[1] or len(nodes) == 1)


def _scan_class(add, cls, defining, node, path) -> None:
    """The uses in class `defining` (`node`: its `ast`), a package class in the MRO of `cls`, which derives from a
    TRL/transformers class (`defining` is `cls` itself, or a package mixin of it)."""
    name = defining.__name__
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner, kind = _owner_of(cls, item.name)
            if owner is not None:
                is_property = any(isinstance(d, ast.Name) and d.id == "property" or
                                  isinstance(d, ast.Attribute) and d.attr == "setter" for d in item.decorator_list)
                add(owner, item.name, ATTRIBUTE if is_property and kind == ATTRIBUTE else kind, path, item,
                    f"{name} overrides it")
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                if isinstance(target, ast.Name) and target.id.startswith("_"):
                    owner, kind = _owner_of(cls, target.id)
                    if owner is not None:
                        add(owner, target.id, kind, path, item, f"{name} sets it")
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Attribute):
            continue
        if _is_super(sub.value):
            owner, kind = _owner_of(cls, sub.attr)
            if owner is not None:
                add(owner, sub.attr, kind, path, sub, f"{name} calls super().{sub.attr}")
        elif _is_self(sub.value):
            owner, kind = _owner_of(cls, sub.attr)
            if owner is None:
                continue
            if sub.attr.startswith("_") and not sub.attr.startswith("__"):
                add(owner, sub.attr, kind, path, sub, f"{name} uses self.{sub.attr}")
            elif kind == METHOD and _defined_by_trl(cls, sub.attr):
                add(owner, sub.attr, kind, path, sub, f"{name} calls self.{sub.attr}")
            elif isinstance(sub.ctx, ast.Store) and kind == ATTRIBUTE:
                add(owner, sub.attr, kind, path, sub, f"{name} writes self.{sub.attr}")


def _is_super(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def find_uses() -> dict[tuple[str, str, str], list[str]]:
    """`{(owner, name, kind): ["or1_trl/file.py:line how", ...]}` for every TRL/transformers name the package hooks."""
    found: dict[tuple[str, str, str], list[str]] = {}

    def add(owner, name, kind, path, node, how):
        owner_path = owner if isinstance(owner, str) else _public_path(owner)
        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {how}"
        found.setdefault((owner_path, name, kind), [])
        if where not in found[(owner_path, name, kind)]:
            found[(owner_path, name, kind)].append(where)

    trees = {path: ast.parse(path.read_text(), str(path)) for _, path in _modules()}
    derived = []  # package classes deriving from a TRL/transformers class
    for module_name, path in _modules():
        if _imports_external(trees[path]):  # others cannot subclass them (e.g. stand-alone worker/driver files)
            module = importlib.import_module(module_name)
            derived += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module_name
                        and any(_external(b) for b in c.__mro__[1:])]

    # 1. In those classes and in the package mixins they inherit: overrides, super() calls, self._private, writes.
    for cls in derived:
        for defining in cls.__mro__:
            if defining.__module__.split(".")[0] == PACKAGE.name:
                path, node = _class_node(defining)
                _scan_class(add, cls, defining, node, path)

    # 2. Anywhere: `x._name` for a private name of a TRL/transformers class the package subclasses (`trainer._metrics`
    #    in a helper module, `self.vllm_generation._iter_named_params`), and TRL/transformers module globals.
    private = {}
    for base in sorted({c.__mro__[1] for c in derived if _external(c.__mro__[1])}, key=lambda c: c.__qualname__):
        for name in set(vars(base)) | _assigned(base):
            if name.startswith("_") and not name.startswith("__"):
                private.setdefault(name, base)
    for path, tree in trees.items():
        aliases, private_imports = _module_aliases(tree) if _imports_external(tree) else ({}, [])
        for module, name, line in private_imports:
            add(module, name, GLOBAL, path, ast.Pass(lineno=line), "imports it")
        for sub in ast.walk(tree):
            if isinstance(sub, ast.Attribute):
                value = sub.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    add(aliases[value.id], sub.attr, GLOBAL, path, sub, f"uses {value.id}.{sub.attr}")
                elif sub.attr in private and not _is_self(value) and not _is_super(value):
                    owner, kind = _owner_of(private[sub.attr], sub.attr)
                    add(owner, sub.attr, kind, path, sub, f"uses .{sub.attr}")
            elif isinstance(sub, ast.Call) and len(sub.args) >= 2:
                first, second = sub.args[0], sub.args[1]
                if (isinstance(first, ast.Name) and first.id in aliases and isinstance(second, ast.Constant)
                        and isinstance(second.value, str)):
                    add(aliases[first.id], second.value, GLOBAL, path, sub,
                        f"swaps it by name ({first.id}, {second.value!r})")
    return found


def _key(use: Use) -> tuple[str, str, str]:
    owner = _resolve(use.owner)
    return _public_path(owner), use.name, use.kind


def test_contract_table_is_complete():
    uses = find_uses()
    table = {_key(use): use for use in CONTRACT}
    missing = {key: where for key, where in uses.items() if key not in table}
    stale = [use for key, use in table.items() if key not in uses and use.scanned]
    lines = [f"  missing: Use({owner!r}, {name!r}, {kind!r}, ...)  # {'; '.join(where[:3])}"
             for (owner, name, kind), where in sorted(missing.items())]
    lines += [f"  no longer used by or1_trl: Use({use.owner!r}, {use.name!r}, {use.kind!r}): remove it" for use in stale]
    assert not lines, (f"tests/test_trl_contract.py CONTRACT is out of date ({_versions()}); every private TRL/"
                       "transformers name or1_trl uses must be listed (with the parameters it relies on):\n"
                       + "\n".join(lines))


def test_the_scan_sees_overrides_super_calls_private_state_and_swaps():
    """The completeness scan is not vacuous: it finds each kind of use in the package as it is."""
    uses = find_uses()
    assert (GRPO, "_compute_loss", METHOD) in uses
    assert any("calls super()._compute_loss" in w for w in uses[(GRPO, "_compute_loss", METHOD)])
    assert (GRPO, "_metrics", ATTRIBUTE) in uses
    assert (VLLM_GENERATION, "_iter_named_params", METHOD) in uses
    assert ("trl.trainer.grpo_trainer", "VLLMGeneration", GLOBAL) in uses


# ---------------------------------------------------------------------------------------------------------------
# Where OR1 re-states TRL: pinned to TRL's own output on the same batch, OR1's parts switched off
# ---------------------------------------------------------------------------------------------------------------
# OR1's loss path (`OR1Trainer._compute_loss` with `rejection_sampling` on) runs TRL's `_compute_loss` on the kept
# tokens and then re-states three pieces of TRL: the micro-step's share of the step's counts (TRL's "dapo"
# normaliser, re-used for T_k and, for the row-mean loss types, the rescaling of TRL's row count to the kept rows:
# `loss.share`, `loss.Normaliser`); the per-loss-type aggregation of a per-token value (`Normaliser.__call__`, which
# aggregates the entropy term like the policy term); TRL's 80/20 high-entropy mask, recomputed for the "selected"
# normaliser; and the entropy measurement e_k of the controller (TRL's window over the step's tokens). Each is pinned
# here to what TRL computes itself.

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
OR1_NEUTRAL = dict(rejection_sampling="mask", use_adaptive_entropy=False, entropy_coef=0.0, logprob_backend="trl",
                   rollout_correction="trl")
ROWS, PROMPT, LENGTH = 8, 5, 6  # one micro-batch: 2 groups of 4, prompt and completion lengths


def _trainers(tmp_path, or1_only=None, model_factory=None, **config):
    """`(OR1Trainer on OR1's loss path with nothing rejected and α = 0, GRPOTrainer)`: same weights, same settings
    (`or1_only`: OR1Config fields GRPOConfig does not have; `model_factory(tokenizer)`: another tiny model)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": ["Q: 1+1=? A:"] * 8})
    or1_args = OR1Config(**tiny_training_args(tmp_path / "or1", **{**OR1_NEUTRAL, **config, **(or1_only or {})}))
    same = {name: value for name, value, _ in or1_args.changed_defaults()}  # OR1's other defaults, given to TRL too
    trl_args = GRPOConfig(**tiny_training_args(tmp_path / "trl", **{**same, **config}))
    trainers = []
    for cls, args in ((OR1Trainer, or1_args), (GRPOTrainer, trl_args)):
        model, tokenizer = tiny_model_and_tokenizer(seed=0)
        if model_factory is not None:
            model = model_factory(tokenizer)
        trainer = cls(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # as the training loop sets it
        trainer.model.train()
        trainers.append(trainer)
    return trainers


def _batch(trainer, num_items_scale: int = 1):
    """One micro-batch of ROWS rows with right padding, advantages of both signs, old log-probs away from the policy
    (ρ ≠ 1: clipping is exercised). `num_items_in_batch` counts the generation batch's tokens: the micro-batch's
    times `num_items_scale` (its share when the batch is split into that many micro-steps)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(5, vocab, (ROWS, PROMPT), generator=g)
    completion_ids = torch.randint(5, vocab, (ROWS, LENGTH), generator=g)
    lengths = torch.tensor([6, 3, 5, 6, 1, 4, 6, 2])
    completion_mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()  # [b, T]
    batch = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.4, 0.7, -1.5, 0.3, -0.9, 1.1, -0.2]),
        "num_items_in_batch": completion_mask.sum() * num_items_scale,
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([batch["prompt_mask"], completion_mask], 1), LENGTH)
    batch["old_per_token_logps"] = logps + 0.3 * torch.randn(ROWS, LENGTH, generator=g)
    return batch


def _or1_inputs(batch, generation_rows: int):
    """What OR1's rollout adds to a batch in which nothing was rejected (`rejection_sampling="mask"`)."""
    import torch

    from or1_trl.recipe.rejection import WEIGHT_KEY
    from or1_trl.trainer.or1_trainer import KEPT_GROUP_ROWS_KEY, KEPT_ROWS_KEY

    rows = torch.tensor(float(generation_rows))
    return {**batch, WEIGHT_KEY: torch.ones(ROWS), KEPT_GROUP_ROWS_KEY: rows, KEPT_ROWS_KEY: rows}


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_or1_loss_path_is_trls_loss_for_every_loss_type(tmp_path, loss_type):
    """OR1's normaliser (the micro-step's share of T_k, the kept-row rescaling of the row means) against TRL's own
    loss, with 2 accumulation steps and 2 micro-steps per rollout, on the same batch: same loss, same gradient."""
    import torch

    or1, trl_trainer = _trainers(tmp_path, loss_type=loss_type, gradient_accumulation_steps=2, steps_per_generation=2)
    batch = _batch(trl_trainer, num_items_scale=2)
    expected, expected_grads = _loss_and_grads(trl_trainer, batch)
    loss, grads = _loss_and_grads(or1, _or1_inputs(batch, generation_rows=2 * ROWS))
    assert abs(expected.item()) > 1e-4, "degenerate batch"
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7), (
        f"TRL {trl.__version__}: OR1's {loss_type} loss path re-states TRL's normaliser and no longer matches it")
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-7, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_normaliser_aggregates_like_trls_loss_type(tmp_path, loss_type):
    """`loss.Normaliser` aggregates a per-token value as TRL's `loss_type` aggregates its per-token loss (it is how
    OR1 normalises α·H like the policy term). With ρ = 1 (old log-probs = the policy's) TRL's PPO-clip loss per token
    is −A·ρ, so TRL's loss is its aggregation of −A·ρ: Normaliser(−A·ρ) must give the same value and gradient."""
    import torch

    from or1_trl.recipe.loss import Normaliser

    _, trl_trainer = _trainers(tmp_path, loss_type=loss_type, gradient_accumulation_steps=2, steps_per_generation=2)
    batch = {k: v for k, v in _batch(trl_trainer, num_items_scale=2).items() if k != "old_per_token_logps"}
    expected, expected_grads = _loss_and_grads(trl_trainer, batch)

    trl_trainer.model.zero_grad()
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logps, _, _ = trl_trainer._get_per_token_logps_and_entropies(trl_trainer.model, input_ids, attention_mask, LENGTH)
    ratio = torch.exp(logps - logps.detach())  # [b, T], 1 with the gradient of log π
    mask = batch["completion_mask"].float()
    norm = Normaliser.for_micro_step(loss_type, batch["num_items_in_batch"], None, ROWS, 1,
                                     trl_trainer.current_gradient_accumulation_steps,
                                     trl_trainer.args.steps_per_generation, trl_trainer.max_completion_length)
    ours = norm(-batch["advantages"][:, None] * ratio, mask)
    ours.backward()
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    for name, p in trl_trainer.model.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], atol=1e-7, rtol=1e-5, msg=name)


def test_selected_tokens_are_trls_high_entropy_mask(tmp_path):
    """80/20 with `top_entropy_normalization="selected"` recomputes TRL's high-entropy mask to count the selected
    tokens. One micro-step, nothing rejected: OR1's loss is TRL's ("dapo", policy term on TRL's mask, over T_k)
    rescaled by T_k / |selected|, where |selected| is what TRL's own `get_high_entropy_mask` selects on the entropies
    TRL computes for this batch."""
    import torch

    or1, trl_trainer = _trainers(tmp_path, top_entropy_quantile=0.2, or1_only=dict(top_entropy_normalization="selected"))
    batch = _batch(trl_trainer)
    expected = trl_trainer._compute_loss(trl_trainer.model, batch).detach()
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        _, entropies, _ = trl_trainer._get_per_token_logps_and_entropies(
            trl_trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), LENGTH, compute_entropy=True)
    selected = (mask * trl_trainer.get_high_entropy_mask(entropies, mask, 1 - 0.2)).sum()
    assert 0 < selected < mask.sum()
    loss = or1._compute_loss(or1.model, _or1_inputs(batch, generation_rows=ROWS)).detach()
    assert loss.item() == pytest.approx((expected * mask.sum() / selected).item(), rel=1e-6)


def test_controller_measures_the_entropy_trls_controller_measures(tmp_path):
    """e_k of eq. 3.2 (OR1's window over the step's kept tokens) is the entropy TRL's own adaptive controller measures
    over the same tokens (`_last_world_entropy`), with 2 accumulation steps: the window spans both micro-steps."""
    import torch

    or1, trl_trainer = _trainers(tmp_path, use_adaptive_entropy=True, entropy_target=0.2, gradient_accumulation_steps=2,
                                 steps_per_generation=2)
    assert or1.args.use_adaptive_entropy and trl_trainer.use_adaptive_entropy
    batch = _batch(trl_trainer, num_items_scale=2)
    second = {**batch, "completion_ids": batch["completion_ids"].flip(0), "completion_mask": batch["completion_mask"].flip(0)}
    for trainer, inputs in ((trl_trainer, [batch, second]), (or1, [_or1_inputs(b, 2 * ROWS) for b in (batch, second)])):
        for index, micro in enumerate(inputs):
            trainer.accelerator.gradient_state._set_sync_gradients(index == len(inputs) - 1)
            with torch.no_grad():
                trainer._compute_loss(trainer.model, micro)
    measured = or1._metrics["train"]["entropy/measured"]
    assert len(measured) == 1
    assert measured[0] == pytest.approx(trl_trainer._last_world_entropy, rel=1e-6)


def _tiny_moe(tokenizer):
    """A tiny Qwen2-MoE (4 experts, 2 per token) that returns its router logits: TRL adds the load-balancing loss."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, output_router_logits=True, router_aux_loss_coef=0.05,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2MoeForCausalLM(config)


def test_aux_loss_is_added_as_trl_adds_it(tmp_path):
    """OR1 rescales TRL's policy term (here the row mean of "grpo" over the 4 kept rows of 8) but not TRL's MoE
    load-balancing term: it takes `router_aux_loss_coef · aux / accumulation` out of TRL's loss before rescaling and
    adds it back after. Pinned: switching the aux loss on adds exactly what it adds to TRL's loss on the same batch."""
    import torch

    from or1_trl.recipe.rejection import WEIGHT_KEY
    from or1_trl.trainer.or1_trainer import KEPT_GROUP_ROWS_KEY, KEPT_ROWS_KEY

    or1, trl_trainer = _trainers(tmp_path, loss_type="grpo", gradient_accumulation_steps=2, model_factory=_tiny_moe)
    assert or1.aux_loss_enabled and trl_trainer.aux_loss_enabled
    batch = _batch(trl_trainer)
    kept = torch.tensor(4.0)
    or1_inputs = {**batch, WEIGHT_KEY: torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0]), KEPT_GROUP_ROWS_KEY: kept,
                  KEPT_ROWS_KEY: kept}

    def with_and_without_aux(trainer, inputs):
        losses = []
        for enabled in (True, False):
            trainer.aux_loss_enabled = enabled
            with torch.no_grad():
                losses.append(trainer._compute_loss(trainer.model, inputs).item())
        return losses

    trl_on, trl_off = with_and_without_aux(trl_trainer, batch)
    or1_on, or1_off = with_and_without_aux(or1, or1_inputs)
    assert abs(trl_on - trl_off) > 1e-4, "the batch has no aux loss to pin"
    assert or1_on - or1_off == pytest.approx(trl_on - trl_off, rel=1e-5, abs=1e-8)


def _position_reward(values: dict):
    """A reward function scoring sample i of prompt p as `values[p][i % 4]` (None: abstains)."""

    def reward(prompts, completions, **kwargs):
        return [values[prompt.split(":")[0]][i % 4] for i, prompt in enumerate(prompts)]

    return reward


def test_rejection_reads_the_rewards_trl_normalises(tmp_path):
    """Rejection sampling re-states how TRL turns the reward functions' outputs into one reward per sample (weighted,
    NaN-ignoring sum: `sum_then_normalize`). Pinned to TRL's own verdict on the same rollout: the groups OR1 rejects
    are those TRL gives zero reward std (`frac_reward_zero_std`, logged by TRL's `_generate_and_score_completions`).
    Group P0 is constant only with the weights (1·[1,0,1,0] + 2·[0,.5,0,.5]); group P1 ([0,0,1,0]) is informative only
    with B's abstentions (None) left out of the sum as TRL leaves them out (a plain sum leaves one scored sample)."""
    from datasets import Dataset

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

    a = _position_reward({"P0": [1.0, 0.0, 1.0, 0.0], "P1": [0.0, 0.0, 0.0, 0.0]})
    b = _position_reward({"P0": [0.0, 0.5, 0.0, 0.5], "P1": [None, None, 0.5, None]})
    a.__name__, b.__name__ = "a", "b"
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(tmp_path, reward_weights=[1.0, 2.0], **OR1_NEUTRAL))
    trainer = OR1Trainer(model, [a, b], args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"prompt": ["P0: 1+1=? A:", "P1: 2+2=? A:"]}))
    trainer.model.train()
    trainer._generate_and_score_completions([trainer.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)])
    metrics = trainer._metrics["train"]
    assert metrics["frac_reward_zero_std"] == [0.5]  # TRL: P0's group has zero std, P1's does not
    assert metrics["rejection/kept_group_frac"] == [0.5]
    assert metrics["rejection/solve_all_frac"] == [0.5]  # P0: every sample scores 1 (weighted)


def test_per_prompt_truncation_and_length_are_trls(tmp_path, answer_model_dir):
    """The per-prompt statistics re-state TRL's truncation rule (the last token is neither EOS nor padding) and its
    completion lengths. Pinned on one rollout of the tiny answer model, whose completions end with `<|im_end|>` when
    they fit: the truncated share and the mean length OR1 records are TRL's `completions/clipped_ratio` and
    `completions/mean_length` of the same rollout."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from or1_trl import OR1Config, OR1Trainer
    from or1_trl.testing import tiny_training_args

    def reward(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Q: {a}+{a}=? A:"}] for a in (3, 7)]})
    args = OR1Config(**tiny_training_args(tmp_path, max_completion_length=6, temperature=1.0, **OR1_NEUTRAL))
    trainer = OR1Trainer(AutoModelForCausalLM.from_pretrained(answer_model_dir), reward, args=args,
                         train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(answer_model_dir))
    trainer.model.train()
    trainer._generate_and_score_completions([trainer.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)])
    outcomes = list(trainer.prompt_stats.stage(0).values())
    samples = sum(o.samples for o in outcomes)
    metrics = trainer._metrics["train"]
    assert samples == 8
    assert 0 < metrics["completions/clipped_ratio"][0] < 1, "the rollout should mix finished and truncated samples"
    assert sum(o.truncated for o in outcomes) / samples == pytest.approx(metrics["completions/clipped_ratio"][0])
    assert sum(o.length_sum for o in outcomes) / samples == pytest.approx(metrics["completions/mean_length"][0])


class _StagesMixin:  # a package mixin, as the trainer may be split into: the scan follows OR1Trainer's MRO into it
    def _get_train_sampler(self, dataset=None):
        self._step = 0
        return super()._get_train_sampler(dataset)


def test_the_scan_follows_mixins():
    from trl import GRPOTrainer

    class Probe(_StagesMixin, GRPOTrainer):
        pass

    found = {}
    path, node = _class_node(_StagesMixin)
    _scan_class(lambda owner, name, kind, *rest: found.setdefault((_public_path(owner), name, kind), rest[-1]),
                Probe, _StagesMixin, node, path)
    assert found == {(GRPO, "_get_train_sampler", METHOD): "_StagesMixin overrides it",
                     (GRPO, "_step", ATTRIBUTE): "_StagesMixin uses self._step"}
