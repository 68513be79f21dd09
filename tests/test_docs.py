"""The documentation: the site builds in strict mode, and every snippet of the README and of `docs/` runs or says why not.

Snippets (issue 37). Every ```` ```python ```` and ```` ```bash ```` block of README.md and `docs/**/*.md` runs here,
page by page in the page's order, in a fresh working directory of its own (the repository's `examples/`, `configs/`,
`scripts/` and `tests/` linked in, so that the commands a reader types at the root of a clone run as written), offline,
on the tiny model of `or1_trl.testing`. Sybil reads the blocks (`sybil.parsers.markdown`) and runs the Python ones in
one namespace per page; the shell ones run with `bash -e -o pipefail`. A block that cannot run here starts with a line
the reader sees and this file reads:

    # needs: a GPU, the Hub

(one or more of `NEEDS`); it is not run, only checked for syntax. What the shell runner changes, and nothing else:
`pip install` commands are not run (the installs are `.ci/run`'s; `test_install_commands_match_the_project` checks
each one against `pyproject.toml` and `.ci/run`), a `python -m pytest` command is not run (its paths must exist; the
README's is `.ci/run`'s own), and `or1-trl demo` without `--max_steps` gets `--max_steps 2 --sft_steps 2` (the full
demo runs in `tests/cli/test_demo.py`). The drop-in diff (README, `docs/or1_trainer.md`) runs its new side with
the tiny model in place of the Hub model, a two-row dataset as `ds`, and the small settings `DROPIN_SMALL` added to
its `OR1Config(...)` (TRL's defaults, 256 tokens × 8 samples × 3 epochs, take minutes on CPU); once per distinct diff.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sybil import Document
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

from .helpers import ENV, ROOT

ROOT_PATH = Path(ROOT)
PAGES = [ROOT_PATH / "README.md", *sorted((ROOT_PATH / "docs").rglob("*.md"))]
#: What a block may say it needs, in its first line `# needs: ...`.
NEEDS = ("a GPU", "GPUs", "the Hub", "the network", "a vLLM server", "a long run")
#: Languages of fenced blocks: the snippets (run or marked), and the rest (output, configs, diffs: read, not run).
SNIPPETS = ("python", "bash")
OTHERS = ("text", "yaml", "diff", "bibtex", "")
#: Repository folders a snippet may name by a relative path (its working directory is a fresh one).
LINKED = ("examples", "configs", "scripts", "tests", "benchmarks")
#: The small flags of a command that would otherwise run for minutes.
SMALL_FLAGS = {"or1-trl demo": "--max_steps 2 --sft_steps 2"}
#: The Hub model of the README's drop-in diff, and what runs in its place.
DROPIN_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DROPIN_SMALL = "max_steps=1, max_completion_length=8, num_generations=4, per_device_train_batch_size=4"
_DROPINS_RUN: set[str] = set()


def needs(source: str) -> list[str] | None:
    """The needs a block's first line states, or `None` for a block that runs here."""
    first = source.split("\n", 1)[0].strip()
    if not first.startswith("# needs:"):
        return None
    return [need.strip() for need in first[len("# needs:"):].split(",")]


def rel(path) -> str:
    return Path(path).relative_to(ROOT_PATH).as_posix()


# --- the shell runner ---------------------------------------------------------------------------------------------
def shell_commands(source: str) -> list[list[str]]:
    """The block's logical lines (continuations joined, comments and blank lines dropped), each split into its
    `&&`-chained commands; a here-document's lines stay as they are, one command each."""
    lines, heredoc = [], None
    for line in source.replace("\\\n", " ").split("\n"):
        if heredoc is not None:
            lines.append([line])
            heredoc = None if line == heredoc else heredoc
        elif line.strip() and not line.strip().startswith("#"):
            lines.append([part.strip() for part in line.split(" && ")])
            match = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
            heredoc = match.group(1) if match else None
    return lines


def is_install(command: str) -> bool:
    return bool(re.match(r"(python -m )?pip install ", command))


