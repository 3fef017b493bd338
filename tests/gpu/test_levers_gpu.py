"""Issue 20 on the device: the load-aware levers with every fast path on (captured decode, verify and draft
graphs), on the bundled tiny pair in fp32, where spec on must equal spec off token for token.

- each lever (gate 1 and 3, trim 2, the automatic policy) against spec off, staggered max_tokens so the
  batch shrinks, spans truncate and decode spans ride with verify spans;
- the automatic policy with its span cycled over every variant between steps: each variant replays its own
  captured row counts (VerifyGraphs.stack.shapes keyed by rows) and the output stays the spec-off output;
- the start-up cost model measured on the captured graphs: positive, monotone, the graphs it timed captured.
Run with `pytest -m gpu tests/gpu/test_levers_gpu.py -s` (scripts/gpu.sh tests).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specbench.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
BUDGETS = [3, 9, 16, 30, 48, 64]


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[: len(BUDGETS)]


@pytest.fixture(scope="module")
def baseline(tiny, prompts):
    llm = LLM(tiny[0], device="cuda", num_pages=512, max_num_seqs=8)
    out = [o.output_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=b, ignore_eos=True) for b in BUDGETS])]
    close = getattr(llm.engine, "close", None)
    if close is not None:
        close()
    return out


@pytest.mark.parametrize("kw", [{"spec_gate": 1}, {"spec_gate": 3}, {"spec_trim": 2}, {"spec_policy": "auto"}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_levers_with_captured_graphs_equal_spec_off(tiny, prompts, baseline, kw):
    llm = LLM(tiny[0], draft=tiny[1], device="cuda", num_pages=512, max_num_seqs=8, **kw)
    out = [o.output_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=b, ignore_eos=True)
                                                         for b in BUDGETS])]
    assert out == baseline
    eng = llm.engine
    stats = eng.fast_path_stats()
    print(kw, eng.metrics.span_hist, "gated", eng.metrics.gated_rounds, stats.get("verify"))
    if "spec_gate" in kw:
        assert eng.metrics.gated_rounds > 0 and eng.metrics.num_drafts > 0  # gated, then speculating again
    if "spec_trim" in kw:
        assert max(eng.metrics.span_hist) == 3


def test_span_variants_replay_their_own_rows(tiny, prompts, baseline):
    llm = LLM(tiny[0], draft=tiny[1], device="cuda", num_pages=512, max_num_seqs=8, spec_policy="auto")
    eng = llm.engine
    costs = eng.policy.costs
    assert costs is not None and costs.source == "measured"
    for s in costs.spans:
        vs = costs.verify_s[s]
        assert all(v > 0 for v in vs) and vs == sorted(vs)
    vg = eng.runner.verify_graphs
    assert vg is not None and vg.stack.captured, "the measurement captures the verify graphs it times"
    print("cost model", costs.describe())
    cycle = itertools.cycle([1, 8, 2, 4, 8, 1, 4])
    eng.policy._best = lambda b, remaining: (next(cycle) - 1, "policy", {})
    out = [o.output_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=b, ignore_eos=True)
                                                         for b in BUDGETS])]
    assert out == baseline
    assert set(eng.metrics.span_hist) == {1, 2, 4, 8}
    assert all(vg.stack.shapes[r] == r for r in vg.stack.shapes)  # every row count replayed only at itself



@pytest.mark.parametrize("case", ["tiny-fp32", "tiny-bf16", "4b-bf16"])
@pytest.mark.parametrize("gate", [0, 3])
def test_graph_context_equals_eager_projection_on_cuda(tiny, gsm8k_prompts, case, gate):
    """The drafter's context written inside the captured decode / verify steps (graph_context, on by default)
    against the eager projection after the accept: after every step of two engines in lockstep, the same context
    lengths and K/V at every committed position, the same tokens. tiny: the trained pair (acceptance; head_dim
    32, so bf16 runs the torch attention and piecewise decode graphs); 4b: the Qwen3-4B-shaped random pair in
    bf16 with FlashInfer (whole-step decode graphs, head_dim 128), random prompts."""
    from pathlib import Path  # noqa: PLC0415

    from graph_context_cases import BUDGETS as B  # noqa: PLC0415
    from graph_context_cases import lockstep  # noqa: PLC0415

    from specbench.benchmarks.spec_step import ensure_pair  # noqa: PLC0415

    if case == "4b-bf16":
        pair = ensure_pair(Path("/tmp/q3-4b-pair"), "cuda")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 100_000, (int(n),), generator=g).tolist() for n in (40, 75, 130, 22, 300, 61)]
        kw: dict = {"dtype": "bfloat16", "tol": (3e-2, 3e-2)}
    else:
        pair, prompts = tiny, gsm8k_prompts[: len(B)]
        kw = {"dtype": "float32", "tol": (1e-4, 1e-4)} if case == "tiny-fp32" else \
            {"dtype": "bfloat16", "tol": (3e-2, 3e-2), "attention_backend": "torch"}
    f, e, paths = lockstep(pair, prompts, gate, device="cuda", **kw)
    print(case, gate, paths, [o.spec["num_accepted_tokens"] for o in f], [o.spec["num_accepted_tokens"] for o in e])
    assert "padded" in paths and (not gate or "decode-graph" in paths)
    assert [o.output_ids for o in f] == [o.output_ids for o in e]
    if case.startswith("tiny"):
        assert sum(o.spec["num_accepted_tokens"] for o in f) > 0


def test_capture_graphs_covers_every_draft_bucket(tiny, prompts):
    """LLMEngine.capture_graphs() captures the drafter's graphs at every batch bucket and the decode graphs (before,
    the first draft at each new bucket and the first one-token step captured in the middle of serving: a stall
    under load), and serving then captures none."""
    llm = LLM(tiny[0], draft=tiny[1], device="cuda", num_pages=512, max_num_seqs=8)
    eng = llm.engine
    got = eng.capture_graphs()
    dg = eng.proposer.draft_graphs()
    want = sorted(b * eng.proposer.block for b in dg.buckets)
    assert sorted(got["draft_rows"]) == want and dg.stack.captured == want and got["verify_rows"]
    decode = eng.runner.graphs  # built (every bucket captured) by capture_graphs, not by the first one-token step
    assert decode is not None and got["decode_buckets"] == decode.buckets and decode.mode != "eager"
    llm.generate(prompts, [SamplingParams(max_tokens=b, ignore_eos=True) for b in BUDGETS])
    assert dg.stack.captured == want and eng.runner.graphs is decode
    assert eng.capture_graphs() == {"verify_rows": [], "draft_rows": [], "decode_buckets": []}
