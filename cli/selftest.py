"""`specbench selftest`: inject every named engine fault, prove some lossless gate catches it.

Contract: builds the reference engine from --candidate (a local engine string; default the bundled pair
with speculation on) once per fault (`faults=<name>` appended) and once per clean repetition, plus one
speculation-off baseline of the same model, and calls specbench.suites.lossless.selftest.run_selftest.
Prints the fault -> gates matrix (one JSON document with --json), writes the markdown with --report.
Exit codes: 0 every fault caught and the clean engine passed every gate in every repetition; 1 a fault
was missed or the clean engine raised an alarm; 2 bad input.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer

from specbench.harness.errors import usage_errors


def selftest(
    repeat: int = typer.Option(5, "--repeat", min=1, help="Clean-engine repetitions (each on a fresh engine)."),
    candidate: str | None = typer.Option(None, "--candidate", help="Local engine string with a drafter. Default: the bundled pair, spec on."),
    faults: str | None = typer.Option(None, "--faults", help="Comma-separated subset of faults (default: every greedy fault)."),
    num_prompts: int = typer.Option(6, "--num-prompts", min=1, help="Prompts per gate."),
    max_tokens: int = typer.Option(48, "--max-tokens", min=4, help="Greedy tokens per request."),
    margin_tol: float = typer.Option(0.20, "--margin-tol", min=0.0, help="Benign-flip margin in nats."),
    expect_accept_len: float | None = typer.Option(None, "--expect-accept-len", min=1.0, help="Reference acceptance (default: clean run 1)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    report: Path | None = typer.Option(None, "--report", help="Write the markdown matrix here."),
) -> None:
    """Prove the lossless gates have teeth: every named fault caught, no false alarm on the clean engine.

    Each greedy fault of the reference engine (KV offset in verify, skipped rollback, wrong bonus token, accept off by one, draft context misaligned, causal mask leak, stale buffer replay, tokens past a stop) is injected into a fresh engine and every gate runs against it; the clean engine runs the same gates --repeat times. Exit 1 if a fault is missed or the clean engine fails a gate.
    """
    from specbench.harness.engines import (
        EngineSpec,
        EngineStringError,
        build_adapter,
        default_engines,
        parse_engine,
        share_gpu,
    )
    from specbench.suites.lossless.greedy import GreedyGateOptions
    from specbench.suites.lossless.report import render_selftest
    from specbench.suites.lossless.selftest import greedy_faults, run_selftest

    bad = usage_errors("selftest")

    try:
        names = [f.strip() for f in faults.split(",") if f.strip()] if faults else None
        unknown = [f for f in names or [] if f not in greedy_faults()]
        if unknown:
            raise ValueError(f"--faults {','.join(unknown)} unknown: expected any of {', '.join(greedy_faults())}")
        base_spec, cand_spec = default_engines() if candidate is None else (None, parse_engine(candidate))
        if cand_spec.kind != "local":
            raise EngineStringError(f"--candidate {candidate!r}: the self-test injects faults into the local "
                                    "reference engine; give a local engine string")
        if base_spec is None:
            opts = {k: v for k, v in cand_spec.options.items() if k in ("device", "dtype", "num_pages")}
            base_spec = EngineSpec("local", cand_spec.target, {**opts, "spec": "off"}, f"local:{cand_spec.target},spec=off")
        base_spec, cand_spec = share_gpu([base_spec, cand_spec])
        baseline = build_adapter(base_spec, name="baseline")
    except (EngineStringError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None

    def make(fs: tuple[str, ...]):
        opts = {k: v for k, v in cand_spec.options.items() if k != "faults"}
        if fs:
            opts["faults"] = "+".join(fs)
        opts["name"] = "candidate" + (f"[{'+'.join(fs)}]" if fs else "")
        return build_adapter(EngineSpec("local", cand_spec.target, opts, cand_spec.raw))

    log = (lambda s: typer.echo(s, err=True)) if json_out else typer.echo

    async def main():
        try:
            return await run_selftest(make, baseline, repeat=repeat, num_prompts=num_prompts, max_tokens=max_tokens,
                                      opts=GreedyGateOptions(margin_tol=margin_tol), faults=names,
                                      expect_accept_len=expect_accept_len, log=log)
        finally:
            await baseline.aclose()

    try:
        out = asyncio.run(main())
    except ValueError as e:
        raise bad(str(e)) from None
    md = render_selftest(out)
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
    if not out.ok:
        raise typer.Exit(1)
