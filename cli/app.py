"""The `specbench` command line: thin. It parses, builds configs and calls suites.

Exit codes: 0 ok, 1 a check failed (a gate, a parity verdict), 2 bad usage or input (also: an optional
feature used without its extra, in one line naming the extra: specbench/extras.py).
Commands live in their own modules and are registered here by dotted path, imported lazily so that
`specbench --help` stays fast and one broken optional dependency never takes the whole CLI down.
Help uses the terminal's width (rich asks the terminal, or $COLUMNS); with no terminal at all (a pipe, a
file, CI) it is 120 columns rather than rich's 80, so option help is not cut into slivers.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from specbench import __version__
from specbench.cli.progress import NO_TERMINAL_WIDTH
from specbench.extras import MissingExtra

# name -> "module:function". Each function's docstring is its --help text.
COMMANDS: dict[str, str] = {
    "fixtures": "specbench.cli.fixtures:fixtures",
    "generate": "specbench.cli.generate:generate",
    "serve": "specbench.cli.serve:serve",
    "demo": "specbench.cli.demo:demo",
    "gaps": "specbench.cli.gaps:gaps",
    "eval": "specbench.cli.eval:eval_cmd",
    "profile": "specbench.cli.profile:profile",
    "sweep": "specbench.cli.sweep:sweep",
    "tune": "specbench.cli.tune:tune",
    "report": "specbench.cli.report:report",
    "import": "specbench.cli.import_cmd:import_cmd",
    "lossless": "specbench.cli.lossless:lossless",
    "selftest": "specbench.cli.selftest:selftest",
    "sampled": "specbench.cli.sampled:sampled",
    "bench-decode": "specbench.cli.bench:bench_decode",
    "check-draft": "specbench.cli.check_draft:check_draft",
}

app = typer.Typer(name="specbench", no_args_is_help=True, add_completion=False,
                  help="Benchmark and verify speculative-decoding engines.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specbench {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Benchmark and verify speculative-decoding engines."""


def _register() -> None:
    if app.registered_commands:  # idempotent: tests and main() may both call it
        return
    for name, target in COMMANDS.items():
        mod, fn = target.split(":")
        app.command(name=name)(getattr(importlib.import_module(mod), fn))


def help_width() -> int | None:
    """The width to force on typer's rich help, or None where rich finds the right one itself: it reads
    $COLUMNS (and typer $TERMINAL_WIDTH), then the size of whichever of stdout/stderr/stdin is a terminal,
    and only then falls back to 80."""
    if os.environ.get("COLUMNS", "").isdigit() or os.environ.get("TERMINAL_WIDTH", "").isdigit():
        return None
    for fd in (1, 2, 0):
        try:
            os.get_terminal_size(fd)
            return None
        except OSError:
            continue
    return NO_TERMINAL_WIDTH


def main() -> None:
    _register()
    width = help_width()
    if width is not None:
        from typer import rich_utils

        rich_utils.MAX_WIDTH = width
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
    except MissingExtra as e:
        cmd = next((a for a in sys.argv[1:] if a in COMMANDS), None)
        typer.echo(f"specbench{' ' + cmd if cmd else ''}: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
