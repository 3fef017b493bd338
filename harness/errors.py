"""How a command reports bad usage or input: one line on stderr naming the command, then exit code 2."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import typer


def usage_exit(command: str, msg: str) -> typer.Exit:
    """Print `specbench COMMAND: MSG` to stderr and return the Exit(2) to raise."""
    typer.echo(f"specbench {command}: {msg}", err=True)
    return typer.Exit(2)


def usage_errors(command: str) -> Callable[[str], typer.Exit]:
    """`bad = usage_errors("lossless")`, then `raise bad("--x ... is invalid: expected ...")`."""
    return partial(usage_exit, command)
