"""The DFlash block-diffusion drafter (Z Lab format), sharing the target's embedding and lm_head.

Architecture (REFERENCE.md section 1): context features = hidden_norm(fc(concat of target decoder-layer
outputs at target_layer_ids)); `num_hidden_layers` pre-norm Qwen3 blocks whose attention takes queries
from the block only and keys/values from [context rows ; block rows], non-causal, RoPE at absolute
positions; a final norm; logits through the target's lm_head for block slots 1..B-1 (slot j predicts the
token at block start + j).

Two entry points over the same weights:
- `context_kv(layer, feats, positions)`: K/V of new context rows (the "K-only" path: no queries),
  which the engine appends to its per-request draft KV cache once the rows are committed;
- `block_forward(x, pos, ctx_k, ctx_v, ctx_valid)`: the batched block pass for N requests at once,
  one [N, S] buffer for all dense ops, attention masked per request over its own context.
`forward_dense` composes both from raw features (the simple path used for training and as the
reference the cached path is tested against).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..loader import load_tensors, take, unused
from ..rope import RotaryCache
from .layers import rms_norm, swiglu
from .qwen3 import Qwen3Layer


class DFlashDraftModel(nn.Module):
    layers: Sequence[Qwen3Layer]

    def __init__(self, cfg: ModelConfig, target_hidden: int) -> None:
        super().__init__()
        if not cfg.is_dflash:
            raise ConfigError(f"config.architectures={list(cfg.architectures)!r}: expected DFlashDraftModel")
        self.cfg = cfg
        self.block_size: int = int(cfg.block_size)  # type: ignore[arg-type]
        self.mask_token_id: int = int(cfg.mask_token_id)  # type: ignore[arg-type]
        self.target_layer_ids: tuple[int, ...] = tuple(cfg.target_layer_ids or ())
        n_in = len(self.target_layer_ids) * target_hidden
        self.fc_w = nn.Parameter(torch.empty(cfg.hidden_size, n_in), requires_grad=False)
        self.hidden_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        # An nn.ModuleList (registers the layers); torch's stubs type its items as Module, not Qwen3Layer.
        self.layers = nn.ModuleList(Qwen3Layer(cfg) for _ in range(cfg.num_hidden_layers))  # type: ignore[assignment]
        self.scale = cfg.head_dim ** -0.5
        dc = cfg.raw.get("dflash_config") or {}
        self.input_embedding_scale = float(dc.get("input_embedding_scale", 1.0))
        self.unused_tensors: list[str] = []  # checkpoint tensors `load` did not take (see harness/checkdraft.py)

    @classmethod
    def load(cls, draft_dir: str | Path, cfg: ModelConfig, target_cfg: ModelConfig, dtype: torch.dtype,
             device: str) -> DFlashDraftModel:
        src = str(draft_dir)
        if cfg.hidden_size != target_cfg.hidden_size:
            raise ConfigError(f"{src}: hidden_size={cfg.hidden_size} differs from the target's "
                              f"{target_cfg.hidden_size}; the drafter shares the target's embedding")
        bad = [i for i in cfg.target_layer_ids or () if not 0 <= i < target_cfg.num_hidden_layers]
        if bad:
            raise ConfigError(f"{src}: dflash_config.target_layer_ids contains {bad}: expected indices in "
                              f"[0, {target_cfg.num_hidden_layers})")
        t = load_tensors(draft_dir, dtype, device, strip_prefix="model.")
        with torch.device("meta"):
            m = cls(cfg, target_cfg.hidden_size)
        m._take_weights(t, src, target_cfg.hidden_size)
        # What this class read of the checkpoint: a tensor it never took is a weight it silently ignores
        # (a DFlash2 checkpoint through this class leaves its convolutions and selector here).
        m.unused_tensors = unused(t)
        return m

    def _take_weights(self, t: dict[str, torch.Tensor], src: str, target_hidden: int) -> None:
        h = self.cfg.hidden_size
        P = lambda x: nn.Parameter(x, requires_grad=False)  # noqa: E731
        self.fc_w = P(take(t, "fc.weight", (h, len(self.target_layer_ids) * target_hidden), src))
        self.hidden_norm = P(take(t, "hidden_norm.weight", (h,), src))
        self.norm = P(take(t, "norm.weight", (h,), src))
        for i, layer in enumerate(self.layers):
            layer.load_weights(t, f"layers.{i}.", src)

    # ---- pieces ----------------------------------------------------------------------------------
    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [T, L * H_target] (concat of tapped layers) -> context features [T, H]."""
        return rms_norm(F.linear(taps, self.fc_w), self.hidden_norm, self.cfg.rms_norm_eps)

    def context_kv(self, layer: int, feats: torch.Tensor, positions: torch.Tensor,
                   rope: RotaryCache) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V (normed, rotated) of context rows for one layer: feats [T, H] -> [T, Hkv, D] x 2."""
        cfg, ly = self.cfg, self.layers[layer]
        w = ly.qkv_w[cfg.q_size:]
        kv = F.linear(feats, w)
        k, v = kv.split([cfg.kv_size, cfg.kv_size], dim=-1)
        t = feats.shape[0]
        k = rms_norm(k.reshape(t, cfg.num_key_value_heads, cfg.head_dim), ly.k_norm, cfg.rms_norm_eps)
        return rope.apply(k, positions), v.reshape(t, cfg.num_key_value_heads, cfg.head_dim)

    def block_forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: list[torch.Tensor],
                      ctx_v: list[torch.Tensor], ctx_valid: torch.Tensor, rope: RotaryCache) -> torch.Tensor:
        """x: block embeddings [N, S, H]; pos [N, S]; ctx_k/ctx_v per layer [N, C, Hkv, D];
        ctx_valid [N, C] bool. Returns final-normed hidden [N, S, H]."""
        n, s, _ = x.shape
        mask = torch.cat([ctx_valid, torch.ones(n, s, dtype=torch.bool, device=x.device)], dim=1)
        return self._layers(x, pos, ctx_k, ctx_v, mask[:, None, None, :], rope)  # [N, 1, 1, C + S]: non-causal

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor],
                mask: torch.Tensor, rope: RotaryCache) -> torch.Tensor:
        """The layers of `block_forward` under an attention mask over [context ; block] (broadcast to
        [N, Hq, S, C + S]), then the final norm. Each sublayer (0 attention, 1 MLP) takes its normed input
        through `_sublayer_in` and adds its output through `_sublayer_out`: the identity here, DFlash2's
        convolutions in its subclass."""
        cfg = self.cfg
        n, s, _ = x.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        flat_pos = pos.reshape(-1)
        for i, ly in enumerate(self.layers):
            h, state = self._sublayer_in(i, 0, rms_norm(x, ly.in_norm, cfg.rms_norm_eps))
            q, k, v = F.linear(h.reshape(n * s, -1), ly.qkv_w).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = rope.apply(rms_norm(q.reshape(n * s, hq, d), ly.q_norm, cfg.rms_norm_eps), flat_pos)
            k = rope.apply(rms_norm(k.reshape(n * s, hkv, d), ly.k_norm, cfg.rms_norm_eps), flat_pos)
            keys = torch.cat([ctx_k[i], k.reshape(n, s, hkv, d)], dim=1).transpose(1, 2)
            vals = torch.cat([ctx_v[i], v.reshape(n, s, hkv, d)], dim=1).transpose(1, 2)
            if hq != hkv:
                keys = keys.repeat_interleave(hq // hkv, dim=1)
                vals = vals.repeat_interleave(hq // hkv, dim=1)
            o = F.scaled_dot_product_attention(q.reshape(n, s, hq, d).transpose(1, 2), keys, vals,
                                               attn_mask=mask, scale=self.scale)
            x = x + self._sublayer_out(i, 0, F.linear(o.transpose(1, 2).reshape(n, s, hq * d), ly.o_w), state)
            h, state = self._sublayer_in(i, 1, rms_norm(x, ly.post_norm, cfg.rms_norm_eps))
            x = x + self._sublayer_out(i, 1, F.linear(swiglu(F.linear(h, ly.gate_up_w)), ly.down_w), state)
        return rms_norm(x, self.norm, cfg.rms_norm_eps)

    def _sublayer_in(self, layer: int, sub: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A sublayer's normed input [N, S, H] as the sublayer takes it, and what `_sublayer_out` needs."""
        return h, None

    def _sublayer_out(self, layer: int, sub: int, y: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output [N, S, H] as it is added to the residual stream."""
        return y

    def forward_dense(self, taps: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
                      block_embeds: torch.Tensor, block_pos: torch.Tensor, rope: RotaryCache) -> torch.Tensor:
        """Simple path from raw tapped features: taps [N, C, L*H_t] -> block hidden [N, S, H]."""
        n, c, _ = taps.shape
        feats = self.project_context(taps.reshape(n * c, -1))
        ks, vs = [], []
        for i in range(len(self.layers)):
            k, v = self.context_kv(i, feats, ctx_pos.reshape(-1), rope)
            ks.append(k.reshape(n, c, *k.shape[1:]))
            vs.append(v.reshape(n, c, *v.shape[1:]))
        return self.block_forward(block_embeds, block_pos, ks, vs, ctx_valid, rope)
