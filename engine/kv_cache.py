"""Paged KV-cache bookkeeping (CPU only; the tensors live in the runner).

Contract:
- The pool has `num_pages` pages of `page_size` token slots. Each request owns a page table (a list of
  page ids); token position p of a request lives in slot `table[p // page_size] * page_size + p % page_size`.
- Admission promises a request its lifetime budget (prompt + max_tokens + speculative headroom) in pages;
  pages are then allocated lazily as the request grows, so growth of an admitted request never fails.
  `can_admit` counts free pages minus what running requests were promised but have not yet taken.
- Speculation is a transaction: `reserve(rid, n)` grows capacity to cover `length + n` tokens,
  `commit(rid, new_length)` records the accepted length and returns every page past it to the free list
  (the rollback of the rejected tail). A request's pages go back on `free`.
- Prefix caching (`prefix`, a `PrefixIndex`, engine/prefix_cache.py; None = off): a page may sit in several
  page tables at once, only if it is registered (a full, forwarded block); `refs(page)` counts the tables
  holding it. `admit(rid, lifetime, shared)` starts a table with a prefix hit's pages; `seal` registers
  the full blocks inside the committed length; a page whose last holder leaves goes back to the free list,
  or, when registered, stays cached and unreferenced (evictable, LRU) until the pool needs it: `ensure`
  takes free pages first, then evicts the oldest cached one. `num_free` counts free + evictable pages
  (as vLLM's KV usage does), so admission and the idle leak checks treat cached pages as available.
Invariant: free + evictable + distinct owned == num_pages at all times, the three disjoint; a page is in
more than one table only when registered, and its refcount is the number of tables holding it. Checked by
`check()` (at idle) and, after every step when `EngineConfig.check_invariants` is on, by
engine/invariants.py through the read-only views `owned()`, `free_pages()`, `free_set()` (the free pages
as a set, kept beside the list), `evictable()`, `refs()`, `entry_keys()` and `last_owner()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefix_cache import PrefixIndex, chain, salt_key


class KVCacheError(RuntimeError):
    pass


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class _Entry:
    table: list[int]
    length: int  # tokens whose KV is committed
    promised: int  # pages promised at admission
    salt: str | None = None  # prefix-cache salt (vLLM's cache_salt): keys of block 0 derive from it
    keys: list[bytes] = field(default_factory=list)  # chained keys of the request's blocks 0.. (hit + sealed)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix: PrefixIndex | None = None) -> None:
        if num_pages < 1:
            raise KVCacheError(f"num_pages={num_pages} is invalid: expected >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        # The same pages as a set, kept beside the list by every mutation below, so that the run-time
        # invariants (engine/invariants.py) test "free?" per owned page without reading the whole pool.
        self._free_set: set[int] = set(self._free)
        self._reqs: dict[str, _Entry] = {}
        self._last_owner: dict[int, str] = {}  # page -> the request it was last handed to (names a lost page)
        self.prefix = prefix
        self._refs: dict[int, int] = {}  # page -> page tables holding it (every owned page)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a request can take: free, plus cached and unreferenced (evicted on demand)."""
        return len(self._free) + (len(self.prefix.lru) if self.prefix is not None else 0)

    def outstanding_promises(self) -> int:
        return sum(max(0, e.promised - len(e.table)) for e in self._reqs.values())

    def can_admit(self, lifetime_tokens: int, shared: Sequence[int] = ()) -> bool:
        """`shared`: a prefix hit's pages, which the request takes from the cache instead of the free list
        (those that are evictable now stop being available to anyone else)."""
        need = pages_for(lifetime_tokens, self.page_size) - len(shared)
        parked = sum(1 for p in shared if self.prefix is not None and p in self.prefix.lru)
        return need <= self.num_free - parked - self.outstanding_promises()

    def fits_ever(self, lifetime_tokens: int) -> bool:
        return pages_for(lifetime_tokens, self.page_size) <= self.num_pages

    def table(self, rid: str) -> list[int]:
        return self._reqs[rid].table

    def length(self, rid: str) -> int:
        return self._reqs[rid].length

    def capacity(self, rid: str) -> int:
        return len(self._reqs[rid].table) * self.page_size

    def slot(self, rid: str, pos: int) -> int:
        t = self._reqs[rid].table
        return t[pos // self.page_size] * self.page_size + pos % self.page_size

    def slots(self, rid: str, start: int, end: int) -> list[int]:
        t, ps = self._reqs[rid].table, self.page_size
        return [t[p // ps] * ps + p % ps for p in range(start, end)]

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def owned(self) -> dict[str, list[int]]:
        """Each request's page table (the pool's own lists: read, never change them)."""
        return {rid: e.table for rid, e in self._reqs.items()}

    def free_pages(self) -> list[int]:
        """The free list (the pool's own list: read, never change it)."""
        return self._free

    def free_set(self) -> set[int]:
        """The free pages as the set the pool keeps beside the list (read, never change it); a page on the
        list twice makes the two sizes differ."""
        return self._free_set

    def last_owner(self, page: int) -> str | None:
        return self._last_owner.get(page)

    def evictable(self) -> dict[int, None]:
        """Cached, unreferenced pages, oldest first (the index's own dict: read, never change it); empty
        without a prefix cache."""
        return self.prefix.lru if self.prefix is not None else {}

    def refs(self) -> dict[int, int]:
        """page -> the number of page tables holding it (the pool's own dict: read, never change it)."""
        return self._refs

    def entry_keys(self, rid: str) -> list[bytes]:
        """The chained keys of the request's blocks known so far (its hit and its sealed blocks)."""
        return self._reqs[rid].keys

    # ---- prefix cache --------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """The cached pages of the longest registered prefix of `tokens` in full blocks, leaving at least one
        token to compute (the last prompt token's logits come from a forward); [] without a prefix cache."""
        if self.prefix is None or len(tokens) < 2:
            return []
        n = (len(tokens) - 1) // self.page_size
        return self.prefix.match(chain(tokens, self.page_size, n, salt_key(salt)))

    def seal(self, rid: str, tokens: Sequence[int], upto: int, captured_upto: int | None) -> None:
        """Register the request's full blocks inside [0, upto): `tokens` are the request's token ids, `upto`
        its committed length (every row below it forwarded); `captured_upto`: the drafter's valid context
        rows end (None: no drafter, nothing to capture). A block whose key is cached already stays the
        request's own page."""
        if self.prefix is None:
            return
        e = self._reqs[rid]
        n = min(upto, len(tokens)) // self.page_size
        if n <= len(e.keys):
            return
        parent = e.keys[-1] if e.keys else salt_key(e.salt)
        new = chain(tokens, self.page_size, n, parent, start=len(e.keys))
        cap = self.prefix.capacity
        for i, key in enumerate(new, start=len(e.keys)):
            if cap is not None and len(self.prefix) >= cap and self.prefix.lru:  # make room: the oldest cached
                old = self.prefix.oldest()
                assert old is not None
                self.prefix.unregister(old)
                self._free.append(old)
                self._free_set.add(old)
            captured = captured_upto is None or captured_upto >= (i + 1) * self.page_size
            self.prefix.register(e.table[i], key, i, e.length, captured)
        e.keys.extend(new)

    def reset_prefix(self) -> bool:
        """Drop every cached page (back to the free list); False, changing nothing, while a request holds
        one (vLLM's POST /reset_prefix_cache answers the same way)."""
        if self.prefix is None:
            return True
        freed = self.prefix.reset()
        if freed is None:
            return False
        self._free.extend(freed)
        self._free_set.update(freed)
        return True

    def _take(self, rid: str) -> int:
        if self._free:
            page = self._free.pop()
            self._free_set.discard(page)
        else:  # the oldest cached, unreferenced page (can_admit counted it as available)
            assert self.prefix is not None
            page = self.prefix.oldest()  # type: ignore[assignment]
            assert page is not None
            self.prefix.unregister(page)
        self._refs[page] = 1
        self._last_owner[page] = rid
        return page

    def _drop(self, page: int, lose: bool = False) -> None:
        """A table let go of `page`: it goes back to the free list when no table holds it (cached instead
        when registered); `lose`: nowhere (the skip_rollback fault)."""
        n = self._refs.get(page, 0) - 1
        if n > 0:
            self._refs[page] = n
            return
        self._refs.pop(page, None)
        if lose:
            if self.prefix is not None and page in self.prefix:
                self.prefix.unregister(page)
            return
        if self.prefix is not None and page in self.prefix:
            self.prefix.park(page)
            return
        self._free.append(page)
        self._free_set.add(page)

    # ---- mutations -----------------------------------------------------------------------------
    def admit(self, rid: str, lifetime_tokens: int, shared: Sequence[int] = (), salt: str | None = None) -> None:
        """`shared`: a prefix hit's cached pages (`lookup`); the request's committed length starts at their
        end."""
        if rid in self._reqs:
            raise KVCacheError(f"request {rid!r} already holds pages")
        if not self.can_admit(lifetime_tokens, shared):
            raise KVCacheError(f"request {rid!r}: {lifetime_tokens} tokens do not fit the free budget")
        keys = []
        for p in shared:
            assert self.prefix is not None and p in self.prefix, f"page {p} is not a cached block"
            self.prefix.unpark(p)
            self._refs[p] = self._refs.get(p, 0) + 1
            keys.append(self.prefix.blocks[p].key)
        self._reqs[rid] = _Entry(list(shared), len(shared) * self.page_size,
                                 pages_for(lifetime_tokens, self.page_size), salt, keys)

    def ensure(self, rid: str, tokens: int) -> None:
        """Grow the page table so that `tokens` positions have slots."""
        e = self._reqs[rid]
        need = pages_for(tokens, self.page_size) - len(e.table)
        if need > self.num_free:
            raise KVCacheError(f"request {rid!r}: pool exhausted ({need} pages needed, {self.num_free} free)")
        for _ in range(max(0, need)):
            e.table.append(self._take(rid))

    def reserve(self, rid: str, extra: int) -> None:
        """Speculative reservation: slots for `length + extra` tokens."""
        self.ensure(rid, self._reqs[rid].length + extra)

    def commit(self, rid: str, new_length: int, leak: bool = False, keep_extra: int = 0, ahead: int = 0) -> None:
        """Record `new_length` committed tokens and release pages wholly past it (the rollback), except the
        pages of the `ahead` positions after it that a step in flight writes (engine/ahead.py).

        Self-test knobs (engine/faults.py), never set otherwise: `leak=True`: the pages leave the table but
        never reach the free list (lost; skip_rollback); `keep_extra=n`: the rollback keeps up to n pages
        past the committed length in the table (held until the request is freed; rollback_keeps_page)."""
        e = self._reqs[rid]
        if new_length > len(e.table) * self.page_size:
            raise KVCacheError(f"request {rid!r}: commit of {new_length} tokens past capacity "
                               f"{len(e.table) * self.page_size}")
        e.length = new_length
        keep = pages_for(new_length + ahead, self.page_size) + keep_extra
        while len(e.table) > keep:
            self._drop(e.table.pop(), lose=leak)
        del e.keys[len(e.table):]  # a block key past the table names no page of this request

    def free(self, rid: str) -> None:
        e = self._reqs.pop(rid, None)
        if e is not None:
            # Deepest block first: the LRU then evicts a request's tail before the prefix others share.
            for page in reversed(e.table):
                self._drop(page)

    def check(self) -> None:
        owned = {p for e in self._reqs.values() for p in e.table}
        parked = set(self.evictable())
        held = sum(len(e.table) for e in self._reqs.values())
        if len(owned) + len(self._free) + len(parked) != self.num_pages \
                or len(owned | set(self._free) | parked) != self.num_pages \
                or held != sum(self._refs.values()) or set(self._refs) != owned:
            raise KVCacheError("page pool invariant broken: pages lost, double-owned or refcounts wrong")
