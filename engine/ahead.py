"""Decode one step ahead: the host builds and launches plain-decode step n+1 while the GPU runs step n.

Without it every step ends on a host read (the sampled tokens), and the GPU idles while the host commits
them, schedules the next step, fills its metadata and launches it (about 0.4 ms a step at one stream, over
1 ms at 64, on the H200). With it (EngineConfig.decode_ahead, on by default; SPECBENCH_DECODE_AHEAD=0 off):

- A step the scheduler planned as plain decode (every span one decode token, see `DecodeAhead.eligible`) is
  launched through the decode graphs with no host read: its tokens are drawn on the device (the argmax, or
  the request's transform and one uniform from its own generator, as the accept phase draws them), copied to
  pinned host memory asynchronously, and an event marks the copy.
- Before that step is read, the next one is built from it: the same requests, each one position further,
  less those it finishes by length (their max_tokens is reached). Its input tokens are the older step's
  device tokens (a gather, no host round trip), its positions, slots and attention metadata come from the
  host as always, through pinned buffers and stream-ordered copies. Only then does the host wait for the
  older step's event and commit its tokens (accept phase results of one token each, the commit phase as
  in a normal step); the step() call returns the older step's outputs, so each call still returns one
  step's outputs, one step late.
- A request the older step finishes on EOS, a stop token or a stop string, or that is aborted meanwhile,
  has a row in the newer step whose token is dropped at its commit. That row wrote its K/V at the request's
  committed length: past every sealed block, on a page the request still holds or has given back, and every
  later write to a page given back is queued after it on the same stream.
- While a step is ahead, the commit of the older one keeps the page the newer one writes (`ahead` of
  CommitStep.commit / PagePool.commit), and the run-time invariants count that one position
  (InvariantChecker.check's `ahead`).
- Gated rounds (EngineConfig.gated_ahead, issue 20): with speculation on, a step in which the span policy holds
  every decode-phase request to one token (the gate, or the automatic policy's span 1) is a plain decode whose
  tapped rows also enter the drafter's context. It chains like plain decode through the decode graphs of the
  drafter's tap set, which write each row's context inside the step (EngineConfig.graph_context), so its
  commit only moves the context lengths, as a normal gated round's does. The policy chooses the chained step
  before the step in flight is committed (`SpanPolicy.choose(..., ahead=1)`: every request one token
  further; those the older step finishes by length left out); each launched step keeps its choice until its
  own commit records it (trace, gated-round metrics, measured step times). When the policy wants to
  speculate on the next step the chain ends there and that choice is kept for the next step() (`take_choice`),
  so no decision is made twice (the exploration cadence stays the same); a kept choice whose batch changed
  before that step (an abort, a stop at the older step's commit) is forgotten (`SpanPolicy.forget`) and the step
  decides afresh. A chained step's measured time runs from the older step's commit (its decision is made before
  it), so the chain's step times do not overlap. A step left in flight whose every row's request has gone (the
  last ones ended on a stop, or were aborted) is not a step of the policy's: the next step() drains it (`dead`)
  and schedules as the off switch does, with no trace entry, span count or step time for it. The one difference
  from the off switch: a request the older step finishes on a stop (unknown until its commit) still counts
  toward the chained step's gate, so a batch that a stop shrinks to the gate speculates one step later.
- Anything else ends the chain: a waiting request that could be admitted, a request in prefill, speculation,
  logprobs, top-p (its transform reads the host), armed faults, synthetic acceptance without a proposer (with
  one it only draws for verify spans, which a chain never holds), an attention backend whose plan is not
  stream-ordered (FlashInfer's own decode plan: `ahead_safe`), more requests than the largest decode bucket.
  The step in flight is then committed first, and the next step runs as before.

The ahead path changes when a token is read, never which token: the same graphs, the same sampling ops on
the same rows, each generator drawn once per decode step in the same order (tests/test_decode_ahead.py
checks it token for token against the off switch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .accept_step import SpanResult
from .output import RequestOutput
from .sampler import draw_one_each
from .scheduler import Span, StepPlan

if TYPE_CHECKING:  # the engine builds this with itself
    from .engine import LLMEngine
    from .graphs import DecodeGraphs
    from .spec.policy import StepChoice

PLACEHOLDER = -1  # a span's token while the step before it is still on the device


@dataclass
class InFlight:
    """A launched decode step: its spans, its tokens on the device and (after the copy) in host memory."""

    spans: list[Span]
    tokens: torch.Tensor  # int64 [len(spans)], on the device
    host: torch.Tensor  # int64 [len(spans)], pinned on CUDA; valid once `event` has completed
    event: torch.cuda.Event | None  # None off CUDA (the copy has already happened)
    # the drafter's tapped rows (a view of the graph's buffer, overwritten by the next replay): only a marker that
    # the step had taps, for the commit (the step wrote their context rows itself); None without a drafter
    taps: torch.Tensor | None = None
    choice: StepChoice | None = None  # the span policy's choice for this step (with a proposer), recorded at commit


class DecodeAhead:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self.cuda = engine.device.type == "cuda"
        self.enabled = engine.cfg.decode_ahead  # a benchmark may flip it between steps (A/B in one engine)
        self.gated = engine.cfg.gated_ahead  # gated rounds too, with a proposer (likewise flippable)
        # the policy's choice for the step after a chain that ended because the policy speculates there:
        # (drafts, states, choice), taken by the engine's next step() instead of choosing again
        self.stashed: tuple[dict[str, int], dict[str, str], StepChoice | None] | None = None

    # ---- when ----------------------------------------------------------------------------------
    def usable(self) -> bool:
        """The engine-wide conditions (they do not change between steps, except a benchmark's swaps)."""
        e = self.engine
        if not (self.enabled and not e.faults.names and e.runner.use_graph_runner
                and getattr(e.runner.backend, "ahead_safe", False)):
            return False
        if e.proposer is None:
            return e.synthetic is None
        # gated rounds: a drafter with tapped features needs its context written inside the decode step
        return self.gated and (not e.proposer.tap_layers or e.runner.context_writer is not None)

    def _graphs(self) -> DecodeGraphs:
        """The decode graphs of the proposer's tap set (its context writer inside), or the plain ones."""
        e = self.engine
        return e.runner.decode_graphs(tuple(e.proposer.tap_layers) if e.proposer is not None else ())

    def take_choice(self) -> tuple[dict[str, int], dict[str, str]] | None:
        """The policy's choice a chain ended on (drafts, states), made the policy's current one; None if none, or
        if the batch it was made for changed since (a request aborted, or finished on a stop at the older step's
        commit): that decision is forgotten (not counted, as the off switch never made it) and the step decides
        afresh."""
        if self.stashed is None:
            return None
        ks, states, choice = self.stashed
        self.stashed = None
        e = self.engine
        if set(states) != {r.rid for r in e.scheduler.running if not r.in_prefill}:
            e.policy.forget(choice)
            return None
        if choice is not None:
            choice.t0 = e.policy.start_time()  # the step runs from here (its time measured as the off switch's)
        e.policy.attach(choice)
        return ks, states

    def dead(self) -> bool:
        """A step is in flight and none of its rows' requests still runs (each finished at the older step's
        commit, on a stop, or was aborted since): a step the off switch never runs."""
        fl = self.inflight
        reqs = self.engine.requests
        return fl is not None and all(s.req.finished or reqs.get(s.req.rid) is not s.req for s in fl.spans)

    @staticmethod
    def request_ok(req) -> bool:
        p = req.params
        return p.logprobs is None and p.prompt_logprobs is None and (p.greedy or p.top_p >= 1.0) and not p.shaped

    def eligible(self, plan: StepPlan) -> bool:
        """A plan the scheduler made that may start a chain: plain decode of eligible requests that fits the
        decode graphs."""
        spans = plan.spans
        if not spans or not self.usable():
            return False
        if not all(s.kind == "decode" and len(s.tokens) == 1 and self.request_ok(s.req) for s in spans):
            return False
        return self._graphs().can_run(spans)

    def reserved(self) -> dict[str, int]:
        """Positions held past the committed length by the step in flight, per request id (its one row)."""
        return {s.req.rid: 1 for s in self.inflight.spans} if self.inflight is not None else {}

    # ---- the step --------------------------------------------------------------------------------
    def start(self, plan: StepPlan, finished_only: bool) -> list[RequestOutput]:
        """Launch `plan` (eligible), chain the next step when it can be, commit `plan`'s tokens."""
        assert self.inflight is None
        with self.engine.ranges.phase("forward"):
            first = self._launch(plan.spans, None, self.engine.policy.detach())
        return self._advance(first, finished_only)

    def step(self, finished_only: bool) -> list[RequestOutput]:
        """With a step in flight: chain the next one when it can be, then commit the one in flight."""
        prev = self.inflight
        assert prev is not None
        self.inflight = None
        return self._advance(prev, finished_only)

    def drain(self) -> list[RequestOutput]:
        """Commit the step in flight without launching another (its outputs; [] with none in flight)."""
        prev, self.inflight = self.inflight, None
        return self._finish(prev, False) if prev is not None else []

    def _advance(self, prev: InFlight, finished_only: bool) -> list[RequestOutput]:
        with self.engine.ranges.phase("forward"):
            spans, choice = self._next_spans(prev)
            self.inflight = self._launch(spans, prev, choice) if spans else None
        if self.inflight is not None:
            self.engine.metrics.decode_ahead_steps += 1
        return self._finish(prev, finished_only)

    def _next_spans(self, prev: InFlight) -> tuple[list[Span], StepChoice | None]:
        """The decode step after `prev` (not yet committed) and the policy's choice for it (with a proposer), or
        ([], None) when the chain must end here."""
        e = self.engine
        sch = e.scheduler
        if not self.usable() or e._inbox or (sch.waiting and len(sch.running) < e.cfg.max_num_seqs):
            return [], None
        ahead = {id(s.req) for s in prev.spans}
        if any(r.in_prefill or id(r) not in ahead for r in sch.running):
            return [], None  # a request the chain does not know (admitted by a normal step): schedule normally
        spans = []
        for s in prev.spans:
            req = s.req
            # prev commits one token; a request it leaves at max_tokens gets no row (a stop is not known yet)
            if req.finished or len(req.output_ids) + 1 >= req.params.max_tokens:
                continue
            spans.append(Span(req, [PLACEHOLDER], s.start + 1, "decode"))
        if not spans or not self._graphs().can_run(spans):
            return [], None
        if e.proposer is None:
            return spans, None
        # the policy's choice for the step after prev's commit: every request one token further
        ks, states = e.policy.choose([s.req for s in spans], e.proposer, e.step_count + 1, ahead=1)
        choice = e.policy.detach()
        if ks:  # it speculates: the chain ends, and the next step() schedules with this very choice
            self.stashed = (ks, states, choice)
            return [], None
        for s in spans:
            s.state = states.get(s.req.rid, "")
        if choice is not None:
            choice.chained = True  # launched behind prev, still in flight: its host work overlaps prev's
        return spans, choice

    def _launch(self, spans: list[Span], prev: InFlight | None, choice: StepChoice | None = None) -> InFlight:
        """Replay the decode graph of `spans` (input tokens from `prev`'s device tokens when given), draw the
        tokens on the device and start their copy to the host."""
        e = self.engine
        src = None
        if prev is not None:
            src = prev.tokens
            if len(spans) != len(prev.spans):
                where = {id(s.req): i for i, s in enumerate(prev.spans)}
                idx = torch.tensor([where[id(s.req)] for s in spans], dtype=torch.long)
                src = prev.tokens[idx.to(prev.tokens.device, non_blocking=self.cuda)]
        for s in spans:
            e.pool.ensure(s.req.rid, s.start + 1)
        graphs = self._graphs()
        e.runner.last_path = ("decode-graph", len(spans))
        e.runner.context_fused = graphs.context is not None  # the commit's observe only moves the lengths
        logits, taps = graphs.launch(spans, src)
        tokens = self._draw(spans, logits)
        host = torch.empty(len(spans), dtype=torch.long, pin_memory=self.cuda)
        host.copy_(tokens, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return InFlight(spans, tokens, host, event, taps, choice)

    def _draw(self, spans: list[Span], logits: torch.Tensor) -> torch.Tensor:
        """Each span's token on the device, as the accept phase picks it: the argmax for greedy requests; for
        sampled ones the request's transform over its row and an inverse-CDF draw with one uniform from its
        own generator, the sampled rows together in span order."""
        sampled = [i for i, s in enumerate(spans) if not s.req.params.greedy]
        tokens = logits.argmax(-1) if len(sampled) < len(spans) else None
        if sampled:
            dev = logits.device
            idx = None if tokens is None else torch.tensor(sampled, dtype=torch.long).to(dev, non_blocking=self.cuda)
            drawn = draw_one_each(logits if idx is None else logits[idx], [spans[i].req.params for i in sampled],
                                  [self.engine._gens[spans[i].req.rid] for i in sampled])
            if tokens is None:
                tokens = drawn
            else:
                assert idx is not None  # some rows greedy: the sampled ones go into the argmax
                tokens = tokens.index_copy(0, idx, drawn)
        assert tokens is not None
        return tokens

    def _finish(self, fl: InFlight, finished_only: bool) -> list[RequestOutput]:
        """Wait for `fl`'s tokens and commit them (requests finished or aborted since its launch dropped)."""
        e = self.engine
        with e.ranges.phase("accept"):
            if fl.event is not None:
                fl.event.synchronize()
            toks = fl.host.tolist()
            kept: list[Span] = []
            results: list[SpanResult] = []
            for s, t in zip(fl.spans, toks, strict=True):
                req = s.req
                if req.finished or e.requests.get(req.rid) is not req:
                    continue  # finished by the step before (a stop) or aborted: the row's token is not the request's
                if req.num_computed != s.start:
                    raise RuntimeError(f"decode ahead: request {req.rid!r} is at {req.num_computed}, its step "
                                       f"in flight at {s.start}")
                s.tokens = [req.token_at(s.start)]
                kept.append(s)
                results.append(SpanResult(1, [t]))
        plan = StepPlan(kept)
        # the step's policy choice: trace, gated-round metrics, measured step time. Not for a step that commits
        # nothing (every row dropped: the off switch never runs it), whose decision is forgotten. A choice made
        # ahead (before the step in flight was committed) is timed from that commit on, so the measured times of
        # chained steps do not overlap (each covers one step of the chain's period, as the off switch's do).
        record = e.proposer is not None and bool(kept)
        if record:
            if fl.choice is not None:
                fl.choice.t0 = max(fl.choice.t0, e.policy.last_end)
            e.policy.attach(fl.choice)
            e.policy.record(plan, results)
        elif e.proposer is not None:
            e.policy.forget(fl.choice)
        with e.ranges.phase("commit"):
            outs = e.commit_step.commit(plan, results, fl.taps, finished_only, ahead=self.reserved())
        if e.proposer is not None:
            e.policy.step_done(busy=e.has_unfinished())
        return outs
