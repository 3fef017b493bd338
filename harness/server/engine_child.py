"""The engine process itself (the child of `ProcEngineLoop`, engine_proc.py): build the engine, step it, send deltas.

Contract:
- `child_main(cfg, warmup, cmd, out, log_level, factory)` is the spawned process's entry point: it ignores SIGINT /
  SIGTERM (the parent drains and then closes it), builds `LLMEngine(cfg)` (or `factory(cfg)`: a picklable
  callable returning an engine with LLMEngine's surface, e.g. benchmarks/serve_capacity.py's paced engine; a refusal is sent as ("fatal",
  (type name, message), traceback) and the process ends), sends ("hello", static facts), then steps the engine
  with `_ChildLoop` (harness/adapters/loop.py's `EngineLoop`, the warm-up first) while its main thread answers
  the parent's commands: ("add", call, rid, prompt, params, submitted, received) -> ("ack", call, None | error),
  ("abort", rid), ("cancel_all", reason), ("call", call, "snapshot" | "reset_prefix_cache") -> ("reply", call,
  value, error), ("close",). It exits when told to close or when the command pipe ends (the parent is gone).
- `_ChildLoop` is `EngineLoop` with its delivery replaced: per step ONE ("step", deltas, [(rid, queue s)])
  message, built and written by the child's sender thread (`_Sender`, every message to the parent in one
  order; SPECBENCH_CHILD_SENDER=0: on the step thread, as before) (`_delta`: the new ids, token times and logprobs, the text appended or, where it does not extend
  what was sent, replaced, the finish fields, the prompt ids and arrival once, the spec record at the end),
  ("fail", rid, "cancelled" | "failure", message, last_error) for a request a failed step or cancel_all ended,
  ("aborted", rid, reason) for the on_abort observer, ("warmup", info) / ("ready", info) for the warm-up.
- Errors cross as (type name, message) (`_encode_error` / `_decode_error`): ConfigError, AdmissionError and
  the other types the server tells apart come back as themselves, anything else as `EngineFailure`.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specbench import env
from specbench.engine.output import RequestOutput

from ..adapters.loop import Cancelled, EngineFailure, EngineLoop, _Sub, num_waiting


def _error_types() -> dict[str, type[BaseException]]:
    from specbench.engine import ConfigError
    from specbench.engine.scheduler import AdmissionError

    return {"ConfigError": ConfigError, "AdmissionError": AdmissionError, "ValueError": ValueError,
            "FileNotFoundError": FileNotFoundError, "EngineFailure": EngineFailure, "TypeError": TypeError}


def _encode_error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def _decode_error(err: tuple[str, str]) -> BaseException:
    name, msg = err
    cls = _error_types().get(name)
    return cls(msg) if cls is not None else EngineFailure(f"{name}: {msg}")


# ---- the child ------------------------------------------------------------------------------------------

SENDER_ENV = "SPECBENCH_CHILD_SENDER"  # 0: the step thread builds and sends each step's message itself
# messages the sender thread may hold unsent: beyond it the step thread waits, as it waited on a full pipe
# before the thread existed (a parent that falls behind slows the engine instead of growing this process)
SENDER_BACKLOG = 256


class _Sender:
    """Every message to the parent, in order. With a sender thread (the default) `__call__` and `later` only
    enqueue: the step thread hands a step's outputs over in microseconds and the thread builds the deltas,
    pickles and writes them while the next step runs (measured against a paced engine at c64: 1.2 ms per step
    on the step thread before); `threaded=False` does everything on the caller's thread. At most `backlog`
    messages wait: a caller beyond that waits for the thread to catch up."""

    def __init__(self, conn: Any, threaded: bool = True, backlog: int = SENDER_BACKLOG) -> None:
        self.conn, self.lock = conn, threading.Lock()
        self._q: queue.Queue | None = queue.Queue(maxsize=backlog) if threaded else None
        self._thread: threading.Thread | None = None
        if self._q is not None:
            self._thread = threading.Thread(target=self._drain, name="specbench-engine-sender", daemon=True)
            self._thread.start()

    def __call__(self, msg: tuple) -> None:
        self.later(lambda: msg)

    def later(self, make: Callable[[], tuple | None]) -> None:
        """Send what `make()` returns (None: nothing), after everything handed over before it (called from the
        sender thread itself, e.g. inside a `make`: written at once)."""
        if self._q is None or threading.current_thread() is self._thread:  # the thread itself never waits on itself
            self._write(make())
        else:
            self._q.put(make)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything handed over so far is written (or `timeout` passed)."""
        if self._q is not None:
            done = threading.Event()
            self._q.put(lambda: done.set())
            done.wait(timeout)

    def _drain(self) -> None:
        assert self._q is not None
        while True:
            make = self._q.get()
            try:
                self._write(make())
            except Exception:  # a delta that cannot be built must not stop every later message
                traceback.print_exc()

    def _write(self, msg: tuple | None) -> None:
        if msg is None:
            return
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the parent is gone: the command pipe's EOF ends the child
                pass


