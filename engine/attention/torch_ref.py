"""Pure-torch reference attention over the paged cache (CPU and GPU).

The step's spans are padded into [N, Qmax] queries and [N, Lmax] gathered keys; one masked SDPA call
serves every layer's attention for the step. Index tensors are built once in `plan`.
Query j of a span of length q whose request has kv_len keys sits at position kv_len - q + j and sees
keys at positions <= its own (causal) or all keys (non-causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        dev = self.device
        n = meta.num_seqs
        qmax = max(meta.q_lens)
        lmax = max(meta.kv_lens)
        ps = meta.page_size
        kv_idx = torch.zeros(n, lmax, dtype=torch.long)
        q_idx = torch.zeros(n, qmax, dtype=torch.long)
        q_valid = torch.zeros(n, qmax, dtype=torch.bool)
        mask = torch.zeros(n, qmax, lmax, dtype=torch.bool)
        start = 0
        key_pos = torch.arange(lmax)
        for i, (ql, kl, table) in enumerate(zip(meta.q_lens, meta.kv_lens, meta.page_tables, strict=True)):
            pos = torch.arange(kl)
            pages = torch.tensor(table, dtype=torch.long)
            kv_idx[i, :kl] = pages[pos // ps] * ps + pos % ps
            q_idx[i, :ql] = torch.arange(start, start + ql)
            q_valid[i, :ql] = True
            qpos = torch.arange(kl - ql, kl).unsqueeze(1)
            if meta.causal:
                limit = qpos + (1 if meta.leak is not None and meta.leak[i] else 0)
                m = (key_pos.unsqueeze(0) <= limit) & (key_pos.unsqueeze(0) < kl)
            else:
                m = (key_pos < kl).unsqueeze(0).expand(ql, lmax)
            mask[i, :ql] = m
            mask[i, ql:, 0] = True  # padded query rows see one key so softmax stays finite
            start += ql
        self.kv_idx = kv_idx.to(dev)
        self.q_idx = q_idx.to(dev)
        self.q_valid = q_valid.to(dev)
        self.mask = mask.unsqueeze(1).to(dev)
        self.flat_rows = q_idx[q_valid].to(dev)
        self.meta = meta

    def forward(self, q, k, v, k_cache, v_cache, scale):
        meta = self.meta
        assert meta is not None, "plan() must run before forward()"
        k_cache[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
        hq, hkv = q.shape[1], k.shape[1]
        qp = q[self.q_idx].transpose(1, 2)  # [N, Hq, Qmax, D]
        kp = k_cache[self.kv_idx].transpose(1, 2)  # [N, Hkv, Lmax, D]
        vp = v_cache[self.kv_idx].transpose(1, 2)
        if hq != hkv:
            kp = kp.repeat_interleave(hq // hkv, dim=1)
            vp = vp.repeat_interleave(hq // hkv, dim=1)
        out = F.scaled_dot_product_attention(qp, kp.to(qp.dtype), vp.to(qp.dtype), attn_mask=self.mask,
                                             scale=scale)
        out = out.transpose(1, 2)  # [N, Qmax, Hq, D]
        res = torch.empty_like(q)
        res[self.flat_rows] = out[self.q_valid]
        return res
