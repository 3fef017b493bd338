"""The acceptance-trace gate (issue 47 item 1): the replay's walk, the alignment, the gate on the bundled engine
(clean: every step equal; planted bugs that keep the output exact but change acceptance: FAIL), the statistical
mode's test, and what it cannot test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from specbench.harness.replay import NgramReplay, ReplayStep, replay_trace
from specbench.suites.lossless.gates import accept_trace as at

FIXTURES = Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures"
DFLASH2 = str(FIXTURES / "tiny-dflash2" / "draft")


# ---- the replay's walk -----------------------------------------------------------------------------------------
def _oracle(truth: list[int], wrong_at: set[int]):
    """A drafter that proposes the true continuation except at absolute output positions in `wrong_at`."""
    def propose(ids, k):
        n = len(ids) - 3  # prompts of 3 tokens
        d = [truth[n + j] + (1 if n + j in wrong_at else 0) for j in range(min(k, len(truth) - n))]
        return d, [float(j + 1) for j in range(len(d))]
    return propose


def test_replay_walk_commits_accepted_plus_bonus_and_truncates_at_max_tokens():
    out = list(range(100, 120))  # 20 tokens
    tr = replay_trace(_oracle(out, {4, 12}), [1, 2, 3], out, k=4, max_tokens=20)
    # n=1: drafts 1..4, slot 4 wrong -> accepts 3 (positions 1-3), bonus 4 -> n=5; n=5: 5..8 all -> n=10;
    # n=10: 10..13, 12 wrong -> 2, n=13; n=13: 13..16 -> 4, n=18; n=18: min(4, 20-18-1)=1 -> 1, n=20
    assert [(s.at, s.drafted, s.accepted) for s in tr.steps] == [(1, 4, 3), (5, 4, 4), (10, 4, 2), (13, 4, 4),
                                                                 (18, 1, 1)]
    assert tr.steps[0].margins == (1.0, 2.0, 3.0, 4.0)  # slots 0..3: three accepted, the rejected one decides too
    assert tr.steps[0].margin == 1.0 and tr.runs == [3, 4, 2, 4, 1]


def test_an_ngram_miss_is_a_plain_step_not_a_verify_step():
    out = [7, 8, 9, 7, 8, 9, 5]
    tr = replay_trace(NgramReplay(1, 2), [1, 2], out, k=2, max_tokens=16)
    # [1,2,7]: no 7 earlier -> plain; [..,8]: none -> plain; [..,9]: none -> plain; [1,2,7,8,9,7]: 7 at 2 -> 8, 9
    assert [(s.at, s.drafted, s.accepted) for s in tr.steps] == [(4, 2, 2)]
    assert tr.steps[0].margin == float("inf")


def test_compare_aligns_by_position_and_excuses_only_near_ties():
    steps = [ReplayStep(1, 4, 2, (0.5, 0.4, 0.3)), ReplayStep(4, 4, 4, (0.2,) * 4), ReplayStep(9, 4, 1, (1e-5, 0.9))]
    ok = at.compare("r", [2, 4, 1], steps, by_position=True, skip_last=False)
    assert (ok.aligned, ok.equal, ok.differ, ok.near_ties) == (3, 3, [], [])
    bad = at.compare("r", [2, 3, 1, 0], steps, by_position=True, skip_last=False)
    # the second step accepts 3 where 4 are earned: a real difference; then the positions part (8 vs 9)
    assert (bad.aligned, bad.equal, len(bad.differ)) == (2, 1, 1) and "position 4" in bad.differ[0]
    tie = at.compare("r", [2, 4, 0], steps, by_position=True, skip_last=False)
    assert tie.differ == [] and len(tie.near_ties) == 1  # margin 1e-5 < NEAR_TIE
    last = at.compare("r", [2, 4, 0], steps, by_position=True, skip_last=True)  # a stop cut the last step
    assert (last.aligned, last.near_ties, last.differ) == (2, [], [])


def test_compare_in_order_stops_at_the_first_difference():
    steps = [ReplayStep(4, 2, 2), ReplayStep(7, 2, 0), ReplayStep(9, 2, 1)]
    c = at.compare("r", [2, 1, 1], steps, by_position=False, skip_last=False)
    assert (c.aligned, c.equal, len(c.differ)) == (2, 1, 1)


def test_the_sign_test_needs_both_significance_and_a_shift():
    def comps(up, down, same, cand, ref):
        c = at.TraceCompare("r", signs=[1] * up + [-1] * down + [0] * same, cand_sum=cand, ref_sum=ref)
        c.aligned = up + down + same
        return [c]
    assert at._sign_check(comps(3, 4, 200, 400, 401)).ok  # bf16 noise: a few each way
    assert not at._sign_check(comps(0, 40, 160, 360, 440)).ok  # every difference one way, -18%
    assert at._sign_check(comps(0, 12, 988, 3988, 4000)).ok  # significant but -0.3%: below MIN_SHIFT


# ---- the gate on the bundled engine --------------------------------------------------------------------------
def _gate(candidate, n: int = 4, max_tokens: int = 40):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.greedy import GreedyGateOptions, tokenize_prompts
    from specbench.suites.lossless.prompts import load_prompts

    base = LocalAdapter.from_dirs(candidate.describe()["model"], spec="off")

    async def go():
        try:
            prompts, _ = await tokenize_prompts(base, candidate, load_prompts("gsm8k", n))
            return await at.accept_trace(base, candidate, prompts, max_tokens, GreedyGateOptions())
        finally:
            await candidate.aclose()
            await base.aclose()
    return asyncio.run(go())


@pytest.mark.parametrize("drafter", ["dflash", "dflash2", "ngram"])
def test_the_clean_engine_matches_its_replay_step_for_step(tiny_pair, drafter):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    ad = (LocalAdapter.from_dirs(t, spec="ngram") if drafter == "ngram"
          else LocalAdapter.from_dirs(t, DFLASH2 if drafter == "dflash2" else d, spec="dflash"))
    run = _gate(ad)
    assert run.verdict == "PASS", (run.missing, [c.detail for c in run.checks], run.notes)
    ev = run.evidence
    assert ev["exact"] and ev["aligned_steps"] >= 10 and ev["near_ties"] == 0, run.notes
    if drafter != "ngram":  # every DFlash step aligns; n-gram compares in order
        assert all(p.spec["aligned_steps"] == p.spec["equal"] for p in run.prompts)


def _conv_wraps_the_block(monkeypatch) -> None:
    """DFlash2's convolution reads the block's last slot before its first (torch.roll: wrapping) instead of zero."""
    from specbench.engine.models import dflash2

    def conv(self, x, delta, side):
        out = torch.zeros_like(x)
        for t in range(self.kernel):
            w = self.base[side, t].to(x.dtype) + delta[:, :, side, t].repeat_interleave(self.group, dim=-1)
            out = out + w * torch.roll(x, t, dims=1)
        return out
    monkeypatch.setattr(dflash2.GroupedDynamicConv, "conv", conv)


def _accepted_overcounted(monkeypatch) -> None:
    """The per-request bookkeeping counts the bonus token as an accepted draft when a draft was rejected."""
    from specbench.engine.request import SpecStats

    record = SpecStats.record
    monkeypatch.setattr(SpecStats, "record", lambda self, k, accepted, at=None: record(self, k, min(k, accepted + 1),
                                                                                      at))


@pytest.mark.parametrize("plant, drafter", [(_conv_wraps_the_block, "dflash2"), (_accepted_overcounted, "dflash")])
def test_a_bug_that_keeps_the_output_exact_but_moves_acceptance_fails(monkeypatch, tiny_pair, plant, drafter):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    plant(monkeypatch)
    run = _gate(LocalAdapter.from_dirs(t, DFLASH2 if drafter == "dflash2" else d, spec="dflash"))
    assert run.verdict == "FAIL", run.notes
    failed = {c.name: c for c in run.failed_checks}
    assert "differ beyond a near-tie" in failed["accept-trace: exact"].detail, list(failed)
    assert any(p.status == "fail" and "replayed drafter earns" in p.reason for p in run.prompts)
    # overcounted accepts also put later steps past their output: the step bookkeeping check says so
    assert set(failed) <= {"accept-trace: exact", "accept-trace: steps"}


def test_what_the_replay_cannot_run_is_cannot_test(tiny_pair):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    off = _gate(LocalAdapter.from_dirs(t, spec="off"))
    assert off.verdict == "CANNOT TEST" and not off.results and "this one does not speculate" in off.missing[0]
    syn = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", synthetic_tau=3.0))
    assert syn.verdict == "CANNOT TEST" and "synthetic acceptance" in syn.missing[0]


@pytest.mark.parametrize("lever", [{"spec_gate": 1}, {"spec_trim": 2}, {"spec_policy": "auto"}])
def test_every_step_is_replayed_where_a_lever_chooses_the_draft_length(tiny_pair, lever):
    """The engine reports each step's position and draft count: the drafter is replayed at those steps."""
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    run = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", **lever), n=6)
    assert run.verdict == "PASS", (run.missing, [c.detail for c in run.checks])
    assert run.evidence["aligned_steps"] >= 5 and all(p.spec["aligned_steps"] == p.spec["equal"] for p in run.prompts)
    if "spec_trim" in lever:  # 2 drafts a step, 1 where max_tokens leaves room for one
        drafts = [x for r in run.results for x in r.spec["step_drafts"]]
        assert set(drafts) <= {1, 2} and drafts.count(2) > drafts.count(1)


