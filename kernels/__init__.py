"""Triton kernels, each beside the torch reference it is tested against.

Contract: every public op here has a `*_ref` torch implementation with the engine's numerics (HF Qwen3:
fp32 statistics, a cast back to the model dtype before each elementwise product) and a Triton kernel that
computes the same function. The engine uses the kernels only on CUDA, when `triton` imports and the
switch allows (`SPECBENCH_TRITON=0` turns them off; `EngineConfig.triton=False` likewise); everywhere
else it keeps the torch references. This package imports nothing from `specbench.engine`.

Modules: `norm` (residual add + RMSNorm), `activation` (SwiGLU), `rope` (q/k RMSNorm + RoPE, optionally
storing K/V into the paged cache; the K-only variant for a drafter's context rows), `kv_store` (slot-mapping
scatter into the paged cache), `gemv` (small-batch GEMM with a fused add + RMSNorm prologue and an
optional SwiGLU epilogue), `ops` (the bundle the model calls), `spec_accept` (the speculative-sampling
accept step of a whole batch in one launch; its reference is the torch path of
`engine.spec.sampling.accept_sampled_batch`, which calls it), `decode_attention` (split-K paged decode
attention and its merge; FlashInfer's decode steps with `EngineConfig.decode_attention="triton"`),
`selector_walk` (DFlash2's candidate-selector walk of a whole batch in one launch; its reference is the torch
path of `engine.spec.selector.greedy_path` / `sampled_path`, which call it; `EngineConfig.selector_kernel`).
"""

from __future__ import annotations

import functools
import os

import torch

from specbench import env


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install on a machine without a driver
        return False
    return True


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the kernels then run on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_enabled(device: torch.device | str, allow: bool = True) -> bool:
    """Whether the engine should use the Triton kernels for tensors on `device`."""
    dev = torch.device(device)
    if not allow or not env.flag("SPECBENCH_TRITON") or not triton_importable():
        return False
    return dev.type == "cuda" or interpreting()
