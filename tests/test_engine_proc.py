"""The server over an engine in a process of its own (harness/server/engine_proc.py) against the same server over
the engine in process: token-for-token equal greedy answers, the same 400s, disconnects that free the child's
requests, /metrics from the child, the warm-up's 503 -> 200, and a child killed mid-run failing fast, not hanging.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from types import SimpleNamespace

import held_engine
import httpx
import pytest

from specbench.engine import ConfigError, EngineConfig, LLMEngine, SamplingParams, SpecConfig
from specbench.engine.scheduler import AdmissionError
from specbench.harness.adapters.loop import EngineFailure
from specbench.harness.server import ServerThread, make_app, make_proc_app
from specbench.harness.server.engine_proc import ProcEngineLoop

MODEL = "tiny"
WAIT_S = 300.0  # hang guards only: the waits below end on events


def _cfg(target: str) -> EngineConfig:
    return EngineConfig(model=target, spec=SpecConfig(method="ngram"), num_pages=256)


@pytest.fixture(scope="module")
def pair(tiny_target, tmp_path_factory):
    gate = tmp_path_factory.mktemp("gate") / "open"
    gate.touch()  # open: the child's engine steps freely until a test shuts it (tests/held_engine.py)
    app, loop = make_proc_app(_cfg(tiny_target), served_name=MODEL, max_pending=64,
                              factory=held_engine.HeldFactory(str(gate)))
    proc = ServerThread(app).start()
    eng = LLMEngine(_cfg(tiny_target))
    app2, loop2 = make_app(eng, served_name=MODEL, max_pending=64)
    local = ServerThread(app2).start()
    yield SimpleNamespace(proc=proc, local=local, loop=loop, loop2=loop2, engine=loop.engine, gate=gate,
                          state=app.state.sb)
    proc.stop()
    loop.close()
    local.stop()
    loop2.close()


def _post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def _norm(r: httpx.Response) -> object:
    """The answer without what differs by construction (ids, timestamps)."""
    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("id", "created")}

    if r.headers.get("content-type", "").startswith("text/event-stream"):
        # per choice, its events in order (how two choices' events interleave depends on the batching)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        out: dict = {"rest": []}
        for ev in map(json.loads, events[:-1]):
            if ev.get("choices"):
                out.setdefault(ev["choices"][0]["index"], []).append(strip(ev))
            else:
                out["rest"].append(strip(ev))
        return out
    return strip(r.json())


def _same(a: object, b: object, where: str = "") -> None:
    """Equal, but for floats (logprobs) within 1e-4: the two engines may batch the prompts differently, which
    moves fp32 logprobs in their last bits; tokens and text must be identical."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-4), where
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _idle(engine, timeout: float = WAIT_S) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        snap = engine.refresh()
        if snap["requests"] == 0 and snap["free"] == snap["total"] and not snap["unfinished"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"the child's engine is not idle: {engine.refresh()}")


BODIES = [
    ("/v1/completions", {"prompt": ["Question: 2 + 3 =", "The cat sat on"], "max_tokens": 24, "temperature": 0,
                         "logprobs": 2, "return_token_ids": True}),
    ("/v1/completions", {"prompt": "Question: 2 + 3 =", "max_tokens": 32, "temperature": 0, "stop": [" the", "1"],
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": ["Question: 7 - 1 =", "x y z"], "max_tokens": 20, "temperature": 0,
                         "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 16, "temperature": 0, "echo": True,
                         "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 20,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 12,
                              "temperature": 0, "stream": True}),
]


@pytest.mark.parametrize("path,body", BODIES, ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _) in enumerate(BODIES)])
def test_greedy_answers_equal_the_in_process_server(pair, path, body):
    body = {"model": MODEL, **body}
    a, b = _post(pair.proc.url, path, body), _post(pair.local.url, path, body)
    assert a.status_code == b.status_code == 200, (a.text[:300], b.text[:300])
    _same(_norm(a), _norm(b))


def test_bad_requests_get_the_same_400(pair):
    n_ctx = pair.engine.max_model_len
    for body, param in (({"prompt": "hi", "max_tokens": n_ctx + 5}, "max_tokens"),
                        ({"prompt": [5] * (n_ctx + 1), "max_tokens": 1}, "prompt")):
        a = _post(pair.proc.url, "/v1/completions", {"model": MODEL, **body})
        b = _post(pair.local.url, "/v1/completions", {"model": MODEL, **body})
        assert a.status_code == b.status_code == 400
        assert a.json() == b.json() and a.json()["error"]["param"] == param


