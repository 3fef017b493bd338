"""How a command reports a failure: one line on stderr naming the command, then the documented exit code.

Contract:
- `fail(command, msg, code)` prints `specbench COMMAND: MSG` (one line: any newline in MSG is folded) on stderr
  and returns the `typer.Exit(code)` to raise. Where the running command has a `--json` flag and it is on,
  stdout gets one JSON object too, `{"command", "error", "exit_code"}` (and `"verdict": "CANNOT TEST"` for
  exit 3), so `--json` output is JSON whatever happens. `usage_exit` / `usage_errors` are `fail` with exit 2.
- Exit codes (README, docs/cli.md "Exit codes"): 0 ok, 1 a check failed, 2 bad usage or input, 3 CANNOT TEST
  (harness/verdicts.py holds the numbers), 130 interrupted (SIGINT), 143 terminated (SIGTERM).
- `Refusal` is a failure that is not a finding, raised where it is found (an adapter, the engine) and turned into
  `fail(...)` by the CLI for every command (cli/app.py): `AuthRefused` (an endpoint answered 401 / 403: exit 2;
  the message names the endpoint, the route and how to give a key, never the key), `EndpointUnreachable`
  (nothing answers at an endpoint's URL on first contact: exit 2), `EndpointError` (it answers, but names no
  model: exit 2), `BadOutputPath` (an output path that cannot be written: exit 2). The engine's `DeviceUnavailable` (device=cuda without a CUDA GPU: the engine imports
  nothing of the harness) is mapped the same way, to exit 3 (`refusal_code`).
This module imports typer only inside `fail`, so adapters may raise its exceptions at no import cost.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from specbench.harness.verdicts import CANNOT_TEST, EXIT_CANNOT_TEST, EXIT_USAGE

if TYPE_CHECKING:
    import typer

EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): every record already written is kept
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), handled exactly as SIGINT (harness/interrupts.py)

# How an openai engine gets its bearer key, for the message of an AuthRefused (commands add their own flag).
KEY_HINT = "give its key with api_key=<key> in the engine string (openai:<url>,api_key=<key>) or $OPENAI_API_KEY"


class Refusal(Exception):
    """A failure the CLI reports in one line with `exit_code` (see the module contract)."""

    exit_code = EXIT_USAGE


class AuthRefused(Refusal):
    """An endpoint refused the request's credentials (HTTP 401 / 403)."""

    def __init__(self, endpoint: str, status: int, route: str, sent: str | None, detail: str = "") -> None:
        self.endpoint, self.status, self.route, self.sent = endpoint, status, route, sent
        what = f"the key from {sent} was refused" if sent else "no key was sent"
        tail = f" ({detail[:200]})" if detail else ""
        super().__init__(f"the endpoint {endpoint} refused authentication (HTTP {status} on {route}; {what}){tail}: "
                         f"{KEY_HINT}")


AUTH_STATUSES = (401, 403)
UNGUARDED_ROUTES = ("/metrics", "/health")  # a refused scrape or health poll is recorded as such, never fatal


def check_auth(endpoint: str, status: int, route: str, sent: str | None, detail: str = "") -> None:
    """Raise AuthRefused for a 401 / 403 answer on any route but /metrics and /health (`route`: "GET /v1/models";
    `sent`: where the key came from, None when none was sent; `detail`: the server's message, keys masked)."""
    if status in AUTH_STATUSES and not route.endswith(UNGUARDED_ROUTES):
        raise AuthRefused(endpoint, status, route, sent, detail)


class EndpointUnreachable(Refusal):
    """Nothing answers at an endpoint's URL on first contact (connection refused, no such host, a timeout)."""

    def __init__(self, endpoint: str, detail: str) -> None:
        self.endpoint = endpoint
        super().__init__(f"the endpoint {endpoint} does not answer ({detail}): is its server up at this URL?")


class EndpointError(Refusal):
    """An endpoint answered, but not in a way the engine string can be used with (e.g. it names no model)."""


class BadOutputPath(Refusal):
    """An output path (--out, --report, --plot, ...) that cannot be written."""


def refusal_code(e: BaseException) -> int | None:
    """The exit code of an exception the CLI reports in one line, or None for any other exception."""
    if isinstance(e, Refusal):
        return e.exit_code
    engine = sys.modules.get("specbench.engine.config")  # raised by the engine only if it was loaded (no import)
    if engine is not None and isinstance(e, engine.DeviceUnavailable):
        return EXIT_CANNOT_TEST  # no CUDA GPU where a configuration names one
    return None


def one_line(msg: str) -> str:
    return " ".join(part.strip() for part in str(msg).splitlines() if part.strip())


def json_requested() -> bool:
    """Whether the command now running has a `--json` flag (not a `--json PATH` option) and it is on."""
    from typer._click.globals import get_current_context  # typer 0.29 vendors click as typer._click

    ctx = get_current_context(silent=True)
    while ctx is not None:
        for p in ctx.command.params:
            if "--json" in (getattr(p, "opts", None) or ()) and getattr(p, "is_flag", False) and p.name:
                return bool(ctx.params.get(p.name))
        ctx = ctx.parent
    return False


def failure_json(command: str, msg: str, code: int) -> str:
    doc: dict[str, Any] = {"command": command, "error": one_line(msg), "exit_code": code}
    if code == EXIT_CANNOT_TEST:
        doc["verdict"] = CANNOT_TEST
    return json.dumps(doc)


def fail(command: str, msg: str, code: int, *, as_json: bool | None = None) -> typer.Exit:
    """Print the failure (module contract) and return the Exit(code) to raise. `as_json`: None = ask the running
    command's --json flag."""
    import typer

    prefix = f"specbench {command}: " if command else "specbench: "
    typer.echo(prefix + one_line(msg), err=True)
    if json_requested() if as_json is None else as_json:
        typer.echo(failure_json(command, msg, code))
    return typer.Exit(code)


def usage_exit(command: str, msg: str) -> typer.Exit:
    """Print `specbench COMMAND: MSG` to stderr and return the Exit(2) to raise."""
    return fail(command, msg, EXIT_USAGE)


def usage_errors(command: str) -> Callable[[str], typer.Exit]:
    """`bad = usage_errors("lossless")`, then `raise bad("--x ... is invalid: expected ...")`."""
    return partial(usage_exit, command)
