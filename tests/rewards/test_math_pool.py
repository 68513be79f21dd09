"""The math reward's worker pool (`or1_trl/rewards/math_pool.py`); scoring through it: tests/test_math_reward.py."""

import ast
import sys

from or1_trl.rewards import math_pool


def test_the_pool_imports_only_the_standard_library():
    """Worker processes load the rule's file with this one beside it and nothing else of the package."""
    imports = [node for node in ast.walk(ast.parse(open(math_pool.__file__).read()))
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not [node.module for node in imports if isinstance(node, ast.ImportFrom) and node.level]  # no relative
    names = {alias.name if isinstance(node, ast.Import) else node.module for node in imports for alias in node.names}
    assert {name.split(".")[0] for name in names} <= set(sys.stdlib_module_names) | {"__future__"}
