"""Skinny GEMMs for 2-64 rows on tensor cores, with the add + RMSNorm prologue and SwiGLU epilogue of
kernels/gemv.py: the verify span of one request (16 rows) and plain decode at c2..c64.

Same contract and references as kernels/gemv.py: `linear(x, w) -> x @ w.T` and
`add_norm_linear(x, residual, norm_w, w, eps, swiglu=False) -> (y, x + residual)` (references
`gemv.linear_ref` / `gemv.add_norm_linear_ref`: the unfused sequences the model runs).

Why: at a few rows every projection is still a weight stream, but the one-row GEMV of kernels/gemv.py reads
the weights once per row (slower than cuBLAS from two rows on), and cuBLAS at 16 rows sits ~15 % above the
one-row GEMV's time while the add+RMSNorm and SwiGLU kernels around it add three launches a layer. Here one
program owns BLOCK_N output columns of ALL the rows (BLOCK_M, the rows padded to a power of two >= 16, the
tensor cores' smallest tile) and one of `split` slices of K: it streams its weight slice once in BLOCK_K
chunks, software-pipelined (num_stages), into a [BLOCK_M, BLOCK_N] fp32 accumulator through `tl.dot`. With
split > 1 (more programs than column blocks, to fill the SMs) each writes its partial to a workspace and the
last of a column block's programs to arrive (an arrival counter) sums the partials in split order and runs the
epilogue: one launch, and a result that does not depend on arrival order. The add-norm variant
first computes every row's statistics (the rows are a few KB each, read from L2), then normalises each x chunk
on the fly with the model's rounding steps; the programs of column block 0 write the residual sum. With SwiGLU
a program owns the gate and the up columns of its block (two accumulators) and writes silu(gate) * up.

Numerics: fp32 accumulation of bf16 products, like cuBLAS; only the summation order differs (fp32 inputs run
IEEE fp32 dots, never TF32, like torch's default). A row's result
does not depend on the other rows' values, but it may differ in the last bit between row buckets (BLOCK_M 16
vs 64 can select different MMA instructions), so unlike the one-row GEMV this kernel is not batch-invariant
across buckets (tested: equal to the reference within the kernel tolerance, and row-independent within one
bucket).

Switch: `EngineConfig.skinny` (engine string `skinny=1`; env SPECBENCH_SKINNY=1; OFF by default: on the H200
it wins only two of the four layer shapes at 16 rows, and no engine-level A/B has run yet), needs `gemv` on too
(the same op bundle); `MAX_ROWS` bounds the rows; `pick` gives the config per (N, K, kind, BLOCK_M), None where
cuBLAS measured faster (benchmarks/gemv.py --kernel skinny).
"""

from __future__ import annotations

import torch

from . import triton_importable
from .gemv import add_norm_linear_ref, linear_ref, norm_outputs

__all__ = ["MAX_ROWS", "add_norm_linear", "add_norm_linear_ref", "block_m", "linear", "linear_ref", "pick"]

MAX_ROWS = 64  # the op bundle's row limit for this kernel (kernels/ops.py); above it cuBLAS (compute-bound)

# (BLOCK_N, BLOCK_K, num_warps, num_stages, split). CONFIGS is what the GPU test sweeps and the benchmark
# searches (split is a run-time argument: the splits of one tile config share a compile); TUNED holds the H200
# picks for the Qwen3-4B shapes keyed (N, K, kind, BLOCK_M) (None: cuBLAS measured faster there); other shapes
# take DEFAULT. The first search (BLOCK_N 16-64, no split) lost to cuBLAS on all but the o projection: too few
# column blocks to fill the 132 SMs (o, down: 80 at BLOCK_N 32), hence the split.
CONFIGS = [(bn, bk, 4, st, sp) for bn in (32, 64) for bk in (128, 256) for st in (3, 4) for sp in (1, 2, 3, 4)
           if not (bk == 256 and st == 4)]  # 256 x 4 stages: over the shared memory at BLOCK_N 32 or more
