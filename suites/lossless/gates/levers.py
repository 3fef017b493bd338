"""The levers gate: the load-aware levers' paths (a gated one-token round, a trimmed draft, the automatic policy)
held to the same rule as plain speculation.

Contract: the levers are off by default, so no other gate ever runs the paths they take. For each of
`VARIANTS` (one lever on, the other two off, whatever the candidate runs itself; gate 1: with more than one request running, every draft-ready request verifies one token; trim 2:
drafts cut to 2 tokens; the automatic span policy) the gate builds a fresh engine like the candidate with that
lever set (the adapter capability "levers", `with_levers`: local engines, their faults and run-time invariants
as the candidate has them), sends every prompt at once with the concurrent gate's staggered max_tokens, and judges
each output against the baseline by the regret rule (the baseline's generations are memoised: the same request
runs once). No comparison against the lever-off acceptance (a lever changes acceptance by design), but each
variant's per-step acceptance is held to its drafter's replay at the steps the engine reports (accept_trace.py's
`judge_traces`: a lever path that loses the drafter's context keeps the tokens exact and fails there; where the
replay cannot run, a note, not a CANNOT TEST of the levers). Each variant must show that its
lever acted, from the engine's counters (`specbench:spec_gated_rounds_total`; `specbench:spec_step_span_total`
at span trim + 1); one that did not is CANNOT TEST for that variant ("the lever never acted"), never a PASS on
nothing. A trim-2 engine that drafted nothing at all (counted: zero drafts) fails: trim 2 drafts every step of
a request with tokens to go, and speculation silently off is a defect. Gate 1 is not held to drafting (it drafts
only while a request runs alone, which an early EOS can leave to none: 0 drafts in the demo's 8 requests, the
longest ending at EOS before the next), nor is the policy (it may hold every span to one token by design). The policy acts by choosing every step's span, so it is held to having chosen spans. A variant the
engine refuses to build (trim 2 past a K of 1) is CANNOT TEST for that variant. An engine without the capability,
or one that does not speculate, is CANNOT TEST (advisory by default). Not a `specbench selftest` column: the self-test's faults
are armed with the levers off; tests/test_gate_power.py plants lever bugs of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specbench.harness.adapters.base import LEVERS, EngineAdapter, UnsupportedCapability
from specbench.harness.adapters.prom import parse_prometheus

from ..cached import CachedAdapter
from ..checks import AcceptanceEvidence, Check
from ..concurrent import staggered
from ..greedy import GreedyGateOptions, resolve_rule, run_greedy
from ..outcomes import GateRun, Prompt
from .accept_trace import judge_traces

# One lever on each, the others off: a candidate that runs a lever itself (policy=auto) must not hide another's path.
OFF = {"gate": 0, "trim": 0, "policy": "off"}
VARIANTS: tuple[tuple[str, dict], ...] = (("gate=1", {**OFF, "gate": 1}), ("trim=2", {**OFF, "trim": 2}),
                                          ("policy=auto", {**OFF, "policy": "auto"}))


def _lever_counts(text: str | None) -> tuple[int, dict[int, int]]:
    """(gated rounds, steps per chosen span) from the engine's Prometheus text."""
    gated, spans = 0, dict[int, int]()
    for name, labels, v in parse_prometheus(text or ""):
        if name == "specbench:spec_gated_rounds_total":
            gated += int(v)
        elif name == "specbench:spec_step_span_total" and labels.get("span", "").isdigit():
            spans[int(labels["span"])] = spans.get(int(labels["span"]), 0) + int(v)
    return gated, spans


def _acted(kw: dict, gated: int, spans: dict[int, int]) -> str | None:
    """What shows the lever acted (the one `kw` turns on), or None when nothing does."""
    if kw["gate"]:
        return f"{gated} gated one-token rounds" if gated else None
    if kw["trim"]:
        n = spans.get(kw["trim"] + 1, 0)
        return f"{n} steps at span {kw['trim'] + 1}" if n else None
    return f"spans chosen {dict(sorted(spans.items()))}" if sum(spans.values()) else None


def _cannot(why: str, opts: GreedyGateOptions, t0: float) -> GateRun:
    return GateRun("levers", [], AcceptanceEvidence.not_measured(), [Check("levers", True, why, skipped=True)],
                   time.perf_counter() - t0, require_spec=False, rule=opts.rule_dict(), cannot_test=[why])


async def levers(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                 max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    why = ("the engine's load-aware levers (the adapter capability \"levers\": gate, trim, policy), which only "
           "a local engine sets: no request was sent")
    if LEVERS not in candidate.capabilities:
        return _cannot(why, opts, t0)
    mts = staggered(max_tokens, len(prompts))
    base = CachedAdapter(baseline)  # not closed here: the baseline is the suite's
    out = GateRun("levers", [], AcceptanceEvidence.not_measured(), require_spec=False, rule=opts.rule_dict())
    drafts = accepted = 0
    source = "none"
    for label, kw in VARIANTS:
        try:
            ad = candidate.with_levers(**kw, name=f"{candidate.name}[{label}]")
        except UnsupportedCapability as e:  # e.g. an engine that does not speculate has no levers
            return _cannot(f"the engine's load-aware levers: {e}; no request was sent", opts, t0)
        except ValueError as e:  # the engine refuses this lever's setting (trim past its K): that variant only
            out.cannot_test.append(f"{label}: an engine with the lever set: refused: {e}")
            out.notes.append(f"{label}: refused by the engine: {e}")
            continue
        try:
            ps = [Prompt(f"{label}: {p.pid}", p.ids, p.text) for p in prompts]
            run = await run_greedy(base, ad, ps, max_tokens, opts, concurrency=None, name=f"levers-{label}",
                                   max_tokens_each=mts, baseline_concurrency=1)
            gated, spans = _lever_counts(await ad.metrics_text())
            trace = await judge_traces(ad, run.results, ps, mts, opts, name=f"{label}: accept-trace")
        finally:
            await ad.aclose()
        out.prompts += run.prompts + [p for p in trace.prompts if p.status == "fail"]
        out.results += run.results
        out.checks += [Check(f"{label}: {c.name}", c.ok, c.detail, c.skipped) for c in run.checks] + trace.checks
        out.notes += [f"{label}: {n}" for n in trace.notes] + trace.cannot_test
        acted = _acted(kw, gated, spans)
        if kw["trim"] and run.stats.known and not run.stats.num_drafts and max(mts) > kw["trim"]:
            # trim 2 drafts 2 tokens every step of a request with tokens to go. (Gate 1 drafts only while a request
            # runs alone, which an early EOS can leave to none; the policy may hold every span to one token by
            # design: neither is held to drafting.)
            out.checks.append(Check(f"{label}: speculating", False,
                                    f"no draft in {len(ps)} requests with the lever on, where the engine speculates "
                                    "without it: speculation silently off"))
        if acted is None:
            out.cannot_test.append(f"{label}: the lever acting: it never acted on {len(ps)} requests at once "
                                   f"(gated rounds {gated}, spans {dict(sorted(spans.items()))})")
        out.notes.append(f"{label}: {len(ps)} requests at once, max_tokens {mts}; {acted or 'the lever never acted'}")
        if run.stats.known:
            source = run.stats.source
            drafts += run.stats.num_drafts
            accepted += run.stats.num_accepted_tokens
    out.stats = AcceptanceEvidence(source, num_drafts=drafts, num_accepted_tokens=accepted,
                                   min_accept_len=opts.min_accept_len)
    out.wall_s = time.perf_counter() - t0
    return out
