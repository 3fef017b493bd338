"""Stop strings: where a request's text first completes one, and how much of its end may still become one.

Contract:
- `stop_set(stops)` is the request's stop list compiled into one automaton over characters (Aho-Corasick: a trie
  of the strings with failure links), kept per distinct list (`CACHE_NODES` trie nodes across the lists kept, least
  recently used first out), so the many requests of a benchmark that share one list build it once. Building costs
  O(total characters of the list); the trie is stored in flat arrays, ~24 bytes a node.
- `StopScan(stop_set)` is one request's position in it, made when the engine admits the request (on the caller's
  thread: a long list's build never lands inside a step). `scan(text, extends)` feeds the characters the text added
  since the last call and returns (start, stop) of the stop that starts earliest among those ending in the new
  part (the first in the list on a tie), else None. `extends=True` says the text extends the last one (the
  engine's incremental text, engine/detok.py, always does): the cost is O(new characters), whatever the number or
  length of the stops. `extends=False` compares with the last text first (the full-decode path, O(text) anyway)
  and rescans from where they differ. "New" means ending after the last text's length (or after the first
  changed character): a stop whose text ended earlier, e.g. before min_tokens, never matches later (vLLM's rule).
- `holdback(text)`: how many characters at the end of `text` are a proper prefix of some stop (they may still
  become one, so a stream holds them back): O(1) for the text last scanned, else O(longest stop).
tests/test_stops.py checks both against the simple path (one `str.find` per stop; every prefix of every stop
tried at the text's end) on random texts and lists, growing and changing.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

CACHE_NODES = 1 << 20  # trie nodes kept across the cached stop lists (~25 MB at most)
_MANY = ""  # one_c[v] for a node with several children (they are in `many[v]`); None: no child


class StopSet:
    """The automaton of one stop list. Node 0 is the root; a node is the prefix of a stop spelled from the root."""

    __slots__ = ("stops", "maxlen", "one_c", "one_n", "many", "fail", "out", "hold", "size")

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops={stops!r:.80}: expected a non-empty tuple of non-empty strings")
        self.stops = stops
        self.maxlen = max(len(s) for s in stops)
        one_c: list[str | None] = [None]  # the only child's character, _MANY, or None
        one_n = array("i", [0])  # the only child
        many: dict[int, dict[str, int]] = {}
        depth = array("i", [0])
        term = array("i", [-1])  # the first stop (list index) spelled exactly by this node
        chars: dict[str, str] = {}  # one object per distinct character
        for idx, s in enumerate(stops):
            v = 0
            for c in s:
                c = chars.setdefault(c, c)
                oc = one_c[v]
                if oc == c:
                    v = one_n[v]
                    continue
                if oc is _MANY and c in many[v]:
                    v = many[v][c]
                    continue
                u = len(one_c)
                one_c.append(None)
                one_n.append(0)
                depth.append(depth[v] + 1)
                term.append(-1)
                if oc is None:
                    one_c[v], one_n[v] = c, u
                elif oc is _MANY:
                    many[v][c] = u
                else:
                    many[v] = {oc: one_n[v], c: u}
                    one_c[v] = _MANY
                v = u
            if term[v] < 0:
                term[v] = idx
        n = len(one_c)
        fail = array("i", [0]) * n
        out = array("i", term)  # the longest stop that ends here: this node's own, else its failure node's
        hold = array("i", [0]) * n  # the deepest node on the failure chain that has a child: a proper prefix
        self.one_c, self.one_n, self.many, self.fail, self.out, self.hold = one_c, one_n, many, fail, out, hold
        order = self._children(0)
        i = 0
        while i < len(order):  # breadth first: a node's failure node is shallower, so it is done before it
            _, v = order[i]
            i += 1
            if out[v] < 0:
                out[v] = out[fail[v]]
            hold[v] = depth[v] if one_c[v] is not None else hold[fail[v]]
            for c, u in self._children(v):
                fail[u] = self.step(fail[v], c) if v else 0
                order.append((c, u))
        self.size = n

    def _children(self, v: int) -> list[tuple[str, int]]:
        oc = self.one_c[v]
        if oc is None:
            return []
        if oc is _MANY:
            return list(self.many[v].items())
        return [(oc, self.one_n[v])]

    def step(self, v: int, c: str) -> int:
        """The node after reading `c` at node `v`: the longest suffix of (v's string + c) that is a node."""
        one_c, fail = self.one_c, self.fail
        while True:
            oc = one_c[v]
            if oc == c:
                return self.one_n[v]
            if oc is _MANY:
                u = self.many[v].get(c)
                if u is not None:
                    return u
            if v == 0:
                return 0
            v = fail[v]


class StopScan:
    """One request's place in its stop set: the node after the text scanned so far, and that text."""

    __slots__ = ("ss", "node", "text")

    def __init__(self, ss: StopSet) -> None:
        self.ss, self.node, self.text = ss, 0, ""

    def scan(self, text: str, extends: bool = True) -> tuple[int, str] | None:
        ss, prev = self.ss, self.text
        if extends:
            d = len(prev)
        else:
            d = _common_prefix(prev, text)
            if d < len(prev):  # the text changed at d: rebuild the node there from the characters before it
                v = 0
                for c in text[max(0, d - ss.maxlen):d]:
                    v = ss.step(v, c)
                self.node = v
        v, best, best_idx = self.node, -1, -1
        out, stops, step, one_c, one_n = ss.out, ss.stops, ss.step, ss.one_c, ss.one_n
        for j in range(d, len(text)):
            c = text[j]
            v = one_n[v] if one_c[v] == c else step(v, c)
            k = out[v]
            if k >= 0:
                start = j + 1 - len(stops[k])
                if best < 0 or start < best or (start == best and k < best_idx):
                    best, best_idx = start, k
        self.node, self.text = v, text
        return (best, stops[best_idx]) if best >= 0 else None

    def holdback(self, text: str) -> int:
        if text is self.text:
            return self.ss.hold[self.node]
        v = 0  # any other text: the automaton over its last maxlen characters (all a proper prefix can span)
        for c in text[max(0, len(text) - self.ss.maxlen):]:
            v = self.ss.step(v, c)
        return self.ss.hold[v]


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo], and they differ somewhere before hi (or hi is an end)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_cache: OrderedDict[tuple[str, ...], StopSet] = OrderedDict()
_cache_nodes = 0
_lock = threading.Lock()


def stop_set(stops: tuple[str, ...]) -> StopSet:
    """The compiled automaton of `stops`, from the cache when this list was compiled lately."""
    global _cache_nodes
    with _lock:
        ss = _cache.get(stops)
        if ss is not None:
            _cache.move_to_end(stops)
            return ss
    ss = StopSet(stops)
    with _lock:
        if stops not in _cache and ss.size <= CACHE_NODES:
            _cache[stops] = ss
            _cache_nodes += ss.size
            while _cache_nodes > CACHE_NODES:
                _, old = _cache.popitem(last=False)
                _cache_nodes -= old.size
    return ss