DEFAULT = (32, 128, 4, 3, 1)
Config = tuple[int, int, int, int, int]
# Measured on the H200, 2026-12-04 (reports/h200-skinny/: `scripts/gpu.sh gemv` with
# GEMV_ARGS="--kernel skinny --rows 16,64"): per call against the cuBLAS chain (with the separate add+RMSNorm /
# SwiGLU kernels), 36 distinct weights per shape. The skinny kernel wins only the plain o and down projections at
# the 16-row tile (9.88 vs 10.78 us, 16.94 vs 18.20 us); the fused qkv / gate_up lose (16.86 vs 13.14 us,
# 41.75 vs 35.10 us), and at the 64-row tile everything loses (36 layers: 6.49 vs 2.83 ms). The 32-row tile was
# not measured: `pick` keeps cuBLAS there for these shapes (a tuned shape's untuned tile is None, not DEFAULT).
TUNED: dict[tuple[int, int, str, int], Config | None] = {
    (6144, 2560, "norm", 16): None, (6144, 2560, "norm", 64): None,
    (2560, 4096, "plain", 16): (32, 128, 4, 4, 4), (2560, 4096, "plain", 64): None,
    (9728, 2560, "swiglu", 16): None, (9728, 2560, "swiglu", 64): None,
    (2560, 9728, "plain", 16): (32, 128, 4, 4, 4), (2560, 9728, "plain", 64): None,
}


def block_m(rows: int) -> int:
    """The row tile for `rows` rows: a power of two, at least 16 (the smallest tensor-core tile)."""
    return max(16, 1 << max(0, rows - 1).bit_length())


