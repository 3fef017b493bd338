"""Run-time invariants (engine/invariants.py) and the faults of #18, each proven real at the engine level.

- the checker itself on hand-broken pools: a page owned twice, owned and free, lost (named with its last
  owner), a table longer than the committed length needs, a stray table, a drafter context off by one;
- the clean engine passes them after every step (DFlash batched, staggered lengths, logprobs and sampled
  neighbours, an abort mid-run; n-gram);
- skip_rollback, rollback_keeps_page and draft_ctx_misaligned raise InvariantError naming the request,
  the step and the numbers; rollback_keeps_page (checks off) holds one page too many while running and
  frees it with the request, so the idle KV check cannot see it;
- verify_pos_shift: the drafted rows' positions move by one (the anchor's does not), deterministically,
  and the output changes;
- batched_draft_pos: one request alone drafts exactly as the clean engine; in a batch acceptance drops;
- accept_tolerance: acceptance rises and the flips it causes cost < 0.1 nat;
- eos_in_run: an EOS or stop token id inside an accepted run no longer ends the request there;
- the engine string switch and the gate commands' default (harness/engines.py gate_specs).
"""

from __future__ import annotations

import pytest
import torch

from specbench.engine import LLM, SamplingParams
from specbench.engine.config import EngineConfig
from specbench.engine.faults import FAULTS, make_faults
from specbench.engine.invariants import InvariantChecker, InvariantError
from specbench.engine.kv_cache import PagePool, pages_for
from specbench.engine.request import Request
from specbench.engine.scheduler import Span
from specbench.engine.spec.accept import accept_greedy, accept_greedy_within
from specbench.engine.spec.dflash_graphs import block_positions
from specbench.engine.spec.plan import SpecPlan
from specbench.engine.spec.proposer import OracleProposer, Proposer

NEW_FAULTS = ("rollback_keeps_page", "verify_pos_shift", "batched_draft_pos", "accept_tolerance", "eos_in_run")


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[:6]


def _llm(pair, faults=(), **kw):
    t, d = pair
    return LLM(t, draft=d, num_pages=256, faults=tuple(faults), **kw)


def _run(eng, prompts, params, rids=None):
    """Every prompt added at once, stepped to the end; the outputs by rid."""
    rids = rids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        eng.add_request(p, params, rid=rid)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.rid] = o
    return [outs[r] for r in rids]


# ---- the checker on hand-built state -----------------------------------------------------------------
class _Sched:
    def __init__(self, reqs):
        self.running = reqs


class _Ctx(Proposer):
    def __init__(self, ctx):
        super().__init__(1)
        self.ctx = ctx

    def context(self, rid):
        return self.ctx.get(rid, (0, 0))


PLAN = SpecPlan(True, "dflash", 7, 8, True, True)


def _req(rid, n):
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8))
    r.num_computed = n
    return r


def _state(page_size=4, pages=16):
    pool = PagePool(pages, page_size)
    reqs = [_req("a", 6), _req("b", 3)]
    for r in reqs:
        pool.admit(r.rid, 20)
        pool.ensure(r.rid, r.num_computed)
        pool.commit(r.rid, r.num_computed)
    return pool, reqs


