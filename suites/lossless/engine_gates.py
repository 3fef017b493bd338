"""Engine gates: scenarios that have broken real speculative engines, each judged by the greedy rule.

Contract: every gate takes (baseline, candidate, prompts, max_tokens, opts) and returns a `GateRun`
(greedy.py) whose verdict is FAIL when any request fails the regret rule or any run check fails.
- short_then_long: requests with max_tokens 3, 4, 2 run first, one at a time, then long ones. The first
  verify the engine ever sees is a truncated span (K = remaining - 1); a buffer or graph captured at that
  shape and replayed at the full 1 + K rows corrupts the long requests (capture shape == replay shape).
  Run it on a fresh engine: it is meant to see the first capture.
- headroom: with a drafter the usable context is max_position_embeddings - block. A request whose
  prompt + max_tokens lands exactly at the usable limit must be served (and lossless); one landing in
  (max_pos - block, max_pos] must be refused with a clear error (not an engine crash), and the engine
  must keep serving. Needs the model geometry: `geometry(adapter)` reads it for local engines.
- mixed: greedy requests beside logprobs requests in one batch. Logprobs requests cannot speculate on
  the reference engine; they must run beside the others without turning speculation off for them:
  every greedy neighbour must still draft, and every output stays lossless.
- stop_in_run: stop strings picked from the baseline's own text at several offsets, so that on an engine
  that accepts several drafts per step the stop often lands inside an accepted run. The candidate must
  end exactly where the baseline ends: same ids, same text, nothing emitted past the stop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta

from .checks import AcceptanceEvidence, Check
from .greedy import (
    Divergence,
    GateRun,
    GreedyGateOptions,
    Prompt,
    PromptCheck,
    baseline_for,
    check_output,
    engine_k,
    finish_run,
    position_dist,
    recover_dist,
    run_greedy,
)
from .regret import first_divergence, judge_pick


async def short_then_long(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                          max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    ps = list(prompts[:3]) or list(prompts)
    shorts = [3, 4, 2][: len(ps)]
    seq = [Prompt(f"{p.pid}-short{m}", p.ids, p.text) for p, m in zip(ps, shorts, strict=False)]
    seq += [Prompt(f"{p.pid}-long", p.ids, p.text) for p in ps[:2]]
    mts = shorts + [max_tokens] * len(ps[:2])
    run = await run_greedy(baseline, candidate, seq, max_tokens, opts, concurrency=1, name="short-then-long",
                           max_tokens_each=mts)
    run.require_spec = False
    run.notes.append(f"max_tokens in order: {mts}, one request at a time")
    return run


def geometry(adapter: EngineAdapter) -> tuple[int, int] | None:
    """(max_position_embeddings, usable context) of a local engine, else None."""
    d = adapter.describe() or {}
    cfg = d.get("config") if isinstance(d.get("config"), dict) else {}
    model, usable = d.get("model"), cfg.get("max_model_len")
    try:
        max_pos = json.loads((Path(str(model)) / "config.json").read_text())["max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (int(max_pos), int(usable)) if isinstance(usable, int) else None


def _ids_of_len(seed: list[int], n: int) -> list[int]:
    reps = -(-n // max(1, len(seed)))
    return (seed * reps)[:n]


async def headroom(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                   max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    geo = geometry(candidate)
    if geo is None:
        return GateRun("headroom", [], AcceptanceEvidence("none"),
                       [Check("headroom", True, "engine geometry unknown (not a local engine)", skipped=True)],
                       require_spec=False)
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


async def mixed(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    ps = list(prompts[:4])
    kinds = ["greedy" if i % 2 == 0 else "logprobs" for i in range(len(ps))]
    if len(ps) == 1:
        ps, kinds = ps * 2, ["greedy", "logprobs"]
    reqs = [GenRequest(prompt=p.ids, max_tokens=max_tokens, logprobs=5 if k == "logprobs" else None,
                       rid=f"mixed-{k}-{i}", prompt_cache=False) for i, (p, k) in enumerate(zip(ps, kinds, strict=True))]
    before = await candidate.spec_counters()
    res = await candidate.generate(reqs, concurrency=None)
    delta = counters_delta(before, await candidate.spec_counters())
    pcs = await asyncio.gather(*(check_output(baseline, Prompt(f"{p.pid}-{k}", p.ids), r, max_tokens, opts,
                                              candidate if opts.rescore else None)
                                 for p, k, r in zip(ps, kinds, res, strict=True)))
    greedy_res = [r for r, k in zip(res, kinds, strict=True) if k == "greedy" and r.ok]
    checks = []
    if greedy_res and all(r.spec is not None for r in greedy_res):
        idle = [r.rid for r in greedy_res if not (r.spec or {}).get("num_drafts")]
        checks.append(Check("neighbours-speculate", not idle,
                            f"greedy requests that never drafted: {idle}" if idle
                            else f"all {len(greedy_res)} greedy neighbours drafted"))
    elif delta is not None:
        n = delta.get("num_drafts") or 0
        checks.append(Check("neighbours-speculate", n > 0, f"{n} drafts during the mixed batch (counters)"))
    lp_res = [r for r, k in zip(res, kinds, strict=True) if k == "logprobs" and r.ok]
    short = [r.rid for r in lp_res if not r.logprobs or len(r.logprobs) != len(r.output_ids or [])]
    checks.append(Check("logprobs-returned", not short, f"missing logprobs: {short}" if short
                        else f"{len(lp_res)} logprobs requests returned one entry per token"))
    run = await finish_run("mixed", candidate, baseline, list(pcs), res, delta, opts, t0, engine_k(candidate))
    run.checks, run.require_spec = checks + run.checks, False
    run.notes.append(f"batch of {len(reqs)}: {kinds}")
    return run


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
            pc.reason = f"CANNOT TEST: the {side} reports no output token ids"
            continue
        if not r.ok or not b.ok:
            pc.status, pc.reason = "error", f"request failed: {r.error or b.error}"
            continue
        inside += _inside_run(r)
        cid, bid = list(r.output_ids), list(b.output_ids)
        pc.candidate_tokens = pc.tokens_compared = len(cid)
        i = first_divergence(cid, bid)
        if i is None:
            if r.text != b.text:
                pc.status, pc.reason = "fail", f"same tokens, different text: {r.text[-40:]!r} vs {b.text[-40:]!r}"
            continue
        if i >= len(bid):
            pc.divergences.append(Divergence(i, "past_stop", cid[i], None, 0))
            pc.status, pc.tokens_compared = "fail", i
            pc.reason = f"{len(cid) - len(bid)} token(s) emitted past the stop {s!r} (baseline ends at {len(bid)})"
        elif i >= len(cid):
            pc.divergences.append(Divergence(i, "early_stop", None, bid[i], 0))
            pc.status, pc.reason = "fail", f"the candidate stopped {len(bid) - len(cid)} token(s) before the baseline"
        else:
            dist = position_dist(b.logprobs, i)
            if not dist:
                dist, _, note = await recover_dist(baseline, list(p.ids) + cid[:i], cid[i], opts.top_k)
                if not dist:
                    pc.status, pc.missing, pc.reason = "untestable", "baseline logprobs at the divergence", note
                    continue
            j = judge_pick(cid[i], dist, opts.margin_tol)
            pc.divergences.append(Divergence(i, "token", cid[i], bid[i], 0, j))
            pc.status, pc.tokens_compared, pc.complete = ("flip" if j.ok else "fail"), i + 1, False
            pc.reason = "benign flip before the stop: the stop was not exercised" if j.ok else j.describe()
    run = await finish_run("stop-in-run", candidate, baseline, pcs, res, delta, opts, t0, engine_k(candidate))
    run.require_spec = False
    run.notes.append(f"{len(cases)} stop strings; {inside} landed inside an accepted run")
    return run


GATES = {"short-then-long": short_then_long, "headroom": headroom, "mixed": mixed, "stop-in-run": stop_in_run}
