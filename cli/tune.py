"""`specbench tune`: the sweep over concurrency for spec off and a grid of settings, the crossover and the best
setting per concurrency with noise floors (suites/tune.py).

Thin: parses and validates options (a bad value exits 2 naming the option), builds the arms (bundled engine:
--base plus the --k / --trim / --gate / --policy grid; any engine: --arms label=engine;...), runs the sweep with
one progress display (cli/progress.py: requests done / total over every cell of the sweep, the cell, the ETA;
on stderr), prints the table and writes --json / --report / --merge-into, and ends with a summary table on stderr
(cli/summary.py: per concurrency the best setting and its ratio to plain, the crossover, the recommendation);
--quiet (-q, or its older name --no-progress) turns the display and the summary off, stdout is the same. Ctrl-C keeps
every record already written and exits 130 (SIGTERM: 143). A cell answered with no output token at all exits 3,
CANNOT TEST, in one line naming the cells (as specbench sweep).
"""

from __future__ import annotations

import json

import typer

from specbench import env
from specbench.cli.flags import quiet_option, record_option, results_dir_option


def _ints(text: str | None, option: str, lo: int) -> list[int]:
    if text is None:
        return []
    out = []
    for p in text.split(","):
        p = p.strip()
        if not p.lstrip("-").isdigit() or int(p) < lo:
            raise typer.BadParameter(f"{p!r} in {text!r} is invalid: expected comma-separated integers >= {lo}",
                                     param_hint=option)
        out.append(int(p))
    return out


