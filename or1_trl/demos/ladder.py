"""The arithmetic ladder: a built-in task for a small real instruct model, in MAGIC's regime.

Rungs, easiest first. Each prompt is a conversation: a lean system turn (`SYSTEM`, 3 tokens, instead of the ~20 that
SmolLM2's default system message adds to every prompt), then the question and "Answer with only the number." The gold
`answer` is the number, scored by the paper's Math-Verify reward (`or1_trl.rewards.math_reward`, §7.1: the model rarely
writes `\\boxed{}`, and Math-Verify reads the plain number).

| rung | question | operands | pairs |
|---|---|---|---|
| `add1` | What is a + b? | a, b in 0..9 | 100 |
| `sub1` | What is c - b? (c = a + b) | a, b in 0..9 | 100 |
| `mul1` | What is a times b? | a, b in 2..9 | 64 |
| `add21` | What is a + b? | a in 10..99, b in 1..9 | 810 |
| `add2` | What is a + b? | a, b in 10..99 | 8,100 |
| `apples` | Tom has a apples and buys b more. How many apples does Tom have now? | a, b in 2..9 | 64 |

Measured on SmolLM2-135M-Instruct (the dequantised Q4_1 model of `or1-trl model smollm2`, vLLM CPU in bf16), 48
prompts x 8 samples at T = 1.0, 48 new tokens: accuracy add1 0.34, sub1 0.21, mul1 0.21, add21 0.08, add2 0.12,
apples 0.10; groups neither all-right nor all-wrong 44-100%; about half the samples run past 48 tokens. Many mixed
groups on the easy rungs, many all-wrong ones on the hard rungs: the regime the recipe's rejection sampling and
growing context are for.

The split (`ladder_split`) draws, per rung and with its own seed, distinct operand pairs: `held_out` of them for
evaluation, then up to `train` others for training. No pair is in both, so held-out accuracy measures what RL carries
over to problems it never trained on. Every row has a `rung` column and a `prompt_id` (`"<rung>-<a>-<b>"`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SYSTEM = "Answer briefly."
INSTRUCTION = "Answer with only the number."


@dataclass(frozen=True)
class Rung:
    """One rung: its question, the operand pairs it draws from, and the answer of a pair."""

    name: str
    question: str  # formatted with the pair's `a`, `b` and `c` (= a + b)
    first: range
    second: range
    answer: Callable[[int, int], int]

    def pairs(self) -> list[tuple[int, int]]:
        return list(itertools.product(self.first, self.second))

    def row(self, a: int, b: int, system: str | None = SYSTEM) -> dict:
        """The training/evaluation row of the pair `(a, b)`: a conversation prompt, its gold answer and its ids."""
        user = {"role": "user", "content": f"{self.question.format(a=a, b=b, c=a + b)} {INSTRUCTION}"}
        prompt = ([{"role": "system", "content": system}] if system is not None else []) + [user]
        return {"prompt": prompt, "answer": str(self.answer(a, b)), "rung": self.name,
                "prompt_id": f"{self.name}-{a}-{b}"}


RUNGS = {
    rung.name: rung
    for rung in (
        Rung("add1", "What is {a} + {b}?", range(10), range(10), lambda a, b: a + b),
        Rung("sub1", "What is {c} - {b}?", range(10), range(10), lambda a, b: a),
        Rung("mul1", "What is {a} times {b}?", range(2, 10), range(2, 10), lambda a, b: a * b),
        Rung("add21", "What is {a} + {b}?", range(10, 100), range(1, 10), lambda a, b: a + b),
        Rung("add2", "What is {a} + {b}?", range(10, 100), range(10, 100), lambda a, b: a + b),
        Rung("apples", "Tom has {a} apples and buys {b} more. How many apples does Tom have now?", range(2, 10),
             range(2, 10), lambda a, b: a + b),
    )
}


def ladder_split(train: int = 40, held_out: int = 24, rungs: Sequence[str] | None = None, seed: int = 0,
                 system: str | None = SYSTEM):
    """`(train_dataset, held_out_dataset)`: per rung, `held_out` distinct pairs for evaluation and up to `train` other
    pairs for training (fewer when the rung has fewer pairs left), drawn with `seed`; the training rows are shuffled
    across rungs, the held-out rows stay in rung order. `system`: the system turn (`None`: the model's default)."""
    from datasets import Dataset

    names = list(RUNGS) if rungs is None else list(rungs)
    if unknown := [name for name in names if name not in RUNGS]:
        raise ValueError(f"unknown rung(s) {', '.join(unknown)}: choose from {', '.join(RUNGS)}")
    if train < 0 or held_out < 1:
        raise ValueError(f"train must be >= 0 and held_out >= 1, got train={train}, held_out={held_out}")
    rng = random.Random(seed)
    train_rows, held_out_rows = [], []
    for name in names:
        rung = RUNGS[name]
        pairs = rung.pairs()
        if held_out >= len(pairs):
            raise ValueError(f"rung {name} has {len(pairs)} pairs: held_out={held_out} leaves none to train on")
        rng.shuffle(pairs)
        held_out_rows += [rung.row(a, b, system) for a, b in pairs[:held_out]]
        train_rows += [rung.row(a, b, system) for a, b in pairs[held_out:held_out + train]]
    rng.shuffle(train_rows)
    columns = ("prompt", "answer", "rung", "prompt_id")
    as_dataset = lambda rows: Dataset.from_dict({c: [row[c] for row in rows] for c in columns})  # noqa: E731
    return as_dataset(train_rows), as_dataset(held_out_rows)
