"""`specbench eval`: lm-eval tasks on two arms (spec off vs on by default), offline, with a parity verdict.

Contract: parses options, builds the suite's config, calls specbench.suites.evalparity, prints the
markdown table (or one JSON document with --json); while it runs, one progress display on stderr (documents
done / total over both arms, the arm and its phase, the ETA), at the end a summary table on stderr
(cli/summary.py: a row per task and metric); neither with --quiet or --json. Exit codes: 0 PARITY, 1 DIFFERENT (with --strict
also any differing answer) or an arm that could not be evaluated, 2 bad usage (an unknown task, a bad
engine string) or lm-eval not installed (with the command that installs it), 3 CANNOT TEST (no document
was compared), 130 on Ctrl-C; servers it
started are stopped in every case.
Arms: with neither --baseline nor --candidate, the bundled tiny pair with speculation off vs on; with
only a local --candidate, the baseline is the same engine with spec=off.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from specbench.cli.flags import quiet_option, record_option, results_dir_option
from specbench.harness.engines import EngineStringError, baseline_and_candidate
from specbench.harness.errors import fail, usage_exit
from specbench.harness.verdicts import is_cannot_test


def eval_cmd(
    task: str = typer.Option("gsm8k", "--task", help="Bundled lm-eval task(s), comma-separated (harness/data/lm_eval_tasks)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Only the first N documents of each task."),
    baseline: str | None = typer.Option(None, "--baseline", help="Engine string of the reference arm (default: bundled pair, spec off)."),
    candidate: str | None = typer.Option(None, "--candidate", help="Engine string of the arm under test (default: bundled pair, spec on)."),
    num_fewshot: int = typer.Option(5, "--num-fewshot", min=0, help="Few-shot examples (drawn from the train split)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Requests in flight per arm (lm-eval num_concurrent)."),
    tokenizer_backend: str = typer.Option("auto", "--tokenizer-backend",
                                          help="auto | remote (lm-eval tokenizes via /tokenize, truncates to the context) | none (text prompts)."),
    max_length: int | None = typer.Option(None, "--max-length", min=2,
                                          help="lm-eval's context budget for both arms (remote tokenizer; default: each server's context)."),
    results: Path | None = results_dir_option("--results"),
    record: bool = record_option("Keep the run (per-sample outputs) in the results store (--no-record: a scratch store, deleted once the table is printed)."),
    quiet: bool = quiet_option(),
    report: Path | None = typer.Option(None, "--report", help="Also write the markdown report here."),
    strict: bool = typer.Option(False, "--strict",
                                help="Also exit 1 when any extracted answer differs, even within stderr (a losslessness gate)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document instead of the markdown."),
    startup_timeout: float = typer.Option(600.0, "--startup-timeout", min=1.0, help="Seconds to wait for a local server's /health."),
) -> None:
    """Task-level parity: run lm-eval (offline, bundled data) on a baseline and a candidate engine.

    For each arm in turn: a local engine is served with `specbench serve` on a free loopback port (stopped afterwards, also on error or Ctrl-C), a remote one (openai:<url>) is used as is; lm-eval's local-completions model runs the task against it with HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1. The table gives both arms' scores with stderr per task and filter, how many extracted answers differ and which. Verdict PARITY when |delta| <= sqrt(se_b^2 + se_c^2), else DIFFERENT (exit 1). Per-sample outputs go to the results store. Needs `pip install 'specbench\\[eval]'` (exit 2 without it). See docs/eval.md.
    """
    from specbench.suites.evalparity import runner
    from specbench.suites.evalparity.endpoint import EndpointError
    from specbench.suites.evalparity.tasks import TaskError, available_tasks

    hint = runner.check_lm_eval()
    if hint is not None:
        raise usage_exit("eval", hint)
    tasks = tuple(t.strip() for t in task.split(",") if t.strip())
    try:
        known = available_tasks()
        unknown = [t for t in tasks if t not in known]
        if not tasks or unknown:
            raise TaskError(f"--task {task!r}: expected bundled task names among {', '.join(known)}")
        if tokenizer_backend not in runner.BACKENDS:
            raise TaskError(f"--tokenizer-backend {tokenizer_backend!r}: expected one of {', '.join(runner.BACKENDS)}")
        base, cand = baseline_and_candidate(baseline, candidate)
    except (TaskError, EngineStringError) as e:
        raise usage_exit("eval", str(e)) from None
    from specbench.cli.flags import scratch_store
    from specbench.cli.progress import RunProgress

    with scratch_store(record, results) as store:
        cfg = runner.EvalConfig(baseline=base, candidate=cand, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                                concurrency=concurrency, tokenizer_backend=tokenizer_backend, max_length=max_length,
                                results=store, startup_timeout_s=startup_timeout)
        try:  # documents done over both arms, on stderr (none with --json): lm-eval's own output goes to its log
            with RunProgress(0, quiet=quiet or json_out, unit="documents") as progress:
                pr, path = runner.run_parity(cfg, progress=progress)
        except (runner.EvalError, EndpointError) as e:
            raise fail("eval", str(e), 1) from None
    if not record:
        pr.samples_path = None  # the scratch store is gone
    from specbench.suites.evalparity.report import render_markdown, to_json

    md = render_markdown(pr)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(md, encoding="utf-8")
    if json_out:
        typer.echo(json.dumps(to_json(pr), default=str))
    else:
        typer.echo(md)
        typer.echo(f"results: {path}" if record else "results: not kept (--no-record)")
    from specbench.cli.summary import eval_summary, show

    show(eval_summary(pr, path if record else None, report), quiet=quiet or json_out)
    if pr.verdict != "PARITY":
        from specbench.harness.verdicts import exit_code

        raise typer.Exit(exit_code(pr.verdict) if is_cannot_test(pr.verdict) else 1)
    n_differ = sum(len(r.differ) for r in pr.rows)
    if strict and n_differ:
        raise fail("eval", f"--strict: {n_differ} extracted answers differ between the arms", 1,
                   as_json=False)  # --json printed its document already