def tune(
    base: str = typer.Option(None, "--base", help="The bundled engine the grid varies (an engine string, e.g. "
                             "local:<dir>,draft=<dir>,device=cuda,tau=6.5); default: the bundled tiny pair."),
    arms: str = typer.Option(None, "--arms", help="Instead of a grid: label=engine;label=engine;... (any engines, e.g. "
                             "several vLLM servers); the first is the spec-off baseline unless --baseline names one."),
    baseline: str = typer.Option(None, "--baseline", help="Label of the spec-off arm with --arms (default: the first)."),
    k: str = typer.Option(None, "--k", help="Grid: K values, comma-separated (default: the engine's own K)."),
    trim: str = typer.Option("0", "--trim", help="Grid: draft trims, comma-separated (0 = no trim)."),
    gate: str = typer.Option("0", "--gate", help="Grid: max-batch gate thresholds, comma-separated (0 = no gate)."),
    policy: str = typer.Option("off,auto", "--policy", help="Grid: span policies, comma-separated (off, auto)."),
    aa: bool = typer.Option(False, "--aa", help="Grid: also a second plain engine built apart (`plain-aa`): its "
                            "ratio to plain is the noise between two engines of one setting, which every arm carries "
                            "and the noise floor (one engine run twice) does not see; an arm must beat both."),
    each: bool = typer.Option(False, "--each/--product", help="Grid: one lever at a time (spec without levers, then "
                              "each value of each knob alone) instead of every combination."),
    concurrency: str = typer.Option("1,8,16,32,64", "--concurrency", "-c", help="Concurrency levels."),
    dataset: str = typer.Option("gsm8k", "--dataset", help="The sweep's data set: the same names as specbench sweep "
                                "(gsm8k, spec_bench, mt_bench, sharegpt, humaneval, random, custom, shared_prefix)."),
    prompts_per_level: int = typer.Option(4, "--prompts-per-level", min=1),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    max_tokens_spread: float = typer.Option(0.0, "--max-tokens-spread", help="Each request's max_tokens uniform in "
                                            "[M (1 - S), M (1 + S)] (M = --max-tokens), the same per prompt position "
                                            "for every arm; 0 <= S < 1 (0: all M)."),
    rounds: int = typer.Option(2, "--rounds", min=1, help="Interleaved rounds per level."),
    warmup: int = typer.Option(1, "--warmup", min=0),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    out: str = results_dir_option("--out", help="The results store (default $SPECBENCH_RESULTS or ./results)."),
    record: bool = record_option("Keep the sweep in the results store (--no-record: a scratch store, deleted once "
                                 "the analysis is printed and written)."),
    json_out: str = typer.Option(None, "--json", help="Write the analysis as JSON here."),
    report: str = typer.Option(None, "--report", help="Write the markdown here."),
    merge_into: str = typer.Option(None, "--merge-into", help="Add this run as a section of a combined JSON (and its "
                                   ".md beside it), e.g. reports/h200-levers/levers.json."),
    section: str = typer.Option(None, "--section", help="The section's name with --merge-into (default: the arms)."),
    quiet: bool = quiet_option(progress_flag=True, help="No progress display (on stderr: requests done / total, the "
                               "cell, ETA) and no summary table at the end; stdout (the markdown) and the exit code "
                               "are the same."),
) -> None:
    """Find the crossover concurrency and the best speculation setting per concurrency."""
    from specbench.harness.engines import EngineStringError
    from specbench.harness.errors import fail
    from specbench.suites.sweep.runner import SweepConfig
    from specbench.suites.tune import merge, remote_arms, render, run_tune, tune_arms

    from .sweep import _dataset_name, _levels, no_tokens_line

    levels = _levels(concurrency, "--concurrency", rate=False)
    if not (0.0 <= max_tokens_spread < 1.0):
        raise typer.BadParameter(f"{max_tokens_spread} is invalid: expected a number in [0, 1)",
                                 param_hint="--max-tokens-spread")
    dataset = _dataset_name(dataset, "--dataset")
    pols = [p.strip() for p in policy.split(",") if p.strip()]
    bad = [p for p in pols if p not in ("off", "auto")]
    if bad or not pols:
        raise typer.BadParameter(f"{policy!r} is invalid: expected off and/or auto", param_hint="--policy")
    if arms and aa:
        raise typer.BadParameter("--aa builds a second bundled engine: give a grid (--base), or among --arms a "
                                 "second server of the baseline's setting labelled plain-aa", param_hint="--aa")
    if arms and (base or k):
        raise typer.BadParameter("give --arms or a grid (--base, --k), not both", param_hint="--arms")
    try:
        if arms:
            engines, labels = remote_arms(arms)
            base_label = baseline or labels[0]
        else:
            engines, labels = tune_arms(base or "local", [*_ints(k, "--k", 1)] or [None], _ints(trim, "--trim", 0),
                                        _ints(gate, "--gate", 0), pols, each=each, aa=aa)
            base_label = labels[0]
        cfg = SweepConfig(levels=levels, dataset=dataset, prompts_per_level=prompts_per_level, max_tokens=max_tokens,
                          max_tokens_spread=max_tokens_spread, rounds=rounds, warmup=warmup, ignore_eos=ignore_eos)
        from specbench.cli.flags import scratch_store
        from specbench.cli.progress import RunProgress

        with scratch_store(record, out) as store, RunProgress(0, quiet=quiet) as bar:
            res = run_tune(cfg, engines, labels, store or env.get("SPECBENCH_RESULTS") or "results",
                           baseline=base_label, progress=bar)
        if not record:
            res["run_dir"] = None  # the scratch store is gone
    except EngineStringError as e:
        raise typer.BadParameter(str(e), param_hint="--arms" if arms else "--base") from None
    except ValueError as e:
        raise fail("tune", str(e), 2) from None
    except KeyboardInterrupt:
        from specbench.harness.interrupts import how_stopped

        typer.echo(f"specbench tune: {how_stopped()}" + ("; every finished record kept" if record else ""), err=True)
        raise typer.Exit(130) from None  # 143 after SIGTERM (cli/app.py)
    typer.echo(render(res))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if report:
        with open(report, "w") as f:
            f.write("# specbench tune\n\n" + render(res))
    if merge_into:
        j, md = merge(merge_into, section or ", ".join(labels), res)
        typer.echo(f"merged into {j} and {md}")
    from specbench.cli.summary import show, tune_summary

    show(tune_summary(res, report), quiet=quiet)
    if not res.get("complete"):
        raise typer.Exit(130)
    if res.get("no_tokens"):  # a ratio of nothing to nothing recommends nothing (cli/sweep.py, the same rule)
        from specbench.harness.verdicts import EXIT_CANNOT_TEST

        raise fail("tune", no_tokens_line(res["no_tokens"]), EXIT_CANNOT_TEST)
