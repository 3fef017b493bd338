"""Speculative decoding in the reference engine (fp32, CPU): lossless by test, exact by construction.

- spec-on greedy == spec-off greedy token for token: batch 1, staggered max_tokens, mixed batches;
- oracle proposer pins every accept length 0..K: committed tokens, page usage after rollback (no leak)
  and the metric invariants;
- the DFlash drafter's paged, batched draft equals its dense reference on the same features;
- the drafter's context covers exactly the committed positions after every step (m + 1 rows per verify);
- stops inside an accepted run end the request there; headroom admission.
"""

import json

import pytest
import torch

from specbench.engine import LLM, AdmissionError, SamplingParams
from specbench.engine.kv_cache import pages_for
from specbench.engine.rope import RotaryCache
from specbench.engine.scheduler import Span
from specbench.engine.spec.proposer import OracleProposer

N_NEW = 24


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[:6]


@pytest.fixture(scope="module")
def baseline(tiny_target, prompts):
    llm = LLM(tiny_target, num_pages=256)
    return llm.generate(prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))


@pytest.fixture(scope="module")
def spec_llm(tiny_target, tiny_draft):
    return LLM(tiny_target, draft=tiny_draft, num_pages=256)


def test_spec_equals_plain_batch1_and_batched(spec_llm, prompts, baseline):
    single = spec_llm.generate([prompts[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    assert single.output_ids == baseline[0].output_ids
    outs = spec_llm.generate(prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    for b, o in zip(baseline, outs, strict=True):
        assert o.output_ids == b.output_ids
    m = spec_llm.engine.metrics
    assert m.num_drafts > 0 and sum(m.accepted_per_pos) == m.num_accepted_tokens
    assert all(a >= b for a, b in zip(m.accepted_per_pos, m.accepted_per_pos[1:], strict=False))


def test_staggered_max_tokens_concurrent(tiny_target, spec_llm, prompts):
    budgets = [1, 2, 3, 5, 9, 17]
    plain = LLM(tiny_target, num_pages=256)
    params = [SamplingParams(max_tokens=b, ignore_eos=True) for b in budgets]
    want = [plain.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params, strict=True)]
    got = spec_llm.generate(prompts, params)
    for w, g, b in zip(want, got, budgets, strict=True):
        assert g.output_ids == w and len(g.output_ids) == b


def test_mixed_batch_speculating_and_not(spec_llm, prompts, baseline):
    # prompt logprobs never speculate (logprobs do: tests/test_logprobs_parity.py)
    params = [SamplingParams(max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=2 if i % 2 else None)
              for i in range(len(prompts))]
    before = spec_llm.engine.metrics.num_drafts
    outs = spec_llm.generate(prompts, params)
    for b, o, p in zip(baseline, outs, params, strict=True):
        assert o.output_ids == b.output_ids
        if p.prompt_logprobs is not None:
            assert o.spec["num_drafts"] == 0 and len(o.prompt_logprobs) == len(o.prompt_ids)
        else:
            assert o.spec["num_drafts"] > 0  # the neighbours kept speculating
    assert spec_llm.engine.metrics.num_drafts > before


def test_batched_draft_equals_per_request(tiny_target, tiny_draft, prompts, baseline):
    a = LLM(tiny_target, draft=tiny_draft, num_pages=256, batched_draft=True)
    b = LLM(tiny_target, draft=tiny_draft, num_pages=256, batched_draft=False)
    sp = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    oa, ob = a.generate(prompts, sp), b.generate(prompts, sp)
    for x, y, base in zip(oa, ob, baseline, strict=True):
        assert x.output_ids == y.output_ids == base.output_ids
        assert x.spec["accepted_runs"] == y.spec["accepted_runs"]


def test_draft_context_tracks_committed_rows(spec_llm, prompts):
    eng = spec_llm.engine
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, SamplingParams(max_tokens=N_NEW, ignore_eos=True), rid=f"ctx-{i}")
    seen_multi = False
    while eng.has_unfinished():
        for out in eng.step():
            if out.spec["accepted_runs"] and max(out.spec["accepted_runs"]) > 0:
                seen_multi = True
        for r in eng.scheduler.running:
            if not r.in_prefill:
                assert eng.proposer.ctx_len[r.rid] == r.num_computed  # m + 1 rows per verify, exactly
            assert eng.pool.capacity(r.rid) >= r.num_computed
    assert seen_multi, "the fixture drafter never accepted a draft: multi-token paths untested"


def test_paged_batched_draft_matches_dense_reference(tiny_target, tiny_draft, prompts):
    transformers = pytest.importorskip("transformers")
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256)
    eng = llm.engine
    ids = [eng.tokenizer.encode(p) for p in prompts[:3]]
    for i, p in enumerate(ids):
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True), rid=f"d{i}")
    while any(r.in_prefill or not r.output_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    reqs = list(eng.scheduler.running)
    spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in reqs]
    paged = eng.proposer.draft_logits(spans)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    draft = eng.draft_model
    rope = RotaryCache(draft.cfg, "cpu", torch.float32, max_pos=4096)
    b = draft.block_size
    for r, lg in zip(reqs, paged, strict=True):
        with torch.no_grad():
            hs = hf(torch.tensor([r.all_ids[: r.num_computed]]), output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in draft.target_layer_ids], dim=-1)[None]
        c = taps.shape[1]
        block = torch.tensor([[r.all_ids[c]] + [draft.mask_token_id] * (b - 1)])
        emb = torch.nn.functional.embedding(block, eng.model.embed)
        h = draft.forward_dense(taps, torch.arange(c)[None], torch.ones(1, c, dtype=torch.bool), emb,
                                torch.arange(c, c + b)[None], rope)
        dense = eng.model.logits(h[0, 1:])
        assert torch.allclose(dense, lg, atol=1e-4), (dense - lg).abs().max()
        assert dense.argmax(-1).tolist() == lg.argmax(-1).tolist()


