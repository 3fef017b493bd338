"""Review probes of gated rounds one step ahead (engine/ahead.py, EngineConfig.gated_ahead) against the off
switch, on the tiny pair (fp32, CPU, the decode graphs' padded body run eagerly; invariants on, conftest.py).

What they pin down:
- a decision the chain stashed for the next step (the policy speculates there) is not run when the batch it was
  made for changed before that step (an abort, a stop in the older step's commit): the step decides afresh, so
  the trace and the span metrics equal the off switch's, and the decision count (exploration cadence) too;
- a step left in flight whose every row's request finished at the older step's commit (a stop) or was aborted
  is not a step the off switch runs: it records no policy choice (no trace entry, no span metrics, no measured
  step time spanning the engine's idle time until the next request), and the next step() schedules normally;
- the measured step times of chained steps do not overlap (a chained step's decision is made before the step in
  flight is committed; timing it from there counted the older step's wait and commit twice);
- the prefix cache: blocks sealed during a gated chain carry a drafter capture that drafts as well as a cold
  engine's context, and the n-gram proposer and the DFlash2 drafter chain losslessly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from policy_clock import tick_policy

from specbench.engine import LLM, SamplingParams

BUDGETS = [6, 11, 17, 24, 30]
DFLASH2 = str(Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft")


def _llm(pair, on: bool, draft: str | None = "pair", **kw) -> LLM:
    llm = LLM(pair[0], draft=pair[1] if draft == "pair" else draft, num_pages=256, max_num_seqs=8, gated_ahead=on,
              **kw)
    llm.engine.runner.use_graph_runner = True  # the decode graphs' padded body (eager on CPU), context writer inside
    tick_policy(llm)  # the automatic policy's measured times: the same on every machine, so on and off decide alike
    return llm


def _key(o) -> tuple:
    return (o.rid, tuple(o.new_ids), tuple(o.output_ids), o.finished, o.finish_reason)


def _trace(llm: LLM) -> list[tuple]:
    return [(e["step"], e["span"], e["reason"], e["running"], e["ready"],
             tuple(sorted((rid, x["state"], x["drafts"], x["accepted"]) for rid, x in e["requests"].items())))
            for e in llm.engine.policy.trace]


def _run(llm: LLM, reqs, events=None, prefix: str = "g") -> list[list]:
    """Every step() call's outputs until idle; events[call](engine) runs before that call."""
    eng = llm.engine
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(p, sp, rid=f"{prefix}{i}")
    calls: list[list] = []
    while eng.has_unfinished() or (events and max(events) >= len(calls)):
        if events and len(calls) in events:
            events[len(calls)](eng)
        calls.append(sorted(_key(o) for o in eng.step()))
        assert len(calls) < 500
    return calls


def _reqs(prompts, budgets=BUDGETS) -> list[tuple[str, SamplingParams]]:
    return [(prompts[i % len(prompts)], SamplingParams(max_tokens=b, ignore_eos=True)) for i, b in enumerate(budgets)]


def _metrics(llm: LLM) -> tuple:
    m = llm.engine.metrics
    return m.gated_rounds, dict(m.span_hist), m.num_draft_tokens, m.num_accepted_tokens


def _stash_call(pair, prompts, **kw) -> int:
    """The first step() call entered with a stashed decision (gate 2 over the shrinking batch)."""
    llm = _llm(pair, True, **kw)
    eng = llm.engine
    for i, (p, sp) in enumerate(_reqs(prompts)):
        eng.add_request(p, sp, rid=f"g{i}")
    for call in range(200):
        if eng.ahead.stashed is not None:
            return call
        eng.step()
    raise AssertionError("no chain ended on a decision to speculate")


