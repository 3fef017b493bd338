"""DFlash2 in the reference engine: config, convolution, selector, paged == dense, lossless, check-draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specbench.engine import LLM, SamplingParams
from specbench.engine.config import ConfigError, ModelConfig
from specbench.engine.models.dflash import DFlashDraftModel
from specbench.engine.models.dflash2 import (
    DFlash2DraftModel,
    GroupedDynamicConv,
    declared_causal,
    drafter_class,
    load_draft_config,
)
from specbench.engine.spec import selector as sel
from specbench.harness.checkdraft import check_draft
from specbench.harness.fixtures.drafter import save_drafter
from specbench.harness.fixtures.drafter2 import draft2_config, drafter2_tensors, new_drafter2

FIXTURE = Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft"


def _random_drafter2(tiny_target: str, out: Path, flat: bool = False, seed: int = 0) -> Path:
    tcfg = json.loads((Path(tiny_target) / "config.json").read_text())
    cfg = draft2_config(tcfg, 4093, [1, 3], 8, 1, flat=flat)
    m = new_drafter2(cfg, tcfg["hidden_size"], seed)
    with torch.no_grad():  # non-identity convolutions and a selector that matters
        gen = torch.Generator().manual_seed(seed + 1)
        for conv in (*m.attn_convs, *m.mlp_convs):
            conv.base.add_(torch.randn(conv.base.shape, generator=gen) * 0.3)
            conv.proj_w.copy_(torch.randn(conv.proj_w.shape, generator=gen) * 0.05)
        for p in (m.sel_pred, m.sel_succ, m.sel_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    save_drafter(out, cfg, drafter2_tensors(m))
    return out


@pytest.fixture(scope="module")
def rand2(tiny_target, tmp_path_factory) -> str:
    return str(_random_drafter2(tiny_target, tmp_path_factory.mktemp("d2") / "draft"))


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[:3]


def test_config_nested_and_flat_and_causality(tiny_target, tmp_path):
    nested = load_draft_config(_random_drafter2(tiny_target, tmp_path / "n"))
    flat = load_draft_config(_random_drafter2(tiny_target, tmp_path / "f", flat=True))
    for c in (nested, flat):
        assert drafter_class(c) is DFlash2DraftModel
        assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (8, 4093, (1, 3))
    a, b = DFlash2DraftModel(nested, 128), DFlash2DraftModel(flat, 128)
    assert (a.conv_kernel, a.conv_group, a.selector_rank, a.selector_top_k, a.softcap) == \
        (b.conv_kernel, b.conv_group, b.selector_rank, b.selector_top_k, b.softcap) == (2, 16, 32, 8, 30.0)
    # is_causal wins over layer_types; without it, all sliding_attention -> causal
    assert declared_causal({"is_causal": False, "layer_types": ["sliding_attention"]}) is False
    assert declared_causal({"layer_types": ["sliding_attention"]}) is True
    assert declared_causal({"is_causal": True}) is True and declared_causal({}) is False
    assert drafter_class(ModelConfig.from_dir(Path(__file__).parent.parent / "harness/data/fixtures/tiny/draft")) \
        is DFlashDraftModel
    # the engine drafts a flat config exactly as the nested one (same weights: same seed)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = []
    for d in (tmp_path / "n", tmp_path / "f"):
        llm = LLM(tiny_target, draft=str(d), num_pages=128)
        runs.append((llm.generate(["Question: 2 + 3?\nAnswer:"], sp)[0].output_ids,
                     llm.engine.metrics.snapshot()["num_accepted_tokens"]))
    assert runs[0] == runs[1]
    raw = {**nested.raw, "dflash_config": {**nested.raw["dflash_config"], "conv_group_size": 7}}
    with pytest.raises(ConfigError, match="conv_group_size=7"):
        DFlash2DraftModel(ModelConfig.from_dict(raw), 128)


def test_conv_formula_and_block_boundary():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(8, 2, 4)
    conv.base.data = torch.randn(2, 2, 8)
    conv.proj_w.data = torch.randn(2 * 2 * 2, 8)
    x = torch.randn(3, 5, 8)
    d = conv.delta(x)
    out = conv.conv(x, d, 1)
    ref = torch.zeros_like(x)
    for n in range(3):
        for i in range(5):
            for t in range(2):
                if i - t >= 0:
                    for c in range(8):
                        ref[n, i, c] += (conv.base[1, t, c] + d[n, i, 1, t, c // 4]) * x[n, i - t, c]
    torch.testing.assert_close(out, ref)
    y = x.clone()
    y[0, 4] += 1.0  # the last slot of block 0: blocks 1, 2 and earlier slots of block 0 unmoved
    out2 = conv.conv(y, d, 1)
    torch.testing.assert_close(out2[1:], out[1:])
    torch.testing.assert_close(out2[0, :4], out[0, :4])


def test_sampled_path_q_is_the_draw_distribution():
    torch.manual_seed(0)
    n, s, k, v, r = 2, 3, 4, 20, 5
    logits = torch.randn(n, s, v)
    unary, ids = sel.candidates(logits, k)
    proj, pred, succ = torch.randn(n, s, r), torch.randn(v, r), torch.randn(v, r)
    anchor = torch.tensor([1, 2])
    temps = torch.tensor([0.7, 1.3])
    d, q = sel.sampled_path(unary, ids, proj, anchor, pred, succ, temps, torch.rand(n, s), v)
    torch.testing.assert_close(q.sum(-1), torch.ones(n, s))
    assert bool(((q > 0).sum(-1) <= k).all())
    # slot 0's q depends on the anchor only: the empirical frequencies of 4000 draws (one batch of copies of
    # request 0) match it
    draws = 4000
    rep = lambda t: t[:1].expand(draws, *t.shape[1:])  # noqa: E731
    dd, qq = sel.sampled_path(rep(unary), rep(ids), rep(proj), rep(anchor), pred, succ, rep(temps),
                              torch.rand(draws, s), v)
    torch.testing.assert_close(qq[:, 0], q[:1, 0].expand(draws, v))
    counts = torch.bincount(dd[:, 0], minlength=v).float()
    assert float((counts / draws - q[0, 0]).abs().max()) < 0.03
    # greedy at T -> 0 is the argmax path
    g = sel.greedy_path(unary, ids, proj, anchor, pred, succ)
    d, _ = sel.sampled_path(unary, ids, proj, anchor, pred, succ, torch.full((n,), 1e-4), torch.rand(n, s) * 0.5, v)
    assert torch.equal(g, d)


def test_paged_draft_equals_dense_reference(tiny_target, rand2, prompts):
    """The engine's paged batched DFlash2 block pass (convolutions, selector) == forward_dense + the
    selector's greedy path on the same features, for every request of one batch."""
    transformers = pytest.importorskip("transformers")
    from specbench.engine.rope import RotaryCache
    from specbench.engine.scheduler import Span

    llm = LLM(tiny_target, draft=rand2, num_pages=256)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(eng.tokenizer.encode(p), SamplingParams(max_tokens=4, ignore_eos=True), rid=f"d{i}")
    while any(r.in_prefill or not r.output_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    reqs = list(eng.scheduler.running)
    spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in reqs]
    paged_h = eng.proposer.draft_hidden(spans)
    eng.proposer.propose(spans, [7] * len(spans))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    d = eng.draft_model
    rope = RotaryCache(d.cfg, "cpu", torch.float32, max_pos=4096)
    b = d.block_size
    for r, h_paged, s in zip(reqs, paged_h, spans, strict=True):
        with torch.no_grad():
            hs = hf(torch.tensor([r.all_ids[: r.num_computed]]), output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in d.target_layer_ids], dim=-1)[None]
        c = taps.shape[1]
        block = torch.tensor([[r.all_ids[c]] + [d.mask_token_id] * (b - 1)])
        emb = torch.nn.functional.embedding(block, eng.model.embed)
        h = d.forward_dense(taps, torch.arange(c)[None], torch.ones(1, c, dtype=torch.bool), emb,
                            torch.arange(c, c + b)[None], rope)[0, 1:]
        torch.testing.assert_close(h, h_paged, atol=1e-4, rtol=1e-4)
        dense = d.greedy_drafts(h[None], eng.model.lm_head_w, torch.tensor([r.all_ids[c]]))[0].tolist()
        assert dense == s.drafts
        argmax = d.greedy_drafts(h[None], eng.model.lm_head_w, torch.tensor([r.all_ids[c]]), selector=False)[0]
        assert argmax.tolist() != dense  # the selector changes the path on this drafter (else the test is blind)


