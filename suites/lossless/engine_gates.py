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
- mixed: greedy requests beside logprobs requests in one batch. The logprobs requests must not turn
  speculation off for their neighbours (every greedy neighbour must still draft), every output stays
  lossless, and the logprobs they return must be the baseline's over the common prefix (logprobs parity,
  checks.logprob_parity: the chosen token's, the top-k's values and membership, within the gate's
  tolerance: exact in fp32, the bf16 margin on a few positions at most). Whether the logprobs requests
  themselves speculated is reported (the bundled engine speculates them, SpecConfig.logprobs; an engine
  that runs them unspeculated has its parity checked on that path, and the check says so).
- stop_in_run: stop strings picked from the baseline's own text at several offsets, so that on an engine
  that accepts several drafts per step the stop often lands inside an accepted run. The candidate must
  end exactly where the baseline ends: same ids, same text, nothing emitted past the stop.
- eos_in_run: EOS and `stop_token_ids` inside an accepted run. Cases: every prompt whose baseline output
  ends early at EOS, and stop token ids picked from the baseline's own output (first occurrences near 30% /
  60% of it). They run one request at a time on the candidate (its own drafter) and, where the adapter offers
  "oracle_drafts", on an oracle engine like the candidate (faults kept) whose drafts replay the baseline's
  continuations, so every step accepts K drafts and almost every stop lands inside the run. Per case the
  candidate must return exactly the baseline's ids (ending at the stop) and count exactly those: usage
  completion_tokens, the streamed chunk tokens and the engine's generation-token counter (where exposed)
  equal the returned ids. A stop lands "inside an accepted run" when the step that emitted it had accepted
  drafts past it (per-step accepted runs where the engine reports them; else, from the request's counter
  delta, fewer tokens returned than 1 + drafts + accepted). CANNOT TEST when no case put its stop inside an
  accepted run (the count is in the notes); stop-id cases whose baseline ignores stop_token_ids are dropped
  (a skipped check says so).
Every gate applies the tolerance `greedy.resolve_rule` decides (strict in fp32, else the margin).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from specbench.harness.adapters.base import (
    ORACLE_DRAFTS,
    EngineAdapter,
    GenRequest,
    GenResult,
    counters_delta,
)
from specbench.harness.verdicts import CANNOT_TEST

