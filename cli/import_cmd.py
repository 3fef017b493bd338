"""`specbench import vllm-bench FILE...`: other tools' result files into the results store.

Thin: `vllm-bench` reads `vllm bench serve --save-result` JSON files (suites/sweep/vllm_import.py) into
one sweep run and prints its directory; `specbench report` then renders it, alone or beside a specbench
run. A file that is not such a result, an unknown source or a mix of closed- and open-loop files exits 2
naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path

import typer

from specbench.cli.flags import results_dir_option

SOURCES = ("vllm-bench",)


def import_cmd(
    source: str = typer.Argument(..., help=f"What the files are: {', '.join(SOURCES)}."),
    files: list[Path] = typer.Argument(..., help="The result files (vLLM: --save-result JSON, one per run)."),
    out: str = results_dir_option("--out"),
    label: str = typer.Option(None, "--label", help="Arm label for every file (default: each file's label, else "
                              "its backend)."),
) -> None:
    """Import vLLM bench results as a sweep run, so `specbench report` can show them beside specbench's."""
    from specbench.suites.sweep.vllm_format import VllmFormatError
    from specbench.suites.sweep.vllm_import import import_vllm_bench

    if source not in SOURCES:
        raise typer.BadParameter(f"{source!r} is invalid: expected one of {', '.join(SOURCES)}", param_hint="SOURCE")
    try:
        path = import_vllm_bench(files, out, label)
    except VllmFormatError as e:
        raise typer.BadParameter(str(e), param_hint="FILES") from None
    typer.echo(f"imported {len(files)} file(s): {path}")
    typer.echo(f"render: specbench report {path}")
