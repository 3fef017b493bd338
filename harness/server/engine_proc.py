"""The engine in a process of its own: `ProcEngineLoop`, the `EngineLoop` surface over a spawned child.

Why: in one process the engine's step thread, uvicorn's event loop and the preparation workers share one GIL.
Measured on the H200 (benchmarks/load.py, Qwen3-4B-shaped pair, closed loop): the served engine made 0.71x the
in-process tok/s at c64 (0.83x at c16, 0.96x at c1); per decode step the host time to launch the CUDA graphs went
0.72 -> 2.67 ms and the GPU forward 5.16 -> 7.63 ms (the GPU waited for late launches). vLLM runs its engine core
in a process of its own for the same reason.

Contract:
- `ProcEngineLoop(cfg, max_pending, warmup, log_level, start_timeout, factory)` spawns (multiprocessing "spawn": CUDA cannot be forked)
  a child (engine_child.py) that builds `LLMEngine(cfg)` from the picklable `EngineConfig` and steps it with an
  `EngineLoop` (`_ChildLoop`: the same loop, its delivery replaced by a pipe). The constructor returns once the engine is
  built (its refusal, e.g. a `ConfigError`, is raised here as that type); the warm-up (harness/server/warmup.py:
  `warmup` False / True / a `WarmupPlan` / a picklable callable) then runs in the child, its progress and its
  end reported to the parent: `ready` is False and `submit` raises `NotReady` until it is done.
- The parent presents what the server uses of `EngineLoop`: submit, abort, cancel_all, close, alive,
  last_error, num_pending, ready, wait_ready, warmup_status, new_rid, refresh_gauges, the observers on_finish /
  on_abort / on_scheduled, and `engine` (`ProcEngine`: cfg, max_model_len, mcfg, k, spec_on and describe() sent
  once by the child at start-up; its own tokenizer loaded from the model directory; reset_prefix_cache() and the
  metrics / scheduler / pool figures /metrics reads fetched from the child). `exclusive()` cannot cross the
  process boundary and says which switch turns the engine process off.
- `submit` round-trips to the child and waits for its accept / refuse answer (`SUBMIT_TIMEOUT_S`), so the
  engine's ConfigError / AdmissionError still reach the caller synchronously (a 400); `Overloaded`
  (max_pending) and `NotReady` are decided in the parent. The consumer is registered before the request is sent,
  so no output is lost.
- Per step the child sends ONE message with that step's deltas (new ids, token times, logprobs, text appended
  or, where it is not an extension, replaced, finish fields; the prompt ids and arrival once; the spec record
  at the end) and the queue times of the requests it first scheduled. The parent's reader thread rebuilds
  cumulative `RequestOutput`s equal to the in-process ones and hands them over with one `call_soon_threadsafe`
  per event loop per step (loop.py `deliver_step`), calling on_finish first as `EngineLoop` does.
- A step that raises fails every request in flight with `EngineFailure` (the child's loop keeps serving);
  `cancel_all` hands every consumer `Cancelled` at once and tells the child to abort them. The child dying
  (a crash, an OOM kill) ends the pipe: every request in flight gets `EngineFailure`, pending round trips fail,
  `alive` turns False (/health 503) and `last_error` says how it exited.
- The child ignores SIGINT / SIGTERM (a terminal's Ctrl-C reaches the whole process group; the parent drains
  and then closes it) and exits when its command pipe closes. `close()` asks it to stop, joins it, and
  terminates / kills it after the timeout; it returns once the reader has handled every message the child sent
  (the observers have seen each abort the child reported: the shutdown summary's count is read right after).
- Clocks: token times, arrival and queue times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux, one clock
  for both processes), so the parent's latency histograms read as in process.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import multiprocessing
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specbench.engine.output import RequestOutput

from ..adapters.loop import (
    Cancelled,
    ConsumerSurface,
    EngineFailure,
    _Sub,
    deliver,
    deliver_step,
    not_ready,
)
from .engine_child import _decode_error, child_main

# Engine children still running when the interpreter exits (a loop never closed): killed before multiprocessing's
# own exit handler joins them (atexit runs last-registered first, and this module imports multiprocessing first;
# the child ignores SIGTERM, so that handler's terminate() would leave it running and the join would wait forever).
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_children() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            if p.is_alive():
                p.kill()
                p.join(5)


SUBMIT_TIMEOUT_S = 60.0  # a submit waits this long for the child's answer (at most one step, in practice)
CALL_TIMEOUT_S = 10.0
SNAPSHOT_MAX_AGE_S = 0.05  # one /metrics scrape reads metrics, scheduler and pool: one round trip
OFF_SWITCH = "specbench serve --no-engine-process (or SPECBENCH_ENGINE_PROCESS=0)"


@dataclass
class _Acc:
    """A request's cumulative output in the parent, rebuilt from the child's deltas."""
    prompt_ids: list[int]
    arrival: float
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    lps: list | None = None
    plp: list | None = None
    text: str = ""


@dataclass
class _Call:
    """One round trip to the child: its answer, or `dead` when the child went away first."""
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: tuple[str, str] | None = None
    dead: bool = False


class _Queues:
    def __init__(self, running: int, waiting: int) -> None:
        self.running, self.waiting = range(running), range(waiting)  # len() is all a reader takes


class _Pool:
    def __init__(self, free: int, total: int, prefix: bool) -> None:
        self.num_free, self.num_pages = free, total
        self.prefix = True if prefix else None


class ProcEngine:
    """What the server reads of the engine, for an engine in the child: static facts from start-up, the
    tokenizer loaded here, live figures fetched from the child (at most `SNAPSHOT_MAX_AGE_S` old)."""

    def __init__(self, loop: ProcEngineLoop, cfg: Any, facts: dict) -> None:
        from specbench.engine.metrics import EngineMetrics
        from specbench.engine.tokenizer import Tokenizer

        self._loop, self.cfg = loop, cfg
        self.max_model_len = facts["max_model_len"]
        self.mcfg, self.k, self.spec_on = facts["mcfg"], facts["k"], facts["spec_on"]
        self._describe = facts["describe"]
        self.tokenizer = Tokenizer(cfg.model)
        self._metrics = EngineMetrics()
        self._snap: dict = {"running": 0, "waiting": 0, "free": 0, "total": 0, "prefix": False,
                            "unfinished": False, "requests": 0}
        self._t_snap = -1.0

    def describe(self) -> dict:
        return dict(self._describe) | {"engine_process": True}

    def reset_prefix_cache(self) -> bool:
        return bool(self._loop.call("reset_prefix_cache"))

    def exclusive_error(self) -> EngineFailure:
        return EngineFailure(f"the engine runs in a process of its own: it cannot be held for synchronous stepping "
                             f"(a profiler window) from the server; run it in process with {OFF_SWITCH}")

    def refresh(self, max_age: float = 0.0) -> dict:
        if time.monotonic() - self._t_snap > max_age and self._loop.alive:
            try:
                snap = self._loop.call("snapshot", timeout=2.0)
            except EngineFailure:
                return self._snap  # the last figures: a scrape never hangs on a busy or dead child
            self._snap, self._t_snap = snap, time.monotonic()
            for k, v in snap["metrics"].items():
                setattr(self._metrics, k, v)
        return self._snap

    @property
    def metrics(self) -> Any:
        self.refresh(SNAPSHOT_MAX_AGE_S)
        return self._metrics

    @property
    def scheduler(self) -> _Queues:
        s = self.refresh(SNAPSHOT_MAX_AGE_S)
        return _Queues(s["running"], s["waiting"])

    @property
    def pool(self) -> _Pool:
        s = self.refresh(SNAPSHOT_MAX_AGE_S)
        return _Pool(s["free"], s["total"], s["prefix"])

    def has_unfinished(self) -> bool:
        return bool(self.refresh()["unfinished"])

    @property
    def num_requests(self) -> int:
        """Requests the child's engine holds now."""
        return int(self.refresh()["requests"])