def pick(n: int, k: int, kind: str, rows: int) -> Config | None:
    """The config for this shape and row count, or None where cuBLAS measured faster (or too many rows)."""
    if rows > MAX_ROWS:
        return None
    key = (n, k, kind, block_m(rows))
    if key in TUNED:
        return TUNED[key]
    # a shape measured at other row tiles keeps cuBLAS at an unmeasured one; an unknown shape takes DEFAULT
    return None if any(t[:3] == key[:3] for t in TUNED) else DEFAULT


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _finish(acc, acc2, out_ptr, rm, rn, mm, mn, so, SWIGLU: tl.constexpr):
        dt = out_ptr.dtype.element_ty
        y = acc
        if SWIGLU:
            gf = acc.to(dt).to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(dt)
            y = s.to(tl.float32) * acc2.to(dt).to(tl.float32)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * so + rn[None, :], y.to(dt), mask=mm[:, None] & mn[None, :])

    @triton.jit
    def _skinny_kernel(x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, res_ptr, ws_ptr, lock_ptr, M, N, K, sx, sr, sw, so, sres,
                       eps, SPLIT, NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        rm = tl.arange(0, BLOCK_M)
        mm = rm < M
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        rk = tl.arange(0, BLOCK_K)
        xrows = x_ptr + rm[:, None].to(tl.int64) * sx
        rrows = r_ptr + rm[:, None].to(tl.int64) * sr
        inv = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:  # every row's statistics over all of K first (the residual sum: column block 0, split 0)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                msk = mm[:, None] & (kk < K)[None, :]
                h = tl.load(xrows + kk[None, :], mask=msk, other=0.0)
                if HAS_RES:
                    h = (h.to(tl.float32) + tl.load(rrows + kk[None, :], mask=msk, other=0.0).to(tl.float32)).to(dt)
                    tl.store(res_ptr + rm[:, None].to(tl.int64) * sres + kk[None, :], h,
                             mask=msk & (pid_n == 0) & (pid_s == 0))
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, axis=1)
            inv = tl.rsqrt(ss / K + eps)
        kc = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K  # this split's K range (whole chunks)
        k_start = pid_s * kc
        k_end = tl.minimum(K, k_start + kc)
        wrows = w_ptr + rn[:, None].to(tl.int64) * sw
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + rk
            mk = kk < K
            xmask = mm[:, None] & mk[None, :]
            xv = tl.load(xrows + kk[None, :], mask=xmask, other=0.0)
            if NORM:
                if HAS_RES:
                    xv = (xv.to(tl.float32) + tl.load(rrows + kk[None, :], mask=xmask, other=0.0).to(tl.float32)).to(dt)
                g = tl.load(g_ptr + kk, mask=mk, other=0.0).to(tl.float32)
                xv = ((xv.to(tl.float32) * inv[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt)
            wmask = mn[:, None] & mk[None, :]
            w = tl.load(wrows + kk[None, :], mask=wmask, other=0.0)
            acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
            if SWIGLU:
                w2 = tl.load(wrows + N * sw + kk[None, :], mask=wmask, other=0.0)
                acc2 = tl.dot(xv, tl.trans(w2), acc2, input_precision="ieee")
        if SPLIT_K:  # partials to the workspace; the last split of the column block to arrive sums them in order
            tile = rm[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            area = BLOCK_M * BLOCK_N
            wsb = ws_ptr + pid_n.to(tl.int64) * SPLIT * area * (2 if SWIGLU else 1)
            tl.store(wsb + pid_s * area + tile, acc)
            if SWIGLU:
                tl.store(wsb + (SPLIT + pid_s) * area + tile, acc2)
            tl.debug_barrier()  # every thread's partial is written before the release below
            count = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
            if count == SPLIT - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sp in range(0, SPLIT):  # fixed order: the result does not depend on who came last
                    acc += tl.load(wsb + sp * area + tile, cache_modifier=".cg")
                    if SWIGLU:
                        acc2 += tl.load(wsb + (SPLIT + sp) * area + tile, cache_modifier=".cg")
                _finish(acc, acc2, out_ptr, rm, rn, mm, mn, so, SWIGLU)
                tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next call (and the next graph replay)
        else:
            _finish(acc, acc2, out_ptr, rm, rn, mm, mn, so, SWIGLU)


_LOCKS: dict[torch.device, torch.Tensor] = {}
LOCK_SLOTS = 1 << 14  # column blocks one split-K launch may have (N / BLOCK_N)


def _locks(device: torch.device) -> torch.Tensor | None:
    """The split-K arrival counters of a device: zeros, and every launch leaves them zero (its last program
    resets its column block's counter). Launches run one at a time on the engine's stream. None while a CUDA
    graph is being captured and the counters do not exist yet (the launch then runs unsplit)."""
    t = _LOCKS.get(device)
    if t is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        t = _LOCKS[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return t


def _launch(x, r, g, w, out, res, m, n, k, eps, norm, has_res, swiglu, cfg) -> None:
    bn, bk, nw, st, split = cfg
    bm = block_m(m)
    nb = triton.cdiv(n, bn)
    split = max(1, min(split, triton.cdiv(k, bk)))
    locks = _locks(x.device) if split > 1 and nb <= LOCK_SLOTS else None
    if locks is None:
        split = 1
    ws = (torch.empty(nb * split * bm * bn * (2 if swiglu else 1), dtype=torch.float32, device=x.device)
          if split > 1 else out)
    for m0 in range(0, m, bm):  # the op bundle sends at most MAX_ROWS rows; direct callers may send more
        m1 = min(m, m0 + bm)
        _skinny_kernel[(nb, split)](
            x[m0:m1], r[m0:m1], g, w, out[m0:m1], res[m0:m1], ws, locks if locks is not None else out,
            m1 - m0, n, k, x.stride(0), r.stride(0), w.stride(0), out.stride(0), res.stride(0), eps, split,
            NORM=norm, HAS_RES=has_res, SWIGLU=swiglu, SPLIT_K=split > 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st)


def linear(x: torch.Tensor, w: torch.Tensor, cfg: Config | None = None) -> torch.Tensor:
    """Triton skinny GEMM; same contract as `gemv.linear_ref` (2-D x with a unit last stride, w [N, K])."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _launch(x, x, x, w, out, out, m, n, k, 0.0, False, False, False, cfg or pick(n, k, "plain", m) or DEFAULT)
    return out


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor,
                    eps: float, swiglu: bool = False, cfg: Config | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton skinny GEMM; same contract as `gemv.add_norm_linear_ref`."""
    m, k, n, out, res_out, r = norm_outputs(x, residual, w, swiglu)
    if m:
        _launch(x, r, norm_w, w, out, res_out, m, n, k, eps, True, residual is not None, swiglu,
                cfg or pick(n, k, "swiglu" if swiglu else "norm", m) or DEFAULT)
    return out, res_out
