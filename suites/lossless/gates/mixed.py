"""The mixed gate: greedy requests beside logprobs requests in one batch.

Contract: the logprobs requests must not turn speculation off for their neighbours (every greedy neighbour
must still draft; a batch in which none drafted is CANNOT TEST, naming it), every output stays lossless, and
the logprobs they return must be the baseline's over the common prefix (logprobs parity,
checks.logprob_parity: the chosen token's, the top-k's values and membership, within the gate's tolerance:
exact in fp32, the bf16 margin on a few positions at most). Whether the logprobs requests themselves
speculated is reported (the bundled engine speculates them, SpecConfig.logprobs; an engine that runs them
unspeculated has its parity checked on that path, and the check says so).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta

from ..checks import Check, check_logprob_parity, logprob_parity
from ..greedy import GreedyGateOptions, baseline_for, check_output, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt

MIXED_LOGPROBS = 5  # top-k logprobs the mixed gate's logprobs requests ask for
MIXED_TOP_K = 20  # ... and its baselines (at least the gate's top_k): every candidate top-k entry finds its value


async def mixed(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    ps = list(prompts[:4])
    kinds = ["greedy" if i % 2 == 0 else "logprobs" for i in range(len(ps))]
    if len(ps) == 1:
        ps, kinds = ps * 2, ["greedy", "logprobs"]
    reqs = [GenRequest(prompt=p.ids, max_tokens=max_tokens, logprobs=MIXED_LOGPROBS if k == "logprobs" else None,
                       rid=f"mixed-{k}-{i}", prompt_cache=False) for i, (p, k) in enumerate(zip(ps, kinds, strict=True))]
    before = await candidate.spec_counters()
    res = await candidate.generate(reqs, concurrency=None)
    delta = counters_delta(before, await candidate.spec_counters())
    bases = await asyncio.gather(*(baseline_for(baseline, p.ids, [], max_tokens, max(opts.top_k, MIXED_TOP_K))
                                   for p in ps))
    pcs = await asyncio.gather(*(check_output(baseline, Prompt(f"{p.pid}-{k}", p.ids), r, max_tokens, opts,
                                              candidate if opts.rescore else None, first_base=b)
                                 for p, k, r, b in zip(ps, kinds, res, bases, strict=True)))
    greedy_res = [r for r, k in zip(res, kinds, strict=True) if k == "greedy" and r.ok]
    # The gate's evidence is speculation in a batch that mixes greedy and logprobs requests. Where none of it
    # drafted (a load gate that holds every batch to one token, an engine that turns speculation off beside a
    # logprobs request) the batch was never speculated: CANNOT TEST, naming it, not a losslessness FAIL.
    checks, idle_batch = [], None
    if greedy_res and all(r.drafted is not None for r in greedy_res):
        idle = [r.rid for r in greedy_res if not r.drafted]
        if len(idle) == len(greedy_res):
            idle_batch = f"greedy neighbours that never drafted: {idle}"
        else:
            checks.append(Check("neighbours-speculate", True, f"{len(greedy_res) - len(idle)} of {len(greedy_res)} "
                                "greedy neighbours drafted" + (f" (not: {idle})" if idle else "")))
    elif delta is not None:
        n = delta.get("num_drafts") or 0
        if n:
            checks.append(Check("neighbours-speculate", True, f"{n} drafts during the mixed batch (counters)"))
        else:
            idle_batch = "no draft during the mixed batch (counters)"
    lp = [(r, b) for r, b, k in zip(res, bases, kinds, strict=True) if k == "logprobs" and r.ok]
    # without output tokens there is nothing to count the entries against (no ids, or no token at all: an endpoint
    # that returned nothing owes no logprobs, and a FAIL needs evidence as a PASS does)
    counted = [r for r, _ in lp if r.output_ids]
    short = [r.rid for r in counted if not r.logprobs or len(r.logprobs) != len(r.output_ids or [])]
    checks.append(Check("logprobs-returned", not short, f"missing logprobs: {short}" if short
                        else f"{len(counted)} logprobs requests returned one entry per token") if counted or not lp
                  else Check("logprobs-returned", True, "no output token to count the logprobs entries against "
                             f"({len(lp)} logprobs requests returned no ids or no token)", skipped=True))
    checks += logprobs_checks(lp, opts)
    run = await finish_run("mixed", candidate, baseline, list(pcs), res, delta, opts, t0, engine_k(candidate))
    run.checks, run.require_spec = checks + run.checks, False
    if idle_batch:
        run.cannot_test.append(f"speculation in the mixed batch: {idle_batch}")
    run.notes.append(f"batch of {len(reqs)}: {kinds}")
    return run


def logprobs_checks(pairs: Sequence[tuple[GenResult, GenResult]], opts: GreedyGateOptions) -> list[Check]:
    """The mixed gate's logprobs requests (candidate result, the baseline's first generation): their logprobs
    against the baseline's over the common prefix (checks.logprob_parity, at the gate's rule), and whether they
    speculated, so a parity PASS says which path it covered: a logprobs request that never drafted tested the
    one-token path alone (skipped, not passed)."""
    if not pairs:
        return []
    tol, strict = opts.tol, opts.rule == "strict"
    each = [(r.rid, logprob_parity(r, b, MIXED_LOGPROBS, tol)) for r, b in pairs]
    parity = check_logprob_parity(each, tol, strict)
    missing = sum(p.missing for _, p in each)
    drafted = [r.drafted for r, _ in pairs]
    if any(d is None for d in drafted):
        spec = Check("logprobs-speculate", True, "the candidate reports no per-request drafts: whether its "
                     "logprobs requests speculated is unknown", skipped=True)
    elif not any(drafted):
        spec = Check("logprobs-speculate", True, f"none of {len(pairs)} logprobs requests drafted: the parity "
                     "above covers the non-speculative path only (the engine runs logprobs requests unspeculated)",
                     skipped=True)
    else:
        covered = "the parity covers speculated runs" if not missing else \
            f"but {missing} positions came back without a logprob (llama.cpp leaves a verify step's tokens without " \
            "one): the parity covers the positions reported"
        spec = Check("logprobs-speculate", True, f"{sum(1 for d in drafted if d)} of {len(pairs)} logprobs requests "
                     f"drafted ({sum(d or 0 for d in drafted)} draft tokens); {covered}")
    return [parity, spec]
