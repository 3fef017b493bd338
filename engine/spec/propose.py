"""The propose phase: which decode-phase requests carry drafts this step, and the drafts themselves.

`draft_lens(running, proposer, spec)` gives K' = min(K, remaining - 1) drafts to every request that can
speculate (`SpecPlan.can_speculate`), is past its prompt, has at least two tokens left and whose proposer
context is ready; every other request decodes a span of 1 in the same batch, so one request that cannot
speculate never turns speculation off for its neighbours. `propose(plan, proposer, ks, faults)` fills the
verify spans' drafts (DFlash: ONE batched draft pass) and appends them to the span's tokens
([anchor, d1..dK']); a span the proposer left without drafts runs as a plain decode. The armed faults'
knobs for the draft come from one `Faults.on_propose` call.
"""

from __future__ import annotations

from ..faults import NO_FAULTS, Faults
from ..request import Request
from ..scheduler import StepPlan
from .plan import SpecPlan
from .proposer import Proposer


def draft_lens(running: list[Request], proposer: Proposer | None, spec: SpecPlan) -> dict[str, int]:
    """Drafts per request id for this step (absent: a plain decode span)."""
    if proposer is None:
        return {}
    return {r.rid: min(spec.k, r.remaining - 1) for r in running
            if not r.in_prefill and spec.can_speculate(r.params) and r.remaining >= 2 and proposer.ready(r)}


def propose(plan: StepPlan, proposer: Proposer | None, ks: dict[str, int], faults: Faults = NO_FAULTS,
            defer: bool = False) -> None:
    """`defer` (EngineConfig.defer_drafts, the engine checks no fault is armed): a proposer that `defers` may keep
    greedy drafts on the device; their PendingDrafts goes to plan.pending (spec/pending.py)."""
    spans = [s for s in plan.spans if s.kind == "verify"]
    if not spans or proposer is None:
        return
    knobs = faults.on_propose(spans)
    kw = knobs.overrides(getattr(proposer, "variants", ()))
    if defer and proposer.defers:
        kw["defer"] = True
    plan.pending = proposer.propose(spans, [ks[s.req.rid] for s in spans], **kw)
    for s in spans:
        if s.drafts:
            s.tokens = s.tokens + list(s.drafts)
        else:
            s.kind = "decode"