@pytest.mark.parametrize("batched", [True, False])
def test_dflash2_greedy_spec_equals_plain(tiny_target, rand2, prompts, batched):
    plain = LLM(tiny_target, num_pages=256)
    spec = LLM(tiny_target, draft=rand2, num_pages=256, batched_draft=batched)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    a = [o.output_ids for o in plain.generate(prompts, p)]
    b = [o.output_ids for o in spec.generate(prompts, p)]
    assert a == b
    snap = spec.engine.metrics.snapshot()
    assert snap["num_drafts"] > 0


def test_unused_tensors_named_when_dflash1_code_loads_dflash2(tiny_target, rand2):
    cfg, tcfg = load_draft_config(rand2), ModelConfig.from_dir(tiny_target)
    m1 = DFlashDraftModel.load(rand2, cfg, tcfg, torch.float32, "cpu")
    assert any("attention_conv" in n for n in m1.unused_tensors)
    assert "candidate_selector.predecessor_codebook" in m1.unused_tensors
    m2 = DFlash2DraftModel.load(rand2, cfg, tcfg, torch.float32, "cpu")
    assert m2.unused_tensors == []


def test_check_draft_passes_clean_and_fails_each_broken_variant(tiny_target, rand2, tiny_draft):
    assert check_draft(rand2, tiny_target).verdict == "PASS"
    assert check_draft(tiny_draft, tiny_target).verdict == "PASS"
    r = check_draft(rand2, tiny_target, arch="DFlashDraftModel")
    assert r.verdict == "FAIL"
    t = next(c for c in r.checks if c.name == "tensors")
    assert t.verdict == "FAIL" and "candidate_selector.successor_codebook" in t.detail and "DFlash1" in t.detail
    r = check_draft(rand2, tiny_target, causal=True)
    c = next(c for c in r.checks if c.name == "causality")
    assert r.verdict == "FAIL" and c.verdict == "FAIL" and "is_causal" in c.detail and "layer_types" in c.detail


