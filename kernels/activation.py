"""SwiGLU on a merged gate/up projection: `swiglu(gate_up[M, 2I]) -> silu(gate) * up  [M, I]`.

Numerics follow the torch reference: silu in fp32 rounded to the model dtype, then the product rounded
to the model dtype (what `F.silu(gate) * up` does on bf16 tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_importable


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _silu_mul(g, u, dt: tl.constexpr):
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(dt)
        return (s.to(tl.float32) * u.to(tl.float32)).to(dt)

    @triton.jit
    def _swiglu_kernel(x_ptr, out_ptr, sx, so, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
        u = tl.load(x_ptr + row * sx + inter + cols, mask=m, other=0.0)
        tl.store(out_ptr + row * so + cols, _silu_mul(g, u, out_ptr.dtype.element_ty), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton kernel; same contract as `swiglu_ref`."""
    shape = gate_up.shape
    inter = shape[-1] // 2
    x2 = gate_up.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] > 0:
        block = min(2048, triton.next_power_of_2(inter))
        _swiglu_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, x2.stride(0), out.stride(0), inter,
                                                                  BLOCK=block, num_warps=4)
    return out.reshape(*shape[:-1], inter)
