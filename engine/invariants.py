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
   num_computed (before a request's first chunk both are 0). A prefix hit starts both at the hit's end
   when its blocks carry the drafter's capture; a capture miss has no context (`context` None: exempt).
4. Prefix cache (engine/prefix_cache.py), when on. Refcounts: every owned page's refcount is the number of
   page tables holding it, no table holds a page twice, a page is in two tables only when registered,
   and no refcount names a page no table holds (nothing freed while referenced, nothing lost). Cached,
   unreferenced pages (evictable) are registered, neither free nor owned, and count in the partition:
   free + evictable + distinct owned == num_pages. A request's registered pages are the blocks its own
   token prefix keys (a hit on another prefix's page would read the wrong KV). Every block registered
   since the last check was sealed at a committed length covering it (`sealed_at >= block end`: no block
   registered before all its rows were forwarded, the register_before_forward fault).

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
        if pool.prefix is not None:
            pool.prefix.recent = []  # the index lists its new registrations for `_prefix`

    def check(self, step: int, ahead: dict[str, int] | None = None) -> None:
        """ahead[rid]: positions past the committed length that a decode step in flight writes (engine/ahead.py):
        their pages are owned on purpose (every other relation is unchanged)."""
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
            held = ahead.get(rid, 0) if ahead else 0
            need = pages_for(req.num_computed + held, ps)
            if len(table) != need:
                raise InvariantError(step, rid, f"owns {len(table)} pages where its committed length needs {need}",
                                     pages=len(table), needed=need, num_computed=req.num_computed, page_size=ps,
                                     outstanding_reservation=held)
        stray = [rid for rid in owned if rid not in running]
        if stray:
            rid = stray[0]
            raise InvariantError(step, rid, "holds pages but is not running (finished, aborted or never admitted)",
                                 pages=len(owned[rid]), stray_requests=len(stray))
        self._partition(step, owned)
        if pool.prefix is not None:
            self._prefix(step, owned)
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
        parked = pool.evictable()
        shared = pool.prefix.blocks if pool.prefix is not None else {}
        for rid, table in owned.items():
            in_table: set[int] = set()
            for p in table:
                if p in in_table:
                    raise InvariantError(step, rid, f"holds page {p} twice in its page table", page=p)
                in_table.add(p)
                if p in seen and p not in shared:
                    raise InvariantError(step, rid, f"owns page {p}, which {seen[p]!r} owns too", page=p,
                                         other=seen[p])
                seen.setdefault(p, rid)
                if p in free_set:
                    raise InvariantError(step, rid, f"owns page {p}, which is on the free list too", page=p)
                if p in parked:
                    raise InvariantError(step, rid, f"owns page {p}, which the prefix cache holds as unreferenced "
                                         "(evictable) too", page=p)
                if not 0 <= p < n:
                    raise InvariantError(step, rid, f"owns page {p}, outside the pool of {n}", page=p, num_pages=n)
        small, large = (parked, free_set) if len(parked) <= len(free_set) else (free_set, parked)
        both = [p for p in small if p in large]
        if both:
            raise InvariantError(step, None, "has pages both free and cached (evictable)", pages=_few(both))
        if len(seen) + len(free_set) + len(parked) == n:
            return  # distinct, disjoint, in range (owned) and n in all: a partition unless the free list
            # holds ids outside the pool, which only a page table could have put there (checked above)
        outside = [p for p in free_set if not 0 <= p < n]
        if outside:
            raise InvariantError(step, None, "has pages outside the pool on its free list", pages=_few(outside),
                                 num_pages=n)
        lost = set(range(n)) - free_set - seen.keys() - set(parked)
        by: dict[str, list[int]] = {}
        for p in sorted(lost):
            by.setdefault(pool.last_owner(p) or "?", []).append(p)
        first = next((r for r in sorted(by) if r != "?"), None)  # the first request that lost pages
        mine = by[first] if first is not None else sorted(lost)
        raise InvariantError(step, first, f"lost {len(mine)} page(s): neither free nor owned", lost=_few(mine),
                             lost_in_all=len(lost), last_owners=sorted(by), free=len(free_set), owned=len(seen),
                             evictable=len(parked), num_pages=n)

    def _prefix(self, step: int, owned: dict[str, list[int]]) -> None:
        """Invariant 4: refcounts, evictable pages, keys of shared pages, new registrations sealed. O(owned
        pages + evictable pages + registrations since the last check)."""
        pool = self.pool
        index = pool.prefix
        assert index is not None
        ps, refs = pool.page_size, pool.refs()
        count: dict[int, int] = {}
        for rid, table in owned.items():
            keys = pool.entry_keys(rid)
            for i, p in enumerate(table):
                count[p] = count.get(p, 0) + 1
                b = index.blocks.get(p)
                if b is not None and i < len(keys) and b.key != keys[i]:
                    raise InvariantError(step, rid, f"holds cached page {p} as its block {i}, but the page caches "
                                         f"another prefix's block {b.index}", page=p, block=i)
        for p, c in count.items():
            if refs.get(p) != c:
                raise InvariantError(step, pool.last_owner(p), f"page {p} has refcount {refs.get(p)} but "
                                     f"{c} page table(s) hold it", page=p, refcount=refs.get(p), holders=c)
        stale = [p for p in refs if p not in count]
        if stale:
            p = stale[0]
            raise InvariantError(step, pool.last_owner(p), f"page {p} has refcount {refs[p]} but no page table "
                                 "holds it", page=p, refcount=refs[p], pages=_few(stale))
        for p in pool.evictable():
            if p not in index.blocks:
                raise InvariantError(step, pool.last_owner(p), f"page {p} is evictable but not a cached block",
                                     page=p)
        recent, index.recent = index.recent or [], []
        for p in recent:
            b = index.blocks.get(p)
            if b is not None and b.sealed_at < (b.index + 1) * ps:
                raise InvariantError(step, pool.last_owner(p), f"registered page {p} as block {b.index} (positions "
                                     f"{b.index * ps}..{(b.index + 1) * ps - 1}) at committed length {b.sealed_at}: "
                                     "a row of it had not been forwarded", page=p, block=b.index,
                                     sealed_at=b.sealed_at, page_size=ps)

    def _draft_context(self, step: int, running: dict[str, Request]) -> None:
        assert self.proposer is not None
        for rid, req in running.items():
            if not self.spec.can_speculate(req.params):
                continue
            ctx = self.proposer.context(rid)
            if ctx is None:
                continue  # no per-position context (n-gram, oracle; a prefix hit without its capture)
            tracked, end = ctx
            if tracked != req.num_computed or end != req.num_computed:
                raise InvariantError(step, rid, f"has drafter context rows to {end} (tracked {tracked}) where its "
                                     f"committed length is {req.num_computed}", drafter_context=tracked, rows_end=end,
                                     num_computed=req.num_computed)

