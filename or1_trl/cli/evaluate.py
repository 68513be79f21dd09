"""`or1-trl eval`: `EvalArguments`, then `or1_trl.eval.evaluation.evaluate` (avg@n, pass@k, maj@n with intervals)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ..eval.evaluation import BENCHMARKS, DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_TEMPLATE
from .parsing import (BackendArguments, check_at_least_one, check_output_dir, command_parser, failure_line,
                      input_errors, parse_command)

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
    problem_column: str | None = field(default=None, metadata={
        "help": "Column with the problem (default: 'problem'; a file without one but with a 'prompt' column, as "
        "or1-trl train reads it, is taken in that training format: its prompts as they are)."})
    answer_column: str | None = field(default=None, metadata={
        "help": "Column with the gold answer(s) (default: 'answer')."})
    id_column: str | None = field(default=None,
                                  metadata={"help": "Column with a unique problem id (default: row index)."})
    prompt_template: str | None = field(default=None, metadata={
        "help": "User message; {problem} is replaced by the problem (a problem that is a list of messages is sent as "
        "it is). Default: the problem, then 'Please reason step by step, and put your final answer within "
        "\\boxed{}.'; for a training-format file, the prompt alone."})
    no_chat_template: bool = field(default=False, metadata={
        "help": "Send the filled template as plain text instead of a chat turn (base models)."})
    limit: int | None = field(default=None,
                              metadata={"help": "Only the first N problems of each benchmark (smoke runs)."})
    n: int = field(default=32, metadata={"help": "Samples per problem (paper §8.1: 32 for AIME)."})
    k: list[int] | None = field(default=None, metadata={"help": "pass@k for these k (default: 1, 2, 4, ..., n)."})
    preset: str = field(default="paper", metadata={
        "help": "Temperature/top-p: paper (1.0, 1.0) or open-r1 (0.6, 0.95); --temperature/--top_p win.",
        "choices": sorted(EVAL_PRESETS)})
    temperature: float | None = field(default=None, metadata={"help": "Sampling temperature (default: the preset's)."})
    top_p: float | None = field(default=None, metadata={"help": "Nucleus top-p (default: the preset's)."})
    max_tokens: int | None = field(default=None, metadata={
        "help": f"Completion tokens. Default: {DEFAULT_MAX_TOKENS} (the paper's), or, when every benchmark is a "
        "training-format file and --model an OR1 run's output_dir, the completion length it trained with (its model "
        "card)."})
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
            top_p=top_p if self.top_p is None else self.top_p, max_tokens=self.max_tokens or DEFAULT_MAX_TOKENS,
            seed=self.seed)
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
        self.assumed = self._training_format_defaults()  # the templates, an unset max_tokens
        self.settings = dataclasses.replace(self.settings, max_tokens=self.max_tokens)
        for name in self.names:  # samples of earlier runs must have been taken with these settings
            samples = os.path.join(self.output_dir, f"{name}.jsonl")
            if os.path.exists(samples):
                SampleStore(samples, self.settings).close()


    def _training_format_defaults(self) -> list[str]:
        """Fill `templates` (`{benchmark: user turn}`) and an unset `max_tokens`: a training-format file
        (`evaluation.is_training_format`) is sent as `or1-trl train` read it — its prompts, no instruction added —
        and, when every benchmark is one, for as many tokens as the OR1 run in `--model` trained with. Returns a
        line saying so per assumption (`or1-trl eval` prints them before sampling)."""
        from ..eval.evaluation import TRAINING_TEMPLATE, is_training_format
        from ..eval.model_card import trained_completion_length

        training = [name for spec, name in zip(self.benchmarks, self.names)
                    if is_training_format(spec, self.problem_column)]
        self.templates = {name: self.prompt_template or (TRAINING_TEMPLATE if name in training
                                                         else DEFAULT_PROMPT_TEMPLATE) for name in self.names}
        lines = []
        for name in training:
            turn = ("plain text (--no_chat_template), as or1-trl train sends a string prompt by default" if
                    self.no_chat_template else "a user turn through the chat template, as or1-trl train "
                    "--chat_prompts true trains on string prompts (--no_chat_template: plain text, as it does "
                    "without)")
            lines.append(f"{name}: the training format (a 'prompt' column, no 'problem'): each prompt is sent as it is"
                         + ("" if self.prompt_template else ", no instruction added (--prompt_template to add one)")
                         + f"; a string prompt as {turn}; a conversation as it is; the gold from 'answer' (or "
                         "reward_model.ground_truth).")
        trained = trained_completion_length(self.model) if training and len(training) == len(self.names) else None
        if self.max_tokens is None:
            self.max_tokens = trained or DEFAULT_MAX_TOKENS
            if trained:
                lines.append(f"max_tokens: {trained}, the completion length {self.model} was trained with (its model "
                             "card); --max_tokens to change.")
            elif training:
                lines.append(f"max_tokens: {DEFAULT_MAX_TOKENS} (the paper's); --max_tokens to match your training "
                             "run.")
        return lines


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
    from ..generation.finite_logits import NonFiniteLogitsError

    parser = eval_parser(prog)
    (args,) = parse_command(parser, argv)
    with input_errors(parser):
        benchmarks = {}
        for spec, name in zip(args.benchmarks, args.names):
            problems = load_problems(spec, args.problem_column, args.answer_column, args.id_column)
            benchmarks[name] = problems[: args.limit] if args.limit else problems
    for line in args.assumed:  # what a training-format file was taken as, before anything loads
        print(line, flush=True)
    try:
        backend = args.make_backend(device=args.device)
    except (ValueError, ImportError) as exc:  # a backend that cannot run here (checked before anything loads)
        parser.error(str(exc))
    with failure_line(parser, NonFiniteLogitsError):  # the model's logits NaN at sampling: one line, exit 1
        summary = evaluate(backend, benchmarks, args.settings, args.output_dir,
                           args.model or backend.served_model(), ks=args.k, template=args.templates,
                           chat=not args.no_chat_template, resamples=args.resamples, confidence=args.confidence)
    print(summary_markdown(summary), end="", flush=True)
    print(f"Per-problem samples and the summary are in {args.output_dir}", flush=True)
    card = report_to_model_card(args.model, args.output_dir, summary)
    if card:  # a card OR1Trainer wrote: it shows the results
        print(f"Updated the evaluation section of {card}", flush=True)
    return summary
