"""`specbench sampled`: the sampled (T > 0) equivalence gate, spec off vs spec on, for any engine.

Contract: builds the baseline and candidate adapters from engine strings (default: the bundled target
spec off, against the default configuration set's candidates on it, suites/sampled/config.py
DEFAULT_CANDIDATES: the soft-q n-gram and the bundled DFlash and DFlash2 drafters; a local candidate alone gets its
spec-off twin as the baseline), runs suites/sampled (gate.py) and prints the verdict and the per-configuration
table (bonus rows, rejections, verdict), or with --selftest runs the gate --repeat times against the clean
local candidates and, through their "faults" capability, once per sampling fault armed on fresh engines
(selftest.py). Records go to the results store (run.json, cells.jsonl, samples.jsonl) unless
--no-record; --endpoint-type chat sends every prompt as one user message (gate.py's chat contract); --report writes markdown; --json prints the summary as one JSON document on the last line.
Exit codes: 0 PASS (also "PASS (speculation asserted by the user, not observed)" with --assume-speculating),
1 FAIL / NOT SPECULATING / NO DRAFT ACCEPTED / INCOMPLETE / a self-test case that did not behave, 2 bad input
(engine string, option value), 3 CANNOT TEST (no readable samples, no testable cell, no evidence that the
candidate speculated: the missing evidence is named, never a pass).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from specbench.harness.errors import usage_errors
from specbench.harness.verdicts import FAIL, PASS, is_pass
from specbench.suites.sampled.config import FIT_MARGIN

if TYPE_CHECKING:
    from specbench.harness.results import Run


def sampled(
    baseline: str | None = typer.Option(None, "--baseline", help="Engine string, speculation off. "
                                        "Default: the local candidate's spec-off twin (the bundled tiny pair, "
                                        "spec off, without --candidate)."),
    candidate: str | None = typer.Option(None, "--candidate", help="Engine string, speculation on. "
                                         "Default: three candidates on the bundled target, the n-gram proposer with a "
                                         "soft q (spec=ngram,mix=0.05), the bundled DFlash drafter and the bundled "
                                         "DFlash2 drafter (its candidate selector), each its own BH family at q / 3."),
    num_prompts: int | None = typer.Option(None, "--num-prompts", min=1, help="Prompts of each prompt set "
                                           "(default 2; --selftest: 1)."),
    configs: str | None = typer.Option(None, "--configs", help="Sampling configs 't=1.0;t=0.7,p=0.9;t=1,k=20' "
                                       "(keys t, p, k). Default: t=0.6,p=0.95; t=0.7; t=1.3,k=3."),
    positions: int | None = typer.Option(None, "--positions", min=1, help="Output positions P tested "
                                         "(max_tokens = P) (default 8; --selftest: 4)."),
    samples: int | None = typer.Option(None, "--samples", min=2, help="Samples per arm per (prompt, config) "
                                       "(default 256)."),
    permutations: int = typer.Option(1999, "--permutations", min=19, help="Permutations per cell."),
    q: float = typer.Option(0.05, "--q", min=0.0, max=1.0, help="Benjamini-Hochberg false discovery rate of a run "
                            "(--selftest: the family-wise level over the --repeat clean runs; each run at q / repeat)."),
    null: bool = typer.Option(False, "--null", help="Also run spec vs spec on disjoint seeds: must reject nothing."),
    selftest: bool = typer.Option(False, "--selftest", help="Inject each sampling fault into the local candidates: "
                                  "every fault must be caught, the clean engine must pass --repeat runs."),
    repeat: int | None = typer.Option(None, "--repeat", min=1, help="--selftest: clean runs, each on fresh engines "
                                      "and its own seeds (default 5)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Base seed (sample seeds and permutations)."),
    concurrency: int = typer.Option(128, "--concurrency", min=1, help="Requests in flight per arm."),
    refine: bool = typer.Option(True, "--refine/--no-refine", help="Extra permutations for cells near the p floor."),
    seed_repeat: int = typer.Option(128, "--seed-repeat", min=0, help="Seeded samples of each arm sent again in one "
                                    "batch, configs mixed, beside half as many requests of other parameters (each "
                                    "run alone first): the candidate must reproduce as often as the baseline does "
                                    "(one-sided Fisher exact, alpha 1e-3); 0 = off."),
    assume_speculating: bool = typer.Option(False, "--assume-speculating", help="The candidate speculates, though "
                                            "nothing it reports shows it (no spec counters, no per-request draft "
                                            "counts, no streamed chunk of several tokens): a verdict that would be "
                                            "CANNOT TEST for want of that evidence becomes 'PASS (speculation "
                                            "asserted by the user, not observed)'. Evidence, where there is some, "
                                            "still decides (zero drafts: NOT SPECULATING)."),
    seed_repeat_gate: bool = typer.Option(False, "--seed-repeat-gate", help="A seed-repeat FAIL fails the gate (else "
                                          "advisory: an engine whose speculation adapts to load draws differently in "
                                          "another batch by design). --selftest always enforces it."),
    prompt_chars: int | None = typer.Option(None, "--prompt-chars", min=16, help="Keep the last N characters "
                                            "of a question (default 400; --selftest: 200)."),
    prompt_set: str | None = typer.Option(None, "--prompt-set", help="Prompt sets, comma-separated: gsm8k; echo "
                                          "(question + the baseline's greedy answer + the question again); repeat "
                                          "(question + a run of one repeated digit). Default: echo,repeat."),
    fit: bool = typer.Option(True, "--fit/--no-fit", help="The one-sample fit test: the baseline scores every sample "
                             "(teacher-forced top-20 logprobs) and each candidate token is tested against the target's "
                             "own law at its prefix, pooled (Cramer-von Mises); the baseline's own samples are the "
                             "control (docs/sampled.md)."),
    fit_margin: float = typer.Option(FIT_MARGIN, "--fit-margin", min=0.0, help="Logits of noise between the candidate and "
                                     "the baseline's scores allowed at a support boundary (top-k, top-p) by the fit "
                                     "test; raise it for bf16 engines whose control reports tokens outside."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary JSON (last line)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display and no summary table: the verdict "
                               "line only (--json implies it)."),
    report: Path | None = typer.Option(None, "--report", help="Write the markdown report here."),
    results: Path | None = typer.Option(None, "--results-dir", "--results", help="The results store (default "
                                        "$SPECBENCH_RESULTS or ./results; --results: its older name, kept)."),
    record: bool = typer.Option(True, "--record/--no-record", help="Write records to the results store."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="The model's tokenizer directory (tokenizer.json), "
                                          "used locally, round-trip checked, for an openai endpoint that cannot tokenize."),
    endpoint_type: str = typer.Option("completions", "--endpoint-type", help="completions (default) or chat: every "
                                      "request of both arms is the prompt as one user message (/v1/chat/completions, "
                                      "the server's chat template); arms that render it differently: CANNOT TEST."),
) -> None:
    """Sampled equivalence gate: per-position token distributions, spec off vs on, permutation test + BH."""
    from specbench.harness.adapters.base import UnsupportedCapability
    from specbench.harness.engines import (
        EngineStringError,
        baseline_and_candidate,
        build_adapter,
        fast_paths_on_cpu,
        gate_specs,
        parse_engine,
        share_gpu,
    )
    from specbench.suites.sampled import report as rep
    from specbench.suites.sampled.gate import DEFAULT_CONFIGS, SampledError, SampledGateOptions, parse_configs
    from specbench.suites.sampled.selftest import SELFTEST_OPTIONS, SELFTEST_REPEAT

    bad = usage_errors("sampled")

    try:
        if repeat is not None and not selftest:
            raise SampledError("--repeat goes with --selftest (the clean engine's repeated runs)")
        given = {"num_prompts": num_prompts, "positions": positions, "samples": samples, "prompt_chars": prompt_chars,
                 "prompt_set": prompt_set}
        dflt_opts = SELFTEST_OPTIONS if selftest else {}
        sized: dict[str, Any] = {k: v if v is not None else dflt_opts.get(k, getattr(SampledGateOptions, k)) for k, v in given.items()}
        opts = SampledGateOptions(**sized, permutations=permutations, q=q, null=null, seed=seed,
                                  concurrency=concurrency, refine=refine, endpoint_type=endpoint_type,
                                  seed_repeat=seed_repeat, seed_repeat_gate=seed_repeat_gate,
                                  assume_speculating=assume_speculating, fit=fit, fit_margin=fit_margin)
        cfgs = parse_configs(configs) if configs else list(DEFAULT_CONFIGS)
        if candidate is None and (selftest or baseline is None):
            bspec = parse_engine(baseline) if baseline else baseline_and_candidate(None, None)[0]
            cspecs = _default_candidates(bspec)  # the default configuration set's candidates
        else:
            bspec, cspec = baseline_and_candidate(baseline, candidate)
            cspecs = [cspec]
        if selftest and any(c.kind != "local" or "faults" in c.options for c in cspecs):
            raise SampledError("--selftest needs a local candidate without faults= (it injects them itself)")
        from specbench.harness.adapters.dialect import with_tokenizer

        bspec, *cspecs = share_gpu(gate_specs(with_tokenizer([bspec, *cspecs], tokenizer)))
        cspecs = [fast_paths_on_cpu(c) for c in cspecs]
        if selftest and opts.positions < 4:
            raise SampledError(f"--positions {opts.positions} is too few for --selftest: reused_uniform acts only "
                               "from the second draft of a verify step (expected >= 4)")
    except (SampledError, EngineStringError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None

    def log(s: str) -> None:
        if not json_out and not quiet:
            typer.echo(s)

    try:
        base = build_adapter(bspec, name="baseline")
    except (EngineStringError, ValueError, FileNotFoundError) as e:
        raise bad(str(e)) from None
    try:
        with _recorder(record, results, opts, cfgs, base) as rec:
            cands = []
            try:
                for cs in cspecs:
                    cands.append(build_adapter(cs, name=cs.options.get("name") or "candidate"))
            except (EngineStringError, ValueError, FileNotFoundError) as e:
                for c in cands:
                    c.close()
                raise bad(str(e)) from None
            from specbench.cli.progress import RunProgress

            if selftest:
                try:
                    with RunProgress(0, quiet=quiet or json_out) as progress:
                        code = _selftest(base, cands, opts, cfgs, rec, log, json_out, report,
                                         repeat or SELFTEST_REPEAT, progress)
                except (SampledError, UnsupportedCapability) as e:
                    raise bad(str(e)) from None
            else:
                from specbench.suites.sampled.gate import run_gate

                try:  # one progress display over every phase (requests done / total, ETA), on stderr
                    with RunProgress(0, quiet=quiet or json_out) as progress:
                        res = run_gate(base, cands if len(cands) > 1 else cands[0], opts, cfgs,
                                       on_samples=rec.samples, progress=progress)
                except SampledError as e:  # refused once the engines answered (as the self-test's are)
                    raise bad(str(e)) from None
                finally:
                    for c in cands:
                        c.close()
                rec.result(res)
                if report:
                    report.parent.mkdir(parents=True, exist_ok=True)
                    report.write_text(rep.render(res))
                summ = res.summary()
                if not quiet and not json_out:
                    _summary_table(summ)
                if not json_out:
                    typer.echo(_line(summ))
                if json_out:
                    typer.echo(json.dumps(summ, default=_jsonable))
                code = res.exit_code
    finally:
        base.close()
    raise typer.Exit(code)


def _default_candidates(bspec) -> list:
    """The default configuration set's candidates on the baseline's target (suites/sampled/config.py
    DEFAULT_CANDIDATES): the soft-q n-gram always, the DFlash and DFlash2 drafters where the target is the bundled
    one and the drafter is installed. A remote baseline has no target to put them on: that needs --candidate."""
    from specbench.harness.engines import TWIN_DROPS, EngineSpec, EngineStringError, bundled
    from specbench.harness.fixtures import bundled_dflash2
    from specbench.suites.sampled.config import DEFAULT_CANDIDATES

    if bspec.kind != "local":
        raise EngineStringError(f"--baseline {bspec.raw!r} is not a local engine: give the engine under test with "
                                "--candidate")
    target, bdraft = bundled()
    tdir = bspec.target or target
    d2 = bundled_dflash2()
    drafters = {"dflash": bdraft, "dflash2": str(d2) if d2 else None} if tdir == target else {}
    # the baseline's engine options (device, dtype, pages, backends, switches) are the candidates' too: the
    # converse of spec_off_twin, dropping the same speculation and arm options
    placed = {k: v for k, v in bspec.options.items() if k not in TWIN_DROPS}
    out = []
    for label, o in DEFAULT_CANDIDATES:
        if "draft" in o:
            ddir = drafters.get(o["draft"])
            if not ddir:
                continue
            o = {**o, "draft": ddir}
        opts = {**placed, **o, "name": label}
        out.append(EngineSpec("local", tdir, opts, f"local:{tdir}" + "".join(f",{k}={v}" for k, v in opts.items())))
    return out


def _selftest(base, cands, opts, cfgs, rec, log, json_out: bool, report: Path | None, repeat: int,
              progress) -> int:
    from specbench.suites.sampled import report as rep
    from specbench.suites.sampled.selftest import run_selftest

    rows, results = run_selftest(base, cands if len(cands) > 1 else cands[0], opts, cfgs, log=log,
                                 on_samples=rec.samples, repeat=repeat, progress=progress)
    for case, res in results.items():
        rec.result(res, case)
    o = {**opts.__dict__, "configs": [c.name for c in cfgs], "repeat": repeat,
         "candidates": [c.name for c in cands]}
    text = rep.render_selftest(rows, o)
    for case, res in results.items():
        text += "\n" + rep.render(res, title=f"Case {case}")
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text)
    ok = all(r["ok"] for r in rows)
    log(rep.render_selftest(rows, o))
    log("self-test: " + (PASS.qualified("every fault caught, clean engine passed") if ok else FAIL))
    if json_out:
        typer.echo(json.dumps({"selftest": PASS if ok else FAIL, "rows": rows, "options": o}, default=_jsonable))
    return 0 if ok else 1


def _summary_table(s: dict) -> None:
    from specbench.cli.progress import summary_table

    rows = [[name, c["cells"], c["testable"], c["rejected"], c["min_p"], c["max_tv"], c["median_mde_lone"]]
            for name, c in s["comparisons"].items()]
    secs = s.get("seconds")
    total = sum(secs.values()) if isinstance(secs, dict) else secs
    summary_table(f"sampled gate: {s['verdict']} ({s['num_prompts']} prompts x {', '.join(s['configs'])}"
                  + (f", {total:.0f} s)" if isinstance(total, (int, float)) else ")"),
                  ["comparison", "cells", "testable", "rejected", "min p", "max TV", "median MDE (lone)"], rows)
    confs = s.get("configurations") or []
    if confs:  # per configuration: the accept-path branches it reached, and its verdict
        summary_table("configurations (candidate x sampling config)",
                      ["candidate", "config", "verify steps", "bonus rows", "rejections", "rejected cells", "verdict"],
                      [[x["candidate"] or "candidate", x["config"], _n(x["verify_steps"]), _n(x["bonus_rows"]),
                        _n(x["rejections"]), f"{x['rejected']} / {x['testable']}", x["verdict"]] for x in confs])


def _n(x) -> str:
    return "unknown" if x is None else str(x)


def _line(s: dict) -> str:
    parts = [f"sampled gate: {s['verdict']}" + (f" [missing: {'; '.join(s['missing'])}]" if s.get("missing") else "")]
    if s.get("candidate_verdicts"):  # each candidate judged on its own evidence
        parts.append("candidates: " + ", ".join(f"{k} {v}" for k, v in s["candidate_verdicts"].items()))
    fam = s.get("family") or {}
    if fam.get("q") is not None:
        parts.append(f"BH within each candidate's cells at q {fam['q_per_candidate']:.3g}"
                     + (f" (q {fam['q']:g} / {fam['candidates']} candidates)" if fam.get("candidates", 1) > 1 else ""))
    seen = [f"{k + ': ' if k else ''}{v['describe']}" for k, v in (s.get("speculation") or {}).items()
            if v.get("source") != "counters" and is_pass(v.get("verdict"))]
    if seen:  # a PASS without counters says what showed speculation (or that the user asserted it)
        parts.append("speculation check: " + "; ".join(seen))
    for name, c in s["comparisons"].items():
        parts.append(f"{name}: {c['rejected']}/{c['testable']} cells rejected (median MDE lone "
                     f"{c['median_mde_lone']:.3f}, all {c['median_mde_all']:.3f})")
    if s["spec"]:
        parts.append(f"mean accepted length {s['spec']['mean_accept_len']:.2f}")
    return "; ".join(parts)


def _jsonable(x):
    return str(x)


class _Rec:
    """Writes samples and cells to an open run (or nothing)."""

    def __init__(self, run) -> None:
        self.run = run

    def samples(self, s) -> None:
        if self.run is None:
            return
        for (pi, ci), arr in s.tokens.items():
            self.run.write("samples", {"arm": s.arm, "prompt": pi, "config": ci, "tokens": arr.tolist()})

    def result(self, res, case: str | None = None) -> None:
        if self.run is None:
            return
        for comp in res.comparisons:
            for c in comp.cells:
                self.run.write("cells", {"case": case, "comparison": comp.name, "candidate": comp.candidate,
                                         **asdict(c)})
        summ = res.summary()
        if case:
            summary = dict(self.run.record.summary)
            summary[case] = summ
            self.run.update(summary=summary)
        else:
            self.run.update(summary=summ, engines=res.engines)


class _recorder:
    def __init__(self, record: bool, results: Path | None, opts, cfgs, base) -> None:
        self.record, self.results, self.opts, self.cfgs, self.base = record, results, opts, cfgs, base
        self._cm: AbstractContextManager[Run] | None = None

    def __enter__(self) -> _Rec:
        if not self.record:
            return _Rec(None)
        from specbench.harness.results import open_run
        from specbench.suites.sampled.gate import SUITE_VERSION

        self._cm = open_run("sampled", SUITE_VERSION, engines={"baseline": self.base.describe()},
                            sampling={"configs": [asdict(c) for c in self.cfgs]}, dataset={"name": "gsm8k", "prompt_sets": self.opts.prompt_set},
                            seeds={"base": self.opts.seed}, config=asdict(self.opts), results=self.results)
        return _Rec(self._cm.__enter__())

    def __exit__(self, *exc) -> bool:
        return bool(self._cm.__exit__(*exc)) if self._cm is not None else False
