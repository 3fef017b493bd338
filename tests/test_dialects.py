"""Endpoint dialects and "no verdict without evidence" (issue #27), on in-process HTTP doubles.

tests/dialect_fakes.py serves one tiny deterministic model in llama.cpp's dialect and in vLLM's. These
tests pin the probe's capability record for each, the routes the openai adapter then takes (llama.cpp's
/tokenize body, native /completion ids and logprobs, `llamacpp:` counters, `timings.draft_n`, explicit
samplers, cache_prompt), the flagging of fake logprobs of draft-accepted tokens, the usage accounting
of a server that reports usage on the final event only, and that every gate answers CANNOT TEST
(exit 3), never PASS, when a capability is removed (no ids, no tokenize, empty samples, no counters).
CPU only, a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dialect_fakes import FakeServer, serving
from typer.testing import CliRunner

from specbench.harness.adapters.base import GenRequest, GenResult
from specbench.harness.adapters.dialect import LocalTokenizer, TokenizerError, missing_positions
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.adapters.openai_stream import StreamAccumulator
from specbench.harness.adapters.prom import spec_counters_from_metrics
from specbench.harness.verdicts import CANNOT_TEST, EXIT_CANNOT_TEST, combine, exit_code

TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures" / "tiny" / "target"


@pytest.fixture(scope="module")
def llama_off():
    with serving(FakeServer("llamacpp")) as url:
        yield url


@pytest.fixture(scope="module")
def llama_spec():
    fake = FakeServer("llamacpp", spec=True)
    with serving(fake) as url:
        yield url, fake


@pytest.fixture(scope="module")
def vllm_spec():
    with serving(FakeServer("vllm", spec=True)) as url:
        yield url


@pytest.fixture()
def cli():
    from specbench.cli.app import _register, app

    _register()
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


# ---- the probe ------------------------------------------------------------------------------------
def test_probe_llamacpp_dialect(llama_spec):
    url, _ = llama_spec
    caps = OpenAIAdapter(url, probe=True).probe()
    assert caps is not None
    d = caps.to_dict()
    assert d["dialect"] == "llamacpp" and d["server"]["version"] == "b0000-fake"  # /version 404 -> /props
    assert d["tokenize"] == "content"  # the {"prompt"} body answered [] for a non-empty text
    assert d["token_id_prompts"] is True and d["generate_route"] == "/completion"
    assert d["output_ids"] == "tokens" and d["logprobs"] == "native" and d["top_logprobs"] == 20
    assert d["prompt_logprobs"] is False and d["scoring"] == "generation"  # echo refused
    assert d["usage"] == "final" and d["metrics_prefix"] == "llamacpp:" and d["spec_counters"] is True
    assert d["per_request_spec"] == "timings" and d["prompt_cache"] == "cache_prompt"
    assert d["sampler_defaults"]["top_k"] == 40 and d["sampler_defaults"]["min_p"] == 0.05
    assert d["speculated_logprobs"] == "missing" and d["missing"] == []


def test_probe_vllm_dialect(vllm_spec):
    d = OpenAIAdapter(vllm_spec, probe=True).probe().to_dict()
    assert (d["dialect"], d["server"]["version"], d["tokenize"]) == ("vllm", "0.0.0-fake", "prompt")
    assert d["generate_route"] == "/v1/completions" and d["output_ids"] == "token_ids"
    assert d["logprobs"] == "legacy" and d["prompt_logprobs"] is True and d["scoring"] == "echo"
    assert d["usage"] == "per_chunk" and d["metrics_prefix"] == "vllm:" and d["prompt_cache"] == "cache_salt"


def test_vllm_prompt_cache_off_sends_a_fresh_cache_salt():
    """reports/h200-vllm finding 2: vLLM's prefix cache flips near-tied greedy tokens, and `cache_prompt` means
    nothing to it. A gate's request (prompt_cache=False) carries a salt of its own, so it never hits the cache;
    a request with prompt_cache None shares the cache (the server's default), as before."""
    fake = FakeServer("vllm", prefix_cache=True, gap=0.1)
    with serving(fake) as url:
        ad = OpenAIAdapter(url, probe=True)
        ids = [3, 4, 5, 6]

        def gen(**kw):
            r = ad.generate_sync([GenRequest(prompt=ids, max_tokens=4, temperature=0.0, **kw)])[0]
            assert r.ok, r.error
            return r.output_ids, fake.seen[-1]

        (a, body_a), (b, body_b) = gen(prompt_cache=False), gen(prompt_cache=False)
        assert body_a["cache_salt"] and body_b["cache_salt"] and body_a["cache_salt"] != body_b["cache_salt"]
        assert a == b  # both cold
        (fill, body_f), (hit, body_h) = gen(), gen()
        assert "cache_salt" not in body_f and "cache_salt" not in body_h
        assert fill == a and hit[0] != fill[0]  # the shared cache's hit flips: what the salt keeps out of a gate
        assert "cache_prompt" not in body_a  # llama.cpp's field is not sent to vLLM
    salted = FakeServer("vllm")
    with serving(salted) as url:  # a salt the caller set (extra_body) wins: the triage's own salts
        ad = OpenAIAdapter(url, probe=True, extra_body={"cache_salt": "mine"})
        assert ad.generate_sync([GenRequest(prompt=[1, 2], max_tokens=2, prompt_cache=False)])[0].ok
        assert salted.seen[-1]["cache_salt"] == "mine"
    fake_l = FakeServer("llamacpp")
    with serving(fake_l) as url:
        ad = OpenAIAdapter(url, probe=True)
        assert ad.generate_sync([GenRequest(prompt=[1, 2], max_tokens=2, prompt_cache=False)])[0].ok
        assert fake_l.seen[-1]["cache_prompt"] is False and "cache_salt" not in fake_l.seen[-1]


def test_describe_carries_the_capability_record(llama_off):
    d = OpenAIAdapter(llama_off, probe=True).describe()
    assert d["dialect"] == "llamacpp" and d["capabilities"]["tokenize"] == "content"
    assert d["version"] == "b0000-fake"
    assert "capabilities" not in OpenAIAdapter(llama_off).describe()  # probing off: the old behaviour


# ---- routes and parsing ---------------------------------------------------------------------------
def test_llamacpp_generation_ids_logprobs_and_draft_counts(llama_spec):
    url, fake = llama_spec
    ad = OpenAIAdapter(url, probe=True)
    ids = ad.tokenize_sync("Question: 2+3?")
    assert ids and all(isinstance(t, int) for t in ids)
    r = ad.generate_sync([GenRequest(prompt=ids, max_tokens=6, logprobs=3, prompt_cache=False)])[0]
    assert r.ok and len(r.output_ids) == 6 and r.chunk_tokens == [1] * 6 and r.token_count_method == "token_ids"
    assert missing_positions(r.logprobs) == [1, 3, 5]  # accepted from a draft: no logprobs, flagged
    assert all(len(p.top) == 3 for i, p in enumerate(r.logprobs) if i % 2 == 0)
    assert r.spec == {"num_draft_tokens": 6, "num_accepted_tokens": 3, "source": "timings"}
    body = fake.seen[-1]
    assert body["route"] == "/completion" and body["top_k"] == 0 and body["min_p"] == 0.0
    assert body["top_p"] == 1.0 and body["cache_prompt"] is False and body["n_probs"] == 3
    ad.generate_sync([GenRequest(prompt=ids, max_tokens=2)])
    assert "cache_prompt" not in fake.seen[-1]  # None = the server's default
    c = ad.spec_counters_sync()
    assert c["prefix"] == "llamacpp:" and c["num_drafts"] > 0 and c["accepted_per_pos"][0] == c["num_accepted_tokens"]


def test_llamacpp_non_streamed_placeholders_are_missing(llama_spec):
    url, _ = llama_spec
    ad = OpenAIAdapter(url, probe=True, stream=False)
    ad.probe()
    r = ad.generate_sync([GenRequest(prompt=[3, 4, 5], max_tokens=4, logprobs=2)])[0]
    assert r.ok and len(r.output_ids) == 4 and missing_positions(r.logprobs) == [1, 3]  # 0.0 + [] in the body


def test_score_by_generation_where_echo_is_refused(llama_spec):
    url, _ = llama_spec
    ad = OpenAIAdapter(url, probe=True)
    sc = ad.score_sync([1, 2, 3], [10, 11], top_k=5)  # greedy after 3 is 10; after 10: 31, 0, 1, then ties
    assert sc is not None and [p.token_id for p in sc.positions] == [10, 11]
    assert sc.positions[0].logprob == pytest.approx(-0.05) and len(sc.positions[0].top) == 5
    assert sc.positions[1].logprob is None  # outside the top-5: unknown, never a made-up value


def test_tokenize_never_answers_an_empty_list_for_text():
    with serving(FakeServer("llamacpp", tokenize="empty")) as url:
        assert OpenAIAdapter(url, probe=True).tokenize_sync("hello") is None
        assert OpenAIAdapter(url).tokenize_sync("hello") is None  # unprobed, both bodies tried
        local = OpenAIAdapter(url, probe=True, tokenizer=TINY_TOKENIZER)
        assert local.tokenize_sync("hello") == LocalTokenizer(TINY_TOKENIZER).encode("hello")
    with serving(FakeServer("llamacpp")) as url:  # unprobed: the {"content"} body is found and kept
        ad = OpenAIAdapter(url)
        assert ad.tokenize_sync("ab") == [97 % 32, 98 % 32] and ad._tokenize_body == "content"


def test_local_tokenizer_round_trip_and_agreement():
    tok = LocalTokenizer(TINY_TOKENIZER)
    assert tok.round_trips("Question: Tom has 3 apples.\nAnswer:") and tok.tokenize("") == []
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        LocalTokenizer(TINY_TOKENIZER.parent)
    # an endpoint that counts another number of prompt tokens: not this model's tokenizer
    with serving(FakeServer("llamacpp", tokenize=False)) as url:
        caps = OpenAIAdapter(url, probe=True, tokenizer=TINY_TOKENIZER).probe()
        assert caps.tokenize is None and caps.tokenizer["agrees_with_endpoint"] is False
    with serving(FakeServer("llamacpp", tokenize=False, tokenizer_json=str(TINY_TOKENIZER / "tokenizer.json"))) as url:
        caps = OpenAIAdapter(url, probe=True, tokenizer=TINY_TOKENIZER).probe()
        assert caps.tokenize == "local" and caps.tokenizer["round_trip"] is True


def test_usage_on_the_final_event_only_is_not_credited_to_it():
    acc = StreamAccumulator(chat=False)
    for i, text in enumerate(("ab", "c", "def", "g")):
        acc.feed({"choices": [{"index": 0, "text": text}]}, i)
    acc.feed({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 55}}, 5)
    r = acc.finish(GenResult(rid="x", ok=True))
    assert r.completion_tokens == 55 and sum(r.chunk_tokens) == 55 and len(r.chunk_tokens) == 4
    assert r.token_count_method == "proportional" and min(r.chunk_tokens) > 0  # not [0, 0, 0, 55]


