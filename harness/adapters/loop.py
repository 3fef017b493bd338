"""`EngineLoop`: one background thread stepping an in-process engine, feeding asyncio consumers.

Contract:
- The engine is anything with the `LLMEngine` surface: add_request(prompt, params, rid), step() ->
  deltas with .rid/.finished, abort(rid), has_unfinished(). The engine is thread-safe (one lock); only
  the loop thread calls step().
- `submit` registers the consumer's queue BEFORE the engine sees the request, so no delta is lost; it
  raises the engine's own ConfigError/AdmissionError synchronously (the caller turns them into a 400)
  and `Overloaded` when `max_pending` requests are already in flight.
- Each delta is delivered as `(tag, output)` on the consumer's asyncio queue through
  `loop.call_soon_threadsafe`, one call per event loop per step carrying that step's deltas in order
  (`batch_delivery`; SPECBENCH_BATCH_DELIVERY=0: one call per delta); a step that raises delivers
  `(tag, EngineFailure)` to every request in flight, aborts them, and the loop keeps serving.
- `submit` may be called from a worker thread (`loop=` the consumer's event loop): the engine's lock is
  held for a whole step, so a caller on the event loop would stall every other connection (/health
  included) behind a long prefill; the server admits from a worker thread for that reason.
- `abort(rid)` frees the request's KV (a disconnecting client, a cancelled task); aborting a finished or
  unknown request is a no-op. It never waits for a step: while one runs, the abort is queued and applied
  by the loop thread right after it (the request's later outputs are dropped at once). `close()` stops the
  thread.
- Observers (the server's metrics): `on_finish(output, sub)` runs on the loop thread for every finished
  output delivered to a consumer; `on_abort(rid, reason)` once per request that the engine still held when it
  was aborted ("abort") or failed in a step ("error"); `on_scheduled(rid, seconds)` once per request, with
  its queue time (submit -> the start of the step that first scheduled it). Observers must not raise.
- `cancel_all(reason)` aborts everything in flight and hands each consumer `Cancelled(reason)`.
- `refresh_gauges()` sets the engine's running / waiting / KV-usage gauges from its scheduler and pool
  as they are now (no lock: a scrape never waits for a step); the server's /metrics and the local
  adapter call it before rendering, so gauges return to zero after aborted requests (engine/metrics.py).
- `exclusive()` hands the engine to the caller for synchronous stepping (a profiler window): the loop
  thread finishes its current step and then steps nothing until the block ends; it is refused while
  requests are in flight, and `submit` is refused while it is held, so no consumer's delta is stolen.
- `warmup=fn`: the loop thread first runs `fn(engine, stop_event, progress)` (harness/server/warmup.py),
  which steps the engine itself, may call `progress(**fields)` to publish how far it got, and returns a
  dict for the record; until it returns, `ready` is False and `submit`
  raises `NotReady` (the server answers 503 "starting"). A warm-up that raises is recorded (`warmup_info`
  state "failed", its error) and the loop serves anyway, like after any failed step; `close()` during the
  warm-up asks it to stop between steps. Without `warmup` the loop is ready at once (state "off").
- Reuse: `admit(prompt, params, rid, sub)` is `submit` without the asyncio side (the engine process's child
  registers its own subscriber records); a step's outputs leave through `_emit`, a failure through `_deliver`,
  which harness/server/engine_child.py overrides to send them to its parent. `deliver` / `deliver_step` are the
  thread-safe hand-overs both loops use.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from specbench import env


class Overloaded(RuntimeError):
    """Too many requests in flight; the caller should answer 503 / retry later."""


class EngineFailure(RuntimeError):
    """The engine raised inside step(); every request in flight at that moment fails with it."""


class Cancelled(RuntimeError):
    """The server cancelled the request (its shutdown grace period ran out); nothing was wrong with it."""


class NotReady(RuntimeError):
    """The engine is still warming up (compiling kernels, capturing graphs); retry once /health says ready."""


@dataclass
class _Sub:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: Any
    received: float = 0.0  # perf_counter when the consumer received the request (a server: the HTTP request)
    submitted: float = 0.0  # perf_counter when it was handed to the engine
    scheduled: bool = False


def deliver(sub: _Sub, item: Any) -> None:
    """`item` onto the consumer's queue through its event loop (a closed loop: nobody listens, dropped)."""
    try:
        sub.loop.call_soon_threadsafe(sub.queue.put_nowait, (sub.tag, item))
    except RuntimeError:
        pass


def num_waiting(engine: Any) -> int:
    """Requests added and not yet running: `LLMEngine.num_waiting()` (its admission inbox included), else the
    length of the engine's scheduler's waiting queue."""
    f = getattr(engine, "num_waiting", None)
    return f() if callable(f) else len(engine.scheduler.waiting)


