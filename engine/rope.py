"""Rotary position embeddings (neox layout, as Qwen3/HF `rotate_half`) with optional rope_scaling.

Supported rope_scaling types: default, linear, dynamic (static form at max length), llama3, yarn.
Anything else is refused with the field named.
"""

from __future__ import annotations

import math

import torch

from .config import ConfigError, ModelConfig


def inv_freq_and_scale(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv, 1.0
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    factor = float(rs.get("factor", 1.0))
    if kind in ("linear", "dynamic"):
        return inv / factor, 1.0
    orig = float(rs.get("original_max_position_embeddings", cfg.max_position_embeddings))
    if kind == "llama3":
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extra_mask = 1 - ramp.clamp(0, 1)
        inv = (inv / factor) * (1 - extra_mask) + inv * extra_mask
        mscale = float(rs.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
        return inv, mscale
    raise ConfigError(f"config.rope_scaling.rope_type={kind!r} is not supported: expected default, linear, "
                      "dynamic, llama3 or yarn")


class RotaryCache:
    """cos/sin tables for positions [0, max_pos), gathered per token."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 max_pos: int | None = None) -> None:
        inv, mscale = inv_freq_and_scale(cfg)
        n = max_pos or cfg.max_position_embeddings
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * mscale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * mscale).to(device=device, dtype=dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin
