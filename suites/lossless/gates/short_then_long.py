"""The short-then-long gate: the first verify the engine ever sees is a truncated span.

Contract: requests with max_tokens 3, 4, 2 run first, one at a time, then long ones. The first verify the
engine ever sees is a truncated span (K = remaining - 1); a buffer or graph captured at that shape and
replayed at the full 1 + K rows corrupts the long requests (capture shape == replay shape). Run it on a
fresh engine: it is meant to see the first capture (the registry marks it `fresh`). Every request is judged
by the greedy gate's regret rule; not requiring speculation (the short requests may not draft at all).
"""

from __future__ import annotations

from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter

from ..greedy import GreedyGateOptions, run_greedy
from ..outcomes import GateRun, Prompt


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
