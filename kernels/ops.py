"""The op bundle the engine's model calls when the Triton path is on.

`TritonOps(gemv=False, max_rows=gemv.MAX_ROWS, skinny=False)` exposes add_rms_norm, swiglu, qk_norm_rope, k_norm_rope,
kv_store, add_norm_linear and linear. add_norm_linear runs the add-norm kernel, cuBLAS and the SwiGLU kernel,
linear runs cuBLAS; with `gemv` on, inputs of at most `max_rows` rows (decode) take the Triton GEMVs of
kernels/gemv.py instead (on the shapes where `gemv.pick` gives a config: cuBLAS stays where it measured
faster): residual add + RMSNorm (+ SwiGLU) fused into the GEMV, and a plain GEMV for the o and down
projections. The same function either way (tests hold both to the torch reference).
Switch: `EngineConfig.gemv` (engine string `gemv=0|1`, default from SPECBENCH_GEMV).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import activation, norm, rope
from . import gemv as _gemv
from . import kv_store as _kv_store
from . import skinny as _skinny


class TritonOps:
    name = "triton"

    def __init__(self, gemv: bool = False, max_rows: int = _gemv.MAX_ROWS, skinny: bool = False) -> None:
        self.gemv = gemv
        self.max_rows = max_rows
        self.skinny = skinny and gemv
        self.kinds = _gemv.enabled_kinds()  # SPECBENCH_GEMV_KINDS, read once
        self._cfgs: dict[tuple[int, int, str], tuple[int, int, int] | None] = {}

    def gemv_config(self, rows: int, n: int, k: int, kind: str) -> tuple[int, int, int] | None:
        """The GEMV config for this call, or None for cuBLAS (switch off, too many rows, kind left out by
        SPECBENCH_GEMV_KINDS, or TUNED None for the shape); decided once per shape."""
        if not self.gemv or rows > self.max_rows:
            return None
        key = (n, k, kind)
        if key not in self._cfgs:
            self._cfgs[key] = _gemv.pick(n, k, kind) if kind in self.kinds else None
        return self._cfgs[key]

    def skinny_config(self, rows: int, n: int, k: int, kind: str) -> _skinny.Config | None:
        """The skinny-GEMM config for a call the GEMV does not take (more than max_rows rows), or None for
        cuBLAS (switch off, more than skinny.MAX_ROWS rows, kind left out, TUNED None for the shape)."""
        if not self.skinny or rows <= self.max_rows or kind not in self.kinds:
            return None
        return _skinny.pick(n, k, kind, rows)

    add_rms_norm = staticmethod(norm.add_rms_norm)
    rms_norm = staticmethod(norm.rms_norm)
    swiglu = staticmethod(activation.swiglu)
    qk_norm_rope = staticmethod(rope.qk_norm_rope)
    k_norm_rope = staticmethod(rope.k_norm_rope)
    kv_store = staticmethod(_kv_store.kv_store)

    def add_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
                        w: torch.Tensor, eps: float, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        n, kind = (w.shape[0] // 2 if swiglu else w.shape[0]), ("swiglu" if swiglu else "norm")
        cfg = self.gemv_config(x.shape[0], n, x.shape[1], kind)
        if cfg is not None:
            return _gemv.add_norm_linear(x, residual, norm_w, w, eps, swiglu, cfg)
        scfg = self.skinny_config(x.shape[0], n, x.shape[1], kind)
        if scfg is not None and x.stride(-1) == 1:
            return _skinny.add_norm_linear(x, residual, norm_w, w, eps, swiglu, scfg)
        h, res = norm.add_rms_norm(x, residual, norm_w, eps)
        y = F.linear(h, w)
        return (activation.swiglu(y) if swiglu else y), res

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cfg = self.gemv_config(x.shape[0], w.shape[0], w.shape[1], "plain") if x.stride(-1) == 1 else None
        if cfg is not None:
            return _gemv.linear(x, w, cfg)
        scfg = self.skinny_config(x.shape[0], w.shape[0], w.shape[1], "plain") if x.stride(-1) == 1 else None
        if scfg is not None:
            return _skinny.linear(x, w, scfg)
        return F.linear(x, w)

    def describe(self) -> dict:
        return {"ops": self.name, "gemv": self.gemv, "gemv_max_rows": self.max_rows, "gemv_kinds": list(self.kinds),
                "skinny": self.skinny, "skinny_max_rows": _skinny.MAX_ROWS}
