"""Greedy drafts kept on the device until the accept (engine/spec/pending.py, EngineConfig.defer_drafts) against
its off switch, token for token, on the tiny DFlash pair (fp32, CPU).

Every step() call's outputs must agree with defer on and off: greedy requests (the deferred path), a sampled one
beside them (that step's drafts come back to the host as before), a stop string and max_tokens inside a verify
span; through the padded verify runner (its rows filled in from the device tensor: `deferred_rows` counts them)
and through the plain forward (the drafts resolved before it). The invariants run after every step
(tests/conftest.py).
"""

from __future__ import annotations

import pytest

from specbench.engine import LLM, SamplingParams


def _llm(tiny_target, tiny_draft, defer: bool, padded: bool, **kw) -> LLM:
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256, defer_drafts=defer, **kw)
    llm.engine.runner.use_graph_runner = padded  # the padded verify body (eager on CPU), or the plain forward
    return llm


def _run(llm: LLM, reqs: list[tuple[str, SamplingParams]]) -> list[list]:
    eng = llm.engine
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(p, sp, rid=f"r{i}")
    calls: list[list] = []
    while eng.has_unfinished():
        calls.append(sorted((o.rid, tuple(o.new_ids), o.text, o.finished, o.finish_reason) for o in eng.step()))
        assert len(calls) < 500
    return calls


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("sampled", [False, True])
def test_defer_equals_its_off_switch(tiny_target, tiny_draft, gsm8k_prompts, padded, sampled):
    reqs = [(gsm8k_prompts[0], SamplingParams(max_tokens=40, ignore_eos=True)),
            (gsm8k_prompts[1], SamplingParams(max_tokens=23, ignore_eos=True)),
            (gsm8k_prompts[2], SamplingParams(max_tokens=31, stop=(" the",), ignore_eos=True))]
    if sampled:
        reqs.append((gsm8k_prompts[3], SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)))
    on = _llm(tiny_target, tiny_draft, True, padded)
    off = _llm(tiny_target, tiny_draft, False, padded)
    assert on.engine.defer_drafts and not off.engine.defer_drafts
    got_on, got_off = _run(on, reqs), _run(off, reqs)
    assert got_on == got_off
    vg = on.engine.runner.verify_graphs
    if padded:
        assert vg is not None and vg.stats["deferred_rows"] > 0, "the verify runner never filled a deferred row"
    else:
        assert vg is None or vg.stats["deferred_rows"] == 0


def test_defer_is_off_with_a_fault_armed(tiny_target, tiny_draft):
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256, faults=("wrong_bonus",))
    assert llm.engine.cfg.defer_drafts and not llm.engine.defer_drafts


def test_the_env_and_engine_string_switches(tiny_target, monkeypatch):
    from specbench.engine import EngineConfig
    from specbench.harness.engines import parse_engine

    monkeypatch.setenv("SPECBENCH_DEFER_DRAFTS", "0")
    assert EngineConfig(model="m").defer_drafts is False
    monkeypatch.delenv("SPECBENCH_DEFER_DRAFTS")
    assert EngineConfig(model="m").defer_drafts is True
    assert parse_engine("local,defer_drafts=0").options["defer_drafts"] == "0"
