"""`logprob_backend` (`or1_trl/trainer/logprobs.py`): Liger's log-prob/entropy head against a plain computation and against
TRL's fused head.

At fp32 on CPU both backends give the same log-probs, entropies, loss, gradient, update and logged metrics within
float tolerance: with temperature scaling, the 80/20 mask, padding, LoRA, a compacted batch, the old-policy pass and
a reference model.
"""

import inspect

import pytest
import torch
import trl.trainer.utils as trl_utils
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import add_fused_lm_head

from or1_trl import OR1Config, OR1Trainer
from or1_trl.trainer.logprobs import LigerLogProbFunction, liger_logps_and_entropy, resolve_logprob_backend, use_liger_head
from or1_trl.testing import save_tiny_model, tiny_model, tiny_model_and_tokenizer, tiny_tokenizer, tiny_training_args

from ..helpers import fixed_batch
from ..helpers import ScriptedReward, logged, tagged_dataset

LIGER_NODE, TRL_NODE = "_FusedLinearPPOFallbackFunctionBackward", "ChunkedLogProbFunctionBackward"
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def reference(hidden, weight, labels, temperature):
    """Plain PyTorch: `[N, V]` logits / τ, log-softmax, the label's log-prob and the entropy."""
    log_probs = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)  # [N, V]
    return log_probs.gather(-1, labels[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


def autograd_nodes(tensor):
    """Names of the autograd nodes that `tensor` was computed through."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def grads_of(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


# ------------------------------------------------------------------------------------------------------------
# The pure function and the kernel swap
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens_per_call", [None, 3])
def test_liger_function_equals_log_softmax_with_temperature(tokens_per_call):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (10,), generator=g)
    up_logps, up_entropy = torch.randn(10, generator=g), torch.randn(10, generator=g)  # arbitrary upstream gradients
    logps, entropy = liger_logps_and_entropy(hidden, weight, labels, 0.7, tokens_per_call=tokens_per_call)
    ref_logps, ref_entropy = reference(hidden, weight, labels, 0.7)
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    ours = grads_of((up_logps * logps).sum() + (up_entropy * entropy).sum(), hidden, weight)
    expected = grads_of((up_logps * ref_logps).sum() + (up_entropy * ref_entropy).sum(), hidden, weight)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert LIGER_NODE in autograd_nodes(logps)

    only_logps, none = liger_logps_and_entropy(hidden, weight, labels, 0.7, compute_entropy=False)
    assert none is None
    torch.testing.assert_close(only_logps, ref_logps, atol=1e-5, rtol=1e-5)


def test_liger_function_with_nothing_to_score_still_reaches_the_weight():
    hidden, weight = torch.randn(0, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    logps, entropy = liger_logps_and_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert logps.shape == entropy.shape == (0,)
    (grad_weight,) = grads_of(logps.sum() + entropy.sum(), weight)
    assert torch.equal(grad_weight, torch.zeros_like(weight))


def test_stand_in_for_trl_kernel_folds_the_logit_scale_and_refuses_what_liger_lacks():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (6,), generator=g)
    logps, entropy, *rest = LigerLogProbFunction.apply(hidden, weight, None, labels, 0.7, 32768, None, 2.0,
                                                       ("log_probs", "entropy"))
    ref_logps, ref_entropy = reference(2.0 * hidden, weight, labels, 0.7)  # logits·s/τ
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert rest == [None, None, None]
    for bias, softcap, outputs in [(torch.zeros(30), None, ("log_probs",)), (None, 30.0, ("log_probs",)),
                                   (None, None, ("log_probs", "is_top1"))]:
        with pytest.raises(ValueError, match="logprob_backend='liger' cannot score this model"):
            LigerLogProbFunction.apply(hidden, weight, bias, labels, 1.0, 32768, softcap, 1.0, outputs)


def test_liger_head_is_bound_to_one_model_only(tiny):
    """`use_liger_head` makes one model's TRL fused head (temperature 0.7, prompt and padding labels -100) compute
    with Liger; a second model patched by TRL in the same process keeps TRL's kernel, and TRL's module globals are
    never touched. Both equal the log-softmax of the model's own logits; `generate` still sees the model's signature."""
    model, _ = tiny
    other = tiny_model(seed=0)
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(5, model.config.vocab_size, (3, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding
    attention_mask[2, -3:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :4] = -100  # the prompt is not scored
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # [3, 8, V]
    for m in (model, other):
        add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy"))
    scored = labels[:, 1:] != -100  # [3, 8]
    ref_logps, ref_entropy = reference(logits[scored], torch.eye(logits.size(-1)), labels[:, 1:][scored], 0.7)

    use_liger_head(model)
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction  # nothing process-wide changed
    liger = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    trl = other(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    for out, node in ((liger, LIGER_NODE), (trl, TRL_NODE)):
        torch.testing.assert_close(out.log_probs[scored], ref_logps, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.entropy[scored], ref_entropy, atol=1e-5, rtol=1e-5)
        assert not out.log_probs[~scored].any() and not out.entropy[~scored].any()
        assert node in autograd_nodes(out.log_probs)
    assert TRL_NODE not in autograd_nodes(liger.log_probs)
    assert inspect.signature(model.forward) == inspect.signature(other.forward)
    with pytest.raises(TypeError, match="needs TRL's fused LM head"):
        use_liger_head(tiny_model(seed=0))


def test_two_trainers_in_one_process_keep_their_own_backend(tmp_path):
    """A Liger trainer and a TRL trainer built in one process: each one's policy pass runs its own kernel."""
    trainers = {backend: trainer_with(backend, tmp_path) for backend in ("liger", "trl")}
    g = torch.Generator().manual_seed(4)
    input_ids = torch.randint(5, 100, (2, 8), generator=g)
    for backend, node, absent in (("liger", LIGER_NODE, TRL_NODE), ("trl", TRL_NODE, LIGER_NODE)):
        trainer = trainers[backend]
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, torch.ones_like(input_ids),
                                                                 4, compute_entropy=True)
        nodes = autograd_nodes(logps)
        assert node in nodes and absent not in nodes, backend


# ------------------------------------------------------------------------------------------------------------
# Choosing the backend
# ------------------------------------------------------------------------------------------------------------


def test_auto_takes_liger_on_cpu_and_trl_on_gpus(tiny):
    model, _ = tiny
    assert resolve_logprob_backend("auto", model, torch.device("cpu"))[0] == "liger"
    backend, why = resolve_logprob_backend("auto", model, torch.device("cuda"))
    assert backend == "trl" and "not measured" in why
    assert resolve_logprob_backend("trl", model, torch.device("cpu"))[0] == "trl"
    assert resolve_logprob_backend("liger", model, torch.device("cpu"))[0] == "liger"


@pytest.mark.parametrize("change,reason", [("bias", "LM head has a bias"), ("softcap", "softcaps its logits")])
def test_models_liger_cannot_score_get_trl_or_an_error(tiny, change, reason):
    model, _ = tiny
    if change == "bias":
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    else:
        model.config.final_logit_softcapping = 30.0
    backend, why = resolve_logprob_backend("auto", model, torch.device("cpu"))
    assert backend == "trl" and reason in why
    with pytest.raises(ValueError, match=f"logprob_backend='liger' cannot run here: .*{reason}"):
        resolve_logprob_backend("liger", model, torch.device("cpu"))


def test_config_refuses_unknown_backend_and_liger_layer_kernels_on_cpu(tmp_path):
    with pytest.raises(ValueError, match=r"logprob_backend='fast' is not one of \['auto', 'trl', 'liger'\]"):
        OR1Config(**tiny_training_args(tmp_path, logprob_backend="fast"))
    with pytest.raises(ValueError, match="use_liger_kernel=True runs Liger's layer kernels .* CUDA GPUs only"):
        OR1Config(**tiny_training_args(tmp_path, use_liger_kernel=True))
    assert OR1Config(**tiny_training_args(tmp_path)).logprob_backend == "auto"


def test_trainer_refuses_liger_layer_kernels_on_cpu_before_loading_the_model(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(**tiny_training_args(tmp_path))
    args.use_liger_kernel = True  # a config built elsewhere (TrainingArguments does not check the device)
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        OR1Trainer("no/such-model", lambda completions, **kw: [0.0] * len(completions), args=args,
                   train_dataset=tagged_dataset(["MIX"] * 4))


# ------------------------------------------------------------------------------------------------------------
# The two backends in the trainer
# ------------------------------------------------------------------------------------------------------------


def trainer_with(backend, tmp_path, peft=False, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    args = OR1Config(**tiny_training_args(tmp_path / backend, logprob_backend=backend, **overrides))
    trainer = OR1Trainer(model, ScriptedReward(), args=args, train_dataset=tagged_dataset(["MIX"] * 8),
                         processing_class=tokenizer, peft_config=peft_config)
    assert trainer.logprob_backend == backend
    return trainer


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_backends_agree_on_a_fixed_batch(tmp_path, peft):
    """Log-probs, entropies, loss, gradient and metrics of one micro-batch: temperature 0.7, the 80/20 mask with the
    "selected" normaliser, α > 0, left- and right-padding, a rejected group (weight 0)."""
    results = {}
    for backend in ("trl", "liger"):
        trainer = trainer_with(backend, tmp_path, peft, temperature=0.7, top_entropy_quantile=0.2,
                               top_entropy_normalization="selected", rejection_sampling="mask")
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        trainer.entropy_controller.coef, trainer.entropy_controller.last_entropy = 0.05, 0.0  # α = 0.05
        batch = fixed_batch(trainer.model, trainer.model.config.vocab_size)
        batch["prompt_mask"][[1, 5], :2] = 0  # left-padded prompts
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1), compute_entropy=True
        )
        loss = trainer._compute_loss(trainer.model, batch)
        params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        results[backend] = (logps, entropies, loss, grads, metrics)
        assert (LIGER_NODE if backend == "liger" else TRL_NODE) in autograd_nodes(logps)

    (logps, entropies, loss, grads, metrics), liger = results["trl"], results["liger"]
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(liger[0][mask], logps[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(liger[1][mask], entropies[mask], atol=1e-5, rtol=1e-5)
    assert abs(loss.item()) > 1e-3 and liger[2].item() == pytest.approx(loss.item(), abs=1e-6)
    assert grads.keys() == liger[3].keys() and (not peft or all("lora" in name for name in grads))
    for name, grad in grads.items():
        torch.testing.assert_close(liger[3][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert metrics.keys() == liger[4].keys()
    for key, value in metrics.items():
        assert liger[4][key] == pytest.approx(value, abs=1e-6), key


def train_one_step(backend, tmp_path, model=None, **overrides):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=0) if model is None else model
    args = OR1Config(**tiny_training_args(tmp_path / backend, logprob_backend=backend, optim="sgd", learning_rate=0.5,
                                          **overrides))
    dataset = tagged_dataset(["MIX", "ALL", "NONE", "MIX"])  # a rollout of 2 micro-steps × 8 rows draws all 4
    trainer = OR1Trainer(model, ScriptedReward(), args=args, train_dataset=dataset, processing_class=tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, before


def assert_same_training(tmp_path, min_update=1e-3, model=None, **overrides):
    """Both backends train from the same weights and seed: same update (plain SGD, so the update is the gradient)
    and the same logged metrics."""
    (trl, before), (liger, _) = (train_one_step(backend, tmp_path, model, **overrides) for backend in ("trl", "liger"))
    moved = 0.0
    for (name, p_trl), (_, p_liger) in zip(trl.model.named_parameters(), liger.model.named_parameters()):
        torch.testing.assert_close(p_liger, p_trl, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, (p_trl - before[name]).abs().max().item())
    assert moved > min_update
    for entry_trl, entry_liger in zip(trl.state.log_history, liger.state.log_history, strict=True):
        assert entry_trl.keys() == entry_liger.keys()
        for key in {k for k in entry_trl.keys() - TIMINGS if not k.startswith("time/")}:  # wall clocks differ
            if entry_trl[key] is None:  # nothing measured (e.g. no non-truncated sample): the same on both
                assert entry_liger[key] is None, key
            else:
                assert entry_liger[key] == pytest.approx(entry_trl[key], abs=1e-5, rel=1e-5), key
    return trl, liger


def test_backends_agree_on_a_training_step_with_a_compacted_batch(tmp_path):
    """One OR1 step: rejection compacts away the constant groups (ALL/NONE), temperature 0.7, the 80/20 mask, a fixed
    entropy bonus, two micro-steps."""
    trl, liger = assert_same_training(
        tmp_path, max_steps=1, temperature=0.7, top_entropy_quantile=0.2, use_adaptive_entropy=False, entropy_coef=0.02,
        gradient_accumulation_steps=2,
    )
    assert logged(trl, "rejection/kept_group_frac") == [0.5]  # ALL and NONE left the batch
    assert trl.or1_rows_forwarded == liger.or1_rows_forwarded == 8  # the 2 informative groups of 4 rows


def test_backends_agree_with_old_policy_and_reference_passes(tmp_path):
    """TRL's loss with a KL term (every OR1 feature off, beta > 0): a reference model (log-probs only) and, with two
    iterations per rollout, the old-policy pass both go through the backend."""
    path = save_tiny_model(tmp_path / "model")
    trl, _ = assert_same_training(
        tmp_path, min_update=1e-4, model=path, max_steps=2, beta=0.04, num_iterations=2, temperature=0.7,
        rejection_sampling="off", use_adaptive_entropy=False, entropy_coef=0.0,
    )
    assert trl.ref_model is not None and len(logged(trl, "kl")) == 2 and logged(trl, "kl")[1] > 0


@pytest.mark.parametrize("backend", ["trl", "liger"])
def test_stage_temperature_reaches_the_backend(tmp_path, backend):
    """A stage with another temperature re-patches TRL's head (`_enter_stage`); both backends then score at it."""
    stages = [{"until_step": 1, "temperature": 1.0}, {"until_step": 2, "temperature": 0.5}]
    trainer = trainer_with(backend, tmp_path, stages=stages)
    trainer._enter_stage(1)
    model = trainer.model
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(5, model.config.vocab_size, (2, 8), generator=g)
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, 4,
                                                                         compute_entropy=True)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -5:-1]  # [2, 4, V]
    vocab = logits.size(-1)
    ref_logps, ref_entropy = reference(logits.reshape(-1, vocab), torch.eye(vocab), input_ids[:, -4:].reshape(-1), 0.5)
    torch.testing.assert_close(logps.reshape(-1), ref_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies.reshape(-1), ref_entropy, atol=1e-5, rtol=1e-5)
