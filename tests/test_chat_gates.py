"""`--endpoint-type chat` in `specbench lossless` and `specbench sampled` (#22 item 3).

Against `specbench serve` over real HTTP (spec off, spec on, spec on with a fault armed in the served engine)
and against the fake endpoint (harness/fake_endpoint.py) that gives a gate less than it needs; plus the gate's
chat rules on the deterministic fake engine of tests/lossless_fakes.py (re-anchoring on the reported rendered
ids, CANNOT TEST without them, arms that render one request differently).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from lossless_fakes import FakeAdapter, V, dist
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.harness.adapters.base import GenRequest, GenResult
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.adapters.openai_stream import StreamAccumulator
from specbench.harness.fake_endpoint import FakeEndpoint
from specbench.suites.lossless.greedy import NO_CHAT_IDS, GreedyGateOptions, Prompt, run_greedy
from specbench.suites.sampled.gate import Samples, rendering_problems

pytest.importorskip("fastapi")
cli._register()
runner = CliRunner()
MODEL = "tiny"
MSG = [{"role": "user", "content": "Question: Tom has 3 apples and buys 2 more. How many apples?\nAnswer:"}]


@pytest.fixture(scope="module")
def serve(tiny_pair):
    """serve(spec, faults) -> the URL of a `specbench serve` app over loopback (one per kind, module-wide)."""
    from specbench.engine import EngineConfig, LLMEngine, SpecConfig
    from specbench.harness.server import ServerThread, make_app

    target, draft = tiny_pair
    draft = draft if draft and Path(draft).is_dir() else None
    up: dict[tuple, tuple] = {}

    def get(spec: str, faults: tuple[str, ...] = ()) -> str:
        spec = "ngram" if spec == "dflash" and draft is None else spec
        if (spec, faults) not in up:
            eng = LLMEngine(EngineConfig(model=target, draft=draft if spec == "dflash" else None, num_pages=256,
                                         spec=SpecConfig(method=None if spec == "off" else spec), faults=faults))
            app, loop = make_app(eng, served_name=MODEL, max_pending=1024)
            up[(spec, faults)] = (ServerThread(app).start(), loop)
        return up[(spec, faults)][0].url

    yield get
    for srv, loop in up.values():
        srv.stop()
        loop.close()


def _lossless(args: list[str]):
    res = runner.invoke(cli.app, ["lossless", *args])
    out = json.loads(res.stdout.strip().splitlines()[-1]) if "--json" in args and res.stdout.strip() else None
    return res, out


def _oa(url: str) -> str:
    return f"openai:{url},model={MODEL}"


# ---- the premise: what the chat route reports is the computation -----------------------------------------
def test_chat_route_reports_the_rendered_prompt_and_it_replays_on_completions(serve):
    url = serve("off")
    body = {"model": MODEL, "messages": MSG, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    rendered = whole["prompt_token_ids"]  # vLLM's place: the top level
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": MSG}, timeout=30).json()["tokens"]
    raw = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": MSG[0]["content"]}, timeout=30).json()["tokens"]
    assert rendered == tok and len(rendered) > len(raw)  # the chat template's tokens around the text
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:") and "[DONE]" not in ln]
    assert events[0]["prompt_token_ids"] == rendered  # streamed: on the first chunk
    # the adapter reads it (streamed), and the rendered ids on /v1/completions give the chat answer's tokens:
    # what re-anchoring and re-scoring rely on
    ad = OpenAIAdapter(url, model=MODEL, probe=True)
    chat, comp = ad.generate_sync([GenRequest(messages=MSG, max_tokens=8),
                                   GenRequest(prompt=list(rendered), max_tokens=8)])
    ad.close()
    assert chat.ok and chat.prompt_ids == rendered and chat.output_ids == whole["choices"][0]["token_ids"]
    assert comp.ok and comp.output_ids == chat.output_ids


def test_stream_accumulator_reads_both_places_of_prompt_token_ids():
    for events in ([{"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                    {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5]}]}],
                   [{"choices": [{"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": [1, 2]}]}]):
        acc = StreamAccumulator(chat="delta" in events[0]["choices"][0])
        for ev in events:
            acc.feed(ev, 0.0)
        res = acc.finish(GenResult(rid="r", ok=True))
        assert res.prompt_ids == [1, 2] and res.output_ids == [5]
    res = StreamAccumulator(chat=True).finish(GenResult(rid="r", ok=True))
    assert res.prompt_ids is None


# ---- lossless over HTTP --------------------------------------------------------------------------------
def test_lossless_chat_passes_between_served_engines(serve, tmp_path):
    off, on = serve("off"), serve("dflash")
    res, out = _lossless(["--baseline", _oa(off), "--candidate", _oa(on), "--endpoint-type", "chat",
                          "--num-prompts", "3", "--max-tokens", "24", "--concurrent", "--json",
                          "--results", str(tmp_path / "res"), "--no-accept-reference"])
    assert res.exit_code == 0, res.output
    assert out["verdict"] == "PASS" and {g["name"] for g in out["gates"]} == {"greedy", "concurrent"}
    g = out["gates"][0]
    assert g["stats"]["speculating"] and g["stats"]["mean_accept_len"] > 1.05
    assert any("rendered prompt ids reported by both arms for 3" in n for n in g["notes"]), g["notes"]
    # every prompt was judged on the chat-rendered prompt (the template's tokens around the text)
    for p in g["prompts"]:
        text = next(t for pid, t in _texts(3) if pid == p["pid"])
        msgs = [{"role": "user", "content": text}]
        rendered = httpx.post(off + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30).json()["tokens"]
        assert p["prompt_len"] == len(rendered) and p["tokens_compared"] == 24
    (run_dir,) = [p for p in (tmp_path / "res").iterdir() if p.name != "references"]
    assert json.loads((run_dir / "run.json").read_text())["config"]["endpoint_type"] == "chat"


def _texts(n: int) -> list[tuple[str, str]]:
    from specbench.suites.lossless.prompts import load_prompts

    return load_prompts("gsm8k", n, 1000)


def test_lossless_chat_fails_a_faulty_engine_behind_the_chat_route(serve):
    off, bad = serve("off"), serve("dflash", ("wrong_bonus",))
    res, out = _lossless(["--baseline", _oa(off), "--candidate", _oa(bad), "--endpoint-type", "chat",
                          "--num-prompts", "2", "--max-tokens", "16", "--no-record", "--json"])
    assert res.exit_code == 1, res.output
    assert out["verdict"] == "FAIL" and out["summary"]["failed_prompts"] >= 1
    fails = [p for p in out["gates"][0]["prompts"] if p["status"] == "fail"]
    d = fails[0]["divergences"][-1]
    assert d["judgement"] and not d["judgement"]["ok"] and fails[0]["prompt_len"] > 0


def test_lossless_chat_cannot_test_on_endpoints_without_the_fields():
    # output ids but no logprobs and no prompt_token_ids; the two arms' tokens differ at position 0
    with FakeEndpoint(token_id=7, max_tokens=8) as b, FakeEndpoint(token_id=8, max_tokens=8) as c:
        res, out = _lossless(["--baseline", f"openai:{b.url}", "--candidate", f"openai:{c.url}", "--endpoint-type",
                              "chat", "--num-prompts", "2", "--max-tokens", "8", "--no-record", "--json"])
        assert {"/v1/chat/completions"} <= {s["path"] for s in b.seen + c.seen if s["method"] == "POST"}
    assert res.exit_code == 3, res.output
    assert out["verdict"] == "CANNOT TEST"
    assert "greedy: baseline logprobs at the divergence (chat endpoint)" in out["summary"]["missing"], out["summary"]
    reason = out["gates"][0]["prompts"][0]["reason"]
    assert "no logprobs" in reason and "prompt_token_ids" in reason
    # no output ids at all (the fake's default)
    with FakeEndpoint(max_tokens=8) as b, FakeEndpoint(max_tokens=8) as c:
        res, out = _lossless(["--baseline", f"openai:{b.url}", "--candidate", f"openai:{c.url}", "--endpoint-type",
                              "chat", "--num-prompts", "1", "--max-tokens", "8", "--no-record", "--json"])
    assert res.exit_code == 3 and out["verdict"] == "CANNOT TEST"
    assert "greedy: output token ids (candidate)" in out["summary"]["missing"]


def test_lossless_chat_on_local_arms_uses_the_engines_rendered_ids(tiny_pair):
    t, d = tiny_pair
    res, out = _lossless(["--baseline", f"local:{t},spec=off", "--candidate", f"local:{t},draft={d},spec=dflash",
                          "--endpoint-type", "chat", "--num-prompts", "2", "--max-tokens", "16", "--no-record", "--json"])
    assert res.exit_code == 0, res.output
    g = out["gates"][0]
    assert any("reported by both arms for 2" in n for n in g["notes"]) and all(p["prompt_len"] > 0 for p in g["prompts"])


def test_chat_bad_usage_exits_2(tiny_pair):
    for args, msg in ((["--endpoint-type", "chatty"], "--endpoint-type 'chatty' is invalid"),
                      (["--endpoint-type", "chat", "--engine-gates"], "--engine-gates is not available"),
                      (["--endpoint-type", "chat", "--rate-test"], "--rate-test is not available"),
                      (["--endpoint-type", "chat", "--suite", "prefix"], "--suite prefix is not available")):
        res = runner.invoke(cli.app, ["lossless", "--no-record", *args])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
    res = runner.invoke(cli.app, ["sampled", "--no-record", "--endpoint-type", "nope"])
    assert res.exit_code == 2 and "--endpoint-type 'nope' is invalid" in res.output, res.output


# ---- the gate's chat rules on the deterministic fake engine -------------------------------------------
class ChatFake(FakeAdapter):
    """FakeAdapter with a chat route: messages render to RENDER + [len(content) % V] (reported as prompt_ids
    when `report`), then generate as a token-id prompt would."""

    RENDER = [1, 2, 3]

    def __init__(self, report: bool = True, render: list[int] | None = None, **kw) -> None:
        super().__init__(**kw)
        self.report, self.render = report, render or self.RENDER

    async def generate_one(self, req: GenRequest) -> GenResult:
        if req.messages is None:
            return await super().generate_one(req)
        ids = self.render + [len(req.messages[0]["content"]) % V]
        res = await super().generate_one(GenRequest(prompt=ids, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                                    rid=req.rid))
        self.requests[-1] = req
        res.prompt_ids = ids if self.report else None
        return res


PROMPT = Prompt("p0", [], "hello", messages=[{"role": "user", "content": "hello"}])
RENDERED = ChatFake.RENDER + [5]


def _greedy_chain(n: int) -> list[int]:
    ids = list(RENDERED)
    for _ in range(n):
        d = dist(ids, {})
        ids.append(max(d, key=lambda t: (d[t], -t)))
    return ids[len(RENDERED):]


def _alt(ctx: list[int]) -> int:
    """The runner-up after context `ctx` (lossless_fakes: (greedy + 1) % V)."""
    d = dist(ctx, {})
    return (max(d, key=lambda t: (d[t], -t)) + 1) % V


def _gate(base: ChatFake, cand: ChatFake, rescore: bool = True, max_tokens: int = 8):
    return asyncio.run(run_greedy(base, cand, [PROMPT], max_tokens, GreedyGateOptions(rescore=rescore, strict=False)))


def test_chat_flip_reanchors_on_the_reported_rendered_ids():
    flip = _alt(RENDERED + _greedy_chain(3))  # a near-tie at output position 3 (context length 7)
    base, cand = ChatFake(gaps={7: 0.05}), ChatFake(gaps={7: 0.05}, picks={7: flip})
    g = _gate(base, cand)
    (pc,) = g.prompts
    assert pc.status == "flip" and pc.reanchors == 1 and pc.prompt_len == len(RENDERED), pc
    assert [r.messages is not None for r in base.requests[:1]] == [True]  # the first baseline: the chat request
    reanchor = base.requests[1]
    out = g.results[0].output_ids
    assert reanchor.prompt == RENDERED + out[:4]  # the rendered ids + the candidate's tokens up to the flip
    assert cand.scored and cand.scored[0][:len(RENDERED)] == RENDERED  # re-scored on the same ids
    assert g.verdict == "PASS"


@pytest.mark.parametrize("rescore", [True, False])
def test_chat_flip_without_rendered_ids_is_cannot_test(rescore):
    base = ChatFake(report=False, gaps={7: 0.05})
    cand = ChatFake(report=False, gaps={7: 0.05}, picks={7: _alt(RENDERED + _greedy_chain(3))})
    g = _gate(base, cand, rescore=rescore)
    (pc,) = g.prompts
    assert pc.untestable and pc.missing == NO_CHAT_IDS and "prompt_token_ids" in pc.reason
    assert ("re-scoring" if rescore else "re-anchoring") in pc.reason
    assert g.verdict == "CANNOT TEST" and NO_CHAT_IDS in g.missing
    assert len(base.requests) == 1 and not cand.scored  # nothing was sent on made-up ids


def test_chat_fail_stays_fail_without_rendered_ids():
    base, cand = ChatFake(report=False), ChatFake(report=False, picks={6: 0})  # a pick far below the top-1
    g = _gate(base, cand)
    assert g.prompts[0].status == "fail" and g.verdict == "FAIL"


def test_chat_arms_rendering_differently_are_untestable():
    base, cand = ChatFake(), ChatFake(render=[1, 2, 4])
    g = _gate(base, cand)
    assert g.prompts[0].untestable and "different prompt token ids" in g.prompts[0].reason
    assert g.verdict == "CANNOT TEST"


def test_sampled_rendering_problems():
    a = Samples("baseline", {}, rendered={0: {("ids", 1, 2, 3)}, 1: {("len", 4)}})
    same = Samples("candidate", {}, rendered={0: {("ids", 1, 2, 3)}, 1: {("ids", 1, 2, 3, 4)}})
    assert rendering_problems([("p0", "x"), ("p1", "y")], a, same) == []
    other = Samples("candidate", {}, rendered={0: {("ids", 1, 2, 9)}, 1: {("len", 5)}})
    probs = rendering_problems([("p0", "x"), ("p1", "y")], a, other)
    assert len(probs) == 2 and "same lengths, different ids" in probs[0] and "prompt p1" in probs[1]


# ---- sampled over HTTP ---------------------------------------------------------------------------------
SMALL = ["--num-prompts", "1", "--positions", "4", "--samples", "48", "--configs", "t=0.5", "--permutations", "99",
         "--prompt-set", "gsm8k"]


def test_sampled_chat_passes_between_served_engines(serve, tmp_path):
    off, on = serve("off"), serve("dflash")
    r = runner.invoke(cli.app, ["sampled", "--baseline", _oa(off), "--candidate", _oa(on), "--endpoint-type", "chat",
                                *SMALL, "--json", "--report", str(tmp_path / "r.md"), "--no-record"])
    assert r.exit_code == 0, r.output
    summ = json.loads(r.output.strip().splitlines()[-1])
    assert summ["verdict"] == "PASS" and summ["spec"]["num_drafts"] > 0 and summ["options"]["endpoint_type"] == "chat"
    assert any("rendered prompt ids reported by baseline, candidate" in n for n in summ["notes"]), summ["notes"]
    assert "/v1/chat/completions" in (tmp_path / "r.md").read_text()


def test_sampled_chat_fails_a_faulty_engine_behind_the_chat_route(serve):
    from specbench.suites.sampled.gate import SampledGateOptions, parse_configs, run_gate

    # the self-test's regime (suites/sampled/selftest.py): the n-gram proposer on an echo prompt, where
    # biased_accept acts; 256 samples per arm catch it in 3 of 4 cells
    opts = SampledGateOptions(num_prompts=1, positions=4, samples=256, permutations=999, prompt_chars=200,
                              prompt_set="echo", endpoint_type="chat", concurrency=64)
    base = OpenAIAdapter(serve("off"), model=MODEL, probe=True, name="baseline")
    cand = OpenAIAdapter(serve("ngram", ("biased_accept",)), model=MODEL, probe=True, name="candidate")
    try:
        res = run_gate(base, cand, opts, parse_configs("t=1.5,k=2"))
    finally:
        base.close()
        cand.close()
    assert res.verdict == "FAIL" and res.comparisons[0].rejected, res.summary()
    assert not res.missing and res.spec["num_drafts"] > 0


def test_sampled_chat_cannot_test_on_a_fake_endpoint_without_ids():
    with FakeEndpoint(max_tokens=4) as b, FakeEndpoint(max_tokens=4) as c:  # no token ids, no /tokenize
        r = runner.invoke(cli.app, ["sampled", "--baseline", f"openai:{b.url}", "--candidate", f"openai:{c.url}",
                                    "--endpoint-type", "chat", *SMALL, "--json", "--no-record"])
        posts = [s["path"] for s in b.seen + c.seen if s["method"] == "POST"]
    assert r.exit_code == 3, r.output
    summ = json.loads(r.output.strip().splitlines()[-1])
    assert summ["verdict"] == "CANNOT TEST" and any("without readable tokens" in m for m in summ["missing"])
    assert posts.count("/v1/chat/completions") == 2 * 48  # every sample of both arms (the probe uses completions)
