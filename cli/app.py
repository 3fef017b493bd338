"""The `specbench` command line: thin. It parses, builds configs and calls suites.

Exit codes: 0 ok, 1 a check failed (a gate, a parity verdict), 2 bad usage or input (also: an optional
feature used without its extra, in one line naming the extra: specbench/extras.py), 3 CANNOT TEST, 130
interrupted (Ctrl-C), 143 terminated (SIGTERM). Every failure is one line on stderr, `specbench COMMAND: ...`
(harness/errors.py `fail`; with a command's --json flag on, a JSON object on stdout too), for every command:
- a bad flag value, a missing or unknown option (click's usage errors): `Group.main` prints them in that shape
  instead of click's box, exit 2;
- around every command (`_guarded`): the failures raised where they are found (harness/errors.py `Refusal`:
  authentication refused, an endpoint that does not answer, an output path that cannot be written; the engine's
  no-CUDA `DeviceUnavailable`, exit 3), a missing extra (exit 2), an interrupt (130; SIGTERM is handled as
  SIGINT, harness/interrupts.py, and exits 143); and before the command runs, every output-path option it was
  given is checked and its folder made (cli/flags.py `prepare_outputs`). `serve` keeps its own signal handling.
Commands live in their own modules and are registered here by dotted path, imported lazily so that
`specbench --help` stays fast and one broken optional dependency never takes the whole CLI down.
Help uses the terminal's width (rich asks the terminal, or $COLUMNS); with no terminal at all (a pipe, a
file, CI) it is 120 columns rather than rich's 80, so option help is not cut into slivers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer
from typer._click.exceptions import (  # typer 0.29 vendors click as typer._click
    ClickException,
    NoArgsIsHelpError,
)
from typer._click.globals import get_current_context
from typer.core import TyperGroup

from specbench import __version__
from specbench.cli.flags import prepare_outputs
from specbench.cli.progress import NO_TERMINAL_WIDTH
from specbench.extras import MissingExtra
from specbench.harness.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    AuthRefused,
    fail,
    failure_json,
    one_line,
    refusal_code,
)
from specbench.harness.interrupts import how_stopped, sigterm_as_sigint, terminated

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

OWN_SIGNALS = ("serve",)  # commands that handle SIGTERM themselves (the server drains)


def _json_in_args(cmd: Any, args: list[str]) -> bool:
    """Whether `--json` was typed for a command whose --json is a flag (for errors raised before parsing ends)."""
    if cmd is None or "--json" not in args:
        return False
    return any("--json" in (getattr(p, "opts", None) or ()) and getattr(p, "is_flag", False) for p in cmd.params)


class Group(TyperGroup):
    """typer's group, but every click usage error is one line (`specbench CMD: Invalid value for '--x': ...`,
    exit 2), and a command interrupted by SIGTERM exits 143 where Ctrl-C exits 130."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, False, windows_expand_args, **extra)
        except NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except ClickException as e:
            ctx = getattr(e, "ctx", None)
            sub = ctx.command if ctx is not None and ctx.command is not self else None
            name = sub.name if sub is not None else ""
            msg = one_line(e.format_message())
            typer.echo((f"specbench {name}: " if name else "specbench: ") + msg, err=True)
            if _json_in_args(sub, argv):
                typer.echo(failure_json(name or "", msg, e.exit_code))
            sys.exit(e.exit_code)
        except typer.Abort:
            rv = EXIT_INTERRUPTED
        code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
        if code == EXIT_INTERRUPTED and terminated():
            code = EXIT_TERMINATED
        sys.exit(code)


def _has_option(flag: str) -> bool:
    """Whether the command now running has the option `flag`."""
    ctx = get_current_context(silent=True)
    return ctx is not None and any(flag in (getattr(p, "opts", None) or ()) for p in ctx.command.params)


def _guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The command `fn` with the one failure policy of the module docstring around it."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        with contextlib.nullcontext() if name in OWN_SIGNALS else sigterm_as_sigint():
            try:
                prepare_outputs(name)
                return fn(*args, **kwargs)
            except (typer.Exit, ClickException):
                raise
            except KeyboardInterrupt:
                raise fail(name, f"{how_stopped()}; every record already written is kept",
                           EXIT_TERMINATED if terminated() else EXIT_INTERRUPTED) from None
            except MissingExtra as e:
                raise fail(name, str(e), EXIT_USAGE) from None
            except Exception as e:
                code = refusal_code(e)
                if code is None:
                    raise
                msg = str(e)
                if isinstance(e, AuthRefused) and _has_option("--api-key"):
                    msg += " (or --api-key <key> for the openai arms without api_key=)"
                raise fail(name, msg, code) from None

    return command


app = typer.Typer(name="specbench", no_args_is_help=True, add_completion=False, cls=Group,
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
        app.command(name=name)(_guarded(name, getattr(importlib.import_module(mod), fn)))


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
