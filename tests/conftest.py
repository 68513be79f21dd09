"""Shared fixtures: every test builds its model from `or1_trl.testing` (offline, seconds)."""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def tiny():
    """A fresh `(model, tokenizer)` pair: the same weights every time (seed 0)."""
    from or1_trl.testing import tiny_model_and_tokenizer

    return tiny_model_and_tokenizer(seed=0)



@pytest.fixture(scope="session")
def sandbox_missing():
    """`sandbox_missing(reason)`: skip a test that needs a code-sandbox backend this machine lacks.

    With ``OR1_REQUIRE_SANDBOX=1`` (set by `.ci/run`) it fails instead, so CI always runs the whole hostile suite.
    """

    def missing(reason: str):
        if os.environ.get("OR1_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"OR1_REQUIRE_SANDBOX=1, but the sandbox this test needs is unavailable: {reason}",
                        pytrace=False)
        pytest.skip(reason)

    return missing
