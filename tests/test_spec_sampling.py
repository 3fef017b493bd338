"""Speculative sampling is exact: the emitted token of a step is distributed as the target's p.

Analytic check of the rule on random small vocabularies, then the implementation (accept_sampled, with
its real generator draws) against p by Monte Carlo, and each sampling fault visibly biased.
"""

import pytest
import torch

from specbench.engine import LLM, SamplingParams
from specbench.engine.spec.sampling import accept_sampled, emitted_distribution


def _rand_dist(v, g, peaky=1.0):
    return torch.softmax(torch.randn(v, generator=g) * peaky, -1)


@pytest.mark.parametrize("seed", range(5))
def test_analytic_output_distribution_equals_p(seed):
    g = torch.Generator().manual_seed(seed)
    p, q = _rand_dist(6, g, 2.0), _rand_dist(6, g, 2.0)
    assert torch.allclose(emitted_distribution(p, q), p, atol=1e-6)
    onehot = torch.zeros(6)
    onehot[2] = 1.0  # a deterministic (n-gram) proposal
    assert torch.allclose(emitted_distribution(p, onehot), p, atol=1e-6)


def _mc_first_token(p, q, faults=frozenset(), n=20000, k=2):
    """Empirical distribution of the token emitted at the first position over n steps."""
    g = torch.Generator().manual_seed(1)
    v = p.shape[1]
    counts = torch.zeros(v)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        _, toks = accept_sampled(drafts, q, p, g, frozenset(faults))
        counts[toks[0]] += 1
    return counts / n


def test_implementation_matches_p_and_faults_do_not():
    g = torch.Generator().manual_seed(7)
    p = torch.stack([_rand_dist(4, g, 1.5) for _ in range(3)])
    q = torch.stack([_rand_dist(4, g, 1.5) for _ in range(2)])
    emp = _mc_first_token(p, q)
    tv = 0.5 * (emp - p[0]).abs().sum().item()
    assert tv < 0.02, f"TV(spec, p) = {tv:.4f}"  # 20k draws: sampling noise TV ~ 0.006
    for fault in ("biased_accept", "resample_from_p"):
        bad = _mc_first_token(p, q, {fault})
        assert 0.5 * (bad - p[0]).abs().sum().item() > 0.03, fault


def test_sampled_requests_speculate_and_are_seeded(tiny_target, tiny_draft):
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=128)
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    a = llm.generate(["Question: Tom has 3 apples.\nAnswer:"], sp)[0]
    b = llm.generate(["Question: Tom has 3 apples.\nAnswer:"], sp)[0]
    assert a.output_ids == b.output_ids  # the request's own seeded generator
    assert a.spec["num_drafts"] > 0  # sampled requests speculate (not span-1 rows)
