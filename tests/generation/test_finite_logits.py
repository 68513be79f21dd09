"""`generation/finite_logits.py`: non-finite scores flagged per row and sampled harmlessly, with no host read per
token; `generate` on the tiny model with a NaN planted in one row's logits; vLLM's log-probs as TRL parses them."""

import math

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper
from trl.generation.vllm_client import parse_logprobs

from or1_trl.generation.finite_logits import (
    FiniteLogits,
    NonFiniteLogitsError,
    checked_sampling,
    finite_sampling,
    nonfinite_logprob_rows,
)
from or1_trl.testing import planted_nan_logits

INF = float("inf")


def scores_with_bad_rows(vocab: int = 11):
    """Rows 0 and 4 fine (row 4 with top-k style -inf), row 1 one NaN, row 2 one +inf, row 3 every score -inf."""
    scores = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))  # [5, V]
    scores[1, 3] = math.nan
    scores[2, 7] = INF
    scores[3] = -INF
    scores[4, 5:] = -INF
    return scores


def test_bad_rows_are_flagged_and_sample_the_end_token_others_untouched():
    scores = scores_with_bad_rows()
    processor = FiniteLogits(end_token_id=2)
    out = processor(torch.zeros(5, 1, dtype=torch.long), scores.clone())  # [5, V]
    assert isinstance(processor.flags, torch.Tensor) and processor.flags.dtype == torch.bool
    assert processor.flags.tolist() == [False, True, True, True, False]
    assert torch.equal(out[[0, 4]], scores[[0, 4]])  # the same values, -inf of row 4 included
    one_hot = torch.full((11,), -INF)
    one_hot[2] = 0.0
    assert torch.equal(out[1:4], one_hot.expand(3, -1))
    probs = torch.softmax(out, dim=-1)  # what `generate` samples from: finite, and the bad rows' mass on token 2
    assert torch.isfinite(probs).all() and probs[1:4, 2].tolist() == [1.0, 1.0, 1.0]
    assert torch.multinomial(probs[1:4], 1).flatten().tolist() == [2, 2, 2]


def test_flags_are_or_ed_over_steps_and_uniform_without_an_end_token():
    processor = FiniteLogits()
    first = torch.zeros(3, 4)
    first[0, 1] = math.nan
    out = processor(torch.zeros(3, 1, dtype=torch.long), first)
    assert torch.equal(out, torch.zeros(3, 4))  # row 0: uniform (0 everywhere); rows 1, 2 were 0 already
    second = torch.ones(3, 4)
    second[2, 0] = INF
    processor(torch.zeros(3, 2, dtype=torch.long), second)
    assert processor.bad_rows() == [0, 2]  # row 0 stays flagged although its second step was finite
    assert FiniteLogits().bad_rows() == []  # never called: nothing flagged


def test_the_per_token_path_reads_nothing_on_the_host():
    """On the meta device a tensor holds no data: `.item()`, `bool(tensor)`, `.tolist()` or `.nonzero()` there
    raise. The processor runs there unchanged, so its per-token path never waits for the device (no sync per
    token on CUDA); `bad_rows` is the one read, and it does need the data."""
    processor = FiniteLogits(end_token_id=2)
    for _ in range(3):
        out = processor(torch.zeros(5, 1, dtype=torch.long, device="meta"), torch.empty(5, 11, device="meta"))
        assert out.shape == (5, 11) and out.device.type == "meta"
    assert processor.flags.shape == (5,) and processor.flags.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):
        processor.bad_rows()


def sample(model, input_ids, attention_mask, seed=0):
    config = GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=model.config.eos_token_id,
                              pad_token_id=model.config.pad_token_id, top_k=0)
    torch.manual_seed(seed)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)


def test_generate_with_a_planted_nan_ends_that_row_and_leaves_the_others_as_sampled(tiny):
    """A plain `generate` raises in `torch.multinomial` (a device-side assert on CUDA). Under `finite_sampling` the
    bad row is flagged and samples EOS at that step; every other row's tokens are those of the run without a NaN (the
    random stream is the same: the processor changes no draw)."""
    model, tokenizer = tiny
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.config.eos_token_id, model.config.pad_token_id = eos, pad
    prompts = [tokenizer(f"{i} + {i} = ")["input_ids"] for i in range(4)]
    prompts[2] = prompts[2][:2]  # a short row, left-padded
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [4, P]
    attention_mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    reference = sample(model, input_ids, attention_mask)  # [4, P + 6]

    with planted_nan_logits(model, row=1, step=2), pytest.raises(RuntimeError, match="probability tensor contains"):
        sample(model, input_ids, attention_mask)
    with planted_nan_logits(model, row=1, step=2), finite_sampling(model, end_token_id=eos) as guard:
        assert "generate" in vars(model)
        guarded = sample(model, input_ids, attention_mask)
    assert "generate" not in vars(model)  # the class's method again
    assert guard.bad_rows() == [1]
    assert torch.equal(guarded[[0, 2, 3]], reference[[0, 2, 3]])
    assert torch.equal(guarded[1, : width + 2], reference[1, : width + 2])  # the two tokens before the NaN
    assert guarded[1, width + 2 :].tolist() == [eos] + [pad] * (guarded.size(1) - width - 3)


def test_the_processor_comes_after_the_calls_own():
    """A processor the caller passes runs first, so `FiniteLogits` sees the scores `softmax` will see."""
    model_calls = []

    class Model(torch.nn.Module):
        def generate(self, *args, logits_processor=None, **kwargs):
            model_calls.append(list(logits_processor))

    model, temperature = Model(), TemperatureLogitsWarper(0.5)
    with finite_sampling(model) as guard:
        model.generate(logits_processor=LogitsProcessorList([temperature]))
        model.generate()
    assert model_calls == [[temperature, guard], [guard]]