def test_the_childs_refusals_are_raised_by_submit(pair):
    """What only the engine checks comes back from the child synchronously, as the engine's own exception."""
    async def refusals(loop) -> list[type]:
        out = []
        for prompt, params in (([pair.engine.mcfg.vocab_size + 3], SamplingParams(max_tokens=2)),
                               ([5, 6, 7], SamplingParams(max_tokens=10 ** 6))):
            with pytest.raises((ConfigError, AdmissionError)) as e:
                loop.submit(prompt, params)
            out.append(type(e.value))
        return out

    assert asyncio.run(refusals(pair.loop)) == asyncio.run(refusals(pair.loop2)) == [ConfigError, AdmissionError]
    assert pair.loop.num_pending == 0
    with pytest.raises(EngineFailure, match="--no-engine-process"), pair.loop.exclusive():
        pass


def test_client_disconnect_frees_the_childs_request(pair):
    """The child's engine holds the request after its first token (the gate shut) until the parent took the
    client's leaving: it cannot finish on its own first, however fast the machine. It ends aborted, freed."""
    body = {"model": MODEL, "prompt": "Question: 1 + 1 =", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}
    aborts = pair.state.metrics.aborts
    pair.gate.unlink()
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", pair.proc.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token; leaving closes the connection
        t0 = time.monotonic()
        while pair.loop.num_pending and time.monotonic() - t0 < WAIT_S:  # the parent took the disconnect
            time.sleep(0.02)
        assert pair.loop.num_pending == 0
    finally:
        pair.gate.touch()
    _idle(pair.engine)
    t0 = time.monotonic()  # the child's "aborted" message reaches the parent's observer (a hang guard only)
    while pair.state.metrics.aborts == aborts and time.monotonic() - t0 < WAIT_S:
        time.sleep(0.02)
    assert pair.state.metrics.aborts == aborts + 1  # aborted, not finished
    assert httpx.get(pair.proc.url + "/health").status_code == 200


def test_metrics_come_from_the_child(pair):
    _post(pair.proc.url, "/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True})
    _idle(pair.engine)
    text = httpx.get(pair.proc.url + "/metrics").text

    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert value("vllm:generation_tokens_total") >= 5 and value("vllm:prompt_tokens_total") >= 3
    assert value("vllm:request_success_total") >= 1 and value("vllm:e2e_request_latency_seconds_count") >= 1
    assert value("vllm:num_requests_running") == 0 and value("specbench:requests_in_flight") == 0
    assert value("specbench:kv_pages_free") == value("specbench:kv_pages_total") > 0


def test_a_scrape_right_after_an_answer_counts_it(pair):
    """/metrics asked right after a response came back counts that request: each scrape fetches the child's figures
    afresh (a snapshot cached for 50 ms made the sweep's audit see a short request one request short)."""
    from specbench.suites.metrics_audit import summarize

    _idle(pair.engine)
    with httpx.Client(base_url=pair.proc.url, timeout=60) as c:  # one connection: a request takes milliseconds
        def counters() -> dict:
            return summarize(c.get("/metrics").text, MODEL)["counters"]

        for _ in range(6):
            c0 = counters()  # a fresh snapshot now; the request below takes far less than the old cache's 50 ms
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2, "temperature": 0,
                                                "ignore_eos": True})
            c1 = counters()
            u = r.json()["usage"]
            got = {k: c1[k] - c0[k] for k in ("requests_ok", "generation_tokens", "prompt_tokens")}
            assert got == {"requests_ok": 1, "generation_tokens": u["completion_tokens"],
                           "prompt_tokens": u["prompt_tokens"]}, got


def _wait_for(path: str, engine, stop, progress) -> dict:
    """A warm-up (picklable: it runs in the child) that lasts until the test creates `path`."""
    progress(phase="gated")
    while not os.path.exists(path) and not stop.is_set():
        time.sleep(0.02)
    return {"gated": True}