def deliver_step(items: list[tuple[_Sub, Any]], batch: bool = True) -> None:
    """One step's outputs, in order: with `batch`, ONE thread-safe hand-over per event loop (one wake-up of
    that loop per step, not one per request: at c64 that is 64 self-pipe writes and loop wake-ups fewer per
    step, each taken while the engine thread waits for the GIL); else one per output."""
    if not batch:
        for sub, item in items:
            deliver(sub, item)
        return
    batches: dict[asyncio.AbstractEventLoop, list[tuple[_Sub, Any]]] = {}
    for sub, item in items:
        batches.setdefault(sub.loop, []).append((sub, item))
    for loop, group in batches.items():
        def put_all(group: list[tuple[_Sub, Any]] = group) -> None:
            for sub, item in group:
                sub.queue.put_nowait((sub.tag, item))

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the consumers' event loop is closed: nobody is listening
            pass


def warmup_status(info: dict) -> dict:
    """A copy of a warm-up record; while it runs, with `elapsed_s` so far (from its monotonic `t_start`)."""
    info = dict(info)
    if info.get("state") == "running" and "t_start" in info:
        info["elapsed_s"] = round(time.monotonic() - info["t_start"], 1)
    info.pop("t_start", None)
    return info


def not_ready(status: dict) -> NotReady:
    return NotReady(f"the server is warming up (compiling kernels, capturing CUDA graphs; "
                    f"{status.get('elapsed_s', 0.0):.0f} s so far): retry once GET /health answers 200")


def overloaded(n: int, limit: int) -> Overloaded:
    return Overloaded(f"the server has {n} requests in flight (limit {limit}); retry later")


