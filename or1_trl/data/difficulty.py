"""Offline difficulty estimation (paper §6.2): N samples per prompt from a model, scored with our rewards; the count
of correct ones is stored per model, as the released data stores it, and prompts solved never or always are dropped.

    or1-trl difficulty --dataset_name my/data --split train --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B \\
        --output_dir data/my-7b                          # or --server_url http://localhost:8000 (`or1-trl serve`)
    or1-trl train ... --dataset_name data/my-7b         # the kept rows: 1..N-1 correct of N

- N = 16 samples per math prompt and 8 per code prompt (the paper's), at temperature 1.0 and top-p 1.0; each row's
  verifier by its `ability` (`released.training_dataset`: the released format, or plain `prompt`/`answer` /
  `tests`).
- Generation is `or1_trl.generation.sampling` (a vLLM server, in-process vLLM or HF `generate`); every finished
  prompt's samples and rewards are appended to `<output_dir>/samples-<ability>.jsonl` at once (one fsynced line), so an
  interrupted run, started again, continues with the prompts it has not finished. A prompt's store key is its row
  number and a hash of its content: a changed dataset is never matched with old samples.
- The count goes into `extra_info.model_difficulty[<model name>]` (the released data's layout, created where the
  dataset has none): `or1-trl train --difficulty_model <model name> --difficulty_range LOW HIGH` filters on it
  later, and several models' counts sit side by side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Samples per prompt by ability (paper §6.2).
DEFAULT_SAMPLES = {"math": 16, "code": 8}
_ROW = "or1_row"


@dataclass
class DifficultyResult:
    """Counts of one model: `dataset` (every row, with the count added), per row its `counts` (correct of
    `samples`)."""

    dataset: object
    model_key: str
    counts: list[int]
    samples: list[int]
    abilities: list[str]

    def kept_rows(self) -> list[int]:
        """Rows solved at least once and not every time: 1 <= count <= N - 1."""
        return [i for i, (c, n) in enumerate(zip(self.counts, self.samples)) if 1 <= c <= n - 1]

    def summary(self) -> str:
        """Per ability: prompts, how many at 0/N, at N/N and kept."""
        lines = []
        for ability in ("math", "code"):
            rows = [i for i, a in enumerate(self.abilities) if a == ability]
            if not rows:
                continue
            n = self.samples[rows[0]]
            none = sum(self.counts[i] == 0 for i in rows)
            every = sum(self.counts[i] == n for i in rows)
            lines.append(f"  {ability}: {len(rows)} prompts x {n} samples: {none} at 0/{n}, {every} at {n}/{n}, "
                         f"{len(rows) - none - every} kept (1..{n - 1})")
        kept = len(self.kept_rows())
        return "\n".join([f"{self.model_key}: correct samples per prompt", *lines,
                          f"  kept {kept} of {len(self.counts)} prompts"])

    def write(self, output_dir: str, split: str, keep_all: bool = False) -> tuple[int, str]:
        """Write the kept rows (every row with `keep_all`) with their counts as
        `<output_dir>/data/<split>-00000-of-00001.parquet` (`or1-trl train --dataset_name OUTPUT_DIR` reads it).
        Returns `(rows written, path)`."""
        from .loading import save_split

        out = self.dataset if keep_all else self.dataset.select(self.kept_rows())
        return len(out), save_split(out, output_dir, split)


def with_counts(dataset, model_key: str, counts: list[int | None]):
    """`dataset` with `extra_info.model_difficulty[model_key] = counts[row]` (other fields and models kept)."""
    from datasets import Features, Value

    features = Features(dataset.features)
    extra = dict(features.get("extra_info") or {}) if isinstance(features.get("extra_info"), dict) else {}
    if "extra_info" in features and not isinstance(features["extra_info"], dict):
        raise ValueError(f"the dataset's extra_info column is {features['extra_info']}, not a struct: the counts "
                         "cannot be stored in extra_info.model_difficulty")
    difficulty = dict(extra.get("model_difficulty") or {})
    difficulty[model_key] = Value("int64")
    extra["model_difficulty"] = difficulty
    features["extra_info"] = extra

    def add(row, index):
        info = dict(row.get("extra_info") or {})
        per_model = dict(info.get("model_difficulty") or {})
        per_model[model_key] = counts[index]
        info["model_difficulty"] = per_model
        return {"extra_info": info}

    return dataset.map(add, with_indices=True, features=features, desc=f"Adding {model_key} counts")


def estimate_difficulty(dataset, backend, model_key: str, output_dir: str, samples: dict[str, int] | None = None,
                        temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 32768, seed: int = 0,
                        reward: str = "auto", prompt_column: str = "prompt", answer_column: str | None = None,
                        rewards: dict | None = None, progress: bool = True) -> DifficultyResult:
    """Sample, score and count every row of `dataset` (module docstring); resumes from `output_dir`'s stores.

    `backend` is an `or1_trl.generation.sampling` backend; `rewards` overrides the verifiers (`{"math": ..., "code":
    ...}`, default `math_reward` / `code_reward`). Rows that cannot be scored are an error before anything is
    generated.
    """
    from .released import training_dataset
    from ..recipe.prompts import content_id
    from ..rewards import code_reward, math_reward
    from ..generation.sampling import SampleStore, SamplingSettings, reward_scorer, sample

    samples = {**DEFAULT_SAMPLES, **(samples or {})}
    verifiers = {"math": math_reward, "code": code_reward, **(rewards or {})}
    indexed = dataset.add_column(_ROW, list(range(len(dataset))))
    rows, abilities, _ = training_dataset(indexed, reward=reward, prompt_column=prompt_column,
                                          answer_column=answer_column)
    os.makedirs(output_dir, exist_ok=True)
    counts: list[int | None] = [None] * len(dataset)
    per_row_samples = [0] * len(dataset)
    row_abilities = [""] * len(dataset)
    for ability in abilities:
        part = rows.filter(lambda a: a == ability, input_columns=["ability"])
        ids = [f"{row}:{content_id(prompt)}" for row, prompt in zip(part[_ROW], part["prompt"])]
        gold_column = "answer" if ability == "math" else "tests"
        settings = SamplingSettings(n=samples[ability], temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                    seed=seed)
        score = reward_scorer(verifiers[ability], dict(zip(ids, part[gold_column])), column=gold_column)
        with SampleStore(os.path.join(output_dir, f"samples-{ability}.jsonl"), settings) as store:
            records = sample(backend, list(zip(ids, part["prompt"])), settings, store=store, score=score,
                             desc=f"{model_key} on {ability}", progress=progress)
        for pid, row in zip(ids, part[_ROW]):  # a sample is correct at reward >= 1, as in the training statistics
            counts[row] = sum(r >= 1.0 for r in records[pid]["rewards"])
            per_row_samples[row], row_abilities[row] = settings.n, ability
    return DifficultyResult(with_counts(dataset, model_key, counts), model_key, counts, per_row_samples,
                            row_abilities)
