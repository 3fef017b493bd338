"""FlashInfer attention over the engine's paged cache (CUDA only; `flashinfer-python` >= 0.5).

Layout: the engine keeps one [num_slots, Hkv, D] tensor per layer for K and one for V, which is FlashInfer's
"NHD" paged layout [num_pages, page_size, Hkv, D] viewed flat. A step's page tables become (indptr,
indices, last_page_len) once in `plan`; every layer then runs the same planned wrapper:
- all spans of length 1 (decode): BatchDecodeWithPagedKVCacheWrapper;
- anything else (prefill chunks, verify spans, a drafter's non-causal block): the paged prefill wrapper,
  causal or not as the metadata says (causal queries are aligned to the end of their request's keys).
Wrapper planning needs the head layout and scale, so eager plans are made lazily at the first `forward`
of a step and redone if a later call brings another head layout (the drafter shares the backend).

CUDA graphs (`prepare_capture` / `prepare_replay`): decode only, through one CUDA-graph-mode decode wrapper
per batch size with fixed indptr/indices/last_page_len buffers. In that mode FlashInfer's split-KV choice
depends only on the batch size, so a plan made for the real lengths before each replay drives the captured
kernels correctly. The host partition depends only on the pages per request, so when those are unchanged
since the last plan of that batch size only the page ids and last-page lengths are copied (no re-plan).

Triton decode (`decode_attention="triton"`): decode-only steps (every span one token; eager and CUDA-graph
paths) run the split-K kernel of `specbench.kernels.decode_attention` instead of the decode wrapper; prefill
and verify steps keep FlashInfer. Its metadata (sequence lengths, kv_indptr, page ids: the same CSR arrays)
is one int32 device buffer: per step in eager `plan`, per batch bucket (fixed size, refreshed by one
host-to-device copy in `prepare_capture` / `prepare_replay`) for graphs; the grid and the fp32 partials
scratch depend on the batch and head layout only, so forward reads no host value and replays see the
current lengths and pages.

K/V storage: `forward(q, k, v, ...)` writes k, v at the step's slots; with k = v = None the caller already
stored them (the fused rope + store kernel: `accepts_stored_kv`). The `mask_leak` selftest fault is served
by the torch reference backend, which can express it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionBackend, AttentionMetadata


@dataclass
class PagedArrays:
    """FlashInfer's paged-KV description of a step, as CPU int32 tensors."""

    qo_indptr: torch.Tensor  # [N + 1]
    kv_indptr: torch.Tensor  # [N + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    last_page_len: torch.Tensor  # [N], in 1..page_size


