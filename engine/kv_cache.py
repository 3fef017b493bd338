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
Invariant: free + allocated == num_pages at all times; a page is owned by at most one request. Checked
by `check()` (at idle) and, after every step when `EngineConfig.check_invariants` is on, by
engine/invariants.py through the read-only views `owned()`, `free_pages()`, `free_set()` (the free pages
as a set, kept beside the list) and `last_owner()`.
"""

from __future__ import annotations

from dataclasses import dataclass


class KVCacheError(RuntimeError):
    pass


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class _Entry:
    table: list[int]
    length: int  # tokens whose KV is committed
    promised: int  # pages promised at admission


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
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

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def outstanding_promises(self) -> int:
        return sum(max(0, e.promised - len(e.table)) for e in self._reqs.values())

    def can_admit(self, lifetime_tokens: int) -> bool:
        need = pages_for(lifetime_tokens, self.page_size)
        return need <= self.num_free - self.outstanding_promises()

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

    # ---- mutations -----------------------------------------------------------------------------
    def admit(self, rid: str, lifetime_tokens: int) -> None:
        if rid in self._reqs:
            raise KVCacheError(f"request {rid!r} already holds pages")
        if not self.can_admit(lifetime_tokens):
            raise KVCacheError(f"request {rid!r}: {lifetime_tokens} tokens do not fit the free budget")
        self._reqs[rid] = _Entry([], 0, pages_for(lifetime_tokens, self.page_size))

    def ensure(self, rid: str, tokens: int) -> None:
        """Grow the page table so that `tokens` positions have slots."""
        e = self._reqs[rid]
        need = pages_for(tokens, self.page_size) - len(e.table)
        if need > len(self._free):
            raise KVCacheError(f"request {rid!r}: pool exhausted ({need} pages needed, {len(self._free)} free)")
        for _ in range(max(0, need)):
            page = self._free.pop()
            self._free_set.discard(page)
            e.table.append(page)
            self._last_owner[page] = rid

    def reserve(self, rid: str, extra: int) -> None:
        """Speculative reservation: slots for `length + extra` tokens."""
        self.ensure(rid, self._reqs[rid].length + extra)

    def commit(self, rid: str, new_length: int, leak: bool = False, keep_extra: int = 0) -> None:
        """Record `new_length` committed tokens and release pages wholly past it (the rollback).

        Self-test knobs (engine/faults.py), never set otherwise: `leak=True`: the pages leave the table but
        never reach the free list (lost; skip_rollback); `keep_extra=n`: the rollback keeps up to n pages
        past the committed length in the table (held until the request is freed; rollback_keeps_page)."""
        e = self._reqs[rid]
        if new_length > len(e.table) * self.page_size:
            raise KVCacheError(f"request {rid!r}: commit of {new_length} tokens past capacity "
                               f"{len(e.table) * self.page_size}")
        e.length = new_length
        keep = pages_for(new_length, self.page_size) + keep_extra
        while len(e.table) > keep:
            page = e.table.pop()
            if not leak:
                self._free.append(page)
                self._free_set.add(page)

    def free(self, rid: str) -> None:
        e = self._reqs.pop(rid, None)
        if e is not None:
            self._free.extend(reversed(e.table))
            self._free_set.update(e.table)

    def check(self) -> None:
        owned = [p for e in self._reqs.values() for p in e.table]
        if len(owned) + len(self._free) != self.num_pages or len(set(owned) | set(self._free)) != self.num_pages:
            raise KVCacheError("page pool invariant broken: pages lost or double-owned")
