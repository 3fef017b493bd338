"""Decode CUDA graphs per batch bucket, whole-step or piecewise.

Contract:
- A decode step (every span one token, at most the largest bucket of them) is padded up to the smallest
  bucket that holds it. Padding rows feed token 0 at position 0, write their K/V to the runner's dummy page
  (in no request's page table) and attend to that one slot; their logits and taps are dropped.
- The padded step runs captured (replay) or eagerly (`capture=False`, the engine's `eager` switch) through
  the same body: same kernels, same shapes, same attention plan. So a replay is bit-identical to the eager
  run of the same batch, and `eager` measures launch overhead alone.
- Whole-step mode (the backend is `graph_safe`: FlashInfer decode in its CUDA-graph mode, whose fixed-size
  plan buffers are re-planned on the host before every replay): one graph per bucket holds embed -> all
  layers with attention -> final norm -> lm_head -> fp32 logits (and the taps a proposer asked for).
- Piecewise mode (any other backend, e.g. the torch reference): per bucket, num_layers + 1 dense segments
  ([embed + L0.pre], [L0.post + L1.pre], ..., [L_last.post + norm + lm_head]) are captured; attention runs
  eagerly between replays on the segment's static q/k/v and writes into a static output buffer. This is the
  shape issue 8's verify graphs take (span > 1: rows = bucket x span).
- With the runner's context writer (a drafter's `write_context`, EngineConfig.graph_context) the body also
  projects the tapped rows into the drafter's context at their slots, padding rows onto the dummy slot; the
  verify graphs' tail does the same, so a step's commit only advances the drafter's context length.
- Buckets are captured largest first into one memory pool; a bucket's graphs are only ever replayed at the
  row count they were captured with (capture shape == replay shape), and graphs of one bucket replay in
  capture order, so sharing the pool is safe for step-local tensors.

Verify graphs (`VerifyGraphs`, issue 8): every step that is not pure decode (verify spans, decode spans
riding with them, and prefill chunks that arrive meanwhile) runs padded to rows = bucket x span, where span
is the smallest configured span >= the longest decode/verify span (default: the engine's K + 1; 16 rows
for an engine without speculation) and bucket the smallest batch bucket that holds both the number of
spans and the step's rows; a step that fits none (a long prefill chunk) runs the plain forward. Real rows
are packed first in span order (so the flat row indices of logits and taps are those of the plain
forward), padding rows after them as their own one-token sequences on the dummy page. The body is
`piecewise.PiecewiseStack`: num_layers + 1 dense segments captured per row count, attention eager between
replays; a step with no prefill chunk runs whole instead where the backend can (`PiecewiseStack.step`,
EngineConfig.whole_graphs: one graph per (rows, span), the span attention inside), and so does a prefill-mixed
step of the row ladder whose chunks hold at most EngineConfig.whole_prefill tokens (`mixed_whole`: every span as
segments of <= MIXED_QUANTUM rows, in the room `mixed_cap` gives its row count). Deferred drafts
(spec/pending.py): their rows hold placeholders in the host copy and are filled in from the device tensor.
A truncated span (a request near max_tokens), a decode span among verify spans or a prefill chunk is
therefore padded, never replayed at a shape it was not captured at: the seed engine's
short-then-long bug (a bucket captured at a short span replayed for a long one left the tail rows' logits
stale) cannot happen by construction. Logits and taps returned are views of static buffers, valid until
the next step of this runner. Under closed-loop load a new request's prefill joins almost every
speculative step, so keeping those steps on the graphs matters as much as the verify spans themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .attention.base import AttentionMetadata
from .piecewise import PiecewiseStack, gc_paused, median_time

if TYPE_CHECKING:  # the runner imports this module
    from torch.cuda import _POOL_HANDLE  # the graph-pool handle's type in torch's stubs

    from .runner import ModelRunner
    from .scheduler import Span
    from .spec.pending import PendingDrafts

log = logging.getLogger("specbench.engine")
NO_SPEC_SPAN = 16  # row quantum of the padded runner in an engine without speculation (prefill-mixed steps)
MIXED_QUANTUM = 16  # rows per span-kernel segment of a prefill-mixed step run whole (EngineConfig.whole_prefill)


def mixed_cap(rows: int, max_seqs: int, quantum: int = MIXED_QUANTUM) -> int:
    """Segment room of a prefill-mixed step of `rows` padded rows and at most `max_seqs` spans: each span of l
    rows makes ceil(l / quantum) <= l / quantum + 1 segments and the padding rows share ceil(pad / quantum), so
    ceil(rows / quantum) + max_seqs + 1 bounds every layout; one room per row count, one graph per row count."""
    return -(-rows // quantum) + max_seqs + 1


def row_ladder(top: int) -> list[int]:
    """Row counts a prefill-mixed step is padded to: 16-row steps to 128, 32 to 256, 64 to 512, 128 beyond, and
    `top` itself (waste under 16 rows or at most a fifth of the step)."""
    out = list(range(16, min(top, 128) + 1, 16)) + list(range(160, min(top, 256) + 1, 32)) + \
        list(range(320, min(top, 512) + 1, 64)) + list(range(640, top + 1, 128)) + [top]
    return sorted({x for x in out if x <= top})


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_batch (always included)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8)) + [max_batch]
    return sorted(set(out))


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, tap: tuple[int, ...] = (), capture: bool = True,
                 buckets: list[int] | None = None, piecewise: bool | None = None) -> None:
        self.runner = runner
        self.model, self.backend = runner.model, runner.backend
        self.tap = tuple(tap)
        self.context = runner.context_writer_for(self.tap)  # the drafter's context rows, written inside the step (or None)
        self.capture = capture and runner.device.type == "cuda"
        self.full = not piecewise if piecewise is not None else bool(getattr(self.backend, "graph_safe", False))
        self.buckets = sorted(set(buckets or default_buckets(runner.cfg.max_num_seqs)))
        big = self.buckets[-1]
        dev = runner.device
        # rows 0/1/2: token ids, positions, slots; padding rows keep (0, 0, dummy slot)
        self.io = torch.zeros(3, big, dtype=torch.long, device=dev)
        self.io[2].fill_(runner.dummy_slot)
        self.pool: _POOL_HANDLE | None = None
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._segs: dict[int, tuple[list[Callable[[], None]], list[Callable[[], None]], dict]] = {}
        if self.capture:
            with torch.inference_mode():
                try:
                    for b in reversed(self.buckets):
                        self._capture(b)
                except RuntimeError as e:
                    if not self.full:
                        raise
                    # A backend whose kernels will not capture: keep attention out of the graphs instead.
                    log.warning("whole-step decode graph capture failed (%s); falling back to piecewise graphs", e)
                    torch.cuda.synchronize()
                    self.full, self.pool = False, None
                    self._graphs.clear()
                    self._out.clear()
                    for b in reversed(self.buckets):
                        self._capture(b)

    @property
    def mode(self) -> str:
        """"whole" or "piecewise" graphs, or "eager" (the same padded body, launched without graphs)."""
        return ("whole" if self.full else "piecewise") if self.capture else "eager"

    # ---- shapes --------------------------------------------------------------------------------
    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def can_run(self, spans: list[Span]) -> bool:
        return 0 < len(spans) <= self.buckets[-1] and all(len(s.tokens) == 1 for s in spans)

    def _meta(self, b: int, kv_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
        pad = b - len(kv_lens)
        return AttentionMetadata(q_lens=[1] * b, kv_lens=kv_lens + [1] * pad,
                                 slot_mapping=self.io[2, :b], page_tables=tables + [[self.runner.dummy_page]] * pad,
                                 page_size=self.runner.pool.page_size, causal=True)

    def _fill(self, spans: list[Span], b: int, tokens: torch.Tensor | None = None) -> AttentionMetadata:
        """The bucket's static inputs for `spans`: token ids (from the spans, or the device tensor `tokens`),
        positions and slots, through one pinned, stream-ordered copy on CUDA (no host wait: the step before may
        still be running, engine/ahead.py)."""
        pool = self.runner.pool
        n = len(spans)
        cuda = self.io.is_cuda
        host = torch.zeros(3, b, dtype=torch.long, pin_memory=cuda)
        host[2].fill_(self.runner.dummy_slot)
        if tokens is None:
            host[0, :n] = torch.tensor([s.tokens[0] for s in spans], dtype=torch.long)
        host[1, :n] = torch.tensor([s.start for s in spans], dtype=torch.long)
        host[2, :n] = torch.tensor([pool.slot(s.req.rid, s.start) for s in spans], dtype=torch.long)
        self.io[:, :b].copy_(host, non_blocking=cuda)
        if tokens is not None:
            self.io[0, :n].copy_(tokens)
        return self._meta(b, [s.start + 1 for s in spans], [pool.table(s.req.rid) for s in spans])

    # ---- bodies --------------------------------------------------------------------------------
    def _whole(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        r = self.runner
        hidden, taps = self.model(self.io[0, :b], self.io[1, :b], self.backend, r.kv, r.rope, self.tap)
        tapped = torch.cat(taps, dim=-1) if taps else None
        if self.context is not None and tapped is not None:
            self.context(tapped, self.io[1, :b], self.io[2, :b])
        return self.model.logits(hidden).float(), tapped

    def _segments(self, b: int) -> tuple[list[Callable[[], None]], list[Callable[[], None]], dict]:
        """(dense segments, attentions, state): segment i, then attention i, ..., then the last segment."""
        if b in self._segs:
            return self._segs[b]
        m, r, be = self.model, self.runner, self.backend
        cfg = m.cfg
        n_layers = len(m.layers)
        ids, pos = self.io[0, :b], self.io[1, :b]
        st: dict = {"q": [None] * n_layers, "k": [None] * n_layers, "v": [None] * n_layers,
                    "res": [None] * n_layers, "taps": {}, "out": None,
                    "o": [torch.empty(b, cfg.num_attention_heads, cfg.head_dim, dtype=r.dtype, device=r.device)
                          for _ in range(n_layers)]}

        def segment(i: int) -> Callable[[], None]:
            def run() -> None:
                if i == 0:
                    x, res = F.embedding(ids, m.embed), None
                else:
                    x, res = m.layers[i - 1].post_attn(st["o"][i - 1], st["res"][i - 1], m.ops)
                    if i - 1 in self.tap:
                        st["taps"][i - 1] = x + res
                if i < n_layers:
                    store = m.fused_store(be, r.kv[i])
                    q, k, v, res = m.layers[i].pre_attn(x, res, pos, r.rope, m.ops, store)
                    st["q"][i], st["k"][i], st["v"][i], st["res"][i] = q, k, v, res
                else:
                    hidden, taps = m.finish(x, res, dict(st["taps"]), self.tap)
                    tapped = torch.cat(taps, dim=-1) if taps else None
                    if self.context is not None and tapped is not None:
                        self.context(tapped, pos, self.io[2, :b])
                    st["out"] = (m.logits(hidden).float(), tapped)
            return run

        def attention(i: int) -> Callable[[], None]:
            def run() -> None:
                o = be.forward(st["q"][i], st["k"][i], st["v"][i], r.kv[i][0], r.kv[i][1], m.scale)
                st["o"][i].copy_(o)
            return run

        self._segs[b] = ([segment(i) for i in range(n_layers + 1)], [attention(i) for i in range(n_layers)], st)
        return self._segs[b]

    def _piecewise_eager(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        segs, attns, st = self._segments(b)
        for i, a in enumerate(attns):
            segs[i]()
            a()
        segs[-1]()
        return st["out"]

    # ---- capture / run -------------------------------------------------------------------------
    def _capture(self, b: int) -> None:
        meta = self._meta(b, [], [])
        if self.full:
            self.backend.prepare_capture(meta)
            self._whole(b)  # warm-up: Triton compiles/tunes, cuBLAS picks its kernels, outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with gc_paused(), torch.cuda.graph(g, pool=self.pool):
                out = self._whole(b)
            graphs = [g]
        else:
            self.backend.plan(meta)
            self._piecewise_eager(b)
            torch.cuda.synchronize()
            segs, _, st = self._segments(b)
            graphs = []
            with gc_paused():
                for seg in segs:  # attention between segments is not captured: it only reads/writes static buffers
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        seg()
                    if self.pool is None:
                        self.pool = g.pool()
                    graphs.append(g)
            out = st["out"]
        if self.pool is None:
            self.pool = graphs[0].pool()
        self._graphs[b] = graphs
        self._out[b] = out
        torch.cuda.synchronize()

    @torch.inference_mode()
    def launch(self, spans: list[Span], tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the padded step of `spans` (input tokens from the device tensor `tokens` when given, else from
        the spans) with no host read; (logits [n, V], taps [n, ...] or None): views of the bucket's static
        buffers, valid until its next replay (stream order: ops queued after this see this step's values)."""
        n = len(spans)
        b = self.bucket(n)
        assert b is not None and self.can_run(spans)
        meta = self._fill(spans, b, tokens)
        if self.full:
            self.backend.prepare_replay(meta)
        else:
            self.backend.plan(meta)
        if not self.capture:
            logits, taps = self._whole(b) if self.full else self._piecewise_eager(b)
        elif self.full:
            self._graphs[b][0].replay()
            logits, taps = self._out[b]
        else:
            segs, attns, _ = self._segments(b)
            graphs = self._graphs[b]
            for i, a in enumerate(attns):
                graphs[i].replay()
                a()
            graphs[-1].replay()
            logits, taps = self._out[b]
        return logits[:n], (taps[:n] if taps is not None else None)

    @torch.inference_mode()
    def run(self, spans: list[Span], logit_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(spans)
        logits, taps = self.launch(spans)
        if logit_rows == list(range(n)):
            out = logits.clone()
        else:
            out = logits[torch.tensor(logit_rows, dtype=torch.long, device=logits.device)]
        # taps: a view of the static buffer, read by this step's commit only (as the verify graphs return theirs)
        return out, taps


    @torch.inference_mode()
    def time_padded(self, b: int, reps: int = 3) -> float:
        """Median seconds of one replay (or eager run) of bucket b on padding rows only (spec/costs.py)."""
        assert b in self.buckets
        self.io[0, :b].zero_()
        self.io[1, :b].zero_()
        self.io[2, :b].fill_(self.runner.dummy_slot)
        meta = self._meta(b, [], [])

        def once() -> None:
            if self.full:
                self.backend.prepare_replay(meta)
            else:
                self.backend.plan(meta)
            if not self.capture:
                self._whole(b) if self.full else self._piecewise_eager(b)
            elif self.full:
                self._graphs[b][0].replay()
            else:
                segs, attns, _ = self._segments(b)
                for i, a in enumerate(attns):
                    self._graphs[b][i].replay()
                    a()
                self._graphs[b][-1].replay()
        return median_time(once, self.runner.device, reps)


class TargetStack(PiecewiseStack):
    """The target's piecewise body: embedding head; final norm, fp32 logits of every row and the taps."""

    name = "verify"

    def __init__(self, runner: ModelRunner, tap: tuple[int, ...], max_rows: int, capture: bool,
                 graph_logits: bool = True) -> None:
        m = runner.model
        super().__init__(m.layers, runner.kv, runner.rope, m.scale, m.ops, runner.backend, max_rows, runner.dtype,
                         runner.device, capture, tap, whole=runner.cfg.whole_graphs)
        self.model = m
        self.hidden = m.cfg.hidden_size
        self.graph_logits = graph_logits
        # graph_logits: fp32 logits of every row written by the captured tail; else the tail writes the
        # final-normed hidden rows and `logits_of` projects only the rows a step reads, after the replay
        self.logits = (torch.zeros(max_rows, m.cfg.vocab_size, dtype=torch.float32, device=runner.device)
                       if graph_logits else None)
        self.final = (None if graph_logits else
                      torch.zeros(max_rows, self.hidden, dtype=runner.dtype, device=runner.device))
        self.taps = (torch.zeros(max_rows, len(tap) * self.hidden, dtype=runner.dtype, device=runner.device)
                     if tap else None)
        self.context = runner.context_writer_for(self.tap)  # the drafter's context rows, written by the tail (or None)

    def static_bytes(self) -> int:
        extra = [t for t in (self.logits, self.final, self.taps) if t is not None]
        return super().static_bytes() + sum(t.numel() * t.element_size() for t in extra)

    def logits_of(self, rows: list[int], real: int) -> torch.Tensor:
        """fp32 logits of the flat rows `rows` (all < real) of the last run."""
        idx = None if rows == list(range(real)) else torch.tensor(rows, dtype=torch.long, device=self.io.device)
        if self.logits is not None:
            return self.logits[:real] if idx is None else self.logits[idx]
        assert self.final is not None
        h = self.final[:real] if idx is None else self.final[idx]
        return self.model.logits(h).float()

    def head(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.model.embed)

    def tap_out(self, layer: int, hidden: torch.Tensor, rows: int) -> None:
        j = self.tap.index(layer)
        assert self.taps is not None
        self.taps[:rows, j * self.hidden:(j + 1) * self.hidden].copy_(hidden)

    def tail(self, x: torch.Tensor, res: torch.Tensor | None, rows: int) -> None:
        hidden, _ = self.model.finish(x, res, {}, ())
        last = len(self.layers) - 1
        if last in self.tap:  # HF's hidden_states[-1] is the final-normed output (Qwen3ForCausalLM.finish)
            self.tap_out(last, hidden, rows)
        if self.context is not None and self.taps is not None:
            self.context(self.taps[:rows], self.io[1, :rows], self.io[2, :rows])
        if self.logits is not None:
            self.logits[:rows].copy_(self.model.logits(hidden))
        else:
            assert self.final is not None
            self.final[:rows].copy_(hidden)


class VerifyGraphs:
    """Piecewise verify graphs per (batch bucket, span); see the module docstring."""

    def __init__(self, runner: ModelRunner, tap: tuple[int, ...], spans: tuple[int, ...], capture: bool = True,
                 buckets: list[int] | None = None, padded_rows: str | None = None,
                 graph_logits: bool | None = None) -> None:
        """padded_rows / graph_logits: EngineConfig's (None: the runner's config)."""
        if not spans or min(spans) < 1:
            raise ValueError(f"spans={spans!r} is invalid: expected span lengths >= 1")
        self.runner = runner
        self.tap = tuple(tap)
        self.spans = tuple(sorted(set(spans)))
        self.buckets = sorted(set(buckets or default_buckets(runner.cfg.max_num_seqs)))
        self.padded_rows = padded_rows or runner.cfg.padded_rows
        if self.padded_rows not in ("ladder", "bucket"):
            raise ValueError(f"padded_rows={self.padded_rows!r} is invalid: expected ladder or bucket")
        top = self.buckets[-1] * self.spans[-1]
        if self.padded_rows == "ladder":  # a prefill-mixed step holds at most max_num_batched_tokens rows
            top = max(top, runner.cfg.max_num_batched_tokens)
        self.ladder = row_ladder(top) if self.padded_rows == "ladder" else []
        gl = runner.cfg.graph_logits if graph_logits is None else graph_logits
        self.stack = TargetStack(runner, self.tap, top, capture, graph_logits=gl)
        self.stats = {"steps": 0, "whole_steps": 0, "real_rows": 0, "padded_rows": 0, "prefill_steps": 0,
                      "deferred_rows": 0, "whole_prefill_steps": 0}
        # prefill-mixed steps of the ladder whose chunks hold at most this many tokens run whole (0: piecewise)
        self.whole_prefill = runner.cfg.whole_prefill if self.ladder else 0
        self.max_seqs = runner.cfg.max_num_seqs

    @property
    def mode(self) -> str:
        return "piecewise" if self.stack.capture else "eager"

    def key(self, spans: list[Span]) -> tuple[int, int] | None:
        """(batch bucket, span) the step runs at, or None when it must take the plain forward. With the
        row ladder, a step with a prefill chunk runs at `rows(spans)` rows instead (its key is (rows, 1))."""
        if not spans:
            return None
        rows = sum(len(s.tokens) for s in spans)
        if self.ladder and any(s.kind == "prefill" for s in spans):
            n = next((x for x in self.ladder if x >= rows), None)
            return None if n is None else (n, 1)
        longest = max((len(s.tokens) for s in spans if s.kind != "prefill"), default=1)
        span = next((x for x in self.spans if x >= longest), None)
        if span is None:
            return None
        b = next((x for x in self.buckets if x >= len(spans) and x * span >= rows), None)
        return None if b is None else (b, span)

    def run(self, spans: list[Span], logit_rows: list[int], key: tuple[int, int] | None = None,
            pending: PendingDrafts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`pending`: drafts still on the device (spec/pending.py): their rows hold placeholders in the spans and
        are filled in from the device tensor after the host rows are copied (no host read)."""
        key = key or self.key(spans)
        assert key is not None, "run() on a step that key() refuses"
        b, span = key
        rows = b * span
        r, pool = self.runner, self.runner.pool
        real = sum(len(s.tokens) for s in spans)
        pad = rows - real
        host = torch.zeros(3, rows, dtype=torch.long)
        host[2].fill_(r.dummy_slot)
        host[0, :real] = torch.tensor([t for s in spans for t in s.tokens], dtype=torch.long)
        host[1, :real] = torch.tensor([p for s in spans for p in range(s.start, s.start + len(s.tokens))],
                                      dtype=torch.long)
        host[2, :real] = torch.tensor([x for s in spans for x in pool.slots(s.req.rid, s.start, s.start + len(s.tokens))],
                                      dtype=torch.long)
        io = self.stack.io
        cuda = io.is_cuda
        # pinned and stream-ordered: the host lays the step out while the draft before it still runs
        io[:, :rows].copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
        if pending is not None:
            dst, src = pending.flat_rows(spans)
            if dst:
                ix = torch.tensor([dst, src], dtype=torch.long)
                ix = ix.pin_memory().to(io.device, non_blocking=True) if cuda else ix
                io[0].index_copy_(0, ix[0], pending.tokens.view(-1).index_select(0, ix[1]))
                self.stats["deferred_rows"] += len(dst)
        meta = AttentionMetadata(q_lens=[len(s.tokens) for s in spans] + [1] * pad,
                                 kv_lens=[s.start + len(s.tokens) for s in spans] + [1] * pad,
                                 slot_mapping=io[2, :rows],
                                 page_tables=[pool.table(s.req.rid) for s in spans] + [[r.dummy_page]] * pad,
                                 page_size=pool.page_size, causal=True)
        prefill = any(s.kind == "prefill" for s in spans)
        if self.mixed_whole(spans, span):  # one graph: every span as segments of <= MIXED_QUANTUM rows
            ran = self.stack.step(meta, rows, whole=True, quantum=MIXED_QUANTUM, cap=mixed_cap(rows, self.max_seqs))
            self.stats["whole_prefill_steps"] += ran
        else:
            ran = self.stack.step(meta, rows, whole=not prefill, quantum=span)
        self.stats["whole_steps"] += ran
        self.stats["steps"] += 1
        self.stats["real_rows"] += real
        self.stats["padded_rows"] += pad
        self.stats["prefill_steps"] += prefill
        out = self.stack.logits_of(logit_rows, real)
        taps = self.stack.taps[:real] if self.stack.taps is not None else None
        return out, taps

    def mixed_whole(self, spans: list[Span], span: int) -> bool:
        """Whether a step runs as a whole prefill-mixed step: a ladder step (key span 1) with a prefill chunk of
        at most `whole_prefill` tokens in all, and no more spans than the room `mixed_cap` holds."""
        if not self.whole_prefill or span != 1 or len(spans) > self.max_seqs:
            return False
        chunk = sum(len(s.tokens) for s in spans if s.kind == "prefill")
        return 0 < chunk <= self.whole_prefill

    def mixed_rows(self) -> list[int]:
        """The ladder's row counts a whole prefill-mixed step can take: at most whole_prefill chunk rows beside
        max_num_seqs spans of the longest span."""
        if not self.whole_prefill:
            return []
        top = self.whole_prefill + self.max_seqs * self.spans[-1]
        return [n for n in self.ladder if n <= next((x for x in self.ladder if x >= top), self.ladder[-1])]

    def row_counts(self) -> list[int]:
        """Every row count a step of this runner can take: bucket x span, and the ladder (prefill-mixed steps)."""
        return sorted({b * s for b in self.buckets for s in self.spans} | set(self.ladder))

    def capture_all(self) -> list[int]:
        """Capture (CUDA, capture mode) every row count not captured yet, on padding rows alone (the dummy
        page), so no served step waits for a capture; returns the row counts captured now."""
        if not self.stack.capture:
            return []
        r = self.runner
        # verify steps (bucket x span rows, no prefill chunk) run whole where the stack can; prefill-mixed steps
        # (the ladder's row counts) run piecewise
        whole = self.stack.whole_rows()
        want = [(b * s, s if whole else 0) for b in self.buckets for s in self.spans] + [(n, 0) for n in self.ladder]
        if whole:  # prefill-mixed steps with short chunks run whole (EngineConfig.whole_prefill): keyed (rows, -q)
            want += [(n, -MIXED_QUANTUM) for n in self.mixed_rows()]
        new = [(n, q) for n, q in dict.fromkeys(want) if n not in self.stack.captured_as(q != 0, q)]
        for n, q in sorted(new, reverse=True):  # largest first: the shared pool is sized once
            self.stack.time_padded(n, r.dummy_slot, r.dummy_page, r.pool.page_size, causal=True, reps=0,
                                   whole=q != 0, quantum=abs(q) or 16,
                                   cap=mixed_cap(n, self.max_seqs) if q < 0 else 0)
        return sorted({n for n, _ in new})

    def describe(self) -> dict:
        return {"mode": self.mode, "whole_rows": self.stack.captured_as(True), "buckets": self.buckets,
                "spans": list(self.spans), "rows": self.padded_rows,
                "graph_logits": self.stack.logits is not None, "max_rows": self.stack.max_rows,
                "captured_rows": self.stack.captured, "static_bytes": self.stack.static_bytes(),
                "capture_bytes": self.stack.capture_bytes, **self.stats}
