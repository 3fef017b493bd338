"""Adapters without a server: engine strings, the local adapter's closed loop and cancellation, the hf
peer, Prometheus parsing, per-chunk token counting, and the openai adapter's retries (mock transport)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import held_engine
import httpx
import pytest

from specbench.harness.adapters import GenRequest, GenResult, counters_delta
from specbench.harness.adapters.local import LocalAdapter
from specbench.harness.adapters.openai_api import OpenAIAdapter, split_url
from specbench.harness.adapters.openai_stream import StreamAccumulator
from specbench.harness.adapters.prom import spec_counters_from_metrics
from specbench.harness.engines import EngineStringError, build_adapter, parse_engine

WAIT_S = 120.0  # hang guards only


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return target, (draft if draft and Path(draft).is_dir() else None)


@pytest.fixture(scope="module")
def local_off(pair):
    ad = LocalAdapter.from_dirs(pair[0], spec="off", num_pages=256)
    yield ad
    ad.close()


@pytest.fixture(scope="module")
def local_on(pair):
    target, draft = pair
    ad = LocalAdapter.from_dirs(target, draft=draft, spec="dflash" if draft else "ngram", num_pages=256)
    yield ad
    ad.close()


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[:6]


# ---- engine strings -------------------------------------------------------------------------------
def test_engine_strings_parse(pair):
    t = pair[0]
    s = parse_engine(f"local:{t},spec=ngram,k=3,device=cpu,dtype=float32")
    assert (s.kind, s.target, s.options) == ("local", t, {"spec": "ngram", "k": "3", "device": "cpu",
                                                          "dtype": "float32"})
    assert parse_engine("local").target == "" and parse_engine("local,spec=off").options == {"spec": "off"}
    o = parse_engine("openai:http://127.0.0.1:8000/v1,model=Qwen/Qwen3-4B")
    assert (o.target, o.options["model"]) == ("http://127.0.0.1:8000/v1", "Qwen/Qwen3-4B")
    assert parse_engine(f"hf:{t},lookup=3").opt_int("lookup") == 3


@pytest.mark.parametrize(("raw", "names"), [
    ("vllm:http://x", "unknown engine kind 'vllm'"),
    ("local:/does/not/exist", "model directory '/does/not/exist' does not exist"),
    ("local,spec=medusa", "spec='medusa'"),
    ("local,k=0", "k='0'"),
    ("local,device=tpu", "device='tpu'"),
    ("local,bogus=1", "unknown option 'bogus'"),
    ("local,draft", "option 'draft' is not key=value"),
    ("openai:localhost:8000", "must start with http"),
    ("openai:http://h:1,retries=-1", "retries='-1'"),
    ("hf:", "hf needs a target"),
])
def test_engine_strings_refused_clearly(raw, names):
    with pytest.raises(EngineStringError) as e:
        parse_engine(raw)
    msg = str(e.value)
    assert names in msg and "Accepted forms" in msg and "openai:<base_url>" in msg


def test_split_url():
    for u in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions", "http://h:1/v1/chat/completions"):
        assert split_url(u) == ("http://h:1", "http://h:1/v1")


# ---- local adapter --------------------------------------------------------------------------------
def test_local_closed_loop_and_callbacks(local_on, local_off, prompts):
    reqs = [GenRequest(prompt=p, max_tokens=12, ignore_eos=True, rid=f"r{i}") for i, p in enumerate(prompts)]
    seen: list[str] = []

    async def persist(r: GenResult) -> None:
        seen.append(r.rid)

    before = local_on.spec_counters_sync()
    on = asyncio.run(local_on.generate(reqs, concurrency=2, on_result=persist))
    off = local_off.generate_sync(reqs)
    assert [r.rid for r in on] == [f"r{i}" for i in range(len(prompts))] and sorted(seen) == sorted(r.rid for r in on)
    for a, b in zip(on, off, strict=True):
        assert a.ok and a.output_ids == b.output_ids and a.text == b.text  # lossless, fp32 greedy
        assert sum(a.chunk_tokens) == a.completion_tokens == 12 and len(a.chunk_times) == len(a.chunk_tokens)
        assert a.t_send < a.t_first <= a.t_end and a.tpot is not None and len(a.token_itls()) == 11
    d = counters_delta(before, local_on.spec_counters_sync())
    assert d["num_drafts"] == sum(r.spec["num_drafts"] for r in on)
    assert sum(d["accepted_per_pos"]) == d["num_accepted_tokens"] == sum(r.spec["num_accepted_tokens"] for r in on)


def test_local_refusals_are_results_not_exceptions(local_off):
    bad = local_off.generate_sync([GenRequest(prompt="x", max_tokens=10**9), GenRequest(prompt=[10**9]),
                                   GenRequest(prompt="2 + 2 =", max_tokens=2)])
    assert [r.ok for r in bad] == [False, False, True]
    assert "max_tokens" in bad[0].error and "out of range" in bad[1].error


def test_local_cancel_frees_kv(local_off, prompts, tmp_path):
    eng = local_off.engine
    ids = eng.tokenizer.encode(prompts[0])
    # held after its first token until the cancel was taken (tests/held_engine.py): it cannot finish first
    held, gate = held_engine.HeldEngine(eng, tmp_path / "open"), tmp_path / "open"

    async def main() -> None:
        req = GenRequest(prompt=ids, max_tokens=eng.max_model_len - len(ids), ignore_eos=True)
        task = asyncio.ensure_future(local_off.generate_one(req))
        assert await asyncio.to_thread(held.holding.wait, WAIT_S)  # running in the engine, held
        assert eng.scheduler.running and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert local_off.loop.num_pending == 0  # the abort is taken (applied after the step the gate holds)
        gate.touch()
        t0 = time.monotonic()  # a hang guard only: the wait ends on the engine's state
        while eng.has_unfinished() and time.monotonic() - t0 < WAIT_S:
            await asyncio.sleep(0.01)

    local_off.loop.engine = held
    try:
        asyncio.run(main())
    finally:
        gate.touch()
        local_off.loop.engine = eng
    assert not eng.has_unfinished() and eng.pool.num_free == eng.pool.num_pages


def test_engine_failure_fails_in_flight_and_loop_survives(local_off, monkeypatch):
    eng, orig, calls = local_off.engine, local_off.engine.step, {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return orig()

    monkeypatch.setattr(eng, "step", flaky)
    reqs = [GenRequest(prompt="ab", max_tokens=8, ignore_eos=True), GenRequest(prompt="cd", max_tokens=8, ignore_eos=True)]
    assert [r.error for r in local_off.generate_sync(reqs)] == ["EngineFailure: engine step failed: RuntimeError: boom"] * 2
    again = local_off.generate_sync(reqs[:1])[0]
    assert again.ok and again.completion_tokens == 8 and eng.pool.num_free == eng.pool.num_pages


def test_local_score_and_logprobs_agree(local_off, prompts):
    ids = local_off.engine.tokenizer.encode(prompts[0])
    gen = local_off.generate_sync([GenRequest(prompt=ids, max_tokens=4, logprobs=3)])[0]
    sc = local_off.score_sync(ids, gen.output_ids, top_k=3)
    assert [p.token_id for p in sc.positions] == gen.output_ids and sc.is_greedy
    assert [p.logprob for p in sc.positions] == pytest.approx([p.logprob for p in gen.logprobs], abs=1e-4)
    assert local_off.describe()["kind"] == "local" and local_off.tokenize_sync("12") == local_off.engine.tokenizer.encode("12")


def test_hf_peer_matches_local_greedy(pair, local_off, prompts):
    pytest.importorskip("transformers")
    hf = build_adapter(f"hf:{pair[0]},lookup=3")
    reqs = [GenRequest(prompt=p, max_tokens=10, ignore_eos=True, logprobs=2) for p in prompts[:2]]
    a, b = hf.generate_sync(reqs), local_off.generate_sync(reqs)
    for x, y in zip(a, b, strict=True):
        assert x.ok, x.error
        assert x.output_ids == y.output_ids and sum(x.chunk_tokens) == 10
        assert [p.logprob for p in x.logprobs] == pytest.approx([p.logprob for p in y.logprobs], abs=1e-3)
    ids = local_off.engine.tokenizer.encode(prompts[0])
    s1, s2 = hf.score_sync(ids[:5], ids[5:], 2), local_off.score_sync(ids[:5], ids[5:], 2)
    assert [p.logprob for p in s1.positions] == pytest.approx([p.logprob for p in s2.positions], abs=1e-3)


# ---- metrics and stream parsing -------------------------------------------------------------------
VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="Qwen/Qwen3-8B"} 50.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 1500.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 420.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-8B",position="1"} 160.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="Qwen/Qwen3-8B",position="0"} 260.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 9.0
garbage line without value
"""


