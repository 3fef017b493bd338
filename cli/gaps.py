"""`specbench gaps TRACE`: the CLI face of specbench.suites.gaps (registered by cli/app.py).

Contract: parses options, calls the suite, prints. Exit code 0 on success, 2 on bad input (an
unreadable or unknown trace, a bad --rules file or --phase-filter regex), with one message on stderr
naming the file and the accepted formats. The suite (and matplotlib) is imported only when the command
runs, so registering it costs the CLI nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from specbench.cli.flags import results_dir_option
from specbench.harness.errors import usage_exit


def gaps(
    trace: Path = typer.Argument(..., help="nsys .sqlite export, nsys stats cuda_gpu_trace .csv, or Kineto .json/.json.gz"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    phases: bool = typer.Option(False, "--phases", help="Also split busy and idle by NVTX / record_function range."),
    rules: Path | None = typer.Option(None, "--rules", help="Extra 'regex,class' lines, tried before the built-in rules."),
    markdown: Path | None = typer.Option(None, "--report", "--markdown", help="Also write a markdown report section here "
                                         "(--markdown: its older name, kept)."),
    plot: Path | None = typer.Option(None, "--plot", help="Also write a PNG bar chart of idle by kernel class (per phase)."),
    phase_filter: str | None = typer.Option(None, "--phase-filter", help="Only ranges whose name matches this regex count as phases."),
    outermost: bool = typer.Option(False, "--outermost", help="Attribute ops to the outermost covering range, not the innermost."),
    results: Path | None = results_dir_option("--results", help="The results store (default $SPECBENCH_RESULTS or "
                                              "./results)."),
    record: bool = typer.Option(True, "--record/--no-record", help="Write the analysis to the results store (`specbench report` renders it)."),
) -> None:
    """Where did the GPU sit idle, and which kernels paid for it?

    Per device: wall span, busy time (the union of kernel, memcpy and memset intervals over all streams; synchronization is not busy), idle time, the gap histogram (< 1, 1-3, 3-10, 10-100, > 100 us) and idle attributed to the kernel that starts right after each gap, grouped by kernel class (GEMM, attention, RMSNorm/LayerNorm, RoPE, activation/SwiGLU, residual add/elementwise, embedding/gather, KV copy, sampling/argmax/top-k, memcpy/memset, communication, other).

    The class rules are one ordered regex table (docs/gaps.md); --rules adds yours in front. Exit code 2 on an unreadable or unknown trace.
    """
    from specbench.suites import gaps as g

    pick = "outermost" if outermost else "innermost"
    try:
        extra = g.load_rules(rules) if rules is not None else []
        classifier = g.Classifier.build(extra)
        tr = g.read_trace(trace, phases=phases, pick=pick, phase_filter=phase_filter)
    except g.GapsError as e:
        raise usage_exit("gaps", str(e)) from None
    report = g.analyze(tr, classifier, phases=phases, phase_pick=pick, phase_filter=phase_filter)
    g.check_invariants(report)
    if record:
        from specbench.harness.results import open_run

        with open_run("gaps", "1", config={"trace": str(trace), "phases": phases, "rules": str(rules) if rules else None,
                                           "phase_filter": phase_filter, "pick": pick}, results=results) as run:
            run.update(summary=g.to_json(report))
        if not json_out:  # with --json the output is one JSON document, wherever stderr goes
            typer.echo(f"run: {run.path}", err=True)
    if plot is not None:
        g.plot_idle_by_class(report, plot)
    if markdown is not None:
        rel = None
        if plot is not None:
            try:
                rel = plot.resolve().relative_to(markdown.resolve().parent)
            except ValueError:
                rel = plot
        markdown.write_text(g.render_markdown(report, plot=rel), encoding="utf-8")
    if json_out:
        typer.echo(json.dumps(g.to_json(report)))
    else:
        typer.echo(g.render_text(report), nl=False)
