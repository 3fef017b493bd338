"""`specbench sweep`: throughput and latency across load levels, arms interleaved, with a noise floor.

Thin: parses and validates options (a bad value exits 2 with the option's name), builds a
`SweepConfig`, calls `suites.sweep.run_sweep`, prints where the records are and optionally renders the
report. Ctrl-C keeps every record already written (the run is marked incomplete) and exits 130; SIGTERM
the same, exit 143 (harness/interrupts.py).
Progress (cli/progress.py) goes to stderr: one display over the whole sweep, requests done / total and the
current cell, with the sweep's ETA; at the end a summary table (cli/summary.py: per level and arm tok/s, the
speedup over the baseline, TTFT / TPOT, acceptance), on stderr too. --quiet (-q, or its older name
--no-progress) turns both off; stdout carries the same lines either way. --no-record runs the sweep in a
scratch store deleted at the end (the summary and --report are computed from its records first).
The acceptance / metrics audit (suites/sweep/audit.py) runs over the records of every complete sweep and
is printed (each arm's verdict and its cells by verdict; cells not judged are named on stderr); with --audit it
is a gate: exit 1 when it FAILs, 3 when it CANNOT TEST (an arm with neither spec counters nor per-request draft
counts, or cells whose counters could not be attributed to them), 0 on PASS. Without --audit the sweep is a measurement and
exits 0 (2 bad usage, 130 interrupted).
A sweep in which some measured request failed (after its retries) exits 4 and its run.json status is
"complete_with_failures", unless --allow-failures is given (then 0); an --audit verdict other than PASS
keeps its own code (1 or 3). A measured cell whose answered requests gave no output token at all is no
measurement (0 tok/s of nothing): the records line says NO OUTPUT TOKENS, one line on stderr names the cells
(`no_tokens_line`, tune's too), and the sweep exits 3, CANNOT TEST (before 4; after an --audit FAIL). The vLLM bench flags (`--dataset-name`, `--dataset-path`, `--random-input-len`
/ `--random-output-len`, `--num-prompts`, `--max-concurrency`, `--request-rate`, `--burstiness`,
`--endpoint`, `--save-result`, `--result-dir`) mean what they mean there (docs/sweep.md has the table).
"""

from __future__ import annotations

import math

import typer

from specbench.cli.flags import dataset_name, quiet_option, record_option, results_dir_option, scratch_store
from specbench.harness.datasets import BUNDLED, SYNTHETIC
from specbench.harness.errors import fail, usage_exit
from specbench.harness.verdicts import INCOMPLETE

DATASETS = BUNDLED + SYNTHETIC  # = suites/sweep/workload.py DATASETS, without importing the sweep here

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
EXIT_FAILED_REQUESTS = 4


def no_tokens_line(cells: list[str]) -> str:
    """The one line of a sweep (or tune) whose cells were answered with no output token (session.py `no_tokens`)."""
    shown = ", ".join(cells[:6]) + (f" and {len(cells) - 6} more" if len(cells) > 6 else "")
    return (f"no output tokens in {len(cells)} measured cell(s) ({shown}): every answered request came back empty, "
            "so their throughput (0 tok/s) measures nothing: CANNOT TEST")


