"""One verifier per row (`or1_trl/rewards/mixed.py`): `mixed_rewards` checks math golds on the math rows only and code
tests on the code rows only, before the model loads."""

import re

import pytest
from datasets import Dataset

from or1_trl import OR1Config, OR1Trainer
from or1_trl.data.preflight import check_datasets
from or1_trl.rewards import code_reward, mixed_rewards
from or1_trl.testing import tiny_training_args

NO_MODEL = "/nonexistent/model"  # the pre-flight fails before this is loaded


@pytest.fixture
def args(tmp_path):
    return OR1Config(**tiny_training_args(tmp_path))


def test_mixed_rewards_check_each_row_with_its_own_verifier(args):
    """`mixed_rewards`: math golds are checked on the math rows only, code tests on the code rows only."""
    tests = '{"inputs": ["1\\n"], "outputs": ["1\\n"]}'
    data = Dataset.from_dict({"prompt": ["m0", "c1", "m2", "c3"], "ability": ["math", "code", "math", "code"],
                              "answer": [["1"], None, ["2"], None], "tests": [None, tests, None, tests]})
    check_datasets(mixed_rewards(), data)  # valid: no error although code rows lack answers and math rows tests
    bad = data.map(lambda row, i: {"tests": '{"inputs": [1]}' if i == 3 else row["tests"]}, with_indices=True)
    with pytest.raises(ValueError, match=re.escape("train_dataset column 'tests' (read by 'code_reward'): 1 of 4 rows "
                                                   "cannot be scored: 1 malformed test JSON (row 3;")):
        OR1Trainer(NO_MODEL, mixed_rewards(), args=args, train_dataset=bad)
    with pytest.raises(ValueError, match=re.escape("column 'tests' (read by 'code_reward'): 1 of 2 rows cannot be "
                                                   "scored: 1 malformed test JSON (row 1;")):
        OR1Trainer(NO_MODEL, code_reward, args=args, train_dataset=bad.select([1, 3]))
