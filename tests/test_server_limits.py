"""Request limits of `specbench serve` (issue 45): stop lists bounded in count and length, token ids outside the
vocabulary refused wherever a request names them, `content: null` only where OpenAI allows it, and the JSON parse
of a body of many values done without holding the GIL for the whole body. Each limit answers a 400 that names the
field, the limit and the option that moves it; the value just inside each limit is accepted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from specbench.engine import EngineConfig, LLMEngine
from specbench.harness.server import ServerOptions, ServerThread, make_app
from specbench.harness.server.errors import APIError
from specbench.harness.server.protocol import YIELD_VALUES, parse_json

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tiny_target):
    eng = LLMEngine(EngineConfig(model=tiny_target, num_pages=128))
    app, loop = make_app(eng, served_name=MODEL, options=ServerOptions(max_stop_strings=8, max_stop_length=40))
    srv = ServerThread(app).start()
    client = httpx.Client(base_url=srv.url, timeout=60)
    yield SimpleNamespace(url=srv.url, client=client, vocab=eng.mcfg.vocab_size, state=app.state.sb)
    client.close()
    srv.stop()
    loop.close()


def _err(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_defaults_are_options_past_what_clients_send():
    o = ServerOptions()
    assert (o.max_stop_strings, o.max_stop_length) == (64, 256)  # OpenAI: 4 stops, TGI: 4 by default
    for kw, flag in (({"max_stop_strings": 0}, "--max-stop-strings"), ({"max_stop_length": True}, "--max-stop-length"),
                     ({"chat_template_timeout": 0}, "--chat-template-timeout")):
        with pytest.raises(ValueError, match=flag):
            ServerOptions(**kw)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stop_lists_past_the_limits_are_refused_naming_them(served, route):
    head = ({"prompt": "1 2 3"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    ok = served.client.post(route, json={**head, "max_tokens": 3, "stop": [f"s{i}" for i in range(8)]})
    assert ok.status_code == 200, ok.text
    err = _err(served.client.post(route, json={**head, "stop": [f"s{i}" for i in range(9)]}))
    assert err["param"] == "stop" and err["code"] == "too_many_stop_strings"
    assert "9 strings" in err["message"] and "at most 8" in err["message"] and "--max-stop-strings" in err["message"]
    assert served.client.post(route, json={**head, "max_tokens": 3, "stop": "q" * 40}).status_code == 200
    err = _err(served.client.post(route, json={**head, "stop": ["ok", "q" * 41]}))
    assert err["param"] == "stop" and err["code"] == "stop_string_too_long"
    assert "stop[1] has 41 characters" in err["message"] and "--max-stop-length" in err["message"]
    # the bodies: far past the limits, refused (and the server answers at once afterwards)
    for stop in ([f"nv{i:06d}zz" for i in range(100_000)], ["q" * 1_000_000]):
        assert _err(served.client.post(route, json={**head, "stop": stop}))["param"] == "stop"
    assert served.client.get("/health").json()["status"] == "ok"


def test_token_ids_outside_the_vocabulary_are_refused(served):
    v = served.vocab
    ok = served.client.post("/v1/completions", json={"prompt": "1 2", "max_tokens": 2, "stop_token_ids": [v - 1],
                                                     "logit_bias": {str(v - 1): -1}})
    assert ok.status_code == 200, ok.text
    for field, value in (("stop_token_ids", [v]), ("stop_token_ids", [5, 10**12]), ("logit_bias", {str(v): 1.0})):
        for route, head in (("/v1/completions", {"prompt": "1 2"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            err = _err(served.client.post(route, json={**head, "max_tokens": 2, field: value}))
            assert err["param"] == field and f"< {v}" in err["message"], err
    assert served.client.post("/detokenize", json={"tokens": [1, v - 1]}).status_code == 200
    for toks in ([v], [1, 10**9]):
        err = _err(served.client.post("/detokenize", json={"tokens": toks}))
        assert err["param"] == "tokens" and f"< {v}" in err["message"], err


@pytest.mark.parametrize(("message", "status"), [
    ({"role": "user", "content": None}, 400),
    ({"role": "user"}, 400),
    ({"role": "system", "content": None}, 400),
    ({"role": "tool", "content": None, "tool_call_id": "c1"}, 400),
    ({"role": "assistant", "content": None}, 400),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]}, 200),
    ({"role": "user", "content": ""}, 200),
])
def test_content_null_only_where_openai_allows_it(served, message, status):
    msgs = [message] if message["role"] == "user" else [{"role": "user", "content": "hi"}, message]
    r = served.client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == status, r.text
    if status == 400:
        i = len(msgs) - 1
        err = r.json()["error"]
        assert err["param"] == f"messages[{i}].content" and message["role"] in err["message"], err


def test_a_body_of_many_values_parses_as_json_does():
    """Past YIELD_VALUES separators the body goes through the pure-Python scanner: the same document, the same
    refusals (bad JSON, nesting), and the separator bound still first."""
    doc = {"stop": [f"s{i}\u2603\"" for i in range(YIELD_VALUES)], "x": [1.5, None, True, {"a": [-2, "é"]}],
           "prompt": list(range(YIELD_VALUES))}
    raw = json.dumps(doc).encode()
    assert parse_json(raw) == json.loads(raw) and len(raw) > YIELD_VALUES
    assert parse_json(json.dumps(doc).encode("utf-16")) == doc  # json.loads' encodings
    for bad in (raw[:-1], raw + b"x", b'{"a": [' + b"1," * YIELD_VALUES + b"]}"):
        with pytest.raises(APIError) as e:
            parse_json(bad)
        assert e.value.code == "invalid_json"
    with pytest.raises(APIError) as e:
        parse_json(b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert e.value.code == "invalid_json" and "nested too deeply" in e.value.message
    with pytest.raises(APIError) as e:
        parse_json(raw, max_values=YIELD_VALUES)
    assert e.value.status == 413


def test_the_serve_command_takes_the_limits(tmp_path):
    """The options reach `specbench serve` (and a bad value is one line, exit 2, before anything loads)."""
    import subprocess
    import sys

    for args, flag in ((["--max-stop-strings", "0"], "--max-stop-strings"),
                       (["--max-stop-length", "-3"], "--max-stop-length"),
                       (["--chat-template-timeout", "0"], "--chat-template-timeout")):
        r = subprocess.run([sys.executable, "-m", "specbench", "serve", "--model", str(tmp_path / "nope"), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and flag in r.stderr, r.stderr
