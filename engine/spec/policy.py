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
  step costs beyond the model (its wall time minus the model's figure). Online correction (off with
  SPECBENCH_SPEC_ONLINE=0): once a (batch bucket, span) pair has run `MIN_OBS` steps without a prefill chunk,
  its measured step time (a running mean of schedule-to-commit wall time) replaces the model's figure for it,
  so a cost the model does not see (attention over long contexts, host work that grows with the span) still
  decides. The best d wins (ties: the shorter span). Every `EXPLORE`-th decision runs another candidate
  instead (the least observed at this bucket, else the runner-up; reason "explore"), so neither the
  acceptance estimate nor the measured times can freeze while the policy holds one span.
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

EXPLORE = 64  # one policy decision in EXPLORE runs another candidate span (exploration)
MIN_OBS = 3  # steps of a (bucket, span) before its measured time replaces the model's
ONLINE_ENV = "SPECBENCH_SPEC_ONLINE"  # 0: the cost model alone (no measured step times)
DECAY = 0.995  # per verify step: the acceptance estimate's memory is ~200 steps
PRIOR = (0.6, 4.0)  # prior conditional acceptance per position and its weight in spans


class DraftState(StrEnum):
    SPEC = "spec"
    GATED = "gated"
    NOT_READY = "not_ready"
    INELIGIBLE = "ineligible"


class Acceptance:
    """Running conditional acceptance per draft position: c_i = P(draft i accepted | drafts < i accepted).

    The observations are censored by the policy itself: a span of d drafts says nothing about positions >= d,
    so a position the policy stopped running keeps whatever it is shrunk toward. Shrinking every position
    toward one fixed prior (0.6) made the policy pessimistic about exactly the positions it never tried: on
    the H200 at synthetic tau 6.5 it held span 8 where span 16 was 29 % faster (reports/h200-levers). So each
    position is shrunk toward the pooled acceptance of the positions before it (position 0 toward the prior):
        c_i = (accepted_i + w r_i) / (offered_i + w),  r_i = (sum_{j<i} accepted_j + w p) / (sum_{j<i} offered_j + w)
    An unobserved position extrapolates what the observed ones say together (pooled, so one unlucky deep
    position does not decide); a longer span then looks as good as the data allow, gets run, and its positions
    become observed (optimistic where unknown, corrected by use). Tested by simulation (tests/test_levers.py):
    at acceptance 0.85 per position the fixed prior held span 8 for 99 of the first 100 steps where span 16
    is 17 % better; at 0.5 both stay short."""

    def __init__(self, k: int, prior: tuple[float, float] = PRIOR, decay: float = DECAY) -> None:
        self.p0, self.w = prior
        self.acc = [0.0] * k  # decayed accepted counts per position
        self.off = [0.0] * k  # decayed offered counts per position
        self.decay = decay
        self._exp: list[float] | None = None  # expected_all, until the next record

    def record(self, pairs: list[tuple[int, int]]) -> None:
        """(drafts, accepted) of this step's verify spans."""
        if not pairs:
            return
        self._exp = None
        self.acc = [a * self.decay for a in self.acc]
        self.off = [o * self.decay for o in self.off]
        for k, m in pairs:
            for i in range(min(k, m + 1, len(self.off))):
                self.off[i] += 1.0
                if i < m:
                    self.acc[i] += 1.0

    def conditional(self) -> list[float]:
        out, ref = [], self.p0
        sa = so = 0.0  # pooled over the positions before: accepted, offered
        for a, o in zip(self.acc, self.off, strict=True):
            c = (a + self.w * ref) / (o + self.w) if o + self.w > 0 else 0.0
            out.append(c)
            sa, so = sa + a, so + o
            ref = (sa + self.w * self.p0) / (so + self.w)
        return out

    def expected(self, d: int) -> float:
        """Expected committed tokens of a verify span with d drafts (the bonus included)."""
        return self.expected_all()[min(max(d, 0), len(self.off))]

    def expected_all(self) -> list[float]:
        """expected(d) for d = 0..K, in one pass (cached until the next record)."""
        if self._exp is not None:
            return self._exp
        out, e, run = [1.0], 1.0, 1.0
        for c in self.conditional():
            run *= c
            e += run
            out.append(e)
        self._exp = out
        return out


