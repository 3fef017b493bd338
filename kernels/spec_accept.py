"""Speculative-sampling accept step for a whole batch in one launch (one program per request).

The torch reference is `specbench.engine.spec.sampling.accept_sampled_batch` with the kernel off (about 60
small launches, host-bound on a GPU); this kernel computes the same function. Per request b, with k_b
drafts (possibly 0) whose target rows start at poff[b] and whose uniforms start at the same offset:
  - ratio tests: accept draft i iff u[poff + i] < min(1, p_i(d_i) / max(q_i(d_i), 1e-20)), where q_i is
    row qrow[doff + i] of q, or a point mass at d_i when qrow is -1; m_b = the leading accepts;
  - the emitted token: inverse CDF at u[poff + k_b] over max(p_m - q_m, 0) (a point mass: p_m with the
    draft token zeroed) when m_b < k_b and that residual has mass, else over p_m (the bonus row when
    m_b = k_b). Two levels like `engine.sampler.draw_rows`: the chunk from the CDF of CHUNK-wide chunk
    sums, then the token inside that chunk; zero-probability tokens are never drawn.
Rule variants (constexpr switches, all off = the rule above): q_over_p (the ratio test uses q/p),
one_uniform (every ratio test of a request reads its first uniform), draw_from_p (the emitted token is
drawn from p_m even after a rejection). Each variant is lossy; they exist so that a caller can check
that its statistical tests detect a wrong accept rule.
The ratio uses round-to-nearest division, as torch does, so the accepted counts equal the reference's;
the drawn token differs only where fp32 rounding of the cumulative sums (added in another order) moves a
boundary across the uniform: rare. Layout: the ratio tests as one vector; a pass over the row (ROWS chunks
a tile) writing per-chunk sums of p_m and of the residual to a small scratch; the chunk from their CDF;
one more CHUNK-wide load for the token.
"""

from __future__ import annotations

import torch

from . import triton_importable

CHUNK = 1024  # vocabulary chunk of the two-level draw (engine.sampler.DRAW_CHUNK); V=151936 is 149 chunks
ROWS = 8  # chunks per tile of the sums pass (8192 tokens a step)

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _residual(p, q, idx, dm, point):
        """max(p - q, 0), or p with the draft token dm zeroed for a point mass."""
        return tl.where(point, tl.where(idx == dm, 0.0, p), tl.maximum(p - q, 0.0))

    @triton.jit
    def _spec_accept_kernel(p_ptr, q_ptr, tok_ptr, qrow_ptr, doff_ptr, k_ptr, poff_ptr, u_ptr, out_ptr,
                            sums_ptr, nb, V, sp, sq,
                            Q_OVER_P: tl.constexpr, ONE_UNIFORM: tl.constexpr, DRAW_FROM_P: tl.constexpr,
                            KMAX: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
                            NCHUNK: tl.constexpr):
        b = tl.program_id(0)
        k = tl.load(k_ptr + b)
        po = tl.load(poff_ptr + b)
        do = tl.load(doff_ptr + b)
        # Ratio tests, all k at once: m = the index of the first failed test (k when none failed).
        ii = tl.arange(0, KMAX)
        live = ii < k
        d = tl.load(tok_ptr + do + ii, mask=live, other=0)
        qr = tl.load(qrow_ptr + do + ii, mask=live, other=-1)
        pd = tl.load(p_ptr + (po + ii) * sp + d, mask=live, other=0.0).to(tl.float32)
        qd = tl.load(q_ptr + qr * sq + d, mask=live & (qr >= 0), other=1.0).to(tl.float32)
        qd = tl.maximum(qd, 1e-20)
        if Q_OVER_P:
            ratio = tl.div_rn(qd, tl.maximum(pd, 1e-20))
        else:
            ratio = tl.div_rn(pd, qd)
        ratio = tl.minimum(ratio, 1.0)
        if ONE_UNIFORM:
            ui = tl.load(u_ptr + po + ii * 0)
        else:
            ui = tl.load(u_ptr + po + ii, mask=live, other=1.0)
        ok = (ui < ratio) & live
        m = tl.minimum(tl.min(tl.where(ok, KMAX, ii), 0), k)
        rejected = m < k
        # The rejected draft's token and q row (-1: a point mass at its token).
        at = (ii == m) & rejected
        dm = tl.sum(tl.where(at, d, 0), 0)
        qm = tl.where(rejected, tl.sum(tl.where(at, qr, 0), 0), -1)
        point = qm < 0
        qload = rejected & (qm >= 0)
        prow = p_ptr + (po + m) * sp
        qrow = q_ptr + qm * sq
        # Pass 1: the sums of p_m and of the residual over each CHUNK-wide chunk, ROWS chunks per tile.
        cols = tl.arange(0, CHUNK)
        rows = tl.arange(0, ROWS)
        nchunk = tl.cdiv(V, CHUNK)
        sbase = sums_ptr + b * (2 * NCHUNK)
        for t in range(0, tl.cdiv(nchunk, ROWS)):
            cidx = t * ROWS + rows
            idx = cidx[:, None] * CHUNK + cols[None, :]
            inb = idx < V
            p = tl.load(prow + idx, mask=inb, other=0.0).to(tl.float32)
            q = tl.load(qrow + idx, mask=inb & qload, other=0.0).to(tl.float32)
            r = _residual(p, q, idx, dm, point)
            tl.store(sbase + cidx, tl.sum(p, 1), mask=cidx < nchunk)
            tl.store(sbase + NCHUNK + cidx, tl.sum(r, 1), mask=cidx < nchunk)
        tl.debug_barrier()  # the sums written above, read back by other threads of this program
        chunks = tl.arange(0, NCHUNK)
        sum_p = tl.load(sbase + chunks, mask=chunks < nchunk, other=0.0)
        sum_r = tl.load(sbase + NCHUNK + chunks, mask=chunks < nchunk, other=0.0)
        # Draw from the residual when a draft was rejected and the residual has mass, else from p_m.
        if DRAW_FROM_P:
            use_r = m < 0
        else:
            use_r = rejected & (tl.sum(sum_r, 0) > 0.0)
        sums = tl.where(use_r, sum_r, sum_p)
        ccdf = tl.cumsum(sums, 0)
        total = tl.max(ccdf, 0)
        target = tl.load(u_ptr + po + k) * total
        # The chunk: the first whose cumulative sum exceeds the target (else the last with mass).
        hit = (ccdf > target) & (sums > 0.0)
        chunk = tl.min(tl.where(hit, chunks, NCHUNK), 0)
        last = tl.max(tl.where(sums > 0.0, chunks, -1), 0)
        chunk = tl.where(chunk < NCHUNK, chunk, tl.maximum(last, 0))
        before = tl.sum(tl.where(chunks == chunk, ccdf - sums, 0.0), 0)
        # Pass 2: the token inside that chunk.
        idx = chunk * CHUNK + cols
        inb = idx < V
        p = tl.load(prow + idx, mask=inb, other=0.0).to(tl.float32)
        q = tl.load(qrow + idx, mask=inb & qload & use_r, other=0.0).to(tl.float32)
        dist = tl.where(use_r, _residual(p, q, idx, dm, point), p)
        icdf = tl.cumsum(dist, 0)
        rest = tl.maximum(target - before, 0.0)
        rest = tl.minimum(rest, tl.max(icdf, 0) * (1.0 - 1e-6))  # strictly below the chunk's own total
        pos = dist > 0.0
        j = tl.min(tl.where((icdf > rest) & pos, cols, CHUNK), 0)
        jlast = tl.max(tl.where(pos, cols, -1), 0)
        j = tl.where(j < CHUNK, j, tl.maximum(jlast, 0))
        tl.store(out_ptr + b, m.to(tl.int64))
        tl.store(out_ptr + nb + b, (chunk * CHUNK + j).to(tl.int64))


