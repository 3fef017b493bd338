"""The DFlash2 drafter (Z Lab format): DFlash plus grouped dynamic convolutions and a candidate selector.

Selected by `architectures: ["DFlash2DraftModel"]` (`drafter_class`); a DFlash1 config resolves to
`DFlashDraftModel` exactly as before. Facts: ../shared/REFERENCE-dflash2.md.

Config (`draft_field`): every DFlash2 field is read from `dflash_config` first, then flat at the top level
(some training tools save it so): `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`,
`output_multiplier` (1.0), `final_logit_softcapping` (none). Causality (`declared_causal`) is `is_causal`
when the config has it; only without it does it follow `layer_types` (`sliding_attention` = causal). Z Lab's
checkpoint declares `sliding_attention` on every layer AND `is_causal: false`: its draft layers are
non-causal, and an engine that derives causality from the layer type drafts plausibly but worse.

Per layer, around each of the two sublayers (attention, MLP), a depthwise convolution along the block:
    out[i, c] = sum_t (base[side, t, c] + delta[i, side, t, g(c)]) * x[i - t, c],   g(c) = c // group
with taps zero across the block boundary (i - t < 0 reads zero: one request's block never sees another's
or its context). `delta` [.., 2, K, G] comes from ONE projection (`kernel_projection`) of the sublayer's
(normed) input; side 0 convolves that input on the way in, side 1 the sublayer's output on the way out.
The context rows (K-only path) are not convolved: they come from the target's features, not the block.

Logits: the target's lm_head on the final-normed block hidden, times `output_multiplier`, then
`cap * tanh(x / cap)` when `final_logit_softcapping` is set. The selector (engine/spec/selector.py) picks
the drafts from the top-K of those logits using `selector_weights`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..loader import take
from ..rope import RotaryCache
from .dflash import DFlashDraftModel

DFLASH2 = "DFlash2DraftModel"


def draft_field(raw: dict, name: str, default: object = None) -> object:
    """A DFlash2 config field: `dflash_config.<name>` wins, then the top-level `<name>`, then `default`."""
    dc = raw.get("dflash_config") or {}
    if isinstance(dc, dict) and dc.get(name) is not None:
        return dc[name]
    return raw.get(name, default) if raw.get(name) is not None else default


def declared_causal(raw: dict) -> bool:
    """Are the draft layers causal inside the block? `is_causal` first; else every layer `sliding_attention`."""
    if raw.get("is_causal") is not None:
        return bool(raw["is_causal"])
    types = raw.get("layer_types") or []
    return bool(types) and all(t == "sliding_attention" for t in types)


def is_dflash2(cfg: ModelConfig) -> bool:
    return DFLASH2 in cfg.architectures


def drafter_class(cfg: ModelConfig) -> type[DFlashDraftModel]:
    """The drafter class a config's `architectures` names (DFlash2DraftModel or DFlashDraftModel)."""
    if is_dflash2(cfg):
        return DFlash2DraftModel
    if not cfg.is_dflash:
        raise ConfigError(f"config.architectures={list(cfg.architectures)!r}: expected DFlashDraftModel or "
                          f"{DFLASH2}")
    return DFlashDraftModel


# DFlash fields ModelConfig reads under dflash_config only; a flat DFlash2 config gets them nested on load.
_NESTED = ("mask_token_id", "target_layer_ids", "block_size")


def nest_flat_fields(raw: dict) -> dict:
    """The config with DFlash fields saved flat at the top level copied under `dflash_config` (the nested
    value wins where both exist); `raw` itself is not changed."""
    dc = dict(raw.get("dflash_config") or {}) if isinstance(raw.get("dflash_config") or {}, dict) else None
    if dc is None:
        return raw
    for name in _NESTED:
        if dc.get(name) is None and raw.get(name) is not None:
            dc[name] = raw[name]
    return {**raw, "dflash_config": dc}


