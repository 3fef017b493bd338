"""SpanPolicy bookkeeping found by review (2026-12-04; each test failed on the code before its fix): the hold
charge follows the chain the engine is in (gate rounds included), an exploration run of span 1 ends at a bucket
change, a gate stretch or a prefill chunk, and an exploration's regret counts the chain restart it causes (out
of a chain) or the unchained first round of a span-1 run."""
from __future__ import annotations

import pytest

import specbench.engine.spec.policy as pm
from specbench.engine.config import SamplingParams
from specbench.engine.spec.costs import CostModel
from specbench.engine.spec.plan import SpecPlan
from specbench.engine.spec.policy import Acceptance, SpanPolicy


def _plan(**kw) -> SpecPlan:
    base = {"enabled": True, "method": "dflash", "k": 7, "headroom": 8, "drafter": True, "sampling": True}
    return SpecPlan(**{**base, **kw})


def _costs(verify, draft=0.0) -> CostModel:
    batches, spans = [1, 8, 64], [1, 2, 4, 8]
    return CostModel(batches, spans, {s: [verify(b, s) for b in batches] for s in spans}, [draft * b for b in batches])


class _Req:
    def __init__(self, i, remaining=100):
        self.rid, self.in_prefill, self.remaining = f"r{i}", False, remaining
        self.params = SamplingParams()


class _Ready:
    def ready(self, r):
        return True


def _decide(pol, n):
    pol.choose([_Req(i) for i in range(n)], _Ready())
    c = pol.detach()
    return c.span, c.reason


def _near_tie_policy(**plan_kw) -> SpanPolicy:
    """b=4, acceptance 0.5/position: span 4 = 7.5 tokens in 5.5 ms (1364 tok/s), chained span 1 = 4 tokens in
    3.0 ms (1333 tok/s), a one-token round alone 5.0 ms. Without the HOLD charge span 4 wins; with it
    ((5.0 - 3.0) / HOLD = 0.25 ms on span 4: 1304 tok/s) chained rounds win."""
    pol = SpanPolicy(_plan(policy="auto", **plan_kw), _costs(lambda b, s: 1e-3))
    pol.acceptance = Acceptance(7, prior=(0.5, 1e9), decay=1.0)
    pol.walls = {(4, 1): [5.0e-3, 9], (4, 2): [7.0e-3, 9], (4, 4): [5.5e-3, 9], (4, 8): [10.0e-3, 9]}
    pol.chain_walls = {4: [3.0e-3, 9]}
    pol.chain_ok = lambda: True
    return pol


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(pm, "EVIDENCE", 0)
    monkeypatch.setattr(pm, "EXPLORE", 10**9)  # no exploration noise


def test_held_is_stale_after_gate_rounds(quiet):
    """A chain of gate rounds is a chain of one-token rounds just like the policy's own span-1 rounds: leaving
    it to speculate costs the same restart. `_held` is only written by `_best`, so after the gate the policy's
    hysteresis depends on what it decided before the gate, not on the chain it is in (policy.py:317-318, 357)."""
    # A: the last step before the decision was a policy span-1 round (in a chain)
    a = _near_tie_policy(gate=4)
    a._held = 1
    # B: the policy last decided span 4, then 20 gate rounds ran (5 requests > gate 4), chained one-token rounds
    b = _near_tie_policy(gate=4)
    b._held = 4
    for _ in range(20):
        assert _decide(b, 5) == (1, "gate")
    # both are now in a chain of one-token rounds and must decide the same
    assert _decide(a, 4) == _decide(b, 4), "the HOLD charge depends on a decision made before the gate stretch"


def test_explore_run_of_span_1_continues_into_another_bucket(monkeypatch):
    """An exploration run of span 1 (EXPLORE_RUN rounds, regret paid from bucket 4's budget) goes on at bucket 64
    after the batch grew, without any budget check there (policy.py:330-333): bucket 64's budget is never even
    accrued, contrary to 'what c1's cheap steps saved is not spent at c64'."""
    monkeypatch.setattr(pm, "EVIDENCE", 0)
    monkeypatch.setattr(pm, "EXPLORE_SHARE", 1.0)
    pol = SpanPolicy(_plan(policy="auto"), _costs(lambda b, s: 1e-3))  # flat: span 8 wins everywhere
    pol.walls = {(4, s): [1e-3, 100] for s in (2, 4, 8)}  # span 1 unseen at bucket 4
    pol.chain_ok = lambda: True
    got = [_decide(pol, 4) for _ in range(pm.EXPLORE)]
    assert got[-1] == (1, "explore") and pol._explore_left == pm.EXPLORE_RUN - 1
    after = [_decide(pol, 64) for _ in range(pm.EXPLORE_RUN - 1)]  # the batch is now 64
    assert after == [(8, "policy")] * (pm.EXPLORE_RUN - 1), (after, pol._budget)


