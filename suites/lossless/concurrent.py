"""The concurrent heterogeneous gate: staggered max_tokens in one batch, each against its own baseline.

Contract: `staggered(max_tokens, n)` gives n distinct-ish lengths from max_tokens down to 2 (long, medium,
and the very short ones whose verify spans are truncated near max_tokens). `run_concurrent` sends all
requests to the candidate at once, so they share steps, join and leave the batch at different times,
and checks each one with the greedy rule (greedy.check_output, re-anchoring included) against a
baseline generated sequentially, one request at a time (the simplest path the baseline has).

Acceptance under batching: the same requests (same ids, same max_tokens) are then sent to the candidate
one at a time, and the acceptance at concurrency N is held against the acceptance at c1
(checks.compare_acceptance: accepted vs rejected draft tokens, pooled over the requests, two-sided Fisher
exact test, FAIL when p < 0.001 and the acceptance rate moved by more than 0.02). Greedy outputs are the
same at both concurrencies, so the drafter sees the same contexts: a drop (a batched draft with the wrong
positions) or a rise is a bug of the batched path. Evidence: per-request draft counts (local engine;
llama.cpp's timings), else the candidate's counter deltas around each run (an idle server); with neither
the gate is CANNOT TEST, naming what is missing. Chat prompts (--endpoint-type chat) go as the same chat
requests at both concurrencies (greedy.py's chat contract).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specbench.harness.adapters.base import EngineAdapter, counters_delta

from .checks import compare_acceptance
from .greedy import GateRun, GreedyGateOptions, Prompt, PromptCheck, prompt_request, run_greedy


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
                         max_tokens: int, opts: GreedyGateOptions, name: str = "concurrent",
                         on_prompt: Callable[[PromptCheck], None] | None = None) -> GateRun:
    mts = staggered(max_tokens, len(prompts))
    run = await run_greedy(baseline, candidate, prompts, max_tokens, opts, concurrency=None, name=name,
                           max_tokens_each=mts, baseline_concurrency=1, on_prompt=on_prompt)
    run.notes.append(f"{len(prompts)} requests sent together; max_tokens {mts}; baselines sequential")
    # The acceptance of each request at concurrency N against the same request alone.
    reqs = [prompt_request(p, m, rid=f"{name}-c1-{p.pid}") for p, m in zip(prompts, mts, strict=True)]
    before = await candidate.spec_counters()
    solo = await candidate.generate(reqs, concurrency=1)
    delta1 = counters_delta(before, await candidate.spec_counters())
    cmp = compare_acceptance(run.results, solo, run.delta, delta1, f"c{len(prompts)} vs c1", mts)
    run.acceptance = cmp
    run.checks.append(cmp.check())
    if not cmp.testable and cmp.source == "none":
        run.cannot_test.append("per-request draft counts or spec counters (acceptance at cN vs c1)")
    same = sum(a.output_ids == b.output_ids for a, b in zip(run.results, solo, strict=True) if a.ok and b.ok)
    run.notes.append(f"acceptance at c{len(prompts)} vs the same requests one at a time: {cmp.describe()}; "
                     f"{same}/{len(solo)} outputs identical at both")
    return run
