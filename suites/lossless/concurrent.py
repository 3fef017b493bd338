"""The concurrent heterogeneous gate: staggered max_tokens in one batch, each against its own baseline.

Contract: `staggered(max_tokens, n)` gives n distinct-ish lengths from max_tokens down to 2 (long, medium,
and the very short ones whose verify spans are truncated near max_tokens). `run_concurrent` sends all
requests to the candidate at once, so they share steps, join and leave the batch at different times,
and checks each one with the greedy rule (greedy.check_output, re-anchoring included) against a
baseline generated sequentially, one request at a time (the simplest path the baseline has).
"""

from __future__ import annotations

from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter

from .greedy import GateRun, GreedyGateOptions, Prompt, run_greedy


def staggered(max_tokens: int, n: int) -> list[int]:
    if max_tokens < 2:
        raise ValueError(f"--max-tokens {max_tokens} is too small for the concurrent gate: expected >= 2")
    fracs = (1.0, 0.5, 0.25, 0.75, 0.125, 0.875, 0.375, 0.625)
    short = (3, 4, 2, 5)
    out: list[int] = []
    for i in range(n):
        if i % 3 == 2:  # every third request is a very short one
            out.append(min(max_tokens, short[(i // 3) % len(short)]))
        else:
            f = fracs[(i - i // 3) % len(fracs)]
            out.append(max(2, min(max_tokens, round(max_tokens * f) - (i // len(fracs)))))
    return out


async def run_concurrent(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                         max_tokens: int, opts: GreedyGateOptions, name: str = "concurrent") -> GateRun:
    mts = staggered(max_tokens, len(prompts))
    run = await run_greedy(baseline, candidate, prompts, max_tokens, opts, concurrency=None, name=name,
                           max_tokens_each=mts, baseline_concurrency=1)
    run.notes.append(f"{len(prompts)} requests sent together; max_tokens {mts}; baselines sequential")
    return run