def test_chat_shaped_logprobs_with_ids_and_placeholders():
    acc = StreamAccumulator(chat=False, top_k=2)
    acc.feed({"choices": [{"index": 0, "text": "a", "logprobs": {"content": [
        {"id": 7, "token": "a", "logprob": -0.1, "top_logprobs": [{"id": 7, "token": "a", "logprob": -0.1},
                                                                  {"id": 9, "token": "b", "logprob": -2.0}]},
        {"id": 8, "token": "c", "logprob": 0.0, "top_logprobs": []}]}}]}, 0)
    r = acc.finish(GenResult(rid="x", ok=True))
    assert r.output_ids == [7, 8] and r.logprobs[0].top == {7: -0.1, 9: -2.0}
    assert missing_positions(r.logprobs) == [1]


def test_prometheus_llamacpp_prefix():
    text = ("llamacpp:spec_decode_num_drafts_total 10\nllamacpp:spec_decode_num_draft_tokens_total 70\n"
            "llamacpp:spec_decode_num_accepted_tokens_total 12\n"
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8\n'
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4\n')
    c = spec_counters_from_metrics(text)
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (10, 70, 12)
    assert c["accepted_per_pos"] == [8, 4] and c["prefix"] == "llamacpp:"
    assert spec_counters_from_metrics(text + "vllm:spec_decode_num_drafts_total 3\n") is None  # two engines


def test_verdict_vocabulary():
    assert [exit_code(v) for v in ("PASS", "PASS (speculation asserted by the user, not observed)", "FAIL",
                                   "NOT SPECULATING",
                                   CANNOT_TEST)] == [0, 0, 1, 1, 3]
    assert combine([]) == CANNOT_TEST and combine(["PASS", CANNOT_TEST]) == CANNOT_TEST
    assert combine([CANNOT_TEST, "FAIL", "PASS"]) == "FAIL"


# ---- the gates: PASS, FAIL, CANNOT TEST -----------------------------------------------------------
def _lossless(cli, base: str, cand: str, *extra):
    return cli("lossless", "--baseline", f"openai:{base}", "--candidate", f"openai:{cand}", "--num-prompts", 2,
               "--max-tokens", 6, "--no-record", "--json", *extra)


def test_lossless_pass_fail_and_cannot_test(cli, llama_off, llama_spec):
    ok = _lossless(cli, llama_off, llama_spec[0])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout.strip().splitlines()[-1])
    assert doc["verdict"] == "PASS" and doc["engines"]["candidate"]["capabilities"]["dialect"] == "llamacpp"
    assert doc["gates"][0]["stats"]["source"] == "counters"  # timings carry no verify steps: llamacpp: counters
    with serving(FakeServer("llamacpp", model="wrong")) as wrong:  # two different models: the broken pairing
        bad = _lossless(cli, wrong, llama_spec[0])
    assert bad.exit_code == 1 and json.loads(bad.stdout.strip().splitlines()[-1])["verdict"] == "FAIL"
    with serving(FakeServer("llamacpp", spec=True, ids=False)) as no_ids:
        r = _lossless(cli, llama_off, no_ids)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.exit_code == EXIT_CANNOT_TEST and doc["verdict"] == CANNOT_TEST
    assert any("output token ids" in m for m in doc["summary"]["missing"])


