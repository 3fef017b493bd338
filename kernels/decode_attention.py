"""Split-K ("flash-decoding") paged decode attention: one query token per request, its KV spread over programs.

`decode_attention(q, k_cache, v_cache, seq_lens, kv_indptr, kv_indices, page_size, scale, splits)`:
q [B, Hq, D] (unit last stride); caches [num_slots, Hkv, D] contiguous, viewed as pages of `page_size`
slots (page p holds slots p * page_size ...); request b has seq_lens[b] keys, on the pages
kv_indices[kv_indptr[b]:kv_indptr[b + 1]] in order (the CSR layout of `engine.attention.flashinfer.paged_arrays`;
int32 device tensors). Query head i reads KV head i // (Hq / Hkv), as in HF / FlashInfer GQA. Returns
[B, Hq, D] in q's dtype. A request with seq_lens 0 gets zeros.

Two launches:
- split: grid (B, Hkv, splits). Program (b, h, s) loads the whole GQA group of h (every query head sharing
  KV head h, so K/V are read once, the group padded to 16 rows for tl.dot) and runs an online softmax (fp32
  max / sum / weighted V; base-2 exponent) over its contiguous token range [s * chunk, min((s + 1) * chunk,
  len)), chunk = ceil(ceil(len / splits) / BLOCK_N) * BLOCK_N, gathering each token's slot through the page
  ids. The range is computed on the device from seq_lens, so the grid depends on (B, Hkv, splits) only:
  a CUDA graph captured for a batch bucket replays correctly while lengths change. A program whose range is
  empty writes the neutral partial (max -inf, sum 0; its V partial is neither written nor read).
- merge: grid (B, Hq): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits (M = max m_s),
  read in split order. `fused_merge=True` (SPECBENCH_DECODE_MERGE=fused) runs it inside the split kernel
  instead: each program, after writing its partial, bumps an int32 arrival counter of its (request, KV head)
  (acq_rel, GPU scope, after a CTA barrier); the program that arrives last merges that head group's splits,
  writes the output and resets the counter to 0 (which program is last varies, the result does not). It saves
  a launch per layer but measured slower on the H200 (split kernel 417 us a step at batch 1 against 131 + 90
  us for split + merge: the last program's serial merge of its 4 heads sits on the critical path), so it is
  off by default.
With splits == 1 the split kernel normalizes and writes the output itself (no merge at all).
Partials: one fp32 scratch of B * Hkv * splits * G * (D + 2) floats followed by the B * Hkv counters
(`alloc_partials`, zero-filled; the kernel leaves the counters at 0); a CUDA-graph user keeps one per bucket. `num_splits(batch, kv_heads, max_ctx)` picks splits so B x Hkv x splits is about
WAVES x the SM count (capped by MAX_SPLITS and by max_ctx / MIN_BLOCK); SPECBENCH_DECODE_SPLITS=N forces N
(for tuning on the device).

`decode_attention_ref` is the torch reference (gather + fp32 softmax), for tests.
"""

from __future__ import annotations

import torch

from specbench import env

from . import triton_importable

WAVES = 3  # target programs per launch, in multiples of the SM count
MAX_SPLITS = 64
MIN_BLOCK = 16  # the smallest token tile (tl.dot needs >= 16)
DEFAULT_SMS = 132  # H200; used where no CUDA device answers (the interpreter)


