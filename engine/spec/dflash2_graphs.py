"""The DFlash2 draft as a padded piecewise graph: DraftGraphs' body with the convolutions inside the captured
dense segments and the selector's greedy walk inside the tail.

Contract (beside engine/spec/dflash_graphs.py, whose padding and row layout it keeps):
- Rows are bucket x B, request i's block at rows [i * B, (i + 1) * B); padding blocks are whole blocks too,
  so every convolution runs on the [rows / B, B, H] view and never crosses a block (a padding block's
  outputs are never read).
- Each drafter layer becomes a `ConvLayer`: pre_attn = add + norm, the attention conv's taps (stashed in a
  static buffer: they are needed again after the eager attention, in the next segment), the conv on the
  way in, the merged qkv GEMM, q/k norm + RoPE (the fused kernel with the Triton ops on, K/V stored by it
  where the backend accepts that); post_attn = o_proj, the conv on the way out, add + norm, the MLP's
  taps, conv in, gate/up, SwiGLU, down, conv out. No tensor's shape depends on anything but the row
  count, so the segments capture like DFlash1's.
- The tail writes the DFlash2 logits (multiplier, soft cap) of slots 1..B-1 into a static fp32 buffer,
  their final hidden into another (the T > 0 walk reads them), and the selector's greedy path from each
  block's anchor (row i * B of `io`) into a static long buffer: the walk is captured with the rest, one
  Triton launch for the whole batch (kernels/selector_walk.py) when the proposer's `walk_kernel` is on,
  else one set of torch ops per slot.
- `run(spans, tile_starts, causal)` -> (logits, hidden, greedy drafts) views of the first N blocks, valid
  until the next draft. Same function as `DFlash2Proposer`'s plain path (tested on CPU with capture=False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..models.dflash2 import DFlash2DraftModel, GroupedDynamicConv
from ..models.layers import add_rms_norm, rms_norm, swiglu
from ..models.qwen3 import Qwen3Layer
from ..rope import RotaryCache
from ..scheduler import Span
from . import selector as sel
from .dflash_graphs import DraftGraphs, DraftStack

if TYPE_CHECKING:
    from .dflash2 import DFlash2Proposer


class ConvLayer:
    """A drafter layer with its two convolutions, in PiecewiseStack's pre_attn / post_attn shape."""

    def __init__(self, layer: Qwen3Layer, aconv: GroupedDynamicConv, mconv: GroupedDynamicConv, block: int,
                 taps: torch.Tensor) -> None:
        self.layer, self.cfg, self.aconv, self.mconv, self.block = layer, layer.cfg, aconv, mconv, block
        self.taps = taps  # static [max_rows, 2 * K * G]: the attention conv's taps, pre -> post

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] // self.block, self.block, -1)

    def pre_attn(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rope: RotaryCache,
                 ops: Any = None, store: Any = None) -> tuple[torch.Tensor, Any, Any, torch.Tensor]:
        ly, cfg = self.layer, self.cfg
        rows = x.shape[0]
        norm = ops.add_rms_norm if ops is not None else add_rms_norm
        h, residual = norm(x, residual, ly.in_norm, cfg.rms_norm_eps)
        hb = self._blocks(h)
        d = self.aconv.delta(hb)
        self.taps[:rows].copy_(d.reshape(rows, -1))
        qkv = F.linear(self.aconv.conv(hb, d, 0).reshape(rows, -1), ly.qkv_w)
        if ops is not None:
            q, k, v = ops.qk_norm_rope(qkv, ly.q_norm, ly.k_norm, cfg.rms_norm_eps, rope.cos, rope.sin, positions,
                                       cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, store)
            return q, k, v, residual
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = rms_norm(q.reshape(rows, cfg.num_attention_heads, cfg.head_dim), ly.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k.reshape(rows, cfg.num_key_value_heads, cfg.head_dim), ly.k_norm, cfg.rms_norm_eps)
        v = v.reshape(rows, cfg.num_key_value_heads, cfg.head_dim)
        return rope.apply(q, positions), rope.apply(k, positions), v, residual

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor, ops: Any = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        ly, cfg = self.layer, self.cfg
        rows = attn_out.shape[0]
        d = self.taps[:rows].view(rows // self.block, self.block, 2, self.aconv.kernel, self.aconv.groups)
        o = F.linear(attn_out.reshape(rows, -1), ly.o_w)
        x = self.aconv.conv(self._blocks(o), d, 1).reshape(rows, -1)
        norm = ops.add_rms_norm if ops is not None else add_rms_norm
        h, residual = norm(x, residual, ly.post_norm, cfg.rms_norm_eps)
        hb = self._blocks(h)
        dm = self.mconv.delta(hb)
        y = F.linear(swiglu(F.linear(self.mconv.conv(hb, dm, 0).reshape(rows, -1), ly.gate_up_w)), ly.down_w)
        return self.mconv.conv(self._blocks(y), dm, 1).reshape(rows, -1), residual


class DraftStack2(DraftStack):
    name = "draft2"
    draft: DFlash2DraftModel

    def __init__(self, proposer: DFlash2Proposer, max_blocks: int, capture: bool) -> None:
        super().__init__(proposer, max_blocks, capture)
        d, dev = proposer.draft, proposer.runner.device
        rows, b = max_blocks * self.block, self.block
        g = d.attn_convs[0]
        self.taps = torch.zeros(rows, 2 * g.kernel * g.groups, dtype=proposer.runner.dtype, device=dev)
        self.layers = [ConvLayer(ly, d.attn_convs[i], d.mlp_convs[i], b, self.taps)  # type: ignore[misc]
                       for i, ly in enumerate(d.layers)]
        self.hidden = torch.zeros(max_blocks, b - 1, d.cfg.hidden_size, dtype=proposer.runner.dtype, device=dev)
        self.drafts = torch.zeros(max_blocks, b - 1, dtype=torch.long, device=dev)
        self.walk_kernel = bool(getattr(proposer, "walk_kernel", False))  # fixed at capture

    def static_bytes(self) -> int:
        return super().static_bytes() + sum(t.numel() * t.element_size() for t in (self.taps, self.hidden, self.drafts))

    def tail(self, x: torch.Tensor, res: torch.Tensor | None, rows: int) -> None:
        norm = self.ops.add_rms_norm if self.ops is not None else add_rms_norm
        hidden, _ = norm(x, res, self.draft.norm, self.draft.cfg.rms_norm_eps)
        blocks = rows // self.block
        self.hidden[:blocks].copy_(hidden.reshape(blocks, self.block, -1)[:, 1:])
        h = self.hidden[:blocks]  # contiguous: one GEMM over the lm_head, not one per block (dflash_graphs.DraftStack)
        logits = self.draft.draft_logits(h, self.target.lm_head_w)
        self.logits[:blocks].copy_(logits)
        proj_w, pred, succ = self.draft.selector_weights()
        unary, ids = sel.candidates(logits, self.draft.selector_top_k)
        anchor = self.io[0, :rows:self.block]
        self.drafts[:blocks].copy_(sel.greedy_path(unary, ids, sel.project(h, proj_w), anchor, pred, succ,
                                                   kernel=self.walk_kernel))


class DraftGraphs2(DraftGraphs):
    stack_class = DraftStack2
    stack: DraftStack2

    def __init__(self, proposer: DFlash2Proposer, capture: bool = True, buckets: list[int] | None = None) -> None:
        super().__init__(proposer, capture, buckets)  # typed: the DFlash2 stack needs a DFlash2 proposer

    @torch.inference_mode()
    def run2(self, spans: list[Span], tile_starts: bool = False, causal: bool | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, B-1, V], hidden [N, B-1, H], greedy drafts [N, B-1]): views of the static buffers."""
        is_causal = bool(getattr(self.proposer.draft, "causal", False)) if causal is None else causal
        n = self._replay(spans, tile_starts, is_causal)
        st = self.stack
        return st.logits[:n], st.hidden[:n], st.drafts[:n]
