"""mkdocs hooks (mkdocs.yml `hooks:`): what the site computes when it is built.

`<!-- or1-trl help: COMMAND -->` on a line of its own becomes the command's `--help`, formatted by its own parser
(`or1_trl.cli.COMMANDS`) at a width of 100 columns, in a collapsed block: the CLI reference cannot drift from the
flags. An unknown command fails the build.
"""

from __future__ import annotations

import os
import re

HELP = re.compile(r"^<!-- or1-trl help: (?P<command>[a-z-]+) -->$", flags=re.M)


def command_help(name: str) -> str:
    """`or1-trl NAME --help`, as the command prints it at 100 columns."""
    os.environ["COLUMNS"] = "100"  # argparse's width (shutil.get_terminal_size reads it)
    from or1_trl.cli import COMMANDS

    commands = {command.name: command for command in COMMANDS}
    if name not in commands:
        raise ValueError(f"<!-- or1-trl help: {name} -->: no such command (one of {', '.join(commands)})")
    return commands[name].parser().format_help()


def on_page_markdown(markdown: str, **kwargs) -> str:
    def block(match: re.Match) -> str:
        name = match.group("command")
        text = command_help(name).rstrip("\n")
        return f'??? note "`or1-trl {name} --help`"\n\n    ```text\n' + "\n".join(
            f"    {line}" if line else "" for line in text.split("\n")) + "\n    ```\n"

    return HELP.sub(block, markdown)