def test_memory_plan_charges_the_dflash2_weights(tiny_target, rand2):
    from specbench.engine.memory import draft_weight_bytes

    cfg, tcfg = load_draft_config(rand2), ModelConfig.from_dir(tiny_target)
    m = DFlash2DraftModel.load(rand2, cfg, tcfg, torch.float32, "cpu")
    assert draft_weight_bytes(cfg, tcfg, torch.float32) == 4 * sum(p.numel() for p in m.parameters())


def test_qwen3_4b_shaped_dflash2_drafter(tmp_path):
    from specbench.harness.fixtures.shape4b import build_qwen3_4b_shape
    from specbench.harness.fixtures.shape4b_dflash2 import (
        build_qwen3_4b_dflash2,
        dflash2_config,
        dflash2_shapes,
    )

    small = {"hidden_size": 32, "intermediate_size": 48, "head_dim": 8}
    tdir, _ = build_qwen3_4b_shape(tmp_path, seed=0, overrides=small, shard_bytes=4 << 20)
    d2 = build_qwen3_4b_dflash2(tmp_path / "draft-dflash2", seed=0, overrides=small, selector_rank=4)
    report = check_draft(d2, tdir)
    assert report.verdict == "PASS", report.render()
    # at full size: REFERENCE-dflash2.md's shapes at hidden 2560 (1664 = 6656 / 16 x 2 x 2 there; 640 here)
    tcfg, cfg = dflash2_config()
    full = dict(dflash2_shapes(cfg, tcfg["hidden_size"]))
    assert full["layers.4.mlp_conv.kernel_projection.weight"] == (640, 2560)
    assert full["layers.0.attention_conv.base_kernel"] == (2, 2, 2560)
    assert full["candidate_selector.predecessor_codebook"] == (151936, 256)


