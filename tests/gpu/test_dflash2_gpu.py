"""Issue 25 on the device: the DFlash2 draft with every fast path on, bf16.

- the DFlash2 draft graph (engine/spec/dflash2_graphs.py: convolutions inside the captured segments, the
  greedy walk in the tail) replays bit-identical to its eager padded body, with torch.topk and with
  FlashInfer's radix top-k (SPECBENCH_FLASHINFER_TOPK=1, where flashinfer.top_k exists), the walk as the
  one-launch kernel (kernels/selector_walk.py) and as torch ops, and its drafts agree with the plain eager pass;
- the selector-walk kernel == the torch walk on CUDA (tests/selector_walk_cases.py, up to the Qwen3-4B
  vocabulary and batch 64), captured in a CUDA graph too; the draft graph's path with the kernel == without it,
  and the replay timed both ways (printed);
- FlashInfer's top-k gives torch.topk's values on draft-like logits;
- the regret gate, spec on vs off, on the tiny target with the tiny-dflash2 fixture and all fast paths.
Run with `pytest -m gpu tests/gpu/test_dflash2_gpu.py -s` (scripts/gpu.sh tests).
"""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent.parent
FIXTURE = ROOT / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft"


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def geo_pair2(tmp_path_factory):
    """A random target with Qwen3-4B's head geometry and a random DFlash2 drafter (block 16) for it."""
    from qwen3_random import write_random_qwen3

    from specbench.harness.fixtures.drafter import save_drafter
    from specbench.harness.fixtures.drafter2 import draft2_config, drafter2_tensors, new_drafter2

    root = tmp_path_factory.mktemp("geo2")
    target = write_random_qwen3(root / "target", vocab=4096, hidden=1024, layers=4, heads=16, kv_heads=4,
                                head_dim=128, inter=2816, max_pos=8192, dtype=torch.bfloat16)
    tcfg = json.loads((target / "config.json").read_text())
    dcfg = draft2_config(tcfg, mask_token_id=4095, target_layer_ids=[1, 3], block_size=16, layers=2)
    d = new_drafter2(dcfg, tcfg["hidden_size"], seed=1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for conv in (*d.attn_convs, *d.mlp_convs):
            conv.proj_w.copy_(torch.randn(conv.proj_w.shape, generator=g) * 0.01)
    save_drafter(root / "draft", dcfg, {k: v.to(torch.bfloat16) for k, v in drafter2_tensors(d).items()})
    return str(target), str(root / "draft")


def _ready(target: str, draft: str, n: int = 8):
    from specbench.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig

    eng = LLMEngine(EngineConfig(model=target, draft=draft, device="cuda", dtype="bfloat16", num_pages=2048,
                                 max_num_seqs=16, spec=SpecConfig(method="dflash")))
    gen = torch.Generator().manual_seed(11)
    for i in range(n):
        eng.add_request(torch.randint(2, 4000, (6 + 5 * i,), generator=gen).tolist(),
                        SamplingParams(max_tokens=200, ignore_eos=True), rid=f"r{i}")
    while any(r.in_prefill or not r.output_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    return eng, list(eng.scheduler.running)


@pytest.mark.parametrize("walk", ["kernel", "torch"])
@pytest.mark.parametrize("fi_topk", ["0", "1"])
def test_dflash2_draft_graph_replay_bit_identical_to_eager(geo_pair2, fi_topk, walk, monkeypatch):
    from specbench.engine.scheduler import Span
    from specbench.engine.spec import selector
    from specbench.engine.spec.dflash2_graphs import DraftGraphs2

    if fi_topk == "1":
        import flashinfer

        if not hasattr(flashinfer, "top_k"):
            pytest.skip(f"flashinfer {flashinfer.__version__} has no top_k")
    monkeypatch.setenv(selector.TOPK_ENV, fi_topk)
    selector._flashinfer_topk.cache_clear()
    try:
        eng, reqs = _ready(*geo_pair2)
        p = eng.proposer
        assert type(p).__name__ == "DFlash2Proposer" and p.use_graphs and p.walk_kernel  # the kernel by default
        p.walk_kernel = walk == "kernel"
        eager, graph = DraftGraphs2(p, capture=False), DraftGraphs2(p, capture=True)
        for n in (1, 3, 8):
            spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in reqs[:n]]
            la, ha, pa = (t.clone() for t in eager.run2(spans))
            for _ in range(2):
                lg, hg, pg = graph.run2(spans)
                assert torch.equal(la, lg) and torch.equal(ha, hg) and torch.equal(pa, pg), f"n={n}"
            p.graphs2 = None
            p.use_graphs = False
            plain_logits, plain_hidden, _ = p._draft(spans, False, None)
            p.use_graphs = True
            agree = (la.argmax(-1) == plain_logits.argmax(-1)).float().mean().item()
            print(f"dflash2 draft n={n} topk={'flashinfer' if fi_topk == '1' else 'torch'} walk={walk}: graph == eager; "
                  f"argmax agreement with the plain pass {agree:.3f}")
            assert agree > 0.8
        assert graph.stack.captured
    finally:
        selector._flashinfer_topk.cache_clear()
    _free()


def test_selector_walk_kernel_equals_torch_walk_on_cuda():
    """kernels/selector_walk.py == the torch walk (greedy and T > 0, ties, bf16 codebooks) on the device, at the
    engine's shapes too; captured in a CUDA graph it replays to the eager result; both walks timed captured."""
    from selector_walk_cases import _inputs, run_cases

    from specbench.engine.spec import selector as sel
    from specbench.kernels.selector_walk import selector_walk

    stats = run_cases(torch.device("cuda"), big=True)
    print(f"selector walk kernel == torch walk on CUDA: {stats}")
    g = torch.Generator(device="cuda").manual_seed(5)
    for n in (1, 8, 64):
        x = _inputs(torch.device("cuda"), g, n, 15, 16, 256, 151936, torch.bfloat16)
        ms = {}
        for name, fn in (("kernel", lambda x=x: selector_walk(*x)[0]), ("torch", lambda x=x: sel.greedy_path(*x))):
            ref = fn()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm-up (Triton compile) outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), f"{name} n={n}: the captured walk differs from its eager run"
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            ms[name] = start.elapsed_time(end) / 50
        print(f"selector walk n={n} S=15 K=16 R=256 V=151936, captured: kernel {ms['kernel'] * 1e3:.1f} us, "
              f"torch {ms['torch'] * 1e3:.1f} us")
    _free()


