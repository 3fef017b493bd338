"""The accept phase: every span's new tokens, read from the step's logits.

Contract: `AcceptStep.accept(plan, fwd)` returns one `SpanResult` per span, in plan order, and changes no
KV, request or counter state (prompt logprobs excepted: they are written as their rows go by):
- prefill: its rows are committed; the chunk that completes the prompt emits the first token;
- decode: one token, the argmax (greedy) or a draw from the request's transform with its own generator;
- verify: greedy = the longest draft prefix equal to the target's argmax, then the target's own token
  (spec/accept.py; the engine's `Faults.accept_rule.greedy_tol` is 0 unless a fault is armed); sampled =
  rejection sampling against the draft distribution (spec/sampling.py, with the engine's
  `Faults.accept_rule`). Either way 1..K+1 tokens; a request that asked for logprobs gets each token's from
  the verify row that decided it (SpecConfig.logprobs: such requests speculate).
Host reads are batched: one argmax transfer serves every greedy span, one speculative-sampling resolve
every sampled verify span (on CUDA the fused kernel), one inverse-CDF draw every sampled single pick.
Requests that set penalties (repetition / presence / frequency), a logit bias or min_tokens are judged on their
shaped rows (`shaped`: a verify row's history holds the drafts before it, and its min_tokens mask its own output
position); logprobs stay the raw rows'.
Synthetic acceptance (speed curves on random weights) replaces the greedy accept count; then the armed
faults may rewrite the results (`Faults.on_accept`), before the commit records anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams
from .faults import Faults
from .forward import StepForward
from .sampler import (
    apply_bias,
    apply_penalties,
    draw_one_each,
    mask_min_tokens,
    sampling_probs_rows,
    topk_logprobs,
)
from .scheduler import Span, StepPlan
from .spec.accept import accept_greedy, accept_greedy_within
from .spec.sampling import AcceptRule, accept_sampled_batch
from .spec.synthetic import SyntheticAcceptance

Logprobs = list[tuple[float, dict[int, float]]]


@dataclass
class SpanResult:
    committed: int  # rows of the span whose KV is kept (start + committed = the new committed length)
    tokens: list[int]  # new output tokens, in order
    logprobs: Logprobs | None = None  # per token (chosen logprob, top-k) when the request asked for them
    drafts: int = 0  # K of a verify span
    accepted: int | None = None  # accepted drafts of a verify span; None for prefill and decode spans
    argmax: list[int] | None = None  # a greedy verify span's target argmax per row (what the faults rewrite from)


class AcceptStep:
    def __init__(self, gens: dict[str, torch.Generator], faults: Faults, synthetic: SyntheticAcceptance | None,
                 kernel: bool, eos: set[int] | None = None) -> None:
        """gens: each request's generator, by id (shared with the engine); kernel: the fused accept kernel
        may run (EngineConfig.triton); eos: the ids min_tokens masks (with each request's stop_token_ids)."""
        self.gens, self.faults, self.synthetic, self.kernel = gens, faults, synthetic, kernel
        self.eos = set(eos or ())

    def accept(self, plan: StepPlan, fwd: StepForward) -> list[SpanResult]:
        spans, raw = plan.spans, fwd.logits
        # the logits every choice reads: the raw ones, or shaped for the requests that set penalties, a logit
        # bias or min_tokens
        logits = shaped(spans, fwd.rows, raw, self.eos, self.faults.accept_rule) \
            if any(s.req.params.shaped for s in spans) else raw
        # One batched argmax and one host transfer per step serve every greedy span (not one sync each).
        amax = logits.argmax(-1).tolist() if any(s.req.params.greedy for s in spans) else []
        sampled = self._resolve_sampled(spans, fwd.rows, logits)  # every sampled verify span, resolved together
        picks = self._draw_picks(spans, fwd.rows, logits)  # every sampled single pick, drawn together
        # logprobs (and the faults' tolerance) read the raw rows: the model's distribution, as vLLM reports it
        results = [self._span(s, raw[r0:r0 + n], amax[r0:r0 + n], sampled.get(i), picks.get(i))
                   for i, (s, (r0, n)) in enumerate(zip(spans, fwd.rows, strict=True))]
        self.faults.on_accept(spans, results)
        return results

    def _span(self, s: Span, lg: torch.Tensor, am: list[int], sampled: tuple[int, list[int]] | None,
              pick: int | None) -> SpanResult:
        """One span's result. `am`: the argmax of each of its logits rows (greedy requests); `sampled`: a
        sampled verify span's (accepted, tokens); `pick`: a sampled single token; both from the batch."""
        p = s.req.params
        if s.kind == "prefill":
            if p.prompt_logprobs is not None:
                self._prompt_logprobs(s, lg)
            if not s.completes_prefill:
                return SpanResult(len(s.tokens), [])
            tok = am[-1] if p.greedy else _drawn(pick)
            return SpanResult(len(s.tokens), [tok], _logprobs(lg[-1:], tok, p))
        if s.kind == "decode":
            tok = am[0] if p.greedy else _drawn(pick)
            return SpanResult(1, [tok], _logprobs(lg[:1], tok, p))
        k = len(s.drafts)
        if not p.greedy:
            assert sampled is not None  # every sampled verify span is resolved with the batch
            m, toks = sampled
            return SpanResult(m + 1, toks, _run_logprobs(lg, toks, p), k, m)
        tol = self.faults.accept_rule.greedy_tol
        m, toks = accept_greedy_within(list(s.drafts), am, lg, tol) if tol else accept_greedy(list(s.drafts), am)
        if self.synthetic is not None:  # speed curves only: the accept count is drawn, not matched
            m = self.synthetic.draw(s.req.prompt_ids, s.start, k, s.req.rid)
            toks = list(s.drafts[:m]) + [am[m]]
        return SpanResult(m + 1, toks, _run_logprobs(lg, toks, p), k, m, am)

    def _resolve_sampled(self, spans: list[Span], row_of: list[tuple[int, int]],
                         logits: torch.Tensor) -> dict[int, tuple[int, list[int]]]:
        """(accepted drafts, emitted tokens) of every sampled verify span, by span index, resolved together."""
        idx = [i for i, s in enumerate(spans) if s.kind == "verify" and not s.req.params.greedy]
        if not idx:
            return {}
        rows: list[int] = []
        params: list[SamplingParams] = []
        for i in idx:
            r0, cnt = row_of[i]
            rows += range(r0, r0 + cnt)
            params += [spans[i].req.params] * cnt
        sel = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        if self.faults.accept_rule.first_params:  # the row_params_first fault
            params = [params[0]] * len(params)
        probs = sampling_probs_rows(sel, params)
        qs = [spans[i].draft_probs for i in idx]
        res = accept_sampled_batch([list(spans[i].drafts) for i in idx], qs, probs,
                                   [self.gens[spans[i].req.rid] for i in idx], self.faults.accept_rule,
                                   kernel=self.kernel)
        return dict(zip(idx, res, strict=True))

    def _draw_picks(self, spans: list[Span], row_of: list[tuple[int, int]], logits: torch.Tensor) -> dict[int, int]:
        """The sampled token of every non-greedy decode span and prefill completion, by span index: each
        request's transform over its last row, an inverse-CDF draw with one uniform from its own generator,
        all on the device, one host read (instead of a multinomial and a sync per request)."""
        idx: list[int] = []
        rows: list[int] = []
        params: list[SamplingParams] = []
        for i, s in enumerate(spans):
            if s.req.params.greedy or not (s.kind == "decode" or (s.kind == "prefill" and s.completes_prefill)):
                continue
            r0, cnt = row_of[i]
            idx.append(i)
            rows.append(r0 + cnt - 1)
            params.append(s.req.params)
        if not idx:
            return {}
        drawn = draw_one_each(logits[torch.tensor(rows, device=logits.device)], params,
                              [self.gens[spans[i].req.rid] for i in idx])
        return dict(zip(idx, drawn.tolist(), strict=True))

    @staticmethod
    def _prompt_logprobs(s: Span, lg: torch.Tensor) -> None:
        req, k, frm = s.req, s.req.params.prompt_logprobs, s.req.params.prompt_logprobs_from
        if s.start == 0:
            req.prompt_logprobs = [None]
        row_of = {s.start + j + 1: i for i, j in enumerate(s.logit_rows())}  # lg's rows are the span's logit rows
        ps = [p for p in range(s.start + 1, s.start + len(s.tokens) + 1) if p < req.prompt_len]
        need = [p for p in ps if p >= frm]  # the positions before prompt_logprobs_from get None
        got = iter(topk_logprobs(lg[torch.tensor([row_of[p] for p in need], device=lg.device)],
                                 [req.prompt_ids[p] for p in need], k or 0) if need else [])
        req.prompt_logprobs += [next(got) if p >= frm else None for p in ps]


def _drawn(pick: int | None) -> int:
    assert pick is not None  # every sampled single pick is drawn with the batch (_draw_picks)
    return pick


def shaped(spans: list[Span], rows: list[tuple[int, int]], logits: torch.Tensor, eos: set[int],
           rule: AcceptRule | None = None) -> torch.Tensor:
    """The step's logits with each shaped request's processors applied to its rows, in vLLM's order: penalties
    (sampler.apply_penalties), logit bias (apply_bias), the min_tokens mask (mask_min_tokens). A row's history is
    the prompt and the output so far; a verify span's row j also holds the drafts d1..dj it follows (row j predicts
    output token len(output) + j). `rule`'s fault flags leave a verify span's rows unpenalized
    (verify_ignores_penalties) or penalized without the drafts (verify_penalty_history_stale), or unbiased (verify_ignores_logit_bias), or mask them all by the span's first row
    (min_tokens_at_span_start)."""
    rule = rule or AcceptRule()
    out = logits.clone()
    for s, (r0, n) in zip(spans, rows, strict=True):
        p = s.req.params
        if not p.shaped or not n:
            continue
        verify = s.kind == "verify"
        hist = list(s.req.output_ids)
        x = out[r0:r0 + n]
        if p.penalized and not (verify and rule.verify_unpenalized):
            outs = [hist + list(s.drafts[:j]) for j in range(n)] if verify and not rule.verify_history_stale \
                else [hist] * n
            x = apply_penalties(x, p, s.req.prompt_ids, outs)
        if p.logit_bias and not (verify and rule.verify_unbiased):
            x = apply_bias(x, p)
        if p.min_tokens:
            lengths = [len(hist) + (j if verify and not rule.min_tokens_at_start else 0) for j in range(n)]
            x = mask_min_tokens(x, p, lengths, eos)
        out[r0:r0 + n] = x
    return out


def _logprobs(rows: torch.Tensor, tok: int, p: SamplingParams) -> Logprobs | None:
    return topk_logprobs(rows, [tok], p.logprobs) if p.logprobs is not None else None


def _run_logprobs(lg: torch.Tensor, toks: list[int], p: SamplingParams) -> Logprobs | None:
    """A verify span's logprobs (the request asked for them): token j of its committed run was decided by logits
    row j (row 0 follows the anchor), so its logprobs are that row's log-softmax, raw as a decode step's are."""
    return topk_logprobs(lg[:len(toks)], list(toks), p.logprobs) if p.logprobs is not None else None
