"""Dense building blocks shared by the target and the drafter (torch reference path).

Numerics follow HF Qwen3: RMSNorm in fp32 then cast back before the weight multiply; residual adds
in the model dtype. The definitions are the torch references that kernels/ tests its Triton kernels
against, so the CPU path and the kernel tests share one source of truth.
"""

from __future__ import annotations

from specbench.kernels.activation import swiglu_ref as swiglu
from specbench.kernels.norm import add_rms_norm_ref as add_rms_norm
from specbench.kernels.norm import rms_norm_ref as rms_norm

__all__ = ["rms_norm", "add_rms_norm", "swiglu"]
