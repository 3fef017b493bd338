"""DFlash2's candidate-selector walk for a whole batch in one launch (one program per draft block).

The torch reference is `specbench.engine.spec.selector.greedy_path` / `sampled_path` with the kernel off
(per slot an embedding of the predecessor's codebook row, one of the K candidates' rows, an einsum and an
argmax or a softmax + cumsum + searchsorted: S x ~6 launches for S = B - 1 slots); this kernel computes the
same function. Per block n, from the anchor p_0 = anchor[n], for slot j = 0..S-1:
    a = A[p_j] (fp32) * proj[n, j]                     (A: predecessor codebook [V, R], proj fp32 [N, S, R])
    s_k = unary[n, j, k] + sum_r a_r * B[ids[n, j, k], r]   (B: successor codebook [V, R])
  greedy: k* = the first k with the largest s_k (torch.argmax's tie rule), p_{j+1} = ids[n, j, k*];
  sampled (temps [N] > 0, u [N, S] in [0, 1)): q = softmax(s / T) over the K candidates, cdf its running
  sum, k* = #{k : cdf_k <= u[n, j] * cdf_{K-1}} clamped to K - 1 (searchsorted(right=True)); q [N, S, K] is
  written out (the caller scatters it over the vocabulary: the draft distribution rejection sampling uses).
The codebook rows are read in their stored dtype and widened to fp32 (exact), the products and sums are
fp32, the division by T round-to-nearest as torch's: the scores equal the reference's up to the order of
the fp32 sum over R (the reference's einsum is a GEMM), so the chosen candidates are the same except where
two scores (or a uniform and a CDF boundary) are within fp32 rounding of each other; q equals the
reference's to fp32 rounding. Exact ties (equal inputs) resolve as torch's: the earlier candidate.
Capture-safe: no host syncs, no allocation but the outputs.
"""

from __future__ import annotations

import torch

from . import triton_importable

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _selector_walk_kernel(unary_ptr, ids_ptr, proj_ptr, anchor_ptr, pred_ptr, succ_ptr, temp_ptr, u_ptr,
                              out_ptr, q_ptr, S, K, R, su0, su1, si0, si1, sp0, sp1, s_pred, s_succ, s_u0,
                              SAMPLED: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, KP)
        rr = tl.arange(0, RP)
        kin = kk < K
        rin = rr < R
        bmask = kin[:, None] & rin[None, :]
        prev = tl.load(anchor_ptr + n).to(tl.int64)
        t = 1.0
        if SAMPLED:
            t = tl.load(temp_ptr + n).to(tl.float32)
        for j in range(0, S):
            ids = tl.load(ids_ptr + n * si0 + j * si1 + kk, mask=kin, other=0).to(tl.int64)
            un = tl.load(unary_ptr + n * su0 + j * su1 + kk, mask=kin, other=0.0).to(tl.float32)
            pj = tl.load(proj_ptr + n * sp0 + j * sp1 + rr, mask=rin, other=0.0).to(tl.float32)
            a = tl.load(pred_ptr + prev * s_pred + rr, mask=rin, other=0.0).to(tl.float32) * pj
            b = tl.load(succ_ptr + ids[:, None] * s_succ + rr[None, :], mask=bmask, other=0.0).to(tl.float32)
            s = un + tl.sum(a[None, :] * b, 1)
            if SAMPLED:
                x = tl.where(kin, tl.div_rn(s, t), float("-inf"))
                e = tl.where(kin, tl.exp(x - tl.max(x, 0)), 0.0)
                q = tl.div_rn(e, tl.sum(e, 0) + tl.zeros_like(e))
                cdf = tl.cumsum(q, 0)
                total = tl.sum(tl.where(kk == K - 1, cdf, 0.0), 0)
                target = tl.load(u_ptr + n * s_u0 + j).to(tl.float32) * total
                idx = tl.minimum(tl.sum(tl.where(kin & (cdf <= target), 1, 0), 0), K - 1)
                tl.store(q_ptr + (n * S + j) * K + kk, q, mask=kin)
            else:
                s = tl.where(kin, s, float("-inf"))
                idx = tl.min(tl.where(s == tl.max(s, 0), kk, KP - 1), 0)
            prev = tl.sum(tl.where(kk == idx, ids, 0), 0)
            tl.store(out_ptr + n * S + j, prev)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def selector_walk(unary: torch.Tensor, ids: torch.Tensor, proj: torch.Tensor, anchor: torch.Tensor,
                  pred: torch.Tensor, succ: torch.Tensor, temps: torch.Tensor | None = None,
                  u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drafts [N, S] int64, q [N, S, K] fp32 or None), one launch for the whole batch.

    unary [N, S, K] fp32 and ids [N, S, K] (int64 or int32): each slot's candidates, descending by logit;
    proj [N, S, R] fp32: project(h); anchor [N]: the verified tokens; pred / succ [V, R] (any float dtype):
    the codebooks. Greedy without `temps`; with temps [N] (> 0) and u [N, S] the inverse-CDF walk, whose
    per-slot q over the K candidates comes back as the second value."""
    n, s, k = ids.shape
    r = pred.shape[1]
    if unary.shape != ids.shape or proj.shape != (n, s, r) or anchor.shape != (n,) or succ.shape[1] != r:
        raise ValueError(f"selector_walk: shapes unary {tuple(unary.shape)}, ids {tuple(ids.shape)}, proj "
                         f"{tuple(proj.shape)}, anchor {tuple(anchor.shape)}, pred {tuple(pred.shape)}, succ "
                         f"{tuple(succ.shape)} do not agree (expected [N, S, K] x2, [N, S, R], [N], [V, R] x2)")
    sampled = temps is not None
    if temps is not None and (u is None or temps.shape != (n,) or u.shape != (n, s)):
        raise ValueError(f"selector_walk: the sampled walk needs temps [N] and u [N, S] (N={n}, S={s}), got "
                         f"{None if temps is None else tuple(temps.shape)} and {None if u is None else tuple(u.shape)}")
    dev = ids.device
    out = torch.empty(n, s, dtype=torch.long, device=dev)
    q = torch.empty(n, s, k, dtype=torch.float32, device=dev) if sampled else None
    if n == 0 or s == 0:
        return out, q
    unary, ids, proj, pred, succ = _rows(unary), _rows(ids), _rows(proj), _rows(pred), _rows(succ)
    if sampled:
        assert temps is not None and u is not None and q is not None
        temps, u = temps.float().contiguous(), _rows(u.float())
    else:
        temps = u = unary  # never read
    kp = max(2, triton.next_power_of_2(k))
    rp = max(16, triton.next_power_of_2(r))
    _selector_walk_kernel[(n,)](unary, ids, proj, anchor.contiguous(), pred, succ, temps, u, out,
                                q if q is not None else out, s, k, r, unary.stride(0), unary.stride(1),
                                ids.stride(0), ids.stride(1), proj.stride(0), proj.stride(1), pred.stride(0),
                                succ.stride(0), u.stride(0), SAMPLED=sampled, KP=kp, RP=rp,
                                num_warps=4 if kp * rp >= 2048 else 2)
    return out, q
