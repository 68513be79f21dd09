"""`or1-trl prepare`: `PrepareArguments`, then `or1_trl.data.prepare` (paper §6.1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .parsing import (DatasetArguments, check_at_least_one, check_output_dir, command_parser, input_errors,
                      parse_command)

PREPARE_SKIPS = ("dedup", "figures", "decontaminate", "verify")


@dataclass(kw_only=True)
class PrepareArguments(DatasetArguments):
    """Arguments of `or1-trl prepare`; `__post_init__` checks `--skip`, `--ngram`, `--overlap_threshold`,
    `--num_proc` and the output directory."""

    output_dir: str = field(metadata={"help": "Where the kept and the removed rows go."})
    problem_column: str = field(default="prompt", metadata={"help": "Problem text: a string or a conversation."})
    answer_column: str = field(default="answer", metadata={
        "help": "Gold answer(s) of plain datasets (the released format: reward_model.ground_truth)."})
    solution_column: str = field(default="solution", metadata={
        "help": "Reference solution to re-verify each gold answer against (step skipped without it)."})
    eval_sets: str = field(default="aime24,aime25,math500", metadata={
        "help": "Comma-separated evaluation sets to decontaminate against: aime24, aime25, math500 (Hub, loaded when "
        "this runs), local files (NAME=PATH.jsonl/.parquet/.csv), Hub ids; 'none': no decontamination."})
    eval_column: str | None = field(default=None, metadata={
        "help": "Problem column of the evaluation sets (default: problem, question or prompt, the first present)."})
    ngram: int = field(default=8, metadata={"help": "n of the word n-grams compared."})
    overlap_threshold: float = field(default=0.5, metadata={
        "help": "Remove a problem sharing at least this fraction of an evaluation problem's n-grams."})
    skip: str = field(default="", metadata={"help": f"Comma-separated steps not to run: {', '.join(PREPARE_SKIPS)}."})
    num_proc: int | None = field(default=None, metadata={"help": "Processes for datasets.map and Math-Verify."})

    def __post_init__(self):
        unknown = [s for s in self.steps_skipped if s not in PREPARE_SKIPS]
        if unknown:
            raise ValueError(f"--skip {','.join(unknown)}: unknown step; the steps are {', '.join(PREPARE_SKIPS)}")
        if self.ngram < 1 or not 0.0 < self.overlap_threshold <= 1.0:
            raise ValueError("--ngram must be >= 1 and --overlap_threshold in (0, 1]")
        check_at_least_one(self, "num_proc")
        check_output_dir(self.output_dir)

    @property
    def steps_skipped(self) -> tuple[str, ...]:
        return tuple(s for s in self.skip.split(",") if s)

    @property
    def eval_specs(self) -> list[str]:
        """The evaluation sets to decontaminate against (none when the step is skipped)."""
        if "decontaminate" in self.steps_skipped or self.eval_sets.strip().lower() == "none":
            return []
        return [s for s in self.eval_sets.split(",") if s]


def prepare_parser(prog: str | None = "or1-trl prepare"):
    return command_parser(
        PrepareArguments, prog,
        "Prepare training data as the paper does (§6.1): exact and normalised de-duplication, problems with figures "
        "or URLs dropped, decontamination against evaluation sets by n-gram overlap, each math answer re-verified "
        "against a reference solution with Math-Verify. Prints rows in, rows removed by each step and rows out; "
        "writes the kept rows (unchanged) to OUTPUT_DIR/data/SPLIT-00000-of-00001.parquet and the removed ones with "
        "their reason to OUTPUT_DIR/removed-SPLIT.jsonl. The released (verl) format is understood.")


def prepare(argv: list[str] | None = None, prog: str | None = "or1-trl prepare") -> None:
    """De-duplicate, drop figures/URLs, decontaminate and re-verify a dataset (paper §6.1)."""
    from ..data.prepare import load_eval_sets, overlap_report, prepare_dataset, write_prepared

    parser = prepare_parser(prog)
    (args,) = parse_command(parser, argv)
    with input_errors(parser):
        dataset = args.load(args.problem_column, "; name the problem's column with --problem_column")
        eval_sets = load_eval_sets(args.eval_specs, args.eval_column) if args.eval_specs else None
    result = prepare_dataset(dataset, problem_column=args.problem_column, answer_column=args.answer_column,
                             solution_column=args.solution_column, eval_sets=eval_sets, ngram=args.ngram,
                             threshold=args.overlap_threshold, skip=args.steps_skipped, num_proc=args.num_proc)
    data_path, removed_path = write_prepared(dataset, result, args.output_dir, args.split)
    print(result.table())
    overlaps = overlap_report(result)
    if overlaps:
        print(f"Overlapping pairs (training row ~ evaluation problem, {args.ngram}-grams):\n{overlaps}")
    print(f"kept rows: {data_path}\nremoved rows: {removed_path}", flush=True)