def test_lossless_cannot_test_without_a_tokenizer_then_tokenizer_dir(cli):
    tj = str(TINY_TOKENIZER / "tokenizer.json")
    with serving(FakeServer("llamacpp", tokenize=False, tokenizer_json=tj)) as b, \
            serving(FakeServer("llamacpp", spec=True, tokenize="empty", tokenizer_json=tj)) as c:
        r = _lossless(cli, b, c)
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.exit_code == EXIT_CANNOT_TEST and doc["verdict"] == CANNOT_TEST and doc["gates"] == []
        assert "tokenize" in doc["summary"]["missing"][0] and "--tokenizer" in doc["summary"]["missing"][0]
        r = _lossless(cli, b, c, "--tokenizer", TINY_TOKENIZER)
        assert r.exit_code == 0, r.output
        caps = json.loads(r.stdout.strip().splitlines()[-1])["engines"]["baseline"]["capabilities"]
        assert caps["tokenize"] == "local" and caps["tokenizer"]["agrees_with_endpoint"] is True


def test_missing_baseline_logprobs_are_recovered_not_used(cli, llama_spec):
    """A speculating baseline (logprobs missing at odd positions) and a candidate that flips at position 1:
    the gate re-generates one token for the baseline's distribution there and judges by it."""
    url, _ = llama_spec
    with serving(FakeServer("llamacpp", spec=True, gap=0.1)) as base_tie, \
            serving(FakeServer("llamacpp", spec=True, flip_at=1, gap=0.1)) as tie, \
            serving(FakeServer("llamacpp", spec=True, flip_at=1)) as real:
        benign = _lossless(cli, base_tie, tie, "--quick")  # the greedy gate's flips alone
        fail = _lossless(cli, url, real, "--quick")
    doc = json.loads(benign.stdout.strip().splitlines()[-1])
    assert benign.exit_code == 0 and doc["summary"]["flips"] == 2, benign.output
    divs = [d for p in doc["gates"][0]["prompts"] for d in p["divergences"]]
    assert {d["dist_source"] for d in divs} == {"regenerated"} and all(d["judgement"]["ok"] for d in divs)
    doc = json.loads(fail.stdout.strip().splitlines()[-1])
    assert fail.exit_code == 1 and doc["verdict"] == "FAIL"
    j = doc["gates"][0]["prompts"][0]["divergences"][0]["judgement"]
    assert j["kind"] == "regret" and j["regret"] == pytest.approx(3.0)


