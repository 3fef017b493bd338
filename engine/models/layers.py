"""Dense building blocks shared by the target and the drafter (torch reference path).

Numerics follow HF Qwen3: RMSNorm in fp32 then cast back before the weight multiply; residual adds
in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-residual form: returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