def num_splits(batch: int, kv_heads: int, max_ctx: int, sm_count: int = DEFAULT_SMS, waves: int = WAVES) -> int:
    """Splits per request for a launch of `batch` requests: B x kv_heads x splits ~ waves x sm_count, at least
    1, at most MAX_SPLITS and ceil(max_ctx / MIN_BLOCK). Depends on no sequence length (CUDA-graph buckets)."""
    forced = env.get("SPECBENCH_DECODE_SPLITS")
    if forced is not None:
        return max(1, forced)
    want = -(-waves * sm_count // max(1, batch * kv_heads))
    cap = max(1, -(-max_ctx // MIN_BLOCK))
    return max(1, min(want, cap, MAX_SPLITS))


def block_n(splits: int) -> int:
    """Token tile: small when a request is spread thin over many splits, larger when each program loops."""
    return 16 if splits >= 8 else 32 if splits >= 2 else 64


def alloc_partials(batch: int, kv_heads: int, group: int, head_dim: int, splits: int,
                   device: torch.device | str) -> torch.Tensor:
    """Scratch for the split partials: acc [B, Hkv, S, G, D] then max and sum [B, Hkv, S, G], fp32, flat, then
    the [B, Hkv] int32 arrival counters of the fused merge (zeros: the same bits in either type)."""
    return torch.zeros(batch * kv_heads * (splits * group * (head_dim + 2) + 1), dtype=torch.float32, device=device)


def fused_merge_default() -> bool:
    return env.get("SPECBENCH_DECODE_MERGE") == "fused"


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, page_size: int,
                         scale: float) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(b, hq, d, dtype=q.dtype, device=q.device)
    lens, ptr = seq_lens.tolist(), kv_indptr.tolist()
    pages = kv_indices.long()
    for i in range(b):
        n = lens[i]
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = pages[ptr[i] + pos // page_size] * page_size + pos % page_size
        k = k_cache[slots].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[slots].float().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


SEG_FIELDS = 5  # a span segment: (first row, query rows, key limit of its first row, limit step per row, page-list start)


def span_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segs: torch.Tensor,
                       pages: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """Torch reference of `span_attention`: every segment's rows attend to the first `base + j * step` keys of
    its page list (row j of the segment); rows no segment covers get zeros."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(r, hq, d, dtype=q.dtype, device=q.device)
    pg = pages.long()
    for row0, qlen, base, step, p0 in segs.view(-1, SEG_FIELDS).tolist():
        for j in range(qlen):
            n = base + j * step
            pos = torch.arange(n, device=q.device)
            slots = pg[p0 + pos // page_size] * page_size + pos % page_size
            k = k_cache[slots].float().repeat_interleave(hq // hkv, dim=1)
            v = v_cache[slots].float().repeat_interleave(hq // hkv, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[row0 + j].float(), k) * scale, dim=-1)
            out[row0 + j] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_head(part_ptr, out_ptr, b, hq, so_b, so_h, NSPLIT, NROWS, HKV: tl.constexpr, G: tl.constexpr,
                    D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr, CG: tl.constexpr):
        """Merge the splits of query head hq of request b (split order fixed) and store its output row."""
        h = hq // G
        s = tl.arange(0, SP)
        d = tl.arange(0, DP)
        sm = s < NSPLIT
        dm = d < D
        r = ((b * HKV + h) * NSPLIT + s) * G + hq % G
        if CG:  # partials other programs wrote during this launch: read them from L2, never from a stale L1 line
            m = tl.load(part_ptr + NROWS * D + r, mask=sm, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(part_ptr + NROWS * (D + 1) + r, mask=sm, other=0.0, cache_modifier=".cg")
        else:
            m = tl.load(part_ptr + NROWS * D + r, mask=sm, other=float("-inf"))
            ls = tl.load(part_ptr + NROWS * (D + 1) + r, mask=sm, other=0.0)
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # every split empty (length 0): weights 0, output 0
        w = tl.exp2(m - mx)
        den = tl.sum(w * ls, 0)
        live = sm & (m > float("-inf"))  # empty splits: weight 0 and no V partial to read
        if CG:
            acc = tl.load(part_ptr + r[:, None] * D + d[None, :], mask=live[:, None] & dm[None, :], other=0.0,
                          cache_modifier=".cg")
        else:
            acc = tl.load(part_ptr + r[:, None] * D + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        o = tl.sum(w[:, None] * acc, 0) / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * so_b + hq * so_h + d, o.to(out_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _kv_pass(q, kc_ptr, vc_ptr, pages_ptr, p0, start, end, h, qk_scale, limit, M: tl.constexpr, HKV: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 LIMIT: tl.constexpr):
        """Online softmax of the query tile q [M, DP] over keys [start, end) of one page list and KV head h (fp32
        max / sum / weighted V, base-2 exponent): (max, sum, unnormalized output) per tile row. LIMIT: query row t
        sees only keys < limit[t] (a row may then meet a tile with no key: its weights stay 0, no NaN)."""
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, DP], tl.float32)
        d = tl.arange(0, DP)
        n = tl.arange(0, BLOCK_N)
        dm = d < D
        for t0 in range(start, end, BLOCK_N):
            pos = t0 + n
            valid = pos < end
            page = tl.load(pages_ptr + p0 + pos // PS, mask=valid, other=0).to(tl.int64)
            row = ((page * PS + pos % PS) * HKV + h) * D
            kv_mask = valid[:, None] & dm[None, :]
            k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [M, BLOCK_N], log2 units
            if LIMIT:
                qk = tl.where(valid[None, :] & (pos[None, :] < limit[:, None]), qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                qk = tl.where(valid[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile holds >= 1 valid token
                m_use = m_new
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _finish(acc, l_i, m_i, out_ptr, part_ptr, rows, heads, mask, so_b, so_h, r, nonempty, NROWS,
                D: tl.constexpr, DP: tl.constexpr, DIRECT: tl.constexpr):
        """One split (DIRECT): the normalized output of each tile row (its output row `rows`, head `heads`); else
        the split's partial at partial row r. An empty range writes max -inf and sum 0 only: the merge reads no V
        partial behind a -inf max."""
        d = tl.arange(0, DP)
        dm = d < D
        if DIRECT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + rows[:, None] * so_b + heads[:, None] * so_h + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=mask[:, None] & dm[None, :])
        else:
            tl.store(part_ptr + r[:, None] * D + d[None, :], acc, mask=(mask[:, None] & dm[None, :]) & nonempty)
            tl.store(part_ptr + NROWS * D + r, m_i, mask=mask)
            tl.store(part_ptr + NROWS * (D + 1) + r, l_i, mask=mask)

    @triton.jit
    def _split_kernel(q_ptr, kc_ptr, vc_ptr, lens_ptr, indptr_ptr, pages_ptr, part_ptr, out_ptr, cnt_ptr,
                      sq_b, sq_h, so_b, so_h, qk_scale, NSPLIT, NROWS,
                      HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                      PS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
                      FUSED: tl.constexpr, SP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        seq = tl.load(lens_ptr + b)
        p0 = tl.load(indptr_ptr + b)
        chunk = tl.cdiv(tl.cdiv(seq, NSPLIT), BLOCK_N) * BLOCK_N
        start = s * chunk
        end = tl.minimum(start + chunk, seq)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        q = tl.load(q_ptr + b.to(tl.int64) * sq_b + (h * G + g)[:, None] * sq_h + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _kv_pass(q, kc_ptr, vc_ptr, pages_ptr, p0, start, end, h, qk_scale, end, GP, HKV, D, DP, PS,
                                 BLOCK_N, PREC, False)
        r = ((b * HKV + h) * NSPLIT + s) * G + g  # partial row of each query head of the group
        _finish(acc, l_i, m_i, out_ptr, part_ptr, b.to(tl.int64) + g * 0, h * G + g, gm, so_b, so_h, r, start < end,
                NROWS, D, DP, DIRECT)
        if not DIRECT:
            if FUSED:
                tl.debug_barrier()  # every thread's partial stores precede the release below
                arrived = tl.atomic_add(cnt_ptr + b * HKV + h, 1, sem="acq_rel", scope="gpu")
                if arrived == NSPLIT - 1:  # the last split of this head group: merge it
                    for gi in tl.static_range(G):
                        _merge_head(part_ptr, out_ptr, b, h * G + gi, so_b, so_h, NSPLIT, NROWS, HKV, G, D, DP, SP,
                                    True)
                    tl.atomic_xchg(cnt_ptr + b * HKV + h, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _span_kernel(q_ptr, kc_ptr, vc_ptr, seg_ptr, pages_ptr, part_ptr, out_ptr, sq_b, sq_h, so_b, so_h, qk_scale,
                     NSPLIT, NROWS, HKV: tl.constexpr, G: tl.constexpr, QM: tl.constexpr, TQ: tl.constexpr,
                     D: tl.constexpr, DP: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                     PREC: tl.constexpr):
        """Program (segment, KV head, split): the segment's <= QM query rows x the G heads of KV head h as one
        [TQ, D] tile (row t = query t // G, head t % G), one pass over the split's keys with a per-row limit."""
        seg = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        qlen = tl.load(seg_ptr + seg * 5 + 1)
        if qlen > 0:
            row0 = tl.load(seg_ptr + seg * 5)
            base = tl.load(seg_ptr + seg * 5 + 2)
            step = tl.load(seg_ptr + seg * 5 + 3)
            p0 = tl.load(seg_ptr + seg * 5 + 4)
            kvlen = base + (qlen - 1) * step  # the last row sees the most keys
            chunk = tl.cdiv(tl.cdiv(kvlen, NSPLIT), BLOCK_N) * BLOCK_N
            start = s * chunk
            end = tl.minimum(start + chunk, kvlen)
            t = tl.arange(0, TQ)
            j = t // G
            g = t % G
            tm = (j < qlen) & (t < QM * G)
            rows = (row0 + j).to(tl.int64)
            limit = tl.where(tm, base + j * step, 0)
            d = tl.arange(0, DP)
            dm = d < D
            q = tl.load(q_ptr + rows[:, None] * sq_b + (h * G + g)[:, None] * sq_h + d[None, :],
                        mask=tm[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _kv_pass(q, kc_ptr, vc_ptr, pages_ptr, p0, start, end, h, qk_scale, limit, TQ, HKV, D, DP,
                                     PS, BLOCK_N, PREC, True)
            r = ((rows * HKV + h) * NSPLIT + s) * G + g  # the decode kernel's partial layout, per row
            _finish(acc, l_i, m_i, out_ptr, part_ptr, rows, h * G + g, tm, so_b, so_h, r, start < end, NROWS, D, DP,
                    DIRECT)

    @triton.jit
    def _merge_kernel(part_ptr, out_ptr, so_b, so_h, NSPLIT, NROWS,
                      HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr):
        _merge_head(part_ptr, out_ptr, tl.program_id(0), tl.program_id(1), so_b, so_h, NSPLIT, NROWS, HKV, G, D, DP,
                    SP, False)


LOG2E = 1.4426950408889634


def span_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segs: torch.Tensor,
                   pages: torch.Tensor, page_size: int, scale: float, splits: int, quantum: int,
                   partials: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   tile: int | None = None) -> torch.Tensor:
    """Paged attention of a padded step of spans (verify spans, a drafter's blocks): q [R, Hq, D]; segs an int32
    device tensor [NSEG, 5] of (first row, query rows <= quantum, key limit of the first row, limit step per row:
    1 causal / 0 not, start of its page list in `pages`); row j of a segment attends to its first base + j * step
    keys. Every row of q belongs to exactly one segment (rows no segment covers are left undefined). A segment
    with 0 rows is skipped, so a CUDA graph captured at NSEG segments replays any layout of up to NSEG. K/V are read once per (segment, KV head, split) for all its rows and heads (one [quantum x G, D] query
    tile); splits merge like the decode kernel's, per row. Same contract as `span_attention_ref`; no host read."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0 and k_cache.shape[2] == d and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and splits >= 1 and quantum >= 1
    g = hq // hkv
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(r, hq, d, dtype=q.dtype, device=q.device)
    nseg = segs.numel() // SEG_FIELDS
    if r == 0 or nseg == 0:
        return out
    direct = splits == 1
    nrows = r * hkv * splits * g
    if direct:
        part = out  # unused
    else:
        part = partials if partials is not None else alloc_partials(r, hkv, g, d, splits, q.device)
        assert part.dtype == torch.float32 and part.numel() >= nrows * (d + 2), "partials too small"
    dp, sp = triton.next_power_of_2(d), triton.next_power_of_2(splits)
    tq = max(16, triton.next_power_of_2(quantum * g))
    _span_kernel[(nseg, hkv, splits)](
        q, k_cache, v_cache, segs, pages, part, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        scale * LOG2E, splits, nrows, HKV=hkv, G=g, QM=quantum, TQ=tq, D=d, DP=dp, PS=page_size,
        BLOCK_N=tile or (32 if tq >= 64 else block_n(splits)), DIRECT=direct,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4 if tq <= 64 else 8, num_stages=2)
    if not direct:
        _merge_kernel[(r, hq)](part, out, out.stride(0), out.stride(1), splits, nrows, HKV=hkv, G=g, D=d, DP=dp,
                               SP=sp, num_warps=4)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, page_size: int, scale: float, splits: int,
                     partials: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     tile: int | None = None, fused_merge: bool | None = None) -> torch.Tensor:
    """Triton kernels; same contract as `decode_attention_ref`. `partials` (from `alloc_partials` with the
    same B, Hkv, G, D, splits) is reused when given; no host read of any device tensor. `fused_merge`: None
    follows SPECBENCH_DECODE_MERGE (default: the separate merge launch)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert hq % hkv == 0 and k_cache.shape[2] == d and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and splits >= 1
    g = hq // hkv
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    direct = splits == 1
    nrows = b * hkv * splits * g
    fused = fused_merge_default() if fused_merge is None else fused_merge
    if direct:
        part = cnt = out  # unused
    else:
        part = partials if partials is not None else alloc_partials(b, hkv, g, d, splits, q.device)
        assert part.dtype == torch.float32 and part.numel() >= nrows * (d + 2) + b * hkv, "partials too small"
        cnt = part.view(torch.int32)[nrows * (d + 2):]
    dp, sp = triton.next_power_of_2(d), triton.next_power_of_2(splits)
    _split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, seq_lens, kv_indptr, kv_indices, part, out, cnt, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), scale * LOG2E, splits, nrows, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, DP=dp,
        PS=page_size, BLOCK_N=tile or block_n(splits), DIRECT=direct,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", FUSED=fused and not direct, SP=sp, num_warps=4,
        num_stages=2)
    if not direct and not fused:
        _merge_kernel[(b, hq)](part, out, out.stride(0), out.stride(1), splits, nrows, HKV=hkv, G=g, D=d, DP=dp,
                               SP=sp, num_warps=4)
    return out
