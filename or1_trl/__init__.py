"""or1-trl: the Skywork-OR1 (MAGIC) recipe, the 80/20 rule and 1-shot RLVR on top of Hugging Face TRL.

    from or1_trl import OR1Config, OR1Trainer   # drop-in for trl's GRPOConfig / GRPOTrainer

The names below are imported on first use (PEP 562): `import or1_trl.rewards.math` (what the math reward's worker
processes import when a user's `score_fn` module imports it) or `or1-trl --help` do not load torch, TRL or
transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> submodule that defines it
_LAZY = {
    "AdaptiveEntropyController": ".recipe.entropy",
    "OR1Config": ".trainer.or1_config",
    "OR1Trainer": ".trainer.or1_trainer",
}

__all__ = ["AdaptiveEntropyController", "OR1Config", "OR1Trainer", "__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .recipe.entropy import AdaptiveEntropyController
    from .trainer.or1_config import OR1Config
    from .trainer.or1_trainer import OR1Trainer


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
