"""Word problems that need reasoning before the answer: the task family for the recipe in its own regime (issue 50).

The arithmetic ladder (`or1_trl.demos.ladder`) asks for "only the number": the model answers with one or two tokens
right after the prompt, so the claims about long chains of thought cannot engage there (the 80/20 rule's
high-entropy tokens fall after the answer; entropy never collapses in a short run). Here every prompt asks the model
to work the problem out step by step and then write its answer on a line of its own, tagged:

    ... 3 bags × 4 apples = 12 apples. 12 - 5 = 7.
    Answer: 7

Rungs, by the number of arithmetic steps a solution takes (`Template.steps`):

| rung | steps | question | answer |
|---|---:|---|---|
| `buy` | 1 | N has a things and buys b more. How many now? | a + b |
| `give` | 1 | N has a things and gives b away. How many are left? | a - b |
| `bags` | 1 | N buys a bags with b things in each. How many things? | a × b |
| `buy_give` | 2 | N has a things, buys b more, then gives c away. How many are left? | a + b - c |
| `bags_eat` | 2 | N buys a bags with b things in each and eats c of them. How many are left? | a × b - c |
| `two_friends` | 2 | N has a things; a friend has b more than N. How many do they have together? | 2a+b |

A row's gold `answer` is the number; `prompt_id` is `"<rung>-<a>-<b>-<c>"`. With `worked_example=True` (the default)
the prompt carries one solved 1-step problem as a user/assistant exchange before the question, so a small instruct
model sees the format once (the issue's probe: with a worked example, steps appeared in 58% of SmolLM2's completions).

What a completion is judged by, here and in the regime probe:
- `tagged_answer`: the number after the last "Answer:" tag, or None;
- `tagged_answer_reward`: 1 when that number equals the gold answer, else 0 (the verifier of this family; Math-Verify
  would also read a number written in passing, which is not what the format asks for);
- `format_reward`: 1 when the completion ends its reasoning with a tagged number at all (the format-only control of
  the 1-shot claim);
- `reasons_before_answer`: the text before the tag holds at least one worked arithmetic step ("12 - 5 = 7");
- `answer_offset`: where the tag starts (the tokens before it are the reasoning: where the 80/20 rule's selected
  tokens should fall); `answer_number_span`: where the tagged number stands.

A completion may write on after its answer line (in the regime probe, 38% of the tagged ones did), where the 80/20
rule's selected tokens and the entropy term would then fall: `ANSWER_LINE`, as `OR1Config.stop_pattern`, ends each
completion with its answer line (`or1_trl.generation.stop`).

The split (`word_problem_split`) draws distinct operand triples per rung with its own seed: `held_out` for evaluation,
then up to `train` others for training, none in both, as `ladder_split` does.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SYSTEM = "You solve word problems step by step."
INSTRUCTION = "Work it out step by step, then write the final answer on its own line as 'Answer: <number>'."
ANSWER_TAG = "Answer:"
#: `OR1Config.stop_pattern` for this family: a completion ends with its answer line (`generation/stop.py`).
ANSWER_LINE = r"Answer:[^\n]*\n"
NAMES = ("Tom", "Ana", "Sam", "Lea", "Ben", "Mia")
THINGS = ("apples", "pens", "cards", "books", "eggs", "coins")

#: The worked example: a solved 1-step problem, the format shown once.
WORKED_QUESTION = "Ana has 6 pens and buys 3 more. How many pens does Ana have now?"
WORKED_SOLUTION = "Ana starts with 6 pens. She buys 3 more: 6 + 3 = 9.\nAnswer: 9"

_TAGGED = re.compile(rf"{re.escape(ANSWER_TAG)}\s*(-?\d+(?:\.\d+)?)")
_STEP = re.compile(r"-?\d+\s*[-+×x*/]\s*-?\d+(?:\s*[-+×x*/]\s*-?\d+)*\s*=\s*-?\d+")


@dataclass(frozen=True)
class Template:
    """One rung: its question, the operand ranges it draws from, and the answer of a triple `(a, b, c)`."""

    name: str
    steps: int  # arithmetic steps a solution takes
    question: str  # formatted with `a`, `b`, `c`, `name` and `things`
    first: range
    second: range
    third: range
    answer: Callable[[int, int, int], int]
    valid: Callable[[int, int, int], bool] = lambda a, b, c: True  # e.g. no negative count

    def triples(self) -> list[tuple[int, int, int]]:
        return [t for t in itertools.product(self.first, self.second, self.third) if self.valid(*t)]

    def row(self, a: int, b: int, c: int, worked_example: bool = True, system: str | None = SYSTEM) -> dict:
        """The row of the triple: a conversation prompt (the worked example first, when asked), its gold answer, its
        rung and id. The person and the things are chosen from the triple, so a row is the same in every split."""
        name, things = NAMES[(a + 2 * b + 3 * c) % len(NAMES)], THINGS[(3 * a + b + c) % len(THINGS)]
        question = self.question.format(a=a, b=b, c=c, name=name, things=things)
        prompt = [{"role": "system", "content": system}] if system is not None else []
        if worked_example:
            prompt += [{"role": "user", "content": f"{WORKED_QUESTION} {INSTRUCTION}"},
                       {"role": "assistant", "content": WORKED_SOLUTION}]
        prompt.append({"role": "user", "content": f"{question} {INSTRUCTION}"})
        return {"prompt": prompt, "answer": str(self.answer(a, b, c)), "rung": self.name,
                "prompt_id": f"{self.name}-{a}-{b}-{c}"}


TEMPLATES = {
    template.name: template
    for template in (
        Template("buy", 1, "{name} has {a} {things} and buys {b} more. How many {things} does {name} have now?",
                 range(2, 20), range(2, 10), range(1), lambda a, b, c: a + b),
        Template("give", 1, "{name} has {a} {things} and gives {b} of them away. How many {things} are left?",
                 range(5, 20), range(2, 10), range(1), lambda a, b, c: a - b, lambda a, b, c: a > b),
        Template("bags", 1, "{name} buys {a} bags with {b} {things} in each. How many {things} is that?",
                 range(2, 7), range(2, 10), range(1), lambda a, b, c: a * b),
        Template("buy_give", 2, "{name} has {a} {things}, buys {b} more, then gives {c} away. How many {things} "
                 "are left?", range(2, 15), range(2, 10), range(1, 10), lambda a, b, c: a + b - c,
                 lambda a, b, c: c < a + b),
        Template("bags_eat", 2, "{name} buys {a} bags with {b} {things} in each and gives {c} of them away. How "
                 "many {things} are left?", range(2, 6), range(2, 8), range(1, 6), lambda a, b, c: a * b - c,
                 lambda a, b, c: c < a * b),
        Template("two_friends", 2, "{name} has {a} {things}. A friend has {b} more {things} than {name}. How many "
                 "{things} do they have together?", range(2, 15), range(1, 10), range(1), lambda a, b, c: 2 * a + b),
    )
}


def word_problem_split(train: int = 40, held_out: int = 24, rungs: Sequence[str] | None = None, seed: int = 0,
                       worked_example: bool = True, system: str | None = SYSTEM):
    """`(train_dataset, held_out_dataset)`: per rung, `held_out` distinct triples for evaluation and up to `train`
    others for training, drawn with `seed`; the training rows shuffled across rungs, the held-out rows in rung order.
    Columns: `prompt` (a conversation), `answer`, `rung`, `prompt_id`."""
    from datasets import Dataset

    names = list(TEMPLATES) if rungs is None else list(rungs)
    if unknown := [name for name in names if name not in TEMPLATES]:
        raise ValueError(f"unknown rung(s) {', '.join(unknown)}: choose from {', '.join(TEMPLATES)}")
    if train < 0 or held_out < 1:
        raise ValueError(f"train must be >= 0 and held_out >= 1, got train={train}, held_out={held_out}")
    rng = random.Random(seed)
    train_rows, held_out_rows = [], []
    for name in names:
        template = TEMPLATES[name]
        triples = template.triples()
        if held_out >= len(triples):
            raise ValueError(f"rung {name} has {len(triples)} problems: held_out={held_out} leaves none to train on")
        rng.shuffle(triples)
        held_out_rows += [template.row(*t, worked_example=worked_example, system=system) for t in triples[:held_out]]
        train_rows += [template.row(*t, worked_example=worked_example, system=system)
                       for t in triples[held_out:held_out + train]]
    rng.shuffle(train_rows)
    columns = ("prompt", "answer", "rung", "prompt_id")
    return tuple(Dataset.from_dict({c: [row[c] for row in rows] for c in columns})
                 for rows in (train_rows, held_out_rows))


# --- Judging a completion ------------------------------------------------------------------------------------------
def _text(completion) -> str:
    """A completion's text: TRL passes a string, or a conversation's turns (the assistant's content)."""
    if isinstance(completion, str):
        return completion
    return "".join(turn.get("content", "") for turn in completion if isinstance(turn.get("content"), str))


def tagged_answer(completion) -> str | None:
    """The number after the last "Answer:" tag (as written, e.g. "7", "-3", "2.5"), or None without one."""
    found = _TAGGED.findall(_text(completion))
    return found[-1] if found else None


def answer_offset(completion) -> int | None:
    """The character offset where the last "Answer:" tag starts (the reasoning is everything before it), or None."""
    text = _text(completion)
    offset = text.rfind(ANSWER_TAG)
    return offset if offset >= 0 else None


def answer_number_span(completion) -> tuple[int, int] | None:
    """The characters `[start, end)` of the number after the last tagged answer ("Answer: 7" -> the "7"), or None
    without one: with `answer_offset`, where a completion's answer line places its number (`benchmarks/regime.py`
    counts the 80/20 rule's selected tokens there apart from the tag's)."""
    found = list(_TAGGED.finditer(_text(completion)))
    return found[-1].span(1) if found else None


def reasons_before_answer(completion) -> bool:
    """Whether the text before the answer tag works at least one arithmetic step out ("6 + 3 = 9"); False without a
    tag (an answer the model never tagged is not reasoning before the answer)."""
    offset = answer_offset(completion)
    return offset is not None and _STEP.search(_text(completion)[:offset]) is not None


def _equal(tagged: str | None, gold: str) -> bool:
    return tagged is not None and float(tagged) == float(gold)


def tagged_answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the tagged answer equals the row's gold `answer` (as numbers), else 0.0."""
    return [float(_equal(tagged_answer(c), gold)) for c, gold in zip(completions, answer, strict=True)]


def format_reward(completions: list, **kwargs) -> list[float]:
    """TRL reward function, the format-only control: 1.0 where the completion tags a number, whatever it is."""
    return [float(tagged_answer(c) is not None) for c in completions]
