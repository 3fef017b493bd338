"""SIGTERM is handled as SIGINT (Ctrl-C): one rule for every long command and every open run.

Contract:
- `sigterm_as_sigint()` (a context manager; a no-op outside the main thread): while inside, SIGTERM calls
  whatever handles SIGINT at that moment: inside `asyncio.run` its runner's handler, which cancels the main
  task, so the run unwinds exactly as it does on Ctrl-C (records kept, `finally` blocks run, no "Task
  exception was never retrieved"); elsewhere Python's default, which raises KeyboardInterrupt. Where SIGINT
  is ignored (a job a script started with `&`: the shell ignores SIGINT for it), the outermost entry blocks
  SIGINT and gives it Python's default handler, so Ctrl-C still does nothing (a blocked signal waits, and is
  dropped when SIG_IGN is back on the way out) while asyncio.run finds the handler it builds on, and SIGTERM
  takes the same path. Only where SIGINT has some other disposition does SIGTERM raise `Terminated` (a
  KeyboardInterrupt) where the program happens to be. The previous handlers and mask are restored on the way
  out; nesting is fine (open_run inside a command).
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
    ignored = False
    if not _state["depth"]:
        _state["terminated"] = False
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # see the module contract
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            signal.signal(signal.SIGINT, signal.default_int_handler)
            ignored = True
    old = signal.signal(signal.SIGTERM, _on_term)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        signal.signal(signal.SIGTERM, old)
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a SIGINT that waited while blocked is dropped now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
