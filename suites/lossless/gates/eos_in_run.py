"""The eos-in-run gate: EOS and `stop_token_ids` inside an accepted run, and ignore_eos past an EOS.

Contract: cases: every prompt whose baseline output ends early at EOS, and stop token ids picked from the
baseline's own output (first occurrences near 30% / 60% of it). They run one request at a time on the
candidate (its own drafter) and, where the adapter offers "oracle_drafts", on an oracle engine like the
candidate (faults kept) whose drafts replay the baseline's continuations, so every step accepts K drafts and
almost every stop lands inside the run. Per case the candidate must return exactly the baseline's ids (ending
at the stop) and count exactly those: usage completion_tokens, the streamed chunk tokens and the engine's
generation-token counter (where exposed) equal the returned ids. A stop lands "inside an accepted run" when
the step that emitted it had accepted drafts past it (per-step accepted runs where the engine reports them;
else, from the request's counter delta, fewer tokens returned than 1 + drafts + accepted). CANNOT TEST when no
case put its stop inside an accepted run (the count is in the notes); stop-id cases whose baseline ignores
stop_token_ids are dropped (a skipped check says so).
ignore_eos cases (`_ignore_eos_cases`): prompts whose greedy baseline ends at EOS within a search budget are
re-sent with ignore_eos to IGNORE_EOS_PAST tokens past that EOS on both arms, judged by the regret rule;
without such an EOS, or with a baseline that stops anyway, a skipped `ignore-eos` check says so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specbench.harness.adapters.base import (
    ORACLE_DRAFTS,
    EngineAdapter,
    GenRequest,
    GenResult,
    counters_delta,
)
from specbench.harness.verdicts import CANNOT_TEST

from ..checks import Check, check_after_stop, check_kv_idle, count_problems, gate_eos
from ..greedy import GreedyGateOptions, baseline_for, engine_k, finish_run, health, resolve_rule
from ..outcomes import GateRun, Prompt, PromptCheck
from ..regret import first_divergence
from .common import judge_shaped, judge_stop_divergence, stop_inside_run


def pick_stop_ids(ids: Sequence[int], avoid: set[int], fracs: Sequence[float] = (0.3, 0.6),
                  k: int | None = None) -> list[tuple[int, int]]:
    """(position, token id) pairs: a token whose first occurrence in `ids` is at or just after each fraction of
    its length (so a stop on that id ends the output there), never position 0 or the last, never in `avoid`.
    With K known, positions that are a multiple of K + 1 are skipped: with every draft accepted (the oracle)
    they are the steps' bonus tokens, never inside a run."""
    out: list[tuple[int, int]] = []
    for f in fracs:
        o = max(1, int(len(ids) * f))
        for i in range(o, min(len(ids) - 1, o + 16)):
            t = ids[i]
            if k and i % (k + 1) == 0:
                continue
            if t not in avoid and ids.index(t) == i and all(t != x for _, x in out):
                out.append((i, t))
                break
    return out


@dataclass
class StopCase:
    prompt: Prompt
    kind: str  # "eos" | "stop-id"
    stop_pos: int  # the stop's position in the baseline's output
    stop_id: int | None  # the stop token id (stop-id cases)
    base: GenResult  # the baseline's output with the same stop


def _counted(r: GenResult, gen_before: int | None, gen_after: int | None) -> list[str]:
    """Token counts that disagree with the returned ids: usage, streamed chunks, the generation counter."""
    n = len(r.output_ids or [])
    bad = count_problems(r)
    if gen_before is not None and gen_after is not None and gen_after - gen_before != n:
        bad.append(f"the engine's generation-token counter moved by {gen_after - gen_before}, {n} returned")
    return bad


async def _stop_cases(baseline: EngineAdapter, prompts: Sequence[Prompt], max_tokens: int, opts: GreedyGateOptions,
                      eos: set[int], k: int | None = None) -> tuple[list[StopCase], dict[tuple[int, ...], list[int]],
                                                                    list[str]]:
    """The cases, the baseline's full continuations (for the oracle) and notes on dropped stop-id cases."""
    cases: list[StopCase] = []
    conts: dict[tuple[int, ...], list[int]] = {}
    ignored: list[str] = []
    for p in prompts:
        full = await baseline_for(baseline, p.ids, [], max_tokens, opts.top_k)
        if not full.ok or not full.output_ids:
            continue
        ids = list(full.output_ids)
        conts[tuple(p.ids)] = ids
        if full.finish_reason == "stop" and len(ids) < max_tokens:  # stopped early at EOS
            cases.append(StopCase(p, "eos", len(ids) - 1, None, full))
        for pos, t in pick_stop_ids(ids, eos, k=k):
            b = await _one_stop(baseline, p.ids, max_tokens, opts.top_k, t)
            if not b.ok or b.output_ids is None:
                continue
            if list(b.output_ids) != ids[:pos + 1]:
                ignored.append(f"{p.pid}: stop id {t} at {pos}: baseline returned {len(b.output_ids)} tokens")
                continue
            cases.append(StopCase(p, "stop-id", pos, t, b))
    return cases, conts, ignored


