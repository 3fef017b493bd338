"""The engine process's wire, without a model: the child's step message drops what was aborted after the step
handed it over (no state kept for it), fails a request whose delta cannot be built, and the parent fails a
request whose first delta never came instead of leaving its consumer waiting; the in-process gauges count the
admission inbox."""

from __future__ import annotations

import pickle
import threading
import time

from specbench.engine.output import RequestOutput
from specbench.harness.adapters.loop import EngineLoop, _Sub
from specbench.harness.server.engine_child import _ChildLoop, _Sender

WAIT_S = 120.0  # hang guards only: each wait ends on an event


class _Conn:
    def __init__(self) -> None:
        self.msgs: list[tuple] = []

    def send(self, msg: tuple) -> None:
        self.msgs.append(pickle.loads(pickle.dumps(msg)))


class _Idle:
    """An engine with nothing to do: the loop thread only idles."""

    def __init__(self) -> None:
        self.requests: dict = {}
        self.aborted: list[str] = []

    def has_unfinished(self) -> bool:
        return False

    def add_request(self, prompt, params=None, rid=None) -> str:
        self.requests[rid] = prompt
        return rid

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return self.requests.pop(rid, None) is not None


def _out(rid: str, n: int, finished: bool = False, ids=None) -> RequestOutput:
    ids = list(range(100, 100 + n)) if ids is None else ids
    return RequestOutput(rid=rid, prompt_ids=[1, 2, 3], output_ids=ids, text="x" * n, finished=finished,
                         finish_reason="length" if finished else None, stop_reason=None, new_ids=ids[-1:],
                         arrival=0.0, token_times=[0.0] * n, spec={})


def _child() -> tuple[_ChildLoop, _Conn, _Idle]:
    conn, eng = _Conn(), _Idle()
    return _ChildLoop(eng, _Sender(conn, threaded=False), None), conn, eng


def _steps(conn: _Conn) -> list[tuple]:
    return [d for m in conn.msgs if m[0] == "step" for d in m[1]]


def test_an_output_aborted_after_the_step_handed_it_over_sends_nothing() -> None:
    loop, conn, _ = _child()
    try:
        sub = _Sub(None, None, "a", 0.0, 0.0)
        loop.admit([1, 2, 3], None, "a", sub)
        loop._emit([(sub, _out("a", 1))])  # the first delta, with the prompt head
        loop.abort("a")  # the parent's abort lands between the step's consumer lookup and its hand-over ...
        loop.forget("a")
        loop._emit([(sub, _out("a", 2))])  # ... so this hand-over comes after the forget
        assert [(d[0], d[1] is not None) for d in _steps(conn)] == [("a", True)]
        assert loop._sent == {}  # nothing left that no finished output would ever free
        # the rid used again: the old consumer's late output does not go out as the new request's start
        new = _Sub(None, None, "a", 0.0, 0.0)
        loop.admit([4, 5], None, "a", new)
        loop._emit([(sub, _out("a", 3))])
        assert len(_steps(conn)) == 1 and loop._sent == {}
        loop._emit([(new, _out("a", 1, finished=True))])  # a finished output still goes out (its consumer is gone)
        assert _steps(conn)[-1][0] == "a" and _steps(conn)[-1][7] is True and loop._sent == {}
    finally:
        loop.close()


def test_a_step_built_after_a_later_step_finished_its_request_still_goes_out() -> None:
    """The sender thread behind the step thread: step 1's message is built only after step 2 finished the request
    (the loop thread has dropped its consumer by then). Step 1's tokens go out in their own delta, not merged into
    the finishing one: one streamed event per engine step (the sweep's audit reads each event as one step)."""
    conn, eng, gate = _Conn(), _Idle(), threading.Event()
    loop = _ChildLoop(eng, _Sender(conn, threaded=True), None)
    try:
        sub = _Sub(None, None, "a", 0.0, 0.0)
        loop.admit([1, 2, 3], None, "a", sub)
        loop._send.later(lambda: (gate.wait(), None)[1])  # the sender thread is busy until the gate opens
        loop._emit([(sub, _out("a", 1))])
        loop._emit([(sub, _out("a", 3))])  # step 2: two more tokens
        with loop._lock:
            del loop._subs["a"]  # step 3 finishes the request: the loop thread lets go of its consumer ...
        loop._emit([(sub, _out("a", 4, finished=True))])  # ... and hands over its output
        gate.set()
        loop._send.flush(WAIT_S)
        assert [(d[0], d[2]) for d in _steps(conn)] == [("a", [100]), ("a", [101, 102]), ("a", [103])]
        assert loop._sent == {} and loop._finished == {}
        # an abort still drops what the step handed over before it
        other = _Sub(None, None, "b", 0.0, 0.0)
        loop.admit([1], None, "b", other)
        gate.clear()
        loop._send.later(lambda: (gate.wait(), None)[1])
        loop._emit([(other, _out("b", 1))])
        loop.abort("b")
        gate.set()
        loop._send.flush(WAIT_S)
        assert [d[0] for d in _steps(conn)] == ["a", "a", "a"] and "b" in eng.aborted
    finally:
        loop.close()


