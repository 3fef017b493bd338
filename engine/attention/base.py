"""Attention-backend interface and the per-step metadata every layer shares.

A step is a flat batch of per-request token spans. `AttentionMetadata` describes it once per step:
span lengths (q_lens), the KV length of each request after the span is written (kv_lens), the slot of
every new token in the paged cache, and each request's page table. A backend `plan`s once per step and
is then called once per layer with that layer's q/k/v and cache; it writes the new K/V into the cache
and returns the attention output.

Graph hooks (for CUDA-graph capture around dense segments): `prepare_capture` / `prepare_replay` let a
backend keep persistent buffers. The torch reference backend needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    q_lens: list[int]
    kv_lens: list[int]
    slot_mapping: torch.Tensor  # [T] long
    page_tables: list[list[int]]
    page_size: int
    causal: bool = True
    # Per sequence: its queries also see one key past the causal limit (a leaky mask; only the self-test
    # sets it, and only the torch reference backend computes it). None = off.
    leak: list[bool] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class AttentionBackend:
    name = "base"
    # The current step's slot of every new token (set by `plan`); read by the fused rope + store kernel
    # of a backend that `accepts_stored_kv`.
    slot_mapping: torch.Tensor | None = None
    # plan / prepare_replay may run while the step before is still on the device (engine/ahead.py): every
    # device buffer they refresh is written by a copy on the current stream, never staged through host memory
    # that a later plan overwrites before the copy ran
    @property
    def ahead_safe(self) -> bool:
        return True

    def plan(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    # Whole graphs of padded steps (engine/piecewise.py `step`): a backend that can plan a step of any span lengths
    # (segments of <= quantum rows) in fixed device buffers, so a graph over every layer replays at other lengths
    # and pages
    @property
    def rows_ok(self) -> bool:
        return False

    def plan_rows(self, meta: AttentionMetadata, quantum: int = 16, cap: int | None = None) -> None:
        raise NotImplementedError(f"{self.name} cannot plan a step for the span attention (plan_rows)")

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D], or None when the caller already stored them (a backend that
        `accepts_stored_kv`); caches: [num_slots, Hkv, D]. Returns [T, Hq, D]."""
        raise NotImplementedError

    def prepare_capture(self, meta: AttentionMetadata) -> None:  # pragma: no cover - GPU hook
        self.plan(meta)

    def prepare_replay(self, meta: AttentionMetadata) -> None:  # pragma: no cover - GPU hook
        self.plan(meta)
