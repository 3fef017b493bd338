"""Speculative sampling is exact at EVERY position of a verify run and for the bonus row, at T != 1, with a
q that is not one-hot (#18 item 7).

A tiny Markov "model" on V = 5 tokens: the target's row after token v is sampling_probs_rows(L_p[v]) under
the request's transform (T, top_k), the drafter's q(. | v) a tempered softmax of other logits. Each of N
requests drafts d_0..d_{k-1} sequentially from q, the target rows are p(. | start), p(. | d_0), ...,
p(. | d_{k-1}), and `accept_sampled_batch` (the torch path) resolves all N at once. For every position j
and every previous token v, the token emitted at position j by the requests that reached j after v must be
distributed as p(. | v) (reaching j depends only on earlier drafts, and d_j | d_{j-1} = v is q(. | v), so
the rejection-sampling lemma applies per position); position k is the bonus row. Chi-square per (j, v),
Bonferroni over the family. The two q/bonus faults must fail the same check.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from specbench.engine import SamplingParams
from specbench.engine.faults import make_faults
from specbench.engine.sampler import sampling_probs_rows
from specbench.engine.spec.sampling import LOSSLESS, accept_sampled_batch

V, K, START = 5, 3, 0


def _chain(temp: float, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(V, V, generator=g) * 1.5
    lq = lp + torch.randn(V, V, generator=g) * 1.0  # a drafter close to the target, not equal
    params = [SamplingParams(temperature=temp, top_k=top_k)] * V
    p = sampling_probs_rows(lp, params)  # p[v] = the target's transformed row after token v
    q = torch.softmax(lq / 1.2, -1)  # drafting temperature 1.2: every token has mass (q never one-hot)
    return p, q


def _run(p, q, n: int, seed: int, rule=LOSSLESS):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.empty(n, K, dtype=torch.long)
    prev = torch.full((n,), START, dtype=torch.long)
    for i in range(K):
        drafts[:, i] = torch.multinomial(q[prev], 1, generator=g).squeeze(1)
        prev = drafts[:, i]
    ctx = torch.cat([torch.full((n, 1), START, dtype=torch.long), drafts], 1)  # row j's previous token
    prow = p[ctx].reshape(n * (K + 1), V)
    qs = list(q[ctx[:, :K]])  # request b's [K, V] draft rows
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + b) for b in range(n)]
    out = accept_sampled_batch(drafts.tolist(), qs, prow, gens, rule, kernel=False)
    return out


def _check(p, out, alpha: float):
    """(min p-value, Bonferroni level, per-position sample counts): chi-square of x_j | x_{j-1} = v vs p[v]."""
    counts = torch.zeros(K + 1, V, V)  # [position, previous token, token]
    for _, toks in out:
        prev = START
        for j, t in enumerate(toks):
            counts[j, prev, t] += 1
            prev = t
    pvals, reached = [], [int(counts[j].sum()) for j in range(K + 1)]
    for j in range(K + 1):
        for v in range(V):
            c = counts[j, v]
            n = float(c.sum())
            if n < 200:
                continue
            e = p[v] * n
            keep = e > 0
            assert c[~keep].sum() == 0, f"position {j}: a token outside the target's support was emitted"
            stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
            pvals.append(float(chi2.sf(stat, int(keep.sum()) - 1)))
    return min(pvals), alpha / max(len(pvals), 1), reached


@pytest.mark.parametrize("temp,top_k", [(0.6, 0), (1.3, 4), (1.0, 3)])
def test_every_position_and_bonus_row_is_distributed_as_p(temp, top_k):
    p, q = _chain(temp, top_k, seed=int(temp * 10) + top_k)
    out = _run(p, q, n=30000, seed=1)
    pmin, level, reached = _check(p, out, alpha=1e-3)
    assert reached[K] > 2000, reached  # the bonus row was drawn often (fully accepted runs)
    assert reached[K] < reached[0] * 0.9, reached  # and rejections happened
    assert pmin > level, (pmin, level, reached)


@pytest.mark.parametrize("fault,position", [("q_next_row", None), ("bonus_residual", K)])
def test_q_and_bonus_faults_fail_the_position_check(fault, position):
    p, q = _chain(1.3, 4, seed=17)
    out = _run(p, q, n=30000, seed=2, rule=make_faults((fault,)).accept_rule)
    pmin, level, _ = _check(p, out, alpha=1e-3)
    assert pmin < level * 1e-3, (fault, pmin)
    if position is not None:  # bonus_residual moves only the bonus row: positions < K still exact
        short = [(m, toks[:K]) for m, toks in out]
        counts_ok = _check(p, short, alpha=1e-3)
        assert counts_ok[0] > counts_ok[1], counts_ok