def spec_accept(p: torch.Tensor, q: torch.Tensor | None, tok: torch.Tensor, qrow: torch.Tensor,
                doff: torch.Tensor, k: torch.Tensor, poff: torch.Tensor, u: torch.Tensor,
                *, q_over_p: bool = False, one_uniform: bool = False, draw_from_p: bool = False,
                kmax: int | None = None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(m [B], token [B]) int64 on p's device, one launch.

    p [Rp, V] target probs (fp32); q [Rq, V] draft-prob rows or None (every draft a point mass);
    tok/qrow [sum k] per draft: its token and its q row (-1: point mass); doff/k/poff [B] per request:
    first draft, draft count, first p row (= first uniform); u [Rp] uniforms. Index tensors int64.
    q_over_p / one_uniform / draw_from_p: the rule variants of the module docstring (all off: the rule).
    kmax: max(k) as a host int (else read from the device: a sync). `out` [2, B] int64, if given,
    receives m and token (one host read of it then gives both)."""
    nb, v = k.shape[0], p.shape[1]
    if out is None:
        out = torch.empty(2, nb, dtype=torch.long, device=p.device)
    if nb == 0:
        return out[0], out[1]
    if kmax is None:
        kmax = int(k.max())
    if p.stride(1) != 1:
        p = p.contiguous()
    if q is None:
        q = p  # never read: every qrow is -1
    elif q.stride(1) != 1 or q.shape[1] != v:
        q = q.reshape(-1, v).contiguous()
    chunk = min(CHUNK, max(16, triton.next_power_of_2(v)))
    nchunk = triton.cdiv(v, chunk)
    rows = min(ROWS, max(2, triton.next_power_of_2(nchunk)))
    npow = max(2, triton.next_power_of_2(nchunk))
    sums = torch.empty(nb, 2 * npow, dtype=torch.float32, device=p.device)  # per-chunk sums (scratch)
    _spec_accept_kernel[(nb,)](p, q, tok, qrow, doff, k, poff, u, out, sums, nb, v, p.stride(0), q.stride(0),
                               Q_OVER_P=q_over_p, ONE_UNIFORM=one_uniform, DRAW_FROM_P=draw_from_p,
                               KMAX=max(2, triton.next_power_of_2(kmax)), CHUNK=chunk, ROWS=rows,
                               NCHUNK=npow, num_warps=8 if chunk * rows >= 4096 else 4)
    return out[0], out[1]
