"""`ShardedAdapter`: one engine's requests sent from several client processes, so the client's own CPU
(SSE parsing, timing, records) is never what limits a high-concurrency cell.

Contract:
- `ShardedAdapter(inner, engine, procs, api_key=None)` wraps an adapter built from the engine string
  `engine` (the openai kind). `generate(requests, concurrency, on_result, offsets)` splits the requests
  round-robin over `shards(concurrency)` worker processes (spawned on first use, each with its own
  adapter built from the same engine string and key) and gives each an even share of the concurrency
  (closed loop) or its requests' own offsets against one common start time (open loop). A worker takes the
  inner adapter's capability record and model instead of probing the endpoint itself: its probe requests, sent
  at its first cell, landed in that cell's server counters (the sweep's audit saw 4 requests, 8 output and 88
  prompt tokens too many in the first c128 cell with two workers). Results come
  back as each request finishes (`on_result` in completion order, the return value in input order), with
  the workers' perf_counter times, which are the same clock on Linux (CLOCK_MONOTONIC).
- `shards(concurrency)`: `procs` fixed (at most one per request in flight), or with procs=0 ("auto")
  one process per 64 requests in flight up to the machine's cores - 1, at least 1 (then no worker is
  used at all: the inner adapter serves in process).
- `client_cpu_by_proc`: after each generate, the event-loop CPU seconds of every worker (the runner
  reports the busiest as the client's load). Everything else (tokenize, counters, metrics, describe,
  probe, scoring, and any attribute such as `model` or `dialect`) is the inner adapter's; describe()
  adds `client_procs`.
- `close()` / `aclose()` stop the workers.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from .base import EngineAdapter, GenRequest, GenResult, OnResult, failed

PER_PROC = 64  # requests in flight per client process under procs=0 (auto)


async def _run(ad: EngineAdapter, conn: Any, reqs: list[GenRequest], conc: int, offsets: list[float] | None,
               t0: float) -> float:
    """One shard of a cell in a worker: start at t0 (every shard's common origin), results sent as they finish;
    the loop's CPU seconds."""
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    cpu0 = time.thread_time()
    await ad.generate(reqs, concurrency=conc, offsets=offsets, on_result=lambda r: conn.send(("res", r)))
    await ad.aclose()
    return time.thread_time() - cpu0


def _worker(conn: Any, engine: str, name: str, api_key: str | None, caps: Any = None, model: str | None = None
            ) -> None:
    from specbench.harness.engines import build_adapter, parse_engine

    ad = build_adapter(parse_engine(engine), name=name)
    use = getattr(ad, "use_api_key", None)
    if api_key and callable(use):
        use(api_key, "--api-key")
    # the parent's probe (an adapter with a capability record never probes again): no probe request of the
    # worker's own lands inside a measured cell's server counters
    if caps is not None and getattr(ad, "caps", False) is None:
        ad.caps = caps  # type: ignore[attr-defined]
    if model is not None and getattr(ad, "model", False) is None:
        ad.model = model  # type: ignore[attr-defined]
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, reqs, conc, offsets, t0 = msg
        try:
            cpu = asyncio.run(_run(ad, conn, reqs, conc, offsets, t0))
        except Exception as e:  # the worker keeps serving; the cell's missing requests fail with the reason
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        conn.send(("done", cpu))


class ShardedAdapter(EngineAdapter):
    def __init__(self, inner: EngineAdapter, engine: str, procs: int, api_key: str | None = None) -> None:
        super().__init__(inner.name)
        self.inner, self.engine, self.procs, self.api_key = inner, engine, procs, api_key
        self.kind = inner.kind
        self._workers: list[tuple[Any, Any]] = []  # (process, connection)
        self.client_cpu_by_proc: list[float] = []

    def __getattr__(self, name: str) -> Any:  # model, dialect, caps, ...: the inner adapter's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def shards(self, concurrency: int | None) -> int:
        c = concurrency or 1
        if self.procs > 0:
            return max(1, min(self.procs, c))
        return max(1, min((os.cpu_count() or 2) - 1, c // PER_PROC))

    def _start(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        caps = self.probe() if len(self._workers) < n else None  # once, here (the sweep probed before any cell)
        model = getattr(self.inner, "model", None)
        while len(self._workers) < n:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, self.engine, self.name, self.api_key, caps, model),
                            daemon=True, name=f"specbench-client-{len(self._workers)}")
            p.start()
            child.close()
            self._workers.append((p, parent))

    async def generate(self, requests: Sequence[GenRequest], concurrency: int | None = None,
                       on_result: OnResult | None = None,
                       offsets: Sequence[float] | None = None) -> list[GenResult]:
        n = self.shards(concurrency if concurrency is not None else len(requests))
        if n <= 1:
            self.client_cpu_by_proc = []
            return await self.inner.generate(requests, concurrency, on_result, offsets)
        self._start(n)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter() + 0.05  # one start for every shard (offsets are relative to it)
        shares = [list(range(j, len(requests), n)) for j in range(n)]
        c = concurrency or len(requests)
        index = {}
        for j, idx in enumerate(shares):
            conc = c // n + (1 if j < c % n else 0)
            for i in idx:
                index[requests[i].rid or f"{self.name}-sh{i}"] = i
                requests[i].rid = requests[i].rid or f"{self.name}-sh{i}"
            self._workers[j][1].send(("gen", [requests[i] for i in idx], max(1, conc),
                                      [offsets[i] for i in idx] if offsets is not None else None, t0))

        def pump(j: int) -> None:
            conn = self._workers[j][1]
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError) as e:
                    msg = ("error", f"client process {j} ended: {type(e).__name__}")
                loop.call_soon_threadsafe(queue.put_nowait, (j, msg))
                if msg[0] in ("done", "error"):
                    return

        threads = [threading.Thread(target=pump, args=(j,), daemon=True) for j in range(n)]
        for t in threads:
            t.start()
        results: list[GenResult | None] = [None] * len(requests)
        cpu = [math.nan] * n
        left = n
        while left:
            j, msg = await queue.get()
            if msg[0] == "res":
                res = msg[1]
                results[index.get(res.rid, 0)] = res
                if on_result is not None:
                    r = on_result(res)
                    if asyncio.iscoroutine(r):
                        await r
            else:
                left -= 1
                cpu[j] = msg[1] if msg[0] == "done" else math.nan
                if msg[0] == "error":
                    for i in shares[j]:
                        if results[i] is None:
                            results[i] = res = failed(requests[i], requests[i].rid or "", str(msg[1]),
                                                      time.perf_counter())
                            if on_result is not None:
                                r = on_result(res)
                                if asyncio.iscoroutine(r):
                                    await r
        self.client_cpu_by_proc = [x for x in cpu if not math.isnan(x)]
        return [r for r in results if r is not None]

    async def generate_one(self, req: GenRequest) -> GenResult:
        return await self.inner.generate_one(req)

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> Any:
        return await self.inner.score(prompt_ids, continuation_ids, top_k)

    async def spec_counters(self) -> dict | None:
        return await self.inner.spec_counters()

    async def tokenize(self, text: str) -> list[int] | None:
        return await self.inner.tokenize(text)

    async def metrics_text(self) -> str | None:
        return await self.inner.metrics_text()

    def probe(self) -> Any:
        p = getattr(self.inner, "probe", None)
        return p() if callable(p) else None

    def describe(self) -> dict:
        d = dict(self.inner.describe())
        d["client_procs"] = self.procs or "auto"
        return d

    def _stop(self) -> None:
        for _, conn in self._workers:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for p, _ in self._workers:
            p.join(5)
            if p.is_alive():
                p.terminate()
        self._workers = []

    async def aclose(self) -> None:
        self._stop()
        await self.inner.aclose()

    def close(self) -> None:
        self._stop()
        self.inner.close()
