"""SIGTERM is handled as SIGINT (Ctrl-C): one rule for every long command and every open run.

Contract:
- `sigterm_as_sigint()` (a context manager; a no-op outside the main thread): while inside, SIGTERM calls
  whatever handles SIGINT at that moment: inside `asyncio.run` its runner's handler, which cancels the main
  task, so the run unwinds exactly as it does on Ctrl-C (records kept, `finally` blocks run, no "Task
  exception was never retrieved"); elsewhere Python's default, which raises KeyboardInterrupt. Where SIGINT
  is ignored (a background job of a script), SIGTERM raises `Terminated` (a KeyboardInterrupt) at once.
  The previous SIGTERM handler is restored on the way out; nesting is fine (open_run inside a command).
- `terminated()`: whether a SIGTERM arrived since the outermost `sigterm_as_sigint()` was entered; the CLI
  then exits 143 (128 + SIGTERM) where Ctrl-C exits 130 (harness/errors.py); `how_stopped()` words it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM where SIGINT is ignored: a KeyboardInterrupt, so it unwinds as Ctrl-C would."""


_state = {"depth": 0, "terminated": False}


def terminated() -> bool:
    return bool(_state["terminated"])


def how_stopped() -> str:
    """How the run was stopped, for the one line that says so: "terminated (SIGTERM)" or "interrupted"."""
    return "terminated (SIGTERM)" if terminated() else "interrupted"


def _on_term(signum: int, frame: Any) -> None:
    _state["terminated"] = True
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
        return
    raise Terminated(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _state["depth"]:
        _state["terminated"] = False
    old = signal.signal(signal.SIGTERM, _on_term)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        signal.signal(signal.SIGTERM, old)
