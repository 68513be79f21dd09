"""Checks of user paths before anything loads (`or1_trl/paths.py`)."""

import os

from or1_trl.paths import model_path_problem
from .helpers import ROOT


def test_model_name_or_path_check():
    assert model_path_problem("Qwen/Qwen2.5-0.5B-Instruct") is None and model_path_problem("gpt2") is None
    assert model_path_problem(ROOT) is None  # an existing directory
    assert "is a file" in model_path_problem(os.path.join(ROOT, "pyproject.toml"))
    assert "neither an existing local directory nor a valid Hub id" in model_path_problem("my model")
