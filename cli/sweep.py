"""`specbench sweep`: throughput and latency across load levels, arms interleaved, with a noise floor.

Thin: parses and validates options (a bad value exits 2 with the option's name), builds a
`SweepConfig`, calls `suites.sweep.run_sweep`, prints where the records are and optionally renders the
report. Ctrl-C keeps every record already written (the run is marked incomplete) and exits 130.
The acceptance / metrics audit (suites/sweep/audit.py) runs over the records of every complete sweep and
is printed; with --audit it is a gate: exit 1 when it FAILs, 3 when it CANNOT TEST (an arm with neither
spec counters nor per-request draft counts), 0 on PASS. Without --audit the sweep is a measurement and
exits 0 (2 bad usage, 130 interrupted).
"""

from __future__ import annotations

import math

import typer

DATASETS = ("gsm8k", "spec_bench", "mt_bench", "sharegpt", "random")


def _levels(text: str, option: str, rate: bool) -> tuple[float, ...]:
    out: list[float] = []
    for piece in text.split(","):
        p = piece.strip()
        try:
            v = float(p) if rate else int(p)
        except ValueError:
            v = None
        if v is None or math.isnan(v) or not v > 0 or (not rate and math.isinf(v)):
            want = "comma-separated request rates > 0 (req/s; inf = all at once)" if rate else \
                "comma-separated integers >= 1"
            raise typer.BadParameter(f"{p!r} in {text!r} is invalid: expected {want}", param_hint=option)
        out.append(v)
    if len(set(out)) != len(out):
        raise typer.BadParameter(f"{text!r} repeats a level", param_hint=option)
    return tuple(out)


