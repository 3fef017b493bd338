"""Prefix caching (engine/prefix_cache.py, engine/kv_cache.py, engine/prefix_share.py) and its invariants."""

from __future__ import annotations

import pytest

from specbench.engine import LLM, SamplingParams
from specbench.engine.config import ConfigError, EngineConfig
from specbench.engine.invariants import InvariantChecker, InvariantError
from specbench.engine.kv_cache import KVCacheError, PagePool
from specbench.engine.prefix_cache import PrefixIndex

PS = 4


def pool_with_cache(pages: int = 8, capacity: int | None = None) -> PagePool:
    return PagePool(pages, PS, PrefixIndex(PS, capacity))


def test_blocks_register_only_inside_the_committed_length():
    pool = pool_with_cache()
    toks = list(range(10, 20))
    pool.admit("a", 12)
    pool.ensure("a", 10)
    pool.commit("a", 7)  # positions 0..6 forwarded; the token at 7 has no KV yet
    pool.seal("a", toks, 7, None)
    assert len(pool.prefix) == 1  # block 0 only: block 1 (4..7) still needs position 7's row
    pool.commit("a", 8)
    pool.seal("a", toks, 8, None)
    assert len(pool.prefix) == 2
    assert pool.lookup(toks) == pool.table("a")[:2]
    assert pool.lookup(toks[:8]) == pool.table("a")[:1]  # at most len - 1 tokens: the last one is forwarded
    assert pool.lookup(toks, salt="other") == []  # another salt shares nothing


def test_shared_pages_are_refcounted_and_cached_after_the_last_holder():
    pool = pool_with_cache()
    toks = list(range(10, 19))
    pool.admit("a", 9)
    pool.ensure("a", 9)
    pool.commit("a", 9)
    pool.seal("a", toks, 9, None)
    hit = pool.lookup(toks)
    assert len(hit) == 2 and pool.can_admit(9, hit)
    pool.admit("b", 9, hit)
    assert pool.length("b") == 8 and pool.refs()[hit[0]] == 2
    pool.free("a")
    assert pool.refs()[hit[0]] == 1 and not pool.evictable()
    pool.free("b")
    assert set(pool.evictable()) == set(hit) and pool.num_free == 8  # cached pages count as available
    pool.check()
    assert pool.reset_prefix() and len(pool.free_pages()) == 8 and len(pool.prefix) == 0


def test_eviction_takes_the_oldest_cached_page_and_admission_counts_it():
    pool = pool_with_cache(pages=4)
    toks = list(range(1, 17))
    pool.admit("a", 16)
    pool.ensure("a", 16)
    pool.commit("a", 16)
    pool.seal("a", toks, 16, None)
    pool.free("a")  # four cached, unreferenced pages; the deepest block is the oldest
    assert len(pool.evictable()) == 4 and not pool.free_pages()
    hit = pool.lookup(toks[:9])  # blocks 0 and 1
    assert not pool.can_admit(20, hit) and pool.can_admit(12, hit)
    pool.admit("b", 12, hit)
    pool.ensure("b", 12)  # one page more: evicts the oldest unreferenced block (block 3)
    assert len(pool.prefix) == 3 and pool.lookup(toks) == pool.lookup(toks[:13])
    pool.check()
    assert not pool.reset_prefix()  # refused while "b" holds cached pages
    with pytest.raises(KVCacheError):
        pool.ensure("b", 20)


def test_capacity_keeps_the_index_bounded():
    pool = pool_with_cache(pages=8, capacity=2)
    for rid, base in (("a", 0), ("b", 100)):
        toks = list(range(base, base + 8))
        pool.admit(rid, 8)
        pool.ensure(rid, 8)
        pool.commit(rid, 8)
        pool.seal(rid, toks, 8, None)
        pool.free(rid)
    assert len(pool.prefix) == 2 and pool.lookup(list(range(100, 109))) and not pool.lookup(list(range(9)))
    pool.check()


def test_invariants_name_refcount_and_sealing_faults():
    pool = pool_with_cache()

    class _Sched:
        running: list = []

    chk = InvariantChecker(pool, _Sched(), None, None)  # type: ignore[arg-type]
    toks = list(range(10, 18))
    pool.admit("a", 8)
    pool.ensure("a", 8)
    pool.commit("a", 7)
    pool.seal("a", toks, 8, None)  # one token early: the register_before_forward bug
    _Sched.running = [type("R", (), {"rid": "a", "num_computed": 7, "params": None})()]
    with pytest.raises(InvariantError, match="had not been forwarded"):
        chk.check(1)
    pool.refs()[pool.table("a")[0]] = 2  # a refcount no table backs
    with pytest.raises(InvariantError, match="refcount 2 but 1 page table"):
        chk.check(2)


