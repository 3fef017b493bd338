"""Property-based fuzzing and a soak of `specbench serve` over real HTTP (#23).

- Fuzz (hypothesis): request bodies over the completions and chat schemas, every field drawn from valid
  values, near misses (wrong type, out of range, bool for a number, NaN) and arbitrary JSON, plus bodies
  that are no JSON object at all. Property: every answer is a 2xx with a well-formed body (a stream ends
  with `[DONE]`, no error event in it) or a 4xx whose OpenAI-style error names the field it blames; never
  a 5xx. Afterwards the server is alive, idle and every KV page is back. `SPECBENCH_FUZZ_EXAMPLES` scales
  the run (default 600 completions + 400 chat: about 30 s on a CI core). A test with a validator removed
  shows the property fails when a bad value reaches the engine.
- Fuzz under a /health poll (issue 45): `specbench serve` as users run it (the engine in its own process), with a
  chat template whose traps a message springs (a gigabyte string, a loop for hours, a flood: benchmarks/
  server_health.py TRAPS), gets the issue's stop lists (1,000 / 100,000 / 250,000 strings, one of 1 MB), a
  500,000-character prompt, and hypothesis bodies aimed at stop, stop_token_ids, logit_bias, token-id prompts,
  messages and /detokenize, while a second client (a process of its own) polls /health every 10 ms: the same
  property per answer, every poll a 200 within 50 ms (beyond the time the scheduler kept the server and the
  poller queued for a CPU: see POLLER), and the server idle with its pool full afterwards. The same poll over a
  server whose preparation runs on the event loop fails the check.
- Soak: 256 concurrent streams (`SPECBENCH_SOAK_STREAMS`), a third of the clients leaving at a random
  point (before the first byte, mid-stream), the rest reading to the end; then no request in flight, the
  pool full, every gauge 0, and the survivors' answers complete. A test with a page leak planted in the
  engine's release shows the check catches one lost page.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specbench import env  # noqa: E402
from specbench.benchmarks.server_health import TRAPS, template_model  # noqa: E402
from specbench.engine import EngineConfig, LLMEngine, SpecConfig  # noqa: E402
from specbench.harness.server import ServerThread, make_app  # noqa: E402

MODEL = "tiny"
VOCAB = 4096  # the bundled tiny target's vocabulary (checked by the fixtures)
EXAMPLES = int(env.get("SPECBENCH_FUZZ_EXAMPLES"))
STREAMS = int(env.get("SPECBENCH_SOAK_STREAMS"))


@pytest.fixture(scope="module")
def served(tiny_pair):
    target, draft = tiny_pair
    draft = draft if draft and Path(draft).is_dir() else None
    spec = SpecConfig(method="dflash" if draft else "ngram")
    # a small pool, so the soak's requests queue for KV and aborts land in every phase
    eng = LLMEngine(EngineConfig(model=target, draft=draft, spec=spec, num_pages=512,
                                 check_invariants=True))  # the pool partition checked after every step
    assert eng.mcfg.vocab_size == VOCAB
    app, loop = make_app(eng, served_name=MODEL, max_pending=STREAMS + 16)
    srv = ServerThread(app).start()
    client = httpx.Client(base_url=srv.url, timeout=60)
    yield SimpleNamespace(url=srv.url, engine=eng, loop=loop, client=client, seen={})
    client.close()
    srv.stop()
    loop.close()


# ---- strategies -------------------------------------------------------------------------------------------
json_leaf = (st.none() | st.booleans() | st.integers() | st.integers(-3, 40) | st.text(max_size=12)
             | st.floats(allow_nan=True, allow_infinity=True))
any_json = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                       max_size=4), max_leaves=8)
small_text = st.text(min_size=0, max_size=40)
token_ids = st.lists(st.integers(0, 300), min_size=0, max_size=12)
bad_ids = st.lists(st.integers(-5, 10**12) | st.booleans() | st.floats(), min_size=1, max_size=4)
numbers = st.floats(-3, 3) | st.integers(-3, 3) | st.just(math.nan) | st.just(1e308) | st.booleans()
nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
penalty_bad = st.floats(2.01, 10) | st.floats(-10, -2.01) | nonfinite | st.booleans()


class Field(NamedTuple):
    ok: st.SearchStrategy  # values the server must accept
    bad: st.SearchStrategy  # near misses: wrong type, out of range, a bool for a number, NaN, boundaries


def f(ok: st.SearchStrategy, bad: st.SearchStrategy | None = None) -> Field:
    return Field(ok, bad if bad is not None else any_json)


def mixed(fl: Field) -> st.SearchStrategy:
    """For nested values: mostly valid, sometimes a near miss, now and then anything at all."""
    return st.integers(0, 19).flatmap(lambda i: fl.ok if i < 17 else fl.bad if i < 19 else any_json)


@st.composite
def schema(draw: Any, required: dict[str, Field], optional: dict[str, Field], target: str | None = None) -> dict:
    """A valid body (the required fields and a random subset of the optional ones) whose `target` field (if
    given) is replaced by a near miss or arbitrary JSON, and now and then a second field too: a bad value
    meets otherwise valid requests, so it reaches whatever code the valid ones reach. (The target is
    chosen by the test, field by field: hypothesis favours the first choices of a sampled_from, so a
    drawn target would leave the later fields nearly untested.)"""
    keys = list(required) + sorted(draw(st.sets(st.sampled_from(sorted(optional)))))
    fields = {**required, **optional}
    out = {k: draw(fields[k].ok) for k in keys}
    if target is not None:
        out[target] = draw(fields[target].bad | any_json)
        if draw(st.integers(0, 4)) == 0:
            k = draw(st.sampled_from(sorted(fields)))
            out[k] = draw(fields[k].bad | any_json)
        if target in required and draw(st.integers(0, 9)) == 0:
            del out[target]  # a required field missing
    return out


bools = st.booleans()
COMMON = {
    "model": f(st.just(MODEL), st.sampled_from(["nope", ""])),
    "temperature": f(st.sampled_from([0, 0.0, 0.7, 1.0, 2.0]) | st.floats(0, 5), numbers),
    "top_p": f(st.sampled_from([1.0, 0.9, 0.5]) | st.floats(0.01, 1), numbers),
    "top_k": f(st.integers(-1, 60) | st.just(10**9), st.integers(-10, -2)),
    "min_p": f(st.sampled_from([0.0, 0.1, 1.0]), numbers),
    "seed": f(st.integers(0, 2**31) | st.none() | st.sampled_from([-1, 2**63 - 1, -(2**63)]),
              st.integers(-(2**70), 2**70) | st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30])),
    # stops that match (short random text over the output's alphabet), at the limits (64 x 256) and past them
    "stop": f(st.none() | small_text.filter(bool) | st.lists(small_text.filter(bool), max_size=3)
              | st.lists(st.text("0123456789 .,", min_size=1, max_size=2), min_size=1, max_size=64)
              | st.lists(st.text(min_size=200, max_size=256), min_size=1, max_size=3),
              st.sampled_from(["", [""], [1, 2]]) | st.lists(small_text.filter(bool), min_size=65, max_size=70)
              | st.text(min_size=257, max_size=300) | st.tuples(small_text.filter(bool), st.text(min_size=257,
                                                                                                   max_size=260)).map(list)),
    "stop_token_ids": f(token_ids, bad_ids | st.lists(st.integers(VOCAB, 10**12), min_size=1, max_size=2)),
    "ignore_eos": f(bools, numbers),
    "include_stop_str_in_output": f(bools),
    "stream": f(bools),
    "stream_options": f(st.fixed_dictionaries({}, optional={"include_usage": bools, "continuous_usage_stats": bools}),
                        st.just([]) | st.fixed_dictionaries({"include_usage": any_json})),
    "return_token_ids": f(bools),
    "return_tokens_as_token_ids": f(bools),
    "n": f(st.just(1), st.integers(0, 3)),
    "best_of": f(st.none() | st.just(1), st.integers(0, 3)),
    "suffix": f(st.none() | st.just(""), small_text.filter(bool)),
    "logit_bias": f(st.none() | st.just({}) | st.dictionaries(st.integers(0, 200).map(str), st.floats(-100, 100),
                                                                max_size=3),
                    st.dictionaries(st.text(alphabet="ab-", min_size=1, max_size=3), st.integers(), min_size=1,
                                    max_size=2)
                    | st.dictionaries(st.integers(0, 200).map(str), st.integers(101, 10**6) | nonfinite, min_size=1,
                                      max_size=2)
                    | st.dictionaries(st.integers(VOCAB, 10**12).map(str), st.floats(-100, 100), min_size=1,
                                      max_size=2)
                    | st.just([[1, 2.0]])),
    "min_tokens": f(st.sampled_from([0, 1]), st.integers(-5, -1) | st.just("2")),
    "presence_penalty": f(st.just(0) | st.floats(-2, 2), penalty_bad),
    "frequency_penalty": f(st.just(0.0) | st.floats(-2, 2), penalty_bad),
    "repetition_penalty": f(st.none() | st.just(1.0) | st.floats(0.5, 2.0), st.floats(-3, 0) | nonfinite | st.booleans()),
    "cache_salt": f(st.none() | small_text.filter(bool), st.just("") | st.integers()),
    "zz_unknown_field": f(any_json),
}
max_tokens = f(st.integers(1, 6), st.integers(-3, 0) | st.sampled_from([10**9, 2**63]))

COMPLETION_FIELDS = (
    {"prompt": f(small_text.filter(bool) | token_ids.filter(bool)
                 | st.lists(small_text.filter(bool), min_size=1, max_size=3)
                 | st.lists(token_ids.filter(bool), min_size=1, max_size=3),
                 bad_ids | st.sampled_from(["", [], [[]], [""]]) | st.lists(st.integers(10**6, 10**7), min_size=1)),
     "max_tokens": max_tokens},
    {**COMMON, "logprobs": f(st.none() | st.integers(0, 20), st.integers(-2, 22) | bools), "echo": f(bools)})


# content null is OpenAI's only on an assistant message with tool_calls (`tool_call`); the trap words make the
# served_proc server's chat template build a gigabyte, spin, flood (TRAPS): plain words on the bundled template
content = f(small_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": small_text}), max_size=2)
            | st.sampled_from(sorted(TRAPS)),
            st.none() | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text"]),
                                                        "text": any_json}), min_size=1, max_size=2))
role = f(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), st.sampled_from(["robot", "", "USER"]))
tool_call = st.just({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
    "name": "f", "arguments": "{}"}}]})
message = st.fixed_dictionaries({"role": role.ok, "content": content.ok}) | tool_call
odd_message = st.fixed_dictionaries({"role": mixed(role), "content": mixed(content)})
CHAT_FIELDS = (
    {"messages": f(st.lists(message, min_size=1, max_size=3), st.just([]) | st.lists(odd_message, min_size=1,
                                                                                      max_size=3)),
     "max_tokens": max_tokens},  # always bounded: the chat default is the rest of the context
    {**COMMON, "max_completion_tokens": max_tokens, "logprobs": f(bools),
     "top_logprobs": f(st.none() | st.integers(0, 20), st.integers(-1, 22)), "add_generation_prompt": f(bools)})
RAW = st.sampled_from([b"", b"   ", b"{", b"[1, 2]", b'"text"', b"null", b"\xff\xfe", b'{"prompt": "a"']) | st.binary(
    max_size=20)


# ---- the property -----------------------------------------------------------------------------------------
def check_answer(r: httpx.Response, body: object) -> None:
    where = f"{r.request.url.path} {json.dumps(body, default=repr)[:300]} -> {r.status_code} {r.text[:300]}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where
        param = err.get("param")
        if param is not None:
            root = param.split("[")[0].split(".")[0]
            assert root in err["message"], where  # the message names the field it blames
        return
    assert 200 <= r.status_code < 300, where
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        for e in events[:-1]:
            assert "error" not in json.loads(e), where  # a 5xx hidden in a 200 stream
    elif r.request.url.path == "/detokenize":
        assert isinstance(r.json()["prompt"], str), where
    else:
        doc = r.json()
        assert doc["choices"] and doc["usage"]["completion_tokens"] >= 0, where


def post(served, path: str, body: object) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    r = served.client.post(path, content=data, headers={"content-type": "application/json"})
    check_answer(r, body)
    served.seen[r.status_code] = served.seen.get(r.status_code, 0) + 1


WAIT_S = 120.0  # hang guards only: the waits below end when the server and the engine are idle
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck),
                print_blob=True)


def assert_alive_and_idle(served) -> None:
    eng, t0 = served.engine, time.monotonic()
    while (served.loop.num_pending or eng.has_unfinished()) and time.monotonic() - t0 < WAIT_S:
        time.sleep(0.02)
    assert served.loop.num_pending == 0 and not eng.has_unfinished()
    assert eng.pool.num_free == eng.pool.num_pages, (eng.pool.num_free, eng.pool.num_pages)
    assert served.client.get("/health").json()["status"] == "ok"
    r = served.client.post("/v1/completions", json={"prompt": "1 2 3", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def fuzz(served, path: str, fields: tuple[dict, dict], examples: int) -> None:
    """`examples` requests: a share of valid bodies and of raw non-objects, the rest split over the fields,
    each fuzzed in turn as the target of otherwise valid bodies."""
    names = sorted({**fields[0], **fields[1]})
    per = max(1, examples // (len(names) + 2))

    @settings(FUZZ, max_examples=2 * per)
    @given(body=schema(*fields) | RAW)
    def plain(body):
        post(served, path, body)

    plain()
    for name in names:
        @settings(FUZZ, max_examples=per)
        @given(body=schema(*fields, target=name))
        def one(body):
            post(served, path, body)

        one()
    print(f"fuzz {path}: {len(names) * per + 2 * per} examples at most; answers so far {sorted(served.seen.items())}")


def test_fuzz_completions(served):
    fuzz(served, "/v1/completions", COMPLETION_FIELDS, EXAMPLES * 6 // 10)
    assert_alive_and_idle(served)
    assert served.seen.get(200, 0) > 50 and served.seen.get(400, 0) > 50, served.seen  # both sides explored


def test_fuzz_chat(served):
    fuzz(served, "/v1/chat/completions", CHAT_FIELDS, EXAMPLES * 4 // 10)
    assert_alive_and_idle(served)


def test_fuzz_finds_a_validator_removed(served, monkeypatch):
    """The bug this fuzzer found first: `seed` was not range-checked, torch refused a seed past int64 and the
    request answered 500 (and, before engine.add_request made the generator first, the scheduled request
    without one failed every later step). With the range check removed again the fuzzer must say 5xx."""
    from specbench.harness.server import protocol

    real = protocol.get_int
    monkeypatch.setattr(protocol, "get_int", lambda body, name, default, lo=None, hi=None: real(
        body, name, default, *((None, None) if name == "seed" else (lo, hi))))

    @settings(FUZZ, max_examples=100, phases=[Phase.generate])  # no shrinking: finding it is the point
    @given(body=schema(*COMPLETION_FIELDS, target="seed"))
    def run(body):
        post(served, "/v1/completions", body)

    with pytest.raises(AssertionError, match=r"-> 5\d\d"):
        run()
    monkeypatch.undo()
    assert_alive_and_idle(served)  # and the engine survived it


# ---- the served process under fuzz, /health polled meanwhile (issue 45) ----------------------------------------
HEALTH_BUDGET_S = 0.050  # no /health answer may take longer while any request is being served
# A second client in a process of its own (this one's GIL is busy with hypothesis): GET /health on one kept-alive
# connection every 10 ms until its stdin closes, then one JSON line. Each poll's time is also taken less the time
# the poller's thread and the server's longest-queued thread sat runnable on a CPU queue during it
# (benchmarks/server_health.py `waited`, from /proc/.../schedstat run_delay): on the
# shared 2-core box an idle server's polls took up to 252-904 ms with two busy loops beside it, none of it the
# server's. What is left is the server working or waiting for its own locks (the GIL), which is what request work
# on the event loop adds: the budget applies to that.
POLLER = """
import json, sys, threading, time
import httpx
from specbench.benchmarks.server_health import queued, waited
server = int(sys.argv[1])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
lat, own, codes = [], [], {}
with httpx.Client(base_url=sys.argv[2], timeout=60) as c:
    c.get("/health")
    print("ready", flush=True)
    while not done.is_set():
        q0 = queued(server)
        t = time.perf_counter()
        r = c.get("/health")
        wall = time.perf_counter() - t
        lat.append(wall)
        own.append(wall - waited(q0, queued(server)))
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
        done.wait(0.01)
