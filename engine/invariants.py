"""Run-time invariants of the engine's bookkeeping, checked after every step (`EngineConfig.check_invariants`).

The KV-leak check of the gates reads the pool only when the engine is idle, after a leak has been freed
with its request; these checks run after the commit of every step, while requests are in flight, and
raise `InvariantError` naming the step, the request and the numbers. After the commit no speculative
reservation is outstanding: the verify span [anchor, d1..dK] and the drafter's block scratch are
reserved by the propose / forward phases and rolled back by the commit, so the exact relations are:

1. Pages per request. Every running request has a page table and its committed length is the
   request's: `pool.length(rid) == req.num_computed`, and it owns exactly
   `pages_for(num_computed, page_size)` pages (the reservation past it went back at the rollback).
   Every table belongs to a running request (a finished or aborted request holds none).
2. The pool is partitioned. The free list and the page tables together hold every page id
   0..num_pages-1 exactly once: no page both free and owned, none owned twice, none on the free list
   twice, none lost (neither free nor owned: named with the request it was last handed to), none out of
   range (the runner's dummy page is never in a table). Read through the pool's free set (kept beside
   the free list by every mutation: a page on the list twice makes their sizes differ), so a check costs
   O(owned pages), not O(num_pages).
3. Draft-seed alignment. For a request the proposer keeps per-position context for (the DFlash
   drafter's K/V rows; `Proposer.context`, None for n-gram / oracle) and that may speculate
   (`SpecPlan.can_speculate`): the drafter's rows cover exactly the committed positions
   [0, num_computed). A verify step from `start` that accepted m drafts committed m + 1 tokens
   (`num_computed = start + m + 1`) and appended exactly m + 1 rows (the anchor and the m accepted
   drafts, at positions start..start+m); the bonus token, the next anchor at position num_computed, has
   no features yet. A prefill chunk appends one row per prompt token. So after every step both the
   drafter's tracked context length and the end of the positions its last rows were written at equal
   num_computed (before a request's first chunk both are 0).

Cost, measured on CPU (bundled tiny pair, DFlash, fp32, 2 threads; `python -m
specbench.benchmarks.invariants_cost`): inside a generate of 8 requests x 64 tokens (7.5 ms steps) the
checks took 0.33% (256-page pool) and 0.39% (2,048 pages) of the wall time, a ratio of 1.004; one check
with 8 requests running takes 11 us whatever the pool size: the pool keeps its free pages as a set beside
the free list, so the check reads the owned pages only (a bare pool of 10^6 pages with 64 requests of
1,024 tokens, 4,096 owned pages: 0.68 ms per check). Off by default; on in the tests (tests/conftest.py
sets SPECBENCH_INVARIANTS=1) and in gate runs (the lossless, selftest and sampled commands run local
engines with `invariants=1`, harness/engines.py `gate_specs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .kv_cache import PagePool, pages_for

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import Scheduler
    from .spec.plan import SpecPlan
    from .spec.proposer import Proposer


class InvariantError(RuntimeError):
    """A run-time invariant broke: `step`, `rid` (None for the pool as a whole), `what`, and the numbers."""

    def __init__(self, step: int, rid: str | None, what: str, **numbers: object) -> None:
        self.step, self.rid, self.what, self.numbers = step, rid, what, numbers
        who = f"request {rid!r}" if rid is not None else "the page pool"
        nums = ", ".join(f"{k}={v}" for k, v in numbers.items())
        super().__init__(f"step {step}: {who} {what}" + (f" ({nums})" if nums else ""))


def _few(pages: list[int] | set[int], n: int = 8) -> list[int]:
    return sorted(pages)[:n]


class InvariantChecker:
    """Checks the three invariants of the module docstring over the engine's parts (read-only)."""

    def __init__(self, pool: PagePool, scheduler: Scheduler, proposer: Proposer | None, spec: SpecPlan) -> None:
        self.pool, self.scheduler, self.proposer, self.spec = pool, scheduler, proposer, spec

    def check(self, step: int) -> None:
        pool, ps = self.pool, self.pool.page_size
        owned = pool.owned()
        running = {r.rid: r for r in self.scheduler.running}
        for rid, req in running.items():
            if rid not in owned:
                raise InvariantError(step, rid, "is running without a page table",
                                     num_computed=req.num_computed)
            table, length = owned[rid], pool.length(rid)
            if length != req.num_computed:
                raise InvariantError(step, rid, "has a pool length that is not its committed length",
                                     pool_length=length, num_computed=req.num_computed)
            need = pages_for(req.num_computed, ps)
            if len(table) != need:
                raise InvariantError(step, rid, f"owns {len(table)} pages where its committed length needs {need}",
                                     pages=len(table), needed=need, num_computed=req.num_computed, page_size=ps,
                                     outstanding_reservation=0)
        stray = [rid for rid in owned if rid not in running]
        if stray:
            rid = stray[0]
            raise InvariantError(step, rid, "holds pages but is not running (finished, aborted or never admitted)",
                                 pages=len(owned[rid]), stray_requests=len(stray))
        self._partition(step, owned)
        if self.proposer is not None:
            self._draft_context(step, running)

    def _partition(self, step: int, owned: dict[str, list[int]]) -> None:
        """O(owned pages), not O(num_pages): the pool keeps its free pages as a set beside the list; the
        whole pool is read only to name what broke."""
        pool, n = self.pool, self.pool.num_pages
        free, free_set = pool.free_pages(), pool.free_set()
        if len(free_set) != len(free):
            extra = sorted({p for p in free if free.count(p) > 1} or (set(free) ^ free_set))
            raise InvariantError(step, None, "has pages on its free list twice", pages=_few(extra), free=len(free),
                                 distinct=len(free_set))
        seen: dict[int, str] = {}
        for rid, table in owned.items():
            for p in table:
                if p in seen:
                    raise InvariantError(step, rid, f"owns page {p}, which {seen[p]!r} owns too", page=p,
                                         other=seen[p])
                seen[p] = rid
                if p in free_set:
                    raise InvariantError(step, rid, f"owns page {p}, which is on the free list too", page=p)
                if not 0 <= p < n:
                    raise InvariantError(step, rid, f"owns page {p}, outside the pool of {n}", page=p, num_pages=n)
        if len(seen) + len(free_set) == n:
            return  # distinct, disjoint, in range (owned) and n in all: a partition unless the free list
            # holds ids outside the pool, which only a page table could have put there (checked above)
        outside = [p for p in free_set if not 0 <= p < n]
        if outside:
            raise InvariantError(step, None, "has pages outside the pool on its free list", pages=_few(outside),
                                 num_pages=n)
        lost = set(range(n)) - free_set - seen.keys()
        by: dict[str, list[int]] = {}
        for p in sorted(lost):
            by.setdefault(pool.last_owner(p) or "?", []).append(p)
        first = next((r for r in sorted(by) if r != "?"), None)  # the first request that lost pages
        mine = by[first] if first is not None else sorted(lost)
        raise InvariantError(step, first, f"lost {len(mine)} page(s): neither free nor owned", lost=_few(mine),
                             lost_in_all=len(lost), last_owners=sorted(by), free=len(free_set), owned=len(seen),
                             num_pages=n)

    def _draft_context(self, step: int, running: dict[str, Request]) -> None:
        assert self.proposer is not None
        for rid, req in running.items():
            if not self.spec.can_speculate(req.params):
                continue
            ctx = self.proposer.context(rid)
            if ctx is None:
                return  # this proposer keeps no per-position context for any request
            tracked, end = ctx
            if tracked != req.num_computed or end != req.num_computed:
                raise InvariantError(step, rid, f"has drafter context rows to {end} (tracked {tracked}) where its "
                                     f"committed length is {req.num_computed}", drafter_context=tracked, rows_end=end,
                                     num_computed=req.num_computed)

