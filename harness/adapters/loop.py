"""`EngineLoop`: one background thread stepping an in-process engine, feeding asyncio consumers.

Contract:
- The engine is anything with the `LLMEngine` surface: add_request(prompt, params, rid), step() ->
  deltas with .rid/.finished, abort(rid), has_unfinished(). The engine is thread-safe (one lock); only
  the loop thread calls step().
- `submit` registers the consumer's queue BEFORE the engine sees the request, so no delta is lost; it
  raises the engine's own ConfigError/AdmissionError synchronously (the caller turns them into a 400)
  and `Overloaded` when `max_pending` requests are already in flight.
- Each delta is delivered as `(tag, output)` on the consumer's asyncio queue through
  `loop.call_soon_threadsafe`; a step that raises delivers `(tag, EngineFailure)` to every request in
  flight, aborts them, and the loop keeps serving.
- `abort(rid)` frees the request's KV (a disconnecting client, a cancelled task); aborting a finished or
  unknown request is a no-op. `close()` stops the thread.
- `exclusive()` hands the engine to the caller for synchronous stepping (a profiler window): the loop
  thread finishes its current step and then steps nothing until the block ends; it is refused while
  requests are in flight, and `submit` is refused while it is held, so no consumer's delta is stolen.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class Overloaded(RuntimeError):
    """Too many requests in flight; the caller should answer 503 / retry later."""


class EngineFailure(RuntimeError):
    """The engine raised inside step(); every request in flight at that moment fails with it."""


@dataclass
class _Sub:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: Any


class EngineLoop:
    def __init__(self, engine: Any, max_pending: int | None = None, idle_wait: float = 0.05) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.idle_wait = idle_wait
        self._subs: dict[str, _Sub] = {}
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()  # held by the loop thread around each step, or by `exclusive`
        self._held = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="specbench-engine-loop", daemon=True)
        self._thread.start()

    # ---- consumer side ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_pending(self) -> int:
        return len(self._subs)

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, prompt: str | list[int], params: Any, rid: str | None = None,
               queue: asyncio.Queue | None = None, tag: Any = None) -> tuple[str, asyncio.Queue]:
        """Add a request; returns (rid, queue). Must be called from inside a running event loop."""
        if not self.alive:
            raise EngineFailure("the engine loop is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        rid = rid or self.new_rid()
        with self._lock:
            if self._held:
                raise EngineFailure("the engine is held for synchronous stepping (a profiler window); "
                                    "submit after it is released")
            if self.max_pending is not None and len(self._subs) >= self.max_pending:
                raise Overloaded(f"the server has {len(self._subs)} requests in flight "
                                 f"(limit {self.max_pending}); retry later")
            if rid in self._subs:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._subs[rid] = _Sub(loop, q, tag)
        try:
            self.engine.add_request(prompt, params, rid=rid)
        except BaseException:
            with self._lock:
                self._subs.pop(rid, None)
            raise
        self._wake.set()
        return rid, q

    def abort(self, rid: str) -> None:
        with self._lock:
            sub = self._subs.pop(rid, None)
        if sub is not None:
            try:
                self.engine.abort(rid)
            except Exception:  # aborting must never raise into a disconnect handler
                pass

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Any]:
        """The engine, stepped by nobody else until the block ends (see the module docstring)."""
        with self._lock:
            if self._subs:
                raise EngineFailure(f"{len(self._subs)} requests are in flight: the engine can be held for "
                                    "synchronous stepping only when idle")
            self._held = True
        try:
            with self._step_lock:
                yield self.engine
        finally:
            with self._lock:
                self._held = False

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- the loop thread -------------------------------------------------------------------------
    def _deliver(self, sub: _Sub, item: Any) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, (sub.tag, item))
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            failed = False
            with self._step_lock:
                busy = self.engine.has_unfinished()
                try:
                    outs = self.engine.step() if busy else []
                except Exception as e:
                    self.last_error = "".join(traceback.format_exception_only(type(e), e)).strip()
                    self._fail_all(EngineFailure(f"engine step failed: {self.last_error}"))
                    failed = True
            if failed:
                self._stop.wait(0.01)  # never spin hot on an engine that keeps failing
                continue
            if not busy:
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            for out in outs:
                with self._lock:
                    sub = self._subs.get(out.rid)
                    if sub is not None and out.finished:
                        del self._subs[out.rid]
                if sub is not None:
                    self._deliver(sub, out)

    def _fail_all(self, err: EngineFailure) -> None:
        with self._lock:
            subs, self._subs = self._subs, {}
        for rid, sub in subs.items():
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            self._deliver(sub, err)