def test_the_error_is_one_line_naming_where_and_the_rows():
    error = NonFiniteLogitsError("training step 3 (the step was not trained on)", rows=[1, 5], batch_size=8)
    text = str(error)
    assert "\n" not in text and error.rows == [1, 5] and error.batch_size == 8
    assert text.startswith("non-finite logits (NaN/inf) at sampling, training step 3 (the step was not trained on): "
                           "rows [1, 5] of the 8-row batch; ")
    assert "cudnn_sdpa_guard" in text and "learning_rate" in text
    many = str(NonFiniteLogitsError("eval", rows=range(40), batch_size=40))
    assert "rows [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, '... 24 more'] of the 40-row" in many


def test_vllm_logprobs_as_trl_parses_an_answer_holding_a_nan():
    """`/v1/completions` choices as vLLM writes them (`logprobs.token_logprobs`, `top_logprobs`), one holding a NaN
    (as `requests` decodes a JSON `NaN`; vLLM 0.32's server refuses to write one, below, but another server may),
    through TRL's own `parse_logprobs` (a NaN becomes `None`, as in-process vLLM's `extract_logprobs` makes it), then
    the sampled token's column as TRL's `_generate_single_turn` keeps it."""
    def choice(values):
        tokens = [f"token_id:{7 + i}" for i in range(len(values))]
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": [{token: value} for token, value in zip(tokens, values)]}

    answers = [choice([-0.5, -1.25]), choice([-0.25, math.nan]), choice([-2.0, -0.125]), choice([-INF, -1.0])]
    logprobs, _ = parse_logprobs(answers)
    sampled = [[values[0] for values in row] for row in logprobs]  # TRL: the top-1 (sampled token) log-prob
    assert sampled[1] == [-0.25, None]
    assert nonfinite_logprob_rows(sampled) == [1, 3]
    assert nonfinite_logprob_rows(None) == [] and nonfinite_logprob_rows([[], [-1.0]]) == []


# What TRL's `VLLMClient._post` raised against a real vLLM 0.32 CPU server whose weights held a NaN
# (tests/trainer/test_or1_trainer.py::test_nan_logprobs_from_the_vllm_server_stop_the_run_before_training_on_them).
REFUSED = Exception('Request failed: 400, {"error":{"message":"Out of range float values are not JSON compliant",'
                    '"type":"BadRequestError","param":null,"code":400}}')


def test_checked_sampling_names_the_place_and_rows_or_passes_everything_else_on():
    def sample(logprobs=None, error=None):
        def call():
            if error is not None:
                raise error
            return [[5, 6], [7]], logprobs
        return call

    place = lambda: "training step 4"  # noqa: E731
    assert checked_sampling(sample([[-1.0, -2.0], [-0.5]]), place=place, batch_size=2) == ([[5, 6], [7]],
                                                                                           [[-1.0, -2.0], [-0.5]])
    with pytest.raises(NonFiniteLogitsError) as bad:
        checked_sampling(sample([[-1.0, None], [-0.5]]), place=place)  # the batch: the completions
    assert bad.value.rows == [0] and str(bad.value).startswith(
        "non-finite vLLM log-probs (NaN/inf) at sampling, training step 4: rows [0] of the 2-row batch; ")
    with pytest.raises(NonFiniteLogitsError) as refused:
        checked_sampling(sample(error=REFUSED), place=place)
    assert refused.value.rows is None and refused.value.batch_size is None and refused.value.__cause__ is REFUSED
    assert "rows unknown (the vLLM server refused its whole answer" in str(refused.value)
    assert str(refused.value).startswith("non-finite vLLM log-probs (NaN/inf) at sampling, training step 4: rows "
                                         "unknown") and "JSON compliant') of the batch; " in str(refused.value)
    other = Exception("Request failed: 500, Internal Server Error")
    with pytest.raises(Exception) as passed:
        checked_sampling(sample(error=other), place=place, batch_size=2)
    assert passed.value is other


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_mostly_padding_left_padded_rows_give_finite_logits(tiny, dtype, tolerance):
    """Issue 47's candidate: one 300-token prompt and five of 1-2 tokens, left-padded (83% of the batch padding), under
    SDPA with the attention mask: every logit finite, at the prompt's forward (padding positions too) and at every
    sampled step (no row flagged), in fp32 and bf16; each row's last logits are those of the row alone (measured:
    at most 5e-7 in fp32, 0.005 in bf16; the padding attended instead would move them by 0.69 to 1.28). SmolLM2-135M
    in the same shape on this CPU (issue 47's check, measured once): no NaN either; the tiny model pins it in seconds.
    """
    model, tokenizer = tiny
    model = model.to(dtype).eval()
    model.config._attn_implementation = "sdpa"
    pad = tokenizer.pad_token_id
    long = (tokenizer(" ".join(str(i) for i in range(200)))["input_ids"] * 2)[:300]
    rows = [long, [5], [6, 7], [8], [9, 10], [11]]
    input_ids = torch.tensor([[pad] * (300 - len(r)) + r for r in rows])  # [6, 300]
    attention_mask = (torch.arange(300) >= torch.tensor([300 - len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [6, 300, V]
        assert torch.isfinite(logits).all()
        for i, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row])).logits[0, -1]  # [V]
            assert (alone.float() - logits[i, -1].float()).abs().max().item() < tolerance, i
        config = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=True, pad_token_id=pad, top_k=0,
                                  eos_token_id=tokenizer.eos_token_id)
        with finite_sampling(model, end_token_id=tokenizer.eos_token_id) as guard:
            torch.manual_seed(0)
            model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    assert guard.flags is not None and guard.bad_rows() == []
