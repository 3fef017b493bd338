"""The penalties gate: presence and frequency penalties on the verify rows.

Contract: greedy requests with presence and frequency penalties (OpenAI's, over the output so far). Under
speculation a verify row must be penalized like a decode step, its count holding the drafts before it: an
engine that forgets penalties on the verify path (the verify_ignores_penalties fault) or counts the history
before the span (verify_penalty_history_stale) picks other tokens. Up to PEN_PROMPTS prompts as given and as
echo prompts (prompt + the baseline's greedy answer + the prompt again: the answer comes back, drafts are
accepted, the penalties bite), at each of PEN_SETTINGS, all at once on the candidate, each one at a time on the
baseline with the same penalties and logprobs. Judged at the first divergence (`judge_penalized`): the
penalized score of a token is its baseline logprob minus the penalties its count in the common prefix earns
(shift-invariant, so exact from the reported logprobs), and the pick's regret under it decides (the gate's
tolerance). A benign flip ends the comparison: a re-anchored baseline would count the prefix as prompt, not
output. Repetition penalties are not judged here (not shift-invariant: the reported logprobs cannot give the
penalized scores).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta

from ..greedy import GreedyGateOptions, baseline_for, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt, PromptCheck
from .common import echo_prompts, judge_shaped

# The penalties gate's (frequency, presence) settings, each on every prompt: presence and frequency together,
# and frequency alone at twice the weight. Strong penalties (1.5 / 1.0) were tried and dropped: the drafter, which
# knows nothing of them, is then hardly ever accepted, and a verify row that counts the wrong history is never
# reached (measured on the tiny pair: 0 of 6 outputs moved by verify_penalty_history_stale, 2 of 6 at these).
PEN_SETTINGS = ((0.5, 0.2), (1.0, 0.0))
PEN_PROMPTS = 4  # prompts (each also as an echo prompt) at each setting


async def penalties(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                    max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """The gate (module docstring)."""
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