class ProcEngineLoop(ConsumerSurface):
    def __init__(self, cfg: Any, max_pending: int | None = None, warmup: Any = False, log_level: str = "warning",
                 start_timeout: float = 900.0, factory: Callable | None = None) -> None:
        self.max_pending = max_pending
        self.batch_delivery = True
        self._subs: dict[str, _Sub] = {}
        self._accs: dict[str, _Acc] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self.on_finish: Callable[[Any, _Sub], None] | None = None
        self.on_abort: Callable[[str, str], None] | None = None
        self.on_scheduled: Callable[[str, float], None] | None = None
        self.last_error: str | None = None
        self._ready = threading.Event()
        self._relay_s = 0.0
        self._dead = False
        self._closing = False
        ctx = multiprocessing.get_context("spawn")
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=child_main, args=(cfg, warmup, cmd_r, out_w, log_level, factory),
                                name="specbench-engine", daemon=True)
        self.proc.start()
        _LIVE.add(self.proc)
        cmd_r.close()
        out_w.close()  # the child holds the only write end: its death is this end's EOF
        self._cmd, self._out = cmd_w, out_r
        facts = self._hello(start_timeout)
        self.warmup_info: dict = facts["warmup"]
        if self.warmup_info["state"] == "off":
            self._ready.set()
        self.engine = ProcEngine(self, cfg, facts)
        self._reader = threading.Thread(target=self._read, name="specbench-engine-proc-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def _hello(self, timeout: float) -> dict:
        t0 = time.monotonic()
        while not self._out.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() - t0 > timeout:
                self._kill()
                raise EngineFailure(f"the engine process did not start (exit code {self.proc.exitcode})")
        try:
            msg = self._out.recv()
        except EOFError:
            self._kill()
            raise EngineFailure(f"the engine process exited while starting (exit code {self.proc.exitcode})") from None
        if msg[0] == "fatal":
            self._kill()
            raise _decode_error(msg[1])
        assert msg[0] == "hello", msg
        return msg[1]

    # ---- the EngineLoop surface --------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._dead and not self._closing and self.proc.is_alive()

    def submit(self, prompt: str | list[int], params: Any, rid: str | None = None,
               queue: asyncio.Queue | None = None, tag: Any = None,
               loop: asyncio.AbstractEventLoop | None = None, received: float | None = None
               ) -> tuple[str, asyncio.Queue]:
        if not self.alive:
            raise EngineFailure(self.last_error or "the engine process is not running")
        if not self._ready.is_set():
            raise not_ready(self.warmup_status())
        loop = loop if loop is not None else asyncio.get_running_loop()
        q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        rid = rid or self.new_rid()
        now = time.perf_counter()
        sub = _Sub(loop, q, tag, received if received is not None else now, now)
        with self._lock:
            self._register(rid, sub)
        try:
            err = self._round_trip(lambda c: ("add", c, rid, prompt, params, sub.submitted, sub.received),
                                   SUBMIT_TIMEOUT_S)[1]
        except BaseException:
            self.abort(rid)
            raise
        if err is not None:
            with self._lock:
                self._subs.pop(rid, None)
            raise _decode_error(err)
        return rid, q

    def abort(self, rid: str) -> None:
        with self._lock:
            sub = self._subs.pop(rid, None)
            self._accs.pop(rid, None)
        if sub is not None:
            self._post(("abort", rid))

    def cancel_all(self, reason: str) -> int:
        with self._lock:
            subs, self._subs = self._subs, {}
            self._accs.clear()
        for sub in subs.values():
            deliver(sub, Cancelled(reason))
        self._post(("cancel_all", reason))
        return len(subs)

    def refresh_gauges(self) -> None:
        self.engine.refresh()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Any]:
        raise self.engine.exclusive_error()
        yield  # pragma: no cover

    def call(self, name: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        value, err = self._round_trip(lambda c: ("call", c, name), timeout)
        if err is not None:
            raise _decode_error(err)
        return value

    def close(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        self._post(("close",))
        self.proc.join(timeout)
        self._kill()
        if threading.current_thread() is not self._reader:  # the child is gone: the reader reaches EOF
            self._reader.join(timeout)
        with contextlib.suppress(OSError):
            self._cmd.close()
        self._fail_all(EngineFailure("the engine process was closed"))

    # ---- plumbing --------------------------------------------------------------------------------
    def _kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)

    def _post(self, msg: tuple) -> bool:
        with self._send_lock:
            try:
                self._cmd.send(msg)
                return True
            except (OSError, ValueError):
                return False

    def _round_trip(self, make: Callable[[int], tuple], timeout: float) -> tuple[Any, Any]:
        """Send `make(call id)`, wait for the child's answer: (value, encoded error or None)."""
        call = next(self._call_ids)
        slot = self._calls[call] = _Call()
        try:
            if not self.alive or not self._post(make(call)):
                raise EngineFailure(self.last_error or "the engine process is not running")
            if not slot.done.wait(timeout):
                raise EngineFailure(f"the engine process did not answer within {timeout:.0f} s")
            if slot.dead:
                raise EngineFailure(self.last_error or "the engine process exited")
            return slot.value, slot.error
        finally:
            self._calls.pop(call, None)

    def _read(self) -> None:
        while True:
            try:
                msg = self._out.recv()
            except (EOFError, OSError):
                break
            try:
                self._handle(msg)
            except Exception:  # a bug here must not kill the reader: the server would hang
                self.last_error = traceback.format_exc(limit=3)
        self._died()

    @property
    def stepping(self) -> dict:
        """The child loop's `EngineLoop.stepping` (steps, step_s, emit_s) and, as relay_s, the seconds this
        process's reader spent turning its step messages into outputs and handing them over."""
        s = self.engine.refresh().get("stepping") or {}
        return {**s, "relay_s": self._relay_s}

    def _handle(self, msg: tuple) -> None:
        op = msg[0]
        if op == "step":
            t0 = time.perf_counter()
            self._step(msg[1], msg[2])
            self._relay_s += time.perf_counter() - t0
        elif op in ("ack", "reply"):
            slot = self._calls.get(msg[1])
            if slot is not None:
                slot.value, slot.error = (None, msg[2]) if op == "ack" else (msg[2], msg[3])
                slot.done.set()
        elif op == "fail":
            _, rid, kind, text, last_error = msg
            if last_error:
                self.last_error = last_error
            with self._lock:
                sub = self._subs.pop(rid, None)
                self._accs.pop(rid, None)
            if sub is not None:
                deliver(sub, Cancelled(text) if kind == "cancelled" else EngineFailure(text))
        elif op == "aborted":
            if self.on_abort is not None:
                self.on_abort(msg[1], msg[2])
        elif op == "warmup":
            self.warmup_info = msg[1]
        elif op == "ready":
            self.warmup_info = msg[1]
            self._ready.set()

    def _step(self, deltas: list[tuple], scheduled: list[tuple[str, float]]) -> None:
        if scheduled and self.on_scheduled is not None:
            for rid, secs in scheduled:
                if rid in self._subs:
                    self.on_scheduled(rid, secs)
        items: list[tuple[_Sub, Any]] = []
        broken: list[_Sub] = []
        for (rid, head, ids, times, lps, appended, tx, finished, reason, stop_reason, plp, spec) in deltas:
            with self._lock:
                sub = self._subs.get(rid)
                if sub is None:  # aborted here meanwhile: its outputs are dropped
                    self._accs.pop(rid, None)
                    continue
                acc = self._accs.pop(rid, None) if finished else self._accs.get(rid)
                if acc is None and head is None:  # its first delta never came: fail it, never leave it waiting
                    del self._subs[rid]
                    broken.append(sub)
                    continue
                if finished:
                    del self._subs[rid]
                if acc is None:
                    acc = _Acc(list(head[0]), head[1])
                    if not finished:
                        self._accs[rid] = acc
            acc.ids += ids
            acc.times += times
            if lps is not None:
                if acc.lps is None:
                    acc.lps = []
                acc.lps += lps
            if plp is not None:
                if acc.plp is None:
                    acc.plp = []
                acc.plp += plp
            acc.text = acc.text + tx if appended else tx
            out = RequestOutput(rid=rid, prompt_ids=acc.prompt_ids, output_ids=list(acc.ids), text=acc.text,
                                finished=finished, finish_reason=reason, stop_reason=stop_reason, new_ids=list(ids),
                                logprobs=list(acc.lps or []) if lps is not None else None,
                                prompt_logprobs=list(acc.plp) if acc.plp is not None else None,
                                arrival=acc.arrival, token_times=list(acc.times), spec=spec or {})
            if finished and self.on_finish is not None:
                self.on_finish(out, sub)
            items.append((sub, out))
        deliver_step(items, self.batch_delivery)
        for sub in broken:
            deliver(sub, EngineFailure("the engine process sent this request's output without its start"))

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            subs, self._subs = self._subs, {}
            self._accs.clear()
        for rid, sub in subs.items():
            if self.on_abort is not None:
                self.on_abort(rid, "error")
            deliver(sub, err)

    def _died(self) -> None:
        for slot in list(self._calls.values()):
            slot.dead = True
            slot.done.set()
        if self._closing:
            return
        self.proc.join(1.0)
        code = self.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.last_error = f"the engine process exited ({how}); restart the server"
        self._dead = True
        self._fail_all(EngineFailure(self.last_error))
        self._ready.set()  # nobody waits for a warm-up that will never end