def _oracle_llm(tiny_target, prompts, base, k, schedule):
    vocab = json.loads(open(f"{tiny_target}/config.json").read())["vocab_size"]
    llm0 = LLM(tiny_target, num_pages=256)
    cont = {tuple(llm0.tokenizer.encode(p)): b.output_ids for p, b in zip(prompts, base, strict=True)}
    return LLM(tiny_target, num_pages=256, proposer=OracleProposer(k, cont, schedule, vocab))


@pytest.mark.parametrize("accept", [0, 1, 2, 3, 4])
def test_oracle_pins_accept_length(tiny_target, prompts, baseline, accept):
    k = 4
    llm = _oracle_llm(tiny_target, prompts[:2], baseline[:2], k, lambda step, req: accept)
    eng = llm.engine
    free0 = eng.pool.num_free
    for i, p in enumerate(prompts[:2]):
        eng.add_request(p, SamplingParams(max_tokens=N_NEW, ignore_eos=True), rid=f"o{i}")
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.rid] = o
        for r in eng.scheduler.running:  # after every commit: exactly the committed pages, no more
            assert len(eng.pool.table(r.rid)) == pages_for(r.num_computed, eng.pool.page_size)
    assert eng.pool.num_free == free0  # nothing leaked after rollback + free
    eng.pool.check()
    for i, b in enumerate(baseline[:2]):
        o = outs[f"o{i}"]
        assert o.output_ids == b.output_ids
        runs = o.spec["accepted_runs"]
        full = [r for r in runs[:-2]]  # the last steps may be truncated by max_tokens
        assert full and all(r == accept for r in full), runs
    m = eng.metrics
    assert sum(m.accepted_per_pos) == m.num_accepted_tokens
    assert m.accepted_per_pos[accept:] == [0] * (k - accept)


def test_stop_inside_accepted_run(tiny_target, prompts, baseline):
    """With every draft correct, a stop token / stop string in the middle of an accepted run ends the
    request there: nothing is emitted past it."""
    llm = _oracle_llm(tiny_target, prompts[:1], baseline[:1], 6, lambda step, req: 6)
    ref = baseline[0].output_ids
    stop_tok = ref[9]
    first = ref.index(stop_tok)
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert out.output_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert max(out.spec["accepted_runs"]) >= 2
    text = llm.tokenizer.decode(ref)
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True, stop=[stop_str]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == text[: text.index(stop_str)]
    assert stop_str not in out.text and len(out.output_ids) < N_NEW


def test_headroom_rejected_at_admission(tiny_target, tiny_draft):
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=512)
    eng = llm.engine
    max_pos = eng.mcfg.max_position_embeddings
    block = eng.draft_cfg.block_size
    assert eng.max_model_len == max_pos - block
    ok = [7] * (max_pos - block - 2)
    eng.add_request(ok, SamplingParams(max_tokens=2, ignore_eos=True), rid="fits")
    for extra in (1, block):  # lands in the drafter's headroom (max_pos - block, max_pos]
        with pytest.raises(AdmissionError, match="drafter's block"):
            eng.add_request([7] * (max_pos - block - 2 + extra), SamplingParams(max_tokens=2))
    eng.abort("fits")
    assert eng.pool.num_free == eng.pool.num_pages