def test_without_step_positions_a_lever_is_cannot_test_and_the_walk_still_judges(monkeypatch, tiny_pair):
    """An engine that reports only its accepted runs: the replay walks at the fixed K; a lever makes K unknown."""
    from specbench.engine.request import SpecStats
    from specbench.harness.adapters.local import LocalAdapter

    as_dict = SpecStats.as_dict
    monkeypatch.setattr(SpecStats, "as_dict", lambda self: {k: v for k, v in as_dict(self).items()
                                                            if k not in ("step_at", "step_drafts")})
    t, d = tiny_pair
    trim = _gate(LocalAdapter.from_dirs(t, d, spec="dflash", spec_trim=2))
    assert trim.verdict == "CANNOT TEST" and "levers {'trim': 2}" in trim.missing[0]
    walk = _gate(LocalAdapter.from_dirs(t, d, spec="dflash"))
    assert walk.verdict == "PASS" and walk.evidence["aligned_steps"] >= 10, walk.notes


def test_a_step_reported_where_the_output_has_none_fails(monkeypatch, tiny_pair):
    """The bookkeeping records each step one position late: the counts are right, the trace is not the output's."""
    from specbench.engine.request import SpecStats
    from specbench.harness.adapters.local import LocalAdapter

    record = SpecStats.record
    monkeypatch.setattr(SpecStats, "record", lambda self, k, accepted, at=None: record(self, k, accepted,
                                                                                      None if at is None else at + 1))
    t, d = tiny_pair
    run = _gate(LocalAdapter.from_dirs(t, d, spec="dflash"))
    assert run.verdict == "FAIL", run.notes
    assert "accept-trace: steps" in [c.name for c in run.failed_checks] or any(
        "replayed drafter earns" in p.reason for p in run.prompts if p.status == "fail")


