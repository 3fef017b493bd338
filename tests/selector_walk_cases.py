"""The one-launch selector walk (kernels/selector_walk.py) against the torch walk (engine/spec/selector.py
`greedy_path` / `sampled_path` with the kernel off), shared by the CPU interpreter test
(tests/test_selector_walk_cpu.py) and the GPU test (tests/gpu/test_dflash2_gpu.py).

The two compute the same scores but sum over the rank R in different orders (the reference's einsum is a
GEMM), so "equal" is checked as: the same chosen candidates at every slot, except where the reference's own
scores at the first differing slot are within fp32 rounding of each other (greedy), or its uniform lies within
rounding of a CDF boundary (sampled); `run_cases` returns how many such near-tie divergences it saw (0 on
every case here so far) and fails on any other difference. q is compared slot by slot up to the first
divergence (after it the two walks condition on different predecessors). Exact ties (equal inputs) must
resolve to the earlier candidate on both sides, which is checked against the candidate index itself.
"""

from __future__ import annotations

import torch

from specbench.engine.spec import selector as sel

NEAR = 1e-5  # relative: a "near tie" is closer than this (fp32 sums of a few hundred terms differ by ~1e-7)


def _inputs(dev, g, n, s, k, r, v, dt, scale=3.0):
    logits = torch.randn(n, s, v, generator=g, device=dev) * scale
    unary, ids = sel.candidates(logits, k)
    proj = torch.randn(n, s, r, generator=g, device=dev)
    pred = (torch.randn(v, r, generator=g, device=dev) * 0.5).to(dt)
    succ = (torch.randn(v, r, generator=g, device=dev) * 0.5).to(dt)
    anchor = torch.randint(0, v, (n,), generator=g, device=dev)
    return unary, ids, proj, anchor, pred, succ


def _scores(x, b, j, prev):
    unary, ids, proj, _, pred, succ = x
    return sel._edge(unary[b:b + 1, j], ids[b:b + 1, j], proj[b:b + 1, j], prev.view(1), pred, succ)[0]


def _prev(x, path, b, j):
    return x[3][b] if j == 0 else path[b, j - 1]


def check_greedy(name, x, got, ref) -> int:
    """Equal paths, or a divergence at a near tie of the reference's scores. Returns the near-tie count."""
    assert got.shape == ref.shape and got.dtype == torch.long, f"{name}: {got.shape} {got.dtype}"
    near = 0
    for b in range(ref.shape[0]):
        diff = (got[b] != ref[b]).nonzero()
        if diff.numel() == 0:
            continue
        j = int(diff[0])
        s = _scores(x, b, j, _prev(x, ref, b, j))
        ids = x[1][b, j]
        ka, kb = int((ids == got[b, j]).nonzero()[0]), int((ids == ref[b, j]).nonzero()[0])
        gap = float((s[ka] - s[kb]).abs())
        assert gap <= NEAR * max(1.0, float(s.abs().max())), \
            f"{name}: block {b} slot {j}: kernel {int(got[b, j])} vs torch {int(ref[b, j])}, score gap {gap:.3g}"
        near += 1
    return near


def check_sampled(name, x, temps, u, got, gq, ref, rq) -> int:
    """Equal draws and q (to fp32 rounding) up to the first divergence, which must be a uniform within rounding
    of the reference's CDF boundary. Returns the near-boundary count."""
    v = rq.shape[-1]
    assert got.shape == ref.shape and gq.shape == rq.shape, f"{name}: shapes"
    near = 0
    for b in range(ref.shape[0]):
        diff = (got[b] != ref[b]).nonzero()
        upto = ref.shape[1] if diff.numel() == 0 else int(diff[0]) + 1
        torch.testing.assert_close(gq[b, :upto], rq[b, :upto], atol=1e-6, rtol=1e-5, msg=f"{name}: q of block {b}")
        if diff.numel() == 0:
            continue
        j = int(diff[0])
        s = _scores(x, b, j, _prev(x, ref, b, j))
        cdf = torch.softmax(s / temps[b], -1).cumsum(-1)
        gap = float((cdf - u[b, j] * cdf[-1]).abs().min())
        assert gap <= NEAR, f"{name}: block {b} slot {j}: kernel {int(got[b, j])} vs torch {int(ref[b, j])}, " \
                            f"uniform {float(u[b, j]):.7f} is {gap:.3g} from a CDF boundary (v={v})"
        near += 1
    return near