async def _one_stop(adapter: EngineAdapter, ids: list[int], max_tokens: int, top_k: int | None, stop_id: int | None,
                    rid: str | None = None) -> GenResult:
    req = GenRequest(prompt=list(ids), max_tokens=max_tokens, temperature=0.0, logprobs=top_k, rid=rid,
                     stop_token_ids=(stop_id,) if stop_id is not None else (), prompt_cache=False)
    return (await adapter.generate([req], concurrency=1))[0]


async def _judge_stop(baseline: EngineAdapter, c: StopCase, r: GenResult, opts: GreedyGateOptions, label: str,
                      counted: list[str]) -> PromptCheck:
    p, b = c.prompt, c.base
    what = "EOS" if c.kind == "eos" else f"stop id {c.stop_id}"
    pc = PromptCheck(f"{p.pid}-{label}-{c.kind}@{c.stop_pos}", len(p.ids), c.stop_pos + 1, spec=r.spec)
    if not r.ok:
        pc.status, pc.reason = "error", f"request failed: {r.error}"
        return pc
    if r.output_ids is None:
        pc.status, pc.missing = "untestable", "output token ids (candidate)"
        pc.reason = f"{CANNOT_TEST}: the candidate reports no output token ids"
        return pc
    cid, bid = list(r.output_ids), list(b.output_ids or [])
    pc.candidate_tokens = pc.tokens_compared = len(cid)
    i = first_divergence(cid, bid)
    if i is None:
        if counted:
            pc.status, pc.reason = "fail", f"{what} at {c.stop_pos}: " + "; ".join(counted)
        return pc
    await judge_stop_divergence(pc, i, cid, bid, baseline, p, b, opts, what,
                                 f"returned past the {what} at position {c.stop_pos}")
    return pc