def load_draft_config(draft_dir: str | Path) -> ModelConfig:
    """A drafter's config.json as ModelConfig, flat DFlash fields accepted (`nest_flat_fields`)."""
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        return ModelConfig.from_dir(draft_dir)  # its error names the missing file
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    return ModelConfig.from_dict(nest_flat_fields(raw) if isinstance(raw, dict) else raw, source=str(path))


def _int_field(raw: dict, name: str, src: str) -> int:
    v = draft_field(raw, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{src}: dflash_config.{name}={v!r} is invalid: expected a positive integer "
                          f"(under dflash_config or at the top level)")
    return v


class GroupedDynamicConv(nn.Module):
    """One sublayer's convolution pair: `base` [2, K, H] static taps, `proj_w` [2 * K * G, H] dynamic taps."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        self.base = nn.Parameter(torch.empty(2, kernel, hidden), requires_grad=False)
        self.proj_w = nn.Parameter(torch.empty(2 * kernel * self.groups, hidden), requires_grad=False)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, S, H] (the sublayer's input) -> dynamic taps [N, S, 2, K, G]."""
        n, s, _ = x.shape
        return F.linear(x, self.proj_w).view(n, s, 2, self.kernel, self.groups)

    def conv(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [N, S, H] along the block (dim 1, zero before slot 0); delta [N, S, 2, K, G]."""
        n, s, h = x.shape
        out = torch.zeros_like(x)
        for t in range(min(self.kernel, s)):
            w = self.base[side, t].to(x.dtype) + delta[:, :, side, t].repeat_interleave(self.group, dim=-1)
            shifted = x if t == 0 else F.pad(x[:, :s - t], (0, 0, t, 0))
            out = out + w * shifted
        return out


class DFlash2DraftModel(DFlashDraftModel):
    attn_convs: Sequence[GroupedDynamicConv]
    mlp_convs: Sequence[GroupedDynamicConv]

    def __init__(self, cfg: ModelConfig, target_hidden: int) -> None:
        super().__init__(cfg, target_hidden)
        raw, src = cfg.raw, "config.json"
        self.conv_kernel = _int_field(raw, "conv_kernel_size", src)
        self.conv_group = _int_field(raw, "conv_group_size", src)
        self.selector_rank = _int_field(raw, "selector_rank", src)
        self.selector_top_k = _int_field(raw, "selector_top_k", src)
        if cfg.hidden_size % self.conv_group:
            raise ConfigError(f"{src}: dflash_config.conv_group_size={self.conv_group} is invalid: expected a "
                              f"divisor of hidden_size={cfg.hidden_size}")
        if self.selector_top_k > cfg.vocab_size:
            raise ConfigError(f"{src}: dflash_config.selector_top_k={self.selector_top_k} is invalid: expected "
                              f"<= vocab_size={cfg.vocab_size}")
        self.output_multiplier = float(draft_field(raw, "output_multiplier", 1.0))  # type: ignore[arg-type]
        cap = draft_field(raw, "final_logit_softcapping")
        self.softcap = float(cap) if cap else None  # type: ignore[arg-type]
        self.causal = declared_causal(raw)
        h = cfg.hidden_size
        # nn.ModuleList registers them; torch's stubs type its items as Module (as DFlashDraftModel.layers).
        self.attn_convs = nn.ModuleList(GroupedDynamicConv(h, self.conv_kernel, self.conv_group)  # type: ignore[assignment]
                                        for _ in range(cfg.num_hidden_layers))
        self.mlp_convs = nn.ModuleList(GroupedDynamicConv(h, self.conv_kernel, self.conv_group)  # type: ignore[assignment]
                                       for _ in range(cfg.num_hidden_layers))
        r, v = self.selector_rank, cfg.vocab_size
        self.sel_proj = nn.Parameter(torch.empty(r, h), requires_grad=False)
        self.sel_pred = nn.Parameter(torch.empty(v, r), requires_grad=False)
        self.sel_succ = nn.Parameter(torch.empty(v, r), requires_grad=False)

    def _take_weights(self, t: dict[str, torch.Tensor], src: str, target_hidden: int) -> None:
        super()._take_weights(t, src, target_hidden)
        h, k, r, v = self.cfg.hidden_size, self.conv_kernel, self.selector_rank, self.cfg.vocab_size
        P = lambda x: nn.Parameter(x, requires_grad=False)  # noqa: E731
        for i in range(self.cfg.num_hidden_layers):
            for name, conv in (("attention_conv", self.attn_convs[i]), ("mlp_conv", self.mlp_convs[i])):
                p = f"layers.{i}.{name}."
                conv.base = P(take(t, p + "base_kernel", (2, k, h), src))
                conv.proj_w = P(take(t, p + "kernel_projection.weight", (2 * k * (h // self.conv_group), h), src))
        self.sel_proj = P(take(t, "candidate_selector.hidden_projection.weight", (r, h), src))
        self.sel_pred = P(take(t, "candidate_selector.predecessor_codebook", (v, r), src))
        self.sel_succ = P(take(t, "candidate_selector.successor_codebook", (v, r), src))

    # ---- pieces ----------------------------------------------------------------------------------
    def draft_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Final-normed block hidden [.., H] -> logits (multiplier, then soft cap), fp32."""
        x = F.linear(hidden, lm_head).float() * self.output_multiplier
        return self.softcap * torch.tanh(x / self.softcap) if self.softcap else x

    def greedy_drafts(self, hidden: torch.Tensor, lm_head: torch.Tensor, anchor: torch.Tensor,
                      selector: bool = True) -> torch.Tensor:
        """Greedy drafts [N, S] from slot hidden [N, S, H] and anchors [N] (the dense reference path)."""
        from ..spec import selector as sel  # noqa: PLC0415  (spec/ imports this module)

        logits = self.draft_logits(hidden, lm_head)
        if not selector:
            return logits.argmax(-1)
        unary, ids = sel.candidates(logits, self.selector_top_k)
        return sel.greedy_path(unary, ids, sel.project(hidden, self.sel_proj), anchor, self.sel_pred, self.sel_succ)

    def selector_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden projection [R, H], predecessor codebook A [V, R], successor codebook B [V, R])."""
        return self.sel_proj, self.sel_pred, self.sel_succ

    def block_forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: list[torch.Tensor],
                      ctx_v: list[torch.Tensor], ctx_valid: torch.Tensor, rope: RotaryCache,
                      causal: bool | None = None) -> torch.Tensor:
        """DFlashDraftModel.block_forward with the two convolutions per layer; causal inside the block when
        the config declares it (or `causal` forces it). Returns final-normed hidden [N, S, H]."""
        n, s, _ = x.shape
        c = ctx_valid.shape[1]
        block_mask = torch.ones(s, s, dtype=torch.bool, device=x.device)
        if self.causal if causal is None else causal:
            block_mask = torch.tril(block_mask)
        mask = torch.cat([ctx_valid[:, None, :].expand(n, s, c), block_mask.expand(n, s, s)], dim=2)[:, None]
        return self._layers(x, pos, ctx_k, ctx_v, mask, rope)

    def _conv(self, layer: int, sub: int) -> GroupedDynamicConv:
        return (self.attn_convs if sub == 0 else self.mlp_convs)[layer]

    def _sublayer_in(self, layer: int, sub: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sublayer's dynamic taps from its normed input, and that input convolved on the way in."""
        conv = self._conv(layer, sub)
        delta = conv.delta(h)
        return conv.conv(h, delta, 0), delta

    def _sublayer_out(self, layer: int, sub: int, y: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """The sublayer's output convolved on the way out, with the taps its input gave."""
        assert state is not None
        return self._conv(layer, sub).conv(y, state, 1)
