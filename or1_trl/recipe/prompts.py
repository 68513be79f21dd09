"""What the trainer trains on: prompt ids, per-prompt statistics, the prompt pool and its sampler (paper §3.1).

- **Prompt ids** (`prompt_ids`): a dataset column (`OR1Config.prompt_id_column`, default `id`) or, without it, a
  stable hash of the prompt's content. Ids must be unique.
- **Statistics** (`PromptStats`): per stage and prompt, the number of samples, correct samples (reward ≥ 1, the
  same line as `solve_all`), truncated samples and the summed completion length. Every rank holds the same counts
  (built from rewards and lengths gathered over all ranks).
- **Pool and online filter** (`PromptPool`): at the start of each stage, prompts whose accuracy over the previous
  stage was ≥ `online_filter_threshold` (1.0: solved in every sample) leave the pool; optionally prompts never
  solved after `online_filter_unsolved_after` samples (all stages so far) leave too.
- **Sampler** (`PromptSampler`): TRL's `RepeatSampler` layout (each prompt `G` times in a row, each rollout batch
  repeated for the micro-steps that consume it) over the active pool only, resumable: its position is a count of
  rollout batches drawn, saved in checkpoints, and the order of each pass over the pool is a pure function of
  (seed, stage, pass), so every rank draws the same prompts without communicating.
- **Schedule** (`PromptSchedule`): all of the above for one run — the pool, the statistics and their log, the
  sampler position, the refill stream, the epoch of each record, stage entry and its checkpoint state — so that
  `OR1Trainer` only calls it from its hooks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

# ---------------------------------------------------------------------------------------------------------------
# Prompt ids
# ---------------------------------------------------------------------------------------------------------------


def content_id(prompt) -> str:
    """A stable id for a prompt (a string or a conversation): the first 16 hex digits of its SHA-256."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


#: Characters of a prompt's text in each of its `prompt_stats.jsonl` records (`prompt_preview`).
PROMPT_PREVIEW = 120


