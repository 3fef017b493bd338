"""Shared by tests/test_graph_context.py (CPU) and tests/gpu/test_levers_gpu.py: two engines, the drafter's context
written inside the target's step (EngineConfig.graph_context) and projected eagerly after the accept, stepped in
lockstep over the same requests with the drafter's context compared after every step."""

from __future__ import annotations

import torch

from specbench.engine import LLM, SamplingParams

BUDGETS = [3, 9, 14, 20, 26, 31]


def make_llm(pair, graph_context: bool, device: str = "cpu", dtype: str = "float32", **kw) -> LLM:
    llm = LLM(pair[0], draft=pair[1], num_pages=256, max_num_seqs=8, graph_context=graph_context, device=device,
              dtype=dtype, **kw)
    if device == "cpu":
        llm.engine.runner.use_graph_runner = True  # the padded decode / verify bodies, run eagerly
        llm.engine.proposer.use_graphs = True
    return llm


def context_rows(eng, rid: str) -> tuple[int, list[torch.Tensor]]:
    """(context length, each drafter layer's K and V at the request's committed positions)."""
    n = eng.proposer.ctx_len.get(rid, 0)
    slots = torch.tensor(eng.pool.slots(rid, 0, n), dtype=torch.long, device=eng.runner.device)
    return n, [c[slots].float() for kv in eng.runner.draft_kv for c in kv]


def lockstep(pair, prompts, gate: int, writer=None, device: str = "cpu", dtype: str = "float32",
             tol: tuple[float, float] = (1e-4, 1e-5), **kw) -> tuple[list, list, set[str]]:
    """Step a fused and an eager engine side by side; returns (fused outputs, eager outputs, the forward paths
    that ran fused) and asserts, after every step, equal context lengths and K/V within `tol` (rtol, atol).
    gate 3 with six requests: one-token rounds until three have finished, then verify spans."""
    fused = make_llm(pair, True, device, dtype, spec_gate=gate, **kw)
    eager = make_llm(pair, False, device, dtype, spec_gate=gate, **kw)
    fe, ee = fused.engine, eager.engine
    assert fe.runner.context_writer is not None and ee.runner.context_writer is None
    if writer is not None:
        fe.runner.context_writer = writer(fe)
    params = [SamplingParams(max_tokens=b, ignore_eos=True) for b in BUDGETS]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=False)):
        fe.add_request(p, sp, rid=f"r{i}")
        ee.add_request(p, sp, rid=f"r{i}")
    outs: dict[str, dict] = {"fused": {}, "eager": {}}
    fused_paths: set[str] = set()
    while fe.has_unfinished() or ee.has_unfinished():
        for name, eng in (("fused", fe), ("eager", ee)):
            for o in eng.step():
                outs[name][o.rid] = o
        if fe.runner.context_fused:
            fused_paths.add(fe.runner.last_path[0])
        assert not ee.runner.context_fused
        for r in fe.scheduler.running:
            n_f, kv_f = context_rows(fe, r.rid)
            n_e, kv_e = context_rows(ee, r.rid)
            assert n_f == n_e, (r.rid, n_f, n_e)
            for a, b in zip(kv_f, kv_e, strict=True):
                torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
    rids = sorted(outs["eager"])
    for llm in (fused, eager):
        llm.close()
    return [outs["fused"][r] for r in rids], [outs["eager"][r] for r in rids], fused_paths
