"""`specbench lossless`: the greedy losslessness gate (regret rule, re-anchoring) between two engines.

Contract: parses options, builds the two adapters (default: the bundled tiny pair, baseline spec off,
candidate spec on; a local candidate alone gets the same model with speculation off as its baseline),
runs the greedy gate and, unless --quick, the concurrent gate and the engine gates (on by default: their CANNOT
TEST is reported beside the verdict, not deciding it; named with --concurrent / --engine-gates, it decides it),
opens a results run (records under results/<run-id>/: checks.jsonl per prompt, requests.jsonl of the
candidate, gates.jsonl), calls specbench.suites.lossless.suite.run_lossless, prints the per-prompt table
and the summary (one JSON document with --json), writes the markdown report with --report, and ends with a
summary table on stderr (cli/summary.py: a row per gate; none with --quiet or --json).
--endpoint-type chat sends each prompt as the same chat request to both arms (suite.py's contract).
Exit codes: 0 PASS (also "PASS (speculation asserted by the user, not observed)" with --assume-speculating);
1 FAIL or NOT SPECULATING (a pass that proves nothing is not a pass); 2 bad input (an engine string, an
option value, --margin-tol with --strict); 3 CANNOT TEST (the evidence could not be collected: no engine
tokenizes, no output token ids, no baseline logprobs at a divergence, no token at all, no evidence that the
candidate speculated; what was missing is named).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer

from specbench.cli.flags import quiet_option, record_option, results_dir_option
from specbench.harness.errors import usage_errors
from specbench.harness.verdicts import PASS


def lossless(
    margin_tol: float | None = typer.Option(None, "--margin-tol", min=0.0, help="Benign-flip margin in nats: regret <= this is a tie flip. Default 0.2 for bf16 / fp16 runs; where both engines run float32 and none is typed, strict mode applies instead. A typed margin is honoured as typed (fp32 too; the verdict line and the reports say so)."),
    assume_speculating: bool = typer.Option(False, "--assume-speculating", help="The candidate speculates, though nothing it reports shows it (no spec counters, no per-request draft counts, no streamed chunk of several tokens): a verdict that would be CANNOT TEST for want of that evidence becomes 'PASS (speculation asserted by the user, not observed)'. Evidence, where there is some, still decides (zero drafts: NOT SPECULATING)."),
    strict: bool | None = typer.Option(None, "--strict/--no-strict", help="Strict mode: every divergence must cost <= --strict-tol (fp32 noise), not --margin-tol (not with a typed --margin-tol). Default: on when both engines run float32 (an openai engine declares it with dtype=float32) and no --margin-tol is typed."),
    strict_tol: float | None = typer.Option(None, "--strict-tol", min=0.0, help="Strict mode's tolerance in nats (default 4e-4: 10x the fp32 noise measured between correct paths, docs/lossless.md)."),
    baseline: str | None = typer.Option(None, "--baseline", help="Engine string of the reference (speculation off). Default: the bundled pair, spec off."),
    candidate: str | None = typer.Option(None, "--candidate", help="Engine string under test (speculation on). Default: the bundled pair, spec on."),
    dataset: str = typer.Option("gsm8k", "--dataset", help="gsm8k | spec_bench | mt_bench | sharegpt | humaneval (spec-bench, mt-bench accepted)"),
    num_prompts: int = typer.Option(8, "--num-prompts", min=1, help="Prompts from the data set (file order)."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Greedy tokens per prompt."),
    max_divergences: int = typer.Option(8, "--max-divergences", min=1, help="Benign flips (re-anchors) judged per prompt before stopping."),
    rescore: bool = typer.Option(True, "--rescore/--no-rescore", help="Re-score each divergence with the candidate's own prefill path."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Candidate requests in flight in the greedy gate."),
    concurrent: bool | None = typer.Option(None, "--concurrent/--no-concurrent", help="The concurrent heterogeneous gate (staggered max_tokens, one batch). Default: on (off with --quick)."),
    engine_gates: bool | None = typer.Option(None, "--engine-gates/--no-engine-gates", help="The engine gates (short-then-long, mixed batch, stop-in-run, eos-in-run, abort-in-flight, penalties, logit-bias, min-tokens, long-context, headroom, levers, prefix-cache, accept-trace, near-ties). Default: on (off with --quick, and with --endpoint-type chat)."),
    quick: bool = typer.Option(False, "--quick", help="The greedy gate alone (at --concurrency): the concurrent and engine gates stay off unless named. Bugs that only batching, stops or sampling parameters reach go unseen."),
    expect_accept_len: float | None = typer.Option(None, "--expect-accept-len", min=1.0, help="Fail if the mean accepted length moves >10% (of its excess over 1) away from this, either way (a rise without cause fails as a drop does). Default: the reference recorded for this engine / drafter / prompts / max_tokens."),
    accept_reference: bool = typer.Option(True, "--accept-reference/--no-accept-reference", help="Hold acceptance against the reference recorded in the results store for the same fingerprint, and record one from a PASS when none exists."),
    record_reference: bool = typer.Option(False, "--record-reference", help="Replace the recorded acceptance reference with this run's (when it PASSes): after a real drafter change."),
    min_accept_len: float = typer.Option(1.05, "--min-accept-len", min=1.0, help="At or below this mean accepted length the verdict is NOT SPECULATING."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document instead of the tables."),
    report: Path | None = typer.Option(None, "--report", help="Write the markdown report here."),
    results: Path | None = results_dir_option("--results"),
    record: bool = record_option(),
    quiet: bool = quiet_option(),
    check_draft: bool = typer.Option(True, "--check-draft/--no-check-draft", help="Run the checkpoint checks of specbench check-draft on a local candidate's drafter first (a FAIL there fails the run)."),
    replay_drafter: str | None = typer.Option(None, "--replay-drafter", help="For the accept-trace gate against an endpoint: the checkpoints its drafter was built from, \"target=DIR,draft=DIR[,k=N][,exact=true]\" (DFlash, DFlash2; k: drafts per step, default block size - 1; exact: the endpoint runs fp32) or \"ngram=MIN-MAX,k=N\". A local engine names its own."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="The model's tokenizer directory (tokenizer.json), used locally, round-trip checked, for an openai endpoint that cannot tokenize."),
    rate_test: bool = typer.Option(False, "--rate-test", help="Also run the divergence-rate gate: spec-on divergences per compared token vs the baseline's own spec-off batch noise on the same prompts (one-sided exact test)."),
    batch_invariance: bool = typer.Option(False, "--batch-invariance", help="Also run the batch-invariance gates: both arms at every --batch-levels level vs their own c1 run (regret rule), and the spec-on vs spec-off batch-rate test."),
    batch_levels: str = typer.Option("1,8,32", "--batch-levels", help="Concurrency levels of the batch gates (c1 is the reference)."),
    batch_prompts: int | None = typer.Option(None, "--batch-prompts", min=1, help="Prompts (mixed lengths) of the batch-invariance gates. Default: the largest level."),
    rate_alpha: float = typer.Option(0.01, "--rate-alpha", help="Significance level of the divergence-rate tests."),
    rate_detect: float = typer.Option(5.0, "--rate-detect", help="Power rule: the rate (per 1,000 tokens, at least 2x the noise) the rate test must be able to see; below it CANNOT TEST."),
    suite: str = typer.Option("greedy", "--suite", help="greedy: spec on vs spec off (this page). prefix: the warm-vs-cold prefix-cache gate on the candidate alone (docs/prefix-cache.md): repeats, a shared system prompt, two-turn conversations ending at block boundary -1/0/+1, one-block-short matches; --num-prompts conversations. noise: the reduction-order noise between --noise-baseline and --baseline (both spec off) measured first, then spec on vs spec off judged against it: divergence rate and regret distribution, exact tests with stated power (docs/noise.md); with no engine given, the bundled pair at emulated TP 2 against TP 1."),
    block_sizes: str | None = typer.Option(None, "--block-sizes", help="--suite prefix: the block sizes to place the boundary cases at, comma-separated (default: the local engine's page size; for an endpoint 16, vLLM's default; SGLang matches per token)."),
    prefix_selftest: bool = typer.Option(False, "--selftest", help="--suite prefix: the gate's self-test instead: --repeat clean engines must PASS without fallbacks, register_before_forward must FAIL, no_publish_on_finish must show fallbacks (a local candidate)."),
    repeat: int = typer.Option(5, "--repeat", min=1, help="--suite prefix --selftest: clean runs."),
    noise_baseline: str | None = typer.Option(None, "--noise-baseline", help="--suite noise: the engine string of the other speculation-off configuration the baseline should agree with up to reduction order (TP 1 where the baseline runs TP 2, another attention backend; a local one runs with speculation off). Default: a local baseline's TP-1 twin where it has tp_emulate=N (docs/noise.md)."),
    noise_concurrency: int | None = typer.Option(None, "--noise-concurrency", min=1, help="--suite noise: requests in flight of the baseline in the noise phase (the reference runs one at a time); another value than --concurrency measures batch noise. Default: --concurrency."),
    noise_max_regret: float = typer.Option(1.0, "--noise-max-regret", min=0.0, help="--suite noise: the largest regret (nat) a noise-phase flip may cost and still count as reduction-order noise; above it the two configurations differ by more than a near-tie and the noise phase FAILs."),
    endpoint_type: str = typer.Option("completions", "--endpoint-type", help="completions (default) or chat: send each prompt to both arms as the same chat request (one user message, /v1/chat/completions, the server's chat template) and judge the token ids the endpoints report; where they report too little (no prompt_token_ids for re-anchoring / re-scoring, no logprobs) CANNOT TEST names it. The greedy and concurrent gates only."),
) -> None:
    """Is speculation lossless? Greedy spec-on vs spec-off, every divergence judged by its regret.

    At each divergence the candidate's pick is scored under the baseline's top-20 distribution: regret = logp(top1) - logp(pick). Regret <= the tolerance (--margin-tol; strict fp32 exactness where both engines run float32 and no margin is typed) is a benign tie flip and the gate re-anchors (a fresh baseline from prompt + candidate tokens) to judge every later divergence too; larger, or a pick outside the top-20, is a FAIL. Speculation that never happened is reported as NOT SPECULATING, not PASS; no evidence either way (no counters, no per-request draft counts, no streamed chunk of several tokens) is CANNOT TEST unless --assume-speculating. By default the concurrent gate and the engine gates (batching, stops inside accepted runs, aborts, penalties, logit bias, min_tokens, long contexts, headroom) run too; --quick runs the greedy gate alone. Exit 1 on FAIL or NOT SPECULATING, 2 on bad input, 3 on CANNOT TEST (a capability the gate needs is missing; it is named).
    """
    from specbench.harness.engines import (
        EngineStringError,
        baseline_and_candidate,
        build_adapter,
        fast_paths_on_cpu,
        gate_specs,
        share_gpu,
    )
    from specbench.harness.results import open_run
    from specbench.suites.lossless.batch import parse_levels
    from specbench.suites.lossless.prompts import DATASETS
    from specbench.suites.lossless.registry import GATES
    from specbench.suites.lossless.regret import STRICT_FP32_TOL
    from specbench.suites.lossless.report import render_console, render_markdown
    from specbench.suites.lossless.suite import SUITE_VERSION, LosslessConfig, LosslessError, run_lossless

    bad = usage_errors("lossless")
    d = dataset.strip().lower().replace("-", "_")  # the spellings every --dataset accepts (cli/flags.py)
    if d not in DATASETS:
        raise bad(f"--dataset {dataset!r} is invalid: expected one of {', '.join(DATASETS)} (spec-bench and other "
                  "spellings with '-' are accepted)")
    dataset = d
    if suite not in ("greedy", "prefix", "noise"):
        raise bad(f"--suite {suite!r} is invalid: expected greedy, prefix or noise")
    if endpoint_type not in ("completions", "chat"):
        raise bad(f"--endpoint-type {endpoint_type!r} is invalid: expected completions or chat")
    if suite != "noise" and (noise_baseline is not None or noise_concurrency is not None):
        raise bad("--noise-baseline and --noise-concurrency are options of --suite noise")
    if suite == "noise":
        if endpoint_type == "chat":
            raise bad("--suite noise is not available with --endpoint-type chat: its phases send token-id prompts")
        from specbench.suites.lossless.noise import NoiseConfig

        try:
            ncfg = NoiseConfig(dataset=dataset, num_prompts=num_prompts, max_tokens=max_tokens,
                               max_divergences=max_divergences, rescore=rescore, concurrency=concurrency,
                               noise_concurrency=noise_concurrency, margin_tol=margin_tol, strict=strict,
                               strict_tol=STRICT_FP32_TOL if strict_tol is None else strict_tol, alpha=rate_alpha,
                               detect_per_1k=rate_detect, max_noise_regret=noise_max_regret,
                               min_accept_len=min_accept_len,
                               assume_speculating=assume_speculating)
        except ValueError as e:
            raise bad(str(e)) from None
        _noise(noise_baseline, baseline, candidate, tokenizer, ncfg, json_out, report, quiet, bad,
               results if record else False)
        return
    if suite == "prefix":
        if endpoint_type == "chat":
            raise bad("--suite prefix is not available with --endpoint-type chat: its conversations are token-id "
                      "prompts placed at block boundaries")
        _prefix(candidate, tokenizer, dataset, num_prompts, max_tokens, block_sizes, prefix_selftest, repeat,
                json_out, report, bad, results if record else False)
        return

    # On by default (not --quick): the concurrent gate, and the engine gates where the requests are token ids. Asked
    # for by name, a gate's CANNOT TEST decides the verdict; on by default, it is reported beside it (advisory).
    advisory: list[str] = []
    if concurrent is None:
        concurrent = not quick
        advisory += ["concurrent"] if concurrent else []
    if engine_gates is None:
        engine_gates = not quick and endpoint_type == "completions"
        advisory += list(GATES) if engine_gates else []
    try:
        cfg = LosslessConfig(margin_tol=margin_tol, dataset=dataset, num_prompts=num_prompts, max_tokens=max_tokens,
                             max_divergences=max_divergences, rescore=rescore, concurrency=concurrency,
                             concurrent=concurrent, engine_gates=engine_gates, min_accept_len=min_accept_len,
                             expect_accept_len=expect_accept_len, rate_test=rate_test,
                             batch_invariance=batch_invariance, batch_levels=parse_levels(batch_levels),
                             batch_prompts=batch_prompts, rate_alpha=rate_alpha, rate_detect=rate_detect,
                             strict=strict, strict_tol=STRICT_FP32_TOL if strict_tol is None else strict_tol,
                             accept_reference=accept_reference, endpoint_type=endpoint_type,
                             record_reference=record_reference, results=str(results) if results else None,
                             advisory=tuple(advisory), assume_speculating=assume_speculating,
                             replay=replay_drafter or "")
        from specbench.harness.adapters.dialect import with_tokenizer

        bspec, cspec = share_gpu(gate_specs(with_tokenizer(list(baseline_and_candidate(baseline, candidate)), tokenizer)))
        cspec = fast_paths_on_cpu(cspec)
        base = build_adapter(bspec, name="baseline")
        cand = build_adapter(cspec, name="candidate")
    except (EngineStringError, LosslessError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None
    log = (lambda s: typer.echo(s, err=True)) if json_out else typer.echo
    from specbench.cli.check_draft import local_draft_verdict

    # A local drafter's checkpoint checks first (a DFlash2 checkpoint drafted as DFlash1, causal layers):
    # lossless either way, so no gate below could see it.
    draft_verdict = local_draft_verdict(cspec, log) if check_draft else None

    from specbench.cli.progress import RunProgress

    async def main(run):
        try:  # prompts compared, on stderr (a bar on a terminal, a line per gate elsewhere; none with --json)
            with RunProgress(0, quiet=quiet or json_out, unit="prompts") as progress:
                return await run_lossless(base, cand, cfg, run=run, log=log, progress=progress)
        finally:
            await base.aclose()
            await cand.aclose()

    run_dir = None
    try:
        if not record:
            out = asyncio.run(main(None))
        else:
            engines = {"baseline": base.describe(), "candidate": cand.describe()}
            with open_run("lossless", SUITE_VERSION, engines=engines, results=results,
                          sampling={"temperature": 0.0, "max_tokens": max_tokens, "logprobs": cfg.top_k},
                          dataset={"name": dataset, "num_prompts": num_prompts}, config=cfg.__dict__) as run:
                out = asyncio.run(main(run))
            run_dir = run.path
    except LosslessError as e:
        raise bad(str(e)) from None
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(render_markdown(out), encoding="utf-8")
    if json_out:
        typer.echo(json.dumps(out.to_dict(), default=str))
    else:
        typer.echo(render_console(out))
        if report is not None:
            typer.echo(f"report: {report}")
    from specbench.cli.summary import lossless_summary, show

    show(lossless_summary(out, run_dir, report), quiet=quiet or json_out)
    if not out.ok:
        raise typer.Exit(out.exit_code)
    if draft_verdict is not None and draft_verdict != PASS:
        typer.echo(f"check-draft: {draft_verdict} (see above): the drafter checkpoint is run wrong", err=True)
        raise typer.Exit(1)


def _prefix(candidate, tokenizer, dataset, num_prompts, max_tokens, block_sizes, selftest, repeat, json_out,
            report, bad, results: Path | None | bool = None) -> None:
    """`--suite prefix`: the warm-vs-cold gate (or its self-test) on the candidate alone. Records (unless
    --no-record): results/<run-id>/ with one `cases` record per case as it is judged (the gate) and the outcome
    in run.json's summary."""
    from dataclasses import asdict

    from specbench.harness.engines import (
        EngineStringError,
        baseline_and_candidate,
        build_adapter,
        gate_specs,
        parse_engine,
    )
    from specbench.harness.results import open_run
    from specbench.harness.verdicts import exit_code
    from specbench.suites.lossless.prefix import (
        PrefixGateOptions,
        render_markdown,
        render_selftest,
        run_prefix_gate,
        run_prefix_selftest,
    )
    from specbench.suites.lossless.prompts import load_prompts

    try:
        sizes = tuple(int(x) for x in block_sizes.split(",") if x.strip()) if block_sizes else None
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"--block-sizes {block_sizes!r} is invalid: expected positive integers, comma-separated")
        from specbench.harness.adapters.dialect import with_tokenizer

        # the candidate alone: a remote one needs no spec-off twin here (nothing is compared with a baseline)
        given = parse_engine(candidate) if candidate is not None else baseline_and_candidate(None, None)[1]
        (cspec,) = gate_specs(with_tokenizer([given], tokenizer))
        cand = build_adapter(cspec, name="candidate")
        texts = load_prompts(dataset, num_prompts)
    except (EngineStringError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None
    opts = PrefixGateOptions(block_sizes=sizes, max_tokens=min(max_tokens, 32))
    log = (lambda s: typer.echo(s, err=True)) if json_out else typer.echo

    async def main(run):
        try:
            convs = [(pid, ids) for pid, text in texts if (ids := await cand.tokenize(text))]
            if selftest:
                return await run_prefix_selftest(cand, convs, opts, repeat=repeat, log=log)
            return await run_prefix_gate(cand, convs, opts, log=log,
                                         on_case=(lambda c: run.write("cases", c.to_dict())) if run else None)
        finally:
            await cand.aclose()

    if results is False:
        out = asyncio.run(main(None))
    else:
        suite = "lossless-prefix-selftest" if selftest else "lossless-prefix"
        with open_run(suite, "1", engines={"candidate": cand.describe()}, results=results if isinstance(results, Path) else None,
                      sampling={"temperature": 0.0, "max_tokens": opts.max_tokens, "logprobs": opts.top_k},
                      dataset={"name": dataset, "num_prompts": num_prompts},
                      config={k: v for k, v in asdict(opts).items() if k != "greedy"}) as run:
            out = asyncio.run(main(run))
            if selftest:
                summary = {"ok": out.ok, "problems": out.problems(), "clean": [o.verdict for o in out.clean],
                           "faults": {k: {"verdict": o.verdict, "failed": len(o.failed), "fallbacks": len(o.fallbacks)}
                                      for k, o in out.faults.items()}}
            else:
                summary = {k: v for k, v in out.to_dict().items() if k != "cases"}
            run.update(summary=summary)
    text = render_selftest(out) if selftest else render_markdown(out)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text, encoding="utf-8")
    typer.echo(json.dumps(out.to_dict(), default=str) if json_out else text)
    code = (0 if out.ok else 1) if selftest else exit_code(out.verdict)
    if code:
        raise typer.Exit(code)


