"""The dataset columns a reward function reads (`or1_trl/rewards/columns.py`)."""

from ..helpers import parity_reward


def test_required_columns_of_reward_functions():
    from or1_trl.rewards.columns import required_columns
    from or1_trl.rewards import code_reward, math_reward

    assert required_columns(math_reward) == ("answer",)
    assert required_columns(code_reward) == ("tests",)
    assert required_columns(parity_reward) == ()
    assert required_columns(lambda prompts, completions, answer, trainer_state=None, **kw: 0) == ("answer",)
    assert required_columns(lambda completions, completion_ids, log_extra, log_metric, **kw: 0) == ()
    assert required_columns("some/reward-model") == ()
