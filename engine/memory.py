"""KV-pool sizing with the drafter's reservation: a memory profile on the GPU, a simple budget on the CPU.

Contract: `plan_memory` runs after both models' weights are loaded and before any KV tensor exists. It
returns a `MemoryPlan` whose `num_pages` is the pool size and whose `reserved` figures say where the rest
of the memory is promised:
- per token, in every page: the target's K/V and the drafter's context K/V (it lives in the same slot
  space), so `bytes_per_token` includes the drafter and the pool shrinks with it;
- fixed, before the pool is sized: the drafter's weights (computed from its config; on the GPU they are
  already resident, so the profile's used memory holds them and the plan logs computed vs measured),
  the activations of the largest plain step, and the speculative step's extra scratch: the draft's
  [max_num_seqs x B] rows and the verify's [max_num_seqs x (K + 1)] rows (fp32 + model-dtype logits
  and dense temporaries), plus, on the GPU, the static buffers of the padded draft and verify runners
  and (unless `eager`) their graph pools (`spec_reserve`).
On the GPU: pages = (total x gpu_memory_utilization - used after the weights - fixed reserves) /
bytes per page, capped at what max_num_seqs full-length requests need. On the CPU: that cap, at most
1 GiB. An explicit `EngineConfig.num_pages` wins and is reported as such.
`measured` is filled by the engine after the runner exists (weights and KV bytes from the tensors
themselves; CUDA allocator figures on the GPU) and refreshed by `LLMEngine.memory_report()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .config import ConfigError, EngineConfig, ModelConfig
from .graphs import NO_SPEC_SPAN

log = logging.getLogger("specbench.engine")
GiB = 2**30


def elem_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def bytes_per_token(mcfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype) -> int:
    elem = elem_size(dtype)
    per = 2 * mcfg.num_hidden_layers * mcfg.kv_size * elem
    if draft is not None:
        per += 2 * draft.num_hidden_layers * draft.kv_size * elem
    return per


def draft_weight_bytes(draft: ModelConfig, target: ModelConfig, dtype: torch.dtype) -> int:
    """The drafter's own weights (it shares the target's embedding and lm_head)."""
    h, q, kv, inter, d = draft.hidden_size, draft.q_size, draft.kv_size, draft.intermediate_size, draft.head_dim
    taps = len(draft.target_layer_ids or ())
    per_layer = (q + 2 * kv) * h + h * q + 2 * inter * h + h * inter + 2 * d + 2 * h
    extra = dflash2_extra_params(draft)  # DFlash2's convolutions and the selector's two codebooks
    return (h * taps * target.hidden_size + 2 * h + draft.num_hidden_layers * per_layer + extra) * elem_size(dtype)


def dflash2_extra_params(draft: ModelConfig) -> int:
    """Parameters a DFlash2 drafter holds beyond DFlash1's (0 for DFlash1): per layer two convolutions of
    2*K*H static + 2*K*(H/group)*H dynamic taps; the selector's [R, H] projection and two [V, R] codebooks
    (about 207 MB in bf16 at Z Lab's vocabulary, R = 256)."""
    if "DFlash2DraftModel" not in draft.architectures:
        return 0
    from .models.dflash2 import draft_field  # noqa: PLC0415

    h, v, raw = draft.hidden_size, draft.vocab_size, draft.raw
    k = int(draft_field(raw, "conv_kernel_size", 0))  # type: ignore[call-overload]
    g = int(draft_field(raw, "conv_group_size", 1))  # type: ignore[call-overload]
    r = int(draft_field(raw, "selector_rank", 0))  # type: ignore[call-overload]
    conv = 2 * (2 * k * h + 2 * k * (h // max(g, 1)) * h)
    return draft.num_hidden_layers * conv + r * h + 2 * v * r


def step_row_bytes(mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """Transient bytes per row of a step whose every row needs logits: fp32 + model-dtype logits and the
    largest dense temporaries (merged qkv, attention output, gate/up and its SwiGLU, residual)."""
    elem = elem_size(dtype)
    dense = mcfg.q_size * 2 + 2 * mcfg.kv_size + 3 * mcfg.intermediate_size + 2 * mcfg.hidden_size
    return mcfg.vocab_size * (4 + elem) + dense * elem


def spec_reserve(cfg: EngineConfig, mcfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype,
                 k: int, runners: bool, capture: bool) -> dict[str, int]:
    """Fixed bytes beyond the plain step's activation reserve: the speculative step's scratch (k > 0), and
    with the padded runners (`runners`: CUDA) their static buffers, plus their graph pools (`capture`)."""
    out: dict[str, int] = {}
    elem = elem_size(dtype)
    verify_rows = cfg.max_num_seqs * (k + 1 if k > 0 else NO_SPEC_SPAN)
    if k > 0:  # verify rows past the plain reserve's row count need their own logits and temporaries
        out["verify_scratch"] = max(0, verify_rows - cfg.max_num_batched_tokens) * step_row_bytes(mcfg, dtype)
    if runners and cfg.verify_graph:
        static = mcfg.vocab_size * 4 + (3 * mcfg.q_size + 2 * mcfg.kv_size + mcfg.hidden_size) * elem
        if draft is not None:
            static += len(draft.target_layer_ids or ()) * mcfg.hidden_size * elem  # the taps
        out["verify_graph_static"] = verify_rows * static
        if capture:  # the pool holds the largest segment's temporaries: the tail's logits, the MLP
            out["verify_graph_pool"] = verify_rows * (mcfg.vocab_size + 3 * mcfg.intermediate_size) * elem
    if draft is not None and k > 0:
        b = int(draft.block_size or 1)
        rows = cfg.max_num_seqs * b
        out["draft_weights"] = draft_weight_bytes(draft, mcfg, dtype)
        out["draft_scratch"] = rows * step_row_bytes(draft, dtype)
        if runners and cfg.draft_graph:
            out["draft_graph_static"] = rows * (mcfg.vocab_size * 4 + (3 * draft.q_size + 2 * draft.kv_size
                                                                       + draft.hidden_size) * elem)
            if capture:
                out["draft_graph_pool"] = rows * (mcfg.vocab_size + 3 * draft.intermediate_size) * elem
    return out


@dataclass
class MemoryPlan:
    num_pages: int
    page_size: int
    bytes_per_token: int  # target + drafter K/V per token
    draft_bytes_per_token: int
    source: str  # "explicit" (num_pages given) | "profile" (GPU) | "cpu-default"
    reserved: dict[str, int] = field(default_factory=dict)  # fixed reservations made before sizing the pool
    budget: int | None = None  # GPU: bytes left for the pool after every reservation
    measured: dict[str, int] = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        return (self.num_pages + 1) * self.page_size * self.bytes_per_token  # + the runner's dummy page

    def describe(self) -> dict:
        return {"num_pages": self.num_pages, "page_size": self.page_size, "bytes_per_token": self.bytes_per_token,
                "draft_bytes_per_token": self.draft_bytes_per_token, "kv_bytes": self.kv_bytes,
                "source": self.source, "reserved": dict(self.reserved), "budget": self.budget,
                "measured": dict(self.measured)}

    def summary(self) -> str:
        res = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.reserved.items()) or "none"
        meas = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.measured.items()) or "pending"
        return (f"KV pool {self.num_pages} pages x {self.page_size} ({self.kv_bytes / GiB:.2f} GiB, "
                f"{self.bytes_per_token} B/token of which drafter {self.draft_bytes_per_token}; {self.source}); "
                f"reserved GiB: {res}; measured GiB: {meas}")


def plan_memory(cfg: EngineConfig, mcfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype,
                max_len: int, k: int = 0) -> MemoryPlan:
    """k: drafts per verify step when speculation is on (0 = off); draft: the DFlash drafter's config."""
    per_tok = bytes_per_token(mcfg, draft, dtype)
    d_tok = per_tok - bytes_per_token(mcfg, None, dtype)
    per_page = per_tok * cfg.page_size
    want = cfg.max_num_seqs * -(-max_len // cfg.page_size)
    cuda = torch.device(cfg.device).type == "cuda"
    reserved = spec_reserve(cfg, mcfg, draft, dtype, k, runners=cuda, capture=cuda and not cfg.eager)
    if cfg.num_pages is not None:
        return MemoryPlan(cfg.num_pages, cfg.page_size, per_tok, d_tok, "explicit", reserved)
    if cuda:
        free, total = torch.cuda.mem_get_info(torch.device(cfg.device))
        # Activations of the largest plain step (logits dominate) and the allocator's slack.
        reserved["activations"] = cfg.max_num_batched_tokens * (mcfg.vocab_size * 4 + mcfg.intermediate_size * 6) + GiB
        # The drafter's weights are resident already (in total - free); do not charge them twice.
        fixed = sum(v for key, v in reserved.items() if key != "draft_weights")
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - fixed
        one = -(-max_len // cfg.page_size)  # pages one request of max_model_len tokens needs
        if budget // per_page < one:
            raise ConfigError(
                f"gpu_memory_utilization={cfg.gpu_memory_utilization}: the KV pool would get "
                f"{max(budget, 0) / GiB:.2f} GiB ({max(budget // per_page, 0)} pages) after "
                f"{(total - free) / GiB:.2f} GiB already in use on {cfg.device} (this engine's weights and anything "
                f"else in the process, e.g. another engine) and {fixed / GiB:.2f} GiB reserved, fewer than the {one} "
                f"pages one max_model_len={max_len} request needs; raise gpu_memory_utilization, give the other "
                "engine a smaller share, lower max_model_len, or set num_pages")
        pages = int(min(budget // per_page, want))
        return MemoryPlan(pages, cfg.page_size, per_tok, d_tok, "profile", reserved, budget=budget,
                          measured={"total": total, "used_after_weights": total - free})
    # CPU: enough for max_num_seqs full-length requests, capped at 1 GiB.
    return MemoryPlan(int(max(1, min(want, GiB // per_page))), cfg.page_size, per_tok, d_tok, "cpu-default", reserved)


def plan_pages(cfg: EngineConfig, mcfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype,
               max_len: int) -> int:
    """The pool size alone (kept for callers that need no reservation report)."""
    return plan_memory(cfg, mcfg, draft, dtype, max_len).num_pages


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(plan: MemoryPlan, target, draft, runner, device: torch.device, draft_graphs=None) -> None:
    """Fill plan.measured from the live tensors (and the CUDA allocator on the GPU)."""
    m = plan.measured
    m["target_weights"] = tensor_bytes(target.parameters())  # parameters() counts a tied lm_head once
    if draft is not None:
        m["draft_weights"] = tensor_bytes(draft.parameters())
    m["kv_pool"] = tensor_bytes(t for pair in runner.kv for t in pair)
    if runner.draft_kv:
        m["draft_kv"] = tensor_bytes(t for pair in runner.draft_kv for t in pair)
    for name, g in (("verify_graphs", runner.verify_graphs), ("draft_graphs", draft_graphs)):
        if g is not None:
            m[f"{name}_static"] = g.stack.static_bytes()
            m[f"{name}_pool"] = g.stack.capture_bytes
    if device.type == "cuda":
        m["cuda_allocated"] = torch.cuda.memory_allocated(device)
        m["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device)
        m["cuda_reserved"] = torch.cuda.memory_reserved(device)
