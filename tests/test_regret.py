"""The regret rule on crafted distributions, and the re-anchoring gate on a fake engine."""

from __future__ import annotations

import asyncio

import pytest
from lossless_fakes import FakeAdapter, dist

from specbench.harness.adapters.base import GenRequest
from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt, check_output, run_greedy
from specbench.suites.lossless.regret import (
    BENIGN,
    FAIL_NO_DIST,
    FAIL_OUTSIDE,
    FAIL_REGRET,
    first_divergence,
    judge_pick,
    merged_dist,
)

# ---- the pure rule --------------------------------------------------------------------------------


def test_exact_tie_is_benign():
    j = judge_pick(7, {3: -0.693, 7: -0.693, 9: -4.0})
    assert j.ok and j.kind == BENIGN and j.regret == 0.0


def test_019_passes_021_fails():
    ok = judge_pick(2, {1: -1.0, 2: -1.19, 3: -5.0}, margin_tol=0.20)
    bad = judge_pick(2, {1: -1.0, 2: -1.21, 3: -5.0}, margin_tol=0.20)
    assert ok.ok and ok.kind == BENIGN and ok.regret == pytest.approx(0.19)
    assert not bad.ok and bad.kind == FAIL_REGRET and bad.regret == pytest.approx(0.21)
    assert "FAIL" in bad.describe() and "0.210" in bad.describe()


def test_exactly_at_margin_passes():
    assert judge_pick(2, {1: -1.0, 2: -1.2}, margin_tol=0.20).ok  # 0.2 is not exact in binary


def test_pick_outside_topk_fails_with_lower_bound():
    j = judge_pick(9, {1: -0.1, 2: -2.0, 3: -3.0})
    assert not j.ok and j.kind == FAIL_OUTSIDE
    assert j.lower_bound == pytest.approx(2.9) and j.regret is None
    assert "outside the baseline's top-3" in j.describe() and ">= 2.900" in j.describe()


def test_outside_topk_still_fails_when_scored_close():
    # Even a small exact regret does not rescue a pick the baseline ranked below its top-k.
    j = judge_pick(9, {1: -3.0, 2: -3.05}, exact_pick_logprob=-3.1)
    assert not j.ok and j.kind == FAIL_OUTSIDE and j.regret == pytest.approx(0.1)


def test_no_distribution():
    assert judge_pick(1, {}).kind == FAIL_NO_DIST


def test_merged_dist_adds_chosen_token():
    assert merged_dist({1: -0.5}, 2, -0.6) == {1: -0.5, 2: -0.6}


def test_bad_margin():
    with pytest.raises(ValueError, match="margin_tol"):
        judge_pick(1, {1: 0.0}, margin_tol=-1)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([9, 2, 3], [1, 2, 3]) == 0
    assert first_divergence([1, 2, 9], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 2, 3, 4], [1, 2, 3]) == 3


# ---- the gate on a fake engine --------------------------------------------------------------------

PROMPT = Prompt("p", [5, 6, 7])  # context lengths 3, 4, ... are output positions 0, 1, ...
T = 16


def alt_at(length: int, picks: dict[int, int] | None = None) -> int:
    """The runner-up token the candidate would pick at this context length (given earlier picks)."""
    ids = list(PROMPT.ids)
    while len(ids) < length:
        d = dist(ids, {})
        ids.append((picks or {}).get(len(ids), max(d, key=lambda x: (d[x], -x))))
    nxt = (3 * ids[-1] + 1) % 32
    return (nxt + 1) % 32


def run_check(base: FakeAdapter, cand: FakeAdapter, opts: GreedyGateOptions | None = None):
    async def go():
        res = (await cand.generate([GenRequest(prompt=PROMPT.ids, max_tokens=T)]))[0]
        return await check_output(base, PROMPT, res, T, opts or GreedyGateOptions(), cand)
    return asyncio.run(go())


def test_identical():
    pc = run_check(FakeAdapter(), FakeAdapter())
    assert pc.status == "identical" and pc.tokens_compared == T and pc.first_divergence is None


def test_benign_divergence_at_position_0():
    gaps = {3: 0.1}
    pc = run_check(FakeAdapter(gaps), FakeAdapter(gaps, picks={3: alt_at(3)}))
    assert pc.status == "flip" and pc.first_divergence == 0 and pc.reanchors == 1
    assert pc.divergences[0].judgement.regret == pytest.approx(0.1)
    assert pc.tokens_compared == T and pc.complete
    assert pc.divergences[0].rescore["status"] == "ok"


