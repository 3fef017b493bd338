"""The client-side metrics audit (suites/metrics_audit.py): synthetic windows, then `specbench serve` over real
HTTP: an audited run passes, gauges return to zero after a client disconnects mid-stream and after a client
gives up on a non-streamed answer, and the audit catches a server whose gauges stay stale (the bug it
had before gauges were refreshed at each scrape) and counters that miss tokens.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from specbench.engine import EngineConfig, LLMEngine, SpecConfig
from specbench.harness.adapters import GenRequest
from specbench.harness.adapters.base import GenResult
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.server import ServerThread, make_app
from specbench.harness.server.metrics import EngineCollector
from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS
from specbench.suites import metrics_audit
from specbench.suites.metrics_audit import (
    audit_window,
    audited,
    busy_gauges,
    per_step_stream,
    scrape,
    settle,
    summarize,
)
from specbench.suites.sweep.audit import audit_records

MODEL = "tiny"

TEXT = """# TYPE vllm:request_success_total counter
vllm:request_success_total{model_name="tiny",finished_reason="stop"} 3
vllm:request_success_total{model_name="tiny",finished_reason="length"} 2
vllm:request_success_total{model_name="tiny",finished_reason="abort"} 4
vllm:request_success_total{model_name="other",finished_reason="stop"} 100
vllm:generation_tokens_total{model_name="tiny"} 90
vllm:prompt_tokens_total{model_name="tiny"} 50
vllm:num_requests_running{model_name="tiny"} 0
vllm:num_requests_waiting{model_name="tiny"} 0
vllm:kv_cache_usage_perc{model_name="tiny"} 0.0
vllm:spec_decode_num_drafts_total{model_name="tiny"} 20
vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 60
vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 30
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 15
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 10
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"} 5
"""


def _snap(requests_ok=0, gen=0, prompt=0, running=0.0, kv=0.0, drafts=0, accepted=0) -> dict:
    return {"counters": {"requests_ok": requests_ok, "generation_tokens": gen, "prompt_tokens": prompt},
            "gauges": {"vllm:num_requests_running": running, "vllm:num_requests_waiting": 0.0,
                       "vllm:kv_cache_usage_perc": kv},
            "names": ["vllm:request_success_total"],
            "spec": {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": accepted,
                     "accepted_per_pos": [accepted, 0, 0]}}


def _req(tokens: int, chunks: list[int], spec: dict | None = None, ok: bool = True) -> GenResult:
    return GenResult("r", ok, completion_tokens=tokens, prompt_tokens=10, chunk_tokens=chunks,
                     token_count_method="token_ids", spec=spec, finish_reason="length")


# ---- synthetic windows -----------------------------------------------------------------------------------
def test_summarize_reads_the_audited_families():
    s = summarize(TEXT, MODEL)
    assert s["counters"] == {"requests_ok": 5, "requests_not_ok": 4, "generation_tokens": 90, "prompt_tokens": 50}
    assert s["spec"]["num_accepted_tokens"] == 30 and not busy_gauges(s)
    assert summarize(TEXT.replace('running{model_name="tiny"} 0', 'running{model_name="tiny"} 2'),
                     MODEL)["gauges"]["vllm:num_requests_running"] == 2


def test_a_consistent_window_passes():
    reqs = [_req(12, [1, 3, 4, 4]), _req(8, [1, 2, 1, 4])]  # 12 tokens past the first of their chunk, 5 multi-token chunks
    w = audit_window(_snap(), _snap(2, 20, 20, drafts=6, accepted=12), reqs, k=3, per_step=True)
    assert w["verdict"] == PASS and not w["problems"] and not w["missing"], w
    assert any(c.startswith("tokens per chunk") for c in w["checks"])


@pytest.mark.parametrize("after, per_step, needle", [
    (_snap(1, 20, 20, drafts=6, accepted=12), True, "request counter delta 1"),
    (_snap(2, 17, 20, drafts=6, accepted=12), True, "output-token counter delta 17"),
    (_snap(2, 20, 26, drafts=6, accepted=12), True, "prompt-token counter delta 26"),
    (_snap(2, 20, 20, running=1.0, drafts=6, accepted=12), True, "vllm:num_requests_running = 1 (stale)"),
    (_snap(2, 20, 20, kv=0.25, drafts=6, accepted=12), True, "vllm:kv_cache_usage_perc = 0.25 (stale)"),
    (_snap(2, 20, 20, drafts=6, accepted=30), True, "accepted-token counter delta 30"),
    (_snap(2, 20, 20, drafts=30, accepted=12), True, "verify-step counter delta 30"),
    (_snap(2, 20, 20, drafts=6, accepted=7), True, "the counters miss accepted drafts"),
    (_snap(2, 20, 20, drafts=4, accepted=12), True, "5 streamed chunks carried several tokens"),
])
def test_a_disagreement_fails(after, per_step, needle):
    reqs = [_req(12, [1, 3, 4, 4]), _req(8, [1, 2, 1, 4])]
    w = audit_window(_snap(), after, reqs, k=3, per_step=per_step)
    assert w["verdict"] == FAIL and any(needle in p for p in w["problems"]), w["problems"]


def test_merged_chunks_are_reported_not_judged_where_the_stream_may_merge_steps():
    reqs = [_req(12, [1, 3, 4, 4]), _req(8, [1, 2, 1, 4])]
    w = audit_window(_snap(), _snap(2, 20, 20, drafts=6, accepted=7), reqs, k=3, per_step=False)
    assert w["verdict"] == PASS and any("not judged" in c for c in w["checks"])


def test_per_request_draft_counts_against_the_stream():
    reqs = [_req(12, [1, 3, 4, 4], spec={"num_drafts": 3, "num_accepted_tokens": 4}), _req(8, [1, 2, 1, 4])]
    w = audit_window(_snap(), _snap(2, 20, 20, drafts=6, accepted=12), reqs, k=3, per_step=True)
    assert w["verdict"] == FAIL and "per-request draft counts" in w["problems"][0]


def test_missing_evidence():
    assert audit_window(None, None, [_req(3, [1, 2])])["verdict"] == CANNOT_TEST
    # a busy server before the window: nothing is judged, the window is CANNOT TEST and says why (even with counters
    # that disagree: they include other traffic)
    for after in (_snap(2, 20, 20), _snap(5, 90, 70, running=1.0)):
        w = audit_window(_snap(running=3.0), after, [_req(12, [12]), _req(8, [8])], k=3)
        assert w["verdict"] == CANNOT_TEST and not w["problems"] and "busy before the window" in w["unattributed"]
        assert any(w["unattributed"] in m for m in w["missing"])
    # a failed client request: the request count may include it, token sums are lower bounds
    w = audit_window(_snap(), _snap(2, 25, 25), [_req(12, [12]), _req(8, [8]), _req(0, [], ok=False)], k=3)
    assert w["verdict"] == PASS and any("a request failed" in m for m in w["missing"])
    assert per_step_stream({"kind": "local"}) and per_step_stream({"dialect": "specbench"})
    assert not per_step_stream({"kind": "openai", "dialect": "vllm"})


def test_the_sweep_audit_uses_the_windows():
    sm = {"before": _snap(), "after": _snap(2, 20, 20, running=1.0, drafts=6, accepted=12), "k": 3, "per_step": True}
    cell = {"kind": "cell", "arm": "a", "level": 1, "round": 0, "warmup": False, "server_metrics": sm,
            "counters": {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 10,
                         "accepted_per_pos": [6, 3, 1]}}
    reqs = [{"kind": "request", "ok": True, "completion_tokens": n, "prompt_tokens": 10, "chunk_tokens": c,
             "token_count_method": "token_ids", "meta": {"arm": "a", "level": 1, "round": 0, "warmup": False}}
            for n, c in ((12, [1, 3, 4, 4]), (8, [1, 2, 1, 4]))]
    out = audit_records([cell, *reqs])
    assert out["verdict"] == FAIL and any("stale" in p for p in out["arms"][0]["problems"])
    cell["server_metrics"] = {**sm, "after": _snap(2, 20, 20, drafts=6, accepted=12)}
    out = audit_records([cell, *reqs])
    assert out["verdict"] == PASS and any("client-side metrics audit on 1/1" in c for c in out["arms"][0]["checks"])


# ---- specbench serve over real HTTP ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_pair):
    target, draft = tiny_pair
    draft = draft if draft and Path(draft).is_dir() else None
    eng = LLMEngine(EngineConfig(model=target, draft=draft, spec=SpecConfig(method="dflash" if draft else "ngram"),
                                 num_pages=256))
    app, loop = make_app(eng, served_name=MODEL, max_pending=64)
    srv = ServerThread(app).start()
    yield SimpleNamespace(url=srv.url, engine=eng, loop=loop)
    srv.stop()
    loop.close()


def _gauges(served) -> dict:
    s = summarize(httpx.get(served.url + "/metrics", timeout=10).text, MODEL)
    return s["gauges"]


def _wait_gauges_zero(served, timeout: float = 5.0) -> dict:
    t0 = time.monotonic()
    while True:
        g = _gauges(served)
        if all(v == 0 for v in g.values()) or time.monotonic() - t0 > timeout:
            return g
        time.sleep(0.05)


def test_audited_run_over_http_passes(served, gsm8k_prompts):
    oa = OpenAIAdapter(served.url, model=MODEL, probe=True)

    async def main():
        reqs = [GenRequest(prompt=p, max_tokens=24, prompt_cache=False) for p in gsm8k_prompts[:6]]
        try:
            return await audited(oa, lambda: oa.generate(reqs, concurrency=3))
        finally:
            await oa.aclose()

    res, before, after = asyncio.run(main())
    w = audit_window(before, after, res, k=served.engine.describe()["k"], per_step=per_step_stream(oa.describe()))
    assert w["verdict"] == PASS, w
    joined = " | ".join(w["checks"])
    for what in ("requests: counter delta 6 vs 6", "output tokens", "prompt tokens", "tokens per chunk",
                 "tokens per chunk vs each request's own draft counts", "gauges after the run"):
        assert what in joined, joined
    assert w["server"]["extra_chunk_tokens"] <= w["server"]["num_accepted_tokens"]


def _disconnect_mid_stream(served, prompt: str) -> None:
    n = len(served.engine.tokenizer.encode(prompt))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": served.engine.max_model_len - n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 3:
                break  # leaving the block closes the connection: the client is gone


def test_gauges_return_to_zero_after_a_disconnect_and_a_client_timeout(served, gsm8k_prompts):
    before = summarize(httpx.get(served.url + "/metrics").text, MODEL)
    _disconnect_mid_stream(served, gsm8k_prompts[0])
    g = _wait_gauges_zero(served)
    assert g and all(v == 0 for v in g.values()), g
    assert served.engine.pool.num_free == served.engine.pool.num_pages
    n = len(served.engine.tokenizer.encode(gsm8k_prompts[1]))
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up waiting
        httpx.post(served.url + "/v1/completions", timeout=0.5,
                   json={"model": MODEL, "prompt": gsm8k_prompts[1], "max_tokens": served.engine.max_model_len - n,
                         "temperature": 0, "ignore_eos": True, "logprobs": 1})
    g = _wait_gauges_zero(served)
    assert all(v == 0 for v in g.values()), g
    after = summarize(httpx.get(served.url + "/metrics").text, MODEL)
    # aborted requests are no successes
    assert after["counters"]["requests_ok"] == before["counters"]["requests_ok"]


def _patch_collector(monkeypatch, change) -> None:
    """/metrics with each sample of the engine collector's families passed through change(name, value)."""
    real = EngineCollector.collect

    def collect(self):
        for fam in real(self):
            fam.samples = [s._replace(value=change(fam.name, s.value)) for s in fam.samples]
            yield fam

    monkeypatch.setattr(EngineCollector, "collect", collect)


