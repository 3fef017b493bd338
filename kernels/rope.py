"""Per-head q/k RMSNorm + rotary embedding (neox layout) on the merged qkv projection, one launch.

`qk_norm_rope(qkv, q_w, k_w, eps, cos, sin, positions, nq, nkv, d, store=None) -> (q, k, v)`:
qkv is [T, (nq + 2 nkv) * d] (unit last stride); cos/sin are the [max_pos, d] tables the engine's
RotaryCache holds (each half repeated, mscale folded in); positions is [T] long. Returns q [T, nq, d]
and k, v [T, nkv, d]. With `store=(k_cache, v_cache, slots)` K and V go straight into the paged cache
([num_slots, nkv, d], slot `slots[t]`; a negative slot is skipped) and k, v come back as None: the fused
"rope + KV store" the FlashInfer backend accepts. `k_norm_rope` is the K-only variant (nq = 0) for a
drafter's context rows, whose projection holds only [k | v].

Numerics follow the torch reference: the normalised head is rounded to the model dtype, multiplied by the
weight in the model dtype, then `x*cos` and `rot*sin` are each rounded before their (rounded) sum.
"""

from __future__ import annotations

import torch

from . import triton_importable
from .kv_store import kv_store_ref
from .norm import rms_norm_ref

Store = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [P, D] tables; positions: [T]."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rot * s


def qk_norm_rope_ref(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, num_q_heads: int,
                     num_kv_heads: int, head_dim: int, store: Store | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    t, d = qkv.shape[0], head_dim
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    qo = None
    if num_q_heads:
        assert q_weight is not None
        qo = rope_ref(rms_norm_ref(q.reshape(t, num_q_heads, d), q_weight, eps), cos, sin, positions)
    k = rope_ref(rms_norm_ref(k.reshape(t, num_kv_heads, d), k_weight, eps), cos, sin, positions)
    v = v.reshape(t, num_kv_heads, d)
    if store is not None:
        kv_store_ref(k, v, *store)
        return qo, None, None
    return qo, k, v


if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_rope_half(x1, x2, w1, w2, c1, c2, s1, s2, inv, dt: tl.constexpr):
        n1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        n2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        o1 = ((n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, sqkv, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                             q_ptr, k_ptr, v_ptr, NQ, NKV, eps,
                             D: tl.constexpr, HALF_BLOCK: tl.constexpr, STORE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        dt = qkv_ptr.dtype.element_ty
        offs = tl.arange(0, HALF_BLOCK)
        m = offs < D // 2
        is_q = h < NQ
        kh = h - NQ
        src = qkv_ptr + t * sqkv + h * D  # q heads then k heads are contiguous in the row
        x1 = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + D // 2 + offs, mask=m, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        if is_q:
            w_ptr = qw_ptr
        else:
            w_ptr = kw_ptr
        w1 = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + D // 2 + offs, mask=m, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        c1 = tl.load(cos_ptr + pos * D + offs, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * D + D // 2 + offs, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * D + offs, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * D + D // 2 + offs, mask=m, other=0.0).to(tl.float32)
        o1, o2 = _norm_rope_half(x1, x2, w1, w2, c1, c2, s1, s2, inv, dt)
        if is_q:
            dst = q_ptr + (t * NQ + h) * D
            tl.store(dst + offs, o1, mask=m)
            tl.store(dst + D // 2 + offs, o2, mask=m)
        else:
            vsrc = qkv_ptr + t * sqkv + (NQ + NKV + kh) * D
            v1 = tl.load(vsrc + offs, mask=m, other=0.0)
            v2 = tl.load(vsrc + D // 2 + offs, mask=m, other=0.0)
            if STORE:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                row = slot * NKV + kh
                ok = m & (slot >= 0)
            else:
                row = t * NKV + kh
                ok = m
            kd = k_ptr.dtype.element_ty
            tl.store(k_ptr + row * D + offs, o1.to(kd), mask=ok)
            tl.store(k_ptr + row * D + D // 2 + offs, o2.to(kd), mask=ok)
            tl.store(v_ptr + row * D + offs, v1.to(kd), mask=ok)
            tl.store(v_ptr + row * D + D // 2 + offs, v2.to(kd), mask=ok)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, store: Store | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Triton kernel; same contract as `qk_norm_rope_ref`."""
    t, d = qkv.shape[0], head_dim
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * d and qkv.stride(1) == 1, "qkv layout"
    q = torch.empty((t, num_q_heads, d), dtype=qkv.dtype, device=qkv.device) if num_q_heads else None
    if store is not None:
        k_out, v_out, slots = store
        assert k_out.is_contiguous() and v_out.is_contiguous() and k_out.shape[1:] == (num_kv_heads, d)
    else:
        k_out = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        v_out = torch.empty_like(k_out)
        slots = positions  # unused
    if t > 0:
        dummy = k_weight if q is None else q
        _qk_norm_rope_kernel[(t, num_q_heads + num_kv_heads)](
            qkv, qkv.stride(0), q_weight if q_weight is not None else k_weight, k_weight, cos, sin, positions,
            slots, dummy, k_out, v_out, num_q_heads, num_kv_heads, eps, D=d,
            HALF_BLOCK=triton.next_power_of_2(d // 2), STORE=store is not None, num_warps=1)
    if store is not None:
        return q, None, None
    return q, k_out, v_out


def k_norm_rope_ref(kv: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, num_kv_heads: int, head_dim: int, store: Store | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    _, k, v = qk_norm_rope_ref(kv, None, k_weight, eps, cos, sin, positions, 0, num_kv_heads, head_dim, store)
    return k, v


def k_norm_rope(kv: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, num_kv_heads: int, head_dim: int, store: Store | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """K-only variant (a drafter's context rows): kv is [T, 2 * nkv * d] = [k | v]."""
    _, k, v = qk_norm_rope(kv, None, k_weight, eps, cos, sin, positions, 0, num_kv_heads, head_dim, store)
    return k, v