def test_checker_accepts_a_consistent_state_and_names_each_break():
    pool, reqs = _state()
    ctx = {"a": (6, 6), "b": (3, 3)}
    chk = InvariantChecker(pool, _Sched(reqs), _Ctx(ctx), PLAN)
    chk.check(1)
    # a table one page longer than the committed length needs (what rollback_keeps_page leaves)
    pool.ensure("a", 9)
    with pytest.raises(InvariantError, match=r"step 2: request 'a' owns 3 pages where its committed length needs 2") as e:
        chk.check(2)
    assert e.value.rid == "a" and e.value.step == 2 and e.value.numbers["pages"] == 3 and e.value.numbers["needed"] == 2
    pool.commit("a", 6)
    chk.check(3)
    # a lost page, named with the request it was last handed to (what skip_rollback leaves)
    pool.ensure("b", 7)
    lost = pool.table("b")[-1]
    pool.commit("b", 3, leak=True)
    with pytest.raises(InvariantError, match=r"request 'b' lost 1 page\(s\)") as e:
        chk.check(4)
    assert e.value.numbers["lost"] == [lost] and e.value.numbers["last_owners"] == ["b"]
    pool.free_pages().append(lost)
    pool.free_set().add(lost)
    chk.check(5)
    # a page on the free list twice
    pool.free_pages().append(lost)
    with pytest.raises(InvariantError, match=r"the page pool has pages on its free list twice") as e:
        chk.check(5)
    assert e.value.numbers["pages"] == [lost] and e.value.rid is None
    pool.free_pages().pop()
    # a page owned twice, and a page owned and free
    pool.table("b").append(pool.table("a")[0])
    reqs[1].num_computed = pool._reqs["b"].length = 5
    with pytest.raises(InvariantError, match="which 'a' owns too"):
        chk.check(6)
    pool.table("b")[-1] = pool.free_pages()[0]
    with pytest.raises(InvariantError, match="on the free list too"):
        chk.check(7)
    pool.free_pages().remove(pool.table("b")[-1])
    pool.free_set().discard(pool.table("b")[-1])
    ctx["b"] = (5, 5)
    chk.check(8)
    # the drafter's rows one position late (draft_ctx_misaligned), and its tracked length behind
    ctx["a"] = (6, 7)
    with pytest.raises(InvariantError, match=r"request 'a' has drafter context rows to 7 \(tracked 6\)"):
        chk.check(9)
    ctx["a"] = (5, 5)
    with pytest.raises(InvariantError, match="drafter context"):
        chk.check(10)
    ctx["a"] = (6, 6)
    # a finished request whose pages were never freed, and a running request with no table
    chk.scheduler.running = [reqs[0]]
    with pytest.raises(InvariantError, match="request 'b' holds pages but is not running"):
        chk.check(11)
    chk.scheduler.running = reqs + [_req("c", 2)]
    with pytest.raises(InvariantError, match="request 'c' is running without a page table"):
        chk.check(12)


def test_checker_skips_requests_that_cannot_speculate_and_proposers_without_context():
    pool, reqs = _state()
    reqs[0].params = SamplingParams(max_tokens=8, prompt_logprobs=2)  # never drafted: the drafter tracks none
    InvariantChecker(pool, _Sched(reqs), _Ctx({"b": (3, 3)}), PLAN).check(1)
    InvariantChecker(pool, _Sched(reqs), Proposer(1), PLAN).check(1)  # no per-position context (n-gram)
    InvariantChecker(pool, _Sched(reqs), None, PLAN).check(1)


# ---- the clean engine ----------------------------------------------------------------------------------
def test_invariants_are_on_in_tests_and_off_by_default(tiny_target, monkeypatch):
    assert EngineConfig(model=tiny_target).check_invariants  # tests/conftest.py: SPECBENCH_INVARIANTS=1
    monkeypatch.delenv("SPECBENCH_INVARIANTS")
    assert not EngineConfig(model=tiny_target).check_invariants
    assert LLM(tiny_target, num_pages=16).engine.invariants is None
    assert LLM(tiny_target, num_pages=16, check_invariants=True).engine.describe()["check_invariants"]


def test_clean_engine_keeps_every_invariant_after_every_step(tiny_pair, prompts):
    """Staggered lengths, logprobs and sampled neighbours, a request aborted mid-run: checked after every
    step (the engine raises otherwise), and every page is back at the end."""
    llm = _llm(tiny_pair)
    eng = llm.engine
    assert eng.invariants is not None
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 3, 20, 9)]
    params += [SamplingParams(max_tokens=12, logprobs=2), SamplingParams(max_tokens=30, temperature=0.8, seed=1)]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(p, sp, rid=f"c{i}")
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 4:
            eng.abort("c2")
        for r in eng.scheduler.running:
            assert len(eng.pool.table(r.rid)) == pages_for(r.num_computed, eng.pool.page_size)
    assert eng.metrics.num_accepted_tokens > 0 and eng.pool.num_free == eng.pool.num_pages
    ngram = LLM(tiny_pair[0], spec="ngram", num_pages=256)
    _run(ngram.engine, prompts[:3], SamplingParams(max_tokens=24, ignore_eos=True))
    assert ngram.engine.metrics.num_drafts > 0