from .checks import (
    AcceptanceEvidence,
    Check,
    check_after_stop,
    check_kv_idle,
    check_logprob_parity,
    count_problems,
    eos_ids_of,
    logprob_parity,
)
from .greedy import (
    Divergence,
    GateRun,
    GreedyGateOptions,
    Prompt,
    PromptCheck,
    baseline_for,
    cannot_compare,
    check_output,
    engine_k,
    finish_run,
    health,
    position_dist,
    prompt_request,
    recover_dist,
    resolve_rule,
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


LONG_LENGTHS = (768, 1536)  # the long-context gate's prompt lengths (tokens), each cut to what the engine serves


def long_prompt(pieces: Sequence[Sequence[int]], tail: Sequence[int], n: int) -> list[int]:
    """A prompt of at most n tokens (at least the tail): whole pieces (a prompt and the baseline's answer to it: a
    few-shot transcript), cycled while they fit, then `tail` (an echo prompt: the first prompt, its answer, the
    prompt again), so the continuation repeats an answer the drafter can follow and accepted runs reach the long
    positions. Cut pieces were tried and dropped: a context that ends mid-sentence left the tiny pair's drafter
    unaccepted at 768 and 1,536 tokens (mean accepted length 1.02-1.03), whole ones gave 5.7-7.0."""
    out: list[int] = []
    for piece in itertools.cycle([list(x) for x in pieces if x] or [list(tail)]):
        if len(out) + len(piece) + len(tail) > n:
            break
        out += piece
    return out + list(tail)


async def long_context(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                       max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """Greedy requests at long contexts (LONG_LENGTHS, each cut to the local engine's usable context less the
    output), sent together to the candidate, each judged against the baseline alone by the regret rule: a verify
    or draft path wrong only past some position (a position, RoPE or page-table limit, an attention kernel's split
    at long rows) that the data set's prompts of a few hundred tokens never reach. An endpoint that refuses a
    length makes that case CANNOT TEST (named), never a FAIL."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    geo = geometry(candidate)
    cap = geo[1] - max_tokens - 1 if geo is not None else None
    answers = await asyncio.gather(*(baseline_for(baseline, p.ids, [], max_tokens, opts.top_k) for p in prompts))
    tail = echo_prompts(prompts[:1], answers[:1])[0].ids
    pieces = [list(p.ids) + list(a.output_ids or []) for p, a in zip(prompts[1:], answers[1:], strict=True)]
    longest = max(len(p.ids) for p in prompts)
    built = {len(x): x for x in (long_prompt(pieces, tail, min(n, cap) if cap is not None else n)
                                 for n in LONG_LENGTHS)}
    ps = [Prompt(f"long-{n}", ids) for n, ids in sorted(built.items()) if n > max(longest, len(tail))]
    if not ps:
        why = (f"a long prompt: the engine's usable context ({geo[1] if geo else '?'}) leaves no prompt longer than the "
               f"others ({max(longest, len(tail))} tokens)")
        return GateRun("long-context", [], AcceptanceEvidence.not_measured(), [Check("long-context", True, why,
                                                                                      skipped=True)],
                       time.perf_counter() - t0, require_spec=False, rule=opts.rule_dict(), cannot_test=[why])
    lengths = [len(p.ids) for p in ps]
    reqs = [GenRequest(prompt=p.ids, max_tokens=max_tokens, temperature=0.0, rid=f"long-context-{p.pid}",
                       prompt_cache=False) for p in ps]
    before = await candidate.spec_counters()
    res = await candidate.generate(reqs, concurrency=None)
    delta = counters_delta(before, await candidate.spec_counters())
    pcs: list[PromptCheck] = []
    for p, r in zip(ps, res, strict=True):
        if not r.ok and r.error and any(w in r.error.lower() for w in ("context", "length", "too long", "exceed")):
            pcs.append(untestable(p.pid, p, r, max_tokens, f"a context of {len(p.ids)} + {max_tokens} tokens "
                                  f"(refused: {r.error[:120]})"))
            continue
        pcs.append(await check_output(baseline, p, r, max_tokens, opts, candidate if opts.rescore else None))
    run = await finish_run("long-context", candidate, baseline, pcs, res, delta, opts, t0, engine_k(candidate))
    drafted = [r.drafted for r in res if r.ok]
    run.notes.append(f"prompts of {lengths} tokens (+ {max_tokens} out), together on the candidate"
                     + (f"; draft tokens per request {drafted}" if all(d is not None for d in drafted) else ""))
    return run


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


async def _judge_stop_divergence(pc: PromptCheck, i: int, cid: list[int], bid: list[int], baseline: EngineAdapter,
                                 p: Prompt, b: GenResult, opts: GreedyGateOptions, what: str, past: str) -> None:
    """Judge a stop gate's first divergence `i` of candidate ids `cid` from baseline ids `bid` into `pc`:
    tokens past the baseline's stop (`past` says where), an early stop, or a token judged by the regret rule
    at the divergence (a benign flip before the `what` leaves the stop unexercised)."""
    if i >= len(bid):
        pc.divergences.append(Divergence(i, "past_stop", cid[i], None, 0))
        pc.status, pc.tokens_compared = "fail", i
        pc.reason = f"{len(cid) - len(bid)} token(s) {past}"
    elif i >= len(cid):
        pc.divergences.append(Divergence(i, "early_stop", None, bid[i], 0))
        pc.status, pc.reason = "fail", f"the candidate stopped {len(bid) - len(cid)} token(s) before the baseline"
    else:
        dist = position_dist(b.logprobs, i)
        if not dist:
            dist, _, note = await recover_dist(baseline, list(p.ids) + cid[:i], cid[i], opts.top_k)
            if not dist:
                pc.status, pc.missing, pc.reason = "untestable", "baseline logprobs at the divergence", note
                return
        j = judge_pick(cid[i], dist, opts.tol)
        pc.divergences.append(Divergence(i, "token", cid[i], bid[i], 0, j))
        pc.status, pc.tokens_compared, pc.complete = ("flip" if j.ok else "fail"), i + 1, False
        pc.reason = f"benign flip before the {what}: the stop was not exercised" if j.ok else j.describe()


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
        cid, bid = list(r.output_ids), list(b.output_ids)
        pc.candidate_tokens = pc.tokens_compared = len(cid)
        i = first_divergence(cid, bid)
        if i is None:
            if r.text != b.text:
                pc.status, pc.reason = "fail", f"same tokens, different text: {r.text[-40:]!r} vs {b.text[-40:]!r}"
            continue
        await _judge_stop_divergence(pc, i, cid, bid, baseline, p, b, opts, "stop",
                                     f"emitted past the stop {s!r} (baseline ends at {len(bid)})")
    run = await finish_run("stop-in-run", candidate, baseline, pcs, res, delta, opts, t0, engine_k(candidate))
    run.require_spec = False
    run.notes.append(f"{len(cases)} stop strings; {inside} landed inside an accepted run")
    if not cases:
        run.cannot_test.append(f"a stop string to test: no baseline output of {len(prompts[:3])} prompts had text to "
                               "pick one from")
    return run


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


def stop_inside_run(res: GenResult, stop_pos: int, delta: dict | None) -> bool | None:
    """Did the stop at output position `stop_pos` land inside an accepted run (drafts accepted past it in the
    step that emitted it)? From the per-step accepted runs and chunks where the engine reports them (one chunk
    per step: the prefill's first token, then one per verify step), else from the request's counter delta (the
    run was cut short: fewer tokens than 1 + drafts + accepted); None when neither is known."""
    ids = res.output_ids or []
    runs = (res.spec or {}).get("accepted_runs")
    if runs is not None and res.chunk_tokens and sum(res.chunk_tokens) == len(ids) and stop_pos < len(ids):
        start = 0
        for c, n in enumerate(res.chunk_tokens):
            if start <= stop_pos < start + n:
                j = c - 1  # chunk 0 is the prefill's token
                return 0 <= j < len(runs) and stop_pos - start < runs[j]
            start += n
        return False
    if delta and delta.get("num_drafts") is not None and delta.get("num_accepted_tokens") is not None:
        return len(ids) < 1 + int(delta["num_drafts"]) + int(delta["num_accepted_tokens"])
    return None


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
    await _judge_stop_divergence(pc, i, cid, bid, baseline, p, b, opts, what,
                                 f"returned past the {what} at position {c.stop_pos}")
    return pc


async def eos_in_run(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                     max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    eos = eos_ids_of(candidate.describe()) or eos_ids_of(baseline.describe())
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


# The penalties gate's (frequency, presence) settings, each on every prompt: presence and frequency together,
# and frequency alone at twice the weight. Strong penalties (1.5 / 1.0) were tried and dropped: the drafter, which
# knows nothing of them, is then hardly ever accepted, and a verify row that counts the wrong history is never
# reached (measured on the tiny pair: 0 of 6 outputs moved by verify_penalty_history_stale, 2 of 6 at these).
PEN_SETTINGS = ((0.5, 0.2), (1.0, 0.0))
PEN_PROMPTS = 4  # prompts (each also as an echo prompt) at each setting


async def penalties(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                    max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """Greedy requests with presence and frequency penalties (OpenAI's, over the output so far): under
    speculation a verify row must be penalized like a decode step, its count holding the drafts before it; an
    engine that forgets penalties on the verify path (the verify_ignores_penalties fault) picks other tokens.
    Up to PEN_PROMPTS prompts as given
    and as echo prompts (prompt + the baseline's greedy answer + the prompt again: the answer comes back, drafts
    are accepted, the penalties bite), at each of PEN_SETTINGS, all at once on the candidate, each one at a time on
    the baseline with the same penalties and logprobs. Judged at the first divergence: the penalized score of a token is its
    baseline logprob minus the penalties its count in the common prefix earns (shift-invariant, so exact from
    the reported logprobs), and the pick's regret under it decides (the gate's tolerance). A benign flip ends
    the comparison: a re-anchored baseline would count the prefix as prompt, not output. Repetition penalties
    are not judged here (not shift-invariant: the reported logprobs cannot give the penalized scores)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    ps = list(prompts[:PEN_PROMPTS])
    firsts = await asyncio.gather(*(baseline_for(baseline, p.ids, [], max_tokens, opts.top_k) for p in ps))
    ps += echo_prompts(ps, firsts)

    def req(p: Prompt, rid: str, lp: int | None, pen: tuple[float, float]) -> GenRequest:
        return GenRequest(prompt=list(p.ids), max_tokens=max_tokens, temperature=0.0, logprobs=lp, rid=rid,
                          frequency_penalty=pen[0], presence_penalty=pen[1], prompt_cache=False)

    cases = [(p, i, pen) for i, pen in enumerate(PEN_SETTINGS) for p in ps]
    before = await candidate.spec_counters()
    res = await candidate.generate([req(p, f"penalties-{p.pid}-p{i}", None, pen) for p, i, pen in cases],
                                   concurrency=None)
    delta = counters_delta(before, await candidate.spec_counters())
    bases = await baseline.generate([req(p, f"penalties-base-{p.pid}-p{i}", opts.top_k, pen) for p, i, pen in cases],
                                    concurrency=1)
    pcs = [judge_penalized(p, r, b, max_tokens, opts, pen, f"p{i}")
           for (p, i, pen), r, b in zip(cases, res, bases, strict=True)]
    run = await finish_run("penalties", candidate, baseline, pcs, res, delta, opts, t0, engine_k(candidate))
    run.notes.append("(frequency_penalty, presence_penalty) " + ", ".join(f"p{i} {pen}" for i, pen in
                                                                          enumerate(PEN_SETTINGS))
                     + f"; {len(cases)} requests ({len(ps)} prompts, half of them echo prompts, at each setting)")
    return run


def judge_penalized(p: Prompt, cand: GenResult, base: GenResult, max_tokens: int, opts: GreedyGateOptions,
                    pen: tuple[float, float] = PEN_SETTINGS[0], tag: str = "") -> PromptCheck:
    """One penalized greedy output (pen: frequency, presence) against its baseline, up to and including the first
    divergence (`penalties`)."""
    freq, pres = pen

    def score(dist: dict[int, float], before: list[int], i: int) -> dict[int, float]:
        counts: dict[int, int] = {}
        for t in before:
            counts[t] = counts.get(t, 0) + 1
        return {t: lp - freq * counts.get(t, 0) - pres * (t in counts) for t, lp in dist.items()}

    return judge_shaped(f"{p.pid}-penalized" + (f"-{tag}" if tag else ""), p, cand, base, max_tokens, opts, score,
                        "penalized")


MASKED = -1e4  # a masked token's score in a shaped judge (min_tokens): any pick of it fails by this much


def judge_shaped(pid: str, p: Prompt, cand: GenResult, base: GenResult, max_tokens: int, opts: GreedyGateOptions,
                 score: Callable[[dict[int, float], list[int], int], dict[int, float]], label: str) -> PromptCheck:
    """A greedy output of shaped logits (penalties, a logit bias, min_tokens) against its baseline, up to and including
    the first divergence. `score(dist, prefix, i)`: the shaped score of each token of the baseline's reported
    distribution at position i after the common prefix; shaping is a per-row shift of the logprobs where the
    processors are additive, so the pick's regret under it is exact from the reported logprobs. A benign flip ends
    the comparison (a re-anchored baseline would count the prefix as prompt, not output); a length difference
    fails (early or past the baseline's stop)."""
    pc = PromptCheck(pid, len(p.ids), max_tokens, spec=cand.spec)
    if cannot_compare(pc, (("candidate", cand), ("baseline", base))):
        return pc
    c, b = list(cand.output_ids or []), list(base.output_ids or [])
    pc.candidate_tokens = len(c)
    i = first_divergence(c, b)
    if i is None:
        pc.tokens_compared = len(c)
        return pc
    pc.tokens_compared = i
    if i >= len(b) or i >= len(c):
        kind = "past_stop" if i >= len(b) else "early_stop"
        pc.divergences.append(Divergence(i, kind, c[i] if i < len(c) else None, b[i] if i < len(b) else None, 0))
        pc.status, pc.reason = "fail", pc.divergences[-1].describe()
        return pc
    dist = position_dist(base.logprobs, i)
    if not dist:
        pc.status, pc.missing = "untestable", "baseline logprobs at the divergence"
        pc.reason = f"{CANNOT_TEST} at position {i}: the baseline reported no logprobs there"
        return pc
    j = judge_pick(c[i], score(dist, b[:i], i), opts.tol)
    pc.divergences.append(Divergence(i, "token", c[i], b[i], 0, judgement=j, dist_source=f"generation, {label}"))
    pc.status = "flip" if j.ok else "fail"
    pc.reason = pc.divergences[-1].describe() + (" (compared up to this benign flip)" if j.ok else "")
    return pc


def untestable(pid: str, p: Prompt, cand: GenResult, max_tokens: int, missing: str) -> PromptCheck:
    """A case the gate cannot judge: its baseline shows no sign of honouring the option under test."""
    pc = PromptCheck(pid, len(p.ids), max_tokens, spec=cand.spec)
    pc.status, pc.missing, pc.reason = "untestable", missing, f"{CANNOT_TEST}: {missing}"
    return pc


def echo_prompts(ps: Sequence[Prompt], firsts: Sequence[GenResult]) -> list[Prompt]:
    """Prompt + the baseline's greedy answer + the prompt again: the answer comes back, so drafts are accepted."""
    return [Prompt(f"{p.pid}-echo", list(p.ids) + list(b.output_ids or []) + list(p.ids))
            for p, b in zip(ps, firsts, strict=True)]


BIAS_BAN = -100.0  # the logit-bias gate's bias on the tokens it bans (OpenAI's bound)
BIAS_AT = (0.05, 0.3, 0.55, 0.8)  # where in each unbiased output the banned tokens are taken


def banned_tokens(ids: Sequence[int], avoid: set[int]) -> dict[int, float]:
    """Tokens of an unbiased greedy output to ban: the one at each fraction BIAS_AT of its length (each is the
    argmax there, so the biased output must leave the unbiased one by then), never one in `avoid` (EOS)."""
    out: dict[int, float] = {}
    for f in BIAS_AT:
        i = min(len(ids) - 1, int(len(ids) * f))
        if i >= 0 and ids[i] not in avoid:
            out[ids[i]] = BIAS_BAN
    return out


async def logit_bias(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                     max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """Greedy requests with a logit bias (OpenAI's, -100 on tokens of each prompt's unbiased greedy output, at
    several places), all at once on the candidate beside an unbiased neighbour, each one at a time on the baseline
    with logprobs. Under speculation the verify rows must carry the bias as a decode step does: an engine that
    leaves it off the verify path (the verify_ignores_logit_bias fault) accepts drafts the bias forbids, since its
    drafter proposes what the unbiased target would say. Checks: no banned token in any candidate output (exact,
    whatever the ties); each biased output against the baseline's, judged at the first divergence with the bias
    added to the reported logprobs (exact: a bias is a per-token shift); the neighbour lossless against its own
    unbiased baseline (a bias must not leak to another row). Two prompts as given and their echo prompts (drafts
    accepted). CANNOT TEST when the baseline shows no sign of honouring the bias (a banned token in its output, or
    an output equal to the unbiased one)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    eos = eos_ids_of(candidate.describe()) or eos_ids_of(baseline.describe())
    ps = list(prompts[:2])
    firsts = await asyncio.gather(*(baseline_for(baseline, p.ids, [], max_tokens, opts.top_k) for p in ps))
    echoes = echo_prompts(ps, firsts)
    firsts += await asyncio.gather(*(baseline_for(baseline, p.ids, [], max_tokens, opts.top_k) for p in echoes))
    ps += echoes
    bans = [banned_tokens(list(f.output_ids or []), eos) for f in firsts]

    def req(p: Prompt, rid: str, bias: dict[int, float] | None, lp: int | None) -> GenRequest:
        return GenRequest(prompt=list(p.ids), max_tokens=max_tokens, temperature=0.0, logprobs=lp, rid=rid,
                          logit_bias=bias, prompt_cache=False)

    neighbour = Prompt(f"{ps[0].pid}-neighbour", ps[0].ids, ps[0].text)
    before = await candidate.spec_counters()
    res = await candidate.generate([req(p, f"bias-{p.pid}", ban, None) for p, ban in zip(ps, bans, strict=True)]
                                   + [req(neighbour, f"bias-{neighbour.pid}", None, None)], concurrency=None)
    delta = counters_delta(before, await candidate.spec_counters())
    res, nres = res[:-1], res[-1]
    bases = await baseline.generate([req(p, f"bias-base-{p.pid}", ban, opts.top_k) for p, ban in zip(ps, bans,
                                                                                                   strict=True)],
                                    concurrency=1)

    def scorer(ban: dict[int, float]) -> Callable[[dict[int, float], list[int], int], dict[int, float]]:
        return lambda dist, before, i: {t: lp + ban.get(t, 0.0) for t, lp in dist.items()}

    # evidence: the biased baseline left its unbiased output and kept no banned token; a case without it is not
    # judged (a candidate held to a baseline that ignores the bias would fail for honouring it)
    honoured = [bool(ban) and b.ok and not any(t in ban for t in (b.output_ids or [])) and b.output_ids != f.output_ids
                for b, f, ban in zip(bases, firsts, bans, strict=True)]
    pcs = [judge_shaped(f"{p.pid}-biased", p, r, b, max_tokens, opts, scorer(ban), "biased") if ok else
           untestable(f"{p.pid}-biased", p, r, max_tokens, "a baseline that honours logit_bias")
           for p, r, b, ban, ok in zip(ps, res, bases, bans, honoured, strict=True)]
    pcs.append(await check_output(baseline, neighbour, nres, max_tokens, opts, candidate, first_base=firsts[0]))
    run = await finish_run("logit-bias", candidate, baseline, pcs, list(res) + [nres], delta, opts, t0,
                           engine_k(candidate))
    leaks = [f"{r.rid}: {sorted({t for t in (r.output_ids or []) if t in ban})}"
             for r, ban, ok in zip(res, bans, honoured, strict=True) if ok and any(t in ban for t in (r.output_ids or []))]
    run.checks.append(Check("banned-tokens", not leaks, "no banned token in a candidate output" if not leaks else
                            f"tokens at bias {BIAS_BAN:g} emitted: " + "; ".join(leaks[:4]), skipped=not any(honoured)))
    if not all(honoured):
        ignored = [b.rid for b, ok in zip(bases, honoured, strict=True) if not ok]
        run.cannot_test.append(f"a baseline that honours logit_bias: {len(ignored)} of {len(bases)} biased baseline "
                               f"outputs kept a banned token, equal the unbiased one or had nothing to ban "
                               f"({ignored[0]})")
    run.notes.append(f"bias {BIAS_BAN:g} on {sum(map(len, bans))} tokens over {len(ps)} requests (2 echo prompts) "
                     "beside one unbiased neighbour")
    return run


MIN_TOKENS_AT = (3, 6, 10, 15)  # the min-tokens gate's min_tokens values (each its own request)
MIN_TOKENS_BIAS = 100.0  # the bias that makes its stop token the argmax wherever it is allowed


async def min_tokens(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                     max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """vLLM's min_tokens under speculation. Each request names a stop token t (stop_token_ids, t from the prompt's
    unbiased greedy output) with a bias of +100 on it and min_tokens m: t must be masked at every position before
    m and is then the argmax, so the one correct output is m tokens without t, then t (finish: stop): exact,
    whatever the model. Under speculation each verify row is masked by its own output position; an engine that
    masks a span's rows by where the span starts (the min_tokens_at_span_start fault) runs past m, one that leaves
    the mask off its verify rows stops early. One echo prompt (drafts accepted) at each m in MIN_TOKENS_AT, all at
    once on the candidate; the baseline one at a time with logprobs; judged at the first divergence under the
    mask and bias. CANNOT TEST when the baseline does not end at m + 1 with t (min_tokens, the bias or
    stop_token_ids not honoured)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    eos = eos_ids_of(candidate.describe()) or eos_ids_of(baseline.describe())
    ms = [m for m in MIN_TOKENS_AT if m < max_tokens - 1] or [max(1, max_tokens - 2)]
    p0 = list(prompts[:1])
    first = await baseline_for(baseline, p0[0].ids, [], max_tokens, opts.top_k)
    echo = echo_prompts(p0, [first])[0]
    ids = list((await baseline_for(baseline, echo.ids, [], max_tokens, opts.top_k)).output_ids or [])
    t = next((x for x in ids[len(ids) // 2:] + ids if x not in eos), None)
    if t is None:
        run = GateRun("min-tokens", [], AcceptanceEvidence.not_measured(), [], time.perf_counter() - t0,
                      rule=opts.rule_dict())
        run.cannot_test.append("a stop token: the baseline's output was empty or all EOS")
        return run
    cases = [Prompt(f"{echo.pid}-min{m}", echo.ids, echo.text) for m in ms]

    def req(p: Prompt, m: int, lp: int | None) -> GenRequest:
        return GenRequest(prompt=list(p.ids), max_tokens=max_tokens, temperature=0.0, logprobs=lp, rid=f"min-{p.pid}",
                          stop_token_ids=[t], min_tokens=m, logit_bias={t: MIN_TOKENS_BIAS}, prompt_cache=False)

    before = await candidate.spec_counters()
    res = await candidate.generate([req(p, m, None) for p, m in zip(cases, ms, strict=True)], concurrency=None)
    delta = counters_delta(before, await candidate.spec_counters())
    bases = await baseline.generate([req(p, m, opts.top_k) for p, m in zip(cases, ms, strict=True)], concurrency=1)

    def scorer(m: int) -> Callable[[dict[int, float], list[int], int], dict[int, float]]:
        return lambda dist, before, i: {x: (MASKED if i < m else lp + MIN_TOKENS_BIAS) if x == t else lp
                                        for x, lp in dist.items()}

    def shape_ok(r: GenResult, m: int) -> bool:
        o = list(r.output_ids or [])
        return len(o) == m + 1 and o[-1] == t and t not in o[:-1]

    # evidence: the baseline's output has the one correct shape; a case without it is not judged
    honoured = [b.ok and shape_ok(b, m) for b, m in zip(bases, ms, strict=True)]
    pcs = [judge_shaped(p.pid, p, r, b, max_tokens, opts, scorer(m), f"min_tokens {m}") if ok else
           untestable(p.pid, p, r, max_tokens, "a baseline that honours min_tokens with a biased stop token")
           for p, r, b, m, ok in zip(cases, res, bases, ms, honoured, strict=True)]
    run = await finish_run("min-tokens", candidate, baseline, pcs, res, delta, opts, t0, engine_k(candidate))
    bad = [f"{r.rid}: {len(r.output_ids or [])} tokens, t at {[i for i, x in enumerate(r.output_ids or []) if x == t][:3]}"
           for r, m, ok in zip(res, ms, honoured, strict=True) if ok and r.ok and not shape_ok(r, m)]
    run.checks.append(Check("min-tokens-shape", not bad, f"every output is m tokens without {t}, then {t}" if not bad
                            else f"expected m tokens without {t}, then {t}: " + "; ".join(bad[:4]),
                            skipped=not any(honoured)))
    inside = [stop_inside_run(r, m, None) for r, m in zip(res, ms, strict=True)]
    run.notes.append(f"stop token {t} at bias +{MIN_TOKENS_BIAS:g}, min_tokens {ms}; the stop decided inside an "
                     f"accepted run in {sum(x is True for x in inside)} of {len(ms)} ("
                     f"{sum(x is None for x in inside)} unknown)")
    off = [b.rid for b, ok in zip(bases, honoured, strict=True) if not ok]
    if off:
        run.cannot_test.append(f"a baseline that honours min_tokens with a biased stop token: {len(off)} of "
                               f"{len(bases)} baseline outputs are not m tokens then the stop ({off[0]})")
    return run


ABORT_VICTIMS = 3  # requests the abort-in-flight gate cancels mid-generation
ABORT_LONG = 4  # ... each asked for this many times the gate's max_tokens (ignore_eos), so it is still running
ABORT_ATTEMPTS = 3  # rounds, each aimed at the decode window the last one observed, until a cancel lands in it


async def abort_in_flight(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                          max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """Clients that go away mid-generation: survivors run beside long victims, and the victims are cancelled
    one by one while the survivors decode (the local adapter aborts a cancelled request in the engine; an
    endpoint sees the connection close). The survivors must stay lossless, the engine must hold no page once
    idle (kv-leak), and a request sent afterwards must be lossless too. Cancel times are spread over how long
    the survivors took alone (timed first); an abort counts as in flight when the victim had not finished and
    a survivor had its first token but not its last. A round without one is run again (at most ABORT_ATTEMPTS),
    its cancels aimed at the decode window the last round observed. CANNOT TEST when none did."""
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


GATES = {"short-then-long": short_then_long, "headroom": headroom, "mixed": mixed, "stop-in-run": stop_in_run,
         "eos-in-run": eos_in_run, "abort-in-flight": abort_in_flight, "penalties": penalties,
         "logit-bias": logit_bias, "min-tokens": min_tokens, "long-context": long_context}
