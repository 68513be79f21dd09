"""`generation/seeded.py`, paired rollouts: the counter-based generator against a plain reference, exact Gumbel-max
sampling, keys that depend on the row alone; the tiny model's `generate` and two short training runs (HF path and the
CPU vLLM server) that draw identical completions with one `rollout_seed` and other ones with another."""

import math

import pytest
import torch
from transformers import GenerationConfig

from or1_trl import OR1Config, OR1Trainer
from or1_trl.generation import seeded
from or1_trl.generation.seeded import (
    RolloutKey,
    RolloutSeeds,
    SeededGumbel,
    completions_hash,
    gumbel_noise,
    next_step_request,
    seeded_sampling,
    splitmix64,
    splitmix64_reference,
)
from or1_trl.generation.vllm_client import http_vllm_client
from or1_trl.testing import tiny_model_and_tokenizer, tiny_training_args

from ..helpers import ScriptedReward, tagged_dataset, tied_trainer

HASH = "rollout/completions_hash"
UNSIGNED = (1 << 64) - 1


def test_splitmix64_is_the_plain_python_generator_at_every_bit():
    keys = [0, 1, 12345, -5, -(2**63), 2**63 - 1, 2**62 + 3]  # int64 bit patterns: the high bit set too
    counters = [0, 1, 7, 49151, 10**12]
    values = splitmix64(torch.tensor(keys, dtype=torch.int64), torch.tensor(counters, dtype=torch.int64))
    for i, key in enumerate(keys):
        for j, counter in enumerate(counters):
            assert values[i, j].item() & UNSIGNED == splitmix64_reference(key & UNSIGNED, counter), (key, counter)
    # the known first outputs of splitmix64 from state 0 (Vigna's reference implementation)
    assert [splitmix64_reference(0, n) for n in range(2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_the_noise_is_standard_gumbel_and_a_function_of_key_and_position_only():
    keys = torch.arange(400, dtype=torch.int64)
    noise = gumbel_noise(keys, position=3, vocab_size=500)  # [400, 500]: 200,000 draws
    assert noise.shape == (400, 500) and noise.dtype == torch.float64
    assert abs(noise.mean().item() - 0.5772156649) < 0.01  # Euler–Mascheroni: the Gumbel mean
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.03
    # a row's noise does not depend on the other rows, and changes with the position
    assert torch.equal(gumbel_noise(keys[[7]], position=3, vocab_size=500)[0], noise[7])
    assert not torch.equal(gumbel_noise(keys[[7]], position=4, vocab_size=500)[0], noise[7])


def test_gumbel_max_samples_the_softmax():
    """Over 40,000 rows (keys), the argmax of scores + noise falls on each token at its softmax probability."""
    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])  # the -inf token (top-k/p masked) is never drawn
    rows = 40_000
    key = RolloutKey(seed=0, step=0)
    processor = SeededGumbel(key, pad_token_id=None)
    prompts = torch.arange(rows, dtype=torch.long)[:, None]  # one distinct one-token prompt per row
    noisy = processor(prompts, scores.expand(rows, -1).clone())
    counts = torch.bincount(noisy.argmax(-1), minlength=5).double() / rows
    expected = torch.softmax(scores.double(), -1)
    assert counts[4] == 0
    assert torch.allclose(counts, expected, atol=0.01), (counts, expected)


def test_row_keys_depend_on_the_prompt_and_its_occurrence_not_its_neighbours():
    key = RolloutKey(seed=1, step=3)
    a, b = [5, 6, 7], [9]
    first = key.row_keys([a, a, b])
    assert first[0] != first[1]  # two copies of one prompt draw independently
    assert key.row_keys([b, a, a, [1, 2]]) == [first[2], first[0], first[1], key.row_keys([[1, 2]])[0]]
    assert all(0 <= k < 2**62 for k in first)
    for other in (RolloutKey(2, 3), RolloutKey(1, 4), RolloutKey(1, 3, "eval"), RolloutKey(1, 3, "train", 1)):
        assert other.row_keys([a])[0] != first[0], other


def test_the_trainer_counts_draws_per_step_and_phase():
    seeds = RolloutSeeds(rollout_seed=7)
    assert [seeds.next_key(3, training=True) for _ in range(2)] == [RolloutKey(7, 3, "train", 0),
                                                                      RolloutKey(7, 3, "train", 1)]
    assert seeds.next_key(3, training=False) == RolloutKey(7, 3, "eval", 0)
    assert seeds.next_key(4, training=True) == RolloutKey(7, 4, "train", 0)
    assert RolloutSeeds(None).next_key(0, training=True) is None


