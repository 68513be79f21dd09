"""The package's layout: no import circle inside `or1_trl` (issue 22.2), no import up the layers of its sub-packages,
and a test file for every module where a newcomer looks for it (issue 33).

Every `import` / `from ... import` of a package module counts, wherever it stands (module level, inside a function
or a method), except under `if TYPE_CHECKING:` (never executed). `from . import x` counts as an import of the
submodule `x` when there is one, otherwise of the package. A circle is reported with the line of each import.
"""

import ast
import pathlib
import subprocess
import sys

import or1_trl

PACKAGE = pathlib.Path(or1_trl.__file__).parent
ROOT = PACKAGE.parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import node, at any depth, outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, dict[str, int]]:
    """`{module: {imported package module: line}}` for every module of `or1_trl`."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in paths]
                targets = submodules or [module]
            for target in targets:
                if target in paths and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_circle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One circle of `graph` as `[a, b, ..., a]`, or `None` (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_find_circle_sees_function_level_imports(tmp_path):
    graph = {"p.a": {"p.b": 3}, "p.b": {"p.c": 10}, "p.c": {"p.a": 42}, "p.d": {"p.a": 1}}
    assert find_circle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_circle({"p.a": {"p.b": 3}, "p.b": {}}) is None
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
                     "def f():\n    from .data import y\n")
    assert [type(n).__name__ for n in _imports(tree)] == ["ImportFrom", "ImportFrom"]


def test_graph_holds_function_level_imports():
    graph = import_graph()
    # `AbilityReward` needs its inner reward's columns: a module-level import of the leaf module `rewards.columns`.
    assert "or1_trl.rewards.columns" in graph["or1_trl.rewards.mixed"]
    assert "or1_trl.rewards.columns" in graph["or1_trl.data.released"]
    # `data.released_format_inputs` imports the rewards inside a function: counted.
    assert "or1_trl.rewards" in graph["or1_trl.data.released"]
    assert graph["or1_trl.rewards.columns"] == {}


def test_no_import_circle_in_the_package():
    graph = import_graph()
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


#: The layers of the package (issue 33): what each sub-package may import of `or1_trl`. The paper's pieces, the
#: rewards and generation import nothing of the training run, its data, evaluation or the command line; the demos
#: (issue 46.4) sit on the trainer, below the command line, with the top-level `models` (real models) and `testing`
#: (the tiny model); the top-level leaves `files` (atomic writes) and `paths` (path checks) are open to all.
MAY_IMPORT = {
    "recipe": {"recipe"},
    "rewards": {"rewards"},
    "generation": {"generation", "recipe", "rewards"},
    "data": {"data", "recipe", "rewards", "generation"},
    "eval": {"eval", "data", "recipe", "rewards", "generation"},
    "trainer": {"trainer", "eval", "data", "recipe", "rewards", "generation"},
    "demos": {"demos", "trainer", "eval", "data", "recipe", "rewards", "generation", "models", "testing"},
}
LEAVES = {"files", "paths"}


def _room(module: str) -> str:
    """`or1_trl.recipe.loss` -> `recipe`; `or1_trl.files` -> `files`; the package itself -> ``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_breaks(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of `graph` that crosses the layers of `MAY_IMPORT`, as `module (line N) -> target`."""
    return [f"{module} (line {line}) -> {target}"
            for module, edges in sorted(graph.items()) if _room(module) in MAY_IMPORT
            for target, line in sorted(edges.items())
            if _room(target) not in MAY_IMPORT[_room(module)] | LEAVES]


def test_layering_sees_an_upward_import():
    graph = {"or1_trl.recipe.loss": {"or1_trl.trainer.checkpoint": 7, "or1_trl.files": 3},
             "or1_trl.generation.serve": {"or1_trl.recipe.ranges": 1, "or1_trl.data.released": 9},
             "or1_trl.cli.run": {"or1_trl.trainer.or1_trainer": 2},
             "or1_trl.trainer.checkpoint": {"or1_trl.demos.tiny": 4},
             "or1_trl.demos.tiny": {"or1_trl.trainer.or1_trainer": 5, "or1_trl.cli.console": 6}}
    assert layering_breaks(graph) == ["or1_trl.demos.tiny (line 6) -> or1_trl.cli.console",
                                      "or1_trl.generation.serve (line 9) -> or1_trl.data.released",
                                      "or1_trl.recipe.loss (line 7) -> or1_trl.trainer.checkpoint",
                                      "or1_trl.trainer.checkpoint (line 4) -> or1_trl.demos.tiny"]


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    assert {_room(m) for m in graph} >= set(MAY_IMPORT) | {"cli"}, "a sub-package of the layout is missing"
    assert not any(_room(target) == "cli" for module, edges in graph.items() if _room(module) != "cli"
                   for target in edges), "only the command line imports the command line"
    assert layering_breaks(graph) == []


def test_the_benchmarks_import_the_library_not_the_command_line():
    """Issue 46.4: `benchmarks/` imports library modules (the demos from `or1_trl.demos`); it runs a command only as a
    command (`python -m or1_trl.cli ...` in a subprocess)."""
    found = [f"{path.name} (line {node.lineno})" for path in sorted((ROOT / "benchmarks").rglob("*.py"))
             for node in _imports(ast.parse(path.read_text(), str(path)))
             if any(name == "or1_trl.cli" or name.startswith("or1_trl.cli.") for name in (
                 [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]))]
    assert found == []


#: What `recipe/` may import besides the standard library and itself (issue 46.3): the paper's pieces are functions of
#: tensors, testable without a trainer; whatever drives a trainer, an accelerator or a server lives in `trainer/`.
RECIPE_MAY_IMPORT = {"torch", "numpy"}


def impure_imports(path: str, source: str) -> list[str]:
    """Every import of `source` (a module of `recipe/`) beyond the standard library, `RECIPE_MAY_IMPORT` and a relative
    import within its own package, as `path (line N) imports name`."""
    found = []
    for node in _imports(ast.parse(source, path)):
        level = getattr(node, "level", 0)  # `from .ranges import ...` (level 1): recipe/ itself
        if level == 1:
            continue
        names = [alias.name for alias in node.names] if level == 0 and isinstance(node, ast.Import) else [
            "." * level + (node.module or "")]
        for name in names:
            top = name.split(".")[0]
            if level > 1 or (top not in sys.stdlib_module_names and top not in RECIPE_MAY_IMPORT):
                found.append((node.lineno, f"{path} (line {node.lineno}) imports {name}"))
    return [text for _, text in sorted(found)]


def test_impure_imports_sees_a_library_and_a_way_out():
    source = ("from __future__ import annotations\nimport math\nimport torch\nfrom .ranges import FIELD_RANGES\n"
              "from transformers import TrainerCallback\ndef f():\n    from ..trainer import sharding\n")
    assert impure_imports("r.py", source) == ["r.py (line 5) imports transformers", "r.py (line 7) imports ..trainer"]


def test_recipe_imports_only_the_standard_library_torch_and_numpy():
    found = []
    for path in sorted((PACKAGE / "recipe").rglob("*.py")):
        found += impure_imports(path.relative_to(ROOT).as_posix(), path.read_text())
    assert found == []


#: Names that build (or run) a training run: a test that uses one tests the trainer, not a recipe piece alone.
TRAINER_NAMES = {"OR1Trainer", "GRPOTrainer", "or1_trainer", "grpo_trainer"}


def trainer_helpers() -> set[str]:
    """The helpers of `tests/helpers.py` that build, launch or read a trainer: they name `OR1Trainer` /
    `GRPOTrainer`, take a `trainer`, or say `trainer` in their name (`tied_trainer`, `two_trainer_processes`)."""
    tree = ast.parse((ROOT / "tests" / "helpers.py").read_text())
    helpers = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            parameters = {a.arg for a in node.args.args} if isinstance(node, ast.FunctionDef) else set()
            if names & TRAINER_NAMES or "trainer" in parameters or "trainer" in node.name.lower():
                helpers.add(node.name)
    return helpers


def trainer_uses(source: str, helpers: set[str]) -> list[str]:
    """The names of `TRAINER_NAMES` and of `helpers` that `source` imports or uses, with their lines."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        names = ([alias.name for alias in node.names] + ([node.module] if getattr(node, "module", None) else [])
                 if isinstance(node, (ast.Import, ast.ImportFrom))
                 else [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) else [])
        for name in names:
            if name.rpartition(".")[2] in TRAINER_NAMES | helpers:
                found[node.lineno, name] = f"line {node.lineno}: {name}"
    return [found[key] for key in sorted(found)]