def test_warmup_then_ready_then_a_killed_child_fails_fast(tiny_target, tmp_path):
    gate = tmp_path / "go"
    held = tmp_path / "held"
    held.mkdir()
    app, loop = make_proc_app(_cfg(tiny_target), served_name=MODEL, warmup=functools.partial(_wait_for, str(gate)),
                              factory=held_engine.HeldFactory(str(held / "open")))  # never opened: held after a token
    srv = ServerThread(app).start(ready=False)
    try:
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "starting"
        r = _post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
        Path(gate).touch()
        assert loop.wait_ready(WAIT_S)
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 200 and h.json()["warmup"]["state"] == "done" and h.json()["warmup"]["gated"]

        got: dict = {"lines": []}
        first = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Question: 3 + 4 =", "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            try:
                # the read timeout is the hang detector: a stream the dead child leaves open ends in ReadTimeout
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            got["lines"].append(line)
                            first.set()
            except httpx.HTTPError as e:
                got["error"] = repr(e)
            finally:
                first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(WAIT_S) and got["lines"] and "error" not in got, got  # running: the engine holds it
        os.kill(loop.pid, signal.SIGKILL)
        t.join(WAIT_S)
        assert not t.is_alive(), "the stream hung after the engine process died"
        assert "error" not in got, got  # not the client's timeout: the server ended the stream
        assert '"error"' in got["lines"][-2] and got["lines"][-1] == "data: [DONE]", got["lines"][-3:]
        assert not loop.alive  # the reader marked the child dead before it failed the stream
        h = httpx.get(srv.url + "/health")
        assert h.status_code != 200 and "engine" in h.text
        assert "killed by signal" in (loop.last_error or "")
        r = _post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert r.status_code >= 500 and r.json()["error"]
        assert loop.num_pending == 0
    finally:
        srv.stop()
        loop.close()


def test_close_returns_after_the_childs_last_messages_are_handled(tiny_target, tmp_path):
    """The shutdown summary reads the abort count (the on_abort observer, fed by the child's "aborted" messages)
    right after `close()`. close() returned once the child had exited, while the reader thread could still be
    handling its last messages: "0 aborted" for a request the grace period cancelled. A slow observer widens
    that window; close() must wait for the reader, so the count is complete when it returns."""
    loop = ProcEngineLoop(_cfg(tiny_target), factory=held_engine.HeldFactory(str(tmp_path / "open")))
    seen: list[tuple[str, str]] = []

    def slow_observer(rid: str, reason: str) -> None:
        mp_wait([loop.proc.sentinel])  # a reader still busy with the abort when the child has exited ...
        time.sleep(0.5)  # ... and for a while after (only widens the window; the pass waits for no clock)
        seen.append((rid, reason))

    loop.on_abort = slow_observer

    async def held_then_cancelled() -> str:
        rid, q = loop.submit("Question: 1 + 1 =", SamplingParams(max_tokens=20, ignore_eos=True, temperature=0))
        _, first = await asyncio.wait_for(q.get(), WAIT_S)  # the first token; the engine holds the rest
        assert not first.finished and len(first.output_ids) == 1
        assert loop.cancel_all("grace period over") == 1
        loop.close()
        return rid

    try:
        rid = asyncio.run(held_then_cancelled())
    finally:
        loop.close()
    assert seen == [(rid, "abort")]
    assert not (tmp_path / "open").exists()


def test_the_switch_and_its_variable(monkeypatch):
    from specbench.cli.serve import DEFAULT_ENGINE_PROCESS, ENGINE_PROCESS_ENV, engine_process_choice

    monkeypatch.delenv(ENGINE_PROCESS_ENV, raising=False)
    assert engine_process_choice(None) is DEFAULT_ENGINE_PROCESS
    assert engine_process_choice(False) is False and engine_process_choice(True) is True
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "0")
    assert engine_process_choice(None) is False and engine_process_choice(True) is True
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "1")
    assert engine_process_choice(None) is True
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "yes")
    with pytest.raises(ValueError, match="SPECBENCH_ENGINE_PROCESS='yes' is invalid: expected 0 .* or 1"):
        engine_process_choice(None)


def test_the_servers_log_handler_outlives_a_swapped_and_closed_stderr(capsys) -> None:
    """`specbench serve` installs the "specbench" logger's handler before it spawns the engine process; run under
    a test runner's captured stderr (closed afterwards), a handler bound to that stream made every later engine
    log line a "--- Logging error ---" (ValueError: I/O operation on closed file) in unrelated tests."""
    import io
    import logging
    import sys

    from specbench.harness.server import setup_logging

    lg = logging.getLogger("specbench")
    saved = lg.handlers[:]
    lg.handlers.clear()
    try:
        old, sys.stderr = sys.stderr, io.StringIO()
        try:
            setup_logging("info")
            captured = sys.stderr
        finally:
            sys.stderr = old
        captured.close()
        logging.getLogger("specbench.engine").info("a line after the close")
        err = capsys.readouterr().err
        assert "Logging error" not in err and "a line after the close" in err
    finally:
        lg.handlers[:] = saved
