"""DFlash2 proposer: DFlashProposer's paged context cache and batched block draft, plus the convolutions
around each sublayer and the candidate selector choosing the drafts (engine/spec/selector.py).

- `dflash_proposer(...)`: the proposer for a loaded drafter, by its class (DFlash2 -> `DFlash2Proposer`,
  DFlash1 -> `DFlashProposer` exactly as before).
- The context rows (K-only path, `observe`) are DFlash1's: the convolutions act on the block only.
- The block pass (`draft_hidden`) is DFlashProposer's plain path with each layer's attention and MLP
  wrapped by the grouped dynamic convolution along the block ([N, B] rows, zero taps before slot 0, so one
  request's block never reads another's). Causal inside the block iff the config declares it
  (`DFlash2DraftModel.causal`, read from `is_causal` first). On the graph path (CUDA with `draft_graph`)
  the same function runs padded through `dflash2_graphs.DraftGraphs2`, convolutions and the greedy walk
  inside the captured segments; `draft_hidden` is what it is checked against.
- Greedy requests: `sel.greedy_path` from the anchor. Sampled requests: `sel.sampled_path` with
  the request's temperature and its own generator; `span.draft_probs` is the walk's q (zero off the
  candidates), which AcceptStep's rejection sampling reads, so T > 0 stays lossless. Both walks run as one
  Triton launch per draft batch when `walk_kernel` (`sel.kernel_on`: CUDA, Triton on,
  EngineConfig.selector_kernel; kernels/selector_walk.py), in the graph's tail and here; else torch ops per slot.
- `variants`: the draft knobs (engine/faults.py `DraftKnobs`) it honours: `selector=False` drafts the
  logits' argmax (greedy) / samples the request's own transformed distribution (T > 0), as a DFlash1 code
  path would; `causal` forces the layers' causality. check-draft runs them as the variants an engine's
  measured acceptance is compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_cache import PagePool
from ..models.dflash import DFlashDraftModel
from ..models.dflash2 import DFlash2DraftModel
from ..models.layers import rms_norm, swiglu
from ..models.qwen3 import Qwen3ForCausalLM
from ..runner import ModelRunner
from ..sampler import draw_rows, sampling_probs_rows, uniforms
from ..scheduler import Span
from . import selector as sel
from .dflash import DFlashProposer
from .dflash2_graphs import DraftGraphs2
from .dflash_graphs import block_positions


def dflash_proposer(k: int, draft: DFlashDraftModel, target: Qwen3ForCausalLM, runner: ModelRunner,
                    pool: PagePool, batched: bool = True) -> DFlashProposer:
    """The proposer for this drafter's architecture."""
    cls = DFlash2Proposer if isinstance(draft, DFlash2DraftModel) else DFlashProposer
    return cls(k, draft, target, runner, pool, batched=batched)


