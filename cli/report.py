"""`specbench report RUN...`: render stored sweep runs as markdown A/B tables and PNG plots.

Thin: loads each run directory, summarizes, writes OUT.md plus OUT-<plot>.png beside it (or prints
the markdown with --out -). Several runs are compared in one report. A missing or non-sweep run
directory exits 2 naming it.
"""

from __future__ import annotations

from pathlib import Path

import typer


def report(
    runs: list[Path] = typer.Argument(..., help="Run directories written by `specbench sweep` (results/<run>)."),
    out: str = typer.Option(None, "--out", "-o", help="Markdown path (PNGs go beside it); '-' prints markdown "
                            "only. Default: reports/<first run id>.md"),
    fmt: str = typer.Option("markdown", "--format", help="Output format: markdown."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots."),
) -> None:
    """Render sweep runs: A/B tables (tok/s, speedup with noise floor, latency, acceptance) and plots."""
    from specbench.suites.report import ReportError, load_run_summary, render_markdown, write_report

    if fmt != "markdown":
        raise typer.BadParameter(f"{fmt!r} is invalid: expected markdown", param_hint="--format")
    try:
        summaries = [load_run_summary(r) for r in runs]
    except ReportError as e:
        raise typer.BadParameter(str(e), param_hint="RUNS") from None
    if out == "-":
        typer.echo(render_markdown(summaries), nl=False)
        return
    target = Path(out) if out else Path("reports") / f"{summaries[0].run_id}.md"
    paths = write_report(summaries, target, plots=plots)
    typer.echo(f"report: {paths[0]}")
    for p in paths[1:]:
        typer.echo(f"plot:   {p}")