def test_prometheus_vllm_and_sglang():
    c = spec_counters_from_metrics(VLLM_METRICS, "Qwen/Qwen3-8B")
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (150, 1500, 420)
    assert c["accepted_per_pos"] == [260, 160] and c["source"] == "metrics"
    assert spec_counters_from_metrics(VLLM_METRICS)["num_drafts"] == 159  # no model: everything
    sg = spec_counters_from_metrics('sglang:spec_accept_length{model_name="m"} 3.25\nsglang:num_running_reqs 2\n')
    assert sg["accept_length"] == 3.25 and sg["num_drafts"] is None
    assert spec_counters_from_metrics("# nothing\nfoo 1\n") is None


def test_stream_token_counting_methods():
    exact = StreamAccumulator(chat=False)
    for i, n in enumerate((1, 3, 2)):
        exact.feed({"choices": [{"index": 0, "text": "x" * n}], "usage": {"completion_tokens": [1, 4, 6][i]}}, i)
    exact.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}, 9)
    r = exact.finish(GenResult(rid="a", ok=True))
    assert r.chunk_tokens == [1, 3, 2] and r.token_count_method == "usage" and r.completion_tokens == 6
    prop = StreamAccumulator(chat=True)
    for i, text in enumerate(("ab", "cdef", "gh")):
        prop.feed({"choices": [{"index": 0, "delta": {"content": text}}]}, i)
    prop.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 8}}, 9)
    r = prop.finish(GenResult(rid="b", ok=True))
    assert r.token_count_method == "proportional" and sum(r.chunk_tokens) == 8 and r.chunk_tokens == [2, 4, 2]
    none = StreamAccumulator(chat=False)
    none.feed({"choices": [{"index": 0, "text": "a"}]}, 0)
    assert none.finish(GenResult(rid="c", ok=True)).token_count_method == "chunks"