def test_fail_at_position_0():
    pc = run_check(FakeAdapter(), FakeAdapter(picks={3: alt_at(3)}))  # gap 3.0 nat
    assert pc.status == "fail" and pc.first_divergence == 0
    assert pc.divergences[0].judgement.regret == pytest.approx(3.0)


def test_divergence_at_last_position():
    last = 3 + T - 1
    gaps = {last: 0.15}
    pc = run_check(FakeAdapter(gaps), FakeAdapter(gaps, picks={last: alt_at(last)}))
    assert pc.status == "flip" and pc.first_divergence == T - 1 and pc.reanchors == 0
    assert pc.tokens_compared == T and pc.complete
    bad = run_check(FakeAdapter(), FakeAdapter(picks={last: alt_at(last)}))
    assert bad.status == "fail" and bad.first_divergence == T - 1


def test_reanchoring_across_several_divergences_then_a_real_error():
    picks: dict[int, int] = {}
    for n in (5, 8, 12):  # benign flips at positions 2, 5, 9
        picks[n] = alt_at(n, picks)
    gaps = {5: 0.05, 8: 0.19, 12: 0.0}
    pc = run_check(FakeAdapter(gaps), FakeAdapter(gaps, picks=dict(picks)))
    assert pc.status == "flip" and [d.position for d in pc.divergences] == [2, 5, 9]
    assert pc.reanchors == 3 and pc.complete and pc.tokens_compared == T
    # A real error after the first flip is still caught: the seed gate would have stopped at position 2.
    picks[15] = alt_at(15, picks)
    pc = run_check(FakeAdapter(gaps), FakeAdapter(gaps, picks=dict(picks)))
    assert pc.status == "fail" and [d.position for d in pc.divergences] == [2, 5, 9, 12]
    assert pc.divergences[-1].judgement.regret == pytest.approx(3.0)


def test_reanchored_baseline_starts_from_candidate_prefix():
    gaps = {5: 0.05}
    base = FakeAdapter(gaps)
    picks = {5: alt_at(5)}
    run_check(base, FakeAdapter(gaps, picks=picks))
    re = base.requests[-1]
    assert re.prompt[:3] == PROMPT.ids and len(re.prompt) == 3 + 3 and re.prompt[-1] == picks[5]
    assert re.max_tokens == T - 3 and re.logprobs == 20


def test_max_divergences_budget():
    picks: dict[int, int] = {}
    for n in (4, 6, 8):
        picks[n] = alt_at(n, picks)
    gaps = dict.fromkeys((4, 6, 8), 0.01)
    pc = run_check(FakeAdapter(gaps), FakeAdapter(gaps, picks=picks), GreedyGateOptions(max_divergences=2))
    assert pc.status == "flip" and not pc.complete and len(pc.divergences) == 2
    assert "unchecked" in pc.reason and pc.tokens_compared == 4


def test_outside_topk_scored_exactly_by_baseline():
    cand = FakeAdapter(picks={4: 0 if alt_at(4) != 0 else 1})
    pc = run_check(FakeAdapter(), cand, GreedyGateOptions(top_k=2))
    d = pc.divergences[0]
    assert pc.status == "fail" and d.judgement.kind == FAIL_OUTSIDE
    assert d.judgement.lower_bound == pytest.approx(3.0) and d.judgement.regret is not None


def test_past_stop_and_early_stop():
    base = FakeAdapter(stop_at={3 + 6: 1})
    pc = run_check(base, FakeAdapter())
    assert pc.status == "fail" and pc.divergences[0].kind == "past_stop" and pc.first_divergence == 6
    pc = run_check(FakeAdapter(), FakeAdapter(stop_at={3 + 6: 1}))
    assert pc.status == "fail" and pc.divergences[0].kind == "early_stop"


def test_rescore_reports_unsupported():
    gaps = {4: 0.1}
    cand = FakeAdapter(gaps, picks={4: alt_at(4)}, can_score=False)
    pc = run_check(FakeAdapter(gaps), cand)
    assert pc.status == "flip" and pc.divergences[0].rescore == {"status": "unsupported by this engine"}


def test_run_greedy_verdict_and_counters():
    run = asyncio.run(run_greedy(FakeAdapter(), FakeAdapter(), [PROMPT, Prompt("q", [1, 2])], 8, GreedyGateOptions()))
    assert run.verdict == "PASS" and run.stats.source == "per-request" and run.stats.mean_accept_len == 2.5
    names = {c.name: c for c in run.checks}
    assert names["counters"].ok and names["kv-leak"].skipped