def test_sampled_pass_and_cannot_test_on_empty_samples(cli, llama_off, llama_spec):
    args = ("--num-prompts", 1, "--positions", 3, "--samples", 48, "--configs", "t=1.0", "--permutations", 99,
            "--no-record", "--json")
    ok = cli("sampled", "--baseline", f"openai:{llama_off}", "--candidate", f"openai:{llama_spec[0]}", *args)
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout.strip().splitlines()[-1])["verdict"] == "PASS"
    with serving(FakeServer("llamacpp", spec=True, ids=False, tokenize="empty")) as empty:
        r = cli("sampled", "--baseline", f"openai:{llama_off}", "--candidate", f"openai:{empty}", *args)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.exit_code == EXIT_CANNOT_TEST and doc["verdict"] == CANNOT_TEST and doc["missing"]
    assert doc["comparisons"]["spec"]["testable"] == 0  # the old "PASS; 0/0 cells rejected"


def test_sweep_audit_pass_and_cannot_test(cli, llama_off, llama_spec, tmp_path):
    args = ("--concurrency", "1,2", "--num-prompts", 2, "--max-tokens", 4, "--rounds", 1, "--warmup", 0,
            "--no-progress", "--out", tmp_path, "--audit")
    ok = cli("sweep", "--arms", f"openai:{llama_off},name=off;openai:{llama_spec[0]},name=spec",
             "--report", tmp_path / "r.md", *args)
    assert ok.exit_code == 0, ok.output
    assert "acceptance audit: PASS" in ok.output
    md = (tmp_path / "r.md").read_text()
    assert "### Acceptance / metrics audit: PASS" in md and "per-request sums = counters" in md
    assert "### Endpoint capabilities" in md and "llamacpp:" in md
    with serving(FakeServer("vllm", metrics=False)) as b, serving(FakeServer("vllm", spec=True, metrics=False)) as c:
        r = cli("sweep", "--arms", f"openai:{b},name=off;openai:{c},name=spec", *args)
        plain = cli("sweep", "--arms", f"openai:{b},name=off;openai:{c},name=spec", *args[:-1])
    assert r.exit_code == EXIT_CANNOT_TEST and "acceptance audit: CANNOT TEST" in r.output
    assert plain.exit_code == 0 and "CANNOT TEST" in plain.output  # measured, reported, not a gate


