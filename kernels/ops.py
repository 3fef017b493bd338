"""The op bundle the engine's model calls when the Triton path is on.

`TritonOps(gemv=False)` exposes add_rms_norm, swiglu, qk_norm_rope, k_norm_rope, kv_store and
add_norm_linear. add_norm_linear runs the add-norm kernel, cuBLAS and the SwiGLU kernel; with `gemv` on it
fuses residual add + RMSNorm (+ SwiGLU) into one Triton GEMM for up to gemv.MAX_ROWS rows instead: the
same function either way (tests hold both to the torch reference). The fused GEMV is off by default: on
the H200 it measured slower than cuBLAS plus the two small kernels (docs/gpu.md); SPECBENCH_GEMV=1 turns
it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import activation, norm, rope
from . import gemv as _gemv
from . import kv_store as _kv_store


class TritonOps:
    name = "triton"

    def __init__(self, gemv: bool = False) -> None:
        self.gemv = gemv

    add_rms_norm = staticmethod(norm.add_rms_norm)
    rms_norm = staticmethod(norm.rms_norm)
    swiglu = staticmethod(activation.swiglu)
    qk_norm_rope = staticmethod(rope.qk_norm_rope)
    k_norm_rope = staticmethod(rope.k_norm_rope)
    kv_store = staticmethod(_kv_store.kv_store)

    def add_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
                        w: torch.Tensor, eps: float, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gemv and x.shape[0] <= _gemv.MAX_ROWS:
            return _gemv.add_norm_linear(x, residual, norm_w, w, eps, swiglu)
        h, res = norm.add_rms_norm(x, residual, norm_w, eps)
        y = F.linear(h, w)
        return (activation.swiglu(y) if swiglu else y), res

    def describe(self) -> dict:
        return {"ops": self.name, "gemv": self.gemv}
