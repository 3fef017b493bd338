"""Small-batch GEMV kernels for decode: a plain `linear` and `add_norm_linear` with a fused residual add +
RMSNorm prologue and an optional SwiGLU epilogue.

`linear(x, w) -> x @ w.T` and
`add_norm_linear(x, residual, norm_w, w, eps, swiglu=False) -> (y, x + residual)`:
  h = x + residual (rounded to the model dtype; h = x when residual is None),
  y = rmsnorm(h) * norm_w @ w.T, and with swiglu=True (w = [gate; up], [2I, K]) y = silu(gate) * up.
The torch references are exactly the unfused sequences the model runs (F.linear; add_rms_norm -> F.linear ->
swiglu).

Why: at decode batch sizes every GEMM is a weight stream (memory-bound), and cuBLAS reaches 65-80 % of the
copy bandwidth on the Qwen3-4B shapes (its down projection also pays a split-K reduce kernel); the small
elementwise kernels around the GEMMs cost about as much as their launches. Here one program owns BLOCK_N
output columns of ONE row: it streams those weight rows once in BLOCK_K chunks into a [BLOCK_N, BLOCK_K]
fp32 accumulator (multiply-adds, no tensor cores: one row has nothing to share) and reduces it at the end.
The grid is (rows, column blocks) with the row fastest, so the programs of a batch's rows run side by side
and read each weight tile from L2 after the first. The add-norm variant recomputes its row's statistics
(the row is a few KB, read from L2) and the programs of column block 0 write their row's residual sum;
with SwiGLU a program owns both the gate and the up rows of its columns.

Numerics: a row's result depends only on that row and the (N, K)-keyed config, never on the rows beside it
or the batch size (batch invariance, tested); it differs from cuBLAS only in the fp32 summation order.

Switch: `EngineConfig.gemv` (engine string `gemv=0`; env SPECBENCH_GEMV) and `MAX_ROWS`: the engine's op
bundle (kernels/ops.py) uses these kernels for at most `max_rows` rows on shapes where `pick` gives a config
(TUNED: None where cuBLAS measured faster), and cuBLAS + the separate kernels everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specbench import env

from . import triton_importable
from .activation import swiglu_ref
from .norm import add_rms_norm_ref

# Default row limit of the engine's op bundle (kernels/ops.py); the kernels take any M. One: a row per program
# reads the weights once per row, which measured slower than cuBLAS from 2 rows on (benchmarks/gemv.py).
MAX_ROWS = 1


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def add_norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor,
                        eps: float, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    h, res = add_rms_norm_ref(x, residual, norm_w, eps)
    y = F.linear(h, w)
    return (swiglu_ref(y) if swiglu else y), res


# (BLOCK_N, BLOCK_K, num_warps). CONFIGS is what the tests sweep and the benchmark (benchmarks/gemv.py) searches;
# TUNED holds the picks measured on the H200 for the Qwen3-4B shapes at one row, keyed (N, K, kind) with N the
# output columns (I for SwiGLU) and kind "plain" | "norm" | "swiglu"; None = cuBLAS (with the separate kernels)
# measured faster there, so the op bundle keeps it. Other shapes take DEFAULT.
CONFIGS = [(bn, bk, nw) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for nw in (2, 4, 8)
           if bn * bk // (32 * nw) >= 8]
DEFAULT = (2, 1024, 4)
TUNED: dict[tuple[int, int, str], tuple[int, int, int] | None] = {
    # 2026-11-29, H200, `python benchmarks/gemv.py` (36 distinct weights per graph, 15 replays, median), us per
    # call at one row against cuBLAS with the separate add+RMSNorm / SwiGLU kernels; the search's run-to-run noise
    # is 5-10 %, so these are the second search's picks where the two disagreed:
    (6144, 2560, "norm"): (8, 512, 2),  # qkv: 10.9 vs 12.7
    (2560, 4096, "plain"): (2, 1024, 4),  # o: 7.3 vs 10.7 (both searches)
    (9728, 2560, "swiglu"): (8, 256, 8),  # gate/up: 31.0 vs 33.4 (first search, two-pass norm: 33.2 vs 30.7)
    (2560, 9728, "plain"): (2, 1024, 4),  # down: 14.0 vs 17.5 (cuBLAS split-K + its reduce; both searches)
}


KINDS = ("plain", "norm", "swiglu")


def enabled_kinds() -> tuple[str, ...]:
    """The kinds SPECBENCH_GEMV_KINDS allows (a comma list of plain / norm / swiglu; default all)."""
    raw = env.get("SPECBENCH_GEMV_KINDS")
    return tuple(x for x in raw if x in KINDS) if raw is not None else KINDS


def pick(n: int, k: int, kind: str) -> tuple[int, int, int] | None:
    """The GEMV config for this shape, or None where cuBLAS measured faster."""
    return TUNED.get((n, k, kind), DEFAULT)


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, res_ptr, N, K, sx, sr, sw, so, sres, eps,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        rk = tl.arange(0, BLOCK_K)
        xrow = x_ptr + row * sx
        rrow = r_ptr + row * sr
        inv = 0.0
        if NORM:  # row statistics first: NORM_BLOCK covers the row in one step where it fits (no load chain)
            rs = tl.arange(0, NORM_BLOCK)
            ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for k0 in range(0, K, NORM_BLOCK):
                kk = k0 + rs
                mk = kk < K
                h = tl.load(xrow + kk, mask=mk, other=0.0)
                if HAS_RES:
                    h = (h.to(tl.float32) + tl.load(rrow + kk, mask=mk, other=0.0).to(tl.float32)).to(dt)
                    tl.store(res_ptr + row * sres + kk, h, mask=mk & (pid_n == 0))
                hf = h.to(tl.float32)
                ss += hf * hf
            inv = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        wrow = w_ptr + rn[:, None].to(tl.int64) * sw
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mk = kk < K
            xv = tl.load(xrow + kk, mask=mk, other=0.0)
            if NORM:
                if HAS_RES:
                    xv = (xv.to(tl.float32) + tl.load(rrow + kk, mask=mk, other=0.0).to(tl.float32)).to(dt)
                g = tl.load(g_ptr + kk, mask=mk, other=0.0).to(tl.float32)
                xv = ((xv.to(tl.float32) * inv).to(dt).to(tl.float32) * g).to(dt)
            xf = xv.to(tl.float32)[None, :]
            wmask = mn[:, None] & mk[None, :]
            w = tl.load(wrow + kk[None, :], mask=wmask, other=0.0)
            acc += w.to(tl.float32) * xf
            if SWIGLU:
                w2 = tl.load(wrow + N * sw + kk[None, :], mask=wmask, other=0.0)
                acc2 += w2.to(tl.float32) * xf
        y = tl.sum(acc, axis=1)
        if SWIGLU:
            gf = y.to(dt).to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(dt)
            y = s.to(tl.float32) * tl.sum(acc2, axis=1).to(dt).to(tl.float32)
        tl.store(out_ptr + row * so + rn, y.to(dt), mask=mn)


NORM_BLOCK_MAX = 4096  # the row-statistics pass loads up to this many elements at once


def _launch(x, r, g, w, out, res, n, k, eps, norm, has_res, swiglu, cfg) -> None:
    bn, bk, nw = cfg
    _gemv_kernel[(x.shape[0], triton.cdiv(n, bn))](
        x, r, g, w, out, res, n, k, x.stride(0), r.stride(0), w.stride(0), out.stride(0), res.stride(0), eps,
        NORM=norm, HAS_RES=has_res, SWIGLU=swiglu, BLOCK_N=bn, BLOCK_K=bk,
        NORM_BLOCK=min(NORM_BLOCK_MAX, triton.next_power_of_2(k)) if norm else 16, num_warps=nw, num_stages=1)


def linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton GEMV; same contract as `linear_ref` (2-D x with a unit last stride, w [N, K] contiguous rows)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _launch(x, x, x, w, out, out, n, k, 0.0, False, False, False, cfg or pick(n, k, "plain") or DEFAULT)
    return out


def norm_outputs(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, swiglu: bool
                 ) -> tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An add_norm_linear call's shapes and buffers (this GEMV and kernels/skinny.py): (m, k, n, out, the residual
    sum's buffer (x itself without a residual), the residual input (x without one))."""
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    return m, k, n, out, res_out, residual if residual is not None else x


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor,
                    eps: float, swiglu: bool = False, cfg: tuple[int, int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel; same contract as `add_norm_linear_ref`."""
    m, k, n, out, res_out, r = norm_outputs(x, residual, w, swiglu)
    if m:
        _launch(x, r, norm_w, w, out, res_out, n, k, eps, True, residual is not None, swiglu,
                cfg or pick(n, k, "swiglu" if swiglu else "norm") or DEFAULT)
    return out, res_out