def test_explore_run_of_span_1_survives_a_gate_stretch(monkeypatch):
    """`_explore_left` is only consumed by `_best`: gate (or no_ready) steps leave it, and it resumes however long
    after, at whatever batch (policy.py:330)."""
    monkeypatch.setattr(pm, "EVIDENCE", 0)
    monkeypatch.setattr(pm, "EXPLORE_SHARE", 1.0)
    pol = SpanPolicy(_plan(policy="auto", gate=4), _costs(lambda b, s: 1e-3))
    pol.walls = {(4, s): [1e-3, 100] for s in (2, 4, 8)}
    pol.chain_ok = lambda: True
    got = [_decide(pol, 4) for _ in range(pm.EXPLORE)]
    assert got[-1] == (1, "explore")
    for _ in range(500):
        assert _decide(pol, 5) == (1, "gate")
    assert _decide(pol, 4) == (8, "policy"), "an exploration run resumed 500 steps later"


def test_exploration_regret_charges_the_chain_restart_it_causes(monkeypatch):
    """Module docstring / policy.py:348-349: an exploration's regret is its step time minus what the best span
    takes for the same tokens, 'and where the best is a chain of one-token rounds, the unchained round that
    restarts it'. The code charges only restart / HOLD (through secs[alt]), so an exploration out of a chain is
    charged about half of what it loses here and exploration overspends EXPLORE_SHARE."""
    monkeypatch.setattr(pm, "EVIDENCE", 0)
    reqs = [_Req(i) for i in range(16)]
    pol = SpanPolicy(_plan(policy="auto"), _costs(lambda b, s: 3e-3 + 3e-5 * b * s))
    pol.acceptance = Acceptance(7, prior=(0.5, 1e9), decay=1.0)
    pol.walls = {(16, 1): [5.0e-3, 9], (16, 2): [7.0e-3, 9], (16, 4): [8.0e-3, 9], (16, 8): [10.0e-3, 9]}
    pol.chain_walls = {16: [3.7e-3, 9]}
    pol.chain_ok = lambda: True
    pol._held = 1  # in a chain of one-token rounds
    pol._since = pm.EXPLORE - 1
    pol._budget = {16: 1.0}
    pol.choose(reqs, _Ready())
    c = pol.detach()
    assert c.reason == "explore" and c.span > 1
    best_rate = c.expected[1]
    accrual = pm.EXPLORE_SHARE * 16 / best_rate
    charged = 1.0 + accrual - pol._budget[16]
    exp = pol.acceptance.expected_all()
    tokens = 16 * exp[c.span - 1]
    # what the exploration loses: its own step (unchained), the restart of the chain after it, less the time the
    # chain takes for the same tokens
    lost = pol.walls[(16, c.span)][0] + (5.0e-3 - 3.7e-3) - tokens / best_rate
    assert charged == pytest.approx(lost, rel=0.05), (charged * 1e3, lost * 1e3)


def test_span1_exploration_run_prices_its_first_round_as_chained(monkeypatch):
    """An exploration of span 1 from a speculative best runs EXPLORE_RUN rounds, the first of which can never
    chain (it follows a speculative step; policy.py docstring: 'the first of a run never can'). Its regret is
    run * (chained-blend price - ...) (policy.py:350), i.e. the first round is charged as chained."""
    monkeypatch.setattr(pm, "EVIDENCE", 0)
    reqs = [_Req(i) for i in range(4)]
    pol = SpanPolicy(_plan(policy="auto"), _costs(lambda b, s: 1e-3))
    pol.walls = {(4, 1): [4.0e-3, 9], (4, 2): [1e-3, 9], (4, 4): [1e-3, 9], (4, 8): [1e-3, 9]}
    pol.chain_walls = {4: [1.0e-3, 9]}  # chained round 1 ms, the first (unchained) round 4 ms
    pol.chain_ok = lambda: True
    pol.acceptance = Acceptance(7, prior=(0.5, 1e9), decay=1.0)
    pol._since = pm.EXPLORE - 1
    pol._budget = {4: 1.0}
    # force span 1 as the alternative: the others are "seen", span 1 is unseen (chain_walls count 0)
    pol.chain_walls = {4: [1.0e-3, 0]}
    pol.choose(reqs, _Ready())
    c = pol.detach()
    assert (c.span, c.reason) == (1, "explore")
    best_rate = max(c.expected.values())
    charged = 1.0 + pm.EXPLORE_SHARE * (4 * pol.acceptance.expected(7)) / best_rate - pol._budget[4]
    chained = pol.costs.verify(4, 1)  # no chained observation: the model's replay time stands in
    lost = (4.0e-3 + (pm.EXPLORE_RUN - 1) * chained) - pm.EXPLORE_RUN * 4 / best_rate
    assert charged == pytest.approx(lost, rel=0.05), (charged * 1e3, lost * 1e3)
