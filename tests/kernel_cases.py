"""Kernel-vs-reference cases shared by the CPU interpreter test and the GPU test (`run_all`).

Every case draws fresh random inputs (never zeros), compares ||out - ref|| / ||ref|| against a tolerance
for the dtype, checks outputs are finite, and for the cache-writing kernels starts from a random cache and
checks that exactly the addressed slots changed (negative slots are skipped).
"""

from __future__ import annotations

import torch

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check(name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert bool(torch.isfinite(a).all()), f"{name}: non-finite output"
    e = rel(a, b)
    assert e <= tol, f"{name}: rel err {e:.3g} > {tol:.3g}"


def _tables(p: int, d: int, dt, dev, g):
    ang = torch.rand(p, d // 2, generator=g, device=dev) * 6.28
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dt)
    return cos, sin


def run_all(dev: torch.device, dtypes, norm, activation, rope, kv_store, gemv, tol: float | None = None) -> None:
    g = torch.Generator(device=dev).manual_seed(1234)

    def rn(*shape, dt, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    big = dev.type == "cuda"  # the interpreter (CPU) runs each program in numpy: small shapes only there
    for dt in dtypes:
        t = tol or TOL[dt]
        if norm is not None:  # the elementwise kernels (None: the GEMM cases only)
            for m, h in ((1, 64), (5, 100)) + (((33, 2560),) if big else ()):
                x, r, w = rn(m, h, dt=dt), rn(m, h, dt=dt), (1 + rn(h, dt=torch.float32, scale=0.2)).to(dt)
                a, ar = norm.add_rms_norm(x, r, w, 1e-6)
                b, br = norm.add_rms_norm_ref(x, r, w, 1e-6)
                _check(f"add_rms_norm {dt} {m}x{h}", a, b, t)
                _check(f"add_rms_norm residual {dt} {m}x{h}", ar, br, t)
                a0, a0r = norm.add_rms_norm(x, None, w, 1e-6)
                _check(f"rms_norm {dt} {m}x{h}", a0, norm.rms_norm_ref(x, w, 1e-6), t)
                assert a0r is x
                gu = rn(m, 2 * h, dt=dt, scale=3.0)
                _check(f"swiglu {dt} {m}x{h}", activation.swiglu(gu), activation.swiglu_ref(gu), t)
            rope_cases = ((3, 4, 2, 16), (4, 0, 2, 32)) + (((5, 32, 8, 128), (2, 0, 8, 128)) if big else ((2, 4, 1, 128),))
            for tok, nq, nkv, d in rope_cases:
                qkv = rn(tok, (nq + 2 * nkv) * d, dt=dt, scale=2.0)
                qw, kw = (1 + rn(d, dt=torch.float32, scale=0.2)).to(dt), (1 + rn(d, dt=torch.float32, scale=0.2)).to(dt)
                cos, sin = _tables(97, d, dt, dev, g)
                pos = torch.randint(0, 97, (tok,), generator=g, device=dev)
                a = rope.qk_norm_rope(qkv, qw, kw, 1e-6, cos, sin, pos, nq, nkv, d)
                b = rope.qk_norm_rope_ref(qkv, qw, kw, 1e-6, cos, sin, pos, nq, nkv, d)
                for name, x, y in zip("qkv", a, b, strict=True):
                    if y is None:
                        assert x is None
                    else:
                        _check(f"qk_norm_rope {name} {dt} t={tok} nq={nq} d={d}", x, y, t)
                slots = torch.randperm(4 * tok + 3, generator=g, device=dev)[:tok]
                slots[-1] = -1  # skipped row
                kc, vc = rn(4 * tok + 3, nkv, d, dt=dt), rn(4 * tok + 3, nkv, d, dt=dt)
                kc2, vc2 = kc.clone(), vc.clone()
                if nq:
                    a = rope.qk_norm_rope(qkv, qw, kw, 1e-6, cos, sin, pos, nq, nkv, d, (kc, vc, slots))
                    b = rope.qk_norm_rope_ref(qkv, qw, kw, 1e-6, cos, sin, pos, nq, nkv, d, (kc2, vc2, slots))
                    assert a[1] is None and a[2] is None
                    _check(f"qk_norm_rope+store q {dt}", a[0], b[0], t)
                else:
                    ka, va = rope.k_norm_rope(qkv, kw, 1e-6, cos, sin, pos, nkv, d, (kc, vc, slots))
                    rope.k_norm_rope_ref(qkv, kw, 1e-6, cos, sin, pos, nkv, d, (kc2, vc2, slots))
                    assert ka is None and va is None
                _check(f"rope store k-cache {dt} nq={nq}", kc, kc2, t)
                assert torch.equal(vc, vc2), "v is copied, never rounded"
                k, v = rn(tok, nkv, d, dt=dt), rn(tok, nkv, d, dt=dt)
                kv_store.kv_store(k, v, kc, vc, slots)
                kv_store.kv_store_ref(k, v, kc2, vc2, slots)
                assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "kv_store is a copy"
        if gemv is None:
            continue
        shapes = ((1, 64, 48, False), (7, 100, 40, True), (16, 256, 96, False), (3, 128, 64, True), (33, 96, 40, True))
        if big:
            shapes += ((1, 2560, 6144, False), (9, 2560, 9728, True), (16, 1024, 3072, False))
        for m, k, n, sw in shapes:
            x, r = rn(m, k, dt=dt), rn(m, k, dt=dt)
            gw = (1 + rn(k, dt=torch.float32, scale=0.2)).to(dt)
            w = rn(2 * n if sw else n, k, dt=dt, scale=k ** -0.5)
            y, res = gemv.add_norm_linear(x, r, gw, w, 1e-6, sw)
            y2, res2 = gemv.add_norm_linear_ref(x, r, gw, w, 1e-6, sw)
            _check(f"add_norm_linear {dt} m={m} k={k} n={n} swiglu={sw}", y, y2, t)
            _check(f"add_norm_linear residual {dt} m={m}", res, res2, t)
            y3, res3 = gemv.add_norm_linear(x, None, gw, w, 1e-6, sw)
            _check(f"add_norm_linear no-residual {dt} m={m}", y3, gemv.add_norm_linear_ref(x, None, gw, w, 1e-6, sw)[0], t)
            assert res3 is x
            yl = gemv.linear(x, w)
            _check(f"linear {dt} m={m} k={k} n={w.shape[0]}", yl, gemv.linear_ref(x, w), t)
            if m > 1:  # a row's result does not depend on the values of the rows beside it
                x2, r2 = x.clone(), r.clone()
                x2[1:], r2[1:] = rn(m - 1, k, dt=dt), rn(m - 1, k, dt=dt)
                y2b, _ = gemv.add_norm_linear(x2, r2, gw, w, 1e-6, sw)
                assert torch.equal(y2b[:1], y[:1]), f"add_norm_linear {dt} m={m}: row 0 depends on the other rows"
                assert torch.equal(gemv.linear(x2, w)[:1], yl[:1]), f"linear {dt} m={m}: row 0 depends on the other rows"
            # batch invariance (the row count does not matter): the GEMV always; the skinny GEMM within a row tile
            bm = getattr(gemv, "block_m", None)
            if m > 1 and (bm is None or bm(1) == bm(m)):
                y1, _ = gemv.add_norm_linear(x[:1], r[:1], gw, w, 1e-6, sw)
                assert torch.equal(y1, y[:1]), f"add_norm_linear {dt} m={m}: row 0 depends on the batch"
                assert torch.equal(gemv.linear(x[1:2], w), yl[1:2]), f"linear {dt} m={m}: row 1 depends on the batch"