# ---- --replay-drafter --------------------------------------------------------------------------------------------
def test_replay_spec_parses_and_refuses_in_one_line(tiny_pair, tmp_path):
    from specbench.suites.lossless.greedy import LosslessError

    t, d = tiny_pair
    rs = at.ReplaySpec.parse(f"target={t},draft={d},k=5,exact=true")
    assert (rs.target, rs.draft, rs.k, rs.exact, rs.ngram) == (str(t), str(d), 5, True, None)
    assert at.ReplaySpec.parse("ngram=2-3,k=4") == at.ReplaySpec(ngram=(2, 3), k=4)
    for bad, says in ((f"target={t},draft={tmp_path}", "draft="), ("ngram=3-2,k=4", "ngram='3-2'"),
                      ("ngram=1-2", "needs k=N"), (f"target={t},draft={d},k=0", "k='0'"),
                      ("model=x", "'model=x' is invalid"), (f"target={t},draft={d},exact=maybe", "exact='maybe'")):
        with pytest.raises(LosslessError, match="--replay-drafter") as e:
            at.ReplaySpec.parse(bad)
        assert says in str(e.value) and "\n" not in str(e.value)


def test_a_bad_replay_drafter_exits_2_before_any_engine_starts():
    from typer.testing import CliRunner

    from specbench.cli import app as cli

    cli._register()
    r = CliRunner().invoke(cli.app, ["lossless", "--no-record", "--replay-drafter", "k=7"])
    assert r.exit_code == 2 and "--replay-drafter" in r.output and "target=''" in r.output, r.output


def test_requests_that_all_fail_are_cannot_test_with_their_error():
    """The one true reason: every request failed (the error shown), not "the engine reports no runs"."""
    from lossless_fakes import FakeAdapter

    from specbench.harness.adapters.base import GenResult
    from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt

    class Failing(FakeAdapter):
        async def generate_one(self, req):
            return GenResult(rid=req.rid or "r", ok=False, error="HTTP 500: boom")

    fake = Failing()
    run = asyncio.run(at.accept_trace(fake, fake, [Prompt("p", [1, 2, 3]), Prompt("q", [4, 5])], 8,
                                      GreedyGateOptions(replay="ngram=1-2,k=2")))
    assert run.verdict == "CANNOT TEST" and "all 2 failed (first: HTTP 500: boom)" in run.missing[0], run.missing