@pytest.fixture(scope="module")
def llm_pair(tiny_pair):
    t, d = tiny_pair
    return LLM(t, draft=d), LLM(t, draft=d, prefix_cache=False)


def test_warm_requests_equal_cold_ones_and_draft(llm_pair, gsm8k_prompts):
    warm_llm, cold_llm = llm_pair
    tok = warm_llm.tokenizer
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    first = [tok.encode(p) for p in gsm8k_prompts[:3]]
    outs = warm_llm.generate(first, sp)
    second = [f + o.output_ids + tok.encode("\nQuestion: and half of it?\nAnswer:") for f, o in zip(first, outs, strict=True)]
    m = warm_llm.engine.metrics
    hits0, caps0 = m.prefix_hits, m.capture_hits
    warm = warm_llm.generate(second, sp)
    cold = cold_llm.generate(second, sp)
    assert [w.output_ids for w in warm] == [c.output_ids for c in cold]
    assert all(w.spec["cached_tokens"] > 0 and w.spec["num_accepted_tokens"] > 0 for w in warm)
    assert m.prefix_hits - hits0 == sum(w.spec["cached_tokens"] for w in warm) and m.capture_hits - caps0 == 3
    assert cold_llm.engine.metrics.prefix_hits == 0
    text = m.prometheus("x")
    assert "vllm:prefix_cache_queries_total" in text and "vllm:prefix_cache_hits_total" in text
    assert warm_llm.engine.reset_prefix_cache() and warm_llm.engine.pool.num_free == warm_llm.engine.pool.num_pages


def test_capture_off_keeps_the_kv_hit_and_falls_back(tiny_pair, gsm8k_prompts):
    t, d = tiny_pair
    llm = LLM(t, draft=d, spec_capture_cache_mb=0)
    ids = llm.tokenizer.encode(gsm8k_prompts[0])
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    a = llm.generate([ids], sp)[0]
    b = llm.generate([ids], sp)[0]
    assert a.output_ids == b.output_ids and b.spec["cached_tokens"] > 0
    assert b.spec["capture_fallback"] and b.spec["num_drafts"] == 0 and a.spec["num_drafts"] > 0
    assert llm.engine.metrics.capture_fallbacks == 1


def test_knobs_are_validated_with_their_names(tiny_target):
    with pytest.raises(ConfigError, match="prefix_cache_pages"):
        EngineConfig(model=tiny_target, prefix_cache_pages=0)
    with pytest.raises(ConfigError, match="spec_capture_cache_mb"):
        EngineConfig(model=tiny_target, spec_capture_cache_mb=-1)
    with pytest.raises(ConfigError, match=r"prefix_cache_pages=9999 is invalid: expected an integer in \[1, 64\]"):
        LLM(tiny_target, num_pages=64, prefix_cache_pages=9999)
    with pytest.raises(ConfigError, match="cache_salt"):
        SamplingParams(cache_salt=3)  # type: ignore[arg-type]


# ---- the prefix gate (suites/lossless/prefix.py) on the bundled pair ----------------------------------------


def _gate(adapter, n: int = 2):
    import asyncio

    from specbench.suites.lossless.prefix import run_prefix_gate
    from specbench.suites.lossless.prompts import load_prompts

    async def main():
        convs = [(pid, await adapter.tokenize(text)) for pid, text in load_prompts("gsm8k", n)]
        try:
            return await run_prefix_gate(adapter, convs)
        finally:
            await adapter.aclose()

    return asyncio.run(main())


def test_prefix_gate_passes_clean_and_catches_register_before_forward(tiny_pair):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    clean = _gate(LocalAdapter.from_dirs(t, d, spec="dflash"))
    assert clean.verdict == "PASS" and clean.cold_method == "reset" and not clean.fallbacks, clean.reason
    assert all(c.cached_tokens for c in clean.cases) and all(c.drafted == "drafted" for c in clean.cases)
    # Without the run-time invariants (an engine specbench cannot look inside): caught by first-token drift,
    # named by conversation and boundary case.
    bad = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", check_invariants=False,
                                       faults=("register_before_forward",)))
    assert bad.verdict == "FAIL" and bad.failed, bad.reason
    wrong = [c for c in bad.failed if "fell back" not in c.reason]  # drift or a divergence: wrong tokens
    assert wrong and all(c.kind == "turn" and c.boundary == 0 for c in wrong)
    assert all(c.kind == "turn" for c in bad.failed)  # the rest fell back: blocks sealed ahead lack a capture
    assert "/ turn / block 16 / boundary +0" in bad.reason and "drift" in bad.reason
    # With them (every gate command's engines): the registration itself is refused.
    inv = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", check_invariants=True,
                                       faults=("register_before_forward",)), n=1)
    assert inv.verdict == "FAIL" and "had not been forwarded" in inv.reason


