"""The stop-in-run gate: a stop string inside an accepted run.

Contract: stop strings picked from the baseline's own text at several offsets (30%, 55%, 80% of it), so that
on an engine that accepts several drafts per step the stop often lands inside an accepted run. The candidate
must end exactly where the baseline ends: same ids, same text, nothing emitted past the stop. A first
divergence before the stop is judged by the regret rule (a benign flip leaves the stop unexercised). The notes
count the stops that landed inside an accepted run; no stop to pick is CANNOT TEST.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta
from specbench.harness.verdicts import CANNOT_TEST

from ..greedy import GreedyGateOptions, baseline_for, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt, PromptCheck
from ..regret import first_divergence
from .common import judge_stop_divergence


def pick_stops(text: str, fracs: Sequence[float] = (0.3, 0.55, 0.8)) -> list[str]:
    """Short substrings whose first occurrence in `text` starts near each fraction of its length."""
    out: list[str] = []
    for f in fracs:
        o = int(len(text) * f)
        for start in range(o, min(len(text), o + 12)):
            for n in range(2, 7):
                s = text[start:start + n]
                if len(s) == n and s.strip() and "\ufffd" not in s and text.find(s) == start and s not in out:
                    out.append(s)
                    break
            else:
                continue
            break
    return out


def _inside_run(res: GenResult) -> bool:
    """Did the stop land inside an accepted run (the engine dropped tokens it had already accepted)?"""
    runs = (res.spec or {}).get("accepted_runs") or []
    return bool(runs and res.chunk_tokens and res.chunk_tokens[-1] < runs[-1] + 1)


async def stop_in_run(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                      max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    cases: list[tuple[Prompt, str]] = []
    for p in prompts[:3]:
        full = await baseline_for(baseline, p.ids, [], max_tokens, opts.top_k)
        if full.ok and full.text:
            cases += [(p, s) for s in pick_stops(full.text)]
    before = await candidate.spec_counters()
    reqs = [GenRequest(prompt=p.ids, max_tokens=max_tokens, stop=(s,), rid=f"stop-{i}", prompt_cache=False)
            for i, (p, s) in enumerate(cases)]
    res = await candidate.generate(reqs, concurrency=1)
    delta = counters_delta(before, await candidate.spec_counters())
    pcs: list[PromptCheck] = []
    inside = 0
    for (p, s), r in zip(cases, res, strict=True):
        b = await baseline_for(baseline, p.ids, [], max_tokens, opts.top_k, stop=(s,))
        pc = PromptCheck(f"{p.pid}-stop{s!r}", len(p.ids), max_tokens, spec=r.spec)
        pcs.append(pc)
        if r.ok and b.ok and (r.output_ids is None or b.output_ids is None):
            side = "candidate" if r.output_ids is None else "baseline"
            pc.status, pc.missing = "untestable", f"output token ids ({side})"
            pc.reason = f"{CANNOT_TEST}: the {side} reports no output token ids"
            continue
        if not r.ok or not b.ok:
            pc.status, pc.reason = "error", f"request failed: {r.error or b.error}"
            continue
        inside += _inside_run(r)
        cid, bid = list(r.output_ids or []), list(b.output_ids or [])  # (neither is None here)
        pc.candidate_tokens = pc.tokens_compared = len(cid)
        i = first_divergence(cid, bid)
        if i is None:
            if r.text != b.text:
                pc.status, pc.reason = "fail", f"same tokens, different text: {r.text[-40:]!r} vs {b.text[-40:]!r}"
            continue
        await judge_stop_divergence(pc, i, cid, bid, baseline, p, b, opts, "stop",
                                     f"emitted past the stop {s!r} (baseline ends at {len(bid)})")
    run = await finish_run("stop-in-run", candidate, baseline, pcs, res, delta, opts, t0, engine_k(candidate))
    run.require_spec = False
    run.notes.append(f"{len(cases)} stop strings; {inside} landed inside an accepted run")
    if not cases:
        run.cannot_test.append(f"a stop string to test: no baseline output of {len(prompts[:3])} prompts had text to "
                               "pick one from")
    return run
