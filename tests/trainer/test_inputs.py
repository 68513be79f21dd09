"""What the trainer trains on, checked first (`trainer/inputs.py`): prompts longer than the context are refused (OR1's
recipe) or counted in one warning (TRL's config), and with `max_prompt_length` counted once and cut from the left at
generation. The rule itself (`data/preflight.check_prompt_lengths`): `tests/data/test_preflight.py`."""

import pytest
from datasets import Dataset
from trl import GRPOConfig

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import tiny_model, tiny_tokenizer, tiny_training_args

from ..helpers import TrainerLog, parity_reward


def long_prompts():
    """Conversational prompts of 1 to 10 repetitions of a phrase (27 to 135 tokens with the chat template)."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is two plus two? " * (1 + i)}]
                                         for i in range(10)]})


def chat_ids(tokenizer, dataset):
    """Each prompt's token ids, from the tokenizer's chat template directly."""
    return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"]
            for p in dataset["prompt"]]


def test_prompts_longer_than_the_context_are_refused_or_truncated(tmp_path):
    """Tiny model with a 64-token context, completions of 6: prompts over 58 tokens are an error naming their count
    (equal to a count made with the tokenizer's chat template directly); with max_prompt_length they are counted in
    one warning and generation gets their last max_prompt_length tokens."""
    tokenizer = tiny_tokenizer()
    data = long_prompts()
    full = chat_ids(tokenizer, data)
    lengths = [len(ids) for ids in full]
    over = [i for i, n in enumerate(lengths) if n > 64 - 6]
    assert 0 < len(over) < len(data)
    args = OR1Config(**tiny_training_args(tmp_path, max_steps=1))
    with pytest.raises(ValueError) as exc:
        OR1Trainer(tiny_model(tokenizer, max_position_embeddings=64), parity_reward, args=args, train_dataset=data,
                   processing_class=tokenizer)
    assert str(exc.value).startswith(f"{len(over)} of 10 prompts of train_dataset are longer than 58 tokens (rows "
                                     f"{', '.join(map(str, over[:5]))}, …; longest {max(lengths)}), the room the "
                                     "model's max_position_embeddings (64 tokens) leaves")

    # TRL's own config has no truncation to offer: the same count, as a warning.
    with TrainerLog() as log:
        OR1Trainer(tiny_model(tokenizer, max_position_embeddings=64), parity_reward,
                   args=GRPOConfig(**tiny_training_args(tmp_path, max_steps=1)), train_dataset=data,
                   processing_class=tokenizer)
    warnings = [m for _, m in log.matching("prompts of train_dataset")]
    assert len(warnings) == 1 and warnings[0].startswith(f"{len(over)} of 10 prompts of train_dataset are longer than 58")

    # max_prompt_length=20: prompts over 20 tokens are counted once and cut from the left at generation.
    over_20 = [i for i, n in enumerate(lengths) if n > 20]
    args = OR1Config(**tiny_training_args(tmp_path, max_steps=1, max_prompt_length=20))
    with TrainerLog() as log:
        trainer = OR1Trainer(tiny_model(tokenizer, max_position_embeddings=64), parity_reward, args=args,
                             train_dataset=data, processing_class=tokenizer)
        log.trainer = trainer
        trainer.train()
    warnings = log.matching("max_prompt_length=20")
    assert len(warnings) == 1 and warnings[0][1].startswith(f"{len(over_20)} of 10 prompts of train_dataset are "
                                                            "longer than max_prompt_length=20 tokens")
    ids, _, _ = trainer._tokenize_prompts(list(data["prompt"]))
    assert [list(i) for i in ids] == [f[-20:] for f in full]
    assert max(map(len, ids)) == 20 and trainer.state.global_step == 1
