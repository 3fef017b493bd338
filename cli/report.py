"""`specbench report RUN...`: render stored runs of any kind as markdown (sweep runs also as PNG plots).

Thin: loads each run directory (or run id under --results), and renders by the run's suite: sweep runs as
A/B tables and plots (suites/report summarize + markdown), lossless / sampled / selftest / eval / gaps runs
from their records (suites/report/kinds.py); several runs of one kind are compared in one report.
Writes OUT.md (PNGs beside it) or prints the markdown with --out -. Default OUT: results/reports/<first run
id>.md under the results store (git-ignored); the tracked reports/ folder only when --out names it.
A missing run, or sweep runs mixed with other kinds, exits 2 naming it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from specbench.cli.flags import results_dir_option


def report(
    runs: list[Path] = typer.Argument(..., help="Run directories (results/<run>) or run ids, of one kind: sweep, "
                                     "lossless, sampled, selftest, evalparity or gaps."),
    out: str = typer.Option(None, "--out", "-o", help="Markdown path (PNGs go beside it); '-' prints markdown "
                            "only. Default: results/reports/<first run id>.md"),
    fmt: str = typer.Option("markdown", "--format", help="Output format: markdown."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots (sweep runs)."),
    results: Path | None = results_dir_option("--results", help="The results store, for run ids and the default "
                                              "output (default $SPECBENCH_RESULTS or ./results)."),
) -> None:
    """Render stored runs: sweep A/B tables and plots; lossless, sampled, selftest, eval and gaps verdicts and tables."""
    from specbench.harness.results import load_stored_run
    from specbench.suites.report import ReportError, load_run_summary, render_markdown, run_meta, write_report
    from specbench.suites.report.kinds import KINDS, default_report_path, render_runs

    if fmt != "markdown":
        raise typer.BadParameter(f"{fmt!r} is invalid: expected markdown", param_hint="--format")
    try:
        loaded = [load_stored_run(r, results) for r in runs]
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="RUNS") from None
    kinds = [str(lr.meta.get("suite")) for lr in loaded]
    unknown = [f"{lr.path} ({k!r})" for lr, k in zip(loaded, kinds, strict=True) if k not in KINDS]
    if unknown:
        raise typer.BadParameter(f"no report for {', '.join(unknown)}: expected runs of {', '.join(KINDS)}",
                                 param_hint="RUNS")
    if "sweep" in kinds and set(kinds) != {"sweep"}:
        raise typer.BadParameter(f"sweep runs cannot share a report with {', '.join(sorted(set(kinds) - {'sweep'}))} "
                                 "runs: render them separately", param_hint="RUNS")
    target = Path(out) if out and out != "-" else default_report_path(runs, loaded[0].run_id, results)
    if kinds[0] == "sweep":
        try:
            summaries = [load_run_summary(lr.path) for lr in loaded]
        except ReportError as e:
            raise typer.BadParameter(str(e), param_hint="RUNS") from None
        if out == "-":
            typer.echo(render_markdown(summaries), nl=False)
            return
        paths = write_report(summaries, target, plots=plots)
    else:
        md = render_runs([(lr, run_meta(lr.meta, lr.status)) for lr in loaded])
        if out == "-":
            typer.echo(md, nl=False)
            return
        target = target if target.suffix == ".md" else target.with_suffix(".md")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(md, encoding="utf-8")
        paths = [target]
    typer.echo(f"report: {paths[0]}")
    for p in paths[1:]:
        typer.echo(f"plot:   {p}")
