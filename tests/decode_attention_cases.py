"""Cases for the split-K paged decode attention (kernels/decode_attention.py), shared by the CPU interpreter test
and the GPU test: random paged caches with shuffled page tables, ragged lengths, padding rows.

A row of a case is an int >= 0 (a request with that many keys on fresh pages; 0 = no pages, output zeros) or
"dummy" (a graph padding row: one key on the dummy page, the last page). With nan_unused every cache slot no
real row reads is NaN (stale pages, the tail of a last page), so a kernel reading past a request's keys shows.
"""

from __future__ import annotations

import torch


def make_case(dev: torch.device, dt: torch.dtype, rows: list, hq: int, hkv: int, d: int, ps: int, seed: int,
              nan_unused: bool = True, nan_dummy: bool = False):
    g = torch.Generator(device=dev).manual_seed(seed)
    need = [-(-r // ps) if r != "dummy" else 0 for r in rows]
    npages = sum(need) + 3  # two spare pages (never read) and the dummy page, last
    dummy = npages - 1
    free = torch.randperm(npages - 1, generator=g, device=dev).tolist()
    ptr, idx, lens = [0], [], []
    used = torch.zeros(npages * ps, dtype=torch.bool)
    for r, n in zip(rows, need, strict=True):
        if r == "dummy":
            pages, length = [dummy], 1
        else:
            pages, free, length = free[:n], free[n:], r
        idx += pages
        ptr.append(len(idx))
        lens.append(length)
        pos = torch.arange(length)
        used[torch.tensor(pages, dtype=torch.long)[pos // ps] * ps + pos % ps] = True
    kc = torch.randn(npages * ps, hkv, d, generator=g, device=dev).to(dt)
    vc = torch.randn(npages * ps, hkv, d, generator=g, device=dev).to(dt)
    bad = ~used if nan_unused else torch.zeros_like(used)
    if nan_dummy:
        bad[dummy * ps:] = True
    bad = bad.to(dev)
    kc[bad] = float("nan")
    vc[bad] = float("nan")
    q = (torch.randn(len(rows), hq, d, generator=g, device=dev) * 2).to(dt)
    i32 = dict(dtype=torch.int32, device=dev)
    return q, kc, vc, torch.tensor(lens, **i32), torch.tensor(ptr, **i32), torch.tensor(idx, **i32)


def check(da, dev: torch.device, dt: torch.dtype, rows: list, hq: int, hkv: int, d: int, ps: int, splits: int,
          tol: float, seed: int = 0, tile: int | None = None, nan_dummy: bool = False,
          fused: bool | None = None) -> float:
    """Kernel vs reference on one case; returns the max abs error over the rows it checks. `fused`: the merge
    inside the split kernel (True), the separate merge launch (False), the default (None). A second call on the
    same scratch must give the same bits and leave the fused merge's arrival counters at 0."""
    q, kc, vc, lens, ptr, idx = make_case(dev, dt, rows, hq, hkv, d, ps, seed, nan_dummy=nan_dummy)
    scale = d ** -0.5
    ref = da.decode_attention_ref(q, kc, vc, lens, ptr, idx, ps, scale)
    part = None
    ncnt = len(rows) * hkv
    if splits > 1:  # stale scratch must not matter: every program writes its partial
        part = da.alloc_partials(len(rows), hkv, hq // hkv, d, splits, dev)
        part[:-ncnt].fill_(float("nan"))
    out = da.decode_attention(q, kc, vc, lens, ptr, idx, ps, scale, splits, part, tile=tile, fused_merge=fused)
    what = f"rows={rows if len(rows) < 8 else len(rows)} hq={hq} hkv={hkv} d={d} ps={ps} splits={splits} {dt} {fused=}"
    if part is not None:
        assert bool((part.view(torch.int32)[-ncnt:] == 0).all()), f"{what}: arrival counters not reset"
        again = da.decode_attention(q, kc, vc, lens, ptr, idx, ps, scale, splits, part, tile=tile, fused_merge=fused)
        assert torch.equal(again, out) or bool(torch.isnan(out).any()), f"{what}: a second launch differs"
    assert out.shape == q.shape and out.dtype == q.dtype, what
    keep = [i for i, r in enumerate(rows) if not (nan_dummy and r == "dummy")]
    o, r = out[keep].float(), ref[keep].float()
    assert bool(torch.isfinite(o).all()), f"{what}: non-finite output"
    for i, row in enumerate(rows):
        if row == 0:
            assert bool((out[i] == 0).all()), f"{what}: a length-0 row is not zeros"
    err = float((o - r).abs().max())
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"
    return err
