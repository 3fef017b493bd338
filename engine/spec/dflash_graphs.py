"""The DFlash draft as a padded graph: with whole graphs (EngineConfig.whole_graphs, a backend with `plan_rows`)
one graph per row count, the non-causal block attention over the drafter's paged context inside it (the span
attention, quantum B); else dense ops per drafter layer captured, that attention eager between replays.

Contract:
- A draft of N requests runs padded to rows = bucket x B (B = block size; bucket the smallest batch
  bucket >= N). Rows [i * B, (i + 1) * B) are request i's block [anchor, MASK x (B - 1)] at positions
  [start, start + B), its K/V written to the request's scratch slots past its committed length (the same
  slots the plain draft uses); padding rows after the real ones read token 0 at position 0, write the
  dummy slot and attend to it alone (one-token non-causal sequences on the dummy page).
- The body is `piecewise.PiecewiseStack` over the drafter's layers (each a `Qwen3Layer`, so on CUDA the
  Triton ops and the fused rope + K/V store serve the drafter too): head = the target's embedding times
  the drafter's input scale; tail = final norm and the target's lm_head over block slots 1..B-1 into a
  static fp32 [bucket, B - 1, V] buffer. Graphs are keyed by row count (and whole or not), captured at
  first use, only ever replayed at it. `run` returns a view of that buffer, valid until the next draft.
- Same function as `DFlashProposer.draft_logits_plain` (tested on CPU with capture=False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..attention.base import AttentionMetadata
from ..graphs import default_buckets
from ..models.layers import add_rms_norm
from ..piecewise import PiecewiseStack
from ..scheduler import Span

if TYPE_CHECKING:
    from .dflash import DFlashProposer


def block_positions(starts: list[int], block: int, tile_starts: bool = False) -> list[int]:
    """The positions of N draft blocks laid out row after row: request i's block is [start_i, start_i + B).
    `tile_starts` is the self-test's batched_draft_pos fault: the starts tiled across rows (torch's
    `starts.repeat(B)` where `starts.repeat_interleave(B)` was meant), the same for one request and wrong
    for every request of a batch of several."""
    n = len(starts)
    if tile_starts:
        return [starts[r % n] + r % block for r in range(n * block)]
    return [s + j for s in starts for j in range(block)]


class DraftStack(PiecewiseStack):
    name = "draft"

    def __init__(self, proposer: DFlashProposer, max_blocks: int, capture: bool) -> None:
        d, r = proposer.draft, proposer.runner
        super().__init__(d.layers, r.draft_kv, proposer.rope, d.scale, r.model.ops, r.backend,
                         max_blocks * proposer.block, r.dtype, r.device, capture, whole=r.cfg.whole_graphs)
        self.draft, self.target, self.block = d, proposer.target, proposer.block
        self.logits = torch.zeros(max_blocks, self.block - 1, self.target.cfg.vocab_size, dtype=torch.float32,
                                  device=r.device)

    def static_bytes(self) -> int:
        return super().static_bytes() + self.logits.numel() * self.logits.element_size()

    def head(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.target.embed) * self.draft.input_embedding_scale

    def tail(self, x: torch.Tensor, res: torch.Tensor | None, rows: int) -> None:
        norm = self.ops.add_rms_norm if self.ops is not None else add_rms_norm
        hidden, _ = norm(x, res, self.draft.norm, self.draft.cfg.rms_norm_eps)
        blocks = rows // self.block
        # contiguous: on the strided view [blocks, B - 1, H] F.linear runs a batched GEMM, one pass over the
        # whole lm_head per block (measured on the H200 at 64 blocks: 11.7 ms, the draft's largest kernel, against
        # about 1 ms for the one GEMM over blocks x (B - 1) rows; docs/levers.md)
        h = hidden.reshape(blocks, self.block, -1)[:, 1:].contiguous()
        self.logits[:blocks].copy_(self.target.logits(h))


class DraftGraphs:
    stack_class: type[DraftStack] = DraftStack  # DFlash2: DraftStack2 (its buffers, its layers, its tail)

    def __init__(self, proposer: DFlashProposer, capture: bool = True, buckets: list[int] | None = None) -> None:
        self.proposer = proposer
        self.buckets = sorted(set(buckets or default_buckets(proposer.runner.cfg.max_num_seqs)))
        self.stack = self.stack_class(proposer, self.buckets[-1], capture)
        self.stats = {"steps": 0, "whole_steps": 0, "real_rows": 0, "padded_rows": 0}

    @property
    def mode(self) -> str:
        return "piecewise" if self.stack.capture else "eager"

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def can_run(self, spans: list[Span]) -> bool:
        return 0 < len(spans) <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, spans: list[Span], tile_starts: bool = False) -> torch.Tensor:
        """Draft logits [N, B - 1, V] (a view of the static buffer). `tile_starts`: the self-test's wrong
        block positions (dflash.block_positions)."""
        return self.stack.logits[:self._replay(spans, tile_starts, False)]

    def _replay(self, spans: list[Span], tile_starts: bool, causal: bool) -> int:
        """Lay the N blocks out padded to their bucket, plan the attention (non-causal unless `causal`;
        padding rows are one-token sequences on the dummy page, to which causal or not is the same), run the
        stack; returns N. The outputs are in the stack's static buffers."""
        p = self.proposer
        r, pool, blk = p.runner, p.pool, p.block
        n = len(spans)
        b = self.bucket(n)
        assert b is not None, "a draft of more spans than the largest bucket"
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
        io = self.stack.io
        io[:, :rows].copy_(host)
        meta = AttentionMetadata(q_lens=[blk] * n + [1] * pad, kv_lens=[s.start + blk for s in spans] + [1] * pad,
                                 slot_mapping=io[2, :rows],
                                 page_tables=[pool.table(s.req.rid) for s in spans] + [[r.dummy_page]] * pad,
                                 page_size=pool.page_size, causal=causal)
        self.stats["whole_steps"] += self.stack.step(meta, rows, quantum=blk)
        self.stats["steps"] += 1
        self.stats["real_rows"] += real
        self.stats["padded_rows"] += pad
        return n

    def capture_all(self) -> list[int]:
        """Capture (CUDA, capture mode) every row count bucket x B not captured yet, on padding rows alone (the
        dummy page), largest first; returns the row counts captured now (VerifyGraphs.capture_all's twin)."""
        if not self.stack.capture:
            return []
        r, blk = self.proposer.runner, self.proposer.block
        new = [b * blk for b in self.buckets if b * blk not in self.stack.captured_as(self.stack.whole_rows(), blk)]
        for n in sorted(new, reverse=True):  # largest first: the shared pool is sized once
            self.stack.time_padded(n, r.dummy_slot, r.dummy_page, r.pool.page_size, causal=False, reps=0, quantum=blk)
        return new

    def describe(self) -> dict:
        return {"mode": self.mode, "buckets": self.buckets, "block": self.proposer.block,
                "captured_rows": self.stack.captured, "static_bytes": self.stack.static_bytes(),
                "capture_bytes": self.stack.capture_bytes, **self.stats}
