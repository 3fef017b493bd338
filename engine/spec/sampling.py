"""Lossless speculative sampling (rejection sampling against the draft distribution).

For drafts d_0..d_{k-1} drawn from q_i and target probabilities p_i (both under the request's own
sampling transform), accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
emit a token from normalize(max(p_i - q_i, 0)); when all k are accepted emit a bonus from p_k. Then the
emitted token at every position is distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023):
  P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) * (p(x) - q(x))^+ / sum_y (p(y) - q(y))^+
       = min(q(x), p(x)) + (p(x) - q(x))^+ = p(x).
A deterministic proposer (n-gram) is the point mass q = one_hot(d). All uniforms are drawn at once from
the request's generator; the only host read is the final accepted count and tokens.
Greedy is the exact limit handled elsewhere (argmax), never a temperature clamp.
"""

from __future__ import annotations

import torch


def accept_sampled(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, gen: torch.Generator,
                   faults: frozenset[str] = frozenset()) -> tuple[int, list[int]]:
    """drafts [k]; q [k, V] draft probs or None (point masses); p [k + 1, V] target probs."""
    k = len(drafts)
    dev = p.device
    d = torch.tensor(drafts, dtype=torch.long, device=dev)
    if q is None:
        q = torch.zeros(k, p.shape[1], dtype=p.dtype, device=dev)
        q[torch.arange(k, device=dev), d] = 1.0
    rows = torch.arange(k, device=dev)
    p_d = p[rows, d]
    q_d = q[rows, d].clamp_min(1e-20)
    ratio = q_d / p_d.clamp_min(1e-20) if "biased_accept" in faults else p_d / q_d
    u = torch.rand(k + 1, generator=gen, device=dev, dtype=torch.float32)
    if "reused_uniform" in faults:
        u = u[:1].expand(k + 1)
    ok = (u[:k] < ratio.clamp(max=1.0)).to(torch.int64)
    m = int(ok.cumprod(0).sum().item())
    if m < k:
        res = (p[m] - q[m]).clamp_min(0.0)
        if "resample_from_p" in faults or float(res.sum()) <= 0.0:
            res = p[m]
        dist = res / res.sum()
    else:
        dist = p[k]
    tok = int(torch.multinomial(dist, 1, generator=gen).item())
    return m, drafts[:m] + [tok]


def emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Analytic distribution of the first emitted token of one step (p, q: [V]); equals p."""
    accept = torch.minimum(p, q)
    res = (p - q).clamp_min(0.0)
    rej = 1.0 - accept.sum()
    return accept + (rej * res / res.sum() if res.sum() > 0 else 0.0)