def test_trainer_uses_sees_the_trainer_and_its_helpers():
    assert {"logged", "tied_trainer", "two_trainer_processes", "gathered_state"} <= trainer_helpers()
    assert not {"tagged_dataset", "fixed_batch", "reference_eq_3_2"} & trainer_helpers()
    source = ("from or1_trl import OR1Config\nfrom ..helpers import fixed_batch, logged\n"
              "import or1_trl.trainer.or1_trainer\n")
    assert trainer_uses(source, trainer_helpers()) == ["line 2: logged", "line 3: or1_trl.trainer.or1_trainer"]


def test_recipe_tests_build_no_trainer():
    """`tests/recipe/` tests the paper's pieces alone (issue 46.3); a test that trains is in `tests/trainer/`."""
    helpers = trainer_helpers()
    found = {path.relative_to(ROOT).as_posix(): trainer_uses(path.read_text(), helpers)
             for path in sorted((ROOT / "tests" / "recipe").rglob("*.py"))}
    assert {path: uses for path, uses in found.items() if uses} == {}


#: Modules whose tests are not in `tests/<package>/test_<module>.py`, and the test files that hold them.
TESTED_IN = {
    "or1_trl/testing.py": "tests/cli/test_demo.py",  # the tiny model every test builds; the demo trains it
    "or1_trl/rewards/sandbox/result.py": "tests/rewards/sandbox/test_runner.py",
    "or1_trl/generation/vllm_generation.py": "tests/generation/test_disk_sync.py",  # the trainer's disk sync
    "or1_trl/generation/vllm_client.py": "tests/generation/test_server_health.py",  # retries, the watch, the key
    # The command line: one file tests the commands as a family (parsing, --config, --help, one-line errors).
    "or1_trl/cli/model.py": "tests/test_models.py",  # `or1-trl model smollm2`
    **{f"or1_trl/cli/{name}.py": "tests/cli/test_commands.py" for name in (
        "difficulty", "evaluate", "parsing", "plot", "prepare", "run", "select_examples", "serve", "train")},
}