@dataclass
class StepChoice:
    step: int
    running: int  # decode-phase requests
    ready: int  # draft-ready among them
    span: int  # 1 + the drafts a ready request carries (1 = gated / plain)
    reason: str  # "fixed", "gate", "policy", "explore", "no_ready"
    states: dict[str, str] = field(default_factory=dict)  # rid -> DraftState value
    drafts: dict[str, int] = field(default_factory=dict)  # rid -> drafts carried (verify spans)
    accepted: dict[str, int] = field(default_factory=dict)  # rid -> accepted drafts (filled after the accept)
    expected: dict[int, float] | None = None  # policy: span -> expected tokens / s (for explaining)
    t0: float = 0.0

    def as_dict(self) -> dict:
        reqs = {rid: {"state": st, "drafts": self.drafts.get(rid, 0), "accepted": self.accepted.get(rid)}
                for rid, st in self.states.items()}
        out = {"step": self.step, "running": self.running, "ready": self.ready, "span": self.span,
               "reason": self.reason, "requests": reqs}
        if self.expected is not None:
            out["expected_tps"] = {str(s): round(v, 3) for s, v in self.expected.items()}
        return out


def trace_len() -> int:
    raw = os.environ.get("SPECBENCH_STEP_TRACE", "").strip()
    return int(raw) if raw.isdigit() else 4096


_SPEC, _GATED, _NOT_READY, _INELIGIBLE = (DraftState.SPEC.value, DraftState.GATED.value, DraftState.NOT_READY.value,
                                          DraftState.INELIGIBLE.value)