class DFlash2Proposer(DFlashProposer):
    name = "dflash"  # the method; the architecture is the drafter's (describe() names the draft dir)
    variants = ("selector", "causal")
    defers = False  # its own propose (the selector walk): drafts always come back to the host
    draft: DFlash2DraftModel

    def __init__(self, k: int, draft: DFlashDraftModel, target: Qwen3ForCausalLM, runner: ModelRunner,
                 pool: PagePool, batched: bool = True) -> None:
        super().__init__(k, draft, target, runner, pool, batched=batched)
        self.graphs2: DraftGraphs2 | None = None  # built at the first draft on the graph path
        # the walk in one launch (kernels/selector_walk.py); read by DraftStack2's tail when it is built
        self.walk_kernel = sel.kernel_on(runner.device, runner.cfg.selector_kernel, runner.cfg.triton)

    def propose(self, spans, ks, tile_starts=False, selector: bool = True, causal: bool | None = None):
        if not spans:
            return
        groups = [spans] if self.batched else [[s] for s in spans]
        kmap = {id(s): k for s, k in zip(spans, ks, strict=True)}
        for g in groups:
            self._propose_group(g, kmap, tile_starts, selector, causal)

    @torch.inference_mode()
    def _propose_group(self, g: list[Span], kmap: dict[int, int], tile_starts: bool, selector_on: bool,
                       causal: bool | None) -> None:
        logits, hidden, path = self._draft(g, tile_starts, causal)  # [N, B-1, V] fp32, [N, B-1, H], [N, B-1]
        dev, slots, v = logits.device, logits.shape[1], logits.shape[2]
        anchor = torch.tensor([s.tokens[0] for s in g], dtype=torch.long, device=dev)
        proj_w, pred, succ = self.draft.selector_weights()
        greedy = [i for i, s in enumerate(g) if s.req.params.greedy]
        sampled = [i for i, s in enumerate(g) if not s.req.params.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=dev)
            if selector_on and path is not None:  # the graph's tail walked it already
                drafts = path[rows].tolist()
            elif selector_on:
                unary, ids = sel.candidates(logits[rows], self.draft.selector_top_k)
                drafts = sel.greedy_path(unary, ids, sel.project(hidden[rows], proj_w), anchor[rows],
                                         pred, succ, kernel=self.walk_kernel).tolist()
            else:
                drafts = logits[rows].argmax(-1).tolist()
            for i, d in zip(greedy, drafts, strict=True):
                g[i].drafts = d[:kmap[id(g[i])]]
        if sampled:
            rows = torch.tensor(sampled, device=dev)
            m = len(sampled)
            u = uniforms([slots] * m, [self.generators.get(g[i].req.rid) for i in sampled], dev).view(m, slots)
            if selector_on:
                unary, ids = sel.candidates(logits[rows], self.draft.selector_top_k)
                temps = torch.tensor([g[i].req.params.temperature for i in sampled], device=dev,
                                     dtype=torch.float32)
                drawn_t, q = sel.sampled_path(unary, ids, sel.project(hidden[rows], proj_w), anchor[rows],
                                              pred, succ, temps, u, v, kernel=self.walk_kernel)
                drawn = drawn_t.tolist()
            else:  # DFlash1's draw: each slot from the request's transformed distribution
                q = sampling_probs_rows(logits[rows].reshape(m * slots, v),
                                        [g[i].req.params for i in sampled for _ in range(slots)]).view(m, slots, v)
                drawn = draw_rows(q.view(m * slots, v), u.reshape(-1)).view(m, slots).tolist()
            for j, i in enumerate(sampled):
                k = kmap[id(g[i])]
                g[i].drafts = drawn[j][:k]
                g[i].draft_probs = q[j, :k]

    def _draft(self, spans: list[Span], tile_starts: bool, causal: bool | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logits, hidden, greedy path or None): the padded graph body on the graph path (CUDA with
        `draft_graph`, or a test that installed `graphs2`), else the plain pass."""
        g = self.draft_graphs()
        if g is not None and g.can_run(spans):
            return g.run2(spans, tile_starts, causal)
        hidden = self.draft_hidden(spans, tile_starts, causal)
        return self.draft.draft_logits(hidden, self.target.lm_head_w), hidden, None

    def draft_graphs(self) -> DraftGraphs2 | None:
        """DFlash2's padded draft runner (its convolutions and the walk in the tail), as DFlash1's."""
        if not (self.use_graphs or self.graphs2 is not None):
            return None
        self.graphs2 = self._current(self.graphs2, DraftGraphs2)
        return self.graphs2

    def draft_logits(self, spans: list[Span], tile_starts: bool = False) -> torch.Tensor:
        """Draft logits [N, B - 1, V] (the selector's unary scores; what check-draft's tensor probe reads)."""
        return self.draft.draft_logits(self.draft_hidden(spans, tile_starts), self.target.lm_head_w)

    @torch.inference_mode()
    def draft_hidden(self, spans: list[Span], tile_starts: bool = False, causal: bool | None = None) -> torch.Tensor:
        """Final-normed hidden [N, B - 1, H] of block slots 1..B-1: one eager pass over [N * B] rows."""
        d, b, n = self.draft, self.block, len(spans)
        cfg, dev = d.cfg, self.runner.device
        for s in spans:
            self.pool.ensure(s.req.rid, s.start + b)
        ids = torch.full((n, b), d.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor([s.tokens[0] for s in spans], dtype=torch.long, device=dev)
        x = F.embedding(ids, self.target.embed) * d.input_embedding_scale  # [N, B, H]
        is_causal = d.causal if causal is None else causal
        meta, pos = self.runner.metadata(spans, causal=is_causal, q_lens=[b] * n)
        if tile_starts:
            pos = torch.tensor(block_positions([s.start for s in spans], b, tile_starts), dtype=torch.long, device=dev)
        backend = self.runner.backend
        backend.plan(meta)
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        t = n * b
        for i, ly in enumerate(d.layers):
            ac, mc = d.attn_convs[i], d.mlp_convs[i]
            h = rms_norm(x, ly.in_norm, cfg.rms_norm_eps)
            dl = ac.delta(h)
            h = ac.conv(h, dl, 0).reshape(t, -1)
            q, k, v = F.linear(h, ly.qkv_w).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = self.rope.apply(rms_norm(q.reshape(t, hq, hd), ly.q_norm, cfg.rms_norm_eps), pos)
            k = self.rope.apply(rms_norm(k.reshape(t, hkv, hd), ly.k_norm, cfg.rms_norm_eps), pos)
            kc, vc = self.runner.draft_kv[i]
            o = backend.forward(q, k, v.reshape(t, hkv, hd), kc, vc, d.scale)
            x = x + ac.conv(F.linear(o.reshape(t, hq * hd), ly.o_w).view(n, b, -1), dl, 1)
            h = rms_norm(x, ly.post_norm, cfg.rms_norm_eps)
            dm = mc.delta(h)
            y = F.linear(swiglu(F.linear(mc.conv(h, dm, 0), ly.gate_up_w)), ly.down_w)
            x = x + mc.conv(y, dm, 1)
        return rms_norm(x, d.norm, cfg.rms_norm_eps)[:, 1:].contiguous()  # one lm_head GEMM, not one per block
