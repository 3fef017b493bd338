"""The sampled gate's self-test: the gate must catch every sampling fault and pass the clean engine.

Contract: `run_selftest(baseline, candidates, opts, ...)` draws the baseline samples once, then runs the gate
(every candidate against those samples, one BH family per run) `repeat` times against the clean candidates,
each repetition after the first on fresh engines and on its own candidate seeds (`--seed` + r), and, per fault
in `cases`, once against fresh engines like the candidates with that fault armed (the candidates' "faults"
capability, `with_faults`; an adapter without it raises `UnsupportedCapability`). Every run is judged at the
per-run level opts.q / repeat, so the probability that a correct engine raises an alarm in any of the
`repeat` clean runs is at most opts.q (Bonferroni over the runs); a fault caught at that level is caught at
the gate's default level too (BH rejects more at a larger q). A fault is caught when the verdict is FAIL
(some cell rejected); NOT SPECULATING does not count. Every clean run must PASS. The candidates and every
engine armed from them are closed here. Returns one row per case plus the per-case `GateResult`s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from specbench.harness.adapters.base import EngineAdapter
from specbench.harness.verdicts import FAIL, PASS

from .config import DEFAULT_CONFIGS_TEXT
from .gate import (
    DEFAULT_CONFIGS,
    GateResult,
    SampledError,
    SampledGateOptions,
    Samples,
    SamplingConfig,
    collect,
    config_key,
    configurations,
    make_prompts,
    neighbours,
    not_tested,
    run_gate,
)

FAULT_CASES = ("biased_accept", "resample_from_p", "reused_uniform", "q_next_row", "bonus_residual", "unseeded_accept",
               "row_params_first")
# Every sampling fault is armed by default: on the echo and repeat prompts each is caught by both default
# candidates (docs/sampled.md "The self-test matrix").
DEFAULT_FAULT_CASES = FAULT_CASES
# The self-test runs the default configuration set (config.py DEFAULT_CANDIDATES x DEFAULT_CONFIGS on the echo
# and repeat prompts) at a smaller size than the gate: one prompt of each set, P = 4 (the fewest positions at
# which reused_uniform can act: the first verify then has 2 drafts), 256 samples per arm.
SELFTEST_OPTIONS = {"num_prompts": 1, "positions": 4, "samples": 256, "prompt_chars": 200,
                    "prompt_set": "echo,repeat"}
SELFTEST_CONFIGS = DEFAULT_CONFIGS_TEXT
SELFTEST_REPEAT = 5  # clean runs; each run is judged at q / SELFTEST_REPEAT


def _row(case: str, res: GateResult, seconds: float, q_run: float) -> dict:
    fin = [c for comp in res.comparisons if comp.name == "spec" for c in comp.cells if c.testable]
    expect = PASS if case.startswith("clean") else FAIL
    ok = res.passed if case.startswith("clean") else res.verdict == FAIL
    confs = configurations(res)
    caught = [{"configuration": config_key(x["candidate"], x["config"]), "rejected": x["rejected"],
               "min_p": x["min_p"]} for x in confs if x["rejected"]]
    caught += [{"configuration": f"seed repeat{' ' + lab if lab else ''}", "rejected": chk["candidate"]["differ"],
                "min_p": chk["p_value"]} for lab, chk in res.seed_repeat.items() if chk["verdict"] == FAIL]
    caught += [{"configuration": f"fit{' ' + lab if lab else ''}", "rejected": j["counts"]["outside"],
                "min_p": j["p_value"]} for lab, j in (res.fit.get("candidates") or {}).items() if j["verdict"] == FAIL]
    known = [x for x in confs if x["bonus_rows"] is not None]
    return {"case": case, "expect": expect, "verdict": res.verdict, "ok": ok,
            "rejected": sum(len(c.rejected) for c in res.comparisons if c.name == "spec"),
            "null_rejected": sum(len(c.rejected) for c in res.comparisons if c.name == "null"),
            "testable": len(fin), "min_p": min((c.p_value for c in fin), default=1.0),
            "min_q": min((c.q_value for c in fin), default=1.0), "q_run": q_run,
            "max_tv": max((c.tv for c in fin), default=0.0),
            "mean_accept_len": (res.spec or {}).get("mean_accept_len", 0.0),
            "bonus_rows": sum(x["bonus_rows"] for x in known) if known else None,
            "rejections": sum(x["rejections"] for x in known) if known else None,
            "caught_by": caught, "configurations": confs,
            "not_tested": not_tested(res.spec_by_config), "seconds": seconds}


class _CaseProgress:
    """One self-test case's view of the whole run's progress display: its own plan is the run's, not a total."""

    def __init__(self, progress: Any, case: str) -> None:
        self.progress, self.case = progress, case

    def plan(self, total: int) -> None:
        pass

    def phase(self, name: str, n: int | None) -> None:
        self.progress.phase(f"{self.case}: {name}", n)

    def advance(self, result: object = None, n: int = 1) -> None:
        self.progress.advance(result, n)