def paged_arrays(q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int) -> PagedArrays:
    qo, kvp, idx, last = [0], [0], [], []
    for ql, kl, table in zip(q_lens, kv_lens, page_tables, strict=True):
        n = -(-kl // page_size)
        if kl < 1 or n > len(table):
            raise ValueError(f"kv_len={kl} needs {n} pages but the page table has {len(table)}")
        idx.extend(table[:n])
        qo.append(qo[-1] + ql)
        kvp.append(kvp[-1] + n)
        last.append(kl - (n - 1) * page_size)
    i32 = torch.int32
    return PagedArrays(torch.tensor(qo, dtype=i32), torch.tensor(kvp, dtype=i32), torch.tensor(idx, dtype=i32),
                       torch.tensor(last, dtype=i32))


def row_segments(q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
                 causal: bool, quantum: int) -> tuple[list[tuple[int, int, int, int, int]], list[int]]:
    """A padded step's sequences as segments of `kernels.decode_attention.span_attention`: (first row, rows <=
    quantum, key limit of the first row, limit step, page-list start), and the page lists (each sequence's once).
    Causal rows are aligned to the end of their keys (row j of a span of q_len over kv_len keys sees
    kv_len - q_len + 1 + j, as FlashInfer's prefill); non-causal rows see all kv_len. A span longer than
    `quantum` is cut into several segments; a run of identical one-token sequences (the padding rows: one key on
    the dummy page) shares one segment of up to `quantum` rows."""
    segs: list[tuple[int, int, int, int, int]] = []
    pages: list[int] = []
    row = 0
    prev: tuple | None = None  # (kv_len, pages) of the last one-token sequence, while its segment has room
    for ql, kl, table in zip(q_lens, kv_lens, page_tables, strict=True):
        n = -(-kl // page_size)
        if kl < ql or ql < 1 or n > len(table):
            raise ValueError(f"q_len={ql}, kv_len={kl} with a page table of {len(table)} pages is not a valid span")
        key = (kl, tuple(table[:n]))
        if ql == 1 and prev == key and segs[-1][1] < quantum:
            r0, c, b, st, p0 = segs[-1]
            segs[-1] = (r0, c + 1, b, 0, p0)
            row += 1
            continue
        p0 = len(pages)
        pages.extend(table[:n])
        for j0 in range(0, ql, quantum):
            c = min(quantum, ql - j0)
            segs.append((row + j0, c, kl - ql + 1 + j0 if causal else kl, 1 if causal else 0, p0))
        row += ql
        prev = key if ql == 1 else None
    return segs, pages


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


DECODE_ATTENTION = ("flashinfer", "triton")  # the kernels decode-only steps may run (EngineConfig.decode_attention)
# The head dims FlashInfer's SM90 (FA3) prefill kernels instantiate: its "auto" backend picks them on a Hopper GPU
# whatever the head dim, and for another one (the tiny pair's 32) their JIT build stops on a static_assert, failing
# every request (found on an H100, 2026-12-08, by the acceptance-trace GPU test). Other head dims take FA2.
FA3_HEAD_DIMS = (64, 128, 256)


def prefill_backend(head_dim: int) -> str:
    """The `backend` of FlashInfer's prefill wrapper for this head dim: its own choice where FA3 has kernels for
    it, else FA2 (which takes any head dim FlashInfer builds)."""
    return "auto" if head_dim in FA3_HEAD_DIMS else "fa2"


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    graph_safe = True  # decode forward may be captured whole after prepare_capture

    def __init__(self, device: torch.device | str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, max_pages: int, workspace_bytes: int = 512 << 20, store_op=None,
                 decode_tensor_cores: bool = False, decode_attention: str = "flashinfer",
                 seq_pages: int | None = None) -> None:
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r} is invalid: expected one of "
                             f"{', '.join(DECODE_ATTENTION)}")
        import flashinfer  # noqa: PLC0415 - optional dependency

        self.fi = flashinfer
        self.device = torch.device(device)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.scale = head_dim ** -0.5
        self.max_pages = max_pages
        # the most pages one request's table can hold (the engine's context in pages); requests sharing prefix
        # pages list them once each, so a step's page lists are bounded per request, not by the pool
        self.seq_pages = min(seq_pages or max_pages, max_pages)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                        backend=prefill_backend(head_dim))
        self.decode_tensor_cores = decode_tensor_cores  # decode via FlashInfer's tensor-core (FA2) kernels
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                     use_tensor_cores=decode_tensor_cores)
        self._graph: dict[int, tuple[object, torch.Tensor]] = {}  # batch -> (wrapper, its int32 buffer)
        self._graph_pages: dict[int, torch.Tensor] = {}  # batch -> kv_indptr of its last plan
        self._store = store_op
        self.meta: AttentionMetadata | None = None
        self.slot_mapping: torch.Tensor | None = None
        self._arrays: PagedArrays | None = None
        self._active: object = None
        self._key: tuple | None = None
        self._fallback: AttentionBackend | None = None
        # Triton split-K decode: (seq_lens, kv_indptr, kv_indices) device views of this step, or None
        self.decode_attention = decode_attention
        self._tri: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._tri_bufs: dict[int, torch.Tensor] = {}  # batch bucket -> its int32 metadata buffer
        self._row_bufs: dict[tuple[int, int, int], torch.Tensor] = {}  # (rows, quantum, segment room) -> int32 metadata (plan_rows)
        self._span: tuple[torch.Tensor, torch.Tensor, int, int] | None = None  # (segments, pages, quantum, cap)
        self._tri_scratch: dict[tuple, torch.Tensor] = {}  # (B, Hkv, G, D, splits) -> fp32 partials
        self._tri_ctx = 0  # the longest context a request can have (pages the cache holds x page size)
        self._sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if self.device.type == "cuda" else 0)

    @property
    def ahead_safe(self) -> bool:
        """Decode steps may be planned while the one before runs (engine/ahead.py) with the Triton split-K
        decode (its metadata: one stream-ordered copy into the bucket's buffer); not with FlashInfer's decode
        wrapper, whose plan stages its metadata in one page-locked buffer that the next plan overwrites."""
        return self.decode_attention == "triton"

    @property
    def accepts_stored_kv(self) -> bool:
        """Whether the model may store K/V itself this step (not when the torch fallback serves it)."""
        return self._fallback is None

    # ---- eager ---------------------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.slot_mapping = meta.slot_mapping
        self._key = None
        self._fallback = None
        self._tri = None
        self._span = None
        if meta.leak is not None and any(meta.leak):
            from .torch_ref import TorchAttention  # noqa: PLC0415

            self._fallback = TorchAttention(self.device)
            self._fallback.plan(meta)
            return
        self._arrays = paged_arrays(meta.q_lens, meta.kv_lens, meta.page_tables, meta.page_size)
        self._decode_only = all(q == 1 for q in meta.q_lens)
        if self._decode_only and self.decode_attention == "triton":
            a, n = self._arrays, meta.num_seqs
            buf = torch.cat([torch.tensor(meta.kv_lens, dtype=torch.int32), a.kv_indptr, a.kv_indices]).to(self.device)
            self._tri = (buf[:n], buf[n: 2 * n + 1], buf[2 * n + 1:])
            self._tri_ctx = self.max_pages * meta.page_size

    def _ensure_planned(self, hq: int, hkv: int, d: int, dtype: torch.dtype, scale: float) -> None:
        key = ("eager", hq, hkv, d, dtype, scale)
        if key == self._key:
            return
        a, meta = self._arrays, self.meta
        assert a is not None and meta is not None, "plan() must run before forward()"
        if self._decode_only:
            self._decode.plan(a.kv_indptr, a.kv_indices, a.last_page_len, hq, hkv, d, meta.page_size,
                              q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
            self._active = self._decode
        else:
            self._prefill.plan(a.qo_indptr, a.kv_indptr, a.kv_indices, a.last_page_len, hq, hkv, d, meta.page_size,
                               causal=meta.causal, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
            self._active = self._prefill
        self._key = key

    def page_room(self, n: int) -> int:
        """Page ids a fixed buffer holds for a step of n sequences: each a table of at most `seq_pages` (shared
        prefix pages counted once per request that lists them: the pool's size is no bound), plus n."""
        return n * self.seq_pages + n

    # ---- CUDA graphs (decode) -------------------------------------------------------------------
    def _graph_wrapper(self, b: int):
        if b not in self._graph:
            buf = torch.zeros(2 * b + 1 + self.page_room(b), dtype=torch.int32, device=self.device)
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=buf[: b + 1],
                paged_kv_last_page_len_buffer=buf[b + 1: 2 * b + 1], paged_kv_indices_buffer=buf[2 * b + 1:])
            self._graph[b] = (w, buf)
        return self._graph[b]

    def _plan_graph(self, meta: AttentionMetadata) -> None:
        if not all(q == 1 for q in meta.q_lens) or not meta.causal or meta.leak is not None:
            raise ValueError("FlashInfer graph plans are for plain decode steps (every span one token)")
        b = meta.num_seqs
        a = paged_arrays(meta.q_lens, meta.kv_lens, meta.page_tables, meta.page_size)
        self.meta = meta
        self.slot_mapping = meta.slot_mapping
        self._fallback = None
        self._span = None
        if self.decode_attention == "triton":
            self._plan_graph_triton(meta, a)
            return
        self._tri = None
        w, buf = self._graph_wrapper(b)
        prev = self._graph_pages.get(b)
        if prev is not None and torch.equal(prev, a.kv_indptr):
            # Same pages per request: the host partition is unchanged; refresh page ids and last lengths.
            buf[b + 1: 2 * b + 1 + len(a.kv_indices)].copy_(torch.cat([a.last_page_len, a.kv_indices]))
        else:
            hq, hkv, d = self.heads
            w.plan(a.kv_indptr, a.kv_indices, a.last_page_len, hq, hkv, d, meta.page_size,
                   q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
            self._graph_pages[b] = a.kv_indptr
        self._active = w
        self._key = ("graph", b)

    def _plan_graph_triton(self, meta: AttentionMetadata, a: PagedArrays) -> None:
        """The bucket's fixed buffer [seq_lens (b) | kv_indptr (b + 1) | page ids (page_room(b))], refreshed
        by one copy; the captured kernels read it at every replay."""
        b = meta.num_seqs
        buf = self._tri_bufs.get(b)
        if buf is None:
            buf = self._tri_bufs[b] = torch.zeros(2 * b + 1 + self.page_room(b), dtype=torch.int32,
                                                  device=self.device)
        host = torch.cat([torch.tensor(meta.kv_lens, dtype=torch.int32), a.kv_indptr, a.kv_indices])
        if len(host) > len(buf):
            raise ValueError(f"{len(a.kv_indices)} pages for a batch of {b} exceed the {self.page_room(b)} "
                             "the decode buffer holds")
        # pinned and stream-ordered: the replay before may still be reading the buffer (engine/ahead.py)
        buf[: len(host)].copy_(host.pin_memory() if buf.is_cuda else host, non_blocking=buf.is_cuda)
        self._tri = (buf[:b], buf[b: 2 * b + 1], buf[2 * b + 1:])
        self._tri_ctx = self.max_pages * meta.page_size
        self._active = None
        self._key = ("graph-triton", b)

    def _partials(self, q: torch.Tensor, hkv: int, splits: int) -> torch.Tensor | None:
        """The split partials' fp32 scratch for q's rows (one per (rows, Hkv, G, D, splits), shared by the steps
        and graphs of that shape: they run one at a time); None with one split."""
        from specbench.kernels import decode_attention as da  # noqa: PLC0415

        r, hq, d = q.shape
        key = (r, hkv, hq // hkv, d, splits)
        part = self._tri_scratch.get(key)
        if part is None and splits > 1:  # first met at a warm-up forward, before any capture
            part = self._tri_scratch[key] = da.alloc_partials(r, hkv, hq // hkv, d, splits, q.device)
        return part

    def _triton_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                       page_size: int) -> torch.Tensor:
        from specbench.kernels import decode_attention as da  # noqa: PLC0415

        assert self._tri is not None
        b, hkv = q.shape[0], k_cache.shape[1]
        splits = da.num_splits(b, hkv, self._tri_ctx, self._sms or da.DEFAULT_SMS)
        part = self._partials(q, hkv, splits)
        lens, indptr, indices = self._tri
        return da.decode_attention(q, k_cache, v_cache, lens, indptr, indices, page_size, scale, splits, part)

    # ---- whole graphs of padded steps (span attention over segments of <= quantum rows) --------
    @property
    def rows_ok(self) -> bool:
        """Whether `plan_rows` can serve a step: the split-K decode kernel is the decode attention."""
        return self.decode_attention == "triton"

    def plan_rows(self, meta: AttentionMetadata, quantum: int = 16, cap: int | None = None) -> None:
        """Plan a padded step of any span lengths (verify spans, a drafter's non-causal blocks) for the span kernel
        (`row_segments`: segments of <= quantum rows, K/V read once per segment), in a fixed buffer per (row count,
        quantum): [segments (cap x 5) | pages (page_room(cap))], cap = 2 x ceil(rows / quantum) + 1 (a step padded to
        bucket x span holds at most bucket spans and bucket padding segments; `cap` given: a prefill-mixed layout's
        room, graphs/mixed_cap), refreshed by one stream-ordered copy
        (unused segments: 0 rows): the forward reads no host value, so a graph captured over every layer replays at
        any lengths and pages."""
        from specbench.kernels.decode_attention import SEG_FIELDS  # noqa: PLC0415

        if meta.leak is not None and any(meta.leak):
            raise ValueError("plan_rows cannot express a leaky mask (the torch reference backend serves it)")
        if not self.rows_ok:
            raise ValueError("plan_rows needs decode_attention='triton'")
        segs, pages = row_segments(meta.q_lens, meta.kv_lens, meta.page_tables, meta.page_size, meta.causal, quantum)
        r = meta.num_tokens
        cap = cap or 2 * -(-r // quantum) + 1
        if len(segs) > cap or len(pages) > self.page_room(cap):
            raise ValueError(f"a step of {r} rows in {len(segs)} segments on {len(pages)} pages exceeds the row "
                             f"buffer ({cap} segments of <= {quantum} rows, {self.page_room(cap)} pages)")
        buf = self._row_bufs.get((r, quantum, cap))
        if buf is None:
            buf = self._row_bufs[(r, quantum, cap)] = torch.zeros(cap * SEG_FIELDS + self.page_room(cap),
                                                             dtype=torch.int32, device=self.device)
        flat = [x for sg in segs for x in sg] + [0] * ((cap - len(segs)) * SEG_FIELDS) + pages
        host = torch.tensor(flat, dtype=torch.int32)
        buf[: len(host)].copy_(host.pin_memory() if buf.is_cuda else host, non_blocking=buf.is_cuda)
        self.meta = meta
        self.slot_mapping = meta.slot_mapping
        self._fallback = None
        self._tri = None
        self._span = (buf[: cap * SEG_FIELDS], buf[cap * SEG_FIELDS:], quantum, cap)
        self._tri_ctx = self.max_pages * meta.page_size
        self._active = None
        self._key = ("rows", r, quantum, cap)

    def _span_forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                      page_size: int) -> torch.Tensor:
        from specbench.kernels import decode_attention as da  # noqa: PLC0415

        assert self._span is not None
        segs, pages, quantum, cap = self._span
        hkv = k_cache.shape[1]
        splits = da.num_splits(cap, hkv, self._tri_ctx, self._sms or da.DEFAULT_SMS)
        part = self._partials(q, hkv, splits)
        return da.span_attention(q, k_cache, v_cache, segs, pages, page_size, scale, splits, quantum, part)

    def prepare_capture(self, meta: AttentionMetadata) -> None:
        self._graph_pages.pop(meta.num_seqs, None)
        self._plan_graph(meta)

    def prepare_replay(self, meta: AttentionMetadata) -> None:
        self._plan_graph(meta)

    # ---- per layer -----------------------------------------------------------------------------
    def forward(self, q, k, v, k_cache, v_cache, scale):
        if self._fallback is not None:
            assert k is not None, "the torch fallback stores K/V itself"
            return self._fallback.forward(q, k, v, k_cache, v_cache, scale)
        meta = self.meta
        assert meta is not None, "plan() must run before forward()"
        if k is not None:
            if self._store is not None:
                self._store(k, v, k_cache, v_cache, meta.slot_mapping)
            else:
                k_cache[meta.slot_mapping] = k.to(k_cache.dtype)
                v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
        if self._span is not None:
            return self._span_forward(q, k_cache, v_cache, scale, meta.page_size)
        if self._tri is not None:
            return self._triton_decode(q, k_cache, v_cache, scale, meta.page_size)
        if self._key is None or self._key[0] == "eager":
            self._ensure_planned(q.shape[1], k_cache.shape[1], q.shape[2], q.dtype, scale)
        ps = meta.page_size
        cache = (k_cache.view(-1, ps, *k_cache.shape[1:]), v_cache.view(-1, ps, *v_cache.shape[1:]))
        return self._active.run(q.contiguous(), cache)
