"""A padded step of spans of any length over fixed page tables, for the plan_rows checks of
tests/test_decode_attention_cpu.py (the reference test and the Triton interpreter script)."""

from __future__ import annotations

import torch

from specbench.engine.attention.base import AttentionMetadata


def rows_step(spans: list[tuple[int, int]], tables: list[list[int]], ps: int, dummy: int, pad: int, hq: int, hkv: int,
              d: int, causal: bool, g: torch.Generator):
    """spans: (q_len, kv_len) of requests 0.. (request i on tables[i]); `pad` one-token padding rows on the dummy
    page after them. Returns (metadata, q, k, v) with random fp32 q/k/v of the step's rows."""
    slots: list[int] = []
    for (ql, kl), t in zip(spans, tables, strict=False):
        slots += [t[p // ps] * ps + p % ps for p in range(kl - ql, kl)]
    slots += [dummy * ps] * pad
    meta = AttentionMetadata(q_lens=[ql for ql, _ in spans] + [1] * pad, kv_lens=[kl for _, kl in spans] + [1] * pad,
                             slot_mapping=torch.tensor(slots), page_size=ps, causal=causal,
                             page_tables=[t[: -(-kl // ps)] for (_, kl), t in zip(spans, tables, strict=False)]
                             + [[dummy]] * pad)
    rows = len(slots)
    q, k, v = (torch.randn(rows, h, d, generator=g) for h in (hq, hkv, hkv))
    return meta, q, k, v
