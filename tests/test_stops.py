"""engine/stops.py: the stop strings' automaton equals the simple path (one `find` per stop, every prefix of every
stop tried at the end), on random stop lists over a small alphabet (overlaps, duplicates, stops inside stops) and
random texts that grow, or change at their end (the full-decode path), step by step."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specbench.engine import stops as stops_mod  # noqa: E402
from specbench.engine.stops import StopScan, StopSet, stop_set  # noqa: E402


def first_stop(text: str, stops: tuple[str, ...], after: int) -> tuple[int, str] | None:
    """(start, stop) of the earliest-starting stop that ends after `after` characters (the first listed on a tie)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def simple_holdback(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of `text` that is a proper prefix of a stop (what the server computed per event before)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


alphabet = st.sampled_from("abcé")
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=6), min_size=1, max_size=8).map(tuple)
# each step: the text grows by a piece, or (extends=False runs only) loses up to 3 characters at its end first
steps = st.lists(st.tuples(st.integers(0, 3), st.text(alphabet, max_size=5)), min_size=1, max_size=12)


def run(scan_cls: type, stops: tuple[str, ...], plan: list[tuple[int, str]], extends: bool) -> None:
    sc = scan_cls(StopSet(stops))
    prev = ""
    for cut, piece in plan:
        text = (prev if extends or not cut else prev[:-cut]) + piece
        after = len(prev) if extends else common(prev, text)
        assert sc.scan(text, extends) == first_stop(text, stops, after), (stops, prev, text)
        assert sc.holdback(text) == simple_holdback(text, stops), (stops, text)
        assert sc.holdback(text[:-1]) == simple_holdback(text[:-1], stops), (stops, text)  # a text not scanned
        prev = text


@settings(max_examples=400, deadline=None, database=None)
@given(stops=stop_lists, plan=steps, extends=st.booleans())
def test_the_automaton_equals_the_simple_path(stops, plan, extends):
    run(StopScan, stops, plan, extends)


class _OldWindow(StopScan):
    """The engine's window before the automaton: a stop ending exactly where the last text ended still matched
    (after min_tokens, vLLM's rule says it must not)."""

    def scan(self, text: str, extends: bool = True) -> tuple[int, str] | None:
        start = len(self.text)
        super().scan(text, extends)
        best = None
        for s in self.ss.stops:
            i = text.find(s, max(0, start - len(s)))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


class _FirstToEnd(StopScan):
    """The stop completed first (the longest ending there), not the one that starts first."""

    def scan(self, text: str, extends: bool = True) -> tuple[int, str] | None:
        d = len(self.text)
        super().scan(text, extends)
        for j in range(d + 1, len(text) + 1):
            hits = [s for s in self.ss.stops if text[:j].endswith(s)]
            if hits:
                s = max(hits, key=len)
                return j - len(s), s
        return None


@pytest.mark.parametrize("broken", [_OldWindow, _FirstToEnd])
def test_the_property_catches_a_matcher_that_differs(broken):
    @settings(max_examples=400, deadline=None, database=None)
    @given(stops=stop_lists, plan=steps)
    def prop(stops, plan):
        run(broken, stops, plan, True)

    with pytest.raises(AssertionError):
        prop()


class _Reads(list):
    """A node table that counts its reads: the automaton's work."""

    n = 0

    def __getitem__(self, i):  # type: ignore[override]
        self.n += 1
        return super().__getitem__(i)


class _Restart(StopScan):
    """A trie walked afresh from the root at every position (no failure links): O(longest stop) per character."""

    def scan(self, text: str, extends: bool = True) -> tuple[int, str] | None:
        ss, d = self.ss, len(self.text)
        for j in range(d, len(text)):
            v = 0
            for c in text[max(0, j + 1 - ss.maxlen):j + 1]:
                v = ss.one_n[v] if ss.one_c[v] == c else 0
        self.text = text
        return None


@pytest.mark.parametrize("n_stops", [1, 10, 10_000])
@pytest.mark.parametrize("scan_cls, bounded", [(StopScan, True), (_Restart, False)])
def test_a_character_costs_the_same_however_many_and_long_the_stops(n_stops, scan_cls, bounded):
    """Per character the automaton reads its node table at most 3 times on average (the failure links pay back
    what the trie descended), for 1, 10 or 10,000 stops of 60 characters and a text that keeps nearly matching
    them; a trie without failure links reads it up to 60 times."""
    stops = tuple("a" * 59 + "b" for _ in range(1)) + tuple(f"{i:05d}" + "a" * 54 + "c" for i in range(n_stops - 1))
    ss = StopSet(stops)
    ss.one_c = _Reads(ss.one_c)
    sc, text = scan_cls(ss), ""
    for _ in range(300):
        text += "aaaaaaa"
        assert sc.scan(text) is None
    per_char = ss.one_c.n / len(text)
    assert (per_char <= 3) is bounded, per_char


def test_the_cache_shares_a_list_and_stays_bounded(monkeypatch):
    monkeypatch.setattr(stops_mod, "_cache", type(stops_mod._cache)())
    monkeypatch.setattr(stops_mod, "_cache_nodes", 0)
    monkeypatch.setattr(stops_mod, "CACHE_NODES", 100)
    a = stop_set(("ab", "abc"))
    assert stop_set(("ab", "abc")) is a
    big = stop_set(tuple(f"{i:03d}" for i in range(200)))  # more nodes than the whole cache: not kept
    assert stop_set(tuple(f"{i:03d}" for i in range(200))) is not big
    for i in range(60):
        stop_set((f"q{i}",))
    assert stops_mod._cache_nodes <= 100 and ("ab", "abc") not in stops_mod._cache


def test_bad_lists_are_refused():
    for bad in ((), ("",), ("a", "")):
        with pytest.raises(ValueError, match="non-empty"):
            StopSet(bad)


def test_engine_snapshots_hold_back_every_stop_prefix():
    """The engine's streamed text (an unfinished output's `text`) never ends with a proper prefix of a stop and
    only grows; the finished text is the free run's up to the earliest stop, as the simple path finds it in the
    full text. Stops are cut from a free run's own text, so prefixes and matches happen."""
    from specbench.engine import LLM, SamplingParams
    from specbench.harness.fixtures import bundled_pair

    llm = LLM(str(bundled_pair()[0]), spec="off")
    prompt = "Once upon a time, there was"
    free = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    assert len(free) > 30, free
    stops = (free[20:24], free[5:8] + "\u2603", free[12:13] + "zz", "never")
    want = first_stop(free, stops, 0)
    assert want is not None
    rid = llm.engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=stops))
    seen: list[str] = []
    final = None
    while final is None:
        for out in llm.engine.step():
            if out.rid != rid:
                continue
            if out.finished:
                final = out
            else:
                assert simple_holdback(out.text, stops) == 0, (out.text, stops)
                assert not seen or out.text.startswith(seen[-1])
                seen.append(out.text)
    assert final.text == free[:want[0]] and final.stop_reason == want[1], (final.text, want)
    assert all(final.text.startswith(t) for t in seen)
