"""The device side: KV tensors, attention metadata, and the target forward for a step plan.

`ModelRunner.forward(spans, logit_rows, tap)` runs ONE target forward over the flat batch of spans and
returns fp32 logits for the requested rows (flat indices) plus the tapped decoder-layer outputs when a
proposer needs them. The KV cache is one [num_slots, Hkv, D] tensor pair per layer, addressed through
the page pool's slot mapping; the drafter (when present) has its own per-layer cache over the SAME slot
space, so its context for a request covers exactly the request's committed positions.

Every cache has one extra page past the pool (`dummy_page`): rows that pad a batch up to a CUDA-graph
bucket write their K/V there and attend to it alone; no request's page table ever holds it.
On CUDA, a step whose spans are all single decode tokens (at most the largest bucket) runs through
`graphs.DecodeGraphs`, padded to its bucket, captured or eager (`EngineConfig.eager`); any other step
(verify spans, and prefill chunks with or without them; `EngineConfig.verify_graph`) runs through
`graphs.VerifyGraphs`, padded to (batch bucket x span) rows, its dense segments captured or eager;
what fits neither (more rows than the largest bucket holds, or a step called with `verify_graph=False`)
runs the plain forward. With a context writer installed (`context_writer`: the DFlash drafter's
`write_context`, EngineConfig.graph_context) both graph runners also write the drafter's context rows of
every row inside the step, and `context_fused` tells the commit so (spec/dflash.py). On CPU the plain forward and the torch reference ops are all there is, unless
EngineConfig.graph_runner is True (engine string graph_runner=1; the gates set it on a CPU candidate) or a test
sets `use_graph_runner = True`: the graph runners then run with capture=False, the same padded bodies, eagerly.
graph_runner=False keeps a CUDA engine on the plain forward.
`forward`'s `slot_shift` / `pos_shift` / `mask_leak` perturb the plain forward (K/V written late, the
drafted rows' positions shifted, one future key visible); only the self-test (engine/faults.py) sets
them, with `verify_graph=False`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .attention.base import AttentionBackend, AttentionMetadata
from .attention.torch_ref import TorchAttention
from .config import EngineConfig, ModelConfig
from .graphs import NO_SPEC_SPAN, DecodeGraphs, VerifyGraphs
from .kv_cache import PagePool
from .models.qwen3 import Qwen3ForCausalLM
from .rope import RotaryCache
from .scheduler import Span

if TYPE_CHECKING:
    from .spec.pending import PendingDrafts

log = logging.getLogger("specbench.engine")

FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer's attention kernels take half precision only


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """"auto" -> flashinfer on CUDA when it imports and the dtype is bf16/fp16, else torch; flashinfer off
    CUDA, absent or asked for fp32 -> torch (with a warning)."""
    if name == "torch":
        return "torch"
    from .attention.flashinfer import flashinfer_available  # noqa: PLC0415

    half = dtype is None or dtype in FLASHINFER_DTYPES
    if device.type == "cuda" and half and flashinfer_available():
        return "flashinfer"
    if name == "flashinfer":
        why = f"dtype {dtype} (FlashInfer takes bfloat16 or float16)" if not half else "CUDA and flashinfer-python"
        log.warning("attention_backend='flashinfer' needs %s; using the torch backend", why)
    return "torch"


def make_backend(name: str, device: torch.device, mcfg: ModelConfig | None = None, dtype: torch.dtype | None = None,
                 max_pages: int = 0, ops=None, decode_tensor_cores: bool = True, decode_attention: str = "triton",
                 triton: bool = True, seq_pages: int | None = None) -> AttentionBackend:
    """Defaults as EngineConfig's; seq_pages: the most pages one request's table holds (None: max_pages).
    decode_attention="triton": the FlashInfer backend runs decode-only steps through the Triton split-K kernel
    (kernels/decode_attention.py) when Triton is enabled (`triton`, SPECBENCH_TRITON), else FlashInfer's decode
    wrapper (logged)."""
    if resolve_backend(name, device, dtype) == "flashinfer":
        from .attention.flashinfer import FlashInferAttention  # noqa: PLC0415 - optional dependency

        assert mcfg is not None and dtype is not None
        if decode_attention == "triton":
            from specbench.kernels import triton_enabled  # noqa: PLC0415

            if not triton_enabled(device, triton):
                log.info("decode_attention='triton' needs Triton enabled (triton switch, SPECBENCH_TRITON); "
                         "decode steps use FlashInfer's decode kernel")
                decode_attention = "flashinfer"
        return FlashInferAttention(device, mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.head_dim, dtype,
                                   max_pages, store_op=ops.kv_store if ops is not None else None,
                                   decode_tensor_cores=decode_tensor_cores, decode_attention=decode_attention,
                                   seq_pages=seq_pages)
    return TorchAttention(device)


def select_ops(cfg: EngineConfig, device: torch.device):
    """The Triton op bundle on CUDA when enabled, else None (the model's torch reference path)."""
    from specbench.kernels import triton_enabled  # noqa: PLC0415

    if device.type != "cuda" or not triton_enabled(device, cfg.triton):
        return None
    from specbench.kernels.ops import TritonOps  # noqa: PLC0415

    return TritonOps(gemv=cfg.gemv, skinny=cfg.skinny)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, mcfg: ModelConfig, model: Qwen3ForCausalLM, pool: PagePool,
                 device: torch.device, dtype: torch.dtype, draft_cfg: ModelConfig | None = None,
                 spec_span: int = 0, span_variants: tuple[int, ...] = (), seq_pages: int | None = None) -> None:
        """spec_span: the longest verify span (K + 1) when speculation is on, else 0; span_variants: every
        verify span length a step may take (SpecPlan.span_variants; default: spec_span alone); seq_pages: the
        most pages one request can hold (the engine's context; sizes the attention backend's fixed page
        buffers, None: the whole pool)."""
        self.cfg, self.mcfg, self.model, self.pool = cfg, mcfg, model, pool
        self.spec_span = spec_span
        self.span_variants = tuple(span_variants)
        self.device, self.dtype = device, dtype
        slots = (pool.num_pages + 1) * pool.page_size  # + the dummy page
        self.dummy_page = pool.num_pages
        self.dummy_slot = pool.num_pages * pool.page_size
        shape = (slots, mcfg.num_key_value_heads, mcfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(mcfg.num_hidden_layers)]
        self.rope = RotaryCache(mcfg, device, dtype)
        model.ops = select_ops(cfg, device)
        self.backend = make_backend(cfg.attention_backend, device, mcfg, dtype, pool.num_pages + 1, model.ops,
                                    cfg.decode_tensor_cores, cfg.decode_attention, cfg.triton, seq_pages)
        self.graphs: DecodeGraphs | None = None  # built at the first eligible decode step (CUDA only)
        self.verify_graphs: VerifyGraphs | None = None  # built at the first verify step (CUDA, verify_graph)
        self.use_graph_runner = device.type == "cuda" if cfg.graph_runner is None else cfg.graph_runner
        # the path and row count of the last forward: ("decode-graph", bucket rows asked), ("padded", rows run),
        # ("plain", rows); read by benchmarks (benchmarks/load.py) to attribute step time
        self.last_path: tuple[str, int] = ("", 0)
        # the drafter's `write_context(taps, positions, slots)` when the captured steps write its context rows
        # (EngineConfig.graph_context; installed by the engine), and whether the last forward did so for every row
        self.context_writer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self.context_fused = False
        self.draft_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if draft_cfg is not None:
            dshape = (slots, draft_cfg.num_key_value_heads, draft_cfg.head_dim)
            self.draft_kv = [(torch.zeros(dshape, dtype=dtype, device=device),
                              torch.zeros(dshape, dtype=dtype, device=device))
                             for _ in range(draft_cfg.num_hidden_layers)]

    def metadata(self, spans: list[Span], causal: bool = True, q_lens: list[int] | None = None,
                 slot_shift: list[int] | None = None, mask_leak: list[bool] | None = None,
                 pos_shift: list[int] | None = None) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata and positions for the spans. slot_shift[i]: span i's K/V land that many slots
        late (its slots are allocated here); mask_leak[i]: span i's queries see one key past the causal
        limit (causal metadata only); pos_shift[i]: span i's rows after the first take positions that
        much late (their slots stay right)."""
        q_lens = q_lens or [len(s.tokens) for s in spans]
        slots: list[int] = []
        positions: list[int] = []
        for i, (s, n) in enumerate(zip(spans, q_lens, strict=True)):
            shift = slot_shift[i] if slot_shift else 0
            if shift:
                self.pool.ensure(s.req.rid, s.start + shift + n)
            slots += self.pool.slots(s.req.rid, s.start + shift, s.start + shift + n)
            dp = pos_shift[i] if pos_shift else 0
            positions += [s.start + j + (dp if j else 0) for j in range(n)] if dp else range(s.start, s.start + n)
        leak = mask_leak if causal else None
        shifts = slot_shift or [0] * len(spans)
        meta = AttentionMetadata(
            q_lens=q_lens,
            kv_lens=[s.start + n + d for s, n, d in zip(spans, q_lens, shifts, strict=True)],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            page_tables=[self.pool.table(s.req.rid) for s in spans],
            page_size=self.pool.page_size,
            causal=causal,
            leak=leak,
        )
        return meta, torch.tensor(positions, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def forward(self, spans: list[Span], logit_rows: list[int], tap: tuple[int, ...] = (), *,
                slot_shift: list[int] | None = None, pos_shift: list[int] | None = None,
                mask_leak: list[bool] | None = None, verify_graph: bool = True, pending: PendingDrafts | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logits of `logit_rows` (flat row indices) and the tapped layers' outputs, concatenated.
        A decode-only step may take the decode graphs, any other step the verify graphs (unless
        `verify_graph` is False). slot_shift / pos_shift / mask_leak (see `metadata`) act in the plain forward only:
        the self-test sets them on verify spans alone, with verify_graph=False. `context_fused` says afterwards
        whether the step wrote the drafter's context rows of every span row (the graph paths with a context writer).
        `pending`: the step's deferred drafts (spec/pending.py): the verify graphs fill them in on the device; the
        plain forward, which builds its inputs on the host, resolves them first."""
        self.context_fused = False
        if self.use_graph_runner and all(len(s.tokens) == 1 and s.kind == "decode" for s in spans):
            graphs = self.decode_graphs(tuple(tap))
            if graphs.can_run(spans):
                self.last_path = ("decode-graph", len(spans))
                out = graphs.run(spans, logit_rows)
                self.context_fused = graphs.context is not None
                return out
        elif self.use_graph_runner and self.cfg.verify_graph and verify_graph:
            vg = self.verify_graphs_for(tuple(tap))
            key = vg.key(spans)
            if key is not None:
                self.last_path = ("padded", key[0] * key[1])
                out = vg.run(spans, logit_rows, key, pending=pending)
                self.context_fused = vg.stack.context is not None
                return out
        if pending is not None:
            pending.resolve()  # the plain forward builds its inputs on the host
        self.last_path = ("plain", sum(len(s.tokens) for s in spans))
        meta, positions = self.metadata(spans, slot_shift=slot_shift, mask_leak=mask_leak, pos_shift=pos_shift)
        ids = torch.tensor([t for s in spans for t in s.tokens], dtype=torch.long, device=self.device)
        self.backend.plan(meta)
        hidden, taps = self.model(ids, positions, self.backend, self.kv, self.rope, tap)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden[rows]).float()
        tapped = torch.cat(taps, dim=-1) if taps else None
        return logits, tapped

    def context_writer_for(self, tap: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
        """The context writer the graphs of this tap set carry (none without taps)."""
        return self.context_writer if tap else None

    def decode_graphs(self, tap: tuple[int, ...] = ()) -> DecodeGraphs:
        """The decode graph runner for this tap set (captured now unless cfg.eager)."""
        if self.graphs is None or self.graphs.tap != tap or self.graphs.context is not self.context_writer_for(tap):
            self.graphs = DecodeGraphs(self, tap, capture=not self.cfg.eager)
        return self.graphs

    def verify_graphs_for(self, tap: tuple[int, ...] = ()) -> VerifyGraphs:
        """The verify graph runner for this tap set, backend and op set (rebuilt when a benchmark swaps
        either); its row counts are captured lazily unless cfg.eager."""
        vg = self.verify_graphs
        if vg is None or vg.tap != tap or vg.stack.backend is not self.backend or vg.stack.ops is not self.model.ops \
                or vg.stack.context is not self.context_writer_for(tap):
            span = self.spec_span if self.spec_span > 1 else NO_SPEC_SPAN
            spans = tuple(s for s in self.span_variants if s > 1) or (span,)  # span 1 steps: the decode graphs
            vg = self.verify_graphs = VerifyGraphs(self, tap, spans, capture=not self.cfg.eager)
        return vg
