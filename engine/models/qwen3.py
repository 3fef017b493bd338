"""The Qwen3 target over a flat batch of token spans on a paged KV cache.

Each decoder layer is split into `pre_attn` (residual add + input norm, merged qkv GEMM, q/k norm, RoPE),
`attn` (the backend, eager) and `post_attn` (o_proj, residual add + post norm, merged gate/up GEMM,
SwiGLU, down). The dense segments between attentions therefore depend only on the number of rows, never
on KV length, which is what lets them be captured in CUDA graphs. Weights load from the standard HF names
(q/k/v and gate/up are concatenated at load time).

`self.ops` selects the dense kernels: None (the default, and always on CPU) runs the torch reference code
below; the runner sets a `kernels.ops.TritonOps` on CUDA: residual add + norm and SwiGLU kernels around the
cuBLAS GEMMs (optionally fused into a small-batch GEMV), and q/k norm + RoPE (+ the K/V store, when the
backend `accepts_stored_kv`) in one kernel. Both compute the same function (docs/gpu.md).

`emulate_tp(N)` (EngineConfig.tp_emulate, docs/noise.md) makes o_proj and down_proj, the projections a
tensor-parallel engine all-reduces, N partial GEMMs over slices of their input dimension summed last slice
first: the reduction order of a TP-N engine on one device. Every forward path (eager, piecewise, the padded
and captured graph runners) goes through `post_attn`, so each runs the same split; N = 1 is the one-GEMM path.

Tapped hidden states (for DFlash) are decoder-layer outputs, i.e. HF `hidden_states[i + 1]`; like HF,
the last layer's entry is the final-normed hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..config import ConfigError, ModelConfig
from ..loader import load_tensors, take
from ..rope import RotaryCache
from .layers import add_rms_norm, rms_norm, swiglu

Store = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (k_cache, v_cache, slot_mapping)


def _P(x: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(x, requires_grad=False)


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.qkv_w = nn.Parameter(torch.empty(q + 2 * kv, h), requires_grad=False)
        self.o_w = nn.Parameter(torch.empty(h, q), requires_grad=False)
        self.gate_up_w = nn.Parameter(torch.empty(2 * inter, h), requires_grad=False)
        self.down_w = nn.Parameter(torch.empty(h, inter), requires_grad=False)
        self.q_norm = nn.Parameter(torch.empty(cfg.head_dim), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(cfg.head_dim), requires_grad=False)
        self.in_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.tp = 1  # the emulated TP degree of the row-parallel projections (Qwen3ForCausalLM.emulate_tp)

    def load_weights(self, t: dict[str, torch.Tensor], p: str, src: str) -> None:
        """Standard HF names under prefix `p`; q/k/v and gate/up are concatenated here (merged GEMMs)."""
        cfg = self.cfg
        h, q, kv, inter, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
        self.qkv_w = _P(torch.cat([take(t, p + "self_attn.q_proj.weight", (q, h), src),
                                   take(t, p + "self_attn.k_proj.weight", (kv, h), src),
                                   take(t, p + "self_attn.v_proj.weight", (kv, h), src)]))
        self.o_w = _P(take(t, p + "self_attn.o_proj.weight", (h, q), src))
        self.gate_up_w = _P(torch.cat([take(t, p + "mlp.gate_proj.weight", (inter, h), src),
                                       take(t, p + "mlp.up_proj.weight", (inter, h), src)]))
        self.down_w = _P(take(t, p + "mlp.down_proj.weight", (h, inter), src))
        self.q_norm = _P(take(t, p + "self_attn.q_norm.weight", (d,), src))
        self.k_norm = _P(take(t, p + "self_attn.k_norm.weight", (d,), src))
        self.in_norm = _P(take(t, p + "input_layernorm.weight", (h,), src))
        self.post_norm = _P(take(t, p + "post_attention_layernorm.weight", (h,), src))

    def pre_attn(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 rope: RotaryCache, ops: Any = None, store: Store | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """`ops` (kernels.ops.TritonOps) swaps in the fused kernels; None keeps the torch reference.
        With `store=(k_cache, v_cache, slots)` K/V go straight into the cache and k, v come back None."""
        cfg = self.cfg
        if ops is not None:
            qkv, residual = ops.add_norm_linear(x, residual, self.in_norm, self.qkv_w, cfg.rms_norm_eps)
            q, k, v = ops.qk_norm_rope(qkv, self.q_norm, self.k_norm, cfg.rms_norm_eps, rope.cos, rope.sin,
                                       positions, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, store)
            return q, k, v, residual
        x, residual = add_rms_norm(x, residual, self.in_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, self.qkv_w)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        t = x.shape[0]
        q = rms_norm(q.reshape(t, cfg.num_attention_heads, cfg.head_dim), self.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k.reshape(t, cfg.num_key_value_heads, cfg.head_dim), self.k_norm, cfg.rms_norm_eps)
        v = v.reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        return rope.apply(q, positions), rope.apply(k, positions), v, residual

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor, ops: Any = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp > 1:
            return self._post_attn_tp(attn_out, residual, ops)
        if ops is not None:
            x = ops.linear(attn_out.reshape(attn_out.shape[0], -1), self.o_w)
            act, residual = ops.add_norm_linear(x, residual, self.post_norm, self.gate_up_w, self.cfg.rms_norm_eps,
                                                swiglu=True)
            return ops.linear(act, self.down_w), residual
        x = F.linear(attn_out.reshape(attn_out.shape[0], -1), self.o_w)
        x, residual = add_rms_norm(x, residual, self.post_norm, self.cfg.rms_norm_eps)
        return F.linear(swiglu(F.linear(x, self.gate_up_w)), self.down_w), residual

    # ---- emulated tensor-parallel reductions (EngineConfig.tp_emulate) ------------------------------
    def row_parallel(self, x: torch.Tensor, w: torch.Tensor, linear: Any) -> torch.Tensor:
        """x @ w.T as a TP-`tp` engine computes a row-parallel projection: `tp` partial GEMMs over equal slices of
        the input dimension, each in the model dtype (a rank's output), summed last slice first (the all-reduce)."""
        n = w.shape[1] // self.tp
        parts = [linear(x[:, i * n:(i + 1) * n], w[:, i * n:(i + 1) * n]) for i in range(self.tp)]
        out = parts[-1]
        for p in reversed(parts[:-1]):
            out = out + p
        return out

    def _post_attn_tp(self, attn_out: torch.Tensor, residual: torch.Tensor, ops: Any = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """post_attn with o_proj and down_proj as row-parallel projections (`row_parallel`); the rest unchanged."""
        a = attn_out.reshape(attn_out.shape[0], -1)
        if ops is not None:
            x = self.row_parallel(a, self.o_w, ops.linear)
            act, residual = ops.add_norm_linear(x, residual, self.post_norm, self.gate_up_w, self.cfg.rms_norm_eps,
                                                swiglu=True)
            return self.row_parallel(act, self.down_w, ops.linear), residual
        x, residual = add_rms_norm(self.row_parallel(a, self.o_w, F.linear), residual, self.post_norm,
                                   self.cfg.rms_norm_eps)
        return self.row_parallel(swiglu(F.linear(x, self.gate_up_w)), self.down_w, F.linear), residual


class Qwen3ForCausalLM(nn.Module):
    layers: Sequence[Qwen3Layer]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        # An nn.ModuleList (registers the layers); torch's stubs type its items as Module, not Qwen3Layer.
        self.layers = nn.ModuleList(Qwen3Layer(cfg) for _ in range(cfg.num_hidden_layers))  # type: ignore[assignment]
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.lm_head_w = (self.embed if cfg.tie_word_embeddings
                          else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False))
        self.scale = cfg.head_dim ** -0.5
        self.ops: Any = None  # kernels.ops.TritonOps on CUDA when enabled (set by the runner)

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> Qwen3ForCausalLM:
        src = str(model_dir)
        t = load_tensors(model_dir, dtype, device)
        with torch.device("meta"):
            model = cls(cfg)
        h, v = cfg.hidden_size, cfg.vocab_size
        model.embed = _P(take(t, "model.embed_tokens.weight", (v, h), src))
        model.norm = _P(take(t, "model.norm.weight", (h,), src))
        if cfg.tie_word_embeddings:
            model.lm_head_w = model.embed
        else:
            model.lm_head_w = _P(take(t, "lm_head.weight", (v, h), src))
        for i, layer in enumerate(model.layers):
            layer.load_weights(t, f"model.layers.{i}.", src)
        return model

    def emulate_tp(self, degree: int) -> None:
        """Emulate a TP-`degree` engine's reduction order in every layer's row-parallel projections (o_proj,
        down_proj; Qwen3Layer.row_parallel); 1 restores the one-GEMM path. The slices follow TP's own split: o_proj
        at head boundaries, down_proj in equal shares of intermediate_size, so both must divide by `degree`."""
        cfg = self.cfg
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ConfigError(f"tp_emulate={degree!r} is invalid: expected an integer >= 1 (1 = off)")
        for name, size in (("num_attention_heads", cfg.num_attention_heads),
                           ("intermediate_size", cfg.intermediate_size)):
            if size % degree:
                raise ConfigError(f"tp_emulate={degree} is invalid for this model: config.{name}={size} does not "
                                  f"divide by {degree} (a TP-{degree} engine splits it evenly across ranks)")
        for layer in self.layers:
            layer.tp = degree

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rope: RotaryCache,
                tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (final-normed hidden [T, H], tapped decoder-layer outputs in tap_layers order)."""
        x = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        taps: dict[int, torch.Tensor] = {}
        ops = self.ops
        for i, layer in enumerate(self.layers):
            store = self.fused_store(backend, kv_caches[i])
            q, k, v, residual = layer.pre_attn(x, residual, positions, rope, ops, store)
            o = backend.forward(q, k, v, kv_caches[i][0], kv_caches[i][1], self.scale)
            x, residual = layer.post_attn(o, residual, ops)
            if i in tap_layers:
                taps[i] = x + residual
        return self.finish(x, residual, taps, tap_layers)

    def fused_store(self, backend: AttentionBackend, kv: tuple[torch.Tensor, torch.Tensor]) -> Store | None:
        """(k_cache, v_cache, slots) when the Triton rope kernel should store K/V itself (the backend
        then gets k = v = None); None when the backend stores them."""
        if self.ops is None or not getattr(backend, "accepts_stored_kv", False):
            return None
        assert backend.slot_mapping is not None, "plan() sets the step's slots before the forward"
        return kv[0], kv[1], backend.slot_mapping

    def finish(self, x: torch.Tensor, residual: torch.Tensor | None, taps: dict[int, torch.Tensor],
               tap_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final norm after the last layer, and the taps in tap_layers order."""
        norm = self.ops.add_rms_norm if self.ops is not None else add_rms_norm
        x, _ = norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        last = len(self.layers) - 1
        if last in tap_layers:  # HF's hidden_states[-1] is the final-normed output: keep its meaning
            taps[last] = x
        return x, [taps[i] for i in tap_layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_w)
