"""The commit phase: what a step's accept results change in the KV pool, the drafter, requests and counters.

Contract, per span in plan order: the spec counters record a verify span's (K, accepted); the request's
committed length becomes start + committed and the pages wholly past it return to the pool (the rollback
of the rejected speculative tail); the new tokens are appended with stop handling (output.py), so a stop
inside an accepted run ends the request there; a finished request leaves the scheduler and frees its
pages. Before that loop the proposer appends the committed rows to its context (their K/V already written
by the captured step with EngineConfig.graph_context, else projected now): after m accepted drafts
exactly m + 1 rows (anchor + accepted drafts); the bonus token has no features yet and becomes the next
anchor. After each span's commit the request's full blocks inside its committed length are sealed into the
prefix cache (engine/prefix_share.py), finished requests included, before their pages are freed (publish on
finish: a retired request's last blocks reach the cache with their drafter capture); with a drafter and a
prefix cache the proposer observes every request's rows, speculating or not, so each sealed block carries its
capture. The armed faults' knobs for the step come from one `Faults.on_commit` call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .accept_step import SpanResult
from .faults import CommitKnobs, Faults
from .kv_cache import PagePool
from .metrics import EngineMetrics
from .output import OutputWriter, RequestOutput
from .prefix_share import PrefixSharing
from .request import Request
from .scheduler import Scheduler, Span, StepPlan
from .spec.plan import SpecPlan
from .spec.proposer import Proposer


class CommitStep:
    def __init__(self, pool: PagePool, scheduler: Scheduler, proposer: Proposer | None, spec: SpecPlan,
                 metrics: EngineMetrics, output: OutputWriter, faults: Faults,
                 release: Callable[[Request], None], prefix: PrefixSharing | None = None) -> None:
        """release: frees a finished request's pages, proposer state and generator (the engine's); prefix: seals
        committed blocks into the prefix cache (None: off)."""
        self.pool, self.scheduler, self.proposer, self.spec = pool, scheduler, proposer, spec
        self.metrics, self.output, self.faults, self.release = metrics, output, faults, release
        self.prefix = prefix

    def commit(self, plan: StepPlan, results: list[SpanResult], taps: torch.Tensor | None,
               finished_only: bool = False, ahead: dict[str, int] | None = None) -> list[RequestOutput]:
        """The outputs of the requests that got new tokens or finished this step (finished_only: of those that
        finished; nothing is built for the others). ahead[rid]: positions past the new committed length that a
        decode step already in flight writes (engine/ahead.py): their pages stay in the table."""
        spans = plan.spans
        knobs = self.faults.on_commit(spans)
        # With a prefix cache the drafter's context rows are written for every request, speculating or not
        # (logprobs, prompt scoring), so every block a request seals carries its capture for later hits.
        capture = self.prefix is not None and self.prefix.enabled and self.prefix.drafter
        if self.proposer is not None:
            self.proposer.observe(spans, [r.committed for r in results], taps,
                                  [capture or self.spec.can_speculate(s.req.params) for s in spans],
                                  ctx_shift=knobs.draft_shift)
        outs = []
        for i, (s, r) in enumerate(zip(spans, results, strict=True)):
            out = self._commit_span(s, r, knobs, i, finished_only, ahead.get(s.req.rid, 0) if ahead else 0)
            if out is not None:
                outs.append(out)
        self.metrics.num_running = len(self.scheduler.running)
        self.metrics.num_waiting = len(self.scheduler.waiting)
        self.metrics.kv_usage = 1.0 - self.pool.num_free / self.pool.num_pages
        return outs

    def _commit_span(self, s: Span, r: SpanResult, knobs: CommitKnobs, i: int,
                     finished_only: bool = False, ahead: int = 0) -> RequestOutput | None:
        req = s.req
        if r.accepted is not None:
            self.metrics.record_verify(r.drafts, r.accepted)
            req.spec.record(r.drafts, r.accepted, at=len(req.output_ids))
        req.num_computed = s.start + r.committed
        self.pool.commit(req.rid, req.num_computed, leak=knobs.leak(i), keep_extra=knobs.kept(i), ahead=ahead)
        if s.kind == "prefill":
            self.metrics.prompt_tokens += r.committed
        n0 = len(req.output_ids)
        if r.tokens:
            self.output.append(req, r.tokens, r.logprobs, knobs.emit_past_stop, knobs.stop_ids_at_end,
                               knobs.stop_strings_at_end, knobs.eos_ignored_at_end_only)
        # new_ids = what this step appended: a stop inside the run drops the tokens after it (not r.tokens)
        emit = req.finished or (bool(r.tokens) and not finished_only)
        out = self.output.build(req, req.output_ids[n0:]) if emit else None
        if self.prefix is not None:
            self.prefix.seal(req, ahead=knobs.seal_ahead, publish=knobs.publish_on_finish or not req.finished)
        if req.finished:
            self.scheduler.finish(req)
            self.release(req)
            self.metrics.requests_finished += 1
        return out