@pytest.mark.parametrize("causal", [None, True])
def test_padded_graph_body_equals_plain_pass(tiny_target, rand2, prompts, causal):
    """DraftGraphs2 (the padded piecewise body, eager on CPU) == the plain pass: logits, hidden, the greedy
    walk inside the tail, for a batch padded to its bucket; causal forced too."""
    from specbench.engine.scheduler import Span
    from specbench.engine.spec.dflash2_graphs import DraftGraphs2

    llm = LLM(tiny_target, draft=rand2, num_pages=256)
    eng, p = llm.engine, llm.engine.proposer
    for i, q in enumerate(prompts):
        eng.add_request(eng.tokenizer.encode(q), SamplingParams(max_tokens=4, ignore_eos=True), rid=f"g{i}")
    while any(r.in_prefill or not r.output_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in eng.scheduler.running]
    logits, hidden, path = p._draft(spans, False, causal)  # plain
    assert path is None
    g = p.graphs2 = DraftGraphs2(p, capture=False, buckets=[1, 4])
    glogits, ghidden, gpath = p._draft(spans, False, causal)
    assert g.stats["padded_rows"] == (4 - len(spans)) * p.block > 0
    torch.testing.assert_close(ghidden, hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(glogits, logits, atol=1e-4, rtol=1e-4)
    d = eng.draft_model
    anchors = torch.tensor([s.tokens[0] for s in spans])
    unary, ids = sel.candidates(logits, d.selector_top_k)
    assert gpath.tolist() == sel.greedy_path(unary, ids, sel.project(hidden, d.sel_proj), anchors, d.sel_pred,
                                             d.sel_succ).tolist()
    if causal is not None:
        return
    # and the engine drafts through it: spec on == spec off with the graph body installed
    plain = LLM(tiny_target, num_pages=256)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    llm2 = LLM(tiny_target, draft=rand2, num_pages=256)
    llm2.engine.proposer.graphs2 = DraftGraphs2(llm2.engine.proposer, capture=False)
    assert [o.output_ids for o in llm2.generate(prompts, sp)] == [o.output_ids for o in plain.generate(prompts, sp)]
    assert llm2.engine.proposer.graphs2.stats["steps"] > 0


def test_prefix_cache_hits_with_the_dflash2_drafter(tiny_target, gsm8k_prompts):
    """A prefix hit restores the drafter's captured context rows (DFlash2's context path is DFlash1's: the
    convolutions act on the block only), so warm requests draft and equal cold ones."""
    fixture = Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft"
    warm_llm = LLM(tiny_target, draft=str(fixture), prefix_cache=True)
    cold_llm = LLM(tiny_target, draft=str(fixture), prefix_cache=False)
    tok, sp = warm_llm.tokenizer, SamplingParams(max_tokens=24, ignore_eos=True)
    first = [tok.encode(p) for p in gsm8k_prompts[:2]]
    outs = warm_llm.generate(first, sp)
    second = [f + o.output_ids + tok.encode("\nQuestion: and half of it?\nAnswer:") for f, o in zip(first, outs, strict=True)]
    caps0 = warm_llm.engine.metrics.capture_hits
    warm, cold = warm_llm.generate(second, sp), cold_llm.generate(second, sp)
    assert [w.output_ids for w in warm] == [c.output_ids for c in cold]
    assert all(w.spec["cached_tokens"] > 0 for w in warm) and warm_llm.engine.metrics.capture_hits - caps0 == 2
    acc = lambda outs: sum(o.spec["num_accepted_tokens"] for o in outs)  # noqa: E731
    assert acc(warm) == acc(cold) > 0  # the restored context drafts exactly as the recomputed one


def test_mixed_greedy_and_sampled_batch(tiny_target, rand2, prompts):
    """Greedy and T > 0 requests in one DFlash2 draft batch: the greedy ones equal spec-off greedy, the sampled
    ones draft from the selector's walk (their q rows sum to 1 over at most K candidates)."""
    plain = LLM(tiny_target, num_pages=256)
    spec = LLM(tiny_target, draft=rand2, num_pages=256)
    g = SamplingParams(max_tokens=20, ignore_eos=True)
    t = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=7)
    seen = []
    prop = spec.engine.proposer
    orig = prop._propose_group

    def spy(grp, kmap, tile_starts, selector, causal):
        orig(grp, kmap, tile_starts, selector, causal)
        seen.extend(s.draft_probs for s in grp if not s.req.params.greedy and s.drafts)

    prop._propose_group = spy
    out = spec.generate(prompts + prompts[:1], [g] * len(prompts) + [t])
    assert [o.output_ids for o in out[:-1]] == [o.output_ids for o in plain.generate(prompts, g)]
    assert seen and all(torch.allclose(q.sum(-1), torch.ones(q.shape[0])) and bool(((q > 0).sum(-1) <= 8).all())
                        for q in seen)


def test_span_cost_model_times_the_dflash2_body(tiny_target, rand2):
    """The automatic span policy's start-up cost model (engine/spec/costs.py) times DFlash2's own padded body."""
    llm = LLM(tiny_target, draft=rand2, num_pages=256, spec_policy="auto", max_num_seqs=2)
    costs = llm.engine.policy.costs
    assert costs is not None and costs.notes["draft_body"] == "dflash2-eager"
    assert all(t > 0 for t in costs.draft_s)
