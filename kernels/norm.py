"""Fused residual add + RMSNorm.

`add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)`; with `residual=None` the second
result is `x` itself. Numerics (HF Qwen3, the torch reference below): the residual add rounds to the
model dtype, the statistics run in fp32, the normalised row is cast back to the model dtype and then
multiplied by the weight in the model dtype. The kernel follows the same rounding steps; only the order
of the fp32 sum of squares differs.

Inputs are [M, H] with a unit last stride (any row stride); outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch

from . import triton_importable


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    return rms_norm_ref(x, weight, eps), x


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, sx, sr, so, sro, H, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(res_out_ptr + row * sro + cols, x, mask=m)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        xn = (xf * inv).to(dt)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        tl.store(out_ptr + row * so + cols, (xn.to(tl.float32) * w.to(tl.float32)).to(dt), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel; same contract as `add_rms_norm_ref`."""
    shape = x.shape
    h = shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out  # unused by the kernel
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(h)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), h,
            eps, HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    if residual is None:
        return out.reshape(shape), x
    return out.reshape(shape), res_out.reshape(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps)[0]
