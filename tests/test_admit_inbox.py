"""`LLMEngine.add_request` while a step runs (issue 28: served TTFT): the request is checked and left in the
engine's inbox without waiting for the step lock, and the next step takes it in, in arrival order. The off
switch (EngineConfig.admit_inbox=False, SPECBENCH_ADMIT_INBOX=0) is the simple path it replaces: add_request waits for the step in flight."""

from __future__ import annotations

import threading

import pytest

from specbench.engine import LLMEngine, SamplingParams
from specbench.engine.config import ConfigError, EngineConfig, SpecConfig
from specbench.engine.scheduler import AdmissionError
from specbench.harness.fixtures import bundled_pair

TARGET, DRAFT = (str(p) for p in bundled_pair())
PROMPTS = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?", "a b c"]
WAIT_S = 120.0  # hang guards only: a waiting add_request would wait for a lock the test holds until after


def _engine(monkeypatch, inbox: bool, spec: bool = True) -> LLMEngine:
    monkeypatch.setenv("SPECBENCH_ADMIT_INBOX", "1" if inbox else "0")  # the default the config field reads
    return LLMEngine(EngineConfig(model=TARGET, draft=DRAFT if spec else None,
                                  spec=SpecConfig(method="dflash" if spec else None), prefix_cache=False))


def _add_in_thread(e: LLMEngine, prompt: str, rid: str) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def add() -> None:
        e.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), rid=rid)
        done.set()

    t = threading.Thread(target=add, daemon=True)
    t.start()
    return t, done


def test_add_request_does_not_wait_for_a_step_in_flight(monkeypatch) -> None:
    e = _engine(monkeypatch, inbox=True, spec=False)
    with e._lock:  # a step in flight on another thread holds this for its whole length
        t, done = _add_in_thread(e, PROMPTS[0], "r0")
        assert done.wait(WAIT_S), "add_request waited for the step lock"
        assert e.has_unfinished() and "r0" not in e.requests  # in the inbox, not yet scheduled
        assert e.num_waiting() == 1  # the gauges count it as waiting
    outs = e.step()
    assert [o.rid for o in outs] == ["r0"] and "r0" in e.requests and e.num_waiting() == 0
    t.join()


def test_no_step_in_flight_goes_straight_into_the_scheduler(monkeypatch) -> None:
    e = _engine(monkeypatch, inbox=True, spec=False)
    with e._lock:  # an arrival during a step waits in the inbox ...
        t, done = _add_in_thread(e, PROMPTS[0], "r0")
        assert done.wait(WAIT_S)
    t.join()
    e.add_request(PROMPTS[1], SamplingParams(max_tokens=4), rid="r1")  # ... and is scheduled before a later one
    assert [r.rid for r in e.scheduler.waiting] == ["r0", "r1"] and e.num_waiting() == 2 and "r1" in e.requests


class _SpyLock:
    """The engine's step lock, telling when someone asks for it and whether they would wait."""

    def __init__(self, lock) -> None:
        self._lock, self.asked = lock, threading.Event()
        self.blocking: list[bool] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread() is not threading.main_thread():
            self.blocking.append(blocking)
            self.asked.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def test_the_off_switch_waits_for_the_step(monkeypatch) -> None:
    e = _engine(monkeypatch, inbox=False, spec=False)
    assert not e.admit_inbox
    spy = e._lock = _SpyLock(e._lock)
    with e._lock:
        t, done = _add_in_thread(e, PROMPTS[0], "r0")
        assert spy.asked.wait(WAIT_S)  # add_request has asked for the step lock the test holds ...
        assert spy.blocking[0] is True and not done.is_set(), "with the inbox off, add_request must take the step lock"
    assert done.wait(WAIT_S)  # ... and got it once the "step" ended
    t.join()
    assert "r0" in e.requests and [o.rid for o in e.step()] == ["r0"]


@pytest.mark.parametrize("spec", [False, True])
def test_outputs_equal_the_simple_path(monkeypatch, spec: bool) -> None:
    """Requests added mid-run (one per step, some while the step lock is held) give the same tokens, text and
    finish as with the inbox off, and are scheduled in the same order."""
    runs = []
    for inbox in (True, False):
        e = _engine(monkeypatch, inbox, spec)
        params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (9, 17, 12, 5)]
        done: dict[str, tuple] = {}
        order: list[str] = []
        pending = list(enumerate(zip(PROMPTS, params, strict=True)))
        while pending or e.has_unfinished():
            if pending:
                i, (p, sp) = pending.pop(0)
                e.add_request(p, sp, rid=f"r{i}")
            for o in e.step():
                if o.rid not in order:
                    order.append(o.rid)
                if o.finished:
                    done[o.rid] = (o.output_ids, o.text, o.finish_reason)
        runs.append((done, order))
    assert runs[0] == runs[1] and len(runs[0][0]) == len(PROMPTS)


def test_refusals_are_raised_by_add_request(monkeypatch) -> None:
    e = _engine(monkeypatch, inbox=True, spec=False)
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=3), rid="dup")
    with pytest.raises(ConfigError, match="already in use"):  # still in the inbox
        e.add_request(PROMPTS[1], SamplingParams(max_tokens=3), rid="dup")
    with pytest.raises(AdmissionError, match="usable context"):
        e.add_request(PROMPTS[1], SamplingParams(max_tokens=10**6), rid="long")
    assert e.metrics.requests_rejected == 1
    e.step()
    with pytest.raises(ConfigError, match="already in use"):  # now scheduled
        e.add_request(PROMPTS[1], SamplingParams(max_tokens=3), rid="dup")


def test_abort_of_a_request_still_in_the_inbox(monkeypatch) -> None:
    e = _engine(monkeypatch, inbox=True, spec=False)
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=5), rid="a")
    e.add_request(PROMPTS[1], SamplingParams(max_tokens=5), rid="b")
    assert e.abort("a") is True and e.abort("a") is False and e.abort("nobody") is False
    rids = set()
    while e.has_unfinished():
        rids |= {o.rid for o in e.step()}
    assert rids == {"b"} and not e.requests and e.pool.num_free == e.pool.num_pages