print(json.dumps({"n": len(lat), "max": max(own), "wall_max": max(lat), "wall_p50": sorted(lat)[len(lat) // 2],
                  "codes": codes, "wall_slow": sum(x > float(sys.argv[3]) for x in lat)}), flush=True)
"""


class HealthPoller:
    def __init__(self, url: str, server_pid: int) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", POLLER, str(server_pid), url, str(HEALTH_BUDGET_S)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "ready"
        self.stats: dict = {}

    def stop(self) -> dict:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.close()
        self.stats = json.loads(self.p.stdout.readline())
        self.p.wait(WAIT_S)
        return self.stats


def assert_health_answered(stats: dict) -> None:
    """Every poll a 200, the slowest under the budget (the event loop never waited for request work)."""
    assert stats["max"] < HEALTH_BUDGET_S, (f"/health took {stats['max'] * 1000:.1f} ms beyond CPU queueing "
                                            f"(budget 50 ms): {stats}")
    assert stats["n"] >= 20 and set(stats["codes"]) == {"200"}, stats


# run `specbench serve ARGS` with the preparation of every request on the event loop: the regression the poll catches
ON_THE_LOOP = ("import sys\n"
               "from specbench.harness.server import serving\n"
               "async def off_loop(state, fn, *args, cleanup=None):\n"
               "    return fn(*args)\n"
               "serving.off_loop = off_loop\n"
               "from specbench.cli import main\n"
               "sys.argv = ['specbench', 'serve'] + sys.argv[1:]\n"
               "main()\n")


def serve_proc(model: Path, *extra: str, on_the_loop: bool = False) -> tuple[subprocess.Popen, str]:
    """`specbench serve` as users run it (the engine in its own process), ready; its URL."""
    args = ["--model", str(model), "--spec", "off", "--port", "0", "--no-warmup", "--num-pages", "512",
            "--served-model-name", MODEL, "--log-level", "warning", *extra]
    cmd = [sys.executable, "-c", ON_THE_LOOP, *args] if on_the_loop else [sys.executable, "-m", "specbench", "serve",
                                                                          *args]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline() if p.stderr else ""
    m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", first)
    assert m, first + (p.stderr.read() if p.stderr else "")
    url = f"http://127.0.0.1:{m.group(1)}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < WAIT_S * 10:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return p, url
        except httpx.HTTPError:
            time.sleep(0.05)
    p.kill()
    raise AssertionError(f"the server never became ready: {p.stderr.read() if p.stderr else ''}")


@pytest.fixture(scope="module")
def served_proc(tmp_path_factory):
    """The bundled target with the trap chat template (benchmarks/server_health.py TRAPS: a message "big" makes
    it build 'x' * 10**9, "spin" loop for hours, ...), a 1 s render timeout."""
    p, url = serve_proc(template_model("trap", tmp_path_factory.mktemp("trap")), "--chat-template-timeout", "1")
    client = httpx.Client(base_url=url, timeout=60)
    yield SimpleNamespace(url=url, client=client, seen={}, proc=p)
    client.close()
    p.send_signal(signal.SIGTERM)
    p.wait(WAIT_S * 4)


# the issue's bodies: stop lists of 1,000 / 100,000 / 250,000 strings (3.3 MB) and one of 1 MB, streamed
ISSUE_STOPS = [[f"nv{i:06d}zz" for i in range(n)] for n in (1_000, 100_000, 250_000)] + [["q" * 1_000_000]]
LONG_PROMPT = "the quick brown fox jumps over the lazy dog 12345 " * 10_000  # 500,000 characters
LIMIT_FIELDS = ("stop", "stop_token_ids", "logit_bias", "prompt")
detok_ids = f(st.lists(st.integers(0, VOCAB - 1), max_size=12),
              st.lists(st.integers(VOCAB, 10**12) | st.integers(-3, -1), min_size=1, max_size=3) | any_json)


def _idle_proc(served) -> None:
    """No request in flight and the pool full, read from /metrics (the engine is in another process)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < WAIT_S:
        g = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in served.client.get("/metrics").text.splitlines()
             if ln.startswith(("specbench:requests_in_flight", "specbench:kv_pages_"))}
        if g["specbench:requests_in_flight"] == 0 and g["specbench:kv_pages_free"] == g["specbench:kv_pages_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {g}")


