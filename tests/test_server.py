"""`specbench serve` end to end on loopback: the official openai client, the openai adapter, lm-eval's
request shapes, bad requests, disconnects, overload, /metrics invariants and a bounded load test.

One server per module (spec on: dflash with the bundled drafter, ngram while it is absent), a separate
spec-off local adapter as the reference for token equality.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import held_engine
import httpx
import pytest

from specbench.engine import EngineConfig, LLMEngine, SpecConfig
from specbench.harness.adapters import GenRequest
from specbench.harness.adapters.local import LocalAdapter
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.adapters.prom import parse_prometheus, spec_counters_from_metrics
from specbench.harness.server import ServerThread, make_app

openai = pytest.importorskip("openai")
MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tiny_pair):
    target, draft = tiny_pair
    draft = draft if draft and Path(draft).is_dir() else None
    spec = SpecConfig(method="dflash" if draft else "ngram")
    eng = LLMEngine(EngineConfig(model=target, draft=draft, spec=spec, num_pages=256))
    app, loop = make_app(eng, served_name=MODEL, max_pending=64)
    srv = ServerThread(app).start()
    yield SimpleNamespace(url=srv.url, engine=eng, loop=loop, target=target, state=app.state.sb)
    srv.stop()
    loop.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(served):
    ad = LocalAdapter.from_dirs(served.target, spec="off", num_pages=256)
    yield ad
    ad.close()


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[:4]


def post(served, path: str, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=data, headers={"content-type": "application/json"}, timeout=60)


WAIT_S = 120.0  # hang guards only: the waits below end on events


def wait_idle(served, timeout: float = WAIT_S) -> None:
    eng = served.engine
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if served.loop.num_pending == 0 and not eng.has_unfinished() and eng.pool.num_free == eng.pool.num_pages:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: pending={served.loop.num_pending} free={eng.pool.num_free}/"
                         f"{eng.pool.num_pages}")


# ---- the official client ------------------------------------------------------------------------
def test_models_and_completion_text(client, prompts):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert ch.index == 0 and ch.finish_reason in ("stop", "length") and isinstance(ch.text, str)
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 8
    sd = r.model_extra["spec_decode"]
    assert sd["method"] in ("dflash", "ngram") and sum(sd["accepted_per_pos"]) == sd["num_accepted_tokens"]


def test_completion_token_ids_and_batch(client, served, prompts):
    ids = [served.engine.tokenizer.encode(p) for p in prompts[:3]]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    many = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    texts = client.completions.create(model=MODEL, prompt=prompts[:3], max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == one.choices[0].text
    assert [c.text for c in many.choices] == [c.text for c in texts.choices]
    assert many.usage.prompt_tokens == sum(len(x) for x in ids)


def test_chat_and_chat_stream(client):
    msgs = [{"role": "user", "content": "How many apples are 3 and 4 apples?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].index == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    lp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)


def test_completion_stream_with_usage(client, prompts):
    full = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    body = [c for c in chunks if c.choices]
    assert all(c.choices[0].index == 0 for c in body)
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in body) == full.usage.completion_tokens


def test_logprobs_legacy_format(client, prompts):
    r = client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy = top-1
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_scoring_matches_local(client, served, reference, prompts):
    ids = served.engine.tokenizer.encode(prompts[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == 0 and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference.score_sync(ids[:5], ids[5:], top_k=2)
    assert [p.logprob for p in ref.positions] == pytest.approx(lp.token_logprobs[5:], abs=1e-4)
    # lm-eval's loglikelihood body: echo, logprobs=1, max_tokens=1 -> prompt positions + one generated.
    body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = post(served, "/v1/completions", body).json()
    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert out["choices"][0]["text"].startswith(served.engine.tokenizer.decode(ids, skip_special_tokens=False))


def test_seed(client, prompts):
    kw = dict(model=MODEL, prompt=prompts[3], max_tokens=8)
    a = client.completions.create(temperature=1.0, seed=7, **kw).choices[0].text
    b = client.completions.create(temperature=1.0, seed=7, **kw).choices[0].text
    g1 = client.completions.create(temperature=0, seed=1, **kw).choices[0].text
    g2 = client.completions.create(temperature=0, seed=2, **kw).choices[0].text
    assert a == b and g1 == g2


def test_lm_eval_generate_body_and_stop(served, prompts):
    """REFERENCE.md section 4: lm-eval's gsm8k body (seed + stop list) answered, stop strings removed."""
    stops = ["Question:", "</s>", "<|im_end|>"]
    body = {"prompt": prompts[0], "model": MODEL, "max_tokens": 48, "temperature": 0.0, "stop": stops, "seed": 1234}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["index"] == 0 and not any(s in ch["text"] for s in stops)
    # A stop string known to occur mid-output: the text ends right before it.
    free = post(served, "/v1/completions", {**body, "stop": None, "ignore_eos": True}).json()["choices"][0]["text"]
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert stop.strip(), f"output too short to pick a stop string: {free!r}"
    cut = post(served, "/v1/completions", {**body, "stop": stops + [stop], "ignore_eos": True}).json()["choices"][0]
    assert cut["text"] == free[:free.index(stop)] and cut["finish_reason"] == "stop"
    streamed = httpx.post(served.url + "/v1/completions", json={**body, "stop": [stop], "ignore_eos": True,
                                                                  "stream": True}, timeout=60).text
    events = [json.loads(x[6:]) for x in streamed.split("\n\n") if x.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == cut["text"]


def test_tokenizer_endpoints_satisfy_lm_eval(served):
    tok = post(served, "/tokenize", {"model": MODEL, "prompt": "Question: 12 apples", "add_special_tokens": False})
    ids = tok.json()["tokens"]
    assert ids == served.engine.tokenizer.encode("Question: 12 apples")
    detok = post(served, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert detok == served.engine.tokenizer.decode(ids, skip_special_tokens=False)
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert "eos_token" in info and "chat_template" in info
    lm_utils = pytest.importorskip("lm_eval.utils")
    assert lm_utils.check_remote_tokenizer_support(served.url + "/v1/completions")


# ---- bad requests -------------------------------------------------------------------------------
BAD = [
    ("malformed json", b'{"prompt": ', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("empty token list", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("prompt wrong type", {"model": MODEL, "prompt": 12}, 400, "prompt"),
    ("mixed prompt list", {"model": MODEL, "prompt": ["a", 3]}, 400, "prompt[1]"),
    ("token id out of range", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("max_tokens negative", {"model": MODEL, "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens string", {"model": MODEL, "prompt": "a", "max_tokens": "8"}, 400, "max_tokens"),
    ("max_tokens bool", {"model": MODEL, "prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("max_tokens huge", {"model": MODEL, "prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens 0 without echo", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature negative", {"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("logprobs too many", {"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("logprobs negative", {"model": MODEL, "prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("stop wrong type", {"model": MODEL, "prompt": "a", "stop": 5}, 400, "stop"),
    ("seed string", {"model": MODEL, "prompt": "a", "seed": "x"}, 400, "seed"),
    ("n > 1", {"model": MODEL, "prompt": "a", "n": 2}, 400, "n"),
    ("unknown model", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("oversize prompt", {"model": MODEL, "prompt": list(range(1, 50)) * 200, "max_tokens": 4}, 400, "prompt"),
]


@pytest.mark.parametrize(("case", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_clear_errors(served, case, body, status, param):
    r = post(served, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert httpx.get(served.url + "/health").status_code == 200


def test_bad_chat_and_routes(served):
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}):
        r = post(served, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["message"]
    assert httpx.get(served.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert post(served, "/tokenize", {"prompt": 3}).status_code == 400
    assert post(served, "/detokenize", {"tokens": ["a"]}).status_code == 400


def test_oversize_body_answers_413(served):
    served.state.max_body_bytes = 1000
    try:
        r = post(served, "/v1/completions", {"model": MODEL, "prompt": "a" * 2000})
        chunks = iter([b'{"model": "tiny", "prompt": "', b"a" * 2000, b'"}'])  # chunked: no Content-Length
        chunked = httpx.post(served.url + "/v1/completions", content=chunks, timeout=30)
    finally:
        served.state.max_body_bytes = 32 * 1024 * 1024
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_body_of_too_many_json_values_answers_413_before_the_parse(served):
    """The JSON parse holds the GIL (it would stall /health): a body with more ',' and ':' than the bound is
    refused unparsed; the same prompt under the bound is parsed and refused for its length, not its size."""
    from specbench.harness.server import protocol

    big = {"model": MODEL, "prompt": [7] * (protocol.MAX_JSON_VALUES + 10), "max_tokens": 1}
    r = post(served, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_values", r.text
    assert "SPECBENCH_MAX_JSON_VALUES" in r.json()["error"]["message"]
    ok = post(served, "/v1/completions", {**big, "prompt": [7] * 5000})
    assert ok.status_code == 400 and ok.json()["error"]["code"] != "too_many_values", ok.text
    assert httpx.get(served.url + "/health").status_code == 200


def test_parse_json_bound():
    from specbench.harness.server.errors import APIError
    from specbench.harness.server.protocol import parse_json

    raw = b'{"prompt": [' + b",".join([b"1"] * 99) + b"]}"
    assert len(parse_json(raw, max_values=100)["prompt"]) == 99  # 98 commas + 1 colon
    with pytest.raises(APIError) as e:
        parse_json(raw, max_values=50)
    assert e.value.status == 413 and "at most 50" in e.value.message
    assert len(parse_json(raw, max_values=0)["prompt"]) == 99  # 0 = no bound


def test_overload_answers_503(served):
    served.loop.max_pending = 0
    try:
        r = post(served, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
    finally:
        served.loop.max_pending = 64
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"]


def _abort_count(served) -> int:
    return int(served.state.metrics.aborts)


def _left_mid_flight(served, gate: Path, leave) -> None:
    """Hold the engine once the request has its first token (tests/held_engine.py), let `leave(first)` send it
    and go away mid-flight, wait until the server took the disconnect, then let the engine step on: the request
    cannot finish on its own first, however fast the machine. It must end aborted, its KV freed."""
    held = held_engine.HeldEngine(served.engine, gate)
    aborts = _abort_count(served)
    served.loop.engine = held
    try:
        leave(held)
        t0 = time.monotonic()
        while served.loop.num_pending and time.monotonic() - t0 < WAIT_S:  # the server saw the client go
            time.sleep(0.02)
    finally:
        gate.touch()
        served.loop.engine = served.engine
    wait_idle(served)
    assert _abort_count(served) == aborts + 1


def test_client_disconnect_mid_stream_frees_kv(served, prompts, tmp_path):
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}

    def stream_then_leave(held) -> None:
        with httpx.Client(timeout=WAIT_S) as c, c.stream("POST", served.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token: the engine holds the rest; leaving closes the connection

    _left_mid_flight(served, tmp_path / "stream", stream_then_leave)

    # The same without streaming: the client gives up waiting for the whole answer (once the request is in
    # flight: the engine holds it after its first token)
    def send_then_leave(held) -> None:
        data = json.dumps({**body, "stream": False}).encode()
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            assert held.holding.wait(WAIT_S) and served.loop.num_pending == 1

    _left_mid_flight(served, tmp_path / "whole", send_then_leave)
    assert httpx.get(served.url + "/health").status_code == 200


# ---- the openai adapter against the same server ---------------------------------------------------
def test_openai_adapter_matches_local_greedy(served, reference, prompts):
    oa = OpenAIAdapter(served.url)
    reqs = [GenRequest(prompt=p, max_tokens=16, ignore_eos=True) for p in prompts]
    remote = oa.generate_sync(reqs, concurrency=4)
    local = reference.generate_sync(reqs)
    for r, loc in zip(remote, local, strict=True):
        assert r.ok, r.error
        assert r.output_ids == loc.output_ids and r.text == loc.text
        assert sum(r.chunk_tokens) == r.completion_tokens == 16 and r.token_count_method == "token_ids"
        assert r.ttft is not None and 0 < r.ttft <= r.e2el
        assert r.spec is not None and sum(r.spec["accepted_per_pos"]) == r.spec["num_accepted_tokens"]
    assert oa.tokenize_sync(prompts[0]) == served.engine.tokenizer.encode(prompts[0])
    ids = served.engine.tokenizer.encode(prompts[1])
    s_remote, s_local = oa.score_sync(ids[:6], ids[6:], 2), reference.score_sync(ids[:6], ids[6:], 2)
    assert [p.logprob for p in s_remote.positions] == pytest.approx([p.logprob for p in s_local.positions], abs=1e-4)
    assert [set(p.top) for p in s_remote.positions] == [set(p.top) for p in s_local.positions]
    desc = oa.describe()
    assert desc["kind"] == "openai" and desc["model"] == MODEL


def test_openai_adapter_logprobs_chat_and_failures(served, reference, prompts):
    oa = OpenAIAdapter(served.url, model=MODEL)
    req = GenRequest(prompt=prompts[2], max_tokens=5, logprobs=2)
    r, loc = oa.generate_sync([req])[0], reference.generate_sync([req])[0]
    assert r.output_ids == loc.output_ids
    assert [p.logprob for p in r.logprobs] == pytest.approx([p.logprob for p in loc.logprobs], abs=1e-4)
    assert all(len(p.top) == 2 for p in r.logprobs)
    creq = GenRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    chat = oa.generate_sync([creq])[0]
    assert chat.ok and chat.completion_tokens == len(chat.output_ids)
    whole = OpenAIAdapter(served.url, model=MODEL, stream=False).generate_sync([creq])[0]
    assert whole.text == chat.text and whole.output_ids == chat.output_ids
    assert whole.chunk_tokens == [whole.completion_tokens]
    bad = oa.generate_sync([GenRequest(prompt="a", max_tokens=10**9)])[0]
    assert not bad.ok and "HTTP 400" in bad.error and bad.attempts == 1


def test_metrics_and_counter_invariants(served, prompts):
    oa = OpenAIAdapter(served.url, model=MODEL)
    before = oa.spec_counters_sync()
    oa.generate_sync([GenRequest(prompt=p, max_tokens=24, ignore_eos=True) for p in prompts[:2]])
    text = httpx.get(served.url + "/metrics").text
    names = {n for n, _, _ in parse_prometheus(text)}
    assert {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:generation_tokens_total"} <= names
    c = spec_counters_from_metrics(text, MODEL)
    assert c["source"] == "metrics" and c["num_drafts"] > before["num_drafts"]
    assert sum(c["accepted_per_pos"]) == c["num_accepted_tokens"] <= c["num_draft_tokens"]
    assert all(a >= b for a, b in zip(c["accepted_per_pos"], c["accepted_per_pos"][1:], strict=False))


def test_bounded_load(served, prompts):
    """32 requests at concurrency 8 over loopback: no failures, exact token counts, KV all freed."""
    oa = OpenAIAdapter(served.url, model=MODEL, retries=0)
    reqs = [GenRequest(prompt=prompts[i % len(prompts)], max_tokens=8, ignore_eos=True) for i in range(32)]
    done: list[str] = []
    res = asyncio.run(oa.generate(reqs, concurrency=8, on_result=lambda r: done.append(r.rid)))
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    assert all(r.completion_tokens == 8 == sum(r.chunk_tokens) for r in res) and len(done) == 32
    wait_idle(served)


def test_lm_eval_local_completions_client(served, reference, prompts):
    """lm-eval's own client: remote tokenizer auto-detected, loglikelihood via echo, generate_until with stops."""
    oc = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    lm = oc.LocalCompletionsAPI(base_url=served.url + "/v1/completions", model=MODEL, num_concurrent=2,
                                max_retries=1)
    assert lm.tokenizer_backend == "remote"
    ctx, cont = prompts[0], " 18"
    (ll, _), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)])
    tok = served.engine.tokenizer
    ids, cids = tok.encode(ctx), tok.encode(ctx + cont)[len(tok.encode(ctx)):]
    assert tok.encode(ctx + cont)[:len(ids)] == ids
    assert ll == pytest.approx(reference.score_sync(ids, cids).total, abs=1e-3)
    free = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["Question:"], "max_gen_toks": 16}), 0)])[0]
    stop = free[len(free) // 2:len(free) // 2 + 2]
    if stop.strip():
        cut = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": [stop], "max_gen_toks": 16}), 0)])[0]
        assert cut == free[:free.index(stop)]


def test_serve_command_subprocess(tiny_pair, tmp_path):
    """`specbench serve` as users run it: warms up, is ready, answers, then exits cleanly on SIGINT."""
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specbench", "serve", "--model", tiny_pair[0], "--spec", "off", "--port", "0",
           "--num-pages", "64", "--served-model-name", "cli", "--log-level", "warning"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the port it bound (--port 0: a port picked here and then bound by the server could be taken between)
        head: list[str] = []
        m = None
        while m is None and (line := p.stdout.readline()):  # "" once it exited
            head.append(line)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, head
        url = f"http://127.0.0.1:{m.group(1)}"
        health = None
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < WAIT_S:  # ready, not just up: 503 while it warms up
            try:
                h = httpx.get(url + "/health", timeout=5)
                if h.status_code == 200:
                    health = h.json()
                    break
                assert h.status_code == 503 and h.json()["status"] == "starting"
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert health is not None and health["ready"] is True and health["warmup"]["state"] == "done"
        r = httpx.post(url + "/v1/completions", json={"model": "cli", "prompt": "1 + 1 =", "max_tokens": 3,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["index"] == 0
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=WAIT_S) == 0, p.stdout.read()  # a drained shutdown, not a KeyboardInterrupt
    finally:
        if p.poll() is None:
            p.kill()
