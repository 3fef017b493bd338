"""The long-context gate: greedy requests past the positions the data set's prompts reach.

Contract: greedy requests at long contexts (LONG_LENGTHS, each cut to the local engine's usable context less
the output; `long_prompt` builds each from a few-shot transcript of the other prompts with the baseline's
answers, whole, then an echo prompt, so accepted runs reach the long positions), sent together to the
candidate, each judged against the baseline alone by the regret rule. It catches a verify or draft path wrong
only past some position (a position, RoPE or page-table limit, an attention kernel's split at long rows; the
long_context_pos_shift fault) that the data set's prompts of a few hundred tokens never reach. An endpoint
that refuses a length makes that case CANNOT TEST (named), never a FAIL; no length longer than the other
prompts within the usable context is CANNOT TEST for the gate.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, counters_delta

from ..checks import AcceptanceEvidence, Check
from ..greedy import GreedyGateOptions, baseline_for, check_output, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt, PromptCheck
from .common import echo_prompts, geometry, untestable

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
    """The gate (module docstring)."""
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
