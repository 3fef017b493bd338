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


@pytest.mark.parametrize("dtype,tol", [("float32", (1e-4, 1e-4)), ("bfloat16", (2e-2, 2e-2))])
@pytest.mark.parametrize("gate", [0, 3])
def test_graph_context_equals_eager_projection_on_cuda(tiny, gsm8k_prompts, dtype, tol, gate):
    """The drafter's context written inside the captured decode / verify steps (graph_context, on by default)
    against the eager projection after the accept: after every step of two engines in lockstep, the same context
    lengths and K/V at every committed position (bf16: FlashInfer's whole-step decode graphs), the same tokens."""
    from graph_context_cases import BUDGETS as B  # noqa: PLC0415
    from graph_context_cases import lockstep  # noqa: PLC0415

    f, e, paths = lockstep(tiny, gsm8k_prompts[: len(B)], gate, device="cuda", dtype=dtype, tol=tol)
    print(dtype, gate, paths, [o.spec["num_accepted_tokens"] for o in f], [o.spec["num_accepted_tokens"] for o in e])
    assert "padded" in paths and (not gate or "decode-graph" in paths)
    assert [o.output_ids for o in f] == [o.output_ids for o in e]
    assert sum(o.spec["num_accepted_tokens"] for o in f) > 0
