"""The drafter's context rows written inside the target's captured step (EngineConfig.graph_context, issue 20)
against the eager projection after the accept (the simple path), on CPU with the tiny pair through the padded
decode / verify bodies the CUDA graphs capture (run eagerly here): engines stepped in lockstep, with gated
rounds, verify spans, prefill chunks and requests finishing, must hold the same drafter context (length and the
K/V of every committed position), accept the same drafts and emit the same tokens; a writer that stores one
layer wrong is caught by the same comparison; faults and the switch turn the fused path off."""

from __future__ import annotations

import pytest
from graph_context_cases import BUDGETS, lockstep, make_llm

from specbench.engine import LLM, SamplingParams
from specbench.harness.engines import parse_engine


@pytest.mark.parametrize("gate", [0, 3])
def test_graph_context_equals_eager_projection(tiny_pair, gsm8k_prompts, gate):
    f, e, paths = lockstep(tiny_pair, gsm8k_prompts[: len(BUDGETS)], gate)
    # verify / prefill steps through the padded runner; with the gate, one-token rounds through the decode graphs
    assert paths == ({"decode-graph", "padded"} if gate else {"padded"}), paths
    assert [o.output_ids for o in f] == [o.output_ids for o in e]
    assert [o.spec["accepted_runs"] for o in f] == [o.spec["accepted_runs"] for o in e]
    assert sum(o.spec["num_accepted_tokens"] for o in f) > 0  # the drafter was used and accepted


def test_a_wrong_fused_write_is_caught(tiny_pair, gsm8k_prompts):
    def broken(eng):
        ok = eng.proposer.write_context

        def write(taps, pos, slots):
            ok(taps, pos, slots)
            kc, _ = eng.runner.draft_kv[-1]
            kc[slots] = kc[slots] * 0.5  # the last layer's K stored wrong
        return write

    with pytest.raises(AssertionError):
        lockstep(tiny_pair, gsm8k_prompts[: len(BUDGETS)], 0, writer=broken)


def test_graph_context_off_with_faults_and_switch(tiny_pair, monkeypatch):
    assert make_llm(tiny_pair, True, faults=("draft_ctx_misaligned",)).engine.runner.context_writer is None
    assert make_llm(tiny_pair, False).engine.describe()["graph_context"] is False
    monkeypatch.setenv("SPECBENCH_GRAPH_CONTEXT", "0")
    assert LLM(tiny_pair[0], draft=tiny_pair[1], num_pages=64).engine.runner.context_writer is None
    spec = parse_engine(f"local:{tiny_pair[0]},draft={tiny_pair[1]},graph_context=0")
    assert spec.opt_bool("graph_context", True) is False


def test_capture_graphs_is_a_no_op_off_cuda(tiny_pair):
    eng = make_llm(tiny_pair, True).engine
    assert eng.capture_graphs() == {"verify_rows": [], "draft_rows": [], "decode_buckets": []}


def test_draft_lm_head_gets_one_contiguous_matrix(tiny_pair, gsm8k_prompts, monkeypatch):
    """The draft's vocabulary projection sees a contiguous [blocks, B - 1, H] input on the graph path and the plain
    path: on the strided slice of slots 1..B-1, F.linear runs one GEMM per block (a batched GEMM reading the whole
    lm_head once per request; 11.7 ms of a 44 ms step at 64 requests on the H200)."""
    for graphs in (True, False):
        llm = make_llm(tiny_pair, True)
        eng = llm.engine
        eng.proposer.use_graphs = graphs
        seen: list[bool] = []
        real = eng.proposer.target.logits

        def spy(h, real=real, seen=seen):
            seen.append(h.is_contiguous())
            return real(h)

        monkeypatch.setattr(eng.proposer.target, "logits", spy)
        eng.proposer.draft.__dict__.pop("_lm", None)
        llm.generate(gsm8k_prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))
        assert seen and all(seen), (graphs, seen)