class SpanPolicy:
    def __init__(self, spec: SpecPlan, costs: CostModel | None = None, metrics: EngineMetrics | None = None) -> None:
        self.spec, self.costs, self.metrics = spec, costs, metrics
        self.acceptance = Acceptance(max(spec.k, 1))
        n = trace_len()
        self._trace: deque[StepChoice] | None = deque(maxlen=n) if n else None
        self.overhead = 0.0  # running mean host seconds per step beyond the cost model
        self._decisions = 0  # policy decisions so far (for exploration)
        self.online = os.environ.get(ONLINE_ENV, "1").strip() not in ("0", "off", "false")
        self.walls: dict[tuple[int, int], list[float]] = {}  # (batch bucket, span) -> [mean step seconds, steps]
        self._choice: StepChoice | None = None
        self._timed: StepChoice | None = None  # the step record() saw, timed by step_done() after its commit
        self._spans = spec.span_variants

    @property
    def auto(self) -> bool:
        return self.spec.policy == "auto" and self.costs is not None

    @property
    def trace(self) -> list[dict]:
        """The step trace, oldest first (empty with SPECBENCH_STEP_TRACE=0); built when read."""
        return [c.as_dict() for c in self._trace] if self._trace is not None else []

    # ---- schedule ---------------------------------------------------------------------------------
    def choose(self, running: list[Request], proposer: Proposer | None, step: int = 0, ahead: int = 0
               ) -> tuple[dict[str, int], dict[str, str]]:
        """(drafts per request id, draft state per request id) for this step's decode-phase requests. `ahead`:
        tokens each of them commits before this step runs (engine/ahead.py chooses the chained step before the
        step in flight is committed): their remaining length counts that much shorter."""
        self._choice = None
        if proposer is None:
            return {}, {}
        spec = self.spec
        states: dict[str, str] = {}
        ready: list[tuple[str, int]] = []  # (rid, remaining)
        n_decode = 0
        for r in running:
            if r.in_prefill:
                continue
            n_decode += 1
            rem = r.remaining - ahead
            if rem < 2 or not spec.can_speculate(r.params):
                states[r.rid] = _INELIGIBLE
            elif not proposer.ready(r):
                states[r.rid] = _NOT_READY
            else:
                ready.append((r.rid, rem))
        expected = None
        if not ready:
            d, reason = 0, "no_ready"
        elif spec.gate and len(running) > spec.gate:
            d, reason = 0, "gate"
        elif self.auto:
            d, reason, expected = self._best(n_decode, [rem for _, rem in ready])
        else:
            d, reason = spec.fixed_drafts, "fixed"
        ks: dict[str, int] = {}
        if d:
            for rid, rem in ready:
                k = d if d < rem else rem - 1
                states[rid] = _SPEC
                ks[rid] = k
        else:
            for rid, _ in ready:
                states[rid] = _GATED
        self._choice = StepChoice(step, n_decode, len(ready), d + 1, reason, states, ks, {}, expected,
                                  time.perf_counter())
        return ks, states

    def _best(self, b: int, remaining: list[int]) -> tuple[int, str, dict[int, float]]:
        assert self.costs is not None
        n_ready = len(remaining)
        others = b - n_ready
        exp = self.acceptance.expected_all()
        top = len(exp) - 1
        hist = [0] * (top + 1)  # ready requests by the drafts they can take (capped at K)
        for rem in remaining:
            hist[rem - 1 if rem - 1 < top else top] += 1
        rate: dict[int, float] = {}
        draft = self.costs.draft(n_ready)
        bk = _bucket(b)
        for s in self._spans:
            d = s - 1 if s - 1 < top else top
            tokens = others + sum(hist[x] * exp[x] for x in range(d)) + sum(hist[d:]) * exp[d]
            w = self.walls.get((bk, s)) if self.online else None
            t = w[0] if w is not None and w[1] >= MIN_OBS else \
                self.costs.verify(b, s) + (draft if d else 0.0) + self.overhead
            rate[s] = tokens / t if t > 0 else 0.0
        best = max(rate, key=lambda s: (rate[s], -s))
        self._decisions += 1
        if self._decisions % EXPLORE == 0 and len(rate) > 1:
            others_s = [s for s in rate if s != best]
            seen = {s: (self.walls.get((bk, s)) or [0.0, 0])[1] for s in others_s}
            alt = min(others_s, key=lambda s: (seen[s], -rate[s]))
            return alt - 1, "explore", rate
        return best - 1, "policy", rate

    def detach(self) -> StepChoice | None:
        """Take the current choice away (a step launched ahead keeps its own until its commit: `attach`)."""
        c, self._choice = self._choice, None
        return c

    def attach(self, choice: StepChoice | None) -> None:
        """Make `choice` (from `detach`) the one the next `record` completes."""
        self._choice = choice

    def forget(self, choice: StepChoice | None) -> None:
        """`choice` (from `detach`) is never run (engine/ahead.py: a stashed decision whose batch changed, a step
        whose every row was dropped): a policy decision it made is not counted, so the exploration cadence stays
        the off switch's."""
        if choice is not None and choice.reason in ("policy", "explore"):
            self._decisions -= 1

    # ---- after the accept phase ------------------------------------------------------------------
    def record(self, plan: StepPlan, results: list[SpanResult]) -> None:
        """The step's verify outcomes: acceptance estimate, trace entry, span metrics, host overhead."""
        pairs = []
        c = self._choice
        for sp, r in zip(plan.spans, results, strict=True):
            if sp.kind == "verify" and r.accepted is not None and r.drafts:
                pairs.append((r.drafts, r.accepted))
                if c is not None:
                    c.accepted[sp.req.rid] = r.accepted
        self.acceptance.record(pairs)
        if c is None:
            return
        self._choice = None
        if self._trace is not None:
            self._trace.append(c)
        if c.running and self.metrics is not None:
            self.metrics.record_span(c.span, gated=c.span == 1 and c.ready > 0)
        self._timed = c if self.auto and c.running and not any(sp.kind == "prefill" for sp in plan.spans) else None

    def step_done(self) -> None:
        """After the step's commit: its wall time from the schedule phase on, into the host overhead and the
        measured step times. The commit is inside it (the drafter's context advance, the page bookkeeping, the
        outputs): it costs about the same per step whatever the span, so leaving it out made every step look
        cheaper by the same amount and favoured the short spans that take more steps per token (a likely part of
        why, at tau 2.0 on the H200, the policy held one-token rounds at c1 for 236 tok/s where span 16 made 275)."""
        c, self._timed = self._timed, None
        if c is not None:
            assert self.costs is not None
            model = self.costs.verify(c.running, c.span) + (self.costs.draft(c.ready) if c.span > 1 else 0.0)
            wall = time.perf_counter() - c.t0
            extra = max(0.0, wall - model)
            self.overhead = extra if self.overhead == 0.0 else 0.9 * self.overhead + 0.1 * extra
            if self.online:
                w = self.walls.setdefault((_bucket(c.running), c.span), [wall, 0])
                w[0] = wall if w[1] == 0 else 0.8 * w[0] + 0.2 * wall
                w[1] += 1

    def describe(self) -> dict:
        return {"gate": self.spec.gate, "trim": self.spec.trim, "policy": self.spec.policy,
                "span_variants": list(self.spec.span_variants),
                "acceptance": [round(c, 4) for c in self.acceptance.conditional()],
                "overhead_ms": round(self.overhead * 1e3, 4), "online": self.online,
                "measured_ms": {f"b{b}s{s}": [round(w[0] * 1e3, 4), int(w[1])] for (b, s), w in sorted(self.walls.items())},
                "costs": self.costs.describe() if self.costs is not None else None}


def _bucket(b: int) -> int:
    """The power of two >= b: the batch bucket measured step times are kept under."""
    return 1 << max(0, int(b) - 1).bit_length()
