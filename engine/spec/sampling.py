"""Lossless speculative sampling (rejection sampling against the draft distribution).

For drafts d_0..d_{k-1} drawn from q_i and target probabilities p_i (both under the request's own
sampling transform), accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
emit a token from normalize(max(p_i - q_i, 0)); when all k are accepted emit a bonus from p_k. Then the
emitted token at every position is distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023):
  P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) * (p(x) - q(x))^+ / sum_y (p(y) - q(y))^+
       = min(q(x), p(x)) + (p(x) - q(x))^+ = p(x).
A deterministic proposer (n-gram) is the point mass q = one_hot(d). Each request's uniforms are drawn at
once from its own generator; a whole batch of requests is resolved on the device with one host read
(the accepted counts and emitted tokens).
Greedy is the exact limit handled elsewhere (argmax), never a temperature clamp.
`AcceptRule` names the three steps of the rule that a caller may swap for a lossy variant (the self-test
does, through engine/faults.py, to prove its gates notice), and the greedy match's tolerance
(spec/accept.py); the default is the rule above and the exact greedy match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.kernels import triton_enabled

from ..sampler import draw_rows, uniforms

# The fused Triton accept kernel (kernels/spec_accept.py) where `triton_enabled` allows it (CUDA, or the
# Triton interpreter); False forces the torch path below everywhere (tests, A/B timing).
USE_KERNEL = True


@dataclass(frozen=True)
class AcceptRule:
    """The speculative-sampling rule the resolve computes; every switch off is the lossless rule. The same
    switches reach the fused kernel (kernels/spec_accept.py), so both paths compute the same variant."""

    q_over_p: bool = False  # accept with min(1, q/p) instead of min(1, p/q)
    one_uniform: bool = False  # every ratio test of a request reads its first uniform
    draw_from_p: bool = False  # after a rejection draw from p instead of the residual (p - q)^+
    q_next_row: bool = False  # draft i reads q row i + 1 (the last draft its own row): q indexed one row late
    bonus_residual: bool = False  # after a fully accepted run the bonus is drawn from (p_k - q_{k-1})^+, not p_k
    # the uniforms come from the process's default generator, not the request's: the law stays exact, but a
    # seeded request no longer reproduces (what only the sampled gate's seed-repeat check can see)
    unseeded: bool = False
    # every sampled verify row of a step takes the first sampled request's parameters (temperature, top-k/p):
    # a batch-only bug that a batch of one sampling config never shows (accept_step.py reads it)
    first_params: bool = False
    # penalties (repetition / presence / frequency) left off a verify span's rows: they are judged on the raw
    # logits (accept_step.penalized reads it)
    verify_unpenalized: bool = False
    # a verify span's row j penalized with the history before the span, without the drafts d1..dj it follows
    # (accept_step.shaped reads it)
    verify_history_stale: bool = False
    # the logit bias left off a verify span's rows (accept_step.shaped reads it)
    verify_unbiased: bool = False
    # every row of a verify span masked for min_tokens by the span's first row's output position, not its own
    # (accept_step.shaped reads it): a stop allowed from a row past min_tokens is still masked there
    min_tokens_at_start: bool = False
    # greedy (spec/accept.py, not the sampled resolve): a draft also matches when its target logit is within
    # this of the row's max (0: the exact argmax match)
    greedy_tol: float = 0.0


LOSSLESS = AcceptRule()


def accept_sampled_batch(drafts: list[list[int]], qs: list[torch.Tensor | None], p: torch.Tensor,
                         gens: list[torch.Generator | None], rule: AcceptRule = LOSSLESS,
                         kernel: bool = True) -> list[tuple[int, list[int]]]:
    """Speculative sampling for a batch of requests with one host read.

    drafts[b]: request b's k_b drafts; qs[b]: their draft probs [k_b, V], or None for a deterministic
    proposer (point masses); p: target probs [sum_b (k_b + 1), V], request b's k_b + 1 rows in order.
    Each request draws k_b + 1 uniforms from its own generator: k_b for the ratio tests, the last for the
    emitted token (inverse CDF over the residual or the bonus distribution). Returns (m_b, tokens_b).
    `rule`: the accept rule (default lossless; the self-test's sampling faults pass their variants).
    On CUDA with Triton enabled (and `kernel`, `USE_KERNEL`) the whole resolve is one fused launch
    (kernels/spec_accept.py); otherwise the torch ops below, its reference. Same generators, same draws.
    """
    nb = len(drafts)
    if not (len(qs) == len(gens) == nb):
        raise ValueError("accept_sampled_batch: drafts, qs and gens must have one entry per request")
    ks = [len(d) for d in drafts]
    if p.shape[0] != sum(ks) + nb:
        raise ValueError(f"accept_sampled_batch: p has {p.shape[0]} rows, expected sum(k + 1) = {sum(ks) + nb}")
    if nb == 0:
        return []
    if rule.unseeded:
        gens = [None] * nb
    # The kernel knows the lossless rule and the first three faults; the two q/bonus faults run on torch only.
    if kernel and USE_KERNEL and p.dtype == torch.float32 and triton_enabled(p.device) \
            and not (rule.q_next_row or rule.bonus_residual):
        return _accept_fused(drafts, qs, p, gens, rule, ks)
    dev = p.device
    kmax, nk = max(ks), sum(ks)
    q, qrows = _q_rows(drafts, qs, p)
    if rule.q_next_row:
        qrows, o = list(qrows), 0
        for k in ks:
            if k:
                qrows[o:o + k] = qrows[o + 1:o + k] + qrows[o + k - 1:o + k]
            o += k
    # Host-built index arrays, one transfer: per draft (p row, token, batch, slot, q row or -1 for a point
    # mass); per request (p offset = offset of its uniforms, first draft, k).
    prow: list[int] = []
    slot: list[int] = []
    toks, bidx, poff, doff = [], [], [], []
    po = do = 0
    for b, d in enumerate(drafts):
        poff.append(po)
        doff.append(do)
        prow += range(po, po + len(d))
        toks += d
        bidx += [b] * len(d)
        slot += range(len(d))
        po += len(d) + 1
        do += len(d)
    ix = torch.tensor(prow + toks + bidx + slot + qrows + poff + doff + ks, dtype=torch.long).to(dev, non_blocking=True)
    prow_t, tok_t, b_t, slot_t, qrow_t = (ix[i * nk:(i + 1) * nk] for i in range(5))
    poff_t, doff_t, k_t = (ix[5 * nk + i * nb:5 * nk + (i + 1) * nb] for i in range(3))
    u = uniforms([k + 1 for k in ks], gens, dev)  # request b's k_b + 1 uniforms at its p offset
    m = torch.zeros(nb, dtype=torch.long, device=dev)
    if nk:
        p_d = p[prow_t, tok_t]
        q_d = torch.ones_like(p_d) if q is None else \
            torch.where(qrow_t < 0, 1.0, q[qrow_t.clamp_min(0), tok_t]).clamp_min(1e-20)
        ratio = q_d / p_d.clamp_min(1e-20) if rule.q_over_p else p_d / q_d
        ua = u[poff_t[b_t]] if rule.one_uniform else u[prow_t]
        ok = torch.zeros(nb, kmax, dtype=torch.long, device=dev)
        ok[b_t, slot_t] = (ua < ratio.clamp(max=1.0)).long()
        m = ok.cumprod(1).sum(1)
    rows = p[poff_t + m]  # the rejected position's target row, or the bonus row when all were accepted
    rejected = m < k_t
    if nk:
        qi = (doff_t + m.clamp(max=(k_t - 1).clamp_min(0))).clamp(max=nk - 1)  # the rejected draft
        res = rows.scatter(1, tok_t[qi].unsqueeze(1), 0.0)  # a point mass: (p - one_hot(d))^+ zeroes d
        if q is not None:
            qr = qrow_t[qi]
            res = torch.where((qr < 0).unsqueeze(1), res, (rows - q[qr.clamp_min(0)]).clamp_min(0.0))
        if rule.draw_from_p:
            res = rows
        full = ~rejected & (k_t > 0) if rule.bonus_residual else torch.zeros_like(rejected)
        use_p = (~rejected & ~full) | (res.sum(1) <= 0.0)
        dist = torch.where(use_p.unsqueeze(1), rows, res)
    else:
        dist = rows
    tok = draw_rows(dist, u[poff_t + k_t])
    mh, th = torch.stack([m, tok]).tolist()
    return [(mb, d[:mb] + [tb]) for mb, tb, d in zip(mh, th, drafts, strict=True)]


def _accept_fused(drafts: list[list[int]], qs: list[torch.Tensor | None], p: torch.Tensor,
                  gens: list[torch.Generator | None], rule: AcceptRule, ks: list[int],
                  ) -> list[tuple[int, list[int]]]:
    """accept_sampled_batch through the fused kernel: one HtoD copy of the index arrays, the uniforms,
    one launch, one host read."""
    from specbench.kernels.spec_accept import spec_accept  # noqa: PLC0415  (imports triton)

    nb, nk, dev = len(drafts), sum(ks), p.device
    q, qrows = _q_rows(drafts, qs, p)
    toks, doff, poff = [], [], []
    do = po = 0
    for d in drafts:
        doff.append(do)
        poff.append(po)
        toks += d
        do += len(d)
        po += len(d) + 1
    ix = torch.tensor(toks + qrows + doff + ks + poff, dtype=torch.long).to(dev, non_blocking=True)
    u = uniforms([k + 1 for k in ks], gens, dev)
    out = torch.empty(2, nb, dtype=torch.long, device=dev)
    spec_accept(p, q, ix[:nk], ix[nk:2 * nk], ix[2 * nk:2 * nk + nb], ix[2 * nk + nb:2 * nk + 2 * nb],
                ix[2 * nk + 2 * nb:], u, q_over_p=rule.q_over_p, one_uniform=rule.one_uniform,
                draw_from_p=rule.draw_from_p, kmax=max(ks), out=out)
    mh, th = out.tolist()
    return [(mb, d[:mb] + [tb]) for mb, tb, d in zip(mh, th, drafts, strict=True)]


def _base_rows(drafts: list[list[int]], qs: list[torch.Tensor | None],
               p: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
    """The DFlash layout: every q a view qall[j, :k] of one contiguous tensor of V-wide rows. Then (that
    tensor as [*, V], the row of each draft in draft order, -1 for the drafts of a None q), else None."""
    v = p.shape[1]
    first = next((q for q in qs if q is not None), None)
    base = first._base if first is not None else None
    if base is None or base.shape[-1] != v or not base.is_contiguous() or base.dtype != p.dtype:
        return None
    rows: list[int] = []
    for d, q in zip(drafts, qs, strict=True):
        if q is None:
            rows += [-1] * len(d)
            continue
        if q._base is not base or q.dim() != 2 or q.stride() != (v, 1):
            return None
        s = q.storage_offset() - base.storage_offset()
        if s % v:
            return None
        rows += range(s // v, s // v + len(d))
    return base.view(-1, v), rows


def _q_rows(drafts: list[list[int]], qs: list[torch.Tensor | None], p: torch.Tensor,
            ) -> tuple[torch.Tensor | None, list[int]]:
    """(q rows [*, V] or None, the row of each draft in draft order, -1 for a point mass), for the kernel
    and the torch path alike. The proposer's views of one tensor are indexed in place (no copy); other
    q's are concatenated; all None (a deterministic proposer) gives no rows at all."""
    nk = sum(len(d) for d in drafts)
    if all(q is None for q in qs):
        return None, [-1] * nk
    got = _base_rows(drafts, qs, p)
    if got is not None:
        return got
    parts, rows, r = [], [], 0
    for d, qb in zip(drafts, qs, strict=True):
        if qb is None:
            rows += [-1] * len(d)
        else:
            parts.append(qb.to(device=p.device, dtype=p.dtype))
            rows += range(r, r + len(d))
            r += qb.shape[0]
    if r == 0:  # only empty q's (requests without drafts): nothing to index
        return None, rows
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), rows


def accept_sampled(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, gen: torch.Generator | None,
                   rule: AcceptRule = LOSSLESS) -> tuple[int, list[int]]:
    """One request: drafts [k]; q [k, V] draft probs or None (point masses); p [k + 1, V] target probs."""
    return accept_sampled_batch([list(drafts)], [q], p, [gen], rule)[0]


def emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Analytic distribution of the first emitted token of one step (p, q: [V]); equals p."""
    accept = torch.minimum(p, q)
    res = (p - q).clamp_min(0.0)
    rej = 1.0 - accept.sum()
    return accept + (rej * res / res.sum() if res.sum() > 0 else 0.0)
