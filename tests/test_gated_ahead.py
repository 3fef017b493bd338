"""Gated rounds one step ahead (engine/ahead.py, EngineConfig.gated_ahead; issue 20) against the off switch,
on the tiny pair (fp32, CPU). As in tests/test_decode_ahead.py the padded bodies the CUDA graphs capture run
eagerly on CPU (`use_graph_runner = True`), so the chained path, the drafter's context written inside the
decode step included, runs as on CUDA with the copies synchronous; the invariants (tests/conftest.py) check
after every step that each draft-ready request's drafter context equals its committed length.

What must hold: every step() call's outputs equal the off switch's, the policy's trace (span, reason and
per-request state of every step) equals it, gated requests later speculate and get drafts accepted with no
fresh prefill (the context advanced by the chained rounds), and the chain really ran.
"""

from __future__ import annotations

import json

import pytest
from policy_clock import tick_policy

from specbench.engine import LLM, SamplingParams
from specbench.engine.spec.policy import DraftState

BUDGETS = [6, 11, 17, 24, 30]  # staggered max_tokens: the batch shrinks (known ahead: no stop) below the gate


def _llm(pair, on: bool, **kw) -> LLM:
    llm = LLM(pair[0], draft=pair[1], num_pages=256, max_num_seqs=8, gated_ahead=on, **kw)
    llm.engine.runner.use_graph_runner = True  # the decode graphs' padded body (eager on CPU), context writer inside
    tick_policy(llm)  # the automatic policy's measured times: the same on every machine, so on and off decide alike
    return llm


def _key(o) -> tuple:
    return (o.rid, tuple(o.new_ids), tuple(o.output_ids), o.finished, o.finish_reason)


def _run(llm: LLM, reqs: list[tuple[str, SamplingParams]]) -> tuple[list[list], dict[str, int]]:
    """Every step() call's outputs until idle, and the prefill steps each request took."""
    eng = llm.engine
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(p, sp, rid=f"g{i}")
    calls: list[list] = []
    prefills: dict[str, int] = {}
    while eng.has_unfinished():
        for r in eng.scheduler.running:
            if r.in_prefill:
                prefills[r.rid] = prefills.get(r.rid, 0) + 1
        calls.append(sorted(_key(o) for o in eng.step()))
        assert len(calls) < 500
    return calls, prefills


def _trace(llm: LLM) -> list[tuple]:
    return [(e["span"], e["reason"], e["running"], e["ready"],
             tuple(sorted((rid, x["state"], x["drafts"], x["accepted"]) for rid, x in e["requests"].items())))
            for e in llm.engine.policy.trace]


def _reqs(prompts, sampled: bool = False) -> list[tuple[str, SamplingParams]]:
    out = []
    for i, b in enumerate(BUDGETS):
        if sampled and i % 2:
            sp = SamplingParams(max_tokens=b, temperature=0.8, top_k=20, seed=11 + i, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=b, ignore_eos=True)
        out.append((prompts[i % len(prompts)], sp))
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "mixed-sampled"])
def test_gated_chain_equals_the_off_switch(tiny_pair, gsm8k_prompts, sampled) -> None:
    """gate 2 over a batch of 5 that shrinks: gated rounds chained ahead, then speculation as it shrinks."""
    reqs = _reqs(gsm8k_prompts, sampled)
    on, off = _llm(tiny_pair, True, spec_gate=2), _llm(tiny_pair, False, spec_gate=2)
    got, pre_on = _run(on, reqs)
    want, pre_off = _run(off, reqs)
    assert got == want
    assert _trace(on) == _trace(off)
    m_on, m_off = on.engine.metrics, off.engine.metrics
    assert m_on.decode_ahead_steps >= 10, "the gated rounds were chained (not the simple path)"
    assert m_off.decode_ahead_steps == 0
    assert m_on.gated_rounds == m_off.gated_rounds > 0
    assert (m_on.num_accepted_tokens, m_on.num_draft_tokens) == (m_off.num_accepted_tokens, m_off.num_draft_tokens)
    assert m_on.num_accepted_tokens > 0
    assert on.engine.describe()["gated_ahead"] and not off.engine.describe()["gated_ahead"]
    assert all(n == 1 for n in pre_on.values()) and pre_on == pre_off
    assert on.engine.pool.num_free == off.engine.pool.num_free