def test_fuzz_limits_with_health_polled(served_proc):
    """Stop lists (matching, at and past the limits, the issue's 250k), token ids in and out of the vocabulary
    (stop_token_ids, logit_bias, prompts, /detokenize), and chat messages that spring the template's traps,
    while a second client polls /health: every answer a 2xx or a 4xx naming its field (never a 5xx), every poll
    a 200 within 50 ms, and the server idle, its pool full, afterwards."""
    served = served_proc
    poller = HealthPoller(served.url, served.proc.pid)
    try:
        for stop in ISSUE_STOPS:
            post(served, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True,
                                             "stream": True, "stop": stop})
        post(served, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 2})  # tokenized, then too long
        for trap in sorted(TRAPS):
            post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": trap}], "max_tokens": 2})
        per = max(1, EXAMPLES // 24)
        for path, fields, names in (("/v1/completions", COMPLETION_FIELDS, LIMIT_FIELDS),
                                    ("/v1/chat/completions", CHAT_FIELDS, ("messages", "stop"))):
            for name in names:
                fuzz_field(served, path, fields, name, per)

        @settings(FUZZ, max_examples=per)
        @given(toks=detok_ids.ok | detok_ids.bad)
        def detok(toks):
            post(served, "/detokenize", {"tokens": toks})

        detok()
    finally:
        stats = poller.stop()
    print(f"/health while fuzzing: {stats}; answers {sorted(served.seen.items())}")
    assert_health_answered(stats)
    assert served.seen.get(200, 0) > 20 and served.seen.get(400, 0) > 20, served.seen
    _idle_proc(served)


def fuzz_field(served, path: str, fields: tuple[dict, dict], name: str, examples: int) -> None:
    @settings(FUZZ, max_examples=examples)
    @given(body=schema(*fields, target=name) | schema(*fields))
    def one(body):
        post(served, path, body)

    one()


def test_the_poll_catches_request_work_on_the_event_loop(tmp_path):
    """The same server with every request's preparation moved onto the event loop (the parse, the validation,
    the tokenization): the issue's stop lists, or a 500,000-character prompt (tokenized, then refused as too
    long), keep /health waiting past the budget, and the check fails."""
    p, url = serve_proc(tiny_model_copy(tmp_path), on_the_loop=True)
    try:
        poller = HealthPoller(url, p.pid)
        try:
            for body in [{"prompt": "a", "stop": stop} for stop in ISSUE_STOPS[1:3]] + [{"prompt": LONG_PROMPT}]:
                r = httpx.post(url + "/v1/completions", timeout=WAIT_S * 4, json={**body, "max_tokens": 2})
                assert r.status_code == 400, r.text
        finally:
            stats = poller.stop()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(WAIT_S * 4)
    print(f"/health with the preparation on the event loop: {stats}")
    with pytest.raises(AssertionError, match="budget 50 ms"):
        assert_health_answered(stats)


def tiny_model_copy(into: Path) -> Path:
    from specbench.harness.fixtures import bundled_pair

    src = Path(bundled_pair()[0])
    for f_ in src.iterdir():
        (into / f_.name).symlink_to(f_.resolve())
    return into


# ---- soak -------------------------------------------------------------------------------------------------
async def _soak(url: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    stats = {"complete": 0, "left_early": 0, "left_before_first_byte": 0, "refused": 0}

    async def one(c: httpx.AsyncClient, i: int) -> None:
        plan = rng.random()
        body = {"prompt": f"{i} " * rng.randint(1, 40), "max_tokens": rng.randint(1, 16), "ignore_eos": True,
                "temperature": rng.choice([0, 0.8]), "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        if plan < 0.1:  # gone before the answer starts: the request sent, the connection closed unread
            host, port = url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            data = json.dumps(body).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            stats["left_before_first_byte"] += 1
            return
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                stats["refused"] += 1
                return
            leave_after = rng.randint(1, 6) if plan < 0.33 else None
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if leave_after is not None and len(events) >= leave_after:
                        stats["left_early"] += 1
                        return
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            assert last["usage"]["completion_tokens"] == body["max_tokens"], last
            stats["complete"] += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n + 8)) as c:
        await asyncio.wait_for(asyncio.gather(*[one(c, i) for i in range(n)]), 240)
    return stats


def _idle_and_full(served, timeout: float = WAIT_S) -> dict:
    """Once every request has left the server and the engine (the event; `timeout` is a hang guard), what is
    left: the pool's free pages are final then (a request's pages go back as it leaves the engine)."""
    eng, t0 = served.engine, time.monotonic()
    while time.monotonic() - t0 < timeout:
        if served.loop.num_pending == 0 and not eng.has_unfinished() and not eng.requests:
            break
        time.sleep(0.05)
    text = served.client.get("/metrics").text
    return {"pending": served.loop.num_pending, "unfinished": eng.has_unfinished(), "free": eng.pool.num_free,
            "total": eng.pool.num_pages, "engine_requests": len(eng.requests),
            "gauges": {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                       if ln.startswith(("vllm:num_requests_", "vllm:kv_cache_usage_perc",
                                         "specbench:requests_in_flight"))}}


def test_soak_concurrent_streams_with_disconnects(served):
    stats = asyncio.run(_soak(served.url, STREAMS, seed=23))
    after = _idle_and_full(served)
    assert after["pending"] == 0 and not after["unfinished"] and after["engine_requests"] == 0, after
    assert after["free"] == after["total"], after  # no KV page lost
    assert all(v == 0 for v in after["gauges"].values()) and len(after["gauges"]) == 4, after
    assert stats["refused"] == 0 and stats["complete"] > STREAMS // 3, stats
    assert stats["left_early"] > 0 and stats["left_before_first_byte"] > 0, stats
    assert_alive_and_idle(served)


def test_soak_check_catches_a_lost_page(served, monkeypatch):
    """The pages of one aborted request never go back to the pool: the soak's pool check must see it."""
    eng = served.engine
    pool, real_free = eng.pool, eng.pool.free
    kept: list[str] = []

    def leaky(rid):
        req = eng.requests.get(rid)
        if not kept and req is not None and req.finish_reason == "abort" and rid in pool and pool.table(rid):
            kept.append(rid)
            return
        real_free(rid)

    monkeypatch.setattr(pool, "free", leaky)
    monkeypatch.setattr(eng, "invariants", None)  # the run-time invariants would catch it first
    asyncio.run(_soak(served.url, 32, seed=7))
    after = _idle_and_full(served)
    assert kept and after["free"] < after["total"], after
    monkeypatch.undo()
    real_free(kept[0])  # give them back for the tests after this one
    assert eng.pool.num_free == eng.pool.num_pages