def runnable_shell(source: str) -> str:
    """The script the runner executes for a block (see the module's docstring)."""
    out = []
    for line in shell_commands(source):
        kept = []
        for command in line:
            if is_install(command):
                continue
            if command.startswith("python -m pytest"):
                for arg in shlex.split(command)[3:]:
                    if not arg.startswith("-"):
                        assert (ROOT_PATH / arg.split("::")[0]).exists(), f"{command}: no {arg}"
                continue
            for prefix, flags in SMALL_FLAGS.items():
                if re.match(rf"{re.escape(prefix)}(\s|$)", command) and "--max_steps" not in command:
                    command = f"{command.split('#')[0].rstrip()} {flags}"
            kept.append(command)
        if kept:
            out.append(" && ".join(kept))
    return "\n".join(out)


def workdir(document: Document) -> Path:
    return document.namespace["__workdir__"]


def run_shell(example) -> None:
    script = runnable_shell(str(example.parsed))
    if not script:
        return
    env = {**ENV, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
           "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "120"}
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=workdir(example.document), env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"{rel(example.path)}, line {example.line}: exit {result.returncode}\n$ {script}\n"
                                    f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def run_python(example) -> None:
    cwd = os.getcwd()
    os.chdir(workdir(example.document))
    try:
        PythonEvaluator()(example)
    finally:
        os.chdir(cwd)


def dropin_source(diff: str) -> str:
    """The new side of a diff: its `+` and context lines."""
    return "\n".join(line[1:] for line in diff.split("\n") if line[:1] in ("+", " "))


def run_dropin(example) -> None:
    """The drop-in diff's new side as written, with the tiny model for the Hub model, a two-row dataset as `ds` and
    `DROPIN_SMALL` in its config; a diff already run (the same text on another page) is not run again."""
    from datasets import Dataset

    from or1_trl.testing import save_tiny_model

    source = dropin_source(str(example.parsed))
    assert DROPIN_MODEL in source and source.count("OR1Config(output_dir=") == 1, source
    if source in _DROPINS_RUN:
        return
    here = workdir(example.document)
    model = here / "dropin-model"
    if not model.exists():
        save_tiny_model(model)
    source = source.replace("OR1Config(output_dir=", f"OR1Config({DROPIN_SMALL}, output_dir=")
    namespace = {"ds": Dataset.from_list([{"prompt": "What is 2 + 3? Answer: \\boxed{", "answer": "5"},
                                          {"prompt": "What is 7 + 1? Answer: \\boxed{", "answer": "8"}])}
    cwd = os.getcwd()
    os.chdir(here)
    try:
        exec(compile(source.replace(DROPIN_MODEL, str(model)), str(example.path), "exec"), namespace)
    finally:
        os.chdir(cwd)
    assert namespace["trainer"].state.global_step == 1
    _DROPINS_RUN.add(dropin_source(str(example.parsed)))


def runnable(parser):
    """`parser`'s regions of the blocks that run here (no `# needs:` line)."""
    def parse(document):
        for region in parser(document):
            if needs(str(region.parsed)) is None:
                yield region
    return parse


PARSERS = [runnable(CodeBlockParser("python", run_python)), runnable(CodeBlockParser("bash", run_shell)),
           CodeBlockParser("diff", run_dropin)]
DOCUMENTS = {page: Document.parse(str(page), *PARSERS) for page in PAGES}
EXAMPLES = [pytest.param(page, index, id=f"{rel(page)}:{example.line}")
            for page, document in DOCUMENTS.items() for index, example in enumerate(document.examples())]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """A fresh working directory per page, made when its first snippet runs."""
    made = {}

    def make(page: Path) -> Path:
        if page not in made:
            path = tmp_path_factory.mktemp(page.stem)
            for name in LINKED:
                (path / name).symlink_to(ROOT_PATH / name)
            made[page] = path
        return made[page]

    return make


@pytest.mark.parametrize("page,index", EXAMPLES)
def test_snippet_runs(page, index, workdirs):
    document = DOCUMENTS[page]
    document.namespace["__workdir__"] = workdirs(page)
    list(document.examples())[index].evaluate()


# --- what is not run ---------------------------------------------------------------------------------------------
def fenced_blocks():
    """`(page, line, language, source)` of every fenced block of the documentation."""
    lexer = FencedCodeBlockLexer(language=r"[^\n]*", mapping={"language": "language", "source": "source"})
    for page in PAGES:
        document = Document(page.read_text(), str(page))
        for region in lexer(document):
            line = document.text.count("\n", 0, region.start) + 1
            yield page, line, region.lexemes["language"].strip(), str(region.lexemes["source"])


def test_every_snippet_runs_or_says_what_it_needs():
    """A block is a snippet (run here, or marked with what it needs from `NEEDS`) or plainly not code; a marked
    snippet still parses (Python: `compile`; shell: `bash -n`), and the pages do hold runnable snippets."""
    problems, runnable_count = [], 0
    for page, line, language, source in fenced_blocks():
        where = f"{rel(page)}:{line}"
        if language not in SNIPPETS + OTHERS:
            problems.append(f"{where}: language {language!r} (snippets: {SNIPPETS}; not run: {OTHERS})")
            continue
        stated = needs(source)
        if language not in SNIPPETS:
            if stated is not None:
                problems.append(f"{where}: a {language or 'plain'} block is never run: no '# needs:' line")
            continue
        if stated is None:
            runnable_count += 1
            continue
        unknown = [need for need in stated if need not in NEEDS]
        if unknown or not stated:
            problems.append(f"{where}: '# needs:' takes {', '.join(NEEDS)}; got {stated}")
        if language == "python":
            compile(source, where, "exec")
        else:
            check = subprocess.run(["bash", "-n"], input=source, capture_output=True, text=True)
            if check.returncode:
                problems.append(f"{where}: {check.stderr.strip()}")
    assert not problems, "\n".join(problems)
    diffs = sum(1 for _, _, language, _ in fenced_blocks() if language == "diff")
    assert runnable_count == len(EXAMPLES) - diffs >= 10  # each runnable block is a test of test_snippet_runs


def test_yaml_blocks_parse():
    for page, line, language, source in fenced_blocks():
        if language == "yaml":
            assert isinstance(yaml.safe_load(source), dict), f"{rel(page)}:{line}"


def test_the_runner_changes_installs_tests_and_long_commands_only(tmp_path):
    source = ('# a comment\npip install torch==2.13.0 --index-url https://x && pip install -e ".[dev]" && or1-trl demo\n'
              "python -m pytest tests -q\nor1-trl plot outputs/demo \\\n    --smooth 3\nor1-trl demo --max_steps 5\n")
    assert runnable_shell(source) == ("or1-trl demo --max_steps 2 --sft_steps 2\nor1-trl plot outputs/demo      --smooth 3\n"
                                      "or1-trl demo --max_steps 5")
    with pytest.raises(AssertionError, match="no tests/nonesuch.py"):
        runnable_shell("python -m pytest tests/nonesuch.py -q")
    heredoc = "cat > a.jsonl <<'EOF'\n# kept && as is\n{}\nEOF\n# dropped\necho && pip install x"
    assert runnable_shell(heredoc) == "cat > a.jsonl <<'EOF'\n# kept && as is\n{}\nEOF\necho"
    assert needs("# needs: a GPU, the Hub\nor1-trl serve M") == ["a GPU", "the Hub"]
    assert needs("or1-trl serve M  # needs: nothing") is None
    assert dropin_source("-a = 1\n+a = 2\n b = a") == "a = 2\nb = a"


def install_commands():
    for page, line, language, source in fenced_blocks():
        if language == "bash":
            for commands in shell_commands(source):
                for command in commands:
                    if is_install(command):
                        yield f"{rel(page)}:{line}", command


def test_install_commands_match_the_project():
    """The installs the docs tell a reader to run are the project's: torch at `.ci/run`'s version, extras that
    `pyproject.toml` defines, other packages at the version it pins."""
    import tomllib

    ci = (ROOT_PATH / ".ci" / "run").read_text()
    (ci_torch,) = re.findall(r"torch==(\S+)", ci)
    pyproject = tomllib.loads((ROOT_PATH / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    pins = "\n".join(pyproject["project"]["dependencies"] + sum(pyproject["project"]["optional-dependencies"].values(), []))
    seen = 0
    for where, command in install_commands():
        for arg in shlex.split(command)[2:]:
            if arg.startswith("-") or arg.startswith("http"):
                continue
            seen += 1
            local = re.fullmatch(r"(?:\.|or1-trl)(?:\[([\w,-]+)\])?", arg)
            if local:
                assert set(filter(None, (local.group(1) or "").split(","))) <= extras, f"{where}: {command}"
            elif arg.startswith("torch=="):
                assert arg == f"torch=={ci_torch}", f"{where}: {command} (.ci/run: torch=={ci_torch})"
            else:
                name, _, version = re.sub(r"\[.*\]", "", arg).partition("==")
                assert version and re.search(rf"^{re.escape(name)}(\[.*\])?=={re.escape(version)}", pins, re.M), \
                    f"{where}: {command} is not pinned so in pyproject.toml"
    assert seen >= 4


# --- the site -----------------------------------------------------------------------------------------------------
def test_the_site_builds_strictly_and_offline(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the navigation, a docstring mkdocstrings
    cannot render or an unknown `or1-trl help` command fails. It builds without a network (in a network namespace of
    its own where `unshare -n` can make one, as root in CI), and the pages load nothing from the network (no web
    fonts, no CDN)."""
    site = tmp_path / "site"
    offline = ["unshare", "-n"] if shutil.which("unshare") and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0 else []
    result = subprocess.run([*offline, sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env={**ENV, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    config = yaml.safe_load("nav:\n" + (ROOT_PATH / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1])

    def nav_pages(items):
        for item in items:
            for value in item.values():
                yield from ([value] if isinstance(value, str) else nav_pages(value))

    pages = list(nav_pages(config["nav"]))
    assert sorted(pages) == sorted(rel(p)[len("docs/"):] for p in PAGES if p.parent != ROOT_PATH)
    for page in pages:
        html = site / ("index.html" if page == "index.md" else page[:-3] + "/index.html")
        text = html.read_text()
        for host in ("fonts.googleapis.com", "fonts.gstatic.com", "cdn.jsdelivr.net", "unpkg.com", "cdnjs"):
            assert host not in text, (page, host)
    assert "--use_peft" in (site / "clis" / "index.html").read_text()  # the train command's --help, rendered
    assert "class=\"doc doc-object doc-class\"" in (site / "reference" / "trainer" / "index.html").read_text()


# --- the README ---------------------------------------------------------------------------------------------------
README = (ROOT_PATH / "README.md").read_text()


def heading_anchors(text: str) -> set[str]:
    """The anchors of a page's headings, as the site (and GitHub) make them."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        plain = re.sub(r"`([^`]*)`", r"\1", heading)
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", plain)
        anchors.add(slug(plain, "-"))
    return anchors


def test_the_readme_is_a_first_screen_and_a_map():
    """At most 200 lines; every relative link leads to a file of the repository and, with an anchor, to a heading of
    that page."""
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [link for link in links if not re.match(r"https?://", link)]
    assert len(local) >= 15
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT_PATH / path
        assert target.exists(), link
        if anchor:
            assert anchor in heading_anchors(target.read_text()), link
    # every page of the site is one click away
    pages = {p for p in PAGES if p.parent == ROOT_PATH / "docs" and p.name != "index.md"}  # index.md: the site's home
    assert pages <= {ROOT_PATH / link.partition("#")[0] for link in local}


def test_the_readmes_figures_are_the_benchmarks_pages():
    """Each headline figure of the README's "Measured" table stands in the section of the benchmarks page it links to
    (the figures are quoted, never recomputed)."""
    table = README.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "](docs/benchmarks.md#" in line]
    assert len(rows) >= 8
    page = (ROOT_PATH / "docs" / "benchmarks.md").read_text()
    sections = {}
    for heading, body in re.findall(r"^(#{2,3} [^\n]+)\n(.*?)(?=^#{2,3} |\Z)", page, flags=re.M | re.S):
        sections[heading_anchors(heading).pop()] = body
    for row in rows:
        _, what, figure, link, _ = row.split("|")
        anchor = re.search(r"\(docs/benchmarks\.md#([^)]+)\)", link).group(1)
        section = sections[anchor]
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", figure):
            assert number in section, f"{what.strip()}: {number} is not in the section #{anchor} of docs/benchmarks.md"


def test_the_readmes_citation_is_the_model_cards():
    from or1_trl.eval.model_card import CITATIONS

    block = README.split("```bibtex\n", 1)[1].split("```", 1)[0]
    assert block.strip() == CITATIONS.strip()


def test_the_architecture_tree_names_every_module():
    """docs/architecture.md's tree of files names every module of the package (a new module goes on the map)."""
    text = (ROOT_PATH / "docs" / "architecture.md").read_text()
    tree = text.split("```\nor1_trl/", 1)[1].split("```", 1)[0]
    missing = []
    for path in sorted((ROOT_PATH / "or1_trl").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") or len(path.relative_to(ROOT_PATH / "or1_trl").parts) > 2:
            continue  # the sandbox's and the server extension's files are named by their folder's line
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", tree):
            missing.append(path.relative_to(ROOT_PATH).as_posix())
    assert not missing, missing


def _trl_names() -> set[str]:
    """Every name `GRPOTrainer` has: its class attributes and methods (and `Trainer`'s), and the attributes TRL's and
    transformers' trainer modules set on `self`."""
    import ast
    import inspect

    import transformers.trainer
    import trl.trainer.grpo_trainer
    from trl import GRPOTrainer

    names = set(dir(GRPOTrainer))
    for module in (trl.trainer.grpo_trainer, transformers.trainer):
        names |= {node.attr for node in ast.walk(ast.parse(inspect.getsource(module)))
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and isinstance(node.ctx, ast.Store)}
    return names


def test_the_hook_table_is_what_the_trainer_overrides():
    """docs/architecture.md's table of TRL hooks names every method (and property) `OR1Trainer` defines over a name
    of `GRPOTrainer`'s, and nothing else: the names in backticks before any parenthesis of its first column."""
    import inspect

    from or1_trl.trainer.or1_trainer import OR1Trainer

    text = (ROOT_PATH / "docs" / "architecture.md").read_text()
    table = text.split("## TRL hooks `OR1Trainer` overrides, and why", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1].split("(")[0])}
    trl = _trl_names()
    overridden = {name for name, value in vars(OR1Trainer).items()
                  if (inspect.isfunction(value) or isinstance(value, property)) and name in trl}
    assert "_compute_loss" in overridden and "prompt_pool" not in overridden  # OR1's own names are not hooks
    assert documented == overridden, (f"in the table, not overridden: {sorted(documented - overridden)}; "
                                      f"overridden, not in the table: {sorted(overridden - documented)}")


def test_every_image_under_docs_is_shown_by_a_page():
    """Issue 49: an image in docs/ that no page shows (`![...](name.png)`) is a figure nobody finds; each one is
    shown, by a path that resolves from the page that shows it."""
    images = {path.resolve() for path in (ROOT_PATH / "docs").rglob("*") if path.suffix in (".png", ".svg", ".jpg")}
    shown = set()
    for page in PAGES:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", page.read_text()):
            shown.add((page.parent / target).resolve())
    assert images, "no image under docs/"
    assert sorted(map(str, images - shown)) == []
