"""EngineLoop hands a step's deltas to an event loop in one thread-safe call (batch_delivery), or one per delta
(SPECBENCH_BATCH_DELIVERY=0): consumers see the same deltas in the same order either way."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from specbench.harness.adapters.loop import EngineLoop


@dataclass
class Out:
    rid: str
    n: int
    finished: bool


class CountingEngine:
    """Each request emits `length` deltas, one per step, all running requests stepped together."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths
        self.done: dict[str, int] = {}
        self.lock = threading.Lock()
        self.steps = 0

    def add_request(self, prompt, params, rid):
        with self.lock:
            self.done[rid] = 0

    def has_unfinished(self) -> bool:
        with self.lock:
            return any(n < self.lengths[r] for r, n in self.done.items())

    def step(self):
        with self.lock:
            self.steps += 1
            outs = []
            for r in sorted(self.done):
                if self.done[r] < self.lengths[r]:
                    self.done[r] += 1
                    outs.append(Out(r, self.done[r], self.done[r] == self.lengths[r]))
            return outs

    def abort(self, rid):
        with self.lock:
            self.done.pop(rid, None)


async def _run(batch: bool) -> tuple[dict[str, list[int]], int, int]:
    lengths = {f"r{i}": 3 + i for i in range(5)}
    eng = CountingEngine(lengths)
    el = EngineLoop(eng, idle_wait=0.001)
    el.batch_delivery = batch
    loop = asyncio.get_running_loop()
    calls = 0
    real = loop.call_soon_threadsafe

    def counting(*a, **kw):
        nonlocal calls
        calls += 1
        return real(*a, **kw)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        q: asyncio.Queue = asyncio.Queue()
        for rid in lengths:  # one queue for all: the order across requests is observable too
            el.submit([1], None, rid=rid, queue=q, tag=rid)
        seen: dict[str, list[int]] = {r: [] for r in lengths}
        finished = 0
        while finished < len(lengths):
            tag, out = await asyncio.wait_for(q.get(), 10)
            seen[tag].append(out.n)
            finished += out.finished
        return seen, calls, eng.steps
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        el.close()


@pytest.mark.parametrize("batch", [True, False])
def test_deltas_arrive_complete_and_in_order(batch):
    seen, calls, steps = asyncio.run(_run(batch))
    assert seen == {f"r{i}": list(range(1, 4 + i)) for i in range(5)}
    total = sum(len(v) for v in seen.values())
    if batch:
        assert calls <= steps + 1  # one hand-over per step (submits may step before all are in)
    else:
        assert calls >= total  # one per delta


def test_off_switch_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECBENCH_BATCH_DELIVERY", "0")
    el = EngineLoop(CountingEngine({}), idle_wait=0.001)
    try:
        assert el.batch_delivery is False
    finally:
        el.close()
    monkeypatch.delenv("SPECBENCH_BATCH_DELIVERY")
    el = EngineLoop(CountingEngine({}), idle_wait=0.001)
    try:
        assert el.batch_delivery is True
    finally:
        el.close()


def test_gil_switch_env_is_checked(monkeypatch):
    from specbench import env
    from specbench.cli.serve import DEFAULT_GIL_SWITCH_MS

    monkeypatch.delenv("SPECBENCH_GIL_SWITCH_MS", raising=False)
    assert env.get("SPECBENCH_GIL_SWITCH_MS") == DEFAULT_GIL_SWITCH_MS == 5.0
    monkeypatch.setenv("SPECBENCH_GIL_SWITCH_MS", "0.5")
    assert env.get("SPECBENCH_GIL_SWITCH_MS") == 0.5
    for bad in ("fast", "0", "1000"):
        monkeypatch.setenv("SPECBENCH_GIL_SWITCH_MS", bad)
        with pytest.raises(env.EnvError, match=rf"^SPECBENCH_GIL_SWITCH_MS='{bad}' is invalid: expected a number "
                                               r"of ms in \[0.01, 100\]$"):
            env.get("SPECBENCH_GIL_SWITCH_MS")