def test_a_request_gated_in_a_chain_resumes_speculating(tiny_pair, gsm8k_prompts) -> None:
    """Per request id: gated in chained rounds, later speculating with an accepted draft, never NOT_READY
    after its prefill (the chained steps advanced its drafter context)."""
    on = _llm(tiny_pair, True, spec_gate=2)
    _run(on, _reqs(gsm8k_prompts))
    trace = on.engine.policy.trace
    resumed = []
    for i in range(len(BUDGETS)):
        rid = f"g{i}"
        seen = [e["requests"][rid] for e in trace if rid in e["requests"]]
        gated = [j for j, x in enumerate(seen) if x["state"] == DraftState.GATED.value]
        if gated and any(x["state"] == DraftState.SPEC.value and (x["accepted"] or 0) >= 1 for x in seen[gated[0]:]):
            resumed.append(rid)
        assert all(x["state"] != DraftState.NOT_READY.value for x in seen[1:]), rid
    assert resumed, "no request was gated and then speculated with an accepted draft"


def test_a_stop_shrinking_the_batch_changes_no_token(tiny_pair, gsm8k_prompts) -> None:
    """A stop token ends a request inside a chain (not known ahead): the chained step's gate may count it
    once more (one more gated round), never a different token."""
    base = LLM(tiny_pair[0], num_pages=256).generate(gsm8k_prompts[:3], SamplingParams(max_tokens=20, ignore_eos=True))
    reqs = [(gsm8k_prompts[i], SamplingParams(max_tokens=20, ignore_eos=True,
                                              stop_token_ids=(base[i].output_ids[4 + 3 * i],))) for i in range(3)]
    reqs += [(gsm8k_prompts[3], SamplingParams(max_tokens=26, ignore_eos=True))]
    on, off = _llm(tiny_pair, True, spec_gate=1), _llm(tiny_pair, False, spec_gate=1)
    final = []
    for llm in (on, off):
        calls, _ = _run(llm, reqs)
        final.append(sorted((k[0], k[2], k[4]) for call in calls for k in call if k[3]))
    assert final[0] == final[1]
    assert any(reason == "stop" for _, _, reason in final[0])
    assert on.engine.metrics.decode_ahead_steps > 0


def test_the_policy_choice_a_chain_ends_on_is_used_once(tiny_pair, gsm8k_prompts, tmp_path, monkeypatch) -> None:
    """The automatic policy: every decision the chain makes ahead is recorded exactly once, and a decision to
    speculate that ends a chain is the one the next step runs (no second decision: the exploration cadence
    of the off switch is kept)."""
    batches, spans = [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]
    # verify cost grows so fast with the span that span 1 (gated) is the policy's pick whatever the measured host
    # overhead (which the chain's decision sees one step older than the off switch's); only explorations draft
    model = {"batches": batches, "verify_ms": {str(s): [1.0 + 100.0 * b * (s - 1) for b in batches] for s in spans},
             "draft_ms": [0.5 for _ in batches]}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(model))
    monkeypatch.setenv("SPECBENCH_SPEC_COSTS", str(path))
    monkeypatch.setenv("SPECBENCH_SPEC_ONLINE", "0")
    monkeypatch.setattr("specbench.engine.spec.policy.EXPLORE", 5)  # explore often: chains end on explorations
    monkeypatch.setattr("specbench.engine.spec.policy.EXPLORE_SHARE", 1e9)  # whatever the exploration costs
    reqs = _reqs(gsm8k_prompts)
    on, off = _llm(tiny_pair, True, spec_policy="auto"), _llm(tiny_pair, False, spec_policy="auto")
    got, _ = _run(on, reqs)
    want, _ = _run(off, reqs)
    assert got == want
    t_on, t_off = _trace(on), _trace(off)
    assert t_on == t_off
    assert on.engine.policy._decisions == off.engine.policy._decisions
    assert any(r == "explore" and s > 1 for s, r, *_ in t_on), "an exploration speculated"
    assert any(s == 1 for s, *_ in t_on) and on.engine.metrics.decode_ahead_steps > 0


