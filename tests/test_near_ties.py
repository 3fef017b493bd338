"""The near-ties gate (issue 47 item 2): an oracle drafter proposing the target's runner-up at each prompt's nearest
tie. The clean engine rejects every one; an accept rule that takes drafts within 1e-3 of the best logit (a
near-tie rule no natural draft on the tiny pair ever reaches) fails; an endpoint is CANNOT TEST."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from specbench.suites.lossless.gates import near_ties as nt


def test_nearest_tie_skips_the_prefill_and_the_oracles_bonus_positions():
    d = [{1: -0.1, 2: -0.1001}] * 10  # every position a near-tie of 1e-4
    d = [*d[:5], {3: -0.5, 4: -0.50001}, *d[6:]]  # position 5: 1e-5, the nearest, but a bonus position at K 4
    d[7] = {5: -0.2, 6: -0.20002}  # position 7: 2e-5, drafted
    j, runner, gap = nt.nearest_tie(d, k=4)
    assert (j, runner) == (7, 6) and abs(gap - 2e-5) < 1e-9
    assert nt.nearest_tie([{1: 0.0}] * 5, k=4) is None  # one candidate: no runner-up


def _gate(candidate, n: int = 8):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.greedy import GreedyGateOptions, tokenize_prompts
    from specbench.suites.lossless.prompts import load_prompts

    base = LocalAdapter.from_dirs(str(candidate.describe()["model"]), spec="off")

    async def go():
        try:
            prompts, _ = await tokenize_prompts(base, candidate, load_prompts("gsm8k", n))
            return await nt.near_ties(base, candidate, prompts, 64, GreedyGateOptions())
        finally:
            await candidate.aclose()
            await base.aclose()
    return asyncio.run(go())


def test_the_clean_engine_rejects_every_planted_runner_up(tiny_pair):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    run = _gate(LocalAdapter.from_dirs(t, d, spec="dflash"))
    assert run.verdict == "PASS" and run.evidence["planted"] == 8 and run.evidence["accepted"] == 0, run.notes
    assert run.evidence["verified"] == 8  # each runner-up inside a verify step the engine reported
    assert run.evidence["min_gap"] < 1e-3  # the default prompts reach a tie nearer than the planted rule's margin
    assert all(p.status == "identical" for p in run.prompts)


def test_an_accept_rule_that_takes_drafts_within_1e_3_fails(monkeypatch, tiny_pair):
    from specbench.engine import faults
    from specbench.harness.adapters.local import LocalAdapter

    monkeypatch.setattr(faults.AcceptTolerance, "rule", lambda self, rule: replace(rule, greedy_tol=1e-3))
    t, d = tiny_pair
    run = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", faults=("accept_tolerance",)))
    assert run.verdict == "FAIL" and run.evidence["accepted"] >= 1, run.notes
    bad = [p for p in run.prompts if p.status == "fail"]
    assert bad and all("accepted the planted runner-up" in p.reason and p.spec["gap"] < 1e-3 for p in bad)


def test_without_the_oracle_capability_it_is_cannot_test():
    from lossless_fakes import FakeAdapter

    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt

    fake = FakeAdapter()
    run = asyncio.run(nt.near_ties(fake, fake, [Prompt("p", [1, 2, 3])], 16, GreedyGateOptions()))
    assert run.verdict == "CANNOT TEST" and "oracle_drafts" in run.missing[0] and not run.results


def test_a_runner_up_no_verify_step_covered_is_untestable_not_a_pass(monkeypatch, tiny_pair):
    """Steps reported, none over the planted position (here: the engine reports no step at all): every case is
    untestable, the gate CANNOT TEST, never a PASS on runner-ups that were never verified."""
    from specbench.engine.request import SpecStats
    from specbench.harness.adapters.local import LocalAdapter

    as_dict = SpecStats.as_dict
    monkeypatch.setattr(SpecStats, "as_dict", lambda self: {**as_dict(self), "step_at": [], "step_drafts": []})
    t, d = tiny_pair
    run = _gate(LocalAdapter.from_dirs(t, d, spec="dflash"), n=3)
    assert run.verdict == "CANNOT TEST" and run.missing == ["the planted runner-up verified"], run.missing
    assert all(p.untestable and "never tested" in p.reason for p in run.prompts)
