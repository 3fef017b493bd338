"""Shared cases: the fused accept kernel vs the torch path of `accept_sampled_batch` (CPU under the
Triton interpreter: tests/test_spec_accept_cpu.py; CUDA: tests/gpu/test_kernels.py)."""

from __future__ import annotations

import torch

from specbench.engine.spec import sampling
from specbench.engine.spec.sampling import AcceptRule

# The lossless rule and each variant the self-test's sampling faults use (engine/faults.py).
RULES = [AcceptRule(), AcceptRule(q_over_p=True), AcceptRule(one_uniform=True), AcceptRule(draw_from_p=True)]


def _dist(p: torch.Tensor, q_row: torch.Tensor | None, d: int | None, rule: AcceptRule) -> torch.Tensor:
    """The distribution the emitted token is drawn from (d None: the bonus row)."""
    if d is None or rule.draw_from_p:
        return p
    res = (p - q_row).clamp_min(0.0) if q_row is not None else p.clone().index_fill_(0, torch.tensor([d]), 0.0)
    return res if res.sum() > 0 else p


def _rand_probs(n: int, v: int, g: torch.Generator, dev: torch.device) -> torch.Tensor:
    x = torch.randn(n, v, generator=g, device=dev) * (1.0 + 4.0 * torch.rand(n, 1, generator=g, device=dev))
    probs = torch.softmax(x, -1)
    sparse = torch.rand(n, 1, generator=g, device=dev) < 0.3  # some rows top-k-like: most entries zero
    keep = torch.rand(n, v, generator=g, device=dev) < 0.2
    keep[:, 0] = True
    probs = torch.where(sparse & ~keep, 0.0, probs)
    return probs / probs.sum(-1, keepdim=True)


def make_batch(g: torch.Generator, dev: torch.device, v: int, nb: int, kmax: int, mode: str,
               k_fixed: int | None = None):
    """(drafts, qs, p) for nb requests with k in 0..kmax drafts (or k_fixed). mode: drafted (q rows),
    point (None), mixed, views (the DFlash layout: each q a view of one tensor)."""
    gd = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    ks = [k_fixed if k_fixed is not None else int(torch.randint(0, kmax + 1, (1,), generator=g))
          for _ in range(nb)]
    p = _rand_probs(sum(ks) + nb, v, gd, dev)
    slots = max(ks) + 1
    qall = _rand_probs(nb * slots, v, gd, dev).view(nb, slots, v)
    drafts, qs, po = [], [], 0
    for b, k in enumerate(ks):
        point = mode == "point" or (mode == "mixed" and b % 2 == 1)
        q = None
        if not point:
            if b % 2 == 0:  # a draft model close to the target: long accepted runs
                qall[b, :k] = 0.8 * p[po:po + k] + 0.2 * qall[b, :k]
            q = qall[b, :k] if mode == "views" else qall[b, :k].clone()
            if k and b % 3 == 2:
                q[0] = p[po]  # residual exactly zero when draft 0 is rejected: falls back to p
        src = p[po:po + k] if point else q  # point masses: drafts from the target itself
        d = torch.multinomial(src, 1, generator=gd).squeeze(1).tolist() if k else []
        if point and k and b % 3 == 2:
            p[po] = 0.0
            p[po, d[0]] = 1.0  # p one-hot at the draft token: accepted surely
        drafts.append(d)
        qs.append(q)
        po += k + 1
    return drafts, qs, p


def run_cases(dev: torch.device, vocabs=(7, 300, 5000), trials: int = 3, batches=(1, 2, 3, 4, 5, 6),
              kmax: int = 5, k_fixed: int | None = None, min_agree: float = 0.99) -> dict:
    """Random batches in every mode and accept rule through both paths; returns counts (requests, same
    emitted token, accepted-count histogram)."""
    g = torch.Generator().manual_seed(1234)
    n = same = 0
    hist: dict[int, int] = {}
    for v in vocabs:
        for mode in ("drafted", "point", "mixed", "views"):
            for rule in RULES:
                for t in range(trials):
                    nb = batches[(t + len(mode) + v) % len(batches)]
                    ms, s_ = check_batch(g, dev, v, nb, kmax, mode, rule, seed=t, k_fixed=k_fixed)
                    n, same = n + len(ms), same + s_
                    for m in ms:
                        hist[m] = hist.get(m, 0) + 1
    assert same >= min_agree * n, (same, n)
    return {"requests": n, "same_token": same, "m_hist": dict(sorted(hist.items()))}


def check_batch(g: torch.Generator, dev: torch.device, v: int, nb: int, kmax: int, mode: str,
                rule: AcceptRule, seed: int = 0, k_fixed: int | None = None) -> tuple[list[int], int]:
    """One batch through both paths; m equal, tokens of positive probability. (the m's, same tokens)."""
    drafts, qs, p = make_batch(g, dev, v, nb, kmax, mode, k_fixed)

    def gens():
        return [torch.Generator(device=dev).manual_seed(1000 * seed + b) for b in range(nb)]

    sampling.USE_KERNEL = False
    try:
        ref = sampling.accept_sampled_batch(drafts, qs, p, gens(), rule)
    finally:
        sampling.USE_KERNEL = True
    got = sampling.accept_sampled_batch(drafts, qs, p, gens(), rule)
    same, po, ms = 0, 0, []
    for b, ((mr, tr), (mg, tg)) in enumerate(zip(ref, got, strict=True)):
        k = len(drafts[b])
        ctx = (v, mode, rule, b, drafts[b])
        assert mg == mr, (ctx, mr, mg)
        assert tg[:-1] == tr[:-1] == drafts[b][:mr], ctx
        row = p[po + mg].cpu()
        if mg < k:
            qrow = qs[b][mg].cpu() if qs[b] is not None else None
            dist = _dist(row, qrow, drafts[b][mg], rule)
        else:
            dist = _dist(row, None, None, rule)
        assert 0 <= tg[-1] < v and dist[tg[-1]] > 0, (ctx, tg[-1], tr[-1])
        same += tg[-1] == tr[-1]
        ms.append(mg)
        po += k + 1
    return ms, same
