"""Small-batch GEMM with a fused residual add + RMSNorm prologue and an optional SwiGLU epilogue.

`add_norm_linear(x, residual, norm_w, w, eps, swiglu=False) -> (y, x + residual)`:
  h = x + residual (rounded to the model dtype; h = x when residual is None),
  y = rmsnorm(h) * norm_w @ w.T, and with swiglu=True (w = [gate; up], [2I, K]) y = silu(gate) * up.
The torch reference is exactly the unfused sequence the model runs (add_rms_norm -> F.linear -> swiglu).

Why: at decode batch sizes a layer's small elementwise kernels cost as much as their launches; folding the
residual add + norm into the qkv and gate/up GEMMs (and SwiGLU into the gate/up epilogue) removes three
launches per layer. Each program owns BLOCK_N output columns (both the gate and the up rows for SwiGLU),
recomputes the row statistics itself (the rows are a few KB, read from L2) and streams its weight rows
once. Rows are independent and the K order is fixed, so a row's result does not depend on how many rows
ride along (padding a batch to a graph bucket changes nothing). Only for M <= MAX_ROWS; callers fall
back to the unfused sequence above that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import env_flag, interpreting, triton_importable
from .activation import swiglu_ref
from .norm import add_rms_norm_ref

MAX_ROWS = 16


def add_norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor,
                        eps: float, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    h, res = add_rms_norm_ref(x, residual, norm_w, eps)
    y = F.linear(h, w)
    return (swiglu_ref(y) if swiglu else y), res


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_h(x_ptr, r_ptr, rm, kk, msk, sx, sr, HAS_RES: tl.constexpr, dt: tl.constexpr):
        h = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=msk, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rm[:, None] * sr + kk[None, :], mask=msk, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
        return h

    @triton.jit
    def _add_norm_gemv_kernel(x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, res_ptr, M, N, K, sx, sr, sw, so, sres, eps,
                              HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, PREC: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        dt = out_ptr.dtype.element_ty
        rm = tl.arange(0, BLOCK_M)
        mm = rm < M
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        rk = tl.arange(0, BLOCK_K)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            msk = mm[:, None] & (kk < K)[None, :]
            h = _load_h(x_ptr, r_ptr, rm, kk, msk, sx, sr, HAS_RES, dt)
            if HAS_RES:
                tl.store(res_ptr + rm[:, None] * sres + kk[None, :], h, mask=msk & (pid == 0))
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        inv = tl.rsqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mk = kk < K
            msk = mm[:, None] & mk[None, :]
            h = _load_h(x_ptr, r_ptr, rm, kk, msk, sx, sr, HAS_RES, dt)
            g = tl.load(g_ptr + kk, mask=mk, other=0.0).to(tl.float32)
            xn = ((h.to(tl.float32) * inv[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt)
            wmask = mn[:, None] & mk[None, :]
            w = tl.load(w_ptr + rn[:, None] * sw + kk[None, :], mask=wmask, other=0.0)
            acc = tl.dot(xn, tl.trans(w), acc, input_precision=PREC)
            if SWIGLU:
                w2 = tl.load(w_ptr + (rn[:, None] + N) * sw + kk[None, :], mask=wmask, other=0.0)
                acc2 = tl.dot(xn, tl.trans(w2), acc2, input_precision=PREC)
        if SWIGLU:
            gf = acc.to(dt).to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(dt)
            y = (s.to(tl.float32) * acc2.to(dt).to(tl.float32)).to(dt)
        else:
            y = acc.to(dt)
        tl.store(out_ptr + rm[:, None] * so + rn[None, :], y, mask=mm[:, None] & mn[None, :])

    _CONFIGS = [
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 512}, num_warps=8, num_stages=2),
    ]
    _tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "SWIGLU", "HAS_RES"])(_add_norm_gemv_kernel)


def tuned_configs() -> dict[str, str]:
    """The autotuner's picks so far (for the benchmark's record)."""
    if not triton_importable() or interpreting():
        return {}
    return {str(k): str(v) for k, v in _tuned.cache.items()}


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor,
                    eps: float, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel for M <= MAX_ROWS rows; same contract as `add_norm_linear_ref`."""
    m, k = x.shape
    assert m <= MAX_ROWS, f"add_norm_linear: {m} rows > MAX_ROWS={MAX_ROWS}"
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    if m == 0:
        return out, res_out
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    args = (x, r, norm_w, w, out, res_out, m, n, k, x.stride(0), r.stride(0), w.stride(0), out.stride(0),
            res_out.stride(0), eps)
    flags = dict(HAS_RES=residual is not None, SWIGLU=swiglu, PREC=prec, BLOCK_M=MAX_ROWS)
    if interpreting() or not env_flag("SPECBENCH_GEMV_TUNE", True):
        _add_norm_gemv_kernel[(triton.cdiv(n, 32),)](*args, **flags, BLOCK_N=32, BLOCK_K=128, num_warps=4,
                                                      num_stages=3)
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    return out, res_out
