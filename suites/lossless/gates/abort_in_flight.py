"""The abort-in-flight gate: clients that go away mid-generation.

Contract: survivors run beside ABORT_VICTIMS long victims (ABORT_LONG x max_tokens, ignore_eos), and the
victims are cancelled one by one while the survivors decode (the local adapter aborts a cancelled request in
the engine; an endpoint sees the connection close). The survivors must stay lossless, the engine must hold no
page once idle (kv-leak; the abort_keeps_pages fault), and a request sent afterwards must be lossless too.
Cancel times are spread over how long the survivors took alone (timed first); an abort counts as in flight
when the victim had not finished and a survivor had its first token but not its last. A round without one is
run again (at most ABORT_ATTEMPTS), its cancels aimed at the decode window the last round observed. CANNOT
TEST when none did.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta

from ..checks import Check
from ..greedy import GreedyGateOptions, check_output, engine_k, finish_run, prompt_request, resolve_rule
from ..outcomes import GateRun, Prompt

ABORT_VICTIMS = 3  # requests the abort-in-flight gate cancels mid-generation
ABORT_LONG = 4  # ... each asked for this many times the gate's max_tokens (ignore_eos), so it is still running
ABORT_ATTEMPTS = 3  # rounds, each aimed at the decode window the last one observed, until a cancel lands in it


async def abort_in_flight(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                          max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """The gate (module docstring)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    ps = list(prompts[:4])
    survivors, victims = ps[:2], [ps[(2 + i) % len(ps)] for i in range(ABORT_VICTIMS)]
    probe = await candidate.generate([prompt_request(p, max_tokens, rid=f"abort-probe-{i}")
                                      for i, p in enumerate(survivors)], concurrency=None)
    span = max((r.t_end - r.t_send for r in probe if r.ok and r.t_end), default=1.0)
    sreqs = [prompt_request(p, max_tokens, rid=f"abort-survivor-{i}") for i, p in enumerate(survivors)]
    vreqs = [GenRequest(prompt=list(p.ids), max_tokens=ABORT_LONG * max_tokens, temperature=0.0, ignore_eos=True,
                        rid=f"abort-victim-{i}", prompt_cache=False) for i, p in enumerate(victims)]
    before = await candidate.spec_counters()
    window = (span * 0.25, span * 0.75)  # where the cancels go, in seconds after the start
    for attempt in range(ABORT_ATTEMPTS):
        res, cuts, start = await _abort_round(candidate, sreqs, vreqs, window, attempt)
        live = [(r.t_first - start, r.t_end - start) for r in res if r.ok and r.t_first and r.t_end]
        inflight = sum(1 for t, done in cuts if not done and any(a <= t <= b for a, b in live))
        if inflight or not live:
            break
        # no cancel landed while a survivor decoded: aim the next round at the window this one observed
        window = (min(a for a, _ in live), max(b for _, b in live))
    after = (await candidate.generate([prompt_request(ps[-1], max_tokens, rid="abort-after")]))[0]
    delta = counters_delta(before, await candidate.spec_counters())
    pcs = await asyncio.gather(*(check_output(baseline, Prompt(f"{p.pid}-survivor", p.ids), r, max_tokens, opts,
                                              candidate if opts.rescore else None)
                                 for p, r in zip([*survivors, ps[-1]], [*res, after], strict=True)))
    pcs[-1].pid = f"{ps[-1].pid}-after-aborts"
    run = await finish_run("abort-in-flight", candidate, baseline, list(pcs), [*res, after], delta, opts, t0,
                           engine_k(candidate))
    run.checks.insert(0, Check("aborted-in-flight", True, f"{inflight} of {len(cuts)} victims cancelled "
                               "while a survivor was decoding (the rest: before its first token, after its last, or "
                               "finished)", skipped=not inflight))
    if not inflight:
        run.cannot_test.append("an abort while the survivors decoded: every cancel landed outside their decoding "
                               f"(survivors alone took {span:.3f} s)")
    run.notes.append(f"{len(survivors)} survivors of max_tokens {max_tokens} beside {len(victims)} victims of "
                     f"{ABORT_LONG * max_tokens}, cancelled at {', '.join(f'{t:.3f}' for t, _ in cuts)} s "
                     f"(survivors alone: {span:.3f} s; round {attempt + 1} of at most {ABORT_ATTEMPTS})")
    return run


async def _abort_round(candidate: EngineAdapter, sreqs: list[GenRequest], vreqs: list[GenRequest],
                       window: tuple[float, float], attempt: int) -> tuple[list[GenResult], list[tuple[float, bool]],
                                                                           float]:
    """One round of the abort-in-flight gate: survivors and victims sent together, victim i cancelled at the
    (i + 1) / (n + 1) point of `window` (seconds after the start). Returns the survivors' results, per victim
    (cancel time after the start, whether it had finished by then), and the start (perf_counter)."""
    tag = f"-r{attempt}" if attempt else ""
    sreqs = [replace(r, rid=f"{r.rid}{tag}") for r in sreqs]
    vreqs = [replace(r, rid=f"{r.rid}{tag}") for r in vreqs]
    start = time.perf_counter()
    stasks = [asyncio.ensure_future(candidate.generate_one(r)) for r in sreqs]
    vtasks = [asyncio.ensure_future(candidate.generate_one(r)) for r in vreqs]
    cuts: list[tuple[float, bool]] = []
    lo, hi = window
    for i, t in enumerate(vtasks):
        await asyncio.sleep(max(0.0, start + lo + (hi - lo) * (i + 1) / (len(vtasks) + 1) - time.perf_counter()))
        cuts.append((time.perf_counter() - start, t.done()))
        t.cancel()
    res = list(await asyncio.gather(*stasks))
    await asyncio.gather(*vtasks, return_exceptions=True)
    return res, cuts, start