# ---- faults the invariants catch -------------------------------------------------------------------
@pytest.mark.parametrize("fault, match", [
    ("skip_rollback", r"lost \d+ page\(s\): neither free nor owned"),
    ("rollback_keeps_page", r"owns \d+ pages where its committed length needs \d+"),
    ("draft_ctx_misaligned", r"has drafter context rows to (\d+) \(tracked (\d+)\)"),
])
def test_invariants_catch_the_bookkeeping_faults(tiny_pair, prompts, fault, match):
    eng = _llm(tiny_pair, (fault,)).engine
    with pytest.raises(InvariantError, match=match) as e:
        _run(eng, prompts[:3], SamplingParams(max_tokens=32, ignore_eos=True))
    err = e.value
    assert err.rid in {"r0", "r1", "r2"} and err.step >= 1 and str(err).startswith(f"step {err.step}: request ")
    if fault == "rollback_keeps_page":
        assert err.numbers["pages"] == err.numbers["needed"] + 1
        assert err.numbers["needed"] == pages_for(err.numbers["num_computed"], err.numbers["page_size"])
    if fault == "draft_ctx_misaligned":
        assert err.numbers["rows_end"] == err.numbers["num_computed"] + 1 == err.numbers["drafter_context"] + 1


def test_rollback_keeps_page_holds_a_page_too_many_and_frees_it_with_the_request(tiny_pair, prompts):
    """Checks off: outputs and acceptance unchanged, one page too many held while running (the run-time
    invariant's catch), none missing at idle (what the idle KV-leak check sees)."""
    clean = _llm(tiny_pair, check_invariants=False).engine
    eng = _llm(tiny_pair, ("rollback_keeps_page",), check_invariants=False).engine
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    extra = []
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, sp, rid=f"r{i}")
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.rid] = o
        extra += [len(eng.pool.table(r.rid)) - pages_for(r.num_computed, eng.pool.page_size)
                  for r in eng.scheduler.running]
    assert max(extra) == 1 and min(extra) == 0 and extra.count(1) >= 3
    assert eng.pool.num_free == eng.pool.num_pages
    eng.pool.check()
    ref = _run(clean, prompts[:3], sp)
    assert [outs[f"r{i}"].output_ids for i in range(3)] == [o.output_ids for o in ref]


def test_invariant_failure_reaches_the_adapter_as_a_failed_request(tiny_pair, prompts):
    """Through the local adapter (as in a gate): every request in flight fails with the invariant's message."""
    import asyncio

    from specbench.harness.adapters.base import GenRequest
    from specbench.harness.engines import build_adapter

    t, d = tiny_pair
    ad = build_adapter(f"local:{t},draft={d},spec=dflash,num_pages=256,faults=rollback_keeps_page,invariants=1")
    try:
        assert ad.describe()["config"]["check_invariants"]
        res = asyncio.run(ad.generate([GenRequest(prompt=p, max_tokens=32, ignore_eos=True) for p in prompts[:2]],
                                      concurrency=2))
    finally:
        ad.close()
    assert all(not r.ok for r in res)
    assert all("InvariantError: step" in r.error and "owns" in r.error and "needs" in r.error for r in res), \
        [r.error for r in res]


# ---- verify_pos_shift ----------------------------------------------------------------------------------
def test_verify_pos_shift_moves_the_drafted_rows_only(tiny_pair, prompts):
    eng = _llm(tiny_pair, check_invariants=False).engine
    req = Request("p", [5, 6, 7], SamplingParams())
    eng.pool.admit("p", 64)
    eng.pool.ensure("p", 40)
    spans = [Span(req, [1, 2, 3, 4], 20, "verify", drafts=[2, 3, 4]), Span(req, [9], 30, "decode")]
    _, pos = eng.runner.metadata(spans, pos_shift=[1, 0])
    assert pos.tolist() == [20, 22, 23, 24, 30]
    _, pos = eng.runner.metadata(spans)
    assert pos.tolist() == [20, 21, 22, 23, 30]
    eng.pool.free("p")


