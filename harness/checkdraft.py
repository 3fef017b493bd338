"""Checkpoint checks for a DFlash-family drafter: would this engine silently draft it wrong?

A DFlash2 checkpoint run by DFlash1 code drafts plausible tokens and the output stays lossless; so does a
DFlash2 drafter whose layers run causal because an engine read causality from `layer_types`. Only the
acceptance moves. These checks make both loud (`specbench check-draft DIR`, and `lossless` with a local
drafter):

- `architecture`: `architectures` resolves to a drafter class of the reference engine
  (engine/models/dflash2.py `drafter_class`); FAIL naming the value when it does not, or when the class
  that loaded it (`arch=` forces one, as a broken engine would) is not the one the config names.
- `tensors`: every tensor in the checkpoint is consumed by the model built (engine/loader.py records what
  `take` handed out); FAIL naming the unused tensors and what they are (DFlash2's convolutions and
  selector left unused = the checkpoint was loaded by DFlash1 code).
- `causality`: the declared causality (`is_causal` first, then `layer_types`) against the built model's
  behaviour, probed: the block pass is run twice with only the last block slot's input changed; if slot 1's
  output moves, the layers are non-causal. FAIL naming the declaration when they disagree (`causal=` forces
  the built model's causality, as an engine deriving it from `layer_types` would).

`check_draft(draft, target, arch=None, causal=None)` -> `DraftReport` (a verdict per check, one overall).
The acceptance sanity test that compares a running engine with the drafter's variants is
harness/draft_variants.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specbench.engine.config import ConfigError, ModelConfig
from specbench.engine.models.dflash import DFlashDraftModel
from specbench.engine.models.dflash2 import (
    DFLASH2,
    DFlash2DraftModel,
    declared_causal,
    drafter_class,
    load_draft_config,
)
from specbench.engine.rope import RotaryCache

from .verdicts import FAIL, PASS, combine

CLASSES: dict[str, type[DFlashDraftModel]] = {"DFlashDraftModel": DFlashDraftModel, DFLASH2: DFlash2DraftModel}
_KINDS = (("attention_conv.", "convolution"), ("mlp_conv.", "convolution"), ("candidate_selector.", "selector"))


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    detail: str


@dataclass
class DraftReport:
    draft: str
    architecture: str  # what the config names
    loaded_as: str  # the class that loaded it
    checks: list[Check] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return combine([c.verdict for c in self.checks])

    def to_dict(self) -> dict:
        return {"draft": self.draft, "architecture": self.architecture, "loaded_as": self.loaded_as,
                "verdict": self.verdict, "checks": [c.__dict__ for c in self.checks]}

    def render(self) -> str:
        lines = [f"check-draft {self.draft}: {self.verdict} (architectures={self.architecture}, "
                 f"loaded as {self.loaded_as})"]
        lines += [f"  {c.name:<13} {c.verdict:<5} {c.detail}" for c in self.checks]
        return "\n".join(lines)


def _kind(name: str) -> str:
    return next((k for p, k in _KINDS if p in name), "other")


def _tensor_check(m: DFlashDraftModel, cls_name: str, arch: str) -> Check:
    unused = list(m.unused_tensors)
    if not unused:
        return Check("tensors", PASS, "every checkpoint tensor is consumed by the model built")
    kinds = sorted({_kind(n) for n in unused})
    shown = ", ".join(unused[:6]) + (f", ... ({len(unused)} in all)" if len(unused) > 6 else "")
    why = ""
    if {"convolution", "selector"} & set(kinds) and cls_name != DFLASH2:
        why = (f": the checkpoint's DFlash2 {' and '.join(k for k in kinds if k != 'other')} tensors are ignored "
               f"by {cls_name} code, which drafts it as DFlash1 (config says {arch})")
    return Check("tensors", FAIL, f"{len(unused)} checkpoint tensor(s) unused by the model built ({shown}){why}")


@torch.no_grad()
def probe_causal(m: DFlashDraftModel, seed: int = 0) -> bool:
    """Does the built block pass behave causally? Slot 1's output with the last slot's input changed."""
    cfg, b = m.cfg, m.block_size
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryCache(cfg, "cpu", torch.float32, max_pos=4 + b)
    c, h = 4, cfg.hidden_size
    x = torch.randn(1, b, h, generator=gen)
    y = x.clone()
    y[0, -1] = torch.randn(h, generator=gen) * 3
    feats = torch.randn(c, h, generator=gen)
    ks, vs = zip(*(m.context_kv(i, feats, torch.arange(c), rope) for i in range(len(m.layers))), strict=True)
    ctx_k, ctx_v = [k[None].float() for k in ks], [v[None].float() for v in vs]
    pos = torch.arange(c, c + b)[None]
    valid = torch.ones(1, c, dtype=torch.bool)
    m32 = m.float()
    a = m32.block_forward(x, pos, ctx_k, ctx_v, valid, rope)[0, 1]
    z = m32.block_forward(y, pos, ctx_k, ctx_v, valid, rope)[0, 1]
    return bool(torch.allclose(a, z, rtol=0, atol=1e-6 * float(a.abs().max()) + 1e-9))


def _causal_check(m: DFlashDraftModel, raw: dict) -> Check:
    dflash2 = DFLASH2 in (raw.get("architectures") or ())
    declared = declared_causal(raw) if dflash2 else False
    source = f"is_causal={raw['is_causal']!r}" if raw.get("is_causal") is not None else \
        f"layer_types={raw.get('layer_types')!r} (no is_causal)"
    if not dflash2:
        source = "DFlash1: non-causal block"
    ran = probe_causal(m)
    word = {True: "causal", False: "non-causal"}
    if ran == declared:
        return Check("causality", PASS, f"{word[ran]} draft layers, as declared ({source})")
    trap = ""
    if raw.get("is_causal") is not None and not raw["is_causal"] and \
            any(t == "sliding_attention" for t in raw.get("layer_types") or []):
        trap = "; layer_types says sliding_attention: causality was taken from the layer type, not is_causal"
    return Check("causality", FAIL, f"the draft layers ran {word[ran]} but the config declares {word[declared]} "
                                    f"({source}){trap}")


def check_draft(draft: str | Path, target: str | Path, arch: str | None = None,
                causal: bool | None = None) -> DraftReport:
    """Run the three checks. `arch` loads with that class instead of the one `architectures` names and
    `causal` forces the built layers' causality: both stand for a broken engine, for the self-test."""
    src = str(draft)
    cfg = load_draft_config(draft)
    arch_named = ",".join(cfg.architectures)
    try:
        resolved = drafter_class(cfg)
    except ConfigError as e:
        return DraftReport(src, arch_named, "-", [Check("architecture", FAIL, str(e))])
    if arch is not None and arch not in CLASSES:
        raise ConfigError(f"arch={arch!r} is invalid: expected one of {', '.join(CLASSES)}")
    cls = CLASSES[arch] if arch else resolved
    checks = []
    if cls is resolved:
        checks.append(Check("architecture", PASS, f"{arch_named} -> {resolved.__name__}"))
    else:
        checks.append(Check("architecture", FAIL, f"config.architectures={arch_named} names {resolved.__name__}, "
                                                  f"but {cls.__name__} loaded it"))
    tcfg = ModelConfig.from_dir(target)
    m = cls.load(draft, cfg, tcfg, torch.float32, "cpu")  # DFlash1's class accepts any DFlash* config
    if causal is not None and isinstance(m, DFlash2DraftModel):
        m.causal = causal
    checks.append(_tensor_check(m, cls.__name__, arch_named))
    checks.append(_causal_check(m, cfg.raw))
    return DraftReport(src, arch_named, cls.__name__, checks)
