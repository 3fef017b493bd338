"""Paged KV store: scatter new K/V rows into the cache by slot mapping.

`kv_store(k, v, k_cache, v_cache, slots)`: k, v [T, Hkv, D] (any row strides, unit last stride);
caches [num_slots, Hkv, D] contiguous; slots [T] long. Row t goes to slot `slots[t]`; a negative slot is
skipped (the reference skips it too), so callers may mark rows that must not be written.
"""

from __future__ import annotations

import torch

from . import triton_importable


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _kv_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sk_t, sk_h, sv_t, sv_h, NKV,
                         D: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        m = (offs < D) & (slot >= 0)
        kd = kc_ptr.dtype.element_ty
        k = tl.load(k_ptr + t * sk_t + h * sk_h + offs, mask=m, other=0.0)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + offs, mask=m, other=0.0)
        dst = (slot * NKV + h) * D + offs
        tl.store(kc_ptr + dst, k.to(kd), mask=m)
        tl.store(vc_ptr + dst, v.to(kd), mask=m)


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Triton kernel; same contract as `kv_store_ref`."""
    t, nkv, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if t == 0:
        return
    _kv_store_kernel[(t, nkv)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               nkv, D=d, BLOCK=triton.next_power_of_2(d), num_warps=1)