def _noise(noise_baseline, baseline, candidate, tokenizer, cfg, json_out, report, quiet, bad,
           results: Path | None | bool = None) -> None:
    """`--suite noise`: the noise phase (reference vs baseline, both spec off), then spec on vs spec off judged
    against it (suites/lossless/noise.py). Records (unless --no-record): results/<run-id>/ with `noise` and `checks`
    records per prompt, `gates` per phase, the outcome in run.json's summary (`specbench report RUN` renders it)."""
    from dataclasses import asdict

    from specbench.harness.adapters.dialect import with_tokenizer
    from specbench.harness.engines import (
        EngineStringError,
        build_adapter,
        fast_paths_on_cpu,
        gate_specs,
        noise_arms,
        share_gpu,
    )
    from specbench.harness.results import open_run
    from specbench.suites.lossless.noise import (
        SUITE,
        SUITE_VERSION,
        render_console,
        render_markdown,
        run_noise,
    )
    from specbench.suites.lossless.suite import LosslessError

    adapters = []
    try:
        specs = share_gpu(gate_specs(with_tokenizer(list(noise_arms(noise_baseline, baseline, candidate)), tokenizer)))
        specs[2] = fast_paths_on_cpu(specs[2])
        for spec, name in zip(specs, ("reference", "baseline", "candidate"), strict=True):
            adapters.append(build_adapter(spec, name=name))
    except (EngineStringError, LosslessError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None
    ref, base, cand = adapters
    log = (lambda s: typer.echo(s, err=True)) if (json_out or quiet) else typer.echo

    async def main(run):
        try:
            return await run_noise(ref, base, cand, cfg, run=run, log=log)
        finally:
            for a in adapters:
                await a.aclose()

    try:
        if results is False:
            out = asyncio.run(main(None))
        else:
            engines = {"reference": ref.describe(), "baseline": base.describe(), "candidate": cand.describe()}
            with open_run(SUITE, SUITE_VERSION, engines=engines, results=results if isinstance(results, Path) else None,
                          sampling={"temperature": 0.0, "max_tokens": cfg.max_tokens, "logprobs": cfg.top_k},
                          dataset={"name": cfg.dataset, "num_prompts": cfg.num_prompts}, config=asdict(cfg)) as run:
                out = asyncio.run(main(run))
    except LosslessError as e:
        raise bad(str(e)) from None
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(render_markdown(out), encoding="utf-8")
    typer.echo(json.dumps(out.to_dict(), default=str) if json_out else render_console(out))
    if report is not None and not json_out:
        typer.echo(f"report: {report}")
    if out.exit_code:
        raise typer.Exit(out.exit_code)