def test_off_switches(tiny_pair, monkeypatch) -> None:
    assert _llm(tiny_pair, True).engine.ahead.usable()
    assert not _llm(tiny_pair, False).engine.ahead.usable()
    assert not _llm(tiny_pair, True, decode_ahead=False).engine.ahead.usable()
    assert not _llm(tiny_pair, True, graph_context=False).engine.ahead.usable(), "taps need the in-step writer"
    monkeypatch.setenv("SPECBENCH_GATED_AHEAD", "0")
    llm = LLM(tiny_pair[0], draft=tiny_pair[1], num_pages=64)
    llm.engine.runner.use_graph_runner = True
    assert not llm.engine.ahead.usable()


# ---- the gates through the chained path (graph_runner=1: the graph runners' bodies on CPU) ----------------
@pytest.mark.parametrize("lever", ["gate=1", "gate=2", "policy=auto"])
def test_lossless_gates_pass_through_the_chain(tiny_pair, lever, tmp_path, monkeypatch) -> None:
    """`specbench lossless --concurrent` with the candidate on the graph runners (graph_runner=1): its gated
    rounds chain ahead (the run record's engine config says so) and the greedy and concurrent gates pass."""
    from typer.testing import CliRunner

    from specbench.cli import app as cli

    cli._register()
    batches, spans = [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]
    model = {"batches": batches, "verify_ms": {str(s): [1.0 + 0.4 * b * (s - 1) for b in batches] for s in spans},
             "draft_ms": [0.05 for _ in batches]}  # the policy drafts alone and gates batches
    (tmp_path / "costs.json").write_text(json.dumps(model))
    monkeypatch.setenv("SPECBENCH_SPEC_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setenv("SPECBENCH_SPEC_ONLINE", "0")
    t, d = tiny_pair
    res = CliRunner().invoke(cli.app, ["lossless", "--margin-tol", "0.20", "--baseline", f"local:{t},spec=off",
                                       "--candidate", f"local:{t},draft={d},spec=dflash,{lever},graph_runner=1",
                                       "--num-prompts", "4", "--max-tokens", "24", "--concurrent", "--no-record",
                                       "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    g = out["summary"]["gates"]
    assert out["verdict"] == "PASS" and g["greedy"] == g["concurrent"] == "PASS"
    # the engine gates (on by default) ran with the lever too, none failed; a batch the lever never lets speculate
    # leaves the mixed gate without evidence, which it says (not deciding the verdict)
    assert set(g) >= {"mixed", "stop-in-run", "eos-in-run", "abort-in-flight", "penalties", "headroom"}
    assert all(m.startswith("mixed: speculation in the mixed batch") for m in out["summary"]["not_tested"])
    assert out["engines"]["candidate"]["config"]["gated_ahead"] is True


def test_sampled_gate_passes_through_the_chain(tiny_pair) -> None:
    """48 samples in flight at gate 1 on the graph runners: every round of the batch gated and chained, seeded
    sampling drawn on the device; the distributions match the spec-off engine's cell for cell."""
    from typer.testing import CliRunner

    from specbench.cli import app as cli

    cli._register()
    t, d = tiny_pair
    res = CliRunner().invoke(cli.app, ["sampled", "--baseline", f"local:{t},spec=off",
                                       "--candidate", f"local:{t},draft={d},spec=dflash,gate=1,graph_runner=1",
                                       "--num-prompts", "1", "--positions", "4", "--samples", "48", "--configs",
                                       "t=0.5", "--permutations", "99", "--concurrency", "48", "--no-record", "--json"])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert not any(c["rejected"] for c in out["comparisons"].values()), out
    assert out["verdict"] in ("PASS", "NOT SPECULATING", "NO DRAFT ACCEPTED"), out["verdict"]


def test_graph_runner_switch_is_validated(monkeypatch) -> None:
    from specbench.engine.config import ConfigError, EngineConfig
    from specbench.harness.engines import EngineStringError, parse_engine

    with pytest.raises(ConfigError, match="graph_runner"):
        EngineConfig(model="x", graph_runner="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("SPECBENCH_GRAPH_RUNNER", "sometimes")
    with pytest.raises(ConfigError, match="SPECBENCH_GRAPH_RUNNER"):
        EngineConfig(model="x")
    monkeypatch.setenv("SPECBENCH_GRAPH_RUNNER", "1")
    assert EngineConfig(model="x").graph_runner is True
    with pytest.raises(EngineStringError, match="graph_runner"):
        parse_engine("local,graph_runner=maybe")