def run_cases(dev: torch.device, big: bool = False, dtypes=(torch.float32, torch.bfloat16)) -> dict:
    """Every case through `selector_walk` and the torch walk; returns {'cases', 'slots', 'near'}."""
    from specbench.kernels.selector_walk import selector_walk

    g = torch.Generator(device=dev).manual_seed(1234)
    shapes = [(1, 7, 8, 32, 500), (3, 15, 16, 256, 2000), (5, 3, 5, 20, 100), (2, 4, 1, 7, 50)]
    if big:
        shapes += [(1, 15, 16, 256, 151936), (32, 15, 16, 256, 151936), (64, 7, 16, 256, 20000)]
    stats = {"cases": 0, "slots": 0, "near": 0}
    for dt in dtypes:
        for n, s, k, r, v in shapes:
            name = f"{dt} n{n} s{s} k{k} r{r} v{v}"
            x = _inputs(dev, g, n, s, k, r, v, dt)
            got, q = selector_walk(*x)
            assert q is None
            stats["near"] += check_greedy(name, x, got, sel.greedy_path(*x))
            # int32 candidate ids (FlashInfer's top-k) walk the same
            got32, _ = selector_walk(x[0], x[1].int(), *x[2:])
            assert torch.equal(got32, got), f"{name}: int32 ids"
            for temps in (torch.rand(n, generator=g, device=dev) * 1.7 + 0.3, torch.full((n,), 100.0, device=dev)):
                u = torch.rand(n, s, generator=g, device=dev)
                ref, rq = sel.sampled_path(*x, temps, u, v)
                dr, qk = selector_walk(*x, temps, u)
                assert qk is not None
                gq = torch.zeros(n, s, v, device=dev).scatter_(2, x[1], qk)
                stats["near"] += check_sampled(name + f" T~{float(temps[0]):.2f}", x, temps, u, dr, gq, ref, rq)
                torch.testing.assert_close(qk.sum(-1), torch.ones(n, s, device=dev))
            # the uniform's extremes: 0 (the first candidate of positive q) and just below 1 (the last)
            for uv in (0.0, 1.0 - 2 ** -24):
                u = torch.full((n, s), uv, device=dev)
                ref, rq = sel.sampled_path(*x, temps, u, v)
                dr, qk = selector_walk(*x, temps, u)
                assert qk is not None
                gq = torch.zeros(n, s, v, device=dev).scatter_(2, x[1], qk)
                stats["near"] += check_sampled(name + f" u={uv}", x, temps, u, dr, gq, ref, rq)
            # T -> 0: the draws are the greedy path
            dr, _ = selector_walk(*x, torch.full((n,), 1e-4, device=dev), torch.rand(n, s, generator=g, device=dev) * 0.5)
            stats["near"] += check_greedy(name + " T=1e-4", x, dr, got)
            stats["cases"] += 1
            stats["slots"] += n * s
        _ties(dev, g, dt, selector_walk)
    # no blocks, and bad shapes named
    x = _inputs(dev, g, 2, 3, 4, 8, 40, torch.float32)
    e = selector_walk(*(t[:0] if i in (0, 1, 2, 3) else t for i, t in enumerate(x)))[0]
    assert e.shape == (0, 3)
    try:
        selector_walk(x[0], x[1], x[2][:, :, :4], *x[3:])
    except ValueError as err:
        assert "proj" in str(err)
    else:
        raise AssertionError("a proj of the wrong rank was accepted")
    return stats


def _ties(dev, g, dt, selector_walk) -> None:
    """Exact ties: equal unary and equal successor rows give bit-equal scores on both sides; both must take the
    earlier candidate (torch.argmax's rule)."""
    n, s, k, r, v = 3, 6, 8, 24, 300
    unary, ids, proj, anchor, pred, succ = _inputs(dev, g, n, s, k, r, v, dt)
    succ, unary, ids = succ.clone(), unary.clone(), ids.clone()
    # the three sites get disjoint candidate tokens: with random top-k ids one site's token could be another's,
    # and its successor row, copied for the second tie, would break the first (seen on CUDA's random draws)
    for i, (b, j) in enumerate(((0, 2), (1, 1), (2, 4))):
        ids[b, j] = torch.arange(i * k, (i + 1) * k, device=dev, dtype=ids.dtype)
    # block 0 slot 2: every candidate the same (-> candidate 0); block 1 slot 1: candidates 2 and 5 tied and far
    # ahead of the rest (-> candidate 2); block 2 slot 4: candidates 0 and 1 tied on top (-> 0)
    c = ids[0, 2]
    succ[c] = succ[c[0]].clone()
    unary[0, 2] = 1.0
    succ[ids[1, 1, 5]] = succ[ids[1, 1, 2]].clone()
    unary[1, 1, 2] = unary[1, 1, 5] = 1e3
    succ[ids[2, 4, 1]] = succ[ids[2, 4, 0]].clone()
    unary[2, 4, 0] = unary[2, 4, 1] = 1e3
    x = (unary, ids, proj, anchor, pred, succ)
    ref = sel.greedy_path(*x)
    got, _ = selector_walk(*x)
    assert torch.equal(got, ref), f"ties {dt}: kernel {got.tolist()} vs torch {ref.tolist()}"
    assert int(got[0, 2]) == int(ids[0, 2, 0]) and int(got[1, 1]) == int(ids[1, 1, 2]) \
        and int(got[2, 4]) == int(ids[2, 4, 0]), \
        f"ties {dt}: the earlier candidate was not taken: {got[0, 2]}, {got[1, 1]}, {got[2, 4]} vs " \
        f"{ids[0, 2, 0]}, {ids[1, 1, 2]}, {ids[2, 4, 0]}"