def sweep(
    concurrency: str = typer.Option(None, "--concurrency", "-c",
                                    help="Closed-loop levels: requests in flight, comma-separated "
                                         "(default 1,8,16,32,64)."),
    arms: str = typer.Option(None, "--arms", help="Engine strings, comma-separated (see docs/sweep.md); "
                             "default: the bundled pair with spec off and spec on."),
    labels: str = typer.Option(None, "--labels", help="Arm labels, comma-separated, one per arm."),
    baseline: str = typer.Option(None, "--baseline", help="Label of the baseline arm (default: the first)."),
    dataset: str = typer.Option("gsm8k", "--dataset", help=f"One of {', '.join(DATASETS)}."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Prompts per cell, the same at every level."),
    prompts_per_level: int = typer.Option(None, "--prompts-per-level",
                                          help="K: each cell at level C runs max(8, K x C) prompts (K waves). "
                                               "Default 4."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Output tokens per request (cap)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate max_tokens tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature (0 = greedy)."),
    rounds: int = typer.Option(3, "--rounds", help="Interleaved rounds per level (A B A' | A B A' ...)."),
    warmup: int = typer.Option(1, "--warmup", help="Warm-up waves per engine and level: W x C requests "
                               "(excluded from every figure)."),
    request_rate: str = typer.Option(None, "--request-rate",
                                     help="Open loop: request rates (req/s), comma-separated; then "
                                          "--concurrency (one value) is only a cap if given explicitly."),
    arrival: str = typer.Option("poisson", "--arrival", help="Open-loop arrivals: poisson or gamma."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape (1 = Poisson, < 1 burstier)."),
    noise: bool = typer.Option(True, "--noise-floor/--no-noise-floor",
                               help="Run the baseline arm twice, interleaved, for the paired noise floor."),
    seed: int = typer.Option(0, "--seed", help="Prompt order and arrival seed."),
    random_words: int = typer.Option(64, "--random-input-len", help="Words per prompt for --dataset random."),
    out: str = typer.Option(None, "--out", help="Results directory (a run folder is created in it); default "
                            "$SPECBENCH_RESULTS or ./results."),
    report: str = typer.Option(None, "--report", help="Also render the report to this markdown path."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A progress bar per level."),
    audit: bool = typer.Option(False, "--audit", help="Make the acceptance / metrics audit a gate: exit 1 on FAIL, "
                               "3 on CANNOT TEST (the audit is always run and reported)."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="The model's tokenizer directory (tokenizer.json), used "
                                  "locally, round-trip checked, for openai arms that cannot tokenize."),
) -> None:
    """Sweep load levels across engine arms (interleaved rounds, paired noise floor); record every request."""
    from specbench.harness.engines import EngineStringError
    from specbench.suites.sweep.runner import SweepConfig
    from specbench.suites.sweep.session import run_sweep, split_arms

    open_loop = request_rate is not None
    if open_loop:
        levels = _levels(request_rate, "--request-rate", rate=True)
        caps = _levels(concurrency, "--concurrency", rate=False) if concurrency else (None,)
        if len(caps) != 1:
            raise typer.BadParameter("with --request-rate give one value (a cap on requests in flight)",
                                     param_hint="--concurrency")
        cap = int(caps[0]) if caps[0] else None
    else:
        levels, cap = _levels(concurrency or "1,8,16,32,64", "--concurrency", rate=False), None
    if dataset not in DATASETS:
        raise typer.BadParameter(f"{dataset!r} is invalid: expected one of {', '.join(DATASETS)}", param_hint="--dataset")
    if num_prompts is not None and prompts_per_level is not None:
        raise typer.BadParameter("give --num-prompts or --prompts-per-level, not both", param_hint="--num-prompts")
    for name, v, lo in (("--num-prompts", num_prompts, 1), ("--prompts-per-level", prompts_per_level, 1),
                        ("--max-tokens", max_tokens, 1), ("--rounds", rounds, 1), ("--warmup", warmup, 0),
                        ("--random-input-len", random_words, 1)):
        if v is not None and v < lo:
            raise typer.BadParameter(f"{v} is invalid: expected an integer >= {lo}", param_hint=name)
    if arrival not in ("poisson", "gamma"):
        raise typer.BadParameter(f"{arrival!r} is invalid: expected poisson or gamma", param_hint="--arrival")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise typer.BadParameter(f"{burstiness} is invalid: expected a number > 0", param_hint="--burstiness")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise typer.BadParameter(f"{temperature} is invalid: expected a number >= 0", param_hint="--temperature")
    engines = split_arms(arms) if arms else None
    if tokenizer is not None:
        from specbench.harness.adapters.dialect import LocalTokenizer, TokenizerError

        try:
            LocalTokenizer(tokenizer)
        except TokenizerError as e:
            raise typer.BadParameter(str(e), param_hint="--tokenizer") from None
        engines = [e + f",tokenizer={tokenizer}" if e.startswith("openai:") and ",tokenizer=" not in e else e
                   for e in engines or []] or None
    label_list = [x.strip() for x in labels.split(",")] if labels else None
    cfg = SweepConfig(levels=levels, mode="open" if open_loop else "closed", max_concurrency=cap, dataset=dataset,
                      num_prompts=num_prompts, prompts_per_level=prompts_per_level or 4, max_tokens=max_tokens,
                      ignore_eos=ignore_eos, temperature=temperature, rounds=rounds, warmup=warmup, arrival=arrival,
                      burstiness=burstiness, noise_floor=noise, seed=seed, random_words=random_words)
    try:
        outcome = run_sweep(cfg, engines, label_list, out_dir=out, baseline=baseline, progress=progress,
                            keep_records=True)
    except EngineStringError as e:
        raise typer.BadParameter(str(e), param_hint="--arms") from None
    except ValueError as e:
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(2) from None
    if outcome.run_dir is None:
        raise typer.Exit(130)
    status = "complete" if outcome.complete else "INCOMPLETE (interrupted; every finished record kept)"
    typer.echo(f"records: {outcome.run_dir} ({status})")
    failed = [r for r in outcome.records if r.get("kind") == "request" and not r.get("ok")]
    if failed:
        typer.echo(f"warning: {len(failed)} requests failed (first: {failed[0].get('error')}); they count as "
                   "failed, not in any latency or throughput figure", err=True)
    if report:
        from specbench.suites.report import load_run_summary, write_report

        s = load_run_summary(outcome.run_dir)  # from the stored records: the report is a function of them
        paths = write_report([s], report)
        typer.echo(f"report: {paths[0]}")
        if outcome.complete:
            from specbench.suites.report.markdown import throughput_table

            typer.echo("\n".join(throughput_table(s)))
    if not outcome.complete:
        raise typer.Exit(130)
    if outcome.audit is not None:
        from specbench.harness.verdicts import exit_code

        a = outcome.audit
        typer.echo(f"acceptance audit: {a['verdict']}" + (f" [missing: {'; '.join(a['missing'])}]" if a["missing"] else "")
                   + "; " + "; ".join(f"{x['arm']} {x['verdict']}" for x in a["arms"]))
        for x in a["arms"]:
            for prob in x["problems"][:5]:
                typer.echo(f"  {prob}", err=True)
        if audit:
            raise typer.Exit(exit_code(a["verdict"]))
