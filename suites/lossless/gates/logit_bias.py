"""The logit-bias gate: a logit bias on the verify rows.

Contract: greedy requests with a logit bias (OpenAI's: BIAS_BAN on tokens of each prompt's unbiased greedy
output, taken at BIAS_AT of it, `banned_tokens`), all at once on the candidate beside an unbiased neighbour,
each one at a time on the baseline with logprobs. Under speculation the verify rows must carry the bias as a
decode step does: an engine that leaves it off the verify path (the verify_ignores_logit_bias fault) accepts
drafts the bias forbids, since its drafter proposes what the unbiased target would say. Checks: no banned
token in any candidate output (exact, whatever the ties); each biased output against the baseline's, judged
at the first divergence with the bias added to the reported logprobs (exact: a bias is a per-token shift);
the neighbour lossless against its own unbiased baseline (a bias must not leak to another row). Two prompts
as given and their echo prompts (drafts accepted). CANNOT TEST when the baseline shows no sign of honouring
the bias (a banned token in its output, or an output equal to the unbiased one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest, counters_delta

from ..checks import Check, gate_eos
from ..greedy import GreedyGateOptions, baseline_for, check_output, engine_k, finish_run, resolve_rule
from ..outcomes import GateRun, Prompt
from .common import echo_prompts, judge_shaped, untestable

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
    """The gate (module docstring)."""
    t0 = time.perf_counter()
    opts = resolve_rule(opts, baseline, candidate)
    eos = gate_eos(baseline, candidate)
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
