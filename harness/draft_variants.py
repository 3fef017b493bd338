"""The acceptance sanity test: which variant of a drafter does an engine's measured acceptance match?

A drafter run wrong (its selector skipped, its layers causal) stays lossless; only its acceptance moves.
So the reference engine runs the same target + drafter once per variant, with the variant forced through
the draft knobs (engine/faults.py: `selector_skipped`, `causal_draft`; DRAFT_VARIANT_FAULTS):

    declared              the drafter as its config says (selector on, causality from is_causal)
    selector skipped      drafts = the logits' argmax (what DFlash1 code does with a DFlash2 checkpoint)
    causal                the draft layers causal inside the block (causality read from layer_types)
    selector skipped + causal

and measures each one's mean accepted length (1 + accepted drafts per verify step, from the spec counters)
on the same greedy prompts. The engine under test (any adapter with spec counters: the local engine,
vLLM, SGLang, ...) runs the same prompts; its mean accepted length is matched to the nearest variant.
PASS: the nearest is `declared` and closer to it than half the gap to any other variant. FAIL: another
variant is nearer, named. CANNOT TEST: the engine reports no spec counters or drafts nothing, or the
variants do not differ for this drafter (DFlash1; a causal-declared drafter has no separate causal row).

`run_variants(target, draft, engine=None, ...)` -> `VariantReport`; engine None = the reference engine as
declared (a self-consistency run; the self-test arms a variant fault on it instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .adapters.base import EngineAdapter, GenRequest, counters_delta
from .datasets import bundled_prompts
from .engines import build_adapter
from .verdicts import CANNOT_TEST, FAIL, PASS

VARIANTS: dict[str, tuple[str, ...]] = {
    "declared": (),
    "selector skipped": ("selector_skipped",),
    "causal": ("causal_draft",),
    "selector skipped + causal": ("selector_skipped", "causal_draft"),
}


@dataclass
class VariantReport:
    engine: str
    measured: float | None  # the engine's mean accepted length (None: no counters or no drafts)
    variants: dict[str, float] = field(default_factory=dict)
    nearest: str | None = None
    verdict: str = CANNOT_TEST
    detail: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def render(self) -> str:
        rows = [f"acceptance sanity ({self.engine}): {self.verdict}: {self.detail}"]
        rows += [f"  {k:<26} {v:.3f}" + ("   <- nearest" if k == self.nearest else "")
                 for k, v in self.variants.items()]
        rows.append(f"  {'engine under test':<26} {self.measured:.3f}" if self.measured is not None else
                    "  engine under test          (no acceptance)")
        return "\n".join(rows)


def mean_accept_len(adapter: EngineAdapter, requests: list[GenRequest]) -> float | None:
    """1 + accepted drafts per verify step over `requests` (greedy), from the adapter's spec counters."""
    before = adapter.spec_counters_sync()
    adapter.generate_sync(requests)
    d = counters_delta(before, adapter.spec_counters_sync())
    if not d or not d.get("num_drafts"):
        return None
    return 1.0 + d["num_accepted_tokens"] / d["num_drafts"]


def prompts(n: int, max_tokens: int) -> list[GenRequest]:
    rows = bundled_prompts("gsm8k")[:n]
    return [GenRequest(prompt=text, max_tokens=max_tokens, ignore_eos=True, rid=f"cd-{pid}", prompt_cache=False)
            for pid, text in rows]


def judge(measured: float | None, variants: dict[str, float]) -> tuple[str, str | None, str]:
    """(verdict, nearest variant, detail) for a measured mean accepted length against the variants'."""
    if measured is None:
        return CANNOT_TEST, None, "the engine under test reported no drafts (spec counters missing or zero)"
    distinct = sorted(set(round(v, 9) for v in variants.values()))
    if len(distinct) < 2:
        return CANNOT_TEST, None, "the variants accept identically for this drafter (nothing to tell apart)"
    nearest = min(variants, key=lambda k: (abs(variants[k] - measured), k != "declared"))
    declared = variants["declared"]
    others = [v for k, v in variants.items() if k != "declared" and abs(v - declared) > 1e-9]
    gap = min(abs(v - declared) for v in others)
    tie = [k for k, v in variants.items() if abs(v - declared) <= 1e-9 and k != "declared"]
    same = f" (identical to {', '.join(tie)} for this drafter)" if tie else ""
    if abs(measured - declared) <= gap / 2:
        return PASS, "declared", (f"mean accepted length {measured:.3f} matches the declared variant "
                                  f"({declared:.3f}){same}; the nearest other variant is {gap:.3f} away")
    return FAIL, nearest, (f"mean accepted length {measured:.3f} matches variant '{nearest}' "
                           f"({variants[nearest]:.3f}), not the declared drafter ({declared:.3f}): the engine "
                           f"runs the drafter as '{nearest}'")


def run_variants(target: str, draft: str, engine: str | EngineAdapter | None = None, engine_faults: tuple[str, ...] = (),
                 num_prompts: int = 8, max_tokens: int = 64, log=None,
                 known: dict[str, float] | None = None) -> VariantReport:
    """Measure every variant on the reference engine (unless `known` gives them, from an earlier run with the
    same pair, prompts and max_tokens), then the engine under test, and judge."""
    say = log or (lambda _m: None)
    reqs = prompts(num_prompts, max_tokens)
    base = f"local:{target},draft={draft}"
    variants: dict[str, float] = dict(known or {})
    for name, faults in VARIANTS.items():
        if name in variants:
            continue
        a = build_adapter(base + (f",faults={'+'.join(faults)}" if faults else ""), name=f"variant[{name}]")
        try:
            tau = mean_accept_len(a, reqs)
        finally:
            a.close()
        if tau is None:
            return VariantReport(base, None, variants, None, CANNOT_TEST, f"variant '{name}' drafted nothing")
        variants[name] = tau
        say(f"  variant {name:<26} mean accepted length {tau:.3f}")
    if engine is None or isinstance(engine, str):
        spec = engine or base + (f",faults={'+'.join(engine_faults)}" if engine_faults else "")
        adapter, label, own = build_adapter(spec, name="engine"), spec, True
    else:
        adapter, label, own = engine, engine.name, False
    try:
        measured = mean_accept_len(adapter, reqs)
    finally:
        if own:
            adapter.close()
    verdict, nearest, detail = judge(measured, variants)
    return VariantReport(label, measured, variants, nearest, verdict, detail)