def run_selftest(baseline: EngineAdapter, candidates: EngineAdapter | Sequence[EngineAdapter],
                 opts: SampledGateOptions, configs: Sequence[SamplingConfig] = DEFAULT_CONFIGS,
                 prompts: Sequence[tuple[str, str]] | None = None,
                 cases: Sequence[str] = ("clean", *DEFAULT_FAULT_CASES), log: Callable[[str], None] | None = None,
                 on_samples: Callable[[Samples], None] | None = None,
                 baseline_samples: Samples | None = None, repeat: int = 1,
                 progress: Any = None) -> tuple[list[dict], dict[str, GateResult]]:
    say = log or (lambda s: None)
    cands = [candidates] if isinstance(candidates, EngineAdapter) else list(candidates)
    if repeat < 1:
        raise SampledError(f"--repeat {repeat} is invalid: expected an integer >= 1")
    if "reused_uniform" in cases and opts.positions < 4:
        raise SampledError(f"--positions {opts.positions} is too few for the self-test: reused_uniform acts only "
                           "from the second draft of a verify step, which needs positions >= 4")
    q_run = opts.q / repeat
    run_opts = replace(opts, q=q_run, seed_repeat_gate=True)  # the seed repeat decides too: its faults need it
    open_ = list(cands)  # closed once their case ran or the self-test ended
    try:
        for c in cands:
            missing = [f for f in cases if f != "clean" and f not in c.armable_faults()]
            if missing:
                raise SampledError(f"{c.name}: the engine names no fault {', '.join(missing)} "
                                   f"(it has {', '.join(c.armable_faults())})")
        prompts = list(prompts) if prompts is not None else make_prompts(baseline, opts)
        faults = [f for f in cases if f != "clean"]
        runs = ([f"clean#{r + 1}" if r else "clean" for r in range(repeat)] if "clean" in cases else []) + faults
        n = len(prompts) * len(configs) * opts.samples
        reps = min(run_opts.seed_repeat, n)  # each run's seed repeat: the baseline's and every candidate's
        if progress is not None:
            progress.plan(n * ((baseline_samples is None) + len(cands) * (len(runs) + bool(opts.null))
                               + opts.fit * (1 + len(cands) * len(runs)))  # fit: the control scored once
                          + (reps + 2 * neighbours(reps)) * (1 + len(cands)) * len(runs) * bool(reps))
        t0 = time.perf_counter()
        base = baseline_samples
        if base is None:
            if progress is not None:
                progress.phase("baseline (spec off)", n)
            base = collect(baseline, prompts, configs, run_opts, "baseline", 0,
                           progress.advance if progress is not None else None)
            if on_samples:
                on_samples(base)
            say(f"baseline samples: {base.seconds:.1f} s")
        rows, results = [], {}
        for case in runs:
            t = time.perf_counter()
            rep = int(case.split("#")[1]) - 1 if "#" in case else 0
            fault = () if case.startswith("clean") else (case,)
            armed = list(cands) if case == "clean" else [c.with_faults(fault, name=c.name) for c in cands]
            try:
                # clean repetition r draws its candidate samples on seed + r (disjoint from every other run's
                # streams: seed_of); the null run goes with the first clean run only
                case_opts = replace(run_opts, seed=opts.seed + rep, null=opts.null and case == "clean")
                res = run_gate(baseline, armed, case_opts, configs, prompts, baseline_samples=base,
                               on_samples=on_samples,
                               progress=_CaseProgress(progress, case) if progress is not None else None)
            finally:
                for a in armed:  # a closed adapter can still arm fresh engines (base.py with_faults)
                    a.close()
                if case == "clean":
                    open_.clear()
                del armed  # one set of armed engines alive at a time besides the candidates
            rows.append(_row(case, res, time.perf_counter() - t, q_run))
            results[case] = res
            r_ = rows[-1]
            by = "; ".join(f"{x['configuration']} {x['rejected']}" for x in r_["caught_by"]) or "none"
            say(f"{case}: {res.verdict} ({r_['rejected']} of {r_['testable']} cells rejected: {by}; "
                f"{r_['seconds']:.1f} s)")
    finally:
        for a in open_:
            a.close()
    rows_total = time.perf_counter() - t0
    for r in rows:
        r["total_seconds"] = rows_total
    return rows, results
