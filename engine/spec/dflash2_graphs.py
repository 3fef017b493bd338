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
  set of ops per slot for the whole batch.
- `run(spans, tile_starts, causal)` -> (logits, hidden, greedy drafts) views of the first N blocks, valid
  until the next draft. Same function as `DFlash2Proposer`'s plain path (tested on CPU with capture=False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..attention.base import AttentionMetadata
from ..graphs import default_buckets
from ..models.dflash2 import DFlash2DraftModel, GroupedDynamicConv
from ..models.layers import add_rms_norm, rms_norm, swiglu
from ..models.qwen3 import Qwen3Layer
from ..rope import RotaryCache
from ..scheduler import Span
from . import selector as sel
from .dflash_graphs import DraftGraphs, DraftStack, block_positions

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

    def static_bytes(self) -> int:
        return super().static_bytes() + sum(t.numel() * t.element_size() for t in (self.taps, self.hidden, self.drafts))

    def tail(self, x: torch.Tensor, res: torch.Tensor | None, rows: int) -> None:
        norm = self.ops.add_rms_norm if self.ops is not None else add_rms_norm
        hidden, _ = norm(x, res, self.draft.norm, self.draft.cfg.rms_norm_eps)
        blocks = rows // self.block
        h = hidden.reshape(blocks, self.block, -1)[:, 1:]
        logits = self.draft.draft_logits(h, self.target.lm_head_w)
        self.hidden[:blocks].copy_(h)
        self.logits[:blocks].copy_(logits)
        proj_w, pred, succ = self.draft.selector_weights()
        unary, ids = sel.candidates(logits, self.draft.selector_top_k)
        anchor = self.io[0, :rows:self.block]
        self.drafts[:blocks].copy_(sel.greedy_path(unary, ids, sel.project(h, proj_w), anchor, pred, succ))


class DraftGraphs2(DraftGraphs):
    stack: DraftStack2

    def __init__(self, proposer: DFlash2Proposer, capture: bool = True, buckets: list[int] | None = None) -> None:
        # DraftGraphs.__init__ with the DFlash2 stack (not calling it: it would allocate DFlash1's buffers)
        self.proposer = proposer
        self.buckets = sorted(set(buckets or default_buckets(proposer.runner.cfg.max_num_seqs)))
        self.stack = DraftStack2(proposer, self.buckets[-1], capture)
        self.stats = {"steps": 0, "real_rows": 0, "padded_rows": 0}

    @torch.inference_mode()
    def run2(self, spans: list[Span], tile_starts: bool = False, causal: bool | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, B-1, V], hidden [N, B-1, H], greedy drafts [N, B-1]): views of the static buffers."""
        p = self.proposer
        r, pool, blk = p.runner, p.pool, p.block
        n = len(spans)
        b = self.bucket(n)
        assert b is not None, "run2() on more spans than the largest bucket"
        rows, real = b * blk, n * blk
        pad = rows - real
        for s in spans:
            pool.ensure(s.req.rid, s.start + blk)
        host = torch.zeros(3, rows, dtype=torch.long)
        host[2].fill_(r.dummy_slot)
        block = torch.full((n, blk), p.draft.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([s.tokens[0] for s in spans], dtype=torch.long)
        host[0, :real] = block.reshape(-1)
        host[1, :real] = torch.tensor(block_positions([s.start for s in spans], blk, tile_starts), dtype=torch.long)
        host[2, :real] = torch.tensor([x for s in spans for x in pool.slots(s.req.rid, s.start, s.start + blk)],
                                      dtype=torch.long)
        self.stack.io[:, :rows].copy_(host)
        is_causal = bool(getattr(p.draft, "causal", False)) if causal is None else causal
        # Padding rows: one-token sequences on the dummy page (q_len 1, so causal or not is the same to them).
        meta = AttentionMetadata(q_lens=[blk] * n + [1] * pad, kv_lens=[s.start + blk for s in spans] + [1] * pad,
                                 slot_mapping=self.stack.io[2, :rows],
                                 page_tables=[pool.table(s.req.rid) for s in spans] + [[r.dummy_page]] * pad,
                                 page_size=pool.page_size, causal=is_causal)
        self.stack.backend.plan(meta)
        self.stack.run(rows)
        self.stats["steps"] += 1
        self.stats["real_rows"] += real
        self.stats["padded_rows"] += pad
        st = self.stack
        return st.logits[:n], st.hidden[:n], st.drafts[:n]
