"""`specbench serve` as something you leave running (#23): nothing slow on the event loop, metrics by
prometheus_client with vLLM's names, gauges right after mass aborts, API key, CORS, x-request-id, and
chat templates in jinja2's sandbox.

The event-loop checks are not timings: the slow part (a tokenization, an engine step) is held on an
Event while /health is asked, so the test fails (a read timeout) exactly when that part runs on the loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import held_engine
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specbench.engine import EngineConfig, LLMEngine, SpecConfig
from specbench.harness.server import ServerOptions, ServerThread, make_app
from specbench.harness.server.chat import probe_template

MODEL = "tiny"
KEY = "sk-test-23"


def _engine(tiny_pair, **kw) -> LLMEngine:
    target, draft = tiny_pair
    draft = draft if draft and Path(draft).is_dir() else None
    spec = SpecConfig(method="dflash" if draft else "ngram")
    return LLMEngine(EngineConfig(model=target, draft=draft, spec=spec, num_pages=kw.pop("num_pages", 512), **kw))


@pytest.fixture(scope="module")
def served(tiny_pair):
    eng = _engine(tiny_pair, num_pages=4096)  # room for 64 long requests at once
    app, loop = make_app(eng, served_name=MODEL, max_pending=128)
    srv = ServerThread(app).start()
    yield SimpleNamespace(url=srv.url, engine=eng, loop=loop, state=app.state.sb)
    srv.stop()
    loop.close()


def families(url: str, headers: dict | None = None) -> dict:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    f = fams[family]
    name = sample or f.name
    hits = [s.value for s in f.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, name, labels, f.samples)
    return hits[0]


WAIT_S = 120.0  # hang guards only: the waits below end on events (idle, entered, every stream started)
ROUTE_S = 10.0  # a route that must answer while something is held far longer (WAIT_S)


def wait_idle(served, timeout: float = WAIT_S) -> None:
    eng, t0 = served.engine, time.monotonic()
    while time.monotonic() - t0 < timeout:
        if served.loop.num_pending == 0 and not eng.has_unfinished() and eng.pool.num_free == eng.pool.num_pages:
            return
        time.sleep(0.02)
    raise AssertionError(f"not idle: pending={served.loop.num_pending} free={eng.pool.num_free}/{eng.pool.num_pages}")


# ---- nothing slow on the event loop --------------------------------------------------------------------------
def test_health_answers_while_a_request_tokenizes(served, monkeypatch):
    tok = served.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    real = tok.encode

    def slow_encode(text):
        if text.startswith("BLOCK"):
            entered.set()
            release.wait(WAIT_S)
        return real(text)

    monkeypatch.setattr(tok, "encode", slow_encode)
    with httpx.Client(timeout=WAIT_S) as c:
        t = threading.Thread(target=lambda: c.post(served.url + "/v1/completions",
                                                   json={"prompt": "BLOCK me", "max_tokens": 2}))
        t.start()
        try:
            assert entered.wait(WAIT_S)
            # while the tokenization is held (until release), every other route answers; on the loop they would
            # wait for the release: a ReadTimeout here (a bound far above a loaded machine's answer, far below it)
            assert httpx.get(served.url + "/health", timeout=ROUTE_S).status_code == 200
            assert httpx.get(served.url + "/metrics", timeout=ROUTE_S).status_code == 200
            r = httpx.post(served.url + "/tokenize", json={"prompt": "hello"}, timeout=ROUTE_S)
            assert r.status_code == 200 and r.json()["count"] > 0
        finally:
            release.set()
            t.join(WAIT_S)
    wait_idle(served)


def test_health_answers_while_the_engine_holds_its_lock(served, monkeypatch):
    """A long prefill holds the engine's lock for the whole step; admitting a request waits for it (or, with the
    admission inbox, leaves it there), but on a worker thread: /health and the other routes keep answering."""
    eng = served.engine
    done: dict = {}
    admitting = threading.Event()
    real = eng.add_request

    def add_request(*a, **kw):
        admitting.set()
        return real(*a, **kw)

    monkeypatch.setattr(eng, "add_request", add_request)
    with eng._lock:  # as a long step does
        t = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
            served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)))
        t.start()
        assert admitting.wait(WAIT_S)  # the request reached add_request while the lock is held
        assert httpx.get(served.url + "/health", timeout=ROUTE_S).status_code == 200
        assert httpx.get(served.url + "/v1/models", timeout=ROUTE_S).status_code == 200
    t.join(WAIT_S)
    assert done["r"].status_code == 200
    wait_idle(served)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(served, monkeypatch):
    calls = []
    monkeypatch.setattr(served.engine.tokenizer, "encode", lambda text: calls.append(len(text)) or [1])
    huge = "x" * (256 * served.engine.max_model_len + 1)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": huge, "max_tokens": 1}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "characters" in err["message"] and not calls


# ---- metrics --------------------------------------------------------------------------------------------------
def test_metrics_names_histograms_and_invariants(served, gsm8k_prompts):
    wait_idle(served)
    before = families(served.url)
    n = 6
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            r = c.post(served.url + "/v1/completions", json={"prompt": gsm8k_prompts[i], "max_tokens": 12,
                                                             "temperature": 0, "ignore_eos": True,
                                                             "stream": i % 2 == 0})
            assert r.status_code == 200
    wait_idle(served)
    after = families(served.url)
    lab = {"model_name": MODEL, "engine": "0"}

    def delta(family: str, sample: str | None = None, **kw: str) -> float:
        return value(after, family, sample, **lab, **kw) - value(before, family, sample, **lab, **kw)

    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == n
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:request_generation_tokens", "vllm:request_prompt_tokens"):
        assert after[h].type == "histogram", h
        assert delta(h, h + "_count") == n, h
        assert value(after, h, h + "_bucket", le="+Inf", **lab) == value(after, h, h + "_count", **lab)
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 12 * n
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 12 * n
    itl = delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    steps = delta("specbench:spec_decode_tokens_per_step", "specbench:spec_decode_tokens_per_step_count")
    # one ITL per step after the first token; each verify step commits 1..K+1 tokens
    assert 0 < itl <= 11 * n and steps <= itl + n
    drafts = value(after, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total", **lab)
    accepted = value(after, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total",
                     **lab)
    proposed = value(after, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total", **lab)
    per_pos = sorted((int(s.labels["position"]), s.value)
                     for s in after["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
                     if s.name.endswith("_total"))
    assert drafts > 0 and accepted <= proposed
    assert sum(v for _, v in per_pos) == accepted
    assert all(a >= b for (_, a), (_, b) in zip(per_pos, per_pos[1:], strict=False))
    for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "specbench:requests_in_flight"):
        assert after[g].type == "gauge" and value(after, g, **lab) == 0, g
    assert value(after, "specbench:kv_pages_free", **lab) == value(after, "specbench:kv_pages_total", **lab)


def test_label_escaping_by_the_library(tiny_pair):
    name = 'we"ird\\name\nx'
    eng = _engine(tiny_pair, num_pages=64)
    app, loop = make_app(eng, served_name=name)
    try:
        with ServerThread(app) as srv:
            fams = families(srv.url)  # the reference parser: raises on a malformed exposition
            assert value(fams, "vllm:num_requests_running", model_name=name) == 0
    finally:
        loop.close()


def test_64_streams_aborted_mid_flight_leave_every_gauge_at_zero(served, gsm8k_prompts, tmp_path, monkeypatch):
    """64 streams, each left by its client after its first token: every one is aborted, every gauge returns to 0.
    The engine is held once every request has its first token (tests/held_engine.py) until the server has
    taken every disconnect, so no stream can finish before its client leaves, however fast the machine."""
    wait_idle(served)
    gate = tmp_path / "open"
    monkeypatch.setattr(served.loop, "engine", held_engine.HeldEngine(served.engine, gate))
    fams0 = families(served.url)
    lab = {"model_name": MODEL, "engine": "0"}
    aborted0 = value(fams0, "vllm:request_success", "vllm:request_success_total", finished_reason="abort", **lab)
    n = 64

    async def one(c: httpx.AsyncClient, i: int, started: asyncio.Event, counter: list) -> None:
        body = {"prompt": gsm8k_prompts[i % len(gsm8k_prompts)], "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with c.stream("POST", served.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    counter[0] += 1
                    if counter[0] >= n:
                        started.set()
                    await started.wait()  # every stream is mid-flight before anyone leaves
                    return  # leaving the block closes the connection mid-stream

    async def main() -> None:
        started, counter = asyncio.Event(), [0]
        async with httpx.AsyncClient(timeout=WAIT_S, limits=httpx.Limits(max_connections=n + 8)) as c:
            await asyncio.wait_for(asyncio.gather(*[one(c, i, started, counter) for i in range(n)]), WAIT_S)

    asyncio.run(main())
    t0 = time.monotonic()
    while served.loop.num_pending and time.monotonic() - t0 < WAIT_S:  # the server took every disconnect ...
        time.sleep(0.02)
    assert served.loop.num_pending == 0
    gate.touch()  # ... and only then may the engine step on (it applies the aborts after that step)
    while True:
        fams = families(served.url)
        gauges = {g: value(fams, g, **lab) for g in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                     "vllm:kv_cache_usage_perc", "specbench:requests_in_flight")}
        if all(v == 0 for v in gauges.values()) or time.monotonic() - t0 > WAIT_S:
            break
        time.sleep(0.05)
    assert all(v == 0 for v in gauges.values()), gauges
    assert value(fams, "specbench:kv_pages_free", **lab) == value(fams, "specbench:kv_pages_total", **lab)
    eng = served.engine
    assert eng.pool.num_free == eng.pool.num_pages and not eng.has_unfinished() and not eng.requests
    aborted = value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort", **lab)
    assert aborted - aborted0 == n


# ---- API key, CORS, x-request-id -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tiny_pair):
    eng = _engine(tiny_pair, num_pages=128)
    opts = ServerOptions(api_key=KEY, metrics_need_key=True, allowed_origins=("https://ui.example",))
    app, loop = make_app(eng, served_name=MODEL, options=opts)
    srv = ServerThread(app).start()
    yield SimpleNamespace(url=srv.url, engine=eng, loop=loop)
    srv.stop()
    loop.close()


def test_api_key_guards_every_route_but_health(guarded):
    u = guarded.url
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(u + "/health").status_code == 200
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "a"}),
                               ("POST", "/v1/chat/completions", {"messages": []}), ("POST", "/tokenize", {}),
                               ("GET", "/metrics", None), ("GET", "/nonexistent", None)):
        for headers, what in (({}, "no API key"), ({"Authorization": "Bearer nope"}, "wrong"),
                              ({"Authorization": KEY}, "not 'Bearer")):
            r = httpx.request(method, u + path, json=body, headers=headers)
            err = r.json()["error"]
            assert r.status_code == 401 and err["code"] == "invalid_api_key", (path, r.text)
            assert err["type"] == "authentication_error" and what in err["message"]
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(u + "/v1/models", headers=ok).status_code == 200
    assert httpx.get(u + "/metrics", headers=ok).status_code == 200
    r = httpx.post(u + "/v1/completions", headers=ok, json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_metrics_open_by_default_and_key_from_env(tiny_pair, monkeypatch):
    monkeypatch.setenv("SPECBENCH_API_KEY", "from-env")
    opts = ServerOptions.from_env(None)
    assert opts.api_key == "from-env" and ServerOptions.from_env("given").api_key == "given"
    eng = _engine(tiny_pair, num_pages=64)
    app, loop = make_app(eng, served_name=MODEL, options=opts)
    try:
        with ServerThread(app) as srv:
            assert httpx.get(srv.url + "/metrics").status_code == 200
            assert httpx.get(srv.url + "/v1/models").status_code == 401
            assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    finally:
        loop.close()


def test_cors(guarded, served):
    pre = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(guarded.url + "/v1/completions", headers=pre)  # a preflight needs no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = httpx.get(guarded.url + "/v1/models", headers={"Origin": "https://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = httpx.get(guarded.url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    # without --allowed-origins: no CORS headers at all
    r = httpx.get(served.url + "/health", headers={"Origin": "https://ui.example"})
    assert "access-control-allow-origin" not in r.headers


def test_x_request_id_is_honoured_and_echoed(served):
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                   headers={"x-request-id": "job-42.a"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "job-42.a"
    assert r.json()["id"] == "cmpl-job-42.a"
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                             "max_tokens": 2, "stream": True},
                   headers={"x-request-id": "chat-7"}, timeout=30)
    assert r.headers["x-request-id"] == "chat-7" and '"id": "chatcmpl-chat-7"' in r.text
    # the same id twice at once never collides in the engine
    with httpx.Client(timeout=30) as c:
        rs = [c.post(served.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                     headers={"x-request-id": "dup"}) for _ in range(2)]
    assert [x.status_code for x in rs] == [200, 200]
    gen = httpx.get(served.url + "/health").headers["x-request-id"]  # made up when absent, echoed anyway
    assert len(gen) == 32
    r = httpx.get(served.url + "/v1/models", headers={"x-request-id": "has space"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
    r = httpx.get(served.url + "/v1/models", headers={"x-request-id": "x" * 129})
    assert r.status_code == 400 and r.headers["x-request-id"] != "x" * 129


# ---- chat templates in the sandbox ---------------------------------------------------------------------------
ESCAPE = "{{ cycler.__init__.__globals__.os.getcwd() }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_template_reaching_python_internals_is_refused(served, monkeypatch):
    import jinja2

    # the template does escape a plain Environment (what the server used to render with)
    assert os.getcwd() in jinja2.Environment().from_string(ESCAPE).render(messages=[])
    tok = served.engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", ESCAPE)
    msg = probe_template(tok)
    assert msg and "sandbox" in msg and "chat_template" in msg
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "chat_template_unsafe" and "sandbox" in err["message"]
    assert os.getcwd() not in r.text
    r = httpx.post(served.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "chat_template_unsafe"
    # mutating what the template is given is refused too (the immutable sandbox)
    monkeypatch.setattr(tok, "chat_template", "{% set _ = messages.append(1) %}x")
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "chat_template_unsafe"
    # raise_exception (the HF convention) is the request's problem: 400 naming messages
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('roles must alternate') }}")
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "roles must alternate" in err["message"]
    monkeypatch.undo()
    assert probe_template(tok) is None
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
