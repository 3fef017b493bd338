"""One vocabulary of flags across commands (issue 24 item 6; docs/cli.md "Flag vocabulary").

- `--results-dir DIR`: the results store (a run folder is created in it). Older spellings stay as aliases:
  `--results` (lossless, sampled, selftest, eval, gaps, report) and `--out` (sweep, tune, import).
- `--out PATH`: the file or folder that is a command's product (fixtures, profile, bench-decode, report);
  `--report PATH`: the markdown report of a run (every run command; gaps' `--markdown` is its alias).
- `--record/--no-record`: whether the run is kept in the store, on every command that stores a run (sweep,
  tune and eval with --no-record run in a scratch store that is deleted at the end).
- `--quiet` / `-q`: no progress display and no summary table; stdout, the verdict and the exit code are the
  same (`--no-progress`, sweep and tune's older flag, is its alias).
- `--dataset`: one set of names (`DATASETS`), spelled with `_` or `-`, any case (`dataset_name`).

The option factories here are what the commands declare, so the names cannot drift apart again;
tests/test_flags.py checks that every alias parses to what its native flag does.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

RESULTS_HELP = "The results store: a run folder is created in it (default $SPECBENCH_RESULTS or ./results)."
QUIET_HELP = ("No progress display and no summary table (stdout, the verdict and the exit code are the same; "
              "--json implies it).")


def _older(old: tuple[str, ...]) -> str:
    return f" ({' / '.join(old)}: its older name, kept)" if old else ""


def results_dir_option(*old: str, help: str = RESULTS_HELP) -> Any:
    """`--results-dir` and the command's older spellings of it."""
    return typer.Option(None, "--results-dir", *old, help=help + _older(old))


def record_option(help: str = "Keep the run in the results store (--no-record: write no run).") -> Any:
    return typer.Option(True, "--record/--no-record", help=help)


def quiet_option(*, progress_flag: bool = False, help: str = QUIET_HELP) -> Any:
    """`--quiet/-q`; with progress_flag also the older `--no-progress` (its alias) and `--progress` (its off)."""
    if progress_flag:
        return typer.Option(False, "--quiet/--progress", "-q", "--no-progress", help=help + _older(("--no-progress",)))
    return typer.Option(False, "--quiet", "-q", help=help)


def dataset_name(name: str, allowed: tuple[str, ...], option: str = "--dataset") -> str:
    """The canonical name (`spec-bench`, `Spec_Bench` -> spec_bench) if it is one of `allowed`, else exit 2
    naming the option and the names accepted."""
    d = name.strip().lower().replace("-", "_")
    if d not in allowed:
        raise typer.BadParameter(f"{name!r} is invalid: expected one of {', '.join(allowed)} (spec-bench and other "
                                 "spellings with '-' are accepted)", param_hint=option)
    return d


@contextlib.contextmanager
def scratch_store(record: bool, results: str | Path | None) -> Iterator[str | None]:
    """The store a run writes to: `results` (None: the default store) when recording, else a temporary folder
    deleted on the way out (for the commands whose figures are computed from their stored records)."""
    if record:
        yield None if results is None else str(results)
        return
    tmp = tempfile.mkdtemp(prefix="specbench-norecord-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
