"""Fixtures only the tests use (not installed with the package): a local dataset in exactly the layout of
`Skywork/Skywork-OR1-RL-Data` (its card's features and `math` / `code` splits), for tests that must not touch the
network. The tiny model and tokenizer are public API: `or1_trl.testing`."""

from __future__ import annotations

import json
import os

# The released data's layout (`Skywork/Skywork-OR1-RL-Data`, README.md `dataset_info.features` and `configs`).
RELEASED_DIFFICULTY_KEYS = ("DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1-Distill-Qwen-32B", "DeepSeek-R1-Distill-Qwen-7B")
_RELEASED_CARD = """---
dataset_info:
  features:
  - name: data_source
    dtype: string
  - name: prompt
    list:
    - name: content
      dtype: string
    - name: role
      dtype: string
  - name: ability
    dtype: string
  - name: reward_model
    struct:
    - name: ground_truth
      dtype: string
    - name: style
      dtype: string
  - name: extra_info
    struct:
    - name: index
      dtype: int64
    - name: model_difficulty
      struct:
      - name: DeepSeek-R1-Distill-Qwen-1.5B
        dtype: int64
      - name: DeepSeek-R1-Distill-Qwen-32B
        dtype: int64
      - name: DeepSeek-R1-Distill-Qwen-7B
        dtype: int64
configs:
- config_name: default
  data_files:
  - split: math
    path: data/math-*
  - split: code
    path: data/code-*
---
"""


def released_features():
    """`datasets.Features` of the released data (its card's `dataset_info.features`)."""
    from datasets import Features, List, Value

    return Features({
        "data_source": Value("string"),
        "prompt": List({"content": Value("string"), "role": Value("string")}),
        "ability": Value("string"),
        "reward_model": {"ground_truth": Value("string"), "style": Value("string")},
        "extra_info": {"index": Value("int64"),
                       "model_difficulty": {key: Value("int64") for key in RELEASED_DIFFICULTY_KEYS}},
    })


def released_row(question: str, ground_truth, ability: str = "math", index: int = 0, data_source: str = "fixture",
                 difficulty: dict | None = None) -> dict:
    """One row in the released layout. `ground_truth` is JSON-encoded (a list of answers for math, a test object for
    code); `difficulty` maps "1.5B" / "7B" / "32B" to counts out of 16 (missing: null)."""
    difficulty = difficulty or {}
    return {
        "data_source": data_source,
        "prompt": [{"content": question, "role": "user"}],
        "ability": ability,
        "reward_model": {"ground_truth": json.dumps(ground_truth), "style": "rule"},
        "extra_info": {"index": index, "model_difficulty": {
            key: difficulty.get(key.rsplit("-", 1)[1]) for key in RELEASED_DIFFICULTY_KEYS}},
    }


def write_released_dataset(path: str | os.PathLike, math_rows: list[dict], code_rows: list[dict]) -> str:
    """A local copy of the released layout at `path`: the card's README.md and `data/{math,code}-00000-of-00001.parquet`
    (`datasets.load_dataset(path, split="math+code")` reads it as it reads the Hub dataset)."""
    from datasets import Dataset

    os.makedirs(os.path.join(path, "data"), exist_ok=True)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(_RELEASED_CARD)
    for split, rows in (("math", math_rows), ("code", code_rows)):
        Dataset.from_list(rows, features=released_features()).to_parquet(
            os.path.join(path, "data", f"{split}-00000-of-00001.parquet"))
    return str(path)