def test_every_module_has_a_test_file_a_newcomer_finds():
    """`or1_trl/recipe/loss.py` -> `tests/recipe/test_loss.py`, or the file `TESTED_IN` names; every entry is used;
    at least 80% of the modules have a test file of their own name (issue 46.5)."""
    missing, stale, by_name, modules = [], [], 0, 0
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py"):
            continue
        mirrored = ROOT / "tests" / path.relative_to(PACKAGE).with_name(f"test_{path.name}")
        modules, by_name = modules + 1, by_name + mirrored.exists()
        tested_in = TESTED_IN.get(module)
        if tested_in is None and not mirrored.exists():
            missing.append(f"{module}: no {mirrored.relative_to(ROOT)}")
        if tested_in is not None and (mirrored.exists() or not (ROOT / tested_in).exists()):
            stale.append(f"{module}: TESTED_IN says {tested_in}")
    assert not missing and not stale, "\n".join(missing + stale)
    assert by_name / modules >= 0.80, f"{by_name} of {modules} modules have a test file of their own name"


def _own_private_attributes(tree: ast.AST) -> set[str]:
    """`self._x = ...` (and `self._x: T = ...`, tuple targets) anywhere in `tree`."""
    names = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name)
                        and element.value.id == "self" and element.attr.startswith("_")
                        and not element.attr.startswith("__")):
                    names.add(element.attr)
    return names


def test_the_trainer_stays_thin():
    """Issues 33 and 46: `OR1Trainer` is the paper wired into TRL's hooks, its state owned by the components it calls:
    `or1_trainer.py` at most 450 lines of at most 119 characters (`test_the_package_keeps_to_119_characters`),
    `__init__` at most 45, at most 10 private attributes of its own (TRL's and transformers', which it only sets
    again, do not count)."""
    import inspect

    from transformers import Trainer
    from trl import GRPOTrainer

    path = PACKAGE / "trainer" / "or1_trainer.py"
    source = path.read_text()
    tree = ast.parse(source)
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "OR1Trainer")
    init = next(node for node in trainer.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    inherited = set()
    for base in (GRPOTrainer, Trainer):
        inherited |= _own_private_attributes(ast.parse(inspect.getsource(inspect.getmodule(base))))
    own = sorted(_own_private_attributes(trainer) - inherited)
    assert len(source.splitlines()) <= 450
    assert init.end_lineno - init.lineno + 1 <= 45
    assert len(own) <= 10, own
    example = "self._a = 1\nself._b, x = 2, 3\nself.c = 4\nother._d = 5"
    assert _own_private_attributes(ast.parse(example)) == {"_a", "_b"}


def test_the_package_keeps_to_119_characters():
    """Issue 46.2: TRL's line length, checked by TRL's linter (ruff, `[tool.ruff]` in pyproject.toml)."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--output-format", "concise",
                             "or1_trl"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


#: Callees that take positional arguments only (torch's autograd `Function.apply`, `types.FunctionType`), and
#: `super().__init__`, which passes the caller's positional arguments on to TRL as they came (`*rest`).
POSITIONAL_ONLY = {"apply", "FunctionType", "__init__"}


def positional_calls(source: str, limit: int = 3) -> list[str]:
    """Calls in `source` with more than `limit` positional arguments, as `line N: callee(k)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            count = sum(not isinstance(argument, ast.Starred) for argument in node.args)
            name = ast.unparse(node.func)
            if count > limit and name.rpartition(".")[2] not in POSITIONAL_ONLY:
                found.append((node.lineno, f"line {node.lineno}: {name}({count})"))
    return [text for _, text in sorted(found)]


def test_the_trainer_calls_by_keyword():
    """Issue 46.2: in `trainer/`, a call with more than three arguments names them (a reader sees what
    `self.args.steps_per_generation` is to the callee without opening it)."""
    assert positional_calls("f(a, b, c)\ng(a, b, c, d)\ng(a, b, c=c, d=d)\nx.apply(a, b, c, d)\n") == [
        "line 2: g(4)"]
    found = {path.name: calls for path in sorted((PACKAGE / "trainer").glob("*.py"))
             if (calls := positional_calls(path.read_text()))}
    assert found == {}
