"""The sampled gate's self-test: the gate must catch every sampling fault and pass the clean engine.

Contract: `run_selftest(baseline, candidate, opts, ...)` draws the baseline samples once, then runs the
gate against the clean candidate and, per fault in `FAULT_CASES`, a fresh engine like it with that fault
armed (the candidate's "faults" capability, `with_faults`; an adapter without it raises
`UnsupportedCapability`). A fault is caught when the verdict is FAIL (some cell rejected); NOT
SPECULATING does not count. The clean case must PASS. The candidate and every engine armed from it are
closed here. Returns one row per case plus the per-case `GateResult`s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specbench.harness.adapters.base import EngineAdapter

from .gate import (
    DEFAULT_CONFIGS,
    GateResult,
    SampledError,
    SampledGateOptions,
    Samples,
    SamplingConfig,
    collect,
    make_prompts,
    not_tested,
    run_gate,
)

FAULT_CASES = ("biased_accept", "resample_from_p", "reused_uniform", "q_next_row", "bonus_residual")
# Armed by default (`run_selftest` cases): the two q/bonus faults are not caught by the default candidate
# (point-mass q: q_next_row is inert) nor, at these sizes, by the soft-q candidate for bonus_residual;
# docs/sampled.md "Seeing q and the bonus row" has the measurements. Pass cases=... to arm them.
DEFAULT_FAULT_CASES = ("biased_accept", "resample_from_p", "reused_uniform")  # the engine's speculative-sampling faults
# Calibrated on the bundled tiny pair (docs/sampled.md "Self-test"). The default candidate is the target
# with the n-gram proposer on echo prompts: its accept ratios p(d)/1 lie strictly inside (0, 1), where all
# three faults act; the bundled DFlash drafter's ratios are near 0 or >= 1, where reused_uniform is inert.
# P = 4 is the fewest positions at which reused_uniform can act (the first verify has 2 drafts); it shows
# at position 2 with a TV of about 0.05, hence 1,024 samples per arm.
SELFTEST_OPTIONS = {"num_prompts": 2, "positions": 4, "samples": 1024, "prompt_chars": 200, "prompt_set": "echo"}
SELFTEST_CONFIGS = "t=1.5,k=2;t=1,k=3"
SELFTEST_SPEC = "ngram"
# The n-gram drafts with a soft q: q_i = (1 - M) one_hot(lookup) + M context frequencies (spec=ngram,mix=M),
# the candidate under which q_next_row is caught (with point masses the accept never reads a q row). M = 0.05,
# not 0.2: at 0.2 every later accept ratio is 0 or >= 1 on echo prompts, so reused_uniform is inert by
# arithmetic; at 0.05 clean passes and reused_uniform (2 / 12 cells) and q_next_row (9 / 12) are caught in one
# measurement (docs/sampled.md "Seeing q and the bonus row"). Not yet the default candidate: one measurement.
SELFTEST_MIX = "0.05"


def _row(case: str, res: GateResult, seconds: float) -> dict:
    spec = res.comparisons[0]
    fin = [c for c in spec.cells if c.testable]
    expect = "PASS" if case == "clean" else "FAIL"
    ok = res.passed if case == "clean" else res.verdict == "FAIL"
    return {"case": case, "expect": expect, "verdict": res.verdict, "ok": ok, "rejected": len(spec.rejected),
            "testable": len(fin), "min_p": min((c.p_value for c in fin), default=1.0),
            "max_tv": max((c.tv for c in fin), default=0.0),
            "mean_accept_len": (res.spec or {}).get("mean_accept_len", 0.0),
            "bonus_rows": (res.spec or {}).get("full_accepts"), "rejections": (res.spec or {}).get("rejections"),
            "not_tested": not_tested(res.spec_by_config), "seconds": seconds}


def run_selftest(baseline: EngineAdapter, candidate: EngineAdapter, opts: SampledGateOptions,
                 configs: Sequence[SamplingConfig] = DEFAULT_CONFIGS, prompts: Sequence[tuple[str, str]] | None = None,
                 cases: Sequence[str] = ("clean", *DEFAULT_FAULT_CASES), log: Callable[[str], None] | None = None,
                 on_samples: Callable[[Samples], None] | None = None,
                 baseline_samples: Samples | None = None) -> tuple[list[dict], dict[str, GateResult]]:
    say = log or (lambda s: None)
    if "reused_uniform" in cases and opts.positions < 4:
        raise SampledError(f"--positions {opts.positions} is too few for the self-test: reused_uniform acts only "
                           "from the second draft of a verify step, which needs positions >= 4")
    open_ = [candidate]  # closed once its case ran or the self-test ended
    try:
        missing = [c for c in cases if c != "clean" and c not in candidate.armable_faults()]
        if missing:
            raise SampledError(f"{candidate.name}: the engine names no fault {', '.join(missing)} "
                               f"(it has {', '.join(candidate.armable_faults())})")
        prompts = list(prompts) if prompts is not None else make_prompts(baseline, opts)
        t0 = time.perf_counter()
        base = baseline_samples
        if base is None:
            base = collect(baseline, prompts, configs, opts, "baseline", 0)
            if on_samples:
                on_samples(base)
            say(f"baseline samples: {base.seconds:.1f} s")
        rows, results = [], {}
        for case in cases:
            t = time.perf_counter()
            cand = candidate if case == "clean" else candidate.with_faults((case,))
            try:
                case_opts = opts if case == "clean" else SampledGateOptions(**{**opts.__dict__, "null": False})
                res = run_gate(baseline, cand, case_opts, configs, prompts, baseline_samples=base,
                               on_samples=on_samples)
            finally:
                cand.close()  # a closed adapter can still arm fresh engines (base.py with_faults)
                if cand is candidate:
                    open_.clear()
                del cand  # one armed engine alive at a time besides the candidate
            rows.append(_row(case, res, time.perf_counter() - t))
            results[case] = res
            say(f"{case}: {res.verdict} ({rows[-1]['rejected']} of {rows[-1]['testable']} cells rejected, "
                f"{rows[-1]['seconds']:.1f} s)")
    finally:
        for a in open_:
            a.close()
    rows_total = time.perf_counter() - t0
    for r in rows:
        r["total_seconds"] = rows_total
    return rows, results