def test_audit_finds_inconsistent_counters():
    from specbench.suites.sweep.audit import audit_records

    def cell(counters, arm="spec"):
        return {"kind": "cell", "arm": arm, "level": 1, "round": 0, "warmup": False, "counters": counters}

    def req(spec, arm="spec"):
        return {"kind": "request", "arm": arm, "ok": True, "spec": spec,
                "meta": {"arm": arm, "level": 1, "round": 0, "warmup": False}}

    good = {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1]}
    a = audit_records([cell(good), req({"num_draft_tokens": 8, "num_accepted_tokens": 3})])
    assert a["verdict"] == "PASS" and a["arms"][0]["cross_checked"] == 1
    a = audit_records([cell(good), req({"num_draft_tokens": 8, "num_accepted_tokens": 2})])
    assert a["verdict"] == "FAIL" and "per-request num_accepted_tokens sum 2 != counters 3" in a["arms"][0]["problems"][0]
    a = audit_records([cell({**good, "accepted_per_pos": [1, 2]})])
    assert a["verdict"] == "FAIL" and "increases" in a["arms"][0]["problems"][0]
    a = audit_records([cell(None), req(None)])
    assert a["verdict"] == CANNOT_TEST and a["missing"]
    assert audit_records([])["verdict"] == CANNOT_TEST


def test_eval_parity_on_nothing_is_cannot_test():
    from specbench.suites.evalparity import parity

    assert parity.overall([]) == CANNOT_TEST