class ConsumerSurface:
    """The read-only half of the loop surface the server uses, shared by `EngineLoop` and the engine-process loop
    (harness/server/engine_proc.py): each sets `_ready` (an Event), `warmup_info`, `_subs` and `_ids`."""

    _ready: threading.Event
    warmup_info: dict
    _subs: dict
    _ids: Iterator[int]
    max_pending: int | None

    @property
    def ready(self) -> bool:
        """False while the warm-up runs; True once it has finished (or failed), or when there is none."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def warmup_status(self) -> dict:
        """A copy of the warm-up record; while it runs, with `elapsed_s` so far."""
        return warmup_status(self.warmup_info)

    @property
    def num_pending(self) -> int:
        return len(self._subs)

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def _register(self, rid: str, sub: Any) -> None:
        """The consumer, registered before the engine sees the request (the caller holds the loop's lock):
        `Overloaded` at max_pending, a ValueError for a request id already in flight."""
        if self.max_pending is not None and len(self._subs) >= self.max_pending:
            raise overloaded(len(self._subs), self.max_pending)
        if rid in self._subs:
            raise ValueError(f"request id {rid!r} is already in flight")
        self._subs[rid] = sub


class EngineLoop(ConsumerSurface):
    def __init__(self, engine: Any, max_pending: int | None = None, idle_wait: float = 0.05,
                 warmup: Callable[[Any, threading.Event, Callable[..., None]], dict] | None = None) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.idle_wait = idle_wait
        # one thread-safe hand-over per event loop per step (False: one per delta, as before; the off switch
        # SPECBENCH_BATCH_DELIVERY=0); consumers see the same deltas in the same order either way
        self.batch_delivery = env.flag("SPECBENCH_BATCH_DELIVERY")
        self._subs: dict[str, _Sub] = {}
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()  # held by the loop thread around each step, or by `exclusive`
        self._held = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._aborts: list[str] = []  # aborted while a step ran: applied by the loop thread after it
        self.on_finish: Callable[[Any, _Sub], None] | None = None
        self.on_abort: Callable[[str, str], None] | None = None
        self.on_scheduled: Callable[[str, float], None] | None = None
        self.last_error: str | None = None
        # what the loop thread did so far: steps taken, seconds inside engine.step(), seconds handing outputs over
        self.stepping = {"steps": 0, "step_s": 0.0, "emit_s": 0.0}
        self._warmup = warmup
        self._ready = threading.Event()
        self.warmup_info: dict = {"state": "off"} if warmup is None else {"state": "pending"}
        if warmup is None:
            self._ready.set()
        self._thread = threading.Thread(target=self._run, name="specbench-engine-loop", daemon=True)
        self._thread.start()

    # ---- consumer side ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt: str | list[int], params: Any, rid: str | None = None,
               queue: asyncio.Queue | None = None, tag: Any = None,
               loop: asyncio.AbstractEventLoop | None = None, received: float | None = None
               ) -> tuple[str, asyncio.Queue]:
        """Add a request; returns (rid, queue). Called inside the consumer's running event loop, or from
        any thread with `loop=` that event loop."""
        self.check_accepting()
        loop = loop if loop is not None else asyncio.get_running_loop()
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        rid = rid or self.new_rid()
        now = time.perf_counter()
        return self.admit(prompt, params, rid, _Sub(loop, q, tag, received if received is not None else now, now)), q

    def check_accepting(self) -> None:
        """Raise what `submit` raises when no request can be accepted now (stopped, warming up)."""
        if not self.alive:
            raise EngineFailure("the engine loop is not running")
        if not self._ready.is_set():
            raise not_ready(self.warmup_status())

    def admit(self, prompt: str | list[int], params: Any, rid: str, sub: _Sub) -> str:
        """Register `sub` as the consumer of `rid`, then hand the request to the engine (its refusal is raised
        as is, the registration undone). The engine process's child calls this with its own `sub`."""
        with self._lock:
            if self._held:
                raise EngineFailure("the engine is held for synchronous stepping (a profiler window); "
                                    "submit after it is released")
            self._register(rid, sub)
        try:
            self.engine.add_request(prompt, params, rid=rid)
        except BaseException:
            with self._lock:
                self._subs.pop(rid, None)
            raise
        self._wake.set()
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            sub = self._subs.pop(rid, None)
            if sub is None:
                return
            if not self._step_lock.acquire(blocking=False):  # a step runs: never wait for it
                self._aborts.append(rid)
                self._wake.set()
                return
        try:
            self._abort_now(rid)
        finally:
            self._step_lock.release()

    def _abort_now(self, rid: str) -> None:
        """With the step lock held: abort in the engine, tell the observer if the engine still had it."""
        held = getattr(self.engine, "requests", None)
        known = held is None or rid in held
        try:
            had = self.engine.abort(rid)
        except Exception:  # aborting must never raise into a disconnect handler
            return
        if isinstance(had, bool):  # LLMEngine says (a request still in its inbox is not in `requests` yet)
            known = had
        if known and self.on_abort is not None:
            self.on_abort(rid, "abort")

    def cancel_all(self, reason: str) -> int:
        """Abort every request in flight and hand each consumer `Cancelled(reason)` (a server's drain
        deadline: clients get a clear error instead of a cut connection). Returns how many."""
        with self._lock:
            n = len(self._subs)
        self._fail_all(Cancelled(reason), "abort")
        return n

    def refresh_gauges(self) -> None:
        e = self.engine
        sched, pool, metrics = getattr(e, "scheduler", None), getattr(e, "pool", None), getattr(e, "metrics", None)
        if sched is None or pool is None or metrics is None or not hasattr(metrics, "set_gauges"):
            return
        metrics.set_gauges(len(sched.running), num_waiting(e), pool.num_free, pool.num_pages)

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
        deliver(sub, item)

    def _emit(self, items: list[tuple[_Sub, Any]]) -> None:
        """One step's outputs to their consumers (the engine process's child sends them to its parent)."""
        deliver_step(items, self.batch_delivery)

    def _progress(self, **fields: Any) -> None:
        self.warmup_info = {**self.warmup_info, **fields}

    def _run_warmup(self) -> None:
        assert self._warmup is not None
        t0 = time.monotonic()
        self.warmup_info = {"state": "running", "t_start": t0}
        try:
            with self._step_lock:
                info = self._warmup(self.engine, self._stop, self._progress) or {}
            self.warmup_info = {"state": "done", **info, "seconds": round(time.monotonic() - t0, 2)}
        except Exception as e:  # recorded; the loop serves anyway, as after any failed step
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
            self.warmup_info = {"state": "failed", "error": err, "seconds": round(time.monotonic() - t0, 2)}
        finally:
            self._ready.set()

    def _run(self) -> None:
        if self._warmup is not None:
            self._run_warmup()
        while not self._stop.is_set():
            failed = False
            with self._step_lock:
                self._apply_aborts()
                busy = self.engine.has_unfinished()
                t_step = time.perf_counter()
                try:
                    outs = self.engine.step() if busy else []
                    if busy and self.on_scheduled is not None:
                        self._note_scheduled(t_step, outs)
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
            t_out = time.perf_counter()
            items: list[tuple[_Sub, Any]] = []
            for out in outs:
                with self._lock:
                    sub = self._subs.get(out.rid)
                    if sub is not None and out.finished:
                        del self._subs[out.rid]
                if sub is not None:
                    if out.finished and self.on_finish is not None:
                        self.on_finish(out, sub)
                    items.append((sub, out))
            self._emit(items)
            st = self.stepping
            st["steps"] += 1
            st["step_s"] += t_out - t_step
            st["emit_s"] += time.perf_counter() - t_out
        with self._step_lock:  # the loop has stopped: what was aborted meanwhile is still freed
            self._apply_aborts()

    def _apply_aborts(self) -> None:
        with self._lock:
            rids, self._aborts = self._aborts, []
        for rid in rids:
            self._abort_now(rid)

    def _note_scheduled(self, t_step: float, outs: list) -> None:
        """Queue time of the requests the step just admitted (running now, or finished in it): submit ->
        the start of that step."""
        sched = getattr(self.engine, "scheduler", None)
        running = {r.rid for r in getattr(sched, "running", ())} | {o.rid for o in outs}
        with self._lock:
            new = [(rid, s) for rid, s in self._subs.items() if not s.scheduled and rid in running]
            for _, s in new:
                s.scheduled = True
        assert self.on_scheduled is not None
        for rid, s in new:
            self.on_scheduled(rid, max(0.0, t_step - s.submitted))

    def _fail_all(self, err: Exception, reason: str = "error") -> None:
        with self._lock:
            subs, self._subs = self._subs, {}
        for rid, sub in subs.items():
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            if self.on_abort is not None:
                self.on_abort(rid, reason)
            self._deliver(sub, err)
