"""Padded piecewise forward: a stack of Qwen3-style layers run as num_layers + 1 dense segments over
static row buffers, attention eager between them; captured as CUDA graphs per row count, or run eagerly
through the very same body.

The segments are [head + L0.pre], [L0.post + L1.pre], ..., [L_last.post + tail], where `pre` is the
layer's pre_attn (residual add + norm, merged qkv GEMM, q/k norm + RoPE, optionally the K/V store) and
`post` its post_attn (o_proj, residual add + norm, gate/up, SwiGLU, down). A dense segment depends only
on the number of rows, never on KV length, so it can be captured; attention cannot (a paged-prefill
kernel freezes its KV-iteration count at capture: the seed engine's whole-forward graph corrupted tokens
past ~60), so it always runs eagerly between replays.

Contract:
- Static buffers, sized for `max_rows` and shared by every row count: `io` (token ids, positions,
  slots), the attention input `q` (and `k`/`v` when the model does not store K/V itself), the attention
  output `o` and the residual stream `res`; the subclass's `tail` writes its outputs into its own static
  buffers. A segment reads and writes only static buffers plus its own temporaries, so a captured
  segment is valid at any later replay, and the temporaries of every graph may share one memory pool
  (they are dead when their graph ends; graphs run one at a time, in order).
- `run(rows)`: the caller has filled io[:, :rows] (real rows first; padding rows: token 0, position 0,
  the runner's dummy slot, which no request owns) and planned the attention backend for the padded step
  (padding rows as their own one-token sequences on the dummy page). The first run at a row count
  captures that count's graphs (CUDA, capture=True), later runs replay them. Capture shape equals replay
  shape by construction: graphs are keyed by the row count and only ever replayed at it (`shapes`
  records it; a mismatch raises).
- capture=False runs the same segments eagerly: same kernels, same shapes, so a replay is bit-identical
  to the eager run of the same step and `eager` measures launch overhead alone. This is also how the CPU
  tests drive it.
- Whole steps (`step`, `whole` on, a backend whose `rows_ok`: FlashInfer with the Triton decode attention): a
  step the caller allows (no prefill chunk) is planned by the backend's `plan_rows` instead: its spans as
  segments of <= quantum rows for `kernels.decode_attention.span_attention`, the segment table and page lists
  in fixed buffers per (rows, quantum), so attention reads no host value and the whole body (`_direct`: the
  layers back to back, no static hand-over copies) is ONE graph per (rows, quantum), replayed at any lengths and
  pages; eager mode runs the same `_direct` body. A whole step and a piecewise step of the same row count use
  different graphs (keyed (rows, quantum) and (rows, 0)); the attention kernels differ, so the two agree to
  bf16 noise, not bit for bit (tests/gpu/test_spec_gpu.py). A prefill-mixed step runs whole only when its caller
  gives the segment room of its layout (`cap`, EngineConfig.whole_prefill): its graphs are keyed (rows, -quantum).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .attention.base import AttentionBackend, AttentionMetadata
from .models.qwen3 import Qwen3Layer
from .rope import RotaryCache

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the graph-pool handle's type in torch's stubs

log = logging.getLogger("specbench.engine")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off around CUDA-graph captures (after one collection): an engine dropped in a
    reference cycle may be collected at any allocation, and its CUDA graphs destroyed inside another engine's
    capture, which that destroy invalidates (seen once on the H200 in a process that had built and closed
    engines before: "operation failed due to a previous error during capture", with "operation not permitted
    when stream is capturing (function reset)" warnings)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PiecewiseStack:
    """Base class: subclasses define `head(ids) -> x` and `tail(x, res, rows)` (writes static outputs)."""

    name = "piecewise"

    def __init__(self, layers: Sequence[Qwen3Layer], kv: list[tuple[torch.Tensor, torch.Tensor]],
                 rope: RotaryCache, scale: float, ops, backend: AttentionBackend, max_rows: int,
                 dtype: torch.dtype, device: torch.device, capture: bool, tap: tuple[int, ...] = (),
                 whole: bool = False) -> None:
        self.layers, self.kv, self.rope, self.scale, self.ops = list(layers), kv, rope, scale, ops
        self.backend = backend
        self.max_rows = max_rows
        self.capture = capture and device.type == "cuda"
        self.tap = tuple(tap)
        self.whole = whole  # steps `step` may run whole (one graph, attention by the backend's plan_rows)
        cfg = self.layers[0].cfg
        hq, hkv, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.io = torch.zeros(3, max_rows, dtype=torch.long, device=device)
        self.q = torch.zeros(max_rows, hq, d, dtype=dtype, device=device)
        self.k = torch.zeros(max_rows, hkv, d, dtype=dtype, device=device)
        self.v = torch.zeros(max_rows, hkv, d, dtype=dtype, device=device)
        self.o = torch.zeros(max_rows, hq, d, dtype=dtype, device=device)
        self.res = torch.zeros(max_rows, h, dtype=dtype, device=device)
        self.shapes: dict[int, int] = {}  # key (row count) -> rows it was captured / first run at
        # (rows, quantum of a whole graph or 0 = piecewise) -> graphs; and K/V stored by the rope kernel at capture
        self._graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self._stored: dict[tuple[int, int], bool] = {}
        self.pool: _POOL_HANDLE | None = None
        self.capture_bytes = 0  # CUDA memory reserved by the captures (the graph pool), measured around each

    # ---- subclass hooks --------------------------------------------------------------------------
    def head(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tail(self, x: torch.Tensor, res: torch.Tensor | None, rows: int) -> None:
        raise NotImplementedError

    def tap_out(self, layer: int, hidden: torch.Tensor, rows: int) -> None:
        """A tapped decoder-layer output (x + residual) for layers before the last."""

    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.io, self.q, self.k, self.v, self.o, self.res))

    # ---- body ------------------------------------------------------------------------------------
    def stores_kv(self) -> bool:
        """Whether the fused rope kernel stores K/V (then attention gets k = v = None)."""
        return self.ops is not None and bool(getattr(self.backend, "accepts_stored_kv", False))

    def _segment(self, i: int, rows: int, stored: bool) -> None:
        n_layers = len(self.layers)
        if i == 0:
            x, res = self.head(self.io[0, :rows]), None
        else:
            x, res = self.layers[i - 1].post_attn(self.o[:rows], self.res[:rows], self.ops)
            if i - 1 in self.tap and i - 1 < n_layers - 1:
                self.tap_out(i - 1, x + res, rows)
        if i == n_layers:
            self.tail(x, res, rows)
            return
        kc, vc = self.kv[i]
        store = (kc, vc, self.io[2, :rows]) if stored else None
        q, k, v, res = self.layers[i].pre_attn(x, res, self.io[1, :rows], self.rope, self.ops, store)
        self.q[:rows].copy_(q)
        if k is not None:
            assert v is not None  # pre_attn returns k and v together, or neither (stored by the kernel)
            self.k[:rows].copy_(k)
            self.v[:rows].copy_(v)
        self.res[:rows].copy_(res)

    def _attention(self, i: int, rows: int, stored: bool) -> None:
        kc, vc = self.kv[i]
        k, v = (None, None) if stored else (self.k[:rows], self.v[:rows])
        self.o[:rows].copy_(self.backend.forward(self.q[:rows], k, v, kc, vc, self.scale))

    def _direct(self, rows: int, stored: bool) -> None:
        """The body of a whole step: the layers back to back, each attention on its layer's own q and output
        (no segment boundary to cross, so none of the static hand-over copies of `_segment`)."""
        last = len(self.layers) - 1
        x, res = self.head(self.io[0, :rows]), None
        for i, layer in enumerate(self.layers):
            kc, vc = self.kv[i]
            store = (kc, vc, self.io[2, :rows]) if stored else None
            q, k, v, r = layer.pre_attn(x, res, self.io[1, :rows], self.rope, self.ops, store)
            x, res = layer.post_attn(self.backend.forward(q, k, v, kc, vc, self.scale), r, self.ops)
            if i in self.tap and i < last:
                self.tap_out(i, x + res, rows)
        self.tail(x, res, rows)

    def _eager(self, rows: int, stored: bool) -> None:
        for i in range(len(self.layers)):
            self._segment(i, rows, stored)
            self._attention(i, rows, stored)
        self._segment(len(self.layers), rows, stored)

    # ---- run -------------------------------------------------------------------------------------
    def whole_rows(self) -> bool:
        """Whether steps without a leaky mask run whole: the `whole` switch on and a backend with `plan_rows`."""
        return self.whole and self.backend.rows_ok

    def whole_for(self, meta: AttentionMetadata, allowed: bool = True) -> bool:
        """Whether a padded step planned by `meta` runs whole (see `step`)."""
        return allowed and self.whole_rows() and not (meta.leak is not None and any(meta.leak))

    def step(self, meta: AttentionMetadata, rows: int, whole: bool = True, quantum: int = 16, cap: int = 0) -> bool:
        """Plan the backend for the padded step `meta` (rows query rows) and run it. Whole (when `whole`, the
        stack's `whole` switch and the backend's `rows_ok` allow, and no leaky mask): the backend's `plan_rows`
        (the spans as segments of <= quantum rows for the span attention kernel, metadata in fixed buffers), so
        the body, attention included, is one CUDA graph per (row count, quantum); else `plan` and the piecewise
        segments with attention eager between replays. `cap`: the segment room of a prefill-mixed layout (any
        spans, `mixed_cap`), whose graphs are keyed (rows, -quantum) apart from the verify layout's (the kernel's
        grid depends on the room); 0 = the verify layout (the backend's own room for bucket x span rows). Returns
        whether it ran whole."""
        whole = self.whole_for(meta, whole)
        if whole:
            self.backend.plan_rows(meta, quantum, cap or None)
        else:
            self.backend.plan(meta)
        self.run(rows, (-quantum if cap else quantum) if whole else 0)
        return whole

    @torch.inference_mode()
    def run(self, rows: int, whole: int = 0) -> None:
        """Run the planned step: `whole` = the quantum the backend's `plan_rows` planned it with (one graph per
        (rows, quantum): the attention grid depends on both; negative: a prefill-mixed layout's room), 0 =
        planned by `plan` (piecewise)."""
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"rows={rows} is invalid: expected 1..{self.max_rows}")
        stored = self.stores_kv()
        first = self.shapes.setdefault(rows, rows)
        if first != rows:  # unreachable by construction; kept as the invariant's guard
            raise RuntimeError(f"{self.name}: graphs captured at {first} rows replayed at {rows}")
        if not self.capture or self._stored.get((rows, whole), stored) != stored:
            # eager mode, or a step whose store mode differs from the capture
            (self._direct if whole else self._eager)(rows, stored)
            return
        if (rows, whole) not in self._graphs:
            self._capture(rows, stored, whole)
        graphs = self._graphs[(rows, whole)]
        if whole:
            graphs[0].replay()
            return
        for i in range(len(self.layers)):
            graphs[i].replay()
            self._attention(i, rows, stored)
        graphs[-1].replay()

    def _capture(self, rows: int, stored: bool, whole: int = 0) -> None:
        # Warm-up outside the capture: Triton compiles, cuBLAS picks its kernels (the outputs are redone
        # by the replay that follows, so this step's result comes from the graphs like every later one).
        (self._direct if whole else self._eager)(rows, stored)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graphs = []
        with gc_paused():
            if whole:  # attention reads only the backend's fixed row buffers: capture the whole body
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._direct(rows, stored)
                graphs.append(g)
            else:
                for i in range(len(self.layers) + 1):  # attention is not captured: it only touches static buffers
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        self._segment(i, rows, stored)
                    if self.pool is None:
                        self.pool = g.pool()
                    graphs.append(g)
            if self.pool is None:
                self.pool = graphs[0].pool()
        torch.cuda.synchronize()
        self.capture_bytes += max(0, torch.cuda.memory_reserved() - before)
        self._graphs[(rows, whole)] = graphs
        self._stored[(rows, whole)] = stored
        log.debug("%s: captured %s at %d rows", self.name, "the whole body" if whole else f"{len(graphs)} segments",
                  rows)

    @torch.inference_mode()
    def time_padded(self, rows: int, dummy_slot: int, dummy_page: int, page_size: int, causal: bool = True,
                    reps: int = 3, whole: bool = True, quantum: int = 16, cap: int = 0) -> float:
        """Median seconds of `step` on a step of padding rows only (token 0, position 0, the dummy slot, each a
        one-token sequence on the dummy page), after one untimed run (the capture on CUDA): the dense work and
        launches of that row count, whole or piecewise as a served step of that kind (`whole`) would run, for
        the span cost model (spec/costs.py) and the pre-captures."""
        self.io[0, :rows].zero_()
        self.io[1, :rows].zero_()
        self.io[2, :rows].fill_(dummy_slot)
        meta = AttentionMetadata(q_lens=[1] * rows, kv_lens=[1] * rows, slot_mapping=self.io[2, :rows],
                                 page_tables=[[dummy_page]] * rows, page_size=page_size, causal=causal)
        return median_time(lambda: self.step(meta, rows, whole, quantum, cap), self.io.device, reps)

    @property
    def captured(self) -> list[int]:
        """Row counts with graphs captured (whole or piecewise)."""
        return sorted({rows for rows, _ in self._graphs})

    def captured_as(self, whole: bool, quantum: int | None = None) -> list[int]:
        """Row counts captured whole (at `quantum`, or any; a negative quantum: a prefill-mixed layout's) or
        piecewise."""
        return sorted({rows for rows, q in self._graphs
                       if (q != 0) == whole and (quantum is None or not whole or q == quantum)})


def median_time(fn, device: torch.device, reps: int) -> float:
    """Median wall seconds of fn() over `reps` runs after one untimed run, synchronised on CUDA."""
    import time  # noqa: PLC0415

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
