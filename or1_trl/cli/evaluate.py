"""`or1-trl eval`: `EvalArguments`, then `or1_trl.eval.evaluation.evaluate` (avg@n, pass@k, maj@n with intervals)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..eval.evaluation import BENCHMARKS, DEFAULT_PROMPT_TEMPLATE
from .parsing import BackendArguments, check_at_least_one, check_output_dir, command_parser, input_errors, parse_command

#: `--preset`: (temperature, top_p). The paper's (§8.1) is the default; open-r1's is offered, not preferred.
EVAL_PRESETS = {"paper": (1.0, 1.0), "open-r1": (0.6, 0.95)}


@dataclass(kw_only=True)
class EvalArguments(BackendArguments):
    """Arguments of `or1-trl eval`: the model or server, the benchmarks, the sampling (paper §8.1), the report;
    `__post_init__` checks them all (the sampling settings, k, the benchmark names, the counts, the model path,
    the output directory and the samples of an earlier run there) and sets `settings` and `output_dir`."""

    device: str | None = field(default=None, metadata={
        "help": "HF: device (default: where from_pretrained puts it, CPU)."})
    benchmarks: list[str] = field(default_factory=lambda: ["aime24", "aime25"], metadata={
        "help": f"Named benchmarks ({', '.join(f'{k}: {v.hub_id}' for k, v in BENCHMARKS.items())}, loaded from the "
        "Hub) or local .jsonl/.json/.parquet files."})
    problem_column: str | None = field(default=None, metadata={"help": "Column with the problem (default: 'problem')."})
    answer_column: str | None = field(default=None, metadata={
        "help": "Column with the gold answer(s) (default: 'answer')."})
    id_column: str | None = field(default=None, metadata={"help": "Column with a unique problem id (default: row index)."})
    prompt_template: str = field(default=DEFAULT_PROMPT_TEMPLATE, metadata={
        "help": "User message; {problem} is replaced by the problem (a problem that is a list of messages is sent as "
        "it is)."})
    no_chat_template: bool = field(default=False, metadata={
        "help": "Send the filled template as plain text instead of a chat turn (base models)."})
    limit: int | None = field(default=None, metadata={"help": "Only the first N problems of each benchmark (smoke runs)."})
    n: int = field(default=32, metadata={"help": "Samples per problem (paper §8.1: 32 for AIME)."})
    k: list[int] | None = field(default=None, metadata={"help": "pass@k for these k (default: 1, 2, 4, ..., n)."})
    preset: str = field(default="paper", metadata={
        "help": "Temperature/top-p: paper (1.0, 1.0) or open-r1 (0.6, 0.95); --temperature/--top_p win.",
        "choices": sorted(EVAL_PRESETS)})
    temperature: float | None = field(default=None, metadata={"help": "Sampling temperature (default: the preset's)."})
    top_p: float | None = field(default=None, metadata={"help": "Nucleus top-p (default: the preset's)."})
    max_tokens: int = field(default=32768, metadata={"help": "Completion tokens."})
    seed: int = field(default=0, metadata={"help": "Sampling seed (per problem) and bootstrap seed."})
    output_dir: str | None = field(default=None, metadata={
        "help": "Where results go (default: MODEL/eval for a local model, else outputs/eval/<model>)."})
    resamples: int = field(default=10_000, metadata={"help": "Bootstrap resamples."})
    confidence: float = field(default=0.95, metadata={"help": "Interval level."})

    def __post_init__(self):
        from ..eval.evaluation import benchmark_name, check_benchmark_spec, check_ks, default_ks
        from ..eval.model_card import eval_output_dir
        from ..generation.sampling import SampleStore, SamplingSettings

        # Everything that can be wrong with the arguments fails here, before a model loads or a token is generated.
        temperature, top_p = EVAL_PRESETS[self.preset]
        self.settings = SamplingSettings(
            n=self.n, temperature=temperature if self.temperature is None else self.temperature,
            top_p=top_p if self.top_p is None else self.top_p, max_tokens=self.max_tokens, seed=self.seed)
        check_ks(self.k or default_ks(self.n), self.n)
        for spec in self.benchmarks:
            check_benchmark_spec(spec)
        if not 0 < self.confidence < 1:
            raise ValueError(f"--confidence must be in (0, 1), got {self.confidence}")
        check_at_least_one(self, "resamples", "limit")
        self.names = [benchmark_name(spec) for spec in self.benchmarks]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"two benchmarks share a name ({self.names}); their sample files would collide")
        self.check_backend()
        self.output_dir = self.output_dir or eval_output_dir(self.model)
        check_output_dir(self.output_dir)
        for name in self.names:  # samples of earlier runs must have been taken with these settings
            samples = os.path.join(self.output_dir, f"{name}.jsonl")
            if os.path.exists(samples):
                SampleStore(samples, self.settings).close()


def eval_parser(prog: str | None = "or1-trl eval"):
    return command_parser(
        EvalArguments, prog,
        "Evaluate a model on math benchmarks: avg@n, unbiased pass@k and maj@n, each with a bootstrap interval over "
        "problems, and the sampling standard error of avg@n. Writes one JSONL record per problem (resumable: finished "
        "problems are not sampled again), eval_summary.json and eval_summary.md.")


def evaluate_command(argv: list[str] | None = None, prog: str | None = "or1-trl eval") -> dict:
    """`or1-trl eval`: sample, score with math_reward, summarize with intervals; prints the table."""
    from ..eval.evaluation import evaluate, load_problems, summary_markdown
    from ..eval.model_card import report_to_model_card

    parser = eval_parser(prog)
    (args,) = parse_command(parser, argv)
    with input_errors(parser):
        benchmarks = {}
        for spec, name in zip(args.benchmarks, args.names):
            problems = load_problems(spec, args.problem_column, args.answer_column, args.id_column)
            benchmarks[name] = problems[: args.limit] if args.limit else problems
    try:
        backend = args.make_backend(device=args.device)
    except (ValueError, ImportError) as exc:  # a backend that cannot run here (checked before anything loads)
        parser.error(str(exc))
    summary = evaluate(backend, benchmarks, args.settings, args.output_dir, args.model or backend.served_model(),
                       ks=args.k, template=args.prompt_template, chat=not args.no_chat_template,
                       resamples=args.resamples, confidence=args.confidence)
    print(summary_markdown(summary), end="", flush=True)
    print(f"Per-problem samples and the summary are in {args.output_dir}", flush=True)
    card = report_to_model_card(args.model, args.output_dir, summary)
    if card:  # a card OR1Trainer wrote: it shows the results
        print(f"Updated the evaluation section of {card}", flush=True)
    return summary
