"""The prefix-cache gate: the prefix gate (prefix.py, `--suite prefix`) in the default set, on the candidate.

Contract: engines that serve speculation usually keep a prefix cache on (vLLM's and SGLang's defaults), and a
prefix hit is where the drafter's context must be restored. The gate runs `run_prefix_gate` on the candidate
alone over the first `CONVERSATIONS` prompts (each: a repeat, a shared system prompt, two-turn conversations
ending at block boundary -1 / 0 / +1, a one-block-short match; the block is the engine's page size, else 16),
warm against cold with `min(max_tokens, MAX_TOKENS)` continuation tokens, under the suite's tolerance.
Each case becomes one prompt check (identical, a benign flip judged by the regret rule, or failed with the
case's reason: drift, regret, a warm turn that fell back); the warm-vs-cold acceptance sign test is a run
check. Without a cold path (no reset route, no cache salt), without logprobs, or with a cache that never
hit, the gate is CANNOT TEST with the prefix gate's reason, and sends nothing further. The baseline is not
used. Its own self-test is `lossless --suite prefix --selftest` (the prefix-family faults), so it is not a
column of `specbench selftest`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter
from specbench.harness.verdicts import CANNOT_TEST, FAIL, is_cannot_test

from ..checks import AcceptanceEvidence, Check
from ..greedy import GreedyGateOptions, resolve_rule
from ..outcomes import NO_OUTPUT, GateRun, Prompt, PromptCheck
from ..prefix import Case, PrefixGateOptions, run_prefix_gate

CONVERSATIONS = 2  # about 5 s on two cores with the bundled pair (12 cases at page size 16)
MAX_TOKENS = 16


def _check(c: Case, max_tokens: int) -> PromptCheck:
    flip = c.regret is not None
    status = "fail" if not c.ok else ("flip" if flip else "identical")
    return PromptCheck(f"prefix: {c.name}", len(c.warm or c.warmup), max_tokens, status=status,
                       candidate_tokens=c.compared, tokens_compared=c.compared, reason=c.reason,
                       spec={"drafted": c.drafted, "warm_accept": c.warm_accept, "cold_accept": c.cold_accept,
                             "cached_tokens": c.cached_tokens, "drift": c.drift})


def _warm_acceptance(cases: Sequence[Case], opts: GreedyGateOptions) -> AcceptanceEvidence:
    """The warm continuations' speculation, from what each case counted (none counted: "none")."""
    counted = [c for c in cases if c.accept_source is not None]
    if not counted:
        return AcceptanceEvidence("none" if cases else "not measured", min_accept_len=opts.min_accept_len)
    source = "per-request" if all(c.accept_source == "per-request" for c in counted) else "counters"
    return AcceptanceEvidence(source, num_drafts=sum(c.warm_drafts or 0 for c in counted),
                              num_accepted_tokens=sum(c.warm_accepted or 0 for c in counted),
                              min_accept_len=opts.min_accept_len)


async def prefix_cache(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                       max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    m = min(max_tokens, MAX_TOKENS)
    convs = [(p.pid, list(p.ids)) for p in prompts[:CONVERSATIONS] if p.ids]
    out = await run_prefix_gate(candidate, convs, PrefixGateOptions(max_tokens=m, greedy=opts))
    run = GateRun("prefix-cache", [_check(c, m) for c in out.cases], _warm_acceptance(out.cases, opts),
                  wall_s=time.perf_counter() - t0, require_spec=False, rule=opts.rule_dict())
    acc = out.acceptance
    if acc:
        run.checks.append(Check("warm-vs-cold acceptance", bool(acc["ok"]),
                                f"{acc['compared']} cases where both drafted: warm accepted less in {acc['fewer']}, "
                                f"more in {acc['more']} (exact sign test p {acc['p']:.2g}, alpha {acc['alpha']:g})"))
    if is_cannot_test(out.verdict):  # the prefix gate's one reason, as "<what it needed>: <why>"
        what = out.verdict.removeprefix(str(CANNOT_TEST)).strip(" ()") or "prefix"
        run.cannot_test.append(out.reason if out.reason == NO_OUTPUT else f"{what}: {out.reason}")
    elif out.verdict == FAIL and not run.failed:  # a failure no case or check carries (a request failed)
        run.checks.append(Check("prefix gate", False, out.reason))
    run.notes.append(f"{len(out.cases)} cases on {len(convs)} conversations, cold runs by {out.cold_method or '-'}; "
                     f"{out.verdict}: {out.reason}")
    run.evidence = {k: v for k, v in out.to_dict().items() if k not in ("cases", "engine")}
    return run
