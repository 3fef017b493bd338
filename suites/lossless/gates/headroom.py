"""The headroom gate: the drafter's block must fit under max_position_embeddings.

Contract: with a drafter the usable context is max_position_embeddings - block. A request whose prompt +
max_tokens lands exactly at the usable limit must be served (and lossless); one landing in
(max_pos - block, max_pos] must be refused with a clear error (not an engine crash), and the engine must keep
serving. Needs the model geometry: `geometry(adapter)` (common.py) reads it for local engines; without it the
gate is CANNOT TEST and sends no request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta

from ..checks import AcceptanceEvidence, Check
from ..greedy import GreedyGateOptions, check_output, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt
from .common import geometry


def _ids_of_len(seed: list[int], n: int) -> list[int]:
    reps = -(-n // max(1, len(seed)))
    return (seed * reps)[:n]


async def headroom(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                   max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    geo = geometry(candidate)
    if geo is None:
        why = ("the model geometry (max_position_embeddings and the usable context), which only a local engine "
               "gives: no request was sent")
        return GateRun("headroom", [], AcceptanceEvidence.not_measured(), [Check("headroom", True, why, skipped=True)],
                       time.perf_counter() - t0, require_spec=False, rule=opts.rule_dict(), cannot_test=[why])
    max_pos, usable = geo
    block = max_pos - usable
    m = min(4, max_tokens)
    seed = prompts[0].ids
    fit = Prompt("headroom-fit", _ids_of_len(seed, usable - m))
    before = await candidate.spec_counters()
    res_fit = (await candidate.generate([GenRequest(prompt=fit.ids, max_tokens=m, prompt_cache=False)],
                                        concurrency=1))[0]
    pc = await check_output(baseline, fit, res_fit, m, opts, candidate if opts.rescore else None)
    checks: list[Check] = []
    results: list[GenResult] = [res_fit]
    refused_lens = sorted({usable + 1, max_pos}) if block > 0 else [max_pos + 1]
    for total in refused_lens:
        req = GenRequest(prompt=_ids_of_len(seed, total - m), max_tokens=m, rid=f"headroom-{total}")
        r = (await candidate.generate([req], concurrency=1))[0]
        err = r.error or ""
        clean = not r.ok and bool(err) and "EngineFailure" not in err and "abort" not in err.lower()
        checks.append(Check(f"refused-at-{total}", clean,
                            f"prompt+max_tokens={total} (usable {usable}, max_pos {max_pos}): "
                            + (f"refused: {err[:160]}" if not r.ok else "ACCEPTED (should be refused)")))
    probe = (await candidate.generate([GenRequest(prompt=seed, max_tokens=m, rid="headroom-probe")],
                                      concurrency=1))[0]
    checks.append(Check("still-serving", probe.ok, "a normal request after the refusals "
                        + ("succeeded" if probe.ok else f"failed: {probe.error}")))
    results.append(probe)
    delta = counters_delta(before, await candidate.spec_counters())
    run = await finish_run("headroom", candidate, baseline, [pc], results, delta, opts, t0, engine_k(candidate))
    run.checks, run.require_spec = checks + run.checks, False
    run.notes.append(f"max_pos {max_pos}, drafter headroom {block}, usable {usable}; served {usable}, "
                     f"refused {refused_lens}")
    return run
