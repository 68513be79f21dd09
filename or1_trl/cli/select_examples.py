"""`or1-trl select-examples`: `SelectExamplesArguments`, then `or1_trl.data.one_shot` (1-shot RLVR)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .parsing import (DatasetArguments, check_at_least_one, check_output_dir, command_parser, input_errors,
                      parse_command)


@dataclass(kw_only=True)
class SelectExamplesArguments(DatasetArguments):
    """Arguments of `or1-trl select-examples`; `__post_init__` checks the counts and the output directory."""

    stats: str = field(metadata={"help": "<output_dir>/prompt_stats.jsonl of the normal run."})
    prompt_column: str = field(default="prompt", metadata={"help": "Prompt column (as --prompt_column in training)."})
    prompt_id_column: str = field(default="id", metadata={
        "help": "Column of prompt ids (as OR1Config.prompt_id_column); without it, a hash of the prompt."})
    top: int = field(default=1, metadata={"help": "How many of the best-ranked prompts to keep (1: π₁)."})
    replicate: int = field(default=128, metadata={
        "help": "Rows of the written dataset: the chosen prompts cycled to this size (the paper: 128, one rollout "
        "batch)."})
    output_dir: str = field(metadata={"help": "Where the replicated dataset goes."})
    show: int = field(default=20, metadata={"help": "Ranking lines to print."})

    def __post_init__(self):
        check_at_least_one(self, "top", "replicate", "show")
        check_output_dir(self.output_dir)


def select_examples_parser(prog: str | None = "or1-trl select-examples"):
    return command_parser(
        SelectExamplesArguments, prog,
        "1-shot RLVR: rank the prompts of a normal run by their historical variance score (standard deviation of each "
        "prompt's per-epoch training accuracy, from prompt_stats.jsonl), print the ranking, and write the TOP prompts "
        "replicated to REPLICATE rows as OUTPUT_DIR/data/train-00000-of-00001.parquet (`or1-trl train --dataset_name "
        "OUTPUT_DIR`). See examples/recipes/one_shot_rlvr.yaml.")


def select_examples(argv: list[str] | None = None, prog: str | None = "or1-trl select-examples") -> None:
    """Rank a run's prompts by historical variance and write the best ones, replicated (1-shot RLVR)."""
    from ..data.released import prompt_text
    from ..data.one_shot import rank_prompts, ranking_table, read_stats, write_selection
    from ..data.one_shot import select_examples as choose

    parser = select_examples_parser(prog)
    (args,) = parse_command(parser, argv)
    with input_errors(parser):
        ranking = rank_prompts(read_stats(args.stats))
        dataset = args.load(args.prompt_column)
        if args.prompt_column != "prompt":
            dataset = dataset.rename_column(args.prompt_column, "prompt")
        selected, chosen = choose(dataset, ranking, args.top, args.replicate, args.prompt_id_column)
    texts = {chosen[i].prompt_id: prompt_text(selected[i]["prompt"]) for i in range(min(len(chosen), len(selected)))}
    print(f"{len(ranking)} prompts ranked by historical variance score (std of per-epoch accuracy):")
    print(ranking_table(ranking, args.show, texts))
    path = write_selection(selected, chosen, args.output_dir,
                           {"stats": os.path.abspath(args.stats), "dataset": args.dataset_name, "split": args.split})
    print(f"wrote {len(selected)} rows ({args.top} prompt{'s' if args.top > 1 else ''} cycled) to {path}", flush=True)
