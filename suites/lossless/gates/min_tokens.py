"""The min-tokens gate: vLLM's min_tokens on the verify rows.

Contract: each request names a stop token t (stop_token_ids, t from the prompt's unbiased greedy output) with
a bias of MIN_TOKENS_BIAS on it and min_tokens m: t must be masked at every position before m and is then the
argmax, so the one correct output is m tokens without t, then t (finish: stop): exact, whatever the model.
Under speculation each verify row is masked by its own output position; an engine that masks a span's rows
by where the span starts (the min_tokens_at_span_start fault) runs past m, one that leaves the mask off its
verify rows stops early, one without the bias on them (verify_ignores_logit_bias) does not stop at m. One
echo prompt (drafts accepted) at each m in MIN_TOKENS_AT, all at once on the candidate; the baseline one at a
time with logprobs; judged at the first divergence under the mask and bias, plus the exact shape check
(min-tokens-shape). The notes count the cases whose stop was decided inside an accepted run. CANNOT TEST
when the baseline does not end at m + 1 with t (min_tokens, the bias or stop_token_ids not honoured).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta

from ..checks import AcceptanceEvidence, Check, gate_eos
from ..greedy import GreedyGateOptions, baseline_for, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt
from .common import MASKED, echo_prompts, judge_shaped, stop_inside_run, untestable

MIN_TOKENS_AT = (3, 6, 10, 15)  # the min-tokens gate's min_tokens values (each its own request)
MIN_TOKENS_BIAS = 100.0  # the bias that makes its stop token the argmax wherever it is allowed


async def min_tokens(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt],
                     max_tokens: int, opts: GreedyGateOptions) -> GateRun:
    """The gate (module docstring)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    eos = gate_eos(baseline, candidate)
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
