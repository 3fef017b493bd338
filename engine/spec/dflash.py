"""DFlash proposer: the drafter's paged context cache and the batched block draft.

Context invariant: for a draft-ready request, the drafter's cache holds context K/V for exactly the
request's committed positions [0, num_computed). After each target forward the committed rows' tapped
features are projected (fc + hidden_norm) and their K/V written at those positions ("K-only" rows: no
queries): by default inside the target's captured step itself, for every row at its own slot
(`write_context`, installed as the runner's `context_writer`; EngineConfig.graph_context), so `observe` only
moves the context length; a row past what the step commits holds context nobody reads (the drafter attends to
[0, committed) plus its own block) until the step that commits its position rewrites it. With graph_context
off, or on a forward path without the writer (the plain forward), `observe` projects the committed rows
eagerly after the accept. After a verify that accepted m drafts that is m + 1 rows (anchor + accepted
drafts); the bonus token has no features yet and becomes the next anchor. `context(rid)` reports (ctx_len, the end of the
positions the last rows were written at); engine/invariants.py checks both equal num_computed.

The draft for N requests is ONE pass over an [N * B] row buffer: block = [anchor, MASK x (B-1)] at
positions [start, start + B), attention non-causal over the request's context plus its own block through
the same paged backend as the target (the block's K/V land in scratch slots past the committed length,
reserved by the verify transaction and overwritten by the next commit). `batched=False` runs the same code
one request at a time (the off switch, for measurement).

On CUDA with `EngineConfig.draft_graph` (and whenever a test installs `self.graphs`), the draft runs through
`dflash_graphs.DraftGraphs`: the same function, padded to a batch bucket, its dense ops per layer captured
as CUDA graphs around the eager non-causal attention (`eager`: the same padded body uncaptured).
`draft_logits_plain` is the simple path it is checked against. With the Triton ops on, context rows take
the K-only norm + RoPE kernel, which stores their K/V straight into the drafter's cache.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F

from ..kv_cache import PagePool
from ..models.dflash import DFlashDraftModel
from ..models.layers import rms_norm, swiglu
from ..models.qwen3 import Qwen3ForCausalLM
from ..request import Request
from ..rope import RotaryCache
from ..runner import ModelRunner
from ..sampler import draw_rows, sampling_probs_rows, uniforms
from ..scheduler import Span
from .dflash_graphs import DraftGraphs, block_positions
from .pending import PendingDrafts
from .proposer import Proposer

G = TypeVar("G", bound=DraftGraphs)


class DFlashProposer(Proposer):
    name = "dflash"
    defers = True  # propose(..., defer=True) may leave greedy drafts on the device (spec/pending.py)
    block: int  # the drafter's block size B: one draft pass writes B scratch slots past the committed length

    def __init__(self, k: int, draft: DFlashDraftModel, target: Qwen3ForCausalLM, runner: ModelRunner,
                 pool: PagePool, batched: bool = True) -> None:
        super().__init__(k)
        self.draft, self.target, self.runner, self.pool = draft, target, runner, pool
        self.block = draft.block_size
        self.tap_layers = draft.target_layer_ids
        self.batched = batched
        self.rope = RotaryCache(draft.cfg, runner.device, runner.dtype,
                                max_pos=max(draft.cfg.max_position_embeddings, runner.mcfg.max_position_embeddings))
        self.ctx_len: dict[str, int] = {}
        self.ctx_end: dict[str, int] = {}  # one past the last position whose slot got a context row
        self.no_context: set[str] = set()  # prefix hits without a capture: never draft-ready (prefix_share.py)
        self.graphs: DraftGraphs | None = None  # built at the first draft on the graph path
        self.use_graphs = runner.use_graph_runner and runner.cfg.draft_graph

    def ready(self, req: Request) -> bool:
        return self.ctx_len.get(req.rid, -1) == req.num_computed

    # ---- context --------------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, spans: list[Span], committed: list[int], taps: torch.Tensor | None, eligible: list[bool],
                ctx_shift: int = 0) -> None:
        if taps is None:
            return
        # The target's captured step already wrote every row's context at its own slot (`write_context` inside
        # the graph, EngineConfig.graph_context): the committed rows' context is in place, only the lengths move.
        fused = self.runner.context_fused and not ctx_shift
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        off = 0
        for s, c, ok in zip(spans, committed, eligible, strict=True):
            rid = s.req.rid
            if ok and c > 0 and self.ctx_len.get(rid, 0) == s.start:
                if not fused:
                    rows += range(off, off + c)
                    positions += range(s.start, s.start + c)
                    if ctx_shift:  # rows written late need their slots: keep it a wrong answer, not a crash
                        self.pool.ensure(rid, s.start + ctx_shift + c)
                    slots += self.pool.slots(rid, s.start + ctx_shift, s.start + ctx_shift + c)
                self.ctx_len[rid] = s.start + c
                self.ctx_end[rid] = s.start + ctx_shift + c
            off += len(s.tokens)
        if not rows:
            return
        dev = self.runner.device
        self.write_context(taps[torch.tensor(rows, device=dev)], torch.tensor(positions, dtype=torch.long, device=dev),
                           torch.tensor(slots, dtype=torch.long, device=dev))

    def write_context(self, taps: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """The drafter's context rows: tapped features taps [T, L * H] of the tokens at positions pos [T]
        projected (fc + hidden_norm) and each drafter layer's K (normed, rotated) and V stored at slots [T] of its
        cache. Static shapes, no host read: the runner calls it inside the target's captured step for every row
        (padding rows write the dummy slot), `observe` for the committed rows alone."""
        feats = self.draft.project_context(taps)
        ops, cfg = self.runner.model.ops, self.draft.cfg
        for i, (kc, vc) in enumerate(self.runner.draft_kv):
            if ops is not None:  # K-only norm + RoPE kernel, storing K/V itself
                ly = self.draft.layers[i]
                kv = F.linear(feats, ly.qkv_w[cfg.q_size:])
                ops.k_norm_rope(kv, ly.k_norm, cfg.rms_norm_eps, self.rope.cos, self.rope.sin, pos,
                                cfg.num_key_value_heads, cfg.head_dim, (kc, vc, slots))
                continue
            k, v = self.draft.context_kv(i, feats, pos, self.rope)
            kc[slots] = k.to(kc.dtype)
            vc[slots] = v.to(vc.dtype)

    def release(self, req):
        self.ctx_len.pop(req.rid, None)
        self.ctx_end.pop(req.rid, None)
        self.no_context.discard(req.rid)

    def restore(self, req: Request, n: int, captured: bool) -> None:
        """The context rows of a prefix hit's blocks live in their pages' slots of the drafter's cache (the
        same slot space as the target's), written when the blocks were first computed: a captured hit has
        context up to n at once. A capture miss leaves the request without context for good (its rows
        below n are missing and the drafter attends to all of them)."""
        if captured:
            self.ctx_len[req.rid] = self.ctx_end[req.rid] = n
        else:
            self.no_context.add(req.rid)

    def context(self, rid: str) -> tuple[int, int] | None:
        if rid in self.no_context:
            return None  # a capture miss: no context to hold to the committed length
        return self.ctx_len.get(rid, 0), self.ctx_end.get(rid, 0)

    # ---- draft ----------------------------------------------------------------------------------
    def propose(self, spans, ks, tile_starts=False, defer=False):
        """Fill each span's drafts (at most its k). `defer` (the engine's EngineConfig.defer_drafts): when every span
        is greedy and the pass is batched, the drafts stay on the device; returns their PendingDrafts (the spans
        hold placeholders until its `resolve`; spec/pending.py). Else None, the drafts on the host."""
        if not spans:
            return None
        if defer and self.batched and not tile_starts and all(s.req.params.greedy for s in spans):
            dev = self.draft_logits(spans).argmax(-1)  # [N, B - 1] on the device; no host read
            for s, k in zip(spans, ks, strict=True):
                s.drafts = [0] * k
            return PendingDrafts(dev, spans, ks)
        groups = [spans] if self.batched else [[s] for s in spans]
        kmap = {id(s): k for s, k in zip(spans, ks, strict=True)}
        for g in groups:
            logits = self.draft_logits(g, tile_starts)
            greedy = [i for i, s in enumerate(g) if s.req.params.greedy]
            if greedy:
                drafts = logits[torch.tensor(greedy, device=logits.device)].argmax(-1).tolist() \
                    if len(greedy) < len(g) else logits.argmax(-1).tolist()
                for i, d in zip(greedy, drafts, strict=True):
                    g[i].drafts = d[:kmap[id(g[i])]]
            sampled = [i for i, s in enumerate(g) if not s.req.params.greedy]
            if sampled:
                # Sampled requests: each slot drawn from its own transformed distribution q (the request's
                # sampling transform), all requests at once with their own generators, one host read.
                n, slots, v = len(sampled), logits.shape[1], logits.shape[2]
                sel = logits[torch.tensor(sampled, device=logits.device)] if n < len(g) else logits
                q = sampling_probs_rows(sel.reshape(n * slots, v),
                                        [g[i].req.params for i in sampled for _ in range(slots)]).view(n, slots, v)
                u = uniforms([slots] * n, [self.generators.get(g[i].req.rid) for i in sampled], logits.device)
                drawn = draw_rows(q.view(n * slots, v), u).view(n, slots).tolist()
                for j, i in enumerate(sampled):
                    k = kmap[id(g[i])]
                    g[i].drafts = drawn[j][:k]
                    g[i].draft_probs = q[j, :k]
        return None

    def draft_graphs(self) -> DraftGraphs | None:
        """The padded draft runner of the graph path (CUDA with `draft_graph`, or a test that installed
        `self.graphs`), built at first use or for a swapped backend / op set; None off the graph path."""
        if not (self.use_graphs or self.graphs is not None):
            return None
        self.graphs = self._current(self.graphs, DraftGraphs)
        return self.graphs

    def _current(self, g: G | None, cls: type[G]) -> G:
        """g, or a new `cls` runner when there is none or g was built for another backend or op set."""
        r = self.runner
        if g is None or g.stack.backend is not r.backend or g.stack.ops is not r.model.ops:
            g = cls(self, capture=not r.cfg.eager)
        return g

    def capture_graphs(self) -> list[int]:
        """Capture now every row count (batch bucket x block) the draft graphs can take, so no draft under load
        waits for a lazy capture (LLMEngine.capture_graphs); returns the row counts captured now."""
        g = self.draft_graphs()
        return g.capture_all() if g is not None else []

    def draft_logits(self, spans: list[Span], tile_starts: bool = False) -> torch.Tensor:
        """Draft logits [N, B - 1, V] for block slots 1..B-1 of each span's request."""
        g = self.draft_graphs()
        if g is not None and g.can_run(spans):
            return g.run(spans, tile_starts)
        return self.draft_logits_plain(spans, tile_starts)

    @torch.inference_mode()
    def draft_logits_plain(self, spans: list[Span], tile_starts: bool = False) -> torch.Tensor:
        """The simple path: one unpadded eager pass with the torch reference ops."""
        cfg, b, n = self.draft.cfg, self.block, len(spans)
        dev = self.runner.device
        for s in spans:
            self.pool.ensure(s.req.rid, s.start + b)
        ids = torch.full((n, b), self.draft.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor([s.tokens[0] for s in spans], dtype=torch.long, device=dev)
        x = F.embedding(ids.reshape(-1), self.target.embed) * self.draft.input_embedding_scale
        meta, pos = self.runner.metadata(spans, causal=False, q_lens=[b] * n)
        if tile_starts:
            pos = torch.tensor(block_positions([s.start for s in spans], b, tile_starts), dtype=torch.long, device=dev)
        backend = self.runner.backend
        backend.plan(meta)
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        t = n * b
        for i, ly in enumerate(self.draft.layers):
            h = rms_norm(x, ly.in_norm, cfg.rms_norm_eps)
            q, k, v = F.linear(h, ly.qkv_w).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = self.rope.apply(rms_norm(q.reshape(t, hq, d), ly.q_norm, cfg.rms_norm_eps), pos)
            k = self.rope.apply(rms_norm(k.reshape(t, hkv, d), ly.k_norm, cfg.rms_norm_eps), pos)
            kc, vc = self.runner.draft_kv[i]
            o = backend.forward(q, k, v.reshape(t, hkv, d), kc, vc, self.draft.scale)
            x = x + F.linear(o.reshape(t, hq * d), ly.o_w)
            x = x + F.linear(swiglu(F.linear(rms_norm(x, ly.post_norm, cfg.rms_norm_eps), ly.gate_up_w)), ly.down_w)
        h = rms_norm(x, self.draft.norm, cfg.rms_norm_eps).reshape(n, b, -1)[:, 1:].contiguous()  # one GEMM
        return self.target.logits(h)