@dataclass
class _Sent:
    n: int = 0  # output ids sent
    text: str = ""
    n_plp: int = 0  # prompt logprobs sent


class _ChildLoop(EngineLoop):
    """`EngineLoop` whose consumers are the parent: each step's outputs go out as one message of deltas."""

    def __init__(self, engine: Any, send: _Sender, warmup: Callable | None) -> None:
        self._send = send
        self._sent: dict[str, _Sent] = {}
        # consumers whose request a step finished (the loop thread has let go of them) while an earlier step's
        # message may still wait for the sender thread: that message still goes out (see `_step_message`)
        self._finished: dict[str, _Sub] = {}
        self._scheduled: list[tuple[str, float]] = []
        super().__init__(engine, None, warmup=warmup)
        self.on_abort = lambda rid, reason: self._send(("aborted", rid, reason))
        self.on_scheduled = lambda rid, s: self._scheduled.append((rid, s))

    def _progress(self, **fields: Any) -> None:
        super()._progress(**fields)
        self._send(("warmup", dict(self.warmup_info)))

    def _run_warmup(self) -> None:
        super()._run_warmup()
        self._send(("ready", dict(self.warmup_info)))

    def _deliver(self, sub: _Sub, item: Any) -> None:  # only failures come this way
        kind = "cancelled" if isinstance(item, Cancelled) else "failure"
        msg = ("fail", sub.tag, kind, str(item), self.last_error)

        def make() -> tuple:
            self._sent.pop(sub.tag, None)
            return msg

        self._send.later(make)

    def _emit(self, items: list[tuple[_Sub, Any]]) -> None:
        sched, self._scheduled = self._scheduled, []
        if items or sched:
            pairs = list(items)
            for sub, out in pairs:
                if out.finished:
                    self._finished[out.rid] = sub
            self._send.later(lambda: self._step_message(pairs, sched))

    def _step_message(self, pairs: list[tuple[_Sub, Any]], sched: list[tuple[str, float]]) -> tuple:
        """The step's message, built on the sender thread. An unfinished output whose consumer is no longer
        the one it was handed over for (aborted or cancelled after the step looked it up, or its rid reused)
        sends nothing and keeps no state (its `_sent` entry would never be freed). One whose request a later
        step finished (the sender fell behind the step thread) still goes out: dropping it would merge this
        step's tokens into the finishing step's delta, one streamed event for two engine steps. A delta that
        cannot be built fails its request (aborted here, a "fail" to the parent) instead of silently losing
        tokens."""
        deltas = []
        for sub, out in pairs:
            if out.finished:
                if self._finished.get(out.rid) is sub:
                    del self._finished[out.rid]
            elif self._subs.get(out.rid) is not sub and self._finished.get(out.rid) is not sub:
                continue
            try:
                deltas.append(self._delta(out))
            except Exception:
                self._sent.pop(out.rid, None)
                self.last_error = traceback.format_exc(limit=3)
                traceback.print_exc()
                self.abort(out.rid)
                self._send.later(self._failed(out.rid))
        return ("step", deltas, sched)

    def _failed(self, rid: str) -> Callable[[], tuple]:
        msg = ("fail", rid, "failure", "the engine process could not send this request's output", self.last_error)
        return lambda: msg

    def _delta(self, out: RequestOutput) -> tuple:
        st = self._sent.get(out.rid)
        head = None
        if st is None:
            st = self._sent[out.rid] = _Sent()
            head = (out.prompt_ids, out.arrival)
        n = st.n
        ids = out.output_ids[n:]
        lps = out.logprobs[n:] if out.logprobs is not None else None
        text = out.text
        appended = text.startswith(st.text)
        tx = text[len(st.text):] if appended else text
        plp = None
        if out.prompt_logprobs is not None:
            plp = out.prompt_logprobs[st.n_plp:]
            st.n_plp = len(out.prompt_logprobs)
        st.n, st.text = len(out.output_ids), text
        if out.finished:
            self._sent.pop(out.rid, None)
        return (out.rid, head, ids, out.token_times[n:], lps, appended, tx, out.finished, out.finish_reason,
                out.stop_reason, plp, out.spec if out.finished else None)

    def forget(self, rid: str) -> None:
        # after the deltas already handed over (those handed over later are dropped by `_step_message`)
        def drop() -> None:
            self._sent.pop(rid, None)

        self._send.later(drop)


