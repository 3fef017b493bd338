"""Ready means ready (#28 item 5): `specbench serve` reports starting until its warm-up has run.

On CPU (no graphs, nothing compiled) the warm-up is the same code over the tiny pair: /health 503
"starting" before it and 200 `ready: true` after, a request during it answered 503 code "starting" with
Retry-After (never a crash, never a stalled server), `--no-warmup` / warmup=False ready at once, a failed
warm-up recorded while the server serves, the engine's counters and RNG untouched by it, and the openai
adapter waiting while /health answers 503.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from specbench.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from specbench.harness.adapters import GenRequest
from specbench.harness.adapters.openai_api import READY_POLL_S, OpenAIAdapter
from specbench.harness.adapters.prom import parse_prometheus
from specbench.harness.server import ServerThread, WarmupPlan, make_app
from specbench.harness.server.warmup import default_plan, kernel_caches, run_warmup

PLAN = WarmupPlan(batch_sizes=(1, 2, 3), long_prompt=300, extra={"span": 5})


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, _ = tiny_pair
    return LLMEngine(EngineConfig(model=target, spec=SpecConfig(method="ngram"), num_pages=128))


WAIT_S = 300.0  # hang guards only: each wait ends on an event


def gated(gate: threading.Event, plan: WarmupPlan = PLAN, fail: bool = False,
          entered: threading.Event | None = None):
    def warmup(engine, stop, progress):
        progress(phase="gated")
        if entered is not None:
            entered.set()
        gate.wait(WAIT_S)
        if fail:
            raise RuntimeError("boom in the warm-up")
        return run_warmup(engine, stop, progress, plan)

    return warmup


def _idle(engine) -> bool:
    return not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_pages and not engine.requests


def _samples(text: str) -> dict[str, float]:
    """name -> value of the samples labelled model_name="tiny" (one series per name here)."""
    return {n: v for n, lab, v in parse_prometheus(text) if lab.get("model_name") == "tiny" and len(lab) == 2}


def test_starting_then_ready_and_requests_meanwhile(engine):
    gate, entered = threading.Event(), threading.Event()
    app, loop = make_app(engine, served_name="tiny", warmup=gated(gate, entered=entered))
    srv = ServerThread(app).start(ready=False)
    try:
        assert entered.wait(WAIT_S)  # the warm-up runs (and holds on the gate)
        h = httpx.get(srv.url + "/health", timeout=5)
        assert h.status_code == 503 and h.headers["retry-after"] == "5"
        body = h.json()
        assert body["status"] == "starting" and body["ready"] is False
        assert body["warmup"]["state"] == "running" and body["warmup"]["phase"] == "gated"
        assert "elapsed_s" in body["warmup"]
        # completions and chat during the warm-up: a prompt 503 "starting", many at once, none stalls (a request
        # that waited for the warm-up would wait for the gate: the client's read timeout)
        with httpx.Client(timeout=30) as c:
            rs = [c.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) for _ in range(20)]
            rs.append(c.post(srv.url + "/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
            rs.append(c.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}))
            assert c.get(srv.url + "/v1/models").status_code == 200  # metadata routes answer meanwhile
            assert c.post(srv.url + "/tokenize", json={"prompt": "hi"}).json()["count"] > 0
        for r in rs:
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            err = r.json()["error"]
            assert err["code"] == "starting" and err["type"] == "service_unavailable_error"
            assert "warming up" in err["message"] and "/health" in err["message"]
        assert loop.num_pending == 0 and not engine.has_unfinished()
        gate.set()
        srv.wait_ready(WAIT_S)
        h = httpx.get(srv.url + "/health", timeout=5).json()
        assert h["status"] == "ok" and h["ready"] is True
        w = h["warmup"]
        assert w["state"] == "done" and w["seconds"] >= 0 and w["requests"] > 0 and w["steps"] > 0
        names = [p["name"] for p in w["phases"]]
        assert names[:3] == ["batch-1-r0", "batch-1-r1", "batch-1-r2"] and "batch-3" in names
        assert "logprobs" in names and "long" in names
        assert w["counted"]["num_drafts"] > 0  # the n-gram proposer drafted: verify spans ran
        assert set(w["caches"]) >= {"flashinfer_jit", "triton"}
        # counters start from zero at ready: the warm-up is not served traffic
        m = _samples(httpx.get(srv.url + "/metrics", timeout=5).text)
        assert m["vllm:prompt_tokens_total"] == 0 and m["vllm:spec_decode_num_drafts_total"] == 0
        assert m["vllm:time_to_first_token_seconds_count"] == 0  # nor in the histograms
        assert _idle(engine)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _samples(httpx.get(srv.url + "/metrics").text)["vllm:prompt_tokens_total"] == 3
    finally:
        gate.set()
        srv.stop()
        loop.close()


def test_no_warmup_is_ready_at_once(engine):
    app, loop = make_app(engine, served_name="tiny", warmup=False)
    try:
        assert loop.ready
        with ServerThread(app) as srv:
            h = httpx.get(srv.url + "/health", timeout=5)
            assert h.status_code == 200 and h.json()["ready"] is True and h.json()["warmup"] == {"state": "off"}
    finally:
        loop.close()


def test_failed_warmup_is_recorded_and_the_server_serves(engine):
    opened = threading.Event()
    opened.set()
    app, loop = make_app(engine, served_name="tiny", warmup=gated(opened, fail=True))
    try:
        with ServerThread(app) as srv:  # start() waits for ready
            h = httpx.get(srv.url + "/health", timeout=5).json()
            assert h["ready"] is True and h["warmup"]["state"] == "failed"
            assert "boom in the warm-up" in h["warmup"]["error"]
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
    finally:
        loop.close()


def test_warmup_leaves_the_engine_as_it_found_it(engine):
    state = engine._gen.get_state().clone()
    engine.metrics.prompt_tokens = 7
    rec = run_warmup(engine, plan=WarmupPlan(batch_sizes=(1, 2), extra={"span": 5}))
    assert torch_equal(engine._gen.get_state(), state)  # every sampled warm-up request had its own seed
    assert engine.metrics.prompt_tokens == 0 and engine.metrics.requests_finished == 0
    assert rec["counted"]["requests_finished"] == rec["requests"] == 10  # 1 x 3 + 2 x 2 (every kind), 3 logprobs
    assert _idle(engine)
    # the same greedy request before and after: the warm-up changes no output
    out = engine.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=6))[0].output_ids
    run_warmup(engine, plan=WarmupPlan(batch_sizes=(2,), logprobs=False, extra={"span": 5}))
    assert engine.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=6))[0].output_ids == out


def test_warmup_stops_and_cleans_up(engine):
    stop = threading.Event()
    seen = []

    def progress(**kw):
        seen.append(kw["phase"])
        if len(seen) == 2:
            stop.set()

    rec = run_warmup(engine, stop, progress, WarmupPlan(batch_sizes=(1, 2, 4), extra={"span": 5}))
    assert rec["phases"][-1]["name"] == "stopped" and len(rec["phases"]) == 2
    assert _idle(engine)


def test_warmup_skips_what_the_engine_refuses(engine):
    rec = run_warmup(engine, plan=WarmupPlan(batch_sizes=(1,), logprobs=False, long_prompt=10**6, extra={"span": 5}))
    long = [p for p in rec["phases"] if p["name"] == "long"][0]
    assert "skipped" in long and _idle(engine)


def test_default_plan_on_cpu(engine):
    plan = default_plan(engine)
    assert plan.batch_sizes == (1, 2) and plan.long_prompt == 0 and plan.prompt_len == 5  # ngram: span K + 1
    caches = kernel_caches()
    assert caches["flashinfer_jit"].endswith(".cache/flashinfer") and caches["triton"]


class _On503:
    """The app, calling `seen()` when it answers /health with 503 (the warm-up is opened on that event)."""

    def __init__(self, app, seen) -> None:
        self.app, self.state, self.seen = app, app.state, seen

    async def __call__(self, scope, receive, send):
        async def spy(msg):
            if scope.get("path") == "/health" and msg["type"] == "http.response.start" and msg["status"] == 503:
                self.seen()
            await send(msg)

        await self.app(scope, receive, spy)


def test_openai_adapter_waits_for_ready(engine):
    gate = threading.Event()
    app, loop = make_app(engine, served_name="tiny", warmup=gated(gate, WarmupPlan(batch_sizes=(1,), extra={"span": 5})))
    srv = ServerThread(_On503(app, gate.set)).start(ready=False)  # the warm-up ends once the adapter saw a 503
    try:
        ad = OpenAIAdapter(srv.url, ready_timeout=WAIT_S, probe=True)
        r = ad.generate_sync([GenRequest(prompt=[5, 6, 7], max_tokens=3, temperature=0.0)])[0]
        assert r.ok and len(r.output_ids) == 3
        assert ad.ready["health"] == 200 and ad.ready["warmup"]["state"] == "done"
        assert ad.ready["waited_s"] >= READY_POLL_S  # it polled again after the 503
        assert ad.describe()["ready"]["health"] == 200
        assert ad.caps is not None and ad.caps.dialect == "specbench" and not ad.caps.errors
    finally:
        gate.set()
        srv.stop()
        loop.close()


def test_openai_adapter_ready_timeout_fails_requests_clearly(engine):
    gate = threading.Event()
    app, loop = make_app(engine, served_name="tiny", warmup=gated(gate))
    srv = ServerThread(app).start(ready=False)
    try:
        ad = OpenAIAdapter(srv.url, model="tiny", ready_timeout=1)
        r = ad.generate_sync([GenRequest(prompt="hi", max_tokens=2)])[0]
        assert not r.ok and "not ready within 1 s" in r.error and "503" in r.error
        assert ad.ready["timed_out"] is True
        assert OpenAIAdapter(srv.url, model="tiny").ready is None  # ready_timeout=0: never asks
    finally:
        gate.set()
        srv.stop()
        loop.close()


def test_serve_cli_passes_no_warmup(monkeypatch, tiny_pair):
    import typer
    from typer.testing import CliRunner

    import specbench.harness.server as server_mod
    from specbench.cli.serve import serve

    seen = {}

    def fake_serve(engine, **kw):
        seen.update(kw)
        if kw.get("app") is not None:  # the engine process the CLI started: the real serve's shutdown closes it
            kw["app"].state.sb.loop.close()

    monkeypatch.setattr(server_mod, "serve", fake_serve)
    app = typer.Typer()
    app.command()(serve)
    runner = CliRunner()
    assert runner.invoke(app, ["--model", tiny_pair[0], "--spec", "off", "--num-pages", "32"]).exit_code == 0
    assert seen["warmup"] is True
    r = runner.invoke(app, ["--model", tiny_pair[0], "--spec", "off", "--num-pages", "32", "--no-warmup"])
    assert r.exit_code == 0 and seen["warmup"] is False and "no warm-up" in r.output


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