def prompt_preview(prompt, limit: int = PROMPT_PREVIEW) -> str:
    """The text a user recognises a prompt by: a string prompt, or a conversation's last user turn (its first turn
    when none is the user's), whitespace collapsed to single spaces, cut to `limit` characters with "…"."""
    if not isinstance(prompt, str):
        turns = [turn for turn in prompt if turn.get("role") == "user"] or list(prompt)
        content = turns[-1].get("content", "") if turns else ""
        prompt = content if isinstance(content, str) else " ".join(  # multimodal content: its text parts
            part.get("text", "") for part in content if isinstance(part, dict))
    text = " ".join(prompt.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def prompt_ids(dataset, column: str = "id") -> list[str]:
    """One id per row: `dataset[column]` as strings, or the content hash of `dataset["prompt"]` without that column.

    Ids from a column must be unique (a `ValueError` names the rows that share one): the statistics and the pool
    are keyed by them. Rows with identical prompts and no id column are the same prompt and share one id.
    """
    if column not in dataset.column_names:
        return [content_id(prompt) for prompt in dataset["prompt"]]
    ids = [str(value) for value in dataset[column]]
    first: dict[str, int] = {}
    duplicates = []
    for row, pid in enumerate(ids):
        if pid in first:
            duplicates.append((pid, first[pid], row))
        else:
            first[pid] = row
    if duplicates:
        shown = ", ".join(f"{pid!r} (rows {a} and {b})" for pid, a, b in duplicates[:5])
        raise ValueError(
            f"{len(duplicates)} duplicate prompt id(s) in column {column!r}: {shown}. Per-prompt statistics and the "
            "prompt pool need unique ids: de-duplicate the dataset, or point prompt_id_column at a unique column."
        )
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Counts for one prompt (one rollout batch, or accumulated over a stage)."""

    samples: int = 0
    correct: int = 0
    truncated: int = 0
    length_sum: int = 0

    def add(self, other: Outcome) -> None:
        self.samples += other.samples
        self.correct += other.correct
        self.truncated += other.truncated
        self.length_sum += other.length_sum

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else 0.0


def batch_outcomes(
    indices: list[int], rewards: list[float], truncated: list[bool], lengths: list[int]
) -> dict[int, Outcome]:
    """Per dataset index, the outcome of one rollout batch (rows of all ranks). A sample is correct at reward ≥ 1."""
    out: dict[int, Outcome] = {}
    for index, reward, trunc, length in zip(indices, rewards, truncated, lengths):
        o = out.setdefault(int(index), Outcome())
        o.samples += 1
        o.correct += int(reward >= 1.0)
        o.truncated += int(bool(trunc))
        o.length_sum += int(length)
    return out


class PromptStats:
    """Accumulated `Outcome`s per stage and prompt id (JSON-serialisable state for checkpoints)."""

    def __init__(self):
        self.by_stage: dict[int, dict[str, Outcome]] = {}

    def add(self, stage: int, prompt_id: str, outcome: Outcome) -> None:
        self.by_stage.setdefault(stage, {}).setdefault(prompt_id, Outcome()).add(outcome)

    def stage(self, stage: int) -> dict[str, Outcome]:
        return self.by_stage.get(stage, {})

    def total(self, prompt_id: str) -> Outcome:
        """Counts of `prompt_id` over every stage so far."""
        total = Outcome()
        for per_prompt in self.by_stage.values():
            if prompt_id in per_prompt:
                total.add(per_prompt[prompt_id])
        return total

    def state_dict(self) -> dict:
        return {
            str(stage): {pid: [o.samples, o.correct, o.truncated, o.length_sum] for pid, o in per_prompt.items()}
            for stage, per_prompt in self.by_stage.items()
        }

    def load_state_dict(self, state: dict) -> None:
        self.by_stage = {
            int(stage): {pid: Outcome(*counts) for pid, counts in per_prompt.items()}
            for stage, per_prompt in state.items()
        }


class StatsLog:
    """`prompt_stats.jsonl`: one record per prompt and rollout step, appended and flushed (main process only):
    `{prompt_id, stage, epoch, step, samples, correct, truncated, mean_length, prompt}` (`epoch`: the pass over the
    pool within the stage; `prompt`: the prompt's first characters, `prompt_preview`, when the schedule was given the
    texts; `one_shot.py` reads it).

    `size` (bytes) is saved in checkpoints; resuming truncates the file back to it, so a run killed after a
    checkpoint has no duplicated or missing steps once resumed.
    """

    def __init__(self, path: str):
        self.path = path

    @property
    def size(self) -> int:
        return os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def append(self, records: list[dict]) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, size: int) -> None:
        if os.path.exists(self.path) and self.size > size:
            with open(self.path, "r+") as f:
                f.truncate(size)


# ---------------------------------------------------------------------------------------------------------------
# Pool and online filter
# ---------------------------------------------------------------------------------------------------------------


class PromptPool:
    """The dataset rows the sampler may draw, and why the others left."""

    def __init__(self, ids: list[str]):
        self.ids = ids
        self.active: list[int] = list(range(len(ids)))
        self.removed: dict[str, dict] = {}  # prompt id -> {"stage": s, "reason": ...}
        self.stage = 0  # the stage this pool was built for

    def __len__(self) -> int:
        return len(self.active)

    def apply_online_filter(
        self, stats: PromptStats, new_stage: int, threshold: float | None, unsolved_after: int | None
    ) -> dict[str, int]:
        """Start `new_stage`: drop the prompts mastered in the previous stage (accuracy ≥ `threshold`, among those
        sampled there) and, if `unsolved_after` is set, those never solved in `unsolved_after` or more samples.
        Returns how many prompts (ids; rows with one id leave together) left for each reason."""
        previous = stats.stage(new_stage - 1)
        counts = {"solved": 0, "unsolved": 0}
        keep = []
        for index in self.active:
            pid = self.ids[index]
            reason = None
            if threshold is not None and pid in previous and previous[pid].accuracy >= threshold:
                reason = "solved"
            elif unsolved_after:
                total = stats.total(pid)
                if total.samples >= unsolved_after and total.correct == 0:
                    reason = "unsolved"
            if reason is None:
                keep.append(index)
            elif pid not in self.removed:
                self.removed[pid] = {"stage": new_stage, "reason": reason}
                counts[reason] += 1
        self.active = keep
        self.stage = new_stage
        return counts

    def state_dict(self) -> dict:
        return {"stage": self.stage, "active": self.active, "removed": self.removed}

    def load_state_dict(self, state: dict) -> None:
        self.stage, self.active, self.removed = state["stage"], list(state["active"]), dict(state["removed"])


# ---------------------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------------------


class PromptSampler(Sampler[int]):
    """TRL's `RepeatSampler` layout over the active pool, resumable from a count of rollout batches drawn.

    Yields, for each rollout batch of `batch_size` prompts (all ranks): every prompt `num_generations` times in a
    row, the whole batch `repeat_count` times (= `num_iterations × steps_per_generation`, the micro-steps that
    consume it). A pass is one permutation of the pool; a last incomplete batch of a pass is dropped (as TRL's
    sampler does). The permutation of pass p is drawn from `seed + 1_000_003·stage + p`, so the order depends only
    on (seed, stage, pass) and every rank computes the same one. Iteration never ends: the trainer stops it.

    `consumed` — rollout batches drawn so far in this stage — is advanced by the trainer when a batch is generated
    (not when the data loader prefetches), saved in checkpoints, and where a new iterator starts.
    """

    def __init__(self, pool: list[int], batch_size: int, num_generations: int, repeat_count: int, seed: int,
                 stage: int = 0, consumed: int = 0):
        if batch_size > len(pool):
            raise ValueError(f"the prompt pool holds {len(pool)} prompts, fewer than one batch of {batch_size}")
        self.pool = list(pool)
        self.batch_size = batch_size
        self.num_generations = num_generations
        self.repeat_count = repeat_count
        self.seed = seed
        self.stage = stage
        self.consumed = consumed

    @property
    def batches_per_pass(self) -> int:
        return len(self.pool) // self.batch_size

    def batch(self, k: int) -> list[int]:
        """The prompts (dataset indices) of rollout batch `k` of this stage."""
        pass_index, position = divmod(k, self.batches_per_pass)
        generator = torch.Generator().manual_seed(self.seed + 1_000_003 * self.stage + pass_index)
        order = torch.randperm(len(self.pool), generator=generator).tolist()
        start = position * self.batch_size
        return [self.pool[i] for i in order[start : start + self.batch_size]]

    def __iter__(self) -> Iterator[int]:
        k = self.consumed
        while True:
            prompts = self.batch(k)
            for _ in range(self.repeat_count):
                for index in prompts:
                    yield from [index] * self.num_generations
            k += 1

    def __len__(self) -> int:  # one pass over the pool, as RepeatSampler counts it
        return self.batches_per_pass * self.batch_size * self.num_generations * self.repeat_count


# ---------------------------------------------------------------------------------------------------------------
# The schedule: pool, statistics, sampler position and refill stream of one run, stage by stage
# ---------------------------------------------------------------------------------------------------------------

PROMPTS_STATE_FILE = "or1_prompts.json"  # pool, sampler position, size of prompt_stats.jsonl
PROMPT_STATS_STATE_FILE = "or1_prompt_stats.json"  # the aggregate per-prompt statistics


class PromptSchedule:
    """What the trainer draws its prompts from, stage by stage (paper §3.1, §3.2.2), and what it learnt about them.

    Owns the prompt pool (`pool`), the per-prompt statistics (`stats`) and their log (`log`, `prompt_stats.jsonl`),
    the sampler's position (`position`: rollout batches drawn in the stage, and refill batches drawn), the refill
    stream (its own `PromptSampler`, seeded `seed + 1`), the epoch of each record, stage entry (the online filter
    and its error) and its own checkpoint state (`state` / `load_state`). Every rank holds the same schedule (it is
    fed rewards gathered over all ranks); only the main process writes the log.

    Args:
        ids: one prompt id per dataset row (`prompt_ids`).
        seed: the run's seed (the samplers' permutations).
        log_path: path of `prompt_stats.jsonl`.
        texts: one `prompt_preview` per dataset row, written beside each record's id (None: ids only).
    """

    STATE_FILES = (PROMPTS_STATE_FILE, PROMPT_STATS_STATE_FILE)

    @classmethod
    def over(cls, dataset, id_column: str | None, seed: int, log_path: str, index_column: str):
        """`(schedule, dataset)`: the schedule over a map-style `datasets.Dataset` (ids by `prompt_ids`), and the
        dataset with `index_column`, each row's index, added for the per-prompt statistics."""
        prompts = dataset["prompt"]
        schedule = cls(prompt_ids(dataset, id_column), seed, log_path, texts=[prompt_preview(p) for p in prompts])
        return schedule, dataset.add_column(index_column, list(range(len(dataset))))

    def __init__(self, ids: list[str], seed: int, log_path: str, texts: list[str] | None = None):
        self.ids = ids
        self.texts = texts  # each row's `prompt_preview`, for the log (None: the log names prompts by id only)
        self.seed = seed
        self.pool = PromptPool(ids)
        self.stats = PromptStats()
        self.log = StatsLog(log_path)
        self.position = {"stage": 0, "consumed": 0, "refill": 0}  # rollout batches drawn in the stage
        self.sampler: PromptSampler | None = None  # the data loader's, with stages
        self._refill: PromptSampler | None = None

    def enter_stage(self, index: int, start_step: int, batch_size: int, threshold: float | None,
                    unsolved_after: int | None, warn: Callable[[str], None] = lambda message: None) -> None:
        """Start stage `index` (if the pool was built for an earlier one): the online filter for every stage between,
        each saying what it removed (`warn(message)`), and the sampler position back to the stage's start. A pool
        left smaller than one batch of `batch_size` prompts is a `ValueError` saying why and what to change."""
        if self.pool.stage >= index:
            return
        for new_stage in range(self.pool.stage + 1, index + 1):
            removed = self.pool.apply_online_filter(self.stats, new_stage, threshold, unsolved_after)
            warn(f"Stage {new_stage} starts at step {start_step}: the online filter removed {removed['solved']} "
                 f"solved and {removed['unsolved']} never-solved prompts; pool: {len(self.pool)} rows.")
        self.position = {"stage": index, "consumed": 0, "refill": 0}
        if len(self.pool) < batch_size:
            raise ValueError(
                f"Stage {index}: the online filter left {len(self.pool)} prompts in the pool, fewer than one batch of "
                f"{batch_size} — {removed['solved']} left for accuracy >= online_filter_threshold={threshold} in "
                f"stage {index - 1}, {removed['unsolved']} for online_filter_unsolved_after={unsolved_after}. Raise "
                "the threshold (or set it to None), unset online_filter_unsolved_after, add prompts, or lower the "
                "stage's batch_size."
            )

    def new_sampler(self, stage: int, batch_size: int, num_generations: int, repeat_count: int) -> PromptSampler:
        """The data loader's sampler over the active pool, from the saved position (0 at a stage start)."""
        self.sampler = PromptSampler(self.pool.active, batch_size=batch_size, num_generations=num_generations,
                                     repeat_count=repeat_count, seed=self.seed, stage=stage,
                                     consumed=self.position["consumed"])
        return self.sampler

    def refill_rows(self, stage: int, num_groups: int, num_generations: int) -> list[int]:
        """Dataset rows of the next refill batch (all ranks): `num_groups` prompts of the pool, each G times, from a
        stream of its own (not the data loader's), resumed from its saved position."""
        refill = self._refill
        if refill is None or refill.stage != stage or refill.batch_size != num_groups:
            refill = self._refill = PromptSampler(self.pool.active, num_groups, num_generations, 1, seed=self.seed + 1,
                                                  stage=stage, consumed=self.position.get("refill", 0))
        prompts = refill.batch(refill.consumed)
        refill.consumed += 1
        self.position["refill"] = refill.consumed
        return [index for index in prompts for _ in range(num_generations)]

    def record(self, stage: int, step: int, rows: list[list[int]], rewards: list[float], prompts_per_batch: int,
               refill: bool = False, write_log: bool = True) -> list[dict]:
        """One rollout's outcomes (rows of all ranks) into the statistics and, with `write_log`, `prompt_stats.jsonl`;
        a regular rollout (not a refill) then counts one rollout batch drawn. Returns the records.

        Args:
            rows: `[N, 3]` per row: dataset index, truncated, completion length.
            rewards: `[N]` scalar rewards.
            prompts_per_batch: prompts per rollout batch (all ranks).

        A record's `epoch` is the pass over the pool (within its stage) its rollout batch belongs to: the sampler
        draws `len(pool) // prompts_per_batch` batches per pass, every prompt at most once (TRL's `RepeatSampler` and
        `PromptSampler` alike); refill batches count in the epoch of the rollout they refill."""
        index, truncated, lengths = (list(column) for column in zip(*rows))
        batches_per_pass = max(1, len(self.pool) // prompts_per_batch)
        epoch = (self.position["consumed"] - (1 if refill else 0)) // batches_per_pass
        records = []
        for row, outcome in batch_outcomes(index, rewards, truncated, lengths).items():
            pid = self.ids[row]
            self.stats.add(stage, pid, outcome)
            records.append({"prompt_id": pid, "stage": stage, "epoch": epoch, "step": step, "samples": outcome.samples,
                            "correct": outcome.correct, "truncated": outcome.truncated,
                            "mean_length": outcome.length_sum / outcome.samples,
                            **({"prompt": self.texts[row]} if self.texts is not None else {})})
        if write_log:
            self.log.append(records)
        if not refill:
            self.position["consumed"] += 1  # rollout batches drawn in this stage (with or without stages)
            if self.sampler is not None:
                self.sampler.consumed = self.position["consumed"]
        return records

    def state(self) -> dict[str, dict]:
        """`{file name: JSON state}` for a checkpoint."""
        return {
            PROMPTS_STATE_FILE: {"pool": self.pool.state_dict(), "sampler": dict(self.position),
                                 "stats_log_size": self.log.size},
            PROMPT_STATS_STATE_FILE: self.stats.state_dict(),
        }

    def load_state(self, states: dict[str, dict], truncate_log: bool = True) -> None:
        """Restore from `state()`'s files; with `truncate_log` (the main process) drop what was logged after them."""
        prompts = states[PROMPTS_STATE_FILE]
        self.pool.load_state_dict(prompts["pool"])
        self.position = dict(prompts["sampler"])
        self.stats.load_state_dict(states[PROMPT_STATS_STATE_FILE])
        if truncate_log:
            self.log.truncate(prompts["stats_log_size"])