async def eos_in_run(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                     max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    eos = gate_eos(baseline, candidate)
    cases, conts, ignored = await _stop_cases(baseline, prompts, max_tokens, opts, eos, engine_k(candidate))
    engines: list[tuple[str, EngineAdapter]] = [("drafter", candidate)]
    oracle: EngineAdapter | None = None
    if ORACLE_DRAFTS in candidate.capabilities and conts:
        oracle = candidate.with_oracle_drafts(conts)
        engines.append(("oracle", oracle))
    pcs: list[PromptCheck] = []
    results: list[GenResult] = []
    oracle_results: list[GenResult] = []
    inside: dict[str, list[int]] = {}  # label/kind -> [inside, known, cases]
    before_all = await candidate.spec_counters()
    extra_checks: list[Check] = []
    try:
        for label, eng in engines:
            for n, c in enumerate(cases):
                snap0 = await eng.spec_counters()
                r = await _one_stop(eng, c.prompt.ids, max_tokens, None, c.stop_id, rid=f"eos-{label}-{n}")
                snap1 = await eng.spec_counters()
                delta = counters_delta(snap0, snap1)
                gen = [(s or {}).get("generation_tokens") for s in (snap0, snap1)]
                counted = _counted(r, gen[0], gen[1]) if r.ok and r.output_ids is not None else []
                pcs.append(await _judge_stop(baseline, c, r, opts, label, counted))
                (results if label == "drafter" else oracle_results).append(r)
                tally = inside.setdefault(f"{label} {c.kind}", [0, 0, 0])
                tally[2] += 1
                got = stop_inside_run(r, c.stop_pos, delta) if r.ok else None
                if got is not None:
                    tally[1] += 1
                    tally[0] += bool(got)
        extra_checks += await _ignore_eos_cases(baseline, candidate, prompts, set(eos or ()), max_tokens, opts, pcs)
        if oracle is not None:  # the oracle's requests stay out of the candidate's speculation statistics
            for ck in (check_after_stop(oracle_results, eos), check_kv_idle(await health(oracle))):
                ck.name = f"oracle {ck.name}"
                extra_checks.append(ck)
    finally:
        if oracle is not None:
            await oracle.aclose()
    delta_all = counters_delta(before_all, await candidate.spec_counters())
    run = await finish_run("eos-in-run", candidate, baseline, pcs, results, delta_all, opts, t0, engine_k(candidate))
    run.require_spec = False
    run.checks += extra_checks
    if ignored:
        run.checks.append(Check("stop-token-ids", True, f"the baseline ignores stop_token_ids: {len(ignored)} stop-id "
                                f"case(s) not run ({ignored[0]})", skipped=True))
    n_inside = sum(v[0] for v in inside.values())
    tallies = "; ".join(f"{k}: {v[0]} of {v[2]} inside an accepted run" + (f" ({v[2] - v[1]} unknown)" if v[1] < v[2] else "")
                        for k, v in inside.items()) or "no case"
    run.notes.append(f"{len(cases)} stop case(s) ({sum(c.kind == 'eos' for c in cases)} EOS, "
                     f"{sum(c.kind == 'stop-id' for c in cases)} stop ids) on "
                     f"{' and '.join(lbl for lbl, _ in engines)}; {tallies}")
    run.evidence["stop_inside_run"] = {k: {"inside": v[0], "known": v[1], "cases": v[2]} for k, v in inside.items()}
    if not cases:
        run.cannot_test.append("a stop to test: no baseline output ended early at EOS and no stop id could be "
                               "picked from one")
    elif not n_inside:
        run.cannot_test.append("a stop inside an accepted run: no case put its stop inside one (" + tallies + ")")
    return run


IGNORE_EOS_PROMPTS = 4  # prompts searched for an EOS to run past with ignore_eos
IGNORE_EOS_SEARCH = 4  # ... within this many times the gate's max_tokens (at most 256 tokens)
IGNORE_EOS_PAST = 16  # ... and how far past it the ignore_eos requests run


async def _ignore_eos_cases(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                            eos: set[int], max_tokens: int, opts: GreedyGateOptions,
                            pcs: list[PromptCheck]) -> list[Check]:
    """ignore_eos under speculation: for each prompt whose greedy baseline ends at EOS within a search budget, the
    same request with ignore_eos, on both arms, to IGNORE_EOS_PAST tokens past that EOS: the candidate must run past
    it (inside an accepted run too) as the baseline does, judged at the first divergence by the regret rule. Without
    an EOS found, or with a baseline that stops at EOS anyway, a skipped check names it (not a CANNOT TEST of the
    whole gate, whose stop cases stand on their own)."""
    if not eos:
        return [Check("ignore-eos", True, "no EOS ids known", skipped=True)]
    budget = min(256, IGNORE_EOS_SEARCH * max_tokens)
    found: list[tuple[Prompt, int]] = []
    for p in prompts[:IGNORE_EOS_PROMPTS]:
        b = await baseline_for(baseline, p.ids, [], budget, 1)
        ids = list(b.output_ids or [])
        at = next((k for k, t in enumerate(ids) if t in eos), None)
        if b.ok and at is not None:
            found.append((p, at))
    if not found:
        return [Check("ignore-eos", True, f"no baseline output of {min(len(prompts), IGNORE_EOS_PROMPTS)} prompts "
                      f"ended at EOS within {budget} tokens", skipped=True)]

    def req(p: Prompt, n: int, rid: str, lp: int | None) -> GenRequest:
        return GenRequest(prompt=list(p.ids), max_tokens=n, temperature=0.0, logprobs=lp, rid=rid, ignore_eos=True,
                          prompt_cache=False)

    lens = [at + 1 + IGNORE_EOS_PAST for _, at in found]
    bases = await baseline.generate([req(p, n, f"ignore-eos-base-{k}", opts.top_k)
                                     for k, ((p, _), n) in enumerate(zip(found, lens, strict=True))], concurrency=1)
    honoured = [(p, at, n, b) for (p, at), n, b in zip(found, lens, bases, strict=True)
                if b.ok and len(b.output_ids or []) > at + 1]
    if not honoured:
        return [Check("ignore-eos", True, f"the baseline stops at EOS with ignore_eos ({len(found)} case(s) not "
                      "run)", skipped=True)]
    res = await candidate.generate([req(p, n, f"ignore-eos-{k}", None) for k, (p, _, n, _) in enumerate(honoured)],
                                   concurrency=1)
    for (p, at, n, b), r in zip(honoured, res, strict=True):
        pcs.append(judge_shaped(f"{p.pid}-ignore-eos@{at}", p, r, b, n, opts, lambda dist, before, i: dist,
                                "ignore_eos"))
    # (their results stay out of the gate's run checks: tokens after EOS are what they ask for)
    drafted = [r.drafted for r in res if r.ok]
    return [Check("ignore-eos", True, f"{len(honoured)} request(s) with ignore_eos run {IGNORE_EOS_PAST} tokens past "
                  f"the EOS their baseline ends at (positions {[at for _, at, _, _ in honoured]})"
                  + (f", draft tokens {drafted}" if drafted and all(d is not None for d in drafted) else ""))]