def test_prefix_gate_fails_the_fallback_of_no_publish_on_finish(tiny_pair):
    """Lossless tokens, but warm turns that never drafted: speculation silently off fails its case."""
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.prefix import render_markdown

    t, d = tiny_pair
    out = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", faults=("no_publish_on_finish",)))
    assert out.verdict == "FAIL" and out.fallbacks and not out.fallback_by_config
    assert all(c.kind == "turn" and c.warm_accept is None and c.cold_accept for c in out.fallbacks)
    assert out.failed == out.fallbacks and all("speculation silently off" in c.reason for c in out.failed)
    assert all(c.regret is None and c.compared for c in out.fallbacks)  # the tokens themselves were lossless
    assert "fell back" in render_markdown(out)


def test_prefix_gate_counts_but_passes_fallbacks_the_configuration_asks_for(tiny_pair):
    """spec_capture_cache_mb=0 turns capture reuse off: every warm hit falls back by design, named, not failed."""
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    out = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", spec_capture_cache_mb=0))
    assert out.fallback_by_config and out.fallbacks and out.verdict == "PASS", out.reason
    assert "capture reuse off by the engine's configuration" in out.reason


def test_acceptance_sign_test_rejects_warm_turns_that_accept_less_and_not_noise():
    from specbench.suites.lossless.prefix import Case, acceptance_sign_test

    def cases(pairs):
        return [Case("c", "repeat", 16, None, [1], 1, warm_accept=w, cold_accept=k) for w, k in pairs]

    same = acceptance_sign_test(cases([(2.5, 2.5)] * 12), 0.01)
    assert same["ok"] and same["compared"] == 12 and same["fewer"] == same["more"] == 0 and same["p"] == 1.0
    noise = acceptance_sign_test(cases([(2.4, 2.5), (2.6, 2.5)] * 4 + [(2.5, 2.5)] * 4), 0.01)
    assert noise["ok"] and (noise["fewer"], noise["more"]) == (4, 4)
    lower = acceptance_sign_test(cases([(2.0, 2.5)] * 8 + [(2.5, 2.5)] * 4), 0.01)
    assert not lower["ok"] and lower["fewer"] == 8 and lower["p"] < 0.01
    one_off = acceptance_sign_test(cases([(2.0, 2.5)] * 6 + [(2.6, 2.5)]), 0.01)  # 6 of 7 one way: p 0.125
    assert one_off["ok"]
    assert acceptance_sign_test(cases([(None, 2.5)] * 3), 0.01)["compared"] == 0


def test_prefix_gate_cannot_test_without_a_cold_path():
    import asyncio

    from lossless_fakes import FakeAdapter  # an adapter with neither a reset nor cache salts

    from specbench.suites.lossless.prefix import run_prefix_gate

    out = asyncio.run(run_prefix_gate(FakeAdapter(), [("p", [1, 2, 3])]))
    assert out.verdict.startswith("CANNOT TEST") and "prefix_reset" in out.verdict


def test_prefix_gate_cannot_test_an_engine_without_a_prefix_cache(tiny_pair):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    out = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", prefix_cache=False), n=1)
    assert out.verdict == "CANNOT TEST (prefix cache)", out.verdict


def test_prefix_gate_through_specbench_serve(tiny_pair):
    """The endpoint path: POST /reset_prefix_cache, cache_salt, the hit counters scraped from /metrics."""
    import httpx

    from specbench.engine import EngineConfig, LLMEngine, SpecConfig
    from specbench.harness.adapters.openai_api import OpenAIAdapter
    from specbench.harness.server import ServerThread, make_app

    t, d = tiny_pair
    eng = LLMEngine(EngineConfig(model=t, draft=d, spec=SpecConfig(method="dflash"), num_pages=256))
    app, loop = make_app(eng, served_name="tiny", max_pending=64)
    srv = ServerThread(app).start()
    try:
        bad = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "cache_salt": 3})
        assert bad.status_code == 400 and "cache_salt" in bad.text
        out = _gate(OpenAIAdapter(srv.url + "/v1", model="tiny", tokenizer=t), n=1)
        assert out.verdict == "PASS" and out.cold_method == "reset", out.reason
        assert all(c.cached_tokens for c in out.cases)  # from vllm:prefix_cache_hits deltas
        assert any(c.drafted == "drafted" for c in out.cases)
        assert "vllm:prefix_cache_hits_total" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
        loop.close()