def test_a_delta_that_cannot_be_built_fails_its_request() -> None:
    loop, conn, eng = _child()
    try:
        good, bad = _Sub(None, None, "g", 0.0, 0.0), _Sub(None, None, "b", 0.0, 0.0)
        loop.admit([1], None, "g", good)
        loop.admit([1], None, "b", bad)
        loop._emit([(bad, _broken("b")), (good, _out("g", 1))])
        assert [d[0] for d in _steps(conn)] == ["g"]  # the others' deltas still go out
        fails = [m for m in conn.msgs if m[0] == "fail"]
        assert [(m[1], m[2]) for m in fails] == [("b", "failure")] and "b" in eng.aborted
        assert "b" not in loop._subs and "b" not in loop._sent
    finally:
        loop.close()


def _broken(rid: str) -> RequestOutput:
    out = _out(rid, 1)
    out.output_ids = None  # type: ignore[assignment]  # slicing it raises in _delta
    return out


def test_the_parent_fails_a_request_whose_first_delta_never_came() -> None:
    from specbench.harness.server.engine_proc import ProcEngineLoop

    got: list = []

    class _Loop:  # an event loop stand-in: the hand-over runs at once
        def call_soon_threadsafe(self, fn, *a):
            fn(*a)

    class _Q:
        def put_nowait(self, item):
            got.append(item)

    parent = ProcEngineLoop.__new__(ProcEngineLoop)  # only the relay's state: no child process
    parent._lock, parent._subs, parent._accs = threading.Lock(), {}, {}
    parent.on_scheduled = parent.on_finish = None
    parent.batch_delivery = True
    sub = _Sub(_Loop(), _Q(), "a", time.perf_counter(), 0.0)
    parent._subs["a"] = sub
    parent._step([("a", None, [7], [0.0], None, True, "x", False, None, None, None, None)], [])
    assert "a" not in parent._subs and len(got) == 1 and isinstance(got[0][1], Exception)


def test_in_process_gauges_count_the_inbox(monkeypatch) -> None:
    from specbench.engine import LLMEngine, SamplingParams
    from specbench.engine.config import EngineConfig, SpecConfig
    from specbench.harness.fixtures import bundled_pair

    target, _ = (str(p) for p in bundled_pair())
    e = LLMEngine(EngineConfig(model=target, spec=SpecConfig(method=None), num_pages=64))
    loop = EngineLoop(e)
    try:
        with e._lock:  # a step in flight
            t = threading.Thread(target=e.add_request, args=("hello", SamplingParams(max_tokens=2)), kwargs={"rid": "r"})
            t.start()
            t.join(WAIT_S)  # the inbox: add_request does not wait for the lock held here
            assert not t.is_alive()
            loop.refresh_gauges()
            assert e.num_waiting() == 1 and e.metrics.num_waiting == 1
    finally:
        loop.close()


def test_the_sender_backlog_is_bounded_and_the_thread_never_waits_on_itself() -> None:
    gate, sent, stuck = threading.Event(), [], threading.Event()

    class _Slow:
        def send(self, msg: tuple) -> None:
            stuck.set()
            gate.wait(WAIT_S)  # a parent that has fallen behind
            sent.append(msg)

    snd = _Sender(_Slow(), threaded=True, backlog=2)
    snd(("m", 0))  # taken by the thread, stuck in send
    assert stuck.wait(WAIT_S)
    snd(("m", 1))
    snd(("m", 2))  # the backlog is full now
    third = threading.Thread(target=snd, args=(("m", 3),))
    third.start()
    third.join(0.2)
    assert third.is_alive(), "a full backlog must make the caller wait"

    def make() -> tuple:  # a message whose building sends another (the failure path): no self-deadlock
        snd.later(lambda: ("inner",))
        return ("outer",)

    gate.set()
    third.join(WAIT_S)
    done = threading.Thread(target=snd.later, args=(make,))
    done.start()
    done.join(WAIT_S)
    snd.flush(WAIT_S)
    assert sent[:4] == [("m", 0), ("m", 1), ("m", 2), ("m", 3)] and sent[4:] == [("inner",), ("outer",)]
