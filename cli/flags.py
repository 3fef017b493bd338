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


# ---- output paths: one policy for every option that names where a command writes --------------------------
# A file's missing folders are created before the command runs; a folder (the store, a product folder) is created
# by the command when it first writes. Either is refused in one line, exit 2, before anything runs when it cannot
# be made (a file in the way, a folder where a file is wanted, no permission): never a traceback after the run.
FILE_OPTIONS = ("--report", "--markdown", "--plot", "--merge-into", "--json")  # --json only where it takes a PATH
FOLDER_OPTIONS = ("--results-dir", "--result-dir", "--workdir")
OUT_IS_FILE = ("report", "bench-decode")  # their --out is a file; fixtures' and profile's a folder


def output_kind(command: str, opts: list[str] | tuple[str, ...]) -> str | None:
    """"file", "folder" or None (not an output path) for an option of `command` spelled `opts`."""
    if any(o in FOLDER_OPTIONS for o in opts):
        return "folder"
    if any(o in FILE_OPTIONS for o in opts):
        return "file"
    if "--out" in opts:
        return "file" if command in OUT_IS_FILE else "folder"
    return None


def _nearest(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def prepare_output(option: str, value: str | Path, kind: str) -> None:
    """Apply the policy above to one path (`-`, stdout, is left alone); raises BadOutputPath naming the option."""
    import os

    from specbench.harness.errors import BadOutputPath

    if str(value) in ("", "-"):
        return
    p = Path(value).expanduser()
    bad = f"{option} {str(value)!r} is invalid: "
    if kind == "file" and p.is_dir():
        raise BadOutputPath(bad + "it is a folder (expected a file path)")
    if kind == "folder" and p.exists() and not p.is_dir():
        raise BadOutputPath(bad + "it is a file (expected a folder)")
    folder = p.parent if kind == "file" else p
    top = _nearest(folder)
    if not top.is_dir():
        raise BadOutputPath(bad + f"{str(top)!r} is a file, so no folder can be made under it")
    if not os.access(top, os.W_OK | os.X_OK):
        raise BadOutputPath(bad + f"no permission to write in {str(top)!r}")
    if kind == "file":
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadOutputPath(bad + f"its folder cannot be created ({e.strerror or e})") from None


def prepare_outputs(command: str) -> None:
    """`prepare_output` for every output-path option the running command was given (cli/app.py calls it before
    each command)."""
    from typer._click.globals import get_current_context  # typer 0.29 vendors click as typer._click

    ctx = get_current_context(silent=True)
    if ctx is None:
        return
    for p in ctx.command.params:
        opts = getattr(p, "opts", None)
        if not opts or getattr(p, "is_flag", False) or not p.name or opts[0].startswith("-") is False:
            continue
        kind = output_kind(command, opts)
        value = ctx.params.get(p.name)
        if kind is None or value is None or isinstance(value, bool):
            continue
        prepare_output(opts[0], value, kind)
