"""Speculative sampling is exact: the emitted token of a step is distributed as the target's p.

Analytic check of the rule on random small vocabularies, then the implementation (accept_sampled, with
its real generator draws) against p by Monte Carlo, and each sampling fault visibly biased.
"""

import pytest
import torch

from specbench.engine import LLM, SamplingParams
from specbench.engine.faults import make_faults
from specbench.engine.sampler import draw_rows, sampling_probs, sampling_probs_rows
from specbench.engine.spec.sampling import accept_sampled, accept_sampled_batch, emitted_distribution


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
        _, toks = accept_sampled(drafts, q, p, g, make_faults(tuple(faults)).accept_rule)
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


def test_batch_equals_one_request_at_a_time():
    """The batched resolve (one host read) gives each request exactly what resolving it alone gives, for
    drafted q, point masses (q None) and a request with no drafts, under the same generator seeds."""
    g = torch.Generator().manual_seed(3)
    v, ks = 7, [3, 2, 0, 4]
    ps = [torch.stack([_rand_dist(v, g, 1.0) for _ in range(k + 1)]) for k in ks]
    qs = [torch.stack([_rand_dist(v, g, 1.0) for _ in range(k)]) if k and i != 1 else None for i, k in enumerate(ks)]
    for trial in range(30):
        drafts = [[int(t) for t in torch.randint(0, v, (k,), generator=g)] for k in ks]
        one = [accept_sampled(d, q, p, torch.Generator().manual_seed(100 * trial + i))
               for i, (d, q, p) in enumerate(zip(drafts, qs, ps, strict=True))]
        gens = [torch.Generator().manual_seed(100 * trial + i) for i in range(len(ks))]
        assert accept_sampled_batch(drafts, qs, torch.cat(ps), gens) == one


def test_draft_probs_views_are_indexed_in_place():
    """q's handed out as views of one tensor (the DFlash proposer's layout) give the same result as copies."""
    g = torch.Generator().manual_seed(4)
    v, ks, slots = 9, [3, 1, 2], 4
    qall = torch.softmax(torch.randn(len(ks) * slots, v, generator=g), -1).view(len(ks), slots, v)
    ps = torch.cat([torch.softmax(torch.randn(k + 1, v, generator=g), -1) for k in ks])
    views = [qall[j, :k] for j, k in enumerate(ks)]
    copies = [t.clone() for t in views]
    for trial in range(20):
        drafts = [[int(t) for t in torch.randint(0, v, (k,), generator=g)] for k in ks]
        a = accept_sampled_batch(drafts, views, ps, [torch.Generator().manual_seed(trial * 10 + i) for i in range(3)])
        b = accept_sampled_batch(drafts, copies, ps, [torch.Generator().manual_seed(trial * 10 + i) for i in range(3)])
        assert a == b


def test_batched_first_tokens_match_p():
    """Monte Carlo over the batched path: every request's first emitted token follows its own p."""
    g = torch.Generator().manual_seed(11)
    v = 4
    ps = [torch.stack([_rand_dist(v, g, 1.5) for _ in range(3)]), torch.stack([_rand_dist(v, g, 1.5) for _ in range(3)]),
          _rand_dist(v, g, 1.5)[None]]
    q0 = torch.stack([_rand_dist(v, g, 1.5) for _ in range(2)])
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    n = 12000
    counts = torch.zeros(3, v)
    for _ in range(n):
        d0 = [int(torch.multinomial(q0[i], 1, generator=g)) for i in range(2)]
        d1 = [int(torch.randint(0, v, (1,), generator=g)) for _ in range(2)]  # any deterministic proposal
        out = accept_sampled_batch([d0, d1, []], [q0, None, None], torch.cat(ps), gens)
        for b, (_, toks) in enumerate(out):
            counts[b, toks[0]] += 1
    for b in range(3):
        tv = 0.5 * (counts[b] / n - ps[b][0]).abs().sum().item()
        assert tv < 0.025, f"request {b}: TV = {tv:.4f}"  # 12k draws: noise TV ~ 0.008


def _top_p_by_sort(x, prm):
    probs = torch.softmax(x.float() / prm.temperature, -1)
    sp, order = probs.sort(dim=-1, descending=True)
    sp = sp.masked_fill((sp.cumsum(-1) - sp) >= prm.top_p, 0.0)
    out = torch.zeros_like(probs).scatter(-1, order, sp)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaky: nucleus inside the top-k candidates; flat: full sort