# ---- a stashed decision whose batch changed -------------------------------------------------------------
@pytest.mark.parametrize("what", ["abort-one", "abort-all-then-new"])
def test_a_stashed_decision_is_not_run_for_a_changed_batch(tiny_pair, gsm8k_prompts, what) -> None:
    at = _stash_call(tiny_pair, gsm8k_prompts, spec_gate=2)

    def event(eng) -> None:
        if what == "abort-one":
            assert eng.abort("g4")
            return
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.add_request(gsm8k_prompts[7], SamplingParams(max_tokens=8, ignore_eos=True), rid="late")

    on, off = _llm(tiny_pair, True, spec_gate=2), _llm(tiny_pair, False, spec_gate=2)
    got = _run(on, _reqs(gsm8k_prompts), {at: event})
    want = _run(off, _reqs(gsm8k_prompts), {at: event})
    assert got == want
    assert on.engine.ahead.stashed is None
    assert _trace(on) == _trace(off)  # was: the stashed choice listed the aborted request(s), running 2 for 1 / 0
    assert _metrics(on) == _metrics(off)  # was: span 8 counted for the late request's prefill step
    assert on.engine.metrics.decode_ahead_steps > 0


def test_a_stashed_decision_after_an_abort_keeps_the_exploration_cadence(tiny_pair, gsm8k_prompts, tmp_path,
                                                                         monkeypatch) -> None:
    """Automatic policy: a stashed decision dropped for a changed batch is not counted; the fresh one is."""
    batches, spans = [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]
    model = {"batches": batches, "verify_ms": {str(s): [1.0 + 100.0 * b * (s - 1) for b in batches] for s in spans},
             "draft_ms": [0.5 for _ in batches]}
    (tmp_path / "costs.json").write_text(json.dumps(model))
    monkeypatch.setenv("SPECBENCH_SPEC_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setenv("SPECBENCH_SPEC_ONLINE", "0")
    monkeypatch.setattr("specbench.engine.spec.policy.EXPLORE", 5)
    monkeypatch.setattr("specbench.engine.spec.policy.EXPLORE_SHARE", 1e9)  # whatever the exploration costs
    at = _stash_call(tiny_pair, gsm8k_prompts, spec_policy="auto")
    ev = {at: lambda eng: eng.abort("g4")}
    on, off = _llm(tiny_pair, True, spec_policy="auto"), _llm(tiny_pair, False, spec_policy="auto")
    got = _run(on, _reqs(gsm8k_prompts), ev)
    want = _run(off, _reqs(gsm8k_prompts), ev)
    assert got == want
    assert _trace(on) == _trace(off)
    assert on.engine.policy._decisions == off.engine.policy._decisions
    assert _metrics(on) == _metrics(off)


# ---- a step in flight whose every row is dead ---------------------------------------------------------------
def _auto_span1(tmp_path, monkeypatch) -> None:
    """A cost model under which the automatic policy holds span 1 (a lone request's rounds chain), no exploring."""
    batches, spans = [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]
    model = {"batches": batches, "verify_ms": {str(s): [1.0 + 100.0 * b * (s - 1) for b in batches] for s in spans},
             "draft_ms": [0.5 for _ in batches]}
    (tmp_path / "costs.json").write_text(json.dumps(model))
    monkeypatch.setenv("SPECBENCH_SPEC_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setattr("specbench.engine.spec.policy.EXPLORE", 10_000)
    monkeypatch.setattr("specbench.engine.spec.policy.EVIDENCE", 0)  # gate from the first step


def test_a_stop_ending_the_last_request_leaves_no_step_to_record(tiny_pair, gsm8k_prompts, tmp_path,
                                                                 monkeypatch) -> None:
    """The last request ends on a stop inside a chain: the step launched after it (its row dropped) stays on the
    device while the engine idles. It must not count as a step of the policy: no trace entry, no span count, and
    no measured step time covering the idle gap until the next request (that made span 1 look ~seconds slow)."""
    _auto_span1(tmp_path, monkeypatch)
    base = LLM(tiny_pair[0], num_pages=256).generate([gsm8k_prompts[0]], SamplingParams(max_tokens=20,
                                                                                           ignore_eos=True))
    stop = base[0].output_ids[7]
    first = [(gsm8k_prompts[0], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))]
    second = [(gsm8k_prompts[1], SamplingParams(max_tokens=10, ignore_eos=True))]
    res = {}
    for on in (True, False):
        llm = _llm(tiny_pair, on, spec_policy="auto")
        calls = _run(llm, first, prefix="a")
        assert any(k[4] == "stop" for c in calls for k in c)
        llm.engine.policy.clock.idle(1.0)  # the engine idles 1 s by its policy's clock (a server between requests)
        calls += _run(llm, second, prefix="b")
        res[on] = (calls, _trace(llm), _metrics(llm), llm.engine.policy.walls, llm.engine.policy.overhead)
    assert res[True][0] == res[False][0]
    assert res[True][1] == res[False][1]
    assert res[True][2] == res[False][2]
    walls_on = max(w[0] for w in res[True][3].values())
    assert walls_on < 0.75, f"a measured step time covers the idle gap: {res[True][3]}"
    assert res[True][4] < 0.75, f"the host overhead covers the idle gap: {res[True][4]}"


def test_an_abort_of_every_request_in_flight_leaves_no_step_to_record(tiny_pair, gsm8k_prompts) -> None:
    """Every request aborted while a gated step is in flight, then a new one: the dead step records nothing and
    the new request is scheduled by the very next step() call, as with the off switch."""
    reqs = _reqs(gsm8k_prompts)[:3]
    probe = _llm(tiny_pair, True, spec_gate=1)
    eng = probe.engine
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(p, sp, rid=f"g{i}")
    at = 0
    while eng.ahead.inflight is None:
        eng.step()
        at += 1

    def event(eng) -> None:
        for rid in list(eng.requests):
            assert eng.abort(rid)
        assert not eng.has_unfinished()
        eng.add_request(gsm8k_prompts[5], SamplingParams(max_tokens=6, ignore_eos=True), rid="late")

    on, off = _llm(tiny_pair, True, spec_gate=1), _llm(tiny_pair, False, spec_gate=1)
    got = _run(on, reqs, {at: event})
    want = _run(off, reqs, {at: event})
    assert got == want  # was: one more call (the dead step's commit) before the late request's first token
    assert _trace(on) == _trace(off)  # was: a gated round of the three aborted requests
    assert _metrics(on) == _metrics(off)
    assert on.engine.pool.num_free == on.engine.pool.num_pages


# ---- the measured step times of a chain ----------------------------------------------------------------------
def test_chained_steps_measured_times_do_not_overlap(tiny_pair, gsm8k_prompts, tmp_path, monkeypatch) -> None:
    """Each measured step time (SpanPolicy.step_done: from its t0 to the end it stamps after its commit) covers a
    stretch of wall time no other step's covers, and a busy engine leaves no stretch uncovered: each step's time
    starts exactly where the previous one ended. A chained step's decision is made before the step in flight is
    committed; timed from there it also counted that step's wait and commit (a gated round measured ~twice as
    slow as it is, biasing the online policy toward speculation)."""
    _auto_span1(tmp_path, monkeypatch)
    llm = _llm(tiny_pair, True, spec_policy="auto")
    pol = llm.engine.policy
    spans: list[tuple[float, float]] = []
    done = pol.step_done

    def spy(busy: bool = True) -> float:
        c = pol._timed
        end = done(busy)
        if c is not None:
            spans.append((c.t0, end))
        return end

    monkeypatch.setattr(pol, "step_done", spy)
    _run(llm, _reqs(gsm8k_prompts, [12, 12, 12]))
    assert llm.engine.metrics.decode_ahead_steps >= 5 and len(spans) >= 8
    for (_, end), (t0, _) in zip(spans, spans[1:], strict=False):
        assert t0 >= end, "a step's measured time starts before the previous step's ended"
    assert sum(t0 == end for (_, end), (t0, _) in zip(spans, spans[1:], strict=False)) >= len(spans) - 3, \
        "busy steps left stretches of the run uncounted"


# ---- prefix cache, n-gram, DFlash2 ---------------------------------------------------------------------------
def test_blocks_sealed_in_a_gated_chain_draft_like_a_cold_context(tiny_pair, gsm8k_prompts) -> None:
    """Five requests gated (gate 1) and chained, sealing blocks whose drafter rows the chained steps wrote; then,
    one at a time (speculating), requests whose prompts extend those outputs hit the blocks: their drafts and
    acceptance equal a cold engine's (no prefix cache) and the off switch's, every hit a capture hit."""
    reqs = _reqs(gsm8k_prompts, [14, 15, 16, 17, 18])
    got, captures = {}, {}
    for on in (True, False):
        llm = _llm(tiny_pair, on, spec_gate=1)
        eng = llm.engine
        first = _run(llm, reqs)
        outs = {k[0]: list(k[2]) for c in first for k in c if k[3]}
        captures[on] = _captures(eng)
        tok = eng.tokenizer
        follow = [(tok.encode(reqs[i][0]) + outs[f"g{i}"] + outs[f"g{(i + 1) % 5}"][:3],
                   SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(5)]
        m0 = (eng.metrics.num_draft_tokens, eng.metrics.num_accepted_tokens)
        calls = []
        for i, (p, sp) in enumerate(follow):
            calls += _run(llm, [(p, sp)], prefix=f"h{i}-")
        drafted = (eng.metrics.num_draft_tokens - m0[0], eng.metrics.num_accepted_tokens - m0[1])
        got[on] = (first, calls, drafted, eng.metrics.capture_hits, eng.metrics.capture_fallbacks,
                   eng.metrics.decode_ahead_steps)
    # the drafter's rows in every captured cached block (the chained steps wrote most of the output positions')
    assert captures[True].keys() == captures[False].keys() and len(captures[True]) >= 10
    for key, rows in captures[True].items():
        torch.testing.assert_close(rows, captures[False][key], msg="the drafter context of a sealed block differs")
    assert got[True][:5] == got[False][:5]
    assert got[True][5] >= 10 and got[False][5] == 0
    assert got[True][3] == 5 and got[True][4] == 0
    cold = LLM(tiny_pair[0], draft=tiny_pair[1], num_pages=256, prefix_cache=False).engine
    for i, (p, sp) in enumerate(follow):
        cold.add_request(p, sp, rid=f"c{i}")
        while cold.has_unfinished():
            cold.step()
    assert got[True][2] == (cold.metrics.num_draft_tokens, cold.metrics.num_accepted_tokens)
    assert got[True][2][1] > 0


def _captures(eng) -> dict[bytes, torch.Tensor]:
    """The drafter's context K/V rows of every cached block that keeps its capture, by block key."""
    prefix, ps = eng.pool.prefix, eng.pool.page_size
    out = {}
    for key, page in prefix.by_key.items():
        if page in prefix.captured:
            sl = slice(page * ps, (page + 1) * ps)
            out[key] = torch.cat([torch.cat([k[sl], v[sl]], -1) for k, v in eng.runner.draft_kv], -1)
    return out


@pytest.mark.parametrize("which", ["ngram", "dflash2"])
def test_other_proposers_chain_like_the_off_switch(tiny_pair, gsm8k_prompts, which) -> None:
    kw = {"spec": "ngram", "draft": None} if which == "ngram" else {"draft": DFLASH2}
    on, off = _llm(tiny_pair, True, spec_gate=2, **kw), _llm(tiny_pair, False, spec_gate=2, **kw)
    assert on.engine.proposer is not None and on.engine.proposer.name in ("ngram", "dflash")
    reqs = _reqs(gsm8k_prompts)
    assert _run(on, reqs) == _run(off, reqs)
    assert _trace(on) == _trace(off)
    assert _metrics(on) == _metrics(off) and _metrics(on)[3] > 0
    assert on.engine.metrics.decode_ahead_steps >= 10
