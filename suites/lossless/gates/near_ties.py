"""The near-ties gate (issue 47, item 2): an adversarial drafter that proposes the target's runner-up exactly where
the target's top two are closest.

Contract: an accept rule that differs from "the draft equals the target's argmax" only at near-ties (a draft
accepted within some margin of the best logit) changes no output unless a drafter proposes the runner-up at a
near-tie, which real drafters rarely do. This gate makes one that does:
- the baseline generates every prompt greedily for `SCAN_TOKENS` tokens with its top-k logprobs; per prompt, the
  drafted position j (not 0, the prefill's token, and not a multiple of K + 1, where an oracle whose drafts are all
  accepted places its bonus tokens) whose top-two logprob gap is the smallest is planted;
- an oracle engine like the candidate (the adapter capability "oracle_drafts": a fresh engine from the candidate's
  config, its faults and accept rule kept, whose drafts replay a given continuation) is given the baseline's
  output with the runner-up at j, every prompt at once, `j + 2` tokens each. A correct verify rejects the
  runner-up and emits the baseline's own token;
- each output is judged by the regret rule under the suite's tolerance: the runner-up accepted at j where the
  gap exceeds the tolerance FAILs with the position and the margin; one within it is a benign flip. Where the
  engine reports its steps (`spec.step_at`, `spec.step_drafts`) and none covered j (a lever that trims the
  drafts moves the bonus positions), that case is untestable: the runner-up was never verified.
The notes give the smallest margin the gate tested (a rule that accepts within a smaller margin cannot be seen on
these prompts: more prompts and tokens find nearer ties). No baseline logprobs, or no capability (an endpoint):
CANNOT TEST (advisory by default).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specbench.harness.adapters.base import ORACLE_DRAFTS, EngineAdapter, GenRequest

from ..checks import AcceptanceEvidence, Check, acceptance_evidence
from ..greedy import GreedyGateOptions, engine_k, position_dist, resolve_rule
from ..outcomes import Divergence, GateRun, Prompt, PromptCheck
from ..regret import first_divergence, judge_pick

SCAN_TOKENS = 128  # the baseline tokens scanned per prompt for its nearest tie
ORACLE_K = 4  # the oracle's K where the candidate does not speculate (LocalAdapter.with_oracle_drafts)


def _cannot(why: str, opts: GreedyGateOptions, t0: float) -> GateRun:
    return GateRun("near-ties", [], AcceptanceEvidence.not_measured(), [Check("near-ties", True, why, skipped=True)],
                   time.perf_counter() - t0, require_spec=False, rule=opts.rule_dict(), cannot_test=[why])


def nearest_tie(dists: Sequence[dict[int, float]], k: int) -> tuple[int, int, float] | None:
    """(position, runner-up, gap) of the smallest top-two gap at a drafted position, else None."""
    best: tuple[int, int, float] | None = None
    for i, d in enumerate(dists):
        if i == 0 or i % (k + 1) == 0 or len(d) < 2:
            continue
        (t1, l1), (t2, l2) = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:2]
        if best is None or l1 - l2 < best[2]:
            best = (i, t2, l1 - l2)
    return best


async def near_ties(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt], max_tokens: int,
                    opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    if ORACLE_DRAFTS not in candidate.capabilities:
        return _cannot("the adapter capability \"oracle_drafts\" (a local engine whose drafts replay a given "
                       "continuation): no request was sent", opts, t0)
    k = engine_k(candidate) or ORACLE_K
    scan = await baseline.generate([GenRequest(prompt=list(p.ids), max_tokens=SCAN_TOKENS, temperature=0.0,
                                               logprobs=opts.top_k, rid=f"ties-scan-{p.pid}", prompt_cache=False)
                                    for p in prompts], concurrency=1)
    cases = []
    for p, b in zip(prompts, scan, strict=True):
        ids = list(b.output_ids or [])
        dists = [position_dist(b.logprobs, i) for i in range(len(ids))]
        tie = nearest_tie(dists, k)
        if b.ok and ids and tie is not None:
            j, runner, gap = tie
            cases.append((p, ids, dists, j, runner, gap))
    if not cases:
        return _cannot("the baseline's top-k logprobs at a drafted position (the runner-up to plant): none of "
                       f"{len(prompts)} baseline outputs had them", opts, t0)
    conts = {tuple(p.ids): ids[:j] + [runner] + ids[j + 1:] for p, ids, _, j, runner, _ in cases}
    oracle = candidate.with_oracle_drafts(conts, name=f"{candidate.name}[near-ties]")
    try:
        results = await oracle.generate([GenRequest(prompt=list(p.ids), max_tokens=j + 2, temperature=0.0,
                                                    rid=f"ties-{p.pid}", prompt_cache=False)
                                         for p, _, _, j, _, _ in cases], concurrency=len(cases))
    finally:
        await oracle.aclose()
    out = GateRun("near-ties", [], AcceptanceEvidence.not_measured(), require_spec=False, rule=opts.rule_dict())
    accepted = covered = 0
    for (p, ids, dists, j, runner, gap), r in zip(cases, results, strict=True):
        pc = PromptCheck(f"near-tie: {p.pid}", len(p.ids), j + 2, candidate_tokens=len(r.output_ids or []),
                         spec={"position": j, "runner_up": runner, "gap": gap})
        cid = list(r.output_ids or [])
        want = ids[:j + 2]
        i = first_divergence(cid, want) if r.ok else None
        sp = r.spec or {}
        at, dr = sp.get("step_at"), sp.get("step_drafts")
        verified = (None if not isinstance(at, list) or not isinstance(dr, list)
                    else any(a <= j < a + n for a, n in zip(at, dr, strict=False)))
        covered += verified is True
        if not r.ok:
            pc.status, pc.missing, pc.reason = "untestable", "output", r.error or "the oracle request failed"
        elif verified is False and (i is None or i > j):
            pc.status, pc.missing = "untestable", "the planted runner-up verified"
            pc.reason = f"no verify step covered position {j} (steps at {at}, drafts {dr}): the runner-up was never tested"
        elif i is None or i >= min(len(cid), len(want)):
            pc.tokens_compared = min(len(cid), len(want))
            if len(cid) < min(len(want), j + 1):
                pc.status, pc.reason = "fail", f"ended after {len(cid)} tokens, before the planted position {j}"
        else:
            jd = judge_pick(cid[i], dists[i], opts.tol)
            accepted += i == j and cid[i] == runner
            pc.divergences.append(Divergence(i, "token", cid[i], want[i], 0, jd))
            pc.status, pc.tokens_compared, pc.complete = ("flip" if jd.ok else "fail"), i + 1, False
            what = (f"accepted the planted runner-up {runner} at position {j} (top-two gap {gap:.3g} nat)"
                    if i == j and cid[i] == runner else f"diverged at {i}, before the planted position {j}")
            pc.reason = f"{what}: {jd.describe()}"
        out.prompts.append(pc)
    gaps = sorted(c[5] for c in cases)
    out.notes.append(f"{len(cases)} runner-ups planted at each prompt's nearest tie in {SCAN_TOKENS} baseline tokens "
                     f"(K {k}); smallest margin tested {gaps[0]:.3g} nat, median {gaps[len(gaps) // 2]:.3g}; "
                     f"{covered} seen verified in the engine's reported steps; {accepted} accepted")
    out.evidence = {"planted": len(cases), "min_gap": gaps[0], "accepted": accepted, "k": k, "verified": covered}
    out.stats = acceptance_evidence(results, None, opts.min_accept_len)  # the oracle's: shown, not judged
    out.results = list(results)
    out.wall_s = time.perf_counter() - t0
    return out