def test_top_p_candidates_equal_full_sort(scale):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 5000, generator=g) * scale
    prm = SamplingParams(temperature=0.9, top_p=0.8)
    assert torch.allclose(sampling_probs(x, prm), _top_p_by_sort(x, prm), atol=1e-7)


def test_rows_helpers():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 50, generator=g)
    a, b = SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=5)
    mixed = sampling_probs_rows(x, [a, b, a, b, b, a])
    for i, prm in enumerate([a, b, a, b, b, a]):
        assert torch.equal(mixed[i], sampling_probs(x[i:i + 1], prm)[0])
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    assert draw_rows(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]  # zero-probability tokens never drawn
    assert draw_rows(probs, torch.tensor([0.6, 0.99])).tolist() == [3, 3]
    u = torch.rand(20000, generator=g)
    emp = torch.bincount(draw_rows(probs[1:].expand(20000, 4), u), minlength=4) / 20000
    assert (emp - 0.25).abs().max() < 0.02
    # Across chunks (vocabulary > DRAW_CHUNK, not a multiple of it): inverse CDF by a full scan agrees.
    big = torch.softmax(torch.randn(8, 3000, generator=g) * 3, -1)
    big[:, 1024:2048] = 0.0  # a whole empty chunk
    big /= big.sum(-1, keepdim=True)
    uu = torch.rand(8, generator=g)
    full = torch.searchsorted(big.cumsum(-1), (uu * big.sum(-1)).unsqueeze(-1), right=True).squeeze(-1)
    got = draw_rows(big, uu)
    assert (big[torch.arange(8), got] > 0).all()
    assert (got == full).sum() >= 7  # the same token but for a rare fp32 tie at a chunk boundary
    many = torch.rand(40000, generator=g)
    emp = torch.bincount(draw_rows(big[:1].expand(40000, 3000), many), minlength=3000) / 40000
    assert 0.5 * (emp - big[0]).abs().sum() < 0.05


def test_sampled_requests_speculate_and_are_seeded(tiny_target, tiny_draft):
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=128)
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    a = llm.generate(["Question: Tom has 3 apples.\nAnswer:"], sp)[0]
    b = llm.generate(["Question: Tom has 3 apples.\nAnswer:"], sp)[0]
    assert a.output_ids == b.output_ids  # the request's own seeded generator
    assert a.spec["num_drafts"] > 0  # sampled requests speculate (not span-1 rows)


def test_sampled_single_picks_are_batched_and_follow_p(tiny_target):
    """Spec off, T > 0: every sampled decode pick and prefill completion of a step comes from one batched
    draw (no per-request `select`), is seeded per request, independent of its batch neighbours, and its
    first token follows the transformed distribution of the prompt's last logits."""
    import specbench.engine.accept_step as accept_mod
    import specbench.engine.sampler as sampler_mod

    assert not hasattr(accept_mod, "select")  # the accept phase has no per-request draw to fall back to
    llm = LLM(tiny_target, num_pages=256)
    prompt = "Question: Tom has 3 apples.\nAnswer:"
    calls = []
    real = sampler_mod.select
    sampler_mod.select = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        sp = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
        together = [o.output_ids for o in llm.generate([prompt] * 3, sp)]
        alone = [llm.generate([prompt], [p])[0].output_ids for p in sp]
    finally:
        sampler_mod.select = real
    assert calls == [] and together == alone  # batched, seeded, neighbour-independent
    # First-token distribution over many seeds against p = softmax(last prompt logits).
    eng = llm.engine
    params = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True, logprobs=0)
    n = 600
    outs = llm.generate([prompt] * n, [params.with_(seed=1000 + i) for i in range(n)])
    counts = torch.bincount(torch.tensor([o.output_ids[0] for o in outs]), minlength=eng.mcfg.vocab_size).float()
    # p at T = 1 is the raw softmax: a greedy request's top-20 logprobs of its first position give it.
    top = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=20))[0].logprobs[0][1]
    p_top = {t: float(torch.tensor(v).exp()) for t, v in top.items()}
    emp = counts / n
    worst = max(abs(emp[t].item() - p) for t, p in p_top.items())
    assert max(p_top.values()) > 0.1 and worst < 0.06, f"first-token frequency off by {worst:.3f} from p (600 seeds; noise ~0.02)"
