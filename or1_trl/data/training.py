"""What `or1-trl train` trains on, from its data flags: the dataset loaded (`loading.load_data`), checked and
converted for the verifier rewards (`released.training_dataset`) with those rewards, or the prompt column alone for
reward functions without a verifier (`--reward_funcs`); string prompts as a user turn of the chat template
(`--chat_prompts`)."""

from __future__ import annotations


def training_data(dataset_name: str | None, *, dataset_config: str | None = None, split: str = "train",
                  data_files: list[str] | str | None = None, reward: str | None = "auto",
                  prompt_column: str = "prompt", answer_column: str | None = None, difficulty_model: str | None = None,
                  difficulty_range: tuple[int, int] | None = None, drop_invalid: bool = False,
                  num_proc: int | None = None):
    """The dataset and the verifier rewards (`reward`: `"auto"`, `"math"`, `"code"`), as `(dataset, reward_funcs,
    report)`: rows checked and converted (`released.training_dataset`, whose lines say what it kept: `report`), or,
    with `reward=None`, the prompt column alone (renamed `prompt`) for reward functions without a verifier, no reward
    and no report. `ValueError` names the dataset."""
    from ..rewards import code_reward, math_reward, mixed_rewards
    from .loading import load_data
    from .released import training_dataset

    # data_files: a list from the command line, maybe a string from a --config file
    name = dataset_name or ", ".join([data_files] if isinstance(data_files, str) else data_files)
    dataset = load_data(dataset_name, dataset_config, split=split, data_files=data_files)
    if reward is None:  # --reward_funcs alone: they read the dataset's own columns
        if prompt_column not in dataset.column_names:
            raise ValueError(f"dataset {name!r} has no column {prompt_column!r} (columns: "
                             f"{dataset.column_names}); training generates from the prompt in --prompt_column")
        if prompt_column != "prompt":
            dataset = dataset.rename_column(prompt_column, "prompt")
        return dataset, [], []
    try:
        dataset, abilities, report = training_dataset(
            dataset, reward=reward, prompt_column=prompt_column, answer_column=answer_column,
            difficulty_model=difficulty_model, difficulty_range=difficulty_range, drop_invalid=drop_invalid,
            num_proc=num_proc,
        )
    except ValueError as exc:
        raise ValueError(f"dataset {name!r} {exc}") from exc
    single = {"math": math_reward, "code": code_reward}
    return dataset, [single[abilities[0]]] if len(abilities) == 1 else mixed_rewards(abilities), report  # a list


def as_user_turns(dataset):
    """`--chat_prompts`: each string `prompt` of `dataset` as one user turn, `[{"role": "user", "content": prompt}]`,
    which TRL renders with the tokenizer's chat template (conversations stay as they are)."""
    if "prompt" not in dataset.column_names or not isinstance(dataset[0]["prompt"], str):
        return dataset
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]},
                       desc="Prompts as user turns (--chat_prompts)")
