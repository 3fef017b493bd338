"""One progress display for a long command, and its end-of-run summary table (rich, on stderr / stdout).

`RunProgress(total, unit=...)` counts units (requests, prompts compared, documents, engines) over every phase
of a run: `phase(name, n)` names the current phase (its n units are part of `total`, which `plan(total)` may
set once it is known; n None: a phase not counted), `advance()` is called once per finished unit (an adapter's
on_result), `update(done, total)` sets counts kept by someone else (a worker process). On a terminal it is one
rich bar: phase, done / total, elapsed, ETA for the whole run; stdout is drawn above it only when stdout is that
terminal too (else what a command prints there stays in the pipe). Without a terminal (a pipe, CI) it prints
one plain line per phase to stderr instead (a bar that redraws is noise in a log) and a last line ("done", or
"stopped at" when the run ended short of its total, e.g. on Ctrl-C, which it never swallows), and nothing at
all when quiet (`--quiet`, `--json`, `--no-progress`). `summary_table` prints rows as one rich table (on stdout
unless told a stream): the end-of-run summary every long command prints through cli/summary.py. docs/cli.md has
what each command counts.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

NO_TERMINAL_WIDTH = 120  # the width of --help (cli/app.py) and of these tables without a terminal


class RunProgress:
    # terminal=None means "is the stream a terminal?"; a test sets this to True or False to decide for every
    # display a command opens (tests/test_progress.py)
    force_terminal: bool | None = None

    def __init__(self, total: int, *, quiet: bool = False, stream: TextIO | None = None,
                 terminal: bool | None = None, unit: str = "requests") -> None:
        self.total, self.quiet, self.unit = total, quiet, unit
        self.stream = stream or sys.stderr
        if terminal is None:
            terminal = self.force_terminal if self.force_terminal is not None else self.stream.isatty()
        self.terminal = terminal
        self.done = 0
        self.work_total: float | None = None  # planned work, when units differ in cost (plan(work=...))
        self.work_done = 0.0
        self.phase_name = ""
        self._t0 = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> RunProgress:
        self._t0 = time.perf_counter()
        if not self.quiet and self.terminal:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn(self.unit), TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                                 console=Console(file=self.stream, force_terminal=True),
                                 transient=False, redirect_stdout=_isatty(sys.stdout))
            # stdout is only drawn above the bar when it is the terminal too: piped or redirected, what the
            # command prints there (a table, JSON, markdown) must reach the pipe, not the bar's stream
            self._bar.start()
            self._task = self._bar.add_task("starting", total=self.total, eta=_clock(None))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif not self.quiet and self.done:
            # short of the total: an interrupt (or a gate that stopped early); what was measured is kept
            word = "done" if self.done >= self.total else "stopped at"
            self._line(f"{word}: {self.done}/{self.total} {self.unit} in {self.elapsed():.0f} s")

    def plan(self, total: int, work: float | None = None) -> None:
        """The run's total, once it is known (after the prompts are made). `work`: the whole run's cost in the
        unit `advance(work=...)` reports, when units differ in cost (a sweep: a request at c64 is 1/64 of a
        wave, at c1 a whole one); the ETA then extrapolates work, not units."""
        self.total, self.work_total = total, work
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def eta(self) -> float | None:
        """Seconds left for the whole run at the rate measured so far (None before the first unit finished):
        units per second, or with planned work, work per second."""
        if self.work_total is not None:
            if self.work_done <= 0:
                return None
            return self.elapsed() / self.work_done * max(0.0, self.work_total - self.work_done)
        if self.done == 0:
            return None
        return self.elapsed() / self.done * max(0, self.total - self.done)

    def _redraw(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, eta=_clock(self.eta()))

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def phase(self, name: str, n: int | None) -> None:
        """The current phase and its n units (None: a phase whose work is not counted in units)."""
        self.phase_name = name
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, description=name)
            return
        eta = self.eta()
        self._line(f"{name}: " + (f"{n} {self.unit}; " if n is not None else "")
                   + f"{self.done}/{self.total} done, {self.elapsed():.0f} s elapsed"
                   + (f", ETA {eta:.0f} s" if eta is not None else ""))

    def advance(self, _result: object = None, n: int = 1, work: float | None = None) -> None:
        """n more units done (an adapter's on_result passes the result); `work` their cost (plan(work=...))."""
        self.done += n
        self.work_done += n if work is None else work
        self._redraw()

    def update(self, done: int, total: int | None = None) -> None:
        """Counts reported by someone else (a worker process): set, not added."""
        if total is not None and total != self.total:
            self.plan(total)
        if done != self.done:
            self.work_done += done - self.done
            self.done = done
            self._redraw()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def summary_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], stream: TextIO | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*("—" if c is None else f"{c:.4g}" if isinstance(c, float) else str(c) for c in r))
    out = stream or sys.stdout
    # a terminal (or $COLUMNS) sets the width; without one (a pipe, a log, CI) 120 columns rather than rich's 80,
    # as --help (cli/app.py), so a table of eight columns is not cut into slivers
    width = None if _isatty(out) or os.environ.get("COLUMNS", "").isdigit() else NO_TERMINAL_WIDTH
    Console(file=out, width=width).print(table)