def test_the_audit_catches_stale_gauges_and_lost_tokens(served, gsm8k_prompts, monkeypatch):
    oa = OpenAIAdapter(served.url, model=MODEL)
    m = served.engine.metrics
    # the server as it was: gauges set only at commit, so an abort on an idle engine leaves them stale
    stale = {"vllm:num_requests_running": lambda: m.num_running, "vllm:num_requests_waiting": lambda: m.num_waiting,
             "vllm:kv_cache_usage_perc": lambda: m.kv_usage}
    _patch_collector(monkeypatch, lambda name, v: stale[name]() if name in stale else v)
    monkeypatch.setattr(metrics_audit, "SETTLE_MAX_S", 0.05)  # the outcome is set by events below, not by pauses
    # one answered request first: its last commit sets the gauges to idle (an abort in an earlier test left them
    # stale, and a window that starts busy is not judged)
    httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2}, timeout=60)

    async def window(fn):
        before = await settle(oa)
        res = await fn()
        return res, before, await settle(oa, before, res, per_step=True)

    async def disconnect():
        aborted = (await scrape(oa))["counters"]["requests_not_ok"]
        await asyncio.to_thread(_disconnect_mid_stream, served, gsm8k_prompts[2])
        t0 = time.monotonic()  # the server has counted the abort: every counter final (a hang guard only)
        while (await scrape(oa))["counters"]["requests_not_ok"] == aborted and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.01)
        return [GenResult("gone", False, error="client disconnected")]

    res, b, a = asyncio.run(window(disconnect))
    w = audit_window(b, a, res, per_step=True)
    print("DBG", w["verdict"], w["unattributed"], w["server"].get("settle"), w["server"]["gauges_before"])
    assert w["verdict"] == FAIL and any("(stale)" in p and "num_requests_running = 1" in p for p in w["problems"])
    monkeypatch.undo()
    assert all(v == 0 for v in _wait_gauges_zero(served).values())
    # counters that miss tokens: the published output-token counter grows by half of what was generated
    base_gen = m.generation_tokens
    _patch_collector(monkeypatch, lambda name, v: base_gen + (int(v) - base_gen) // 2
                     if name == "vllm:generation_tokens" else v)

    async def main():
        reqs = [GenRequest(prompt=p, max_tokens=16, prompt_cache=False) for p in gsm8k_prompts[:2]]
        try:
            return await audited(oa, lambda: oa.generate(reqs, concurrency=2))
        finally:
            await oa.aclose()

    res, b, a = asyncio.run(main())
    w = audit_window(b, a, res, per_step=True)
    assert w["verdict"] == FAIL and any("output-token counter delta" in p for p in w["problems"]), w