def test_prefix_benchmark_logic_on_cpu(capsys):
    """benchmarks/prefix.py on a small workload: warm turns hit the cache and draft as the cold arm does."""
    from specbench.benchmarks.prefix import main

    doc = main(["--prefix-tokens", "40", "--conversations", "2", "--turns", "2", "--max-tokens", "8", "--rounds", "1"])
    rows = doc["turns_summary"]
    assert len(rows) == 2 and all(r["on_cached_tokens_mean"] >= 32 and r["off_cached_tokens_mean"] == 0 for r in rows)
    assert all(r["on_fallbacks"] == 0 and r["on_accept_len"] == r["off_accept_len"] for r in rows)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"benchmark": "prefix"')


def test_shared_prefix_sweep_workload():
    from specbench.suites.sweep.workload import SHARED_PREFIX, load_texts

    texts, _ = load_texts("shared_prefix", 4)
    assert len(texts) == 4 and all(t.startswith(SHARED_PREFIX) and len(t) > len(SHARED_PREFIX) for t in texts)


def test_blocks_of_a_request_that_cannot_speculate_carry_the_capture(llm_pair, gsm8k_prompts):
    """A request that never drafts (prompt logprobs) still has its drafter rows written, so a later hit on its
    blocks drafts."""
    warm_llm, _ = llm_pair
    ids = warm_llm.tokenizer.encode(gsm8k_prompts[5])
    first = warm_llm.generate([ids], SamplingParams(max_tokens=4, prompt_logprobs=1, ignore_eos=True))[0]
    assert first.spec["num_drafts"] == 0
    out = warm_llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.spec["cached_tokens"] > 0 and not out.spec["capture_fallback"] and out.spec["num_drafts"] > 0


def test_hits_through_the_padded_graph_runners(tiny_pair, gsm8k_prompts):
    """The GPU path's padded verify / draft runners (eager on CPU): prefills that start at a hit, restored drafter
    context, several warm requests batched together; tokens equal the cache-off engine's."""
    t, d = tiny_pair
    fast = LLM(t, draft=d, num_pages=256, max_num_seqs=8)
    fast.engine.runner.use_graph_runner = True
    fast.engine.proposer.use_graphs = fast.engine.cfg.draft_graph
    plain = LLM(t, draft=d, num_pages=256, max_num_seqs=8, prefix_cache=False)
    tok = fast.tokenizer
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    firsts = [tok.encode(p) for p in gsm8k_prompts[:3]]
    outs = fast.generate(firsts, sp)
    seconds = [f + o.output_ids + tok.encode("\nQuestion: and then?\nAnswer:") for f, o in zip(firsts, outs, strict=True)]
    warm = fast.generate(seconds + firsts, sp)  # turn 2 of each and the first turns again, one batch
    cold = plain.generate(seconds + firsts, sp)
    assert [w.output_ids for w in warm] == [c.output_ids for c in cold]
    assert all(w.spec["cached_tokens"] and w.spec["num_drafts"] and not w.spec["capture_fallback"] for w in warm)
    assert fast.engine.fast_path_stats().get("verify") is not None


def test_lossless_suite_prefix_command(tmp_path):
    import json

    from typer.testing import CliRunner

    from specbench.cli import app as cli

    cli._register()
    runner = CliRunner()
    res = runner.invoke(cli.app, ["lossless", "--suite", "prefix", "--num-prompts", "1", "--results", str(tmp_path)])
    assert res.exit_code == 0, res.output
    run = json.loads(next(tmp_path.glob("*/run.json")).read_text())
    assert run["suite"] == "lossless-prefix" and run["summary"]["verdict"] == "PASS"
    assert len(next(tmp_path.glob("*/cases.jsonl")).read_text().splitlines()) == 6
    bad = runner.invoke(cli.app, ["lossless", "--suite", "prefix", "--block-sizes", "0", "--no-record"])
    assert bad.exit_code == 2 and "--block-sizes" in bad.output