def test_verify_pos_shift_changes_the_output_deterministically(tiny_pair, prompts):
    sp = SamplingParams(max_tokens=48)
    base = LLM(tiny_pair[0], num_pages=256)
    ref = [base.generate([p], sp)[0].output_ids for p in prompts]
    runs = [[_llm(tiny_pair, ("verify_pos_shift",)).generate([p], sp)[0].output_ids for p in prompts]
            for _ in range(2)]
    assert runs[0] == runs[1]  # deterministic
    assert sum(a != b for a, b in zip(runs[0], ref, strict=True)) >= 3


# ---- batched_draft_pos --------------------------------------------------------------------------------
def test_block_positions_tiled_only_differ_for_a_batch():
    assert block_positions([10], 4) == block_positions([10], 4, tile_starts=True) == [10, 11, 12, 13]
    assert block_positions([10, 50], 3) == [10, 11, 12, 50, 51, 52]
    assert block_positions([10, 50], 3, tile_starts=True) == [10, 51, 12, 50, 11, 52]


def test_batched_draft_pos_hurts_batched_requests_only(tiny_pair, prompts):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    clean, bad = _llm(tiny_pair), _llm(tiny_pair, ("batched_draft_pos",))
    for p in prompts[:3]:  # one request at a time: exactly the clean engine, acceptance included
        a, b = clean.generate([p], sp)[0], bad.generate([p], sp)[0]
        assert a.output_ids == b.output_ids and a.spec["accepted_runs"] == b.spec["accepted_runs"]
    ca, ba = _run(clean.engine, prompts, sp), _run(bad.engine, prompts, sp)
    assert [o.output_ids for o in ca] == [o.output_ids for o in ba]  # verify still corrects every token
    acc_clean = sum(sum(o.spec["accepted_runs"]) for o in ca)
    acc_bad = sum(sum(o.spec["accepted_runs"]) for o in ba)
    assert acc_bad < 0.7 * acc_clean, (acc_bad, acc_clean)
    assert sum(sum(a.spec["accepted_runs"]) > sum(b.spec["accepted_runs"]) for a, b in zip(ca, ba, strict=True)) >= 4


# ---- accept_tolerance ---------------------------------------------------------------------------------
def test_accept_greedy_within_tolerance():
    lg = torch.tensor([[0.0, 5.0, 4.95, 0.0], [0.0, 0.0, 1.0, 3.0], [1.0, 0.0, 0.0, 0.0]])
    am = lg.argmax(-1).tolist()
    assert accept_greedy([2, 3], am) == (0, [1])
    assert accept_greedy_within([2, 3], am, lg, 0.1) == (2, [2, 3, 0])  # 4.95 within 0.1 of 5.0; 3 is the argmax
    assert accept_greedy_within([2, 2], am, lg, 0.1) == (1, [2, 3])
    assert accept_greedy_within([2, 3], am, lg, 0.0) == (0, [1])
    assert make_faults(("accept_tolerance",)).accept_rule.greedy_tol == 0.1
    assert make_faults(()).accept_rule.greedy_tol == 0.0


def test_accept_tolerance_raises_acceptance_with_tiny_flips(tiny_pair, prompts):
    sp = SamplingParams(max_tokens=48)
    base = LLM(tiny_pair[0], num_pages=256)
    clean, bad = _llm(tiny_pair), _llm(tiny_pair, ("accept_tolerance",))
    acc = {"clean": 0, "bad": 0}
    flips = []
    for p in prompts:
        ref, a, b = base.generate([p], sp)[0], clean.generate([p], sp)[0], bad.generate([p], sp)[0]
        assert a.output_ids == ref.output_ids
        acc["clean"] += sum(a.spec["accepted_runs"])
        acc["bad"] += sum(b.spec["accepted_runs"])
        i = next((j for j, (x, y) in enumerate(zip(ref.output_ids, b.output_ids, strict=False)) if x != y), None)
        if i is None:
            continue
        lp = base.generate([ref.prompt_ids + ref.output_ids[:i]], SamplingParams(max_tokens=1, logprobs=20))[0]
        top = lp.logprobs[0][1]
        flips.append(max(top.values()) - top[b.output_ids[i]])
    assert acc["bad"] > acc["clean"], acc
    assert len(flips) >= 2 and all(0.0 <= f < 0.1 + 1e-4 for f in flips), flips


