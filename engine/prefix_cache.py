"""Prefix caching: full KV pages keyed by a chained hash of their tokens, shared, refcounted, LRU-evicted.

Contract (the index; the page pool, engine/kv_cache.py, owns the refcounts and calls it):
- A block is one full page: the tokens at positions [i * page_size, (i + 1) * page_size) of a request. Its
  key is a chained hash, `sha256(parent key + the block's token ids)`, the parent of block 0 being the hash
  of the request's cache salt ("" = the shared cache; vLLM's `cache_salt`), so equal keys mean equal
  token prefixes (and salt) up to the block's end.
- A page is registered (matchable) only once every row in it has been forwarded and committed: the pool's
  `seal` registers the blocks wholly inside [0, committed length). The last token of a request (a plain
  decode's, or the bonus token of a verify) has no KV until the next forward, so a block it completes stays
  unregistered until then. The block records the committed length it was sealed at (`sealed_at`); the
  run-time invariants (engine/invariants.py) hold every new registration to `sealed_at >= block end`.
- Pages are refcounted by the page tables holding them (the pool). A registered page whose last holder
  left stays cached, unreferenced, in LRU order (`lru`, oldest first); the pool takes the oldest when its
  free list is empty (eviction drops the key), or when more than `capacity` pages are indexed.
- Capture (speculation with a drafter): the drafter's context rows for a block (the K/V its context
  projection of the target's captured rows produced, engine/spec/dflash.py) live in the same slots as the
  block's target K/V, so a cached page carries them; `Block.captured` records whether they are valid (the
  drafter had context rows for the whole block when it was sealed). At most `capture_blocks` cached blocks
  keep a capture (LRU by use: `captured`, oldest first; 0 = capture reuse off, None = every block). On a
  prefix hit whose every matched block is captured the drafter's context is restored to the hit length, so
  the first draft round drafts; otherwise (a capture miss) the KV hit is kept and the request decodes
  without drafts (engine/prefix_share.py).
CPU bookkeeping only; no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = b"specbench-prefix-v1"


def salt_key(salt: str | None) -> bytes:
    """The parent key of a request's block 0."""
    return hashlib.sha256(ROOT + (salt or "").encode()).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def chain(tokens: Sequence[int], page_size: int, n_blocks: int, parent: bytes, start: int = 0) -> list[bytes]:
    """Keys of blocks start..n_blocks-1 of `tokens`; `parent` is the key of block start-1 (or the salt's)."""
    out = []
    for i in range(start, n_blocks):
        parent = block_key(parent, tokens[i * page_size:(i + 1) * page_size])
        out.append(parent)
    return out


@dataclass
class Block:
    key: bytes
    index: int  # the block's position in its request (block i covers positions [i * ps, (i + 1) * ps))
    sealed_at: int  # the registering request's committed length at registration
    captured: bool  # the page's drafter context rows are valid for the whole block


class PrefixIndex:
    """key -> page, page -> Block, the LRU of unreferenced cached pages, the LRU of captured blocks."""

    def __init__(self, page_size: int, capacity: int | None = None, capture_blocks: int | None = None) -> None:
        self.page_size = page_size
        self.capacity = capacity  # most pages indexed at once (None: the whole pool)
        self.capture_blocks = capture_blocks  # most blocks keeping a capture (None: all; 0: none)
        self.by_key: dict[bytes, int] = {}
        self.blocks: dict[int, Block] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self.captured: OrderedDict[int, None] = OrderedDict()  # pages whose capture is kept, oldest use first
        self.recent: list[int] | None = None  # pages registered since the invariants last looked (their list)

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, page: int) -> bool:
        return page in self.blocks

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest cached run of `keys` from block 0."""
        pages = []
        for k in keys:
            p = self.by_key.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def captured_prefix(self, pages: Sequence[int]) -> int:
        """How many leading `pages` keep a valid capture."""
        n = 0
        for p in pages:
            if not self.blocks[p].captured:
                break
            n += 1
        return n

    def touch(self, pages: Sequence[int]) -> None:
        """A hit used these pages' captures: most recently used."""
        for p in pages:
            if p in self.captured:
                self.captured.move_to_end(p)

    def register(self, page: int, key: bytes, index: int, sealed_at: int, captured: bool) -> bool:
        """Index `page` under `key`; False (nothing changes) when the key is already cached on another page or
        the index is full (the page then stays the request's own, freed with it)."""
        if key in self.by_key or page in self.blocks:
            return False
        if self.capacity is not None and len(self.blocks) >= self.capacity:
            return False
        captured = captured and self.capture_blocks != 0
        self.by_key[key] = page
        self.blocks[page] = Block(key, index, sealed_at, captured)
        if self.recent is not None:
            self.recent.append(page)
        if captured:
            self.captured[page] = None
            if self.capture_blocks is not None and len(self.captured) > self.capture_blocks:
                old, _ = self.captured.popitem(last=False)
                self.blocks[old].captured = False
        return True

    def unregister(self, page: int) -> None:
        b = self.blocks.pop(page)
        del self.by_key[b.key]
        self.captured.pop(page, None)
        self.lru.pop(page, None)

    def park(self, page: int) -> None:
        """The page's last holder left: cached, unreferenced, most recently used."""
        self.lru[page] = None

    def unpark(self, page: int) -> None:
        self.lru.pop(page, None)

    def oldest(self) -> int | None:
        return next(iter(self.lru), None)

    def reset(self) -> list[int] | None:
        """Forget every cached page and return them (for the free list), or None, changing nothing, while
        any cached page is still held by a request (as vLLM's reset_prefix_cache refuses then)."""
        if len(self.lru) != len(self.blocks):
            return None
        freed = list(self.lru)
        self.by_key.clear()
        self.blocks.clear()
        self.lru.clear()
        self.captured.clear()
        return freed