# ---- openai adapter: retries and per-request failures (mock transport) ----------------------------
def _sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_openai_retries_then_succeeds():
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] <= 2:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        body = json.loads(request.content)
        assert body["stream"] and body["stream_options"]["include_usage"] and body["seed"] == 3
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "text": "Hel", "token_ids": [1, 2]}]},
            {"choices": [{"index": 0, "text": "lo", "token_ids": [3], "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}))

    ad = OpenAIAdapter("http://mock", model="m", retries=3, backoff=0.001, transport=httpx.MockTransport(handler))
    r = ad.generate_sync([GenRequest(prompt="hi", max_tokens=3, seed=3)])[0]
    assert r.ok and r.attempts == 3 and r.text == "Hello" and r.output_ids == [1, 2, 3]
    assert r.chunk_tokens == [2, 1] and r.finish_reason == "stop" and r.prompt_tokens == 4


def test_openai_failures_recorded_not_raised():
    def handler(request: httpx.Request) -> httpx.Response:
        if b'"bad"' in request.content:
            return httpx.Response(400, json={"error": {"message": "prompt is bad", "type": "invalid_request_error"}})
        return httpx.Response(500, text="boom")

    ad = OpenAIAdapter("http://mock/v1", model="m", retries=1, backoff=0.001, transport=httpx.MockTransport(handler))
    bad, down = ad.generate_sync([GenRequest(prompt="bad"), GenRequest(prompt="fine")])
    assert not bad.ok and bad.error == "HTTP 400: prompt is bad" and bad.attempts == 1
    assert not down.ok and "gave up after 2 attempts" in down.error and "HTTP 500" in down.error
    refused = OpenAIAdapter("http://127.0.0.1:9", model="m", retries=0, connect_timeout=2)
    r = refused.generate_sync([GenRequest(prompt="x")])[0]
    assert not r.ok and "ConnectError" in r.error


# ---- specbench generate ---------------------------------------------------------------------------
def _generate_cli():
    import typer

    from specbench.cli.generate import generate

    app = typer.Typer()
    app.command()(generate)
    return app


def test_cli_generate_json_and_exit_codes(pair):
    from typer.testing import CliRunner

    app, runner = _generate_cli(), CliRunner()
    ok = runner.invoke(app, ["-e", f"local:{pair[0]},spec=off,num_pages=64", "-p", "12 + 3 =", "-p", "Question:",
                             "--max-tokens", "4", "--logprobs", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    assert doc["engine"]["kind"] == "local" and [r["rid"] for r in doc["results"]] == ["prompt-0", "prompt-1"]
    assert all(r["ok"] and r["completion_tokens"] <= 4 and len(r["logprobs"]) == r["completion_tokens"]
               for r in doc["results"])
    bad = runner.invoke(app, ["-e", "local:/no/such/dir", "-p", "x"])
    assert bad.exit_code == 2 and "does not exist" in bad.output
    failed = runner.invoke(app, ["-e", f"local:{pair[0]},spec=off,num_pages=64", "-p", "x", "--max-tokens", "100000"])
    assert failed.exit_code == 1 and "FAILED" in failed.output
