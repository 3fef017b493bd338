"""The serving stack's streaming pieces: stream coalescing (serving.py `coalesced` / `deltas`), the engine
process's sender thread (engine_child.py `_Sender`), the loops' stepping figures, and
benchmarks/serve_capacity.py end to end against its paced engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specbench.engine import EngineConfig, LLMEngine, SamplingParams
from specbench.harness.server import ServerOptions
from specbench.harness.server.engine_child import _Sender
from specbench.harness.server.serving import coalesced


class _Out:
    def __init__(self, n: int, finished: bool = False) -> None:
        self.n, self.finished = n, finished


def test_coalesced_keeps_each_choices_latest_output_in_place():
    a1, b1, a2, b2, a3 = _Out(1), _Out(1), _Out(2), _Out(2), _Out(3, True)
    got = coalesced([(0, a1), (1, b1), (0, a2), (1, b2), (0, a3)])
    assert got == [(1, b2), (0, a3)]


def test_coalesced_stops_at_an_exception_and_keeps_what_came_before():
    a1, a2, b1 = _Out(1), _Out(2), _Out(1)
    err = RuntimeError("engine failed")
    got = coalesced([(0, a1), (1, b1), (0, err), (0, a2)])
    assert got == [(0, a1), (1, b1), (0, err)]  # a1 is not superseded: a2 came after the failure


def _drain(outs: list, coalesce: bool) -> tuple[list[int], str, int]:
    """`deltas` over a queue already holding a request's outputs (a consumer that fell behind), through
    `ChoiceStream` as the streamed completion uses it: (ids sent, text sent, events)."""
    from types import SimpleNamespace

    from specbench.harness.server.serving import ChoiceStream, deltas

    async def run() -> tuple[list[int], str, int]:
        q: asyncio.Queue = asyncio.Queue()
        for o in outs:
            q.put_nowait((0, o))
        state = SimpleNamespace(options=ServerOptions(coalesce=coalesce), loop=SimpleNamespace(abort=lambda r: None))
        cs, ids, text, n = ChoiceStream(), [], "", 0
        async for _, out in deltas(state, q, {0: "r0"}):  # type: ignore[arg-type]
            t, new, _ = cs.advance(out)
            ids, text, n = ids + new, text + t, n + 1
        return ids, text, n

    return asyncio.run(run())


def test_a_coalesced_stream_carries_the_same_tokens_and_text(tiny_target):
    """The tiny engine's per-step outputs of one request, queued all at once: coalescing on sends them as one
    event with exactly the tokens and text of the per-step events; off, one event per step."""
    eng = LLMEngine(EngineConfig(model=tiny_target, num_pages=64))
    eng.add_request("Question: 3 + 4 =", SamplingParams(max_tokens=24, ignore_eos=True), rid="r0")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    eng.close()
    ids0, text0, n0 = _drain(outs, coalesce=False)
    ids1, text1, n1 = _drain(outs, coalesce=True)
    assert len(ids0) == 24 and n0 == len(outs) > 1
    assert (ids1, text1, n1) == (ids0, text0, 1)
    assert ServerOptions().coalesce is False  # off unless SPECBENCH_COALESCE=1


def test_sender_thread_writes_every_message_in_handover_order():
    seen: list = []
    gate = threading.Event()

    class Conn:
        def send(self, msg):
            gate.wait(5)
            seen.append(msg)

    s = _Sender(Conn(), threaded=True)
    s(("a",))
    s.later(lambda: ("b",))
    s.later(lambda: None)  # nothing to send
    s(("c",))
    assert seen == []  # the caller never waits for the pipe
    gate.set()
    s.flush()
    assert seen == [("a",), ("b",), ("c",)]
    inline: list = []
    s2 = _Sender(type("C", (), {"send": lambda self, m: inline.append(m)})(), threaded=False)
    s2.later(lambda: ("x",))
    assert inline == [("x",)]  # the off switch: written on the caller's thread


def test_serve_capacity_end_to_end_against_the_paced_engine(tmp_path):
    from specbench.benchmarks import serve_capacity as sc

    res = sc.run((4,), step_ms=4.0, max_tokens=8, waves=1, repeats=1, arms=["direct", "http", "http-proc"],
                 client_procs=1, out_dir=tmp_path)
    lvl = res["levels"]["4"]
    assert lvl["ideal_tok_s"] == pytest.approx(1000.0)
    for arm in ("direct", "http", "http-proc"):
        assert 0.05 < lvl[arm]["of_ideal"] <= 1.05, (arm, lvl[arm])  # never faster than the clock allows
    for arm in ("http", "http-proc"):
        assert lvl[arm]["step_ms"] >= 4.0  # the loop's own figures: each step at least the paced sleep
    assert "child_busy" in lvl["http-proc"] and "relay_ms" in lvl["http-proc"]
    assert (tmp_path / "serve_capacity.md").read_text().count("| 4 |") == 3