def _dataset_name(name: str, option: str) -> str:
    return dataset_name(name, DATASETS, option)


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
    dataset: str = typer.Option(None, "--dataset", help=f"One of {', '.join(DATASETS)} (default gsm8k)."),
    dataset_name: str = typer.Option(None, "--dataset-name", help="vLLM bench's name for --dataset: random, sharegpt, "
                                     "custom, spec-bench, ... (custom and a file need --dataset-path)."),
    dataset_path: str = typer.Option(None, "--dataset-path", help="Your own prompts: JSONL with a \"prompt\" per line "
                                     "(custom), a ShareGPT JSON list (sharegpt), JSONL with \"turns\" (spec-bench)."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Prompts per cell, the same at every level."),
    prompts_per_level: int = typer.Option(None, "--prompts-per-level",
                                          help="K: each cell at level C runs max(8, K x C) prompts (K waves). "
                                               "Default 4."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Output tokens per request (cap; default 128)."),
    random_output_len: int = typer.Option(None, "--random-output-len", help="vLLM bench: output tokens per request "
                                          "(= --max-tokens, and like vLLM's random dataset it sets --ignore-eos)."),
    max_tokens_spread: float = typer.Option(0.0, "--max-tokens-spread", help="Each request's max_tokens uniform in "
                                            "[M (1 - S), M (1 + S)] (M = --max-tokens), one seeded draw per prompt "
                                            "position, the same for every arm and round (vLLM bench's "
                                            "--random-range-ratio); 0 <= S < 1 (0: every request M)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate max_tokens tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature (0 = greedy)."),
    rounds: int = typer.Option(3, "--rounds", help="Interleaved rounds per level (A B A' | A B A' ...)."),
    warmup: int = typer.Option(1, "--warmup", help="Warm-up waves per engine and level: W x C requests "
                               "(excluded from every figure)."),
    request_rate: str = typer.Option(None, "--request-rate",
                                     help="Open loop: request rates (req/s), comma-separated; then "
                                          "--concurrency (one value) is only a cap if given explicitly."),
    max_concurrency: str = typer.Option(None, "--max-concurrency", help="vLLM bench's name for --concurrency: "
                                        "closed-loop levels, or with --request-rate the cap on requests in flight."),
    arrival: str = typer.Option(None, "--arrival", help="Open-loop arrivals: poisson or gamma (default: gamma when "
                                "--burstiness is not 1, as in vLLM bench; else poisson)."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape (1 = Poisson, < 1 burstier)."),
    noise: bool = typer.Option(True, "--noise-floor/--no-noise-floor",
                               help="Run the baseline arm twice, interleaved, for the paired noise floor."),
    seed: int = typer.Option(0, "--seed", help="Prompt order and arrival seed."),
    random_input_len: int = typer.Option(64, "--random-input-len", help="Prompt length in TOKENS for --dataset random "
                                         "(each engine's own tokenizer; words where an engine cannot tokenize)."),
    endpoint_type: str = typer.Option(None, "--endpoint-type", help="completions (default) or chat: send each prompt "
                                      "as a chat message (/v1/chat/completions, the server's chat template)."),
    endpoint: str = typer.Option(None, "--endpoint", help="vLLM bench's --endpoint: /v1/completions or "
                                 "/v1/chat/completions (= --endpoint-type)."),
    api_key: str = typer.Option(None, "--api-key", help="Bearer key for openai arms without api_key= (default: "
                                "$OPENAI_API_KEY). Never written to any record, log or report."),
    allow_failures: bool = typer.Option(False, "--allow-failures", help=f"Exit 0 even when requests failed (else "
                                        f"{EXIT_FAILED_REQUESTS}); they are counted and reported either way."),
    save_result: bool = typer.Option(False, "--save-result", help="vLLM bench's flag: every cell's vLLM-format result "
                                     "JSON is always written to <run>/vllm-bench/; with --result-dir also there."),
    result_dir: str = typer.Option(None, "--result-dir", help="Also write each cell's vLLM-format JSON here, named as "
                                   "vLLM bench names its files."),
    client_procs: str = typer.Option("auto", "--client-procs", help="Client processes per openai arm: N, or auto (the "
                                     "default: one per 64 requests in flight, up to the cores - 1; below 128 in "
                                     "flight, or on 2 cores, the client stays in this process)."),
    out: str = results_dir_option("--out", help="The results store: a run folder is created in it (default "
                                  "$SPECBENCH_RESULTS or ./results; not --result-dir, vLLM bench's folder for copies "
                                  "of the result JSON)."),
    record: bool = record_option("Keep the run in the results store (--no-record: the sweep runs in a scratch store, "
                                 "deleted once its summary and --report are written)."),
    report: str = typer.Option(None, "--report", help="Also render the report to this markdown path."),
    quiet: bool = quiet_option(progress_flag=True, help="No progress display (on stderr: requests done / total, the "
                               "cell, ETA) and no summary table at the end; stdout and the exit code are the same."),
    audit: bool = typer.Option(False, "--audit", help="Make the acceptance / metrics audit a gate: exit 1 on FAIL, "
                               "3 on CANNOT TEST (the audit is always run and reported)."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="The model's tokenizer directory (tokenizer.json), used "
                                  "locally, round-trip checked, for openai arms that cannot tokenize."),
) -> None:
    """Sweep load levels across engine arms (interleaved rounds, paired noise floor); record every request."""
    from specbench.harness.engines import EngineStringError
    from specbench.suites.sweep.runner import SweepConfig
    from specbench.suites.sweep.session import run_sweep, split_arms

    if max_concurrency is not None:
        if concurrency is not None:
            raise typer.BadParameter("give --concurrency or --max-concurrency (its vLLM name), not both",
                                     param_hint="--max-concurrency")
        concurrency = max_concurrency
    if dataset is not None and dataset_name is not None:
        raise typer.BadParameter("give --dataset or --dataset-name (its vLLM name), not both", param_hint="--dataset-name")
    dataset = _dataset_name(dataset_name, "--dataset-name") if dataset_name is not None else \
        _dataset_name(dataset or "gsm8k", "--dataset")
    if random_output_len is not None:
        if max_tokens is not None and max_tokens != random_output_len:
            raise typer.BadParameter(f"--max-tokens {max_tokens} and --random-output-len {random_output_len} disagree",
                                     param_hint="--random-output-len")
        max_tokens, ignore_eos = random_output_len, True
    max_tokens = 128 if max_tokens is None else max_tokens
    if endpoint is not None:
        if endpoint not in ENDPOINTS:
            raise typer.BadParameter(f"{endpoint!r} is invalid: expected one of {', '.join(ENDPOINTS)}",
                                     param_hint="--endpoint")
        if endpoint_type is not None and endpoint_type != ENDPOINTS[endpoint]:
            raise typer.BadParameter(f"--endpoint {endpoint} and --endpoint-type {endpoint_type} disagree",
                                     param_hint="--endpoint")
        endpoint_type = ENDPOINTS[endpoint]
    endpoint_type = endpoint_type or "completions"
    if endpoint_type not in ENDPOINTS.values():
        raise typer.BadParameter(f"{endpoint_type!r} is invalid: expected completions or chat", param_hint="--endpoint-type")
    if client_procs.strip().lower() == "auto":
        nprocs = 0
    else:
        try:
            nprocs = int(client_procs)
        except ValueError:
            nprocs = -1
        if nprocs < 1:
            raise typer.BadParameter(f"{client_procs!r} is invalid: expected an integer >= 1 or auto",
                                     param_hint="--client-procs")
    if arrival is None:
        arrival = "gamma" if burstiness != 1.0 else "poisson"
    elif arrival == "poisson" and burstiness != 1.0:
        raise typer.BadParameter(f"--burstiness {burstiness} needs gamma arrivals (Poisson is burstiness 1)",
                                 param_hint="--burstiness")
    if dataset_path is not None:
        from specbench.suites.sweep.workload import WorkloadError, file_texts

        if dataset == "random":
            raise typer.BadParameter("--dataset-path cannot be used with random: use custom (JSONL with \"prompt\"), "
                                     "sharegpt or spec-bench", param_hint="--dataset-path")
        try:
            file_texts(dataset, dataset_path)
        except WorkloadError as e:
            raise typer.BadParameter(str(e).removeprefix("--dataset-path "), param_hint="--dataset-path") from None
    elif dataset == "custom":
        raise typer.BadParameter("custom needs --dataset-path (JSONL, one {\"prompt\": ...} per line)",
                                 param_hint="--dataset-path")
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
    if num_prompts is not None and prompts_per_level is not None:
        raise typer.BadParameter("give --num-prompts or --prompts-per-level, not both", param_hint="--num-prompts")
    for name, v, lo in (("--num-prompts", num_prompts, 1), ("--prompts-per-level", prompts_per_level, 1),
                        ("--max-tokens", max_tokens, 1), ("--rounds", rounds, 1), ("--warmup", warmup, 0),
                        ("--random-input-len", random_input_len, 1)):
        if v is not None and v < lo:
            raise typer.BadParameter(f"{v} is invalid: expected an integer >= {lo}", param_hint=name)
    if not (0.0 <= max_tokens_spread < 1.0):
        raise typer.BadParameter(f"{max_tokens_spread} is invalid: expected a number in [0, 1)",
                                 param_hint="--max-tokens-spread")
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
                      max_tokens_spread=max_tokens_spread, ignore_eos=ignore_eos, temperature=temperature, rounds=rounds, warmup=warmup, arrival=arrival,
                      burstiness=burstiness, noise_floor=noise, seed=seed, random_input_len=random_input_len,
                      dataset_path=dataset_path, endpoint_type=endpoint_type, client_procs=nprocs)
    from specbench.cli.progress import RunProgress
    from specbench.harness.redact import redact_text

    with scratch_store(record, out) as store:
        try:  # one display over every cell (requests done / total, warm-up included; the ETA of the whole sweep)
            with RunProgress(0, quiet=quiet) as bar:
                outcome = run_sweep(cfg, engines, label_list, out_dir=store, baseline=baseline, progress=bar,
                                    keep_records=True, api_key=api_key, result_dir=result_dir)
        except EngineStringError as e:
            raise typer.BadParameter(redact_text(str(e), [api_key]), param_hint="--arms") from None
        except ValueError as e:
            raise usage_exit("sweep", redact_text(str(e), [api_key])) from None
        if outcome.run_dir is None:
            raise typer.Exit(130)
        code = _finish(outcome, record=record, report=report, quiet=quiet, audit=audit, allow_failures=allow_failures,
                       vllm_copies=save_result or result_dir is not None, result_dir=result_dir)
    if code:
        raise typer.Exit(code)


def _cells(arm: dict) -> str:
    """An audited arm's cells by verdict, e.g. " (cells: 10 PASS, 2 CANNOT TEST)" (suites/sweep/audit.py)."""
    n = {v: c for v, c in (arm.get("cell_verdicts") or {}).items() if c}
    return f" (cells: {', '.join(f'{c} {v}' for v, c in n.items())})" if n else ""


def _finish(outcome, *, record: bool, report: str | None, quiet: bool, audit: bool, allow_failures: bool,
            vllm_copies: bool, result_dir: str | None) -> int:
    """Print what a finished (or interrupted) sweep has to say, the summary table last; its exit code."""
    acc = outcome.accounting
    nfail = int(acc.get("failed") or 0)
    empty = list(acc.get("no_tokens") or [])
    if not outcome.complete:
        from specbench.harness.interrupts import how_stopped

        how = how_stopped()
        status = INCOMPLETE.qualified(f"{how}; every finished record kept" if record else how)
    elif empty:
        status = f"complete, but NO OUTPUT TOKENS in {len(empty)} measured cell(s): CANNOT TEST"
    elif nfail:
        status = f"complete_with_failures: {nfail} of {acc['requests']} requests FAILED"
    else:
        status = "complete"
    typer.echo(f"records: {outcome.run_dir} ({status})" if record else
               f"records: not kept (--no-record; {status})")
    if acc:
        typer.echo(f"requests: {acc['requests']} measured, {nfail} failed, {acc['retried']} retried "
                   f"({acc['extra_attempts']} extra attempts; latency counted from each request's first send)")
    if nfail:
        typer.echo(f"warning: {nfail} requests failed (first: {acc['first_errors'][0]}); they count as failed, "
                   "not in any latency or throughput figure"
                   + ("" if allow_failures else f"; exit {EXIT_FAILED_REQUESTS} (--allow-failures to accept)"),
                   err=True)
    if acc.get("client_saturated"):
        cells = acc["client_saturated"]
        typer.echo(f"warning: the client was saturated (its event loop busy >= 90 % of the time) in {len(cells)} "
                   f"cell(s): {', '.join(cells[:6])}{' ...' if len(cells) > 6 else ''}; their figures may measure "
                   "the client, not the engine (benchmarks/client.py shows what this client absorbs)", err=True)
    if vllm_copies:
        where = [str(outcome.run_dir / "vllm-bench")] if record else []
        typer.echo("vLLM bench results: " + " and ".join(where + ([result_dir] if result_dir else [])))
    s = None
    if report or not quiet:
        from specbench.suites.report import ReportError, load_run_summary

        try:
            s = load_run_summary(outcome.run_dir)  # from the stored records: the report is a function of them
        except ReportError:
            if outcome.complete:
                raise
            s = None  # stopped before its first cell: nothing to summarise, the records line said so
    if report and s is not None:
        from specbench.suites.report import write_report

        paths = write_report([s], report)
        typer.echo(f"report: {paths[0]}")
        if outcome.complete:
            from specbench.suites.report.markdown import throughput_table

            typer.echo("\n".join(throughput_table(s)))
    code = 0
    if not outcome.complete:
        code = 130
    elif outcome.audit is not None:
        from specbench.harness.verdicts import exit_code

        a = outcome.audit
        typer.echo(f"acceptance audit: {a['verdict']}" + (f" [missing: {'; '.join(a['missing'])}]" if a["missing"] else "")
                   + "; " + "; ".join(f"{x['arm']} {x['verdict']}" + _cells(x) for x in a["arms"]))
        for x in a["arms"]:
            for prob in x["problems"][:5]:
                typer.echo(f"  {prob}", err=True)
            for why in x.get("unattributed", [])[:5]:
                typer.echo(f"  not judged: {why}", err=True)
        if audit and exit_code(a["verdict"]) != 0:
            code = exit_code(a["verdict"])
    if not code and empty:
        from specbench.harness.verdicts import EXIT_CANNOT_TEST

        fail("sweep", no_tokens_line(empty), EXIT_CANNOT_TEST, as_json=False)
        code = EXIT_CANNOT_TEST
    if not code and nfail and not allow_failures:
        code = EXIT_FAILED_REQUESTS
    if s is not None and not quiet:
        from specbench.cli.summary import show, sweep_summary

        show(sweep_summary(s, outcome.run_dir if record else None, report), quiet=quiet)
    return code