def _snapshot(engine: Any, loop: EngineLoop | None = None) -> dict:
    m = engine.metrics
    figs = {f: getattr(m, f) for f in m.__dataclass_fields__}
    figs = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in figs.items()}
    sched, pool = engine.scheduler, engine.pool
    return {"metrics": figs, "running": len(sched.running), "waiting": num_waiting(engine),
            "free": pool.num_free, "total": pool.num_pages, "prefix": pool.prefix is not None,
            "unfinished": engine.has_unfinished(), "requests": len(engine.requests),
            "stepping": dict(loop.stepping) if loop is not None else None}


def child_main(cfg: Any, warmup: Any, cmd: Any, out: Any, log_level: str, factory: Callable | None = None) -> None:
    """The engine process: build the engine, say so, step it (warm-up first), answer commands until told to
    close or the parent goes away."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from . import setup_logging

    setup_logging(log_level)
    send = _Sender(out, threaded=env.flag(SENDER_ENV))
    try:
        from specbench.engine import LLMEngine

        engine = (factory or LLMEngine)(cfg)
        fn: Callable | None
        if warmup is False or warmup is None:
            fn = None
        elif warmup is True or not callable(warmup):  # True or a WarmupPlan
            from .warmup import make_warmup

            fn = make_warmup(None if warmup is True else warmup)
        else:
            fn = warmup
    except BaseException as e:
        send(("fatal", _encode_error(e), traceback.format_exc()))
        send.flush()
        return
    send(("hello", {"max_model_len": engine.max_model_len, "mcfg": engine.mcfg, "k": engine.k,
                    "spec_on": engine.spec_on, "describe": engine.describe(),
                    "warmup": {"state": "off"} if fn is None else {"state": "pending"}}))
    loop = _ChildLoop(engine, send, fn)
    try:
        while True:
            try:
                msg = cmd.recv()
            except (EOFError, OSError):
                break
            op = msg[0]
            if op == "add":
                _, call, rid, prompt, params, submitted, received = msg
                try:
                    loop.admit(prompt, params, rid, _Sub(None, None, rid, received, submitted))  # type: ignore[arg-type]
                    send(("ack", call, None))
                except BaseException as e:
                    send(("ack", call, _encode_error(e)))
            elif op == "abort":
                loop.abort(msg[1])
                loop.forget(msg[1])
            elif op == "cancel_all":
                loop.cancel_all(msg[1])
            elif op == "call":
                _, call, name = msg
                try:
                    value = _snapshot(engine, loop) if name == "snapshot" else engine.reset_prefix_cache()
                    send(("reply", call, value, None))
                except BaseException as e:
                    send(("reply", call, None, _encode_error(e)))
            elif op == "close":
                break
    finally:
        loop.close()
        send.flush()
        with contextlib.suppress(Exception):
            engine.close()
