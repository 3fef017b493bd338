"""The device side: KV tensors, attention metadata, and the target forward for a step plan.

`ModelRunner.forward(spans, logit_rows, tap)` runs ONE target forward over the flat batch of spans and
returns fp32 logits for the requested rows (flat indices) plus the tapped decoder-layer outputs when a
proposer needs them. The KV cache is one [num_slots, Hkv, D] tensor pair per layer, addressed through
the page pool's slot mapping; the drafter (when present) has its own per-layer cache over the SAME slot
space, so its context for a request covers exactly the request's committed positions.
"""

from __future__ import annotations

import torch

from .attention.base import AttentionMetadata
from .attention.torch_ref import TorchAttention
from .config import EngineConfig, ModelConfig
from .kv_cache import PagePool
from .models.qwen3 import Qwen3ForCausalLM
from .rope import RotaryCache
from .scheduler import Span


def make_backend(name: str, device: torch.device):
    if name == "flashinfer":
        from .attention.flashinfer import FlashInferAttention  # noqa: PLC0415 - optional dependency

        return FlashInferAttention(device)
    return TorchAttention(device)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, mcfg: ModelConfig, model: Qwen3ForCausalLM, pool: PagePool,
                 device: torch.device, dtype: torch.dtype, draft_cfg: ModelConfig | None = None,
                 faults: frozenset[str] = frozenset()) -> None:
        self.cfg, self.mcfg, self.model, self.pool = cfg, mcfg, model, pool
        self.device, self.dtype = device, dtype
        self.faults = faults
        slots = pool.num_pages * pool.page_size
        shape = (slots, mcfg.num_key_value_heads, mcfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(mcfg.num_hidden_layers)]
        self.rope = RotaryCache(mcfg, device, dtype)
        self.backend = make_backend(cfg.attention_backend, device)
        self.draft_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if draft_cfg is not None:
            dshape = (slots, draft_cfg.num_key_value_heads, draft_cfg.head_dim)
            self.draft_kv = [(torch.zeros(dshape, dtype=dtype, device=device),
                              torch.zeros(dshape, dtype=dtype, device=device))
                             for _ in range(draft_cfg.num_hidden_layers)]
        self._static_logits: dict[int, tuple[int, torch.Tensor]] = {}  # stale_shape fault only

    def metadata(self, spans: list[Span], causal: bool = True, q_lens: list[int] | None = None,
                 slot_shift: list[int] | None = None) -> tuple[AttentionMetadata, torch.Tensor]:
        q_lens = q_lens or [len(s.tokens) for s in spans]
        slots: list[int] = []
        positions: list[int] = []
        for i, (s, n) in enumerate(zip(spans, q_lens, strict=True)):
            shift = slot_shift[i] if slot_shift else 0
            slots += self.pool.slots(s.req.rid, s.start + shift, s.start + shift + n)
            positions += range(s.start, s.start + n)
        leak = [s.kind == "verify" for s in spans] if "mask_leak" in self.faults and causal else None
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
    def forward(self, spans: list[Span], logit_rows: list[int], tap: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shift = None
        if "kv_offset" in self.faults:
            shift = [1 if s.kind == "verify" else 0 for s in spans]
        meta, positions = self.metadata(spans, slot_shift=shift)
        ids = torch.tensor([t for s in spans for t in s.tokens], dtype=torch.long, device=self.device)
        self.backend.plan(meta)
        hidden, taps = self.model(ids, positions, self.backend, self.kv, self.rope, tap)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden[rows]).float()
        if "stale_shape" in self.faults and any(s.kind == "verify" for s in spans):
            logits = self._replay_stale(len(spans), logits)
        tapped = torch.cat(taps, dim=-1) if taps else None
        return logits, tapped

    def _replay_stale(self, bucket: int, logits: torch.Tensor) -> torch.Tensor:
        """Fault: the first row count seen for a batch bucket is 'captured'; longer replays read stale rows."""
        captured = self._static_logits.get(bucket)
        if captured is None:
            buf = torch.zeros(4096, logits.shape[1], dtype=logits.dtype, device=logits.device)
            buf[: logits.shape[0]] = logits
            self._static_logits[bucket] = (logits.shape[0], buf)
            return logits
        rows, buf = captured
        out = logits.clone()
        if logits.shape[0] > rows:
            out[rows:] = buf[rows: logits.shape[0]]
        buf[: min(rows, logits.shape[0])] = logits[:rows]
        return out
