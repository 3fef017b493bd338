"""Load-aware speculation (issue 20): each step's verify span, chosen by the gate, the trim or the cost model.

Speculation pays at one stream and loses under load: a verify step costs batch x span target rows where a
plain decode costs batch rows. `SpanPolicy.choose(running, proposer, step)` decides, once per step, how
many drafts every decode-phase request carries (the schedule phase's `draft_lens`) and why:
- a request that cannot speculate (logprobs, sampling without spec sampling, one token left) is
  `INELIGIBLE`; one whose proposer has no context for its committed length is `NOT_READY` (plain decode);
  every other one is draft-ready and gets the step's drafts (`SPEC`) or none (`GATED`);
- gate (`SpecPlan.gate` = N > 0): with more than N running requests the step is a one-token round, every
  draft-ready request `GATED` (N = 1: every step of a batch is gated, a request alone speculates). A gated
  span is a plain decode of [current token]: one token committed, and its tapped row enters the drafter's
  context like any committed row (commit.py -> `Proposer.observe`), so the request stays draft-ready and
  speculates again, without a prefill, as soon as N or fewer run;
- otherwise, without the automatic policy: `SpecPlan.fixed_drafts` (trim k when set, else K), capped by what
  the request has left (min(d, remaining - 1)), exactly `draft_lens` of spec/propose.py when no lever is set;
- automatic policy (`SpecPlan.policy == "auto"`): over the span variants s (1 + drafts, SpecPlan.span_variants),
  the expected committed tokens per second
      tokens(d) / (C_verify(b, d + 1) + [d > 0] C_draft(r) + overhead)
  with b the decode-phase requests, r the draft-ready ones, tokens(d) = the non-ready requests' one token each
  plus, per ready request, 1 + sum_{j=1..d'} prod_{i<j} c_i (d' = min(d, remaining - 1)), c_i the running
  acceptance at draft position i given positions < i were accepted (`Acceptance`, decayed counts with a
  prior), C_* the start-up cost model (spec/costs.py) and `overhead` the running mean of the host time a
  step costs beyond the model (its wall time minus the model's figure). The best d wins (ties: the shorter
  span). While the policy keeps choosing 1 with ready requests, every `EXPLORE`-th such step speculates at
  the best d > 0 instead, so the acceptance estimate cannot freeze (reason "explore").
Every step's choice is one `trace` entry (a bounded deque; SPECBENCH_STEP_TRACE entries, default 4096, 0 =
off): step, running, ready, span, reason, and per request id its state, drafts and accepted drafts; and
counted in the metrics (`EngineMetrics.record_span`: gated rounds, the span histogram).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from ..request import Request
from .plan import SpecPlan
from .proposer import Proposer

if TYPE_CHECKING:
    from ..accept_step import SpanResult
    from ..metrics import EngineMetrics
    from ..scheduler import StepPlan
    from .costs import CostModel

EXPLORE = 64  # with ready requests held at span 1 by the policy, one step in EXPLORE speculates anyway
DECAY = 0.995  # per verify step: the acceptance estimate's memory is ~200 steps
PRIOR = (0.6, 4.0)  # prior conditional acceptance per position and its weight in spans


class DraftState(StrEnum):
    SPEC = "spec"
    GATED = "gated"
    NOT_READY = "not_ready"
    INELIGIBLE = "ineligible"


class Acceptance:
    """Running conditional acceptance per draft position: c_i = P(draft i accepted | drafts < i accepted)."""

    def __init__(self, k: int, prior: tuple[float, float] = PRIOR, decay: float = DECAY) -> None:
        p, w = prior
        self.acc = [p * w] * k
        self.off = [w] * k
        self.decay = decay

    def record(self, pairs: list[tuple[int, int]]) -> None:
        """(drafts, accepted) of this step's verify spans."""
        if not pairs:
            return
        self.acc = [a * self.decay for a in self.acc]
        self.off = [o * self.decay for o in self.off]
        for k, m in pairs:
            for i in range(min(k, m + 1, len(self.off))):
                self.off[i] += 1.0
                if i < m:
                    self.acc[i] += 1.0

    def conditional(self) -> list[float]:
        return [a / o if o > 0 else 0.0 for a, o in zip(self.acc, self.off, strict=True)]

    def expected(self, d: int) -> float:
        """Expected committed tokens of a verify span with d drafts (the bonus included)."""
        e, run = 1.0, 1.0
        for c in self.conditional()[:d]:
            run *= c
            e += run
        return e


@dataclass
class StepChoice:
    step: int
    running: int  # decode-phase requests
    ready: int  # draft-ready among them
    span: int  # 1 + the drafts a ready request carries (1 = gated / plain)
    reason: str  # "fixed", "gate", "policy", "explore", "no_ready"
    requests: dict[str, dict] = field(default_factory=dict)  # rid -> {"state", "drafts", "accepted"}
    expected: dict[int, float] | None = None  # policy: span -> expected tokens / s (for explaining)
    t0: float = 0.0

    def as_dict(self) -> dict:
        out = {"step": self.step, "running": self.running, "ready": self.ready, "span": self.span,
               "reason": self.reason, "requests": self.requests}
        if self.expected is not None:
            out["expected_tps"] = {str(s): round(v, 3) for s, v in self.expected.items()}
        return out


