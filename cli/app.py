"""The `specbench` command line: thin. It parses, builds configs and calls suites.

Exit codes: 0 ok, 1 a check failed (a gate, a parity verdict), 2 bad usage or input.
Commands live in their own modules and are registered here by dotted path, imported lazily so that
`specbench --help` stays fast and one broken optional dependency never takes the whole CLI down.
"""

from __future__ import annotations

import importlib
import sys

import typer

from specbench import __version__

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


def main() -> None:
    _register()
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
