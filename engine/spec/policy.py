"""Load-aware speculation (issue 20): each step's verify span, chosen by the gate, the trim or the cost model.

Contract: `SpanPolicy.choose(running, proposer, step)` decides, once per step, how many drafts every
decode-phase request carries (the schedule phase, before `Scheduler.schedule`) and why. The measurements behind each rule
below are in docs/levers.md ("Why the automatic policy's rules are what they are").
- a request that cannot speculate (prompt logprobs, logprobs with SpecConfig.logprobs off, sampling without spec
  sampling, one token left) is `INELIGIBLE`; one whose proposer has no context for its committed length is
  `NOT_READY` (plain decode); every other one is draft-ready and gets the step's drafts (`SPEC`) or none
  (`GATED`);
- gate (`SpecPlan.gate` = N > 0): with more than N running requests the step is a one-token round, every
  draft-ready request `GATED`. A gated span is a plain decode of [current token] whose tapped row enters the
  drafter's context like any committed row (commit.py -> `Proposer.observe`), so the request speculates again,
  without a prefill, as soon as N or fewer run;
- without the automatic policy: `SpecPlan.fixed_drafts` (trim k when set, else K), capped by what the request
  has left (min(d, remaining - 1)): exactly `draft_lens` of spec/propose.py when no lever is set;
- automatic policy (`SpecPlan.policy == "auto"`): over the span variants s = 1 + d (SpecPlan.span_variants),
  the span with the most expected committed tokens per second wins (ties: the shorter span)
      tokens(d) / (C_verify(b, d + 1) + [d > 0] C_draft(r) + overhead)
  with b the decode-phase requests, r the draft-ready ones, tokens(d) = the non-ready requests' one token each
  plus, per ready request, 1 + sum_{j=1..d'} prod_{i<j} c_i (d' = min(d, remaining - 1)), c_i the running
  acceptance at draft position i given positions < i were accepted (`Acceptance`, decayed counts with a
  prior), C_* the start-up cost model (spec/costs.py) and `overhead` the median over the last `WINDOW`
  unchained steps of a step's wall time beyond the model's figure;
- online correction (off with SPECBENCH_SPEC_ONLINE=0): once a (batch bucket, span) pair has run `MIN_OBS`
  steps, the median of its last `WINDOW` measured step times replaces the model's figure for it;
- a step's measured time is the wall time it adds to the run: from the previous step's commit (when requests
  were left running; after an idle spell, from its own schedule phase) to after its own commit. Only steps whose
  span the policy chose are timed: not `no_ready` ones, and none that carries a prefill chunk;
- a one-token round that ran chained (engine/ahead.py, `chain_ok`) is timed apart (`chain_walls` per batch
  bucket); the span-1 figure weights the chained time by `chain_frac` (the share of one-token rounds right
  after a timed one-token round that ran chained; a round after a prefill-mixed step restarts a chain) and the
  unchained time by the rest; with no chained observation yet, the model's replay time of the decode step;
- in a chain of one-token rounds, a speculative span's step time carries 1 / `HOLD` of the unchained round
  that restarts the chain; a gated or no_ready round counts as a one-token round for this;
- until `EVIDENCE` verify spans have been observed (the acceptance estimate's decayed count at position 0) the
  policy speculates (its best span > 1);
- exploration: at most once per `EXPLORE` decisions another candidate runs instead (reason "explore": one never
  run at this bucket first, else the runner-up), paid from a per-bucket budget: every decision adds
  `EXPLORE_SHARE` of the best span's step time, an exploration spends its regret (its step time minus the
  best span's time for the same tokens, plus a chain restart where it breaks one). A span already run at the
  bucket is explored only within `EXPLORE_GAP` of the best's expected rate. Exploring span 1 where rounds
  chain runs `EXPLORE_RUN` rounds in a row, ending early at a bucket change, a gated or no_ready step, or a
  prefill chunk.
Every step's choice is one `trace` entry (a bounded deque; SPECBENCH_STEP_TRACE entries, default 4096, 0 =
off): step, running, ready, span, reason, and per request id its state, drafts and accepted drafts; and
counted in the metrics (`EngineMetrics.record_span`: gated rounds, the span histogram).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from specbench import env

from ..request import Request
from .plan import SpecPlan
from .proposer import Proposer

if TYPE_CHECKING:
    from ..accept_step import SpanResult
    from ..metrics import EngineMetrics
    from ..scheduler import StepPlan
    from .costs import CostModel

EXPLORE = 8  # at most one policy decision in EXPLORE runs another candidate span (exploration; the budget decides)
EXPLORE_SHARE = 0.005  # the share of the run's time exploration may cost (its budget per decision)
EXPLORE_RUN = 4  # one-token rounds an exploration of span 1 runs in a row where they chain
EXPLORE_GAP = 0.25  # a span measured at this bucket is explored only within this share of the best's expected rate
WINDOW = 9  # a (bucket, span)'s measured step time: the median of its last WINDOW steps
HOLD = 8  # steps a switch out of a chain of one-token rounds must be worth (the restart it costs, spread over them)
EVIDENCE = 16  # verify spans observed (decayed) before the policy may hold one-token rounds
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
    chained: bool = False  # launched behind a step still in flight (engine/ahead.py): its host work hidden
    mixed: bool = False  # the step carried a prefill chunk
    undo: tuple | None = None  # the policy's exploration state before this decision (`SpanPolicy.forget`)

    def as_dict(self) -> dict:
        reqs = {rid: {"state": st, "drafts": self.drafts.get(rid, 0), "accepted": self.accepted.get(rid)}
                for rid, st in self.states.items()}
        out = {"step": self.step, "running": self.running, "ready": self.ready, "span": self.span,
               "reason": self.reason, "requests": reqs}
        if self.expected is not None:
            out["expected_tps"] = {str(s): round(v, 3) for s, v in self.expected.items()}
        return out


def trace_len() -> int:
    return int(env.get("SPECBENCH_STEP_TRACE"))


_SPEC, _GATED, _NOT_READY, _INELIGIBLE = (DraftState.SPEC.value, DraftState.GATED.value, DraftState.NOT_READY.value,
                                          DraftState.INELIGIBLE.value)


class SpanPolicy:
    def __init__(self, spec: SpecPlan, costs: CostModel | None = None, metrics: EngineMetrics | None = None) -> None:
        self.spec, self.costs, self.metrics = spec, costs, metrics
        self.acceptance = Acceptance(max(spec.k, 1))
        n = trace_len()
        self._trace: deque[StepChoice] | None = deque(maxlen=n) if n else None
        self.overhead = 0.0  # host seconds per step beyond the cost model: the median of the last WINDOW
        self._extras: deque[float] = deque(maxlen=WINDOW)
        self._decisions = 0  # policy decisions so far (for exploration)
        self.online = env.flag(ONLINE_ENV)
        self.walls: dict[tuple[int, int], list[float]] = {}  # (batch bucket, span) -> [mean step seconds, steps]
        self._choice: StepChoice | None = None
        self._timed: StepChoice | None = None  # the step record() saw, timed by step_done() after its commit
        self._spans = spec.span_variants
        self.chain_ok: Callable[[], bool] = lambda: False  # whether one-token rounds can chain (the engine's ahead)
        self.clock: Callable[[], float] = time.perf_counter  # seconds (benchmarks/policy_sim.py: a simulated one)
        self.chain_walls: dict[int, list[float]] = {}  # batch bucket -> [mean chained one-token round s, steps]
        self.chain_frac = 1.0  # running share of the one-token rounds after a one-token round that ran chained
        self._last_span = 0  # span of the last timed step
        self._budget: dict[int, float] = {}  # exploration budget per batch bucket, seconds
        self._since = 0  # decisions since the last exploration
        self._explore_left = 0  # one-token rounds an exploration run still holds
        self._held = 0  # the span of the last step (1 for a gated or no_ready round too)
        self._explore_bk = 0  # the batch bucket an exploration run of span 1 belongs to
        self._recent: dict[tuple, deque[float]] = {}  # (chained, key) -> the last WINDOW measured step times
        self._end = 0.0  # perf_counter after the last commit
        self._busy = False  # requests were left running at it (the next step follows at once)
        self.on_record: Callable[[StepChoice], None] | None = None  # sees every recorded choice (benchmarks/load.py)

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
        undo = (self._decisions, self._since, dict(self._budget), self._explore_left, self._held, self._explore_bk) \
            if self.auto else None
        if not ready:
            d, reason = 0, "no_ready"
        elif spec.gate and len(running) > spec.gate:
            d, reason = 0, "gate"
        elif self.auto:
            prefill = any(r.in_prefill for r in running)
            d, reason, expected = self._best(n_decode, [rem for _, rem in ready], prefill)
        else:
            d, reason = spec.fixed_drafts, "fixed"
        if self.auto and reason in ("no_ready", "gate"):  # a one-token round the policy did not choose: it is in
            self._held, self._explore_left = 1, 0  # (or starts) a chain, and no exploration run outlives it
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
                                  self.start_time(), undo=undo)
        return ks, states

    @property
    def last_end(self) -> float:
        """The time `step_done` stamped on the last committed step (engine/ahead.py times a chained step from it)."""
        return self._end

    def start_time(self) -> float:
        """Where a step's measured time starts: the previous step's commit when the engine was busy since (a
        step follows the one before at once: the loop's work between them is part of what each step costs),
        else now (after an idle spell)."""
        return self._end if self._busy else self.clock()

    def _best(self, b: int, remaining: list[int], prefill: bool = False) -> tuple[int, str, dict[int, float]]:
        """The span of this step (drafts = span - 1), why, and each span's expected tokens / s. `prefill`: the
        step carries a prefill chunk (not timed: an exploration run of span 1 ends there)."""
        assert self.costs is not None
        n_ready = len(remaining)
        others = b - n_ready
        exp = self.acceptance.expected_all()
        top = len(exp) - 1
        hist = [0] * (top + 1)  # ready requests by the drafts they can take (capped at K)
        for rem in remaining:
            hist[rem - 1 if rem - 1 < top else top] += 1
        rate: dict[int, float] = {}
        secs: dict[int, float] = {}  # the step time each span is ranked by
        tokens: dict[int, float] = {}
        draft = self.costs.draft(n_ready)
        bk = _bucket(b)
        chain = self.online and self.chain_ok()
        alone1 = self._step_seconds(bk, b, 1, 0.0, False)
        # the unchained round that restarts a chain of one-token rounds after a speculative step
        restart = max(0.0, alone1 - self._step_seconds(bk, b, 1, 0.0, True)) if chain else 0.0
        # leaving a chain is paid once per switch: charged to a speculative step spread over the HOLD steps a
        # switch is worth
        hold = restart / HOLD if self._held == 1 else 0.0
        for s in self._spans:
            d = s - 1 if s - 1 < top else top
            tokens[s] = others + sum(hist[x] * exp[x] for x in range(d)) + sum(hist[d:]) * exp[d]
            t = self._step_seconds(bk, b, s, draft if d else 0.0, chain) + (hold if s > 1 else 0.0)
            secs[s] = t
            rate[s] = tokens[s] / t if t > 0 else 0.0
        pool = rate
        if self.acceptance.off[0] < EVIDENCE and len(rate) > 1:  # no acceptance seen yet: gating would learn none
            pool = {s: r for s, r in rate.items() if s > 1}
        best = max(pool, key=lambda s: (pool[s], -s))
        self._decisions += 1
        if self._explore_left > 0 and 1 in rate and chain and bk == self._explore_bk and not prefill:
            self._explore_left -= 1  # an exploration run of one-token rounds goes on (same bucket, chaining)
            self._held = 1
            return 0, "explore", rate
        self._explore_left = 0
        budget = self._budget.get(bk, 0.0) + EXPLORE_SHARE * secs[best]
        self._budget[bk] = budget
        self._since += 1
        alt = 0
        if self._since >= EXPLORE and len(rate) > 1 and rate[best] > 0:
            others_s = [s for s in rate if s != best]
            seen = {s: (self.walls.get((bk, s)) or [0.0, 0])[1] for s in others_s}
            if chain and 1 in seen:
                seen[1] = int((self.chain_walls.get(bk) or [0.0, 0])[1])
            # a span never run at this bucket first; else the runner-up (the one that could take over, and the
            # cheapest to check: the least observed one was often a span nobody would pick, spending the budget),
            # and only when its expected rate is within EXPLORE_GAP of the best's: a measured span far behind
            # would need its acceptance or its step time to move by that much before it could win, and each
            # exploration desynchronises a batch that runs in step (see the module docstring)
            unseen = [s for s in others_s if seen[s] == 0]
            near = [s for s in others_s if rate[s] >= (1.0 - EXPLORE_GAP) * rate[best]]
            pick = unseen or near
            alt = max(pick, key=lambda s: rate[s]) if pick else 0
        if alt:
            run = EXPLORE_RUN if alt == 1 and chain and not prefill else 1
            # the time the exploration loses: what its steps take minus what the best span takes for the same
            # tokens. Out of a chain of one-token rounds (best span 1), a speculative step also costs the round
            # that restarts the chain; a run of span 1 from a speculative best starts with an unchained round.
            same = tokens[alt] / rate[best]
            if alt == 1:
                rounds = [alone1] + [secs[1]] * (run - 1)
                regret = sum(max(0.0, t - same) for t in rounds)
            else:
                regret = max(0.0, secs[alt] - hold - same) + (restart if best == 1 else 0.0)
            if budget >= regret:
                self._budget[bk] = budget - regret
                self._since = 0
                self._explore_left, self._explore_bk = run - 1, bk
                self._held = alt
                return alt - 1, "explore", rate
        self._held = best
        return best - 1, "policy", rate

    def _step_seconds(self, bk: int, b: int, s: int, draft: float, chain: bool) -> float:
        """What a step of span s costs at b decode-phase requests (batch bucket bk): measured, else modelled."""
        assert self.costs is not None
        w = self.walls.get((bk, s)) if self.online else None
        alone = w[0] if w is not None and w[1] >= MIN_OBS else self.costs.verify(b, s) + draft + self.overhead
        if s != 1 or not chain:
            return alone
        cw = self.chain_walls.get(bk)
        chained = cw[0] if cw is not None and cw[1] >= MIN_OBS else self.costs.verify(b, 1)
        return self.chain_frac * chained + (1.0 - self.chain_frac) * alone

    def detach(self) -> StepChoice | None:
        """Take the current choice away (a step launched ahead keeps its own until its commit: `attach`)."""
        c, self._choice = self._choice, None
        return c

    def attach(self, choice: StepChoice | None) -> None:
        """Make `choice` (from `detach`) the one the next `record` completes."""
        self._choice = choice

    def forget(self, choice: StepChoice | None) -> None:
        """`choice` (from `detach`) is never run (engine/ahead.py: a stashed decision whose batch changed, a step
        whose every row was dropped): a policy decision it made is undone (its count and the exploration state,
        as they were before it; no decision is made between one and its forgetting), so the exploration cadence
        stays the off switch's."""
        if choice is not None and choice.undo is not None:
            self._decisions, self._since, self._budget, self._explore_left, self._held, self._explore_bk = choice.undo

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
        c.mixed = any(sp.kind == "prefill" for sp in plan.spans)  # carries a prefill chunk: not timed
        # timed: the steps whose span the policy chose ("no_ready": nobody could draft, a new wave's prefill-mixed
        # steps at ~25 ms on the H200 at c64, says nothing of what a one-token round costs), without a prefill chunk
        # (its cost is the chunk's, whatever the span; see the module docstring)
        self._timed = c if self.auto and c.running and c.reason in ("policy", "explore") and not c.mixed else None
        if self._timed is None:
            self._last_span = 0  # the round after this one restarts a chain: it is no evidence against chaining
        if self.on_record is not None:
            self.on_record(c)

    def step_done(self, busy: bool = True) -> float:
        """After a step's commit (`busy`: requests are left running, so the next step follows at once): the
        step's wall time, from `start_time()` through its commit, into the host overhead and the measured step
        times. The commit is inside it (the drafter's context advance, the page bookkeeping, the outputs): it
        costs about the same per step whatever the span, so leaving it out made every step look cheaper by the
        same amount and favoured the short spans that take more steps per token. Returns the time it stamped as
        the step's end."""
        now = self.clock()
        c, self._timed = self._timed, None
        if c is not None:
            assert self.costs is not None
            model = self.costs.verify(c.running, c.span) + (self.costs.draft(c.ready) if c.span > 1 else 0.0)
            wall = now - c.t0
            bk = _bucket(c.running)
            if c.span == 1 and self._last_span == 1:  # it could have chained (the first of a run never can)
                self.chain_frac = 0.9 * self.chain_frac + 0.1 * (1.0 if c.chained else 0.0)
            self._last_span = c.span
            if not (c.chained or c.mixed):  # hidden host work, or a prefill chunk's: neither is the overhead
                # the median of the recent extras: a cold first step (hundreds of ms at start on the H200) in a
                # running mean that only unchained steps move priced every unmeasured span that much higher for
                # hundreds of steps (the policy then held one-token rounds at c16 where span 16 ran 1.30x faster)
                self._extras.append(max(0.0, wall - model))
                self.overhead = statistics.median(self._extras)
            if self.online:
                table: dict = self.chain_walls if c.chained else self.walls
                key = bk if c.chained else (bk, c.span)
                recent = self._recent.setdefault((c.chained, key), deque(maxlen=WINDOW))
                recent.append(wall)
                w = table.setdefault(key, [wall, 0])
                w[0] = statistics.median(recent)  # one stall (a collection, a late capture) moves no median
                w[1] += 1
        self._end, self._busy = now, busy
        return now

    def describe(self) -> dict:
        return {"gate": self.spec.gate, "trim": self.spec.trim, "policy": self.spec.policy,
                "span_variants": list(self.spec.span_variants),
                "acceptance": [round(c, 4) for c in self.acceptance.conditional()],
                "overhead_ms": round(self.overhead * 1e3, 4), "online": self.online,
                "measured_ms": {f"b{b}s{s}": [round(w[0] * 1e3, 4), int(w[1])] for (b, s), w in sorted(self.walls.items())},
                "chained_ms": {f"b{b}s1": [round(w[0] * 1e3, 4), int(w[1])] for b, w in sorted(self.chain_walls.items())},
                "chain_frac": round(self.chain_frac, 4),
                "costs": self.costs.describe() if self.costs is not None else None}


def _bucket(b: int) -> int:
    """The power of two >= b: the batch bucket measured step times are kept under."""
    return 1 << max(0, int(b) - 1).bit_length()