def test_the_prefetched_request_is_keyed_for_the_step_that_trains_on_it():
    request = {"prompts": [[1]], "n": 2, "generation_kwargs": {"ignore_eos": True,
                                                                 seeded.KEY_FIELD: [7, 3, "train", 1]}}
    assert next_step_request(request, step=4)["generation_kwargs"] == {"ignore_eos": True,
                                                                       seeded.KEY_FIELD: [7, 4, "train", 0]}
    assert request["generation_kwargs"][seeded.KEY_FIELD] == [7, 3, "train", 1]  # not changed in place
    unkeyed = {"prompts": [[1]], "generation_kwargs": None}
    assert next_step_request(unkeyed, step=4) is unkeyed


def test_completions_hash_tells_runs_apart():
    assert completions_hash([[1, 2], [3]]) == completions_hash([[1, 2], [3]]) < 2**24
    assert completions_hash([[1, 2], [3]]) != completions_hash([[1, 2], [4]])
    assert completions_hash([[1]], previous=completions_hash([[2]])) != completions_hash([[1]])


def _generate(model, tokenizer, prompts, key, **sampling):
    """Left-padded `generate` of `prompts` (token ids) under `seeded_sampling(key)`: the completions' token ids."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=pad, **sampling)
    with seeded_sampling(model, key, pad_token_id=pad):
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert "generate" not in vars(model)  # the instance attribute is gone after the block
    return out[:, width:].tolist()


def test_generate_draws_a_row_alike_in_any_batch_position_and_padding():
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    a, b, c = (tokenizer(text)["input_ids"] for text in ("hello there", "x", "a longer prompt than the others"))
    key = RolloutKey(seed=3, step=0)
    first = _generate(model, tokenizer, [a, a, b], key, temperature=1.0)
    second = _generate(model, tokenizer, [c, b, a, a], key, temperature=1.0)
    assert second[2:] == first[:2] and second[1] == first[2]  # other neighbours, other padding: the same samples
    assert first[0] != first[1]  # the two copies of `a` are two samples
    assert _generate(model, tokenizer, [a, a, b], RolloutKey(seed=4, step=0), temperature=1.0) != first
    # transformers' warpers act before the noise: top_k=1 is greedy whatever the key
    greedy = model.generate(input_ids=torch.tensor([a]), max_new_tokens=8, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id)[:, len(a):].tolist()
    assert _generate(model, tokenizer, [a], key, temperature=0.7, top_k=1) == greedy


def _hf_run(tmp_path, name, rollout_seed, **overrides):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    args = OR1Config(**tiny_training_args(tmp_path / name, rollout_seed=rollout_seed, max_steps=3, logging_steps=1,
                                          learning_rate=1e-2, **overrides))
    trainer = OR1Trainer(model, ScriptedReward(), args=args, processing_class=tokenizer,
                         train_dataset=tagged_dataset(["MIX", "ALL", "MIX", "NONE"] * 4))
    trainer.train()
    hashes = [log[HASH] for log in trainer.state.log_history if HASH in log]
    return hashes, {name: param.detach().clone() for name, param in trainer.model.named_parameters()}


def test_two_hf_runs_with_one_rollout_seed_draw_the_same_completions_and_weights(tmp_path):
    hashes, weights = _hf_run(tmp_path, "a", rollout_seed=5)
    again, weights_again = _hf_run(tmp_path, "b", rollout_seed=5)
    other, _ = _hf_run(tmp_path, "c", rollout_seed=6)
    assert len(hashes) == 3 and hashes == again
    assert all(h != o for h, o in zip(hashes, other))
    for name, param in weights.items():
        assert torch.equal(param, weights_again[name]), name


def test_rollout_seed_is_refused_where_it_cannot_seed(tmp_path):
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        OR1Config(**tiny_training_args(tmp_path, rollout_seed=1, use_vllm=True, vllm_mode="colocate"))
    with pytest.raises(ValueError, match=r"rollout_seed=-1 must be an integer >= 0, or None"):
        OR1Config(**tiny_training_args(tmp_path, rollout_seed=-1))


# --- the CPU vLLM server ------------------------------------------------------------------------------------------
def test_server_requests_draw_a_prompt_alike_in_any_batch(vllm_server):
    client = http_vllm_client(base_url=vllm_server.url, api_key=vllm_server.api_key)
    key = {seeded.KEY_FIELD: RolloutKey(seed=9, step=2).as_field()}
    a, b, c = [5, 6, 7, 8], [9, 10], [11, 12, 13]

    def completions(prompts, generation_kwargs=key):
        return client.generate(prompts=prompts, n=3, max_tokens=8, temperature=1.0,
                               generation_kwargs={"ignore_eos": True, **generation_kwargs})["completion_ids"]

    first = completions([a, b])
    second = completions([c, a, b])
    assert second[3:] == first  # prompt-major, n=3 each: a's and b's samples, after c's
    assert len({tuple(row) for row in first[:3]}) == 3  # the n samples of a prompt differ
    unseeded = completions([a, b], generation_kwargs={})
    assert unseeded != first


def test_two_server_runs_with_one_rollout_seed_draw_the_same_completions_and_weights(vllm_server, tmp_path):
    runs = []
    for name, rollout_seed in (("a", 11), ("b", 11), ("c", 12)):
        trainer = tied_trainer(vllm_server, tmp_path / name, max_steps=2, logging_steps=1, rollout_seed=rollout_seed)
        trainer.train()
        runs.append(([log[HASH] for log in trainer.state.log_history if HASH in log],
                     {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
    (hashes, weights), (again, weights_again), (other, _) = runs
    assert len(hashes) == 2 and hashes == again  # the second step samples from the weights the first one trained
    assert all(h != o for h, o in zip(hashes, other))
    for name, param in weights.items():
        assert torch.equal(param, weights_again[name]), name


def test_one_step_off_rollouts_are_keyed_for_the_step_that_trains_on_them(vllm_server, tmp_path):
    """With `async_generation`, step k+1's rollout is requested during step k under step k+1's key: the step's own
    request matches it (staleness 1, the prefetch used), and two such runs draw the same completions."""
    runs = []
    for name in ("a", "b"):
        trainer = tied_trainer(vllm_server, tmp_path / name, max_steps=3, logging_steps=1, rollout_seed=3,
                               async_generation=True, rollout_correction="token_truncate",
                               max_completion_length=4)
        trainer.train()
        runs.append([(log[HASH], log["async/staleness"]) for log in trainer.state.log_history if HASH in log])
    assert runs[0] == runs[1]
    assert [staleness for _, staleness in runs[0]] == [0.0, 1.0, 1.0]


def test_on_paired_rollouts_rejection_only_rescales_the_first_update(tmp_path):
    """The mechanism behind pairing `or1` with `or1_no_rejection` (issue 48): on the same rollout (one `rollout_seed`,
    the same starting weights) with the entropy term inactive (c_0 = 0) and on-policy (ratio 1, no clipping), groups
    whose rewards are all equal have zero advantage and add nothing to the gradient, so dropping them (rejection
    sampling) only changes the normaliser: the gradient is the same up to a positive scale (T over all tokens ÷ T
    over the kept ones, before clipping; after, both are scaled to the clipping norm if above it). Adam's first step
    is invariant to the gradient's scale (m̂ / √v̂ = g / |g| elementwise, up to ε = 1e-8), so both arms take the same
    first update. Checked on the tiny model: two of the four groups all-equal (ALL, NONE)."""
    deltas, logs = [], []
    for name, rejection in (("or1", "compact"), ("or1_no_rejection", "off")):
        model, tokenizer = tiny_model_and_tokenizer(seed=0)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = OR1Config(**tiny_training_args(tmp_path / name, rollout_seed=1, max_steps=1, logging_steps=1,
                                              learning_rate=1e-3, rejection_sampling=rejection,
                                              per_device_train_batch_size=16))  # the 4 prompts in one step
        trainer = OR1Trainer(model, ScriptedReward(), args=args, processing_class=tokenizer,
                             train_dataset=tagged_dataset(["MIX", "ALL", "MIX", "NONE"]))
        trainer.train()
        kept = [log["rejection/kept_group_frac"] for log in trainer.state.log_history
                if "rejection/kept_group_frac" in log]
        assert kept == ([0.5] if rejection == "compact" else [])  # the two all-equal groups left or1's batch
        deltas.append(torch.cat([(p.detach() - start[n]).flatten() for n, p in model.named_parameters()]))
        logs.append(trainer.state.log_history[0])
    assert logs[0][HASH] == logs[1][HASH]  # the same rollout
    assert logs[0]["grad_norm"] > 1.5 * logs[1]["grad_norm"]  # the gradient rescaled (fewer tokens in T_k)...
    with_rejection, without = deltas
    assert with_rejection.abs().max() > 0.9e-3  # ...yet a real update, Adam's first: about lr per weight
    assert torch.nn.functional.cosine_similarity(with_rejection, without, dim=0) > 0.9999
    # nearly equal: the two batches differ in rows and padding, so their gradients differ at rounding level, which
    # Adam's g / (|g| + ε) shows only where |g| is near ε: a handful of the 416,384 weights, by how much depends on the
    # CPU's rounding (up to 5.05e-5 on an AVX2 machine, under 5e-5 on an AVX-512 one). So: all but a few in 1,000 move
    # alike to 0.1% of the learning rate, and none moves the other way (a sign flip would differ by about 2 x lr)
    difference = (with_rejection - without).abs()
    assert (difference > 1e-3 * 1e-3).float().mean() < 1e-3
    assert difference.max() < 0.5 * 1e-3
