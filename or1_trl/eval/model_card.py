"""The OR1 part of the model card that `OR1Trainer` writes with TRL's card machinery.

TRL renders the card (`_BaseTrainer.create_model_card` → `trl.trainer.utils.generate_model_card`, template
`trl/templates/lm_model_card.md`): metadata (base model, datasets, tags — TRL's plus `or1`), quick start, framework
versions, and the citation of the trainer's paper (`OR1Trainer._paper`: the seed papers below). `OR1Trainer`
then inserts one section, built here, before "### Framework versions":

- base model, training data, steps;
- the stages of the run (paper §3.2.2) and the OR1 settings (rejection sampling, adaptive entropy control and its
  preset/target, the 80/20 rule, …);
- the final training metrics (reward, entropy, kept-group fraction, pool size, entropy coefficient);
- the evaluation results with their intervals, when `or1-trl eval` wrote `<output_dir>/eval/eval_summary.json`
  (`or1-trl eval --model <output_dir>` does; it also refreshes this block of an existing card).

The section sits between markers, so writing the card again (every checkpoint, `push_to_hub`) replaces it.

TRL's own part states what it does not know: its template links `base_model` and the dataset to the Hub even when
they are a local folder or file ("a fine-tuned version of [None](https://huggingface.co/None)", a dataset page for
`mytrain.jsonl`), its quick start loads `model="None"` before a push, and its metadata carries a misspelt
`licence: license`. `tidy_trl_card` corrects these after TRL writes the card: the base model as its user knows it
(`base_model_name`: a Hub id, or the name a local folder records), a local dataset by its file name, nothing that is
unknown and never a path of the machine that trained.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Mapping

SECTION_START, SECTION_END = "<!-- or1-trl -->", "<!-- /or1-trl -->"
EVAL_START, EVAL_END = "<!-- or1-trl:eval -->", "<!-- /or1-trl:eval -->"
EVAL_SUBDIR = "eval"  # where `or1-trl eval --model <output_dir>` writes by default

# docstyle-ignore
CITATIONS = textwrap.dedent("""\
    @article{he2025skywork,
        title        = {{Skywork Open Reasoner 1 Technical Report}},
        author       = {Jujie He and Jiacai Liu and Chris Yuhao Liu and Rui Yan and Chaojie Wang and Peng Cheng and Xiaoyu Zhang and Fuxiang Zhang and Jiacheng Xu and Wei Shen and Siyuan Li and Liang Zeng and Tianwen Wei and Cheng Cheng and Bo An and Yang Liu and Yahui Zhou},
        year         = 2025,
        eprint       = {arXiv:2505.22312},
    }

    @article{wang2025beyond,
        title        = {{Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning}},
        author       = {Shenzhi Wang and Le Yu and Chang Gao and Chujie Zheng and Shixuan Liu and Rui Lu and Kai Dang and Xionghui Chen and Jianxin Yang and Zhenru Zhang and Yuqiong Liu and An Yang and Andrew Zhao and Yang Yue and Shiji Song and Bowen Yu and Gao Huang and Junyang Lin},
        year         = 2025,
        eprint       = {arXiv:2506.01939},
    }

    @article{wang2025reinforcement,
        title        = {{Reinforcement Learning for Reasoning in Large Language Models with One Training Example}},
        author       = {Yiping Wang and Qing Yang and Zhiyuan Zeng and Liliang Ren and Lucas Liu and Baolin Peng and Hao Cheng and Xuehai He and Kuan Wang and Jianfeng Gao and Weizhu Chen and Shuohang Wang and Simon Shaolei Du and Yelong Shen},
        year         = 2025,
        eprint       = {arXiv:2504.20571},
    }""")  # noqa: E501 (BibTeX entries as TRL writes them: one line per field)

#: `OR1Trainer._paper` (TRL's card: "trained with OR1, a method introduced in …" and "Cite OR1 as: …").
PAPER = {"title": "Skywork Open Reasoner 1 Technical Report", "id": "2505.22312", "citation": CITATIONS}

#: Training metrics reported in the card: (log key, label).
FINAL_METRICS = (
    ("reward", "reward"),
    ("entropy", "entropy"),
    ("rejection/kept_group_frac", "kept-group fraction"),
    ("pool/size", "pool size"),
    ("entropy_coef", "entropy coefficient"),
)


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def final_metrics(log_history: list[dict]) -> tuple[int | None, dict]:
    """`(step, {key: value})` of the last training log entry (one with a `reward`)."""
    for entry in reversed(log_history):
        if "reward" in entry:
            return entry.get("step"), {key: entry.get(key) for key, _ in FINAL_METRICS}
    return None, {}


def or1_settings(args) -> list[tuple[str, str]]:
    """`(setting, value)` rows of the OR1 recipe (a plain `GRPOConfig`: TRL's objective)."""
    rows = [
        ("learning rate",
         f"{_fmt(args.learning_rate)} ({getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)})"),
        ("clip ε (low / high)", f"{_fmt(args.epsilon)} / {_fmt(args.epsilon_high or args.epsilon)}"),
        ("sampling temperature", _fmt(args.temperature)),
        ("loss type, β (KL)", f"{args.loss_type}, {_fmt(args.beta)}"),
    ]
    if args.recipe == "trl":
        return rows + [("objective", "TRL's GRPO (a plain GRPOConfig: no OR1 settings)")]
    entropy = "off"
    if args.use_adaptive_entropy:
        entropy = (
            f"adaptive (eq. 3.2), preset `{args.entropy_preset}`: target {_fmt(args.entropy_target)}, "
            f"Δ {_fmt(args.entropy_coef_delta)}, c ∈ [{_fmt(args.entropy_coef_min)}, {_fmt(args.entropy_coef_max)}], "
            f"c₀ {_fmt(args.entropy_coef)}, estimator `{args.entropy_estimator}`"
        )
    elif args.entropy_coef:
        entropy = f"fixed coefficient {_fmt(args.entropy_coef)}"
    eighty_twenty = "off (all tokens)"
    if args.top_entropy_quantile < 1:
        eighty_twenty = (f"top {_fmt(args.top_entropy_quantile)} of tokens by entropy, normalised over "
                         f"`{args.top_entropy_normalization}`")
    return rows + [
        ("rejection sampling (§3.1)", f"`{args.rejection_sampling}`"
         + (f", refill up to {args.rejection_refill_rounds} rounds" if args.rejection_refill_rounds else "")),
        ("entropy control", entropy),
        ("80/20 rule", eighty_twenty),
        ("online filter (stage starts)", f"accuracy ≥ {_fmt(args.online_filter_threshold)} leaves the pool"
         + (f"; unsolved after {args.online_filter_unsolved_after} samples too" if args.online_filter_unsolved_after
            else "")),
        ("mask truncated completions", _fmt(args.mask_truncated_completions)),
    ] + ([("rollout correction (vLLM)", _rollout_correction(args))] if args.use_vllm else [])


def _rollout_correction(args) -> str:
    if args.rollout_correction == "trl":
        if not args.vllm_importance_sampling_correction:
            return "TRL's: off"
        low, high = _fmt(args.vllm_importance_sampling_clip_min), _fmt(args.vllm_importance_sampling_clip_max)
        return f"TRL's: `{args.vllm_importance_sampling_mode}`, clip [{low}, {high}]"
    return f"`{args.rollout_correction}`" + (f", cap {_fmt(args.rollout_correction_cap)}"
                                             if args.rollout_correction != "off" else "")


def stage_rows(shapes) -> list[list[str]]:
    """One row per stage (`stages.StageShape`s, resolved for the run's world size)."""
    return [
        [str(s.index), f"{s.start_step}–{s.until_step}", str(s.max_completion_length), str(s.batch_size),
         str(s.mini_batch_size), str(s.num_generations), _fmt(s.temperature), _fmt(s.learning_rate)]
        for s in shapes
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def eval_block(summary: Mapping | None) -> str:
    """The evaluation part of the section (between its own markers), from an `or1-trl eval` summary."""
    from .evaluation import summary_markdown

    if summary:
        table = summary_markdown(summary, name_model=False)  # the model is this card's: its path is the machine's
        body = f"`or1-trl eval` results (`{EVAL_SUBDIR}/eval_summary.json`):\n\n{table}"
    else:
        body = (f"No `or1-trl eval` results yet: `or1-trl eval --model <output_dir>` writes them to "
                f"`<output_dir>/{EVAL_SUBDIR}/` and into this card.\n")
    return f"{EVAL_START}\n### Evaluation\n\n{body}{EVAL_END}"


def or1_section(args, state, base_model: str | None, dataset_name: str | None, num_prompts: int | None,
                eval_summary: Mapping | None, stage_shapes=()) -> str:
    """The card's OR1 section (markdown, between `SECTION_START` and `SECTION_END`): `args` the run's config,
    `state` its `TrainerState`, `stage_shapes` its stages (`stages.StageShape`, none for a single-stage run)."""
    data = "not named (pass `dataset_name=` to `push_to_hub`)"
    if dataset_name:
        data = f"`{dataset_name}`" if is_hub_dataset(dataset_name) else \
            f"a local dataset, `{os.path.basename(os.path.normpath(dataset_name))}`"
    if num_prompts is not None:
        data += f", {num_prompts} prompts"
    parts = [
        SECTION_START,
        "## OR1 training",
        "",
        "Trained with `OR1Trainer` (or1-trl): TRL's `GRPOTrainer` with the Skywork-OR1 MAGIC objective.",
        "",
        *([f"- **Base model:** `{base_model}`"] if base_model else []),
        f"- **Training data:** {data}",
        f"- **Steps:** {state.global_step} of {state.max_steps}",
        "",
    ]
    stages = stage_rows(stage_shapes)
    if stages:
        parts += ["### Stages (paper §3.2.2)", "",
                  _table(["stage", "steps", "completion tokens", "prompts / rollout", "prompts / step", "group",
                          "temperature", "learning rate"], stages), ""]
    settings = [list(r) for r in or1_settings(args)]
    if not stages:
        settings.insert(0, ["completion tokens, group size", f"{args.max_completion_length}, {args.num_generations}"])
    parts += ["### Settings", "", _table(["setting", "value"], settings), ""]
    step, metrics = final_metrics(state.log_history)
    if metrics:
        parts += [f"### Final training metrics (step {step})", "",
                  _table([label for _, label in FINAL_METRICS],
                         [[_fmt(metrics[key]) for key, _ in FINAL_METRICS]]), ""]
    parts += [eval_block(eval_summary), SECTION_END]
    return "\n".join(parts) + "\n"


def _replace_block(text: str, start: str, end: str, block: str) -> str | None:
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        return None
    return text[:i] + block.rstrip("\n") + text[j + len(end):]


def insert_section(card_text: str, section: str) -> str:
    """`card_text` with the OR1 section replaced, or inserted before TRL's "### Framework versions"."""
    replaced = _replace_block(card_text, SECTION_START, SECTION_END, section)
    if replaced is not None:
        return replaced
    for anchor in ("### Framework versions", "## Citations"):
        if anchor in card_text:
            i = card_text.index(anchor)
            return card_text[:i] + section + "\n" + card_text[i:]
    return card_text.rstrip("\n") + "\n\n" + section


def write_section(card_path: str, section: str) -> None:
    """Put the OR1 `section` into the model card TRL wrote at `card_path` (`insert_section`)."""
    with open(card_path, encoding="utf-8") as f:
        card = f.read()
    with open(card_path, "w", encoding="utf-8") as f:
        f.write(insert_section(card, section))


# --- What TRL's card says of the base model, the data and the snippet: only what is known, never a machine path ----
#: The sentence TRL's template (`trl/templates/lm_model_card.md`) opens the card with: it links `base_model` and the
#: dataset to the Hub even when they are a local folder or file ("a fine-tuned version of [None](…/None)").
TRL_FIRST_SENTENCE = re.compile(r"^This model is a fine-tuned version of .*$", flags=re.M)
#: The pipeline line of TRL's quick start: `model="{{ hub_model_id }}"` ("None" before the run is pushed).
TRL_SNIPPET_MODEL = re.compile(r'pipeline\("text-generation", model="None"')


def base_model_name(name_or_path: str | None) -> str | None:
    """The base model as its user knows it, or None when unknown — never a path of this machine.

    A name that is not a local folder is a Hub id, kept as given. A local folder names itself by what it records:
    `or1_model.json`'s `model` (a folder `or1-trl model` built, e.g. "SmolLM2-135M-Instruct"), else the `base_model`
    of its own card (an earlier run's output dir: that run's base model)."""
    if not name_or_path:
        return None
    folder = os.path.expanduser(name_or_path)
    if not os.path.isdir(folder):
        return name_or_path
    import json

    record = os.path.join(folder, "or1_model.json")
    if os.path.isfile(record):
        with open(record, encoding="utf-8") as f:
            return json.load(f).get("model") or None
    card = os.path.join(folder, "README.md")
    if os.path.isfile(card):
        from huggingface_hub import ModelCard

        base = ModelCard.load(card).data.base_model
        return base if isinstance(base, str) and base_model_name(base) == base else None
    return None


def is_hub_dataset(dataset_name: str | None) -> bool:
    """Whether `dataset_name` is a Hub dataset id rather than a local file or folder."""
    return bool(dataset_name) and not os.path.exists(os.path.expanduser(dataset_name))


def first_sentence(base_model: str | None, dataset_name: str | None) -> str:
    """The card's opening sentence: the base model and the data linked to the Hub only when they are on it."""
    sentence = "This model was fine-tuned"
    if base_model:
        on_hub = "/" in base_model  # a Hub id (`org/name`); a folder's recorded name is not linked
        sentence = ("This model is a fine-tuned version of "
                    + (f"[{base_model}](https://huggingface.co/{base_model})" if on_hub else base_model))
    if is_hub_dataset(dataset_name):
        sentence += f" on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset"
    elif dataset_name:
        sentence += f" on a local dataset (`{os.path.basename(os.path.normpath(dataset_name))}`)"
    return sentence + "."


def tidy_trl_card(card_path: str, base_model: str | None, dataset_name: str | None, model_ref: str) -> None:
    """Correct what TRL's card (written at `card_path`) states without knowing: its metadata's `base_model` (a Hub
    id or nothing), `datasets` (Hub datasets only) and TRL's misspelt `licence: license` (removed); its opening
    sentence (`first_sentence`); and the quick start's `model="None"` of a run not pushed (`model_ref`)."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_path)
    card.data.base_model = base_model if base_model and "/" in base_model else None
    if not is_hub_dataset(dataset_name):
        card.data.datasets = None
    card.data.pop("licence", None)
    text = TRL_FIRST_SENTENCE.sub(first_sentence(base_model, dataset_name), str(card), count=1)
    text = TRL_SNIPPET_MODEL.sub(f'pipeline("text-generation", model="{model_ref}"', text, count=1)
    with open(card_path, "w", encoding="utf-8") as f:
        f.write(text)


def snippet_model(args, hub_model_id: str | None) -> str:
    """What the quick start loads: the Hub id once pushed, else the output dir as given (its name if absolute)."""
    if hub_model_id:
        return hub_model_id
    return os.path.basename(os.path.normpath(args.output_dir)) if os.path.isabs(args.output_dir) else args.output_dir


def write_for_trainer(trainer, dataset_name: str | None, stage_shapes=()) -> None:
    """The OR1 section (`or1_section`) of the card TRL wrote for `trainer` (an `OR1Trainer`) into its
    `output_dir/README.md`: its config, state, base model, train dataset and stages, and the eval results found in
    `output_dir/eval` (`or1-trl eval --model <output_dir>`)."""
    from datasets import Dataset  # the trainer's libraries, loaded by the trainer already
    from trl.trainer.utils import get_config_model_id

    from .evaluation import read_summary

    args, train_dataset = trainer.args, trainer.train_dataset
    card_path = os.path.join(args.output_dir, "README.md")
    base_model = base_model_name(get_config_model_id(trainer.accelerator.unwrap_model(trainer.model).config))
    tidy_trl_card(card_path, base_model, dataset_name, snippet_model(args, trainer.hub_model_id))
    section = or1_section(
        args, trainer.state, base_model=base_model,
        dataset_name=dataset_name,
        num_prompts=len(train_dataset) if isinstance(train_dataset, Dataset) else None,
        eval_summary=read_summary(os.path.join(args.output_dir, EVAL_SUBDIR)), stage_shapes=stage_shapes)
    write_section(card_path, section)


def update_eval_block(card_path: str, summary: Mapping) -> bool:
    """Refresh the evaluation block of an OR1 card in place (what `or1-trl eval` does for a trained output dir).
    False when `card_path` is not an OR1 card."""
    if not os.path.isfile(card_path):
        return False
    with open(card_path, encoding="utf-8") as f:
        text = f.read()
    updated = _replace_block(text, EVAL_START, EVAL_END, eval_block(summary))
    if updated is None:
        return False
    tmp = f"{card_path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(updated)
    os.replace(tmp, card_path)
    return True


def trained_completion_length(model: str | None) -> int | None:
    """The completion length (tokens) a run's model was trained with, as its OR1 card (`MODEL/README.md`, written by
    `OR1Trainer`) states it: the settings' "completion tokens", or the last stage's. None for a model without one."""
    card = os.path.join(os.path.expanduser(model), "README.md") if model else None
    if card is None or not os.path.isfile(card):
        return None
    with open(card, encoding="utf-8") as f:
        text = f.read()
    section = text[text.find(SECTION_START):text.find(SECTION_END)] if SECTION_START in text else ""
    single = re.search(r"^\| completion tokens, group size \| (\d+), \d+ \|$", section, flags=re.M)
    if single:
        return int(single.group(1))
    stages = re.findall(r"^\| \d+ \| \d+–\d+ \| (\d+) \|", section, flags=re.M)
    return int(stages[-1]) if stages else None


def eval_output_dir(model: str | None) -> str:
    """Where `or1-trl eval` writes without `--output_dir`: `MODEL/eval` for a local model (its card shows the
    results, `report_to_model_card`), else `outputs/eval/<model>`. `ValueError` without a model (a server's)."""
    if model is None:
        raise ValueError("--output_dir is needed with --server_url and no --model")
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.join(os.path.expanduser(model), EVAL_SUBDIR)
    return os.path.join("outputs", "eval", model.replace("/", "__"))


def report_to_model_card(model: str | None, output_dir: str, summary: Mapping) -> str | None:
    """When the results went to a local model's default `MODEL/eval`, update the evaluation section of its
    `README.md` (a card `OR1Trainer` wrote; `model_card.update_eval_block`). Returns the card's path if updated."""
    if model is None or not os.path.isdir(model):
        return None
    if os.path.abspath(output_dir) != os.path.abspath(os.path.join(model, EVAL_SUBDIR)):
        return None
    card = os.path.join(model, "README.md")
    return card if update_eval_block(card, summary) else None