def trace_len() -> int:
    raw = os.environ.get("SPECBENCH_STEP_TRACE", "").strip()
    return int(raw) if raw.isdigit() else 4096


class SpanPolicy:
    def __init__(self, spec: SpecPlan, costs: CostModel | None = None, metrics: EngineMetrics | None = None) -> None:
        self.spec, self.costs, self.metrics = spec, costs, metrics
        self.acceptance = Acceptance(max(spec.k, 1))
        n = trace_len()
        self.trace: deque[dict] | None = deque(maxlen=n) if n else None
        self.overhead = 0.0  # running mean host seconds per step beyond the cost model
        self._held = 0  # policy steps in a row at span 1 with ready requests (for exploration)
        self._choice: StepChoice | None = None

    @property
    def auto(self) -> bool:
        return self.spec.policy == "auto" and self.costs is not None

    # ---- schedule ---------------------------------------------------------------------------------
    def choose(self, running: list[Request], proposer: Proposer | None, step: int = 0
               ) -> tuple[dict[str, int], dict[str, str]]:
        """(drafts per request id, draft state per request id) for this step's decode-phase requests."""
        self._choice = None
        if proposer is None:
            return {}, {}
        spec = self.spec
        decode = [r for r in running if not r.in_prefill]
        states: dict[str, str] = {}
        ready: list[Request] = []
        for r in decode:
            if not (spec.can_speculate(r.params) and r.remaining >= 2):
                states[r.rid] = DraftState.INELIGIBLE.value
            elif not proposer.ready(r):
                states[r.rid] = DraftState.NOT_READY.value
            else:
                ready.append(r)
        expected = None
        if not ready:
            d, reason = 0, "no_ready"
        elif spec.gate and len(running) > spec.gate:
            d, reason = 0, "gate"
        elif self.auto:
            d, reason, expected = self._best(len(decode), ready)
        else:
            d, reason = spec.fixed_drafts, "fixed"
        ks: dict[str, int] = {}
        for r in ready:
            k = min(d, r.remaining - 1)
            states[r.rid] = DraftState.SPEC.value if k > 0 else DraftState.GATED.value
            if k > 0:
                ks[r.rid] = k
        self._choice = StepChoice(step, len(decode), len(ready), d + 1, reason,
                                  {rid: {"state": st, "drafts": ks.get(rid, 0), "accepted": None}
                                   for rid, st in states.items()} if self.trace is not None else {},
                                  expected, time.perf_counter())
        return ks, states

    def _best(self, b: int, ready: list[Request]) -> tuple[int, str, dict[int, float]]:
        assert self.costs is not None
        others = b - len(ready)
        rate: dict[int, float] = {}
        for s in self.spec.span_variants:
            d = s - 1
            tokens = others + sum(self.acceptance.expected(min(d, r.remaining - 1)) for r in ready)
            t = self.costs.verify(b, s) + (self.costs.draft(len(ready)) if d else 0.0) + self.overhead
            rate[s] = tokens / t if t > 0 else 0.0
        best = max(rate, key=lambda s: (rate[s], -s))
        if best > 1:
            self._held = 0
            return best - 1, "policy", rate
        self._held += 1
        if self._held % EXPLORE == 0:
            alt = max((s for s in rate if s > 1), key=lambda s: (rate[s], -s), default=None)
            if alt is not None:
                return alt - 1, "explore", rate
        return 0, "policy", rate

    # ---- after the accept phase ------------------------------------------------------------------
    def record(self, plan: StepPlan, results: list[SpanResult]) -> None:
        """The step's verify outcomes: acceptance estimate, trace entry, span metrics, host overhead."""
        pairs = [(r.drafts, r.accepted) for s, r in zip(plan.spans, results, strict=True)
                 if s.kind == "verify" and r.accepted is not None and r.drafts]
        self.acceptance.record(pairs)
        c = self._choice
        if c is None:
            return
        self._choice = None
        if self.trace is not None:
            for s, r in zip(plan.spans, results, strict=True):
                e = c.requests.get(s.req.rid)
                if e is not None:
                    e["drafts"] = r.drafts if s.kind == "verify" else 0
                    e["accepted"] = r.accepted if s.kind == "verify" else None
            self.trace.append(c.as_dict())
        if c.running and self.metrics is not None:
            self.metrics.record_span(c.span, gated=c.span == 1 and c.ready > 0)
        if self.auto and not any(s.kind == "prefill" for s in plan.spans) and c.running:
            assert self.costs is not None
            d = c.span - 1
            model = self.costs.verify(c.running, c.span) + (self.costs.draft(c.ready) if d else 0.0)
            extra = max(0.0, time.perf_counter() - c.t0 - model)
            self.overhead = extra if self.overhead == 0.0 else 0.9 * self.overhead + 0.1 * extra

    def describe(self) -> dict:
        return {"gate": self.spec.gate, "trim": self.spec.trim, "policy": self.spec.policy,
                "span_variants": list(self.spec.span_variants),
                "acceptance": [round(c, 4) for c in self.acceptance.conditional()],
                "overhead_ms": round(self.overhead * 1e3, 4),
                "costs": self.costs.describe() if self.costs is not None else None}
