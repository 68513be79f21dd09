"""Reward functions by name (`or1_trl/rewards/by_name.py`): TRL's names and import paths, as `trl grpo
--reward_funcs` takes them. Through the command line (one-line errors, training with them):
tests/trainer/test_dropin.py."""


def test_reward_funcs_resolve_trl_names_and_import_paths(tmp_path, monkeypatch):
    from trl.rewards import think_format_reward

    from or1_trl.rewards.by_name import resolve_reward_funcs

    (tmp_path / "my_rewards.py").write_text("def length_reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    think, overlong, mine = resolve_reward_funcs(["think_format_reward", "get_soft_overlong_punishment",
                                                  "my_rewards.length_reward"], max_completion_length=64)
    assert think is think_format_reward and mine.__name__ == "length_reward"
    assert (overlong.max_completion_len, overlong.soft_punish_cache) == (64, 16)
    assert overlong(completion_ids=[[0] * 40, [0] * 56, [0] * 65]) == [0.0, -0.5, -1.0]
