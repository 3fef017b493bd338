"""`specbench selftest`: inject every named engine fault, prove some lossless gate catches it.

Contract: builds the clean candidate from --candidate (a local engine string; default the bundled pair
with speculation on; faults= dropped) and its speculation-off twin as the baseline, and calls
specbench.suites.lossless.selftest.run_selftest, which arms each fault on a fresh engine through the
candidate's "faults" capability.
Prints the fault -> gates matrix (one JSON document with --json), writes the markdown with --report, and
records the run in the results store (`specbench report` renders it; --no-record skips it); ends with a
summary table on stderr (cli/summary.py: a row per engine, what caught each fault; none with --quiet, --json).
Exit codes: 0 every fault caught and the clean engine passed every gate in every repetition; 1 a fault
was missed or the clean engine raised an alarm; 2 bad input.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer

from specbench.cli.flags import record_option, results_dir_option
from specbench.harness.errors import usage_errors


def selftest(
    repeat: int = typer.Option(5, "--repeat", min=1, help="Clean-engine repetitions (each on a fresh engine)."),
    candidate: str | None = typer.Option(None, "--candidate", help="Local engine string with a drafter. Default: the bundled pair, spec on."),
    faults: str | None = typer.Option(None, "--faults", help="Comma-separated subset of faults (default: every greedy fault)."),
    num_prompts: int = typer.Option(6, "--num-prompts", min=1, help="Prompts per gate."),
    max_tokens: int = typer.Option(48, "--max-tokens", min=4, help="Greedy tokens per request."),
    margin_tol: float | None = typer.Option(None, "--margin-tol", min=0.0, help="Benign-flip margin in nats, honoured as typed. Default: strict mode for a float32 candidate (as `specbench lossless`), else 0.2."),
    expect_accept_len: float | None = typer.Option(None, "--expect-accept-len", min=1.0, help="Reference acceptance (default: clean run 1)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display, no per-engine lines and no summary "
                               "table: the matrix and the verdict only (--json implies it)."),
    report: Path | None = typer.Option(None, "--report", help="Write the markdown matrix here."),
    results: Path | None = results_dir_option("--results"),
    record: bool = record_option("Write the run to the results store."),
) -> None:
    """Prove the lossless gates have teeth: every named fault caught, no false alarm on the clean engine.

    Each greedy fault of the reference engine (KV offset in verify, skipped rollback, wrong bonus token, accept off by one, draft context misaligned, causal mask leak, stale buffer replay, tokens past a stop) is injected into a fresh engine and every gate runs against it; the clean engine runs the same gates --repeat times. Exit 1 if a fault is missed or the clean engine fails a gate.
    """
    from specbench.harness.adapters.base import UnsupportedCapability
    from specbench.harness.engines import (
        EngineSpec,
        EngineStringError,
        build_adapter,
        default_engines,
        fast_paths_on_cpu,
        gate_specs,
        parse_engine,
        share_gpu,
        spec_off_twin,
    )
    from specbench.suites.lossless.greedy import GreedyGateOptions
    from specbench.suites.lossless.regret import MARGIN_TOL
    from specbench.suites.lossless.report import render_selftest
    from specbench.suites.lossless.selftest import run_selftest

    bad = usage_errors("selftest")

    try:
        names = [f.strip() for f in faults.split(",") if f.strip()] if faults else None
        if candidate is None:
            base_spec, cand_spec = default_engines()
        else:
            cand_spec = parse_engine(candidate)
            if cand_spec.kind != "local":
                raise EngineStringError(f"--candidate {candidate!r}: the self-test injects faults into the local "
                                        "reference engine; give a local engine string")
            base_spec = spec_off_twin(cand_spec)
        clean = {k: v for k, v in cand_spec.options.items() if k != "faults"}
        cand_spec = EngineSpec(cand_spec.kind, cand_spec.target, clean, cand_spec.raw)
        base_spec, cand_spec = share_gpu(gate_specs([base_spec, cand_spec]))
        cand_spec = fast_paths_on_cpu(cand_spec)  # the faults are judged on the code a GPU run takes
        baseline = build_adapter(base_spec, name="baseline")
        cand = build_adapter(cand_spec, name="candidate")
    except (EngineStringError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None

    from specbench.cli.progress import RunProgress

    def log(s: str) -> None:  # per-engine lines: on a terminal the progress bar says it
        if not (quiet or json_out or progress.terminal):
            typer.echo(s, err=True)

    async def main():
        try:
            return await run_selftest(cand, baseline, repeat=repeat, num_prompts=num_prompts, max_tokens=max_tokens,
                                      opts=GreedyGateOptions(margin_tol=MARGIN_TOL if margin_tol is None else margin_tol,
                                                             margin_given=margin_tol is not None), faults=names,
                                      expect_accept_len=expect_accept_len, log=log, progress=progress)
        finally:
            await baseline.aclose()
            await cand.aclose()

    try:
        # one display over every engine (the clean one, each fault, the repetitions): done / total, ETA
        with RunProgress(0, quiet=quiet or json_out, unit="engines") as progress:
            out = asyncio.run(main())
    except (ValueError, UnsupportedCapability) as e:
        raise bad(str(e)) from None
    md = render_selftest(out)
    run_dir = None
    if record:
        from specbench.harness.results import open_run

        with open_run("selftest", "1", engines={"baseline": baseline.describe(), "candidate": cand.describe()},
                      config={"repeat": repeat, "faults": names, "num_prompts": num_prompts, "max_tokens": max_tokens,
                              "margin_tol": margin_tol, "expect_accept_len": expect_accept_len},
                      results=results) as run:
            run.update(summary=out.to_dict())
        run_dir = run.path
        typer.echo(f"run: {run.path}", err=True)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(md, encoding="utf-8")
    if json_out:
        typer.echo(json.dumps(out.to_dict(), default=str))
    else:
        typer.echo(md)
        if out.missed:
            typer.echo(f"MISSED faults: {', '.join(out.missed)}")
        if out.false_alarms:
            typer.echo(f"FALSE ALARMS on the clean engine: {'; '.join(out.false_alarms)}")
    from specbench.cli.summary import selftest_summary, show

    show(selftest_summary(out, run_dir, report), quiet=quiet or json_out)
    if not out.ok:
        raise typer.Exit(1)
