"""Reward functions by name, as `trl grpo --reward_funcs` takes them (`trl/scripts/grpo.py`; TRL exposes no
resolver): one of TRL's reward names (`TRL_REWARD_NAMES`, from `trl.rewards`), or a `module.function` import path.
What `or1-trl train --reward_funcs` scores with, alone or beside the verifier."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# `trl grpo --reward_funcs` names (trl/scripts/grpo.py, from `trl.rewards`).
TRL_REWARD_NAMES = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                    "get_soft_overlong_punishment")


def resolve_reward_funcs(names: list[str], max_completion_length: int) -> list[Callable]:
    """`--reward_funcs` as `trl grpo` resolves them (TRL exposes no resolver): a name of `TRL_REWARD_NAMES` from
    `trl.rewards`, or `module.function` imported with the current directory on `sys.path`. A `ValueError` names the
    first that is neither; nothing else is loaded."""
    import importlib

    funcs = []
    for name in names:
        if name in TRL_REWARD_NAMES:
            import trl.rewards

            func = getattr(trl.rewards, name)
            # a factory: `trl grpo` fixes 1280 / 256; we use the run's length
            if name == "get_soft_overlong_punishment":
                func = func(max_completion_len=max_completion_length,
                            soft_punish_cache=min(256, max_completion_length // 4))
        elif "." in name.strip("."):
            module, attr = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                func = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"--reward_funcs {name}: cannot import {attr!r} from {module!r} ({exc})") from None
        else:
            raise ValueError(f"--reward_funcs {name}: neither one of TRL's reward names "
                             f"({', '.join(TRL_REWARD_NAMES)}) nor a module.function import path")
        if not callable(func):
            raise ValueError(f"--reward_funcs {name}: {type(func).__name__} is not callable")
        funcs.append(func)
    return funcs