# ---- eos_in_run ---------------------------------------------------------------------------------------
def test_eos_in_run_overruns_a_stop_token_inside_an_accepted_run(tiny_target, prompts):
    base = LLM(tiny_target, num_pages=256)
    ref = base.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True))[0].output_ids
    cont = {tuple(base.tokenizer.encode(prompts[0])): ref}
    vocab = base.engine.mcfg.vocab_size
    stop_tok = ref[9]
    first = ref.index(stop_tok)
    sp = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok])
    outs = {}
    for fault in ((), ("eos_in_run",)):
        llm = LLM(tiny_target, num_pages=256, faults=fault, proposer=OracleProposer(6, cont, lambda s, r: 6, vocab))
        outs[fault] = llm.generate([prompts[0]], sp)[0]
    ok, bad = outs[()], outs[("eos_in_run",)]
    assert ok.output_ids == ref[: first + 1] and ok.finish_reason == "stop"
    assert len(bad.output_ids) > first + 1 and bad.output_ids[: first + 1] == ref[: first + 1]
    assert bad.output_ids[first] == stop_tok and stop_tok in bad.output_ids[:-1]


def test_eos_in_run_overruns_the_models_own_eos(tiny_pair, gsm8k_prompts):
    """The tiny model ends some gsm8k answers with EOS inside an accepted run: with the fault the request
    emits the EOS and keeps going."""
    sp = SamplingParams(max_tokens=120)
    clean = _llm(tiny_pair).generate(gsm8k_prompts[:2], sp)
    bad = _llm(tiny_pair, ("eos_in_run",)).generate(gsm8k_prompts[:2], sp)
    eos = _llm(tiny_pair).engine.eos_ids
    over = [(a, b) for a, b in zip(clean, bad, strict=True) if a.finish_reason == "stop" and a.output_ids[-1] in eos
            and len(b.output_ids) > len(a.output_ids)]
    assert over, [(a.finish_reason, len(a.output_ids), len(b.output_ids)) for a, b in zip(clean, bad, strict=True)]
    for a, b in over:
        assert b.output_ids[: len(a.output_ids)] == a.output_ids  # the clean output, then past its EOS


# ---- the registry and the switch ---------------------------------------------------------------------
def test_new_faults_are_registered_hooks(tiny_target):
    assert set(NEW_FAULTS) <= set(FAULTS) and all(FAULTS[f] for f in NEW_FAULTS)
    f = make_faults(NEW_FAULTS)
    req = Request("x", [1], SamplingParams())
    spans = [Span(req, [1, 2], 0, "verify", drafts=[2]), Span(req, [3], 0, "decode")]
    assert f.on_propose(spans).tile_starts
    kn = f.on_commit(spans)
    assert kn.keep_pages == (1, 0) and kn.stop_ids_at_end and kn.kept(0) == 1 and kn.kept(5) == 0
    assert not make_faults(()).on_propose(spans).tile_starts and make_faults(()).on_commit(spans).keep_pages == ()


def test_engine_string_switch_and_gate_default(tiny_target):
    from specbench.harness.engines import EngineStringError, gate_specs, parse_engine

    on, off, remote = (parse_engine(s) for s in (f"local:{tiny_target}", f"local:{tiny_target},invariants=0",
                                                 "openai:http://127.0.0.1:9"))
    g = gate_specs([on, off, remote])
    assert g[0].options["invariants"] == "1" and g[0].raw.endswith(",invariants=1")
    assert g[1].options["invariants"] == "0" and g[2] is remote
    assert parse_engine(g[0].raw).options["invariants"] == "1"
    with pytest.raises(EngineStringError, match="invariants"):
        parse_engine(f"local:{tiny_target},invariants=maybe")