def test_ngram_proposer_is_lossless(tiny_target, prompts, baseline):
    llm = LLM(tiny_target, spec="ngram", num_speculative_tokens=3, num_pages=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    for b, o in zip(baseline, outs, strict=True):
        assert o.output_ids == b.output_ids
    assert llm.engine.metrics.num_drafts > 0


def test_synthetic_acceptance_hits_tau_and_is_labelled(tiny_target, tiny_draft, prompts):
    from specbench.engine.spec.synthetic import rate_for_tau

    r = rate_for_tau(3.5, 7)
    assert abs(sum(r ** i for i in range(1, 8)) - 2.5) < 1e-6
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256, synthetic_tau=3.5)
    assert llm.engine.describe()["synthetic_tau"] == 3.5
    llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    m = llm.engine.metrics
    k = llm.engine.k
    full = [a for a in m.accepted_per_pos]  # per-position counts follow r^(i+1)
    tau = 1 + m.num_accepted_tokens / m.num_drafts
    assert 2.5 < tau < 4.5, tau  # truncation near max_tokens pulls it down a little
    assert all(a >= b for a, b in zip(full, full[1:], strict=False)) and len(full) == k


def test_synthetic_acceptance_is_common_to_every_engine(tiny_target, tiny_draft, prompts):
    """Common random numbers (spec/synthetic.py): whether a position is acceptable is fixed by the seed, the
    request's prompt and the position, so two engines given the same prompts in another order, another batch
    and another step order accept the same drafts, request by request; and a span's count keeps its law,
    P(m >= j) = r^j capped at its drafts, over spans that each start past the last one's rejection."""
    from specbench.engine.spec.synthetic import SyntheticAcceptance

    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    runs = []
    for order in (prompts, list(reversed(prompts))):
        llm = LLM(tiny_target, draft=tiny_draft, num_pages=256, synthetic_tau=3.5)
        outs = {p: o for p, o in zip(order, llm.generate(order, sp), strict=True)}
        runs.append([(outs[p].spec["num_draft_tokens"], outs[p].spec["num_accepted_tokens"]) for p in prompts])
        llm.close()
    assert runs[0] == runs[1] and sum(a for _, a in runs[0]) > 0
    syn = SyntheticAcceptance(3.5, 7, seed=3)
    counts, pos = [], 0
    for _ in range(20000):
        m = syn.draw([5, 6, 7], pos, 7)
        counts.append(m)
        pos += m + 1  # the rejected position is replaced by the target's token: never read again
    for j in (1, 2, 4):
        got = sum(m >= j for m in counts) / len(counts)
        assert abs(got - syn.rate ** j) < 0.02, (j, got, syn.rate ** j)
    assert syn.draw([5, 6, 7], 10, 7) == SyntheticAcceptance(3.5, 7, seed=3).draw([5, 6, 7], 10, 7)
    other = SyntheticAcceptance(3.5, 7, seed=4)
    assert syn.acceptable([5, 6, 7], 50)[:50].tolist() != other.acceptable([5, 6, 7], 50)[:50].tolist()


def test_speed_bench_reseeds_synthetic_acceptance(tiny_target, tiny_draft, prompts):
    """benchmarks/speed.py `spec_wall`: the arms of one repeat (one seed) accept the same drafts, another repeat's
    seed draws other ones (it ran on the GPU only, so a stale attribute would have failed there first)."""
    from specbench.benchmarks.speed import spec_wall

    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256, synthetic_tau=3.5)
    ps = [llm.engine.tokenizer.encode(p) for p in prompts[:2]]
    got = []
    for seed in (7, 7, 8, 9, 10):
        m = llm.engine.metrics
        before = (m.num_drafts, list(m.accepted_per_pos))
        spec_wall(llm, ps, 32, "cpu", seed=seed)
        got.append((m.num_drafts - before[0], [a - b for a, b in zip(m.accepted_per_pos, before[1] or
                                                                      [0] * len(m.accepted_per_pos), strict=True)]))
    assert got[0] == got[1] and len({repr(g) for g in got[1:]}) > 1, got
    assert llm.engine.synthetic.seed == 10
    llm.close()


def test_synthetic_acceptance_cache_by_request_id():
    """Keyed by the request id (no hash of a long prompt per step), the draws equal the prompt-keyed ones, and a
    request that reuses an id with another prompt gets that prompt's draws."""
    from specbench.engine.spec.synthetic import SyntheticAcceptance

    a, b = list(range(3, 900)), list(range(5, 40))
    by_rid, by_prompt = SyntheticAcceptance(3.5, 7, seed=1), SyntheticAcceptance(3.5, 7, seed=1)
    for start in range(0, 200, 9):
        assert by_rid.draw(a, start, 7, rid="x") == by_prompt.draw(a, start, 7)
    assert [by_rid.draw(b, s, 7, rid="x") for s in range(0, 90, 5)] == [by_prompt.draw(b, s, 7) for s in range(0, 90, 5)]