def test_dflash2_draft_graph_with_and_without_the_walk_kernel(geo_pair2):
    """The captured DFlash2 draft with the kernel walk == with the torch walk (same logits and hidden; the path
    equal but at fp32 near ties), and its replay timed both ways (printed: the kernel's saving)."""
    from selector_walk_cases import check_greedy

    from specbench.engine.scheduler import Span
    from specbench.engine.spec import selector as sel
    from specbench.engine.spec.dflash2_graphs import DraftGraphs2

    eng, reqs = _ready(*geo_pair2)
    p = eng.proposer
    d = eng.draft_model
    graphs = {}
    for walk in (True, False):
        p.walk_kernel = walk
        graphs[walk] = DraftGraphs2(p, capture=True)
    near = 0
    for n in (1, 3, 8):
        spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in reqs[:n]]
        lk, hk, pk = (t.clone() for t in graphs[True].run2(spans))
        lt, ht, pt = (t.clone() for t in graphs[False].run2(spans))
        assert torch.equal(lk, lt) and torch.equal(hk, ht), f"n={n}: the walk changed the body"
        unary, ids = sel.candidates(lk, d.selector_top_k)
        anchor = torch.tensor([s.tokens[0] for s in spans], device="cuda")
        near += check_greedy(f"draft graph n={n}", (unary, ids, sel.project(hk, d.sel_proj), anchor, d.sel_pred,
                                                    d.sel_succ), pk, pt)
        ms = {}
        for walk, g in graphs.items():
            for _ in range(3):
                g.run2(spans)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(30):
                g.run2(spans)
            end.record()
            torch.cuda.synchronize()
            ms[walk] = start.elapsed_time(end) / 30
        print(f"dflash2 draft graph n={n} (geo pair, block 16): walk kernel {ms[True]:.3f} ms, torch walk "
              f"{ms[False]:.3f} ms ({ms[False] - ms[True]:+.3f} ms saved)")
    assert all(g.stack.captured for g in graphs.values())
    print(f"near-tie divergences: {near}")
    _free()


def test_flashinfer_topk_equals_torch_topk():
    import flashinfer

    if not hasattr(flashinfer, "top_k"):
        pytest.skip(f"flashinfer {flashinfer.__version__} has no top_k")
    x = torch.randn(15 * 4, 151936, device="cuda") * 3
    v, i = flashinfer.top_k(x, 16, sorted=True)
    tv, ti = torch.topk(x, 16, dim=-1, sorted=True)
    assert torch.equal(v, tv)
    assert torch.equal(x.gather(1, i.long()), tv)


def test_regret_gate_tiny_dflash2_all_fast_paths():
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.harness.fixtures import bundled_pair
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt, run_greedy

    target = str(bundled_pair()[0])
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="torch", num_pages=2048, max_num_seqs=16)
    base = LocalAdapter.from_dirs(target, spec="off", name="base", **kw)
    cand = LocalAdapter.from_dirs(target, draft=str(FIXTURE), spec="dflash", name="cand", **kw)
    try:
        eng = cand.engine
        assert eng.runner.use_graph_runner and eng.proposer.use_graphs
        prompts = [Prompt(f"p{i}", eng.tokenizer.encode(f"Question: what is {3 + i} times {7 + 2 * i}?\nAnswer:"))
                   for i in range(12)]
        budgets = [8 + 9 * (i % 6) for i in range(12)]
        run = asyncio.run(run_greedy(base, cand, prompts, max(budgets), GreedyGateOptions(), concurrency=12,
                                     max_tokens_each=budgets, baseline_concurrency=1))
        print(f"tiny-dflash2 bf16 regret gate: {run.verdict}; {run.stats.describe()}")
        assert run.ok, [p.to_dict() for p in run.prompts if not p.ok]
        assert run.stats.speculating, run.stats.describe()
        assert eng.proposer.graphs2 is not None and eng.proposer.graphs2.stack.captured
    finally:
        base.close()
        cand.close()
        _free()
