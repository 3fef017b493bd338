"""The sampled equivalence gate: its statistics on synthetic data, the gate on the tiny pair, the CLI.

Statistics: identical distributions give uniform-ish p-values and no BH rejections, a shifted one is
rejected, BH matches a hand-worked vector, the stated power bound holds by simulation. Gate: the clean
local engine passes, each sampling fault is caught (a CI-sized configuration; the full-size one is
`-m slow`), and the CLI's exit codes (0 pass, 1 fail, 2 bad input).
"""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest

from specbench.harness.adapters.base import EngineAdapter, GenResult, PosLogprobs, ScoreResult
from specbench.harness.verdicts import NO_SPEC_EVIDENCE, PASS_ASSERTED
from specbench.suites.lossless.checks import AcceptanceEvidence
from specbench.suites.sampled import stats
from specbench.suites.sampled.config import DEFAULT_CONFIGS_TEXT, SOFT_Q_MIX
from specbench.suites.sampled.gate import (
    DEFAULT_CONFIGS,
    END,
    SampledError,
    SampledGateOptions,
    SamplingConfig,
    parse_configs,
    verdict_of,
)

GEOM = np.exp(-np.arange(30) / 3.0)
GEOM = GEOM / GEOM.sum()


# ---- statistics ------------------------------------------------------------------------------------
def test_max_studentized_and_tv_known_values():
    ca, cb = np.array([3, 1]), np.array([1, 3])
    # pooled f = 0.5 each; |0.75 - 0.25| / sqrt(0.25 * 0.5) = 0.5 / 0.35355
    assert math.isclose(stats.max_studentized(ca, cb, 4, 4), 0.5 / math.sqrt(0.125))
    assert stats.max_studentized(np.array([4]), np.array([4]), 4, 4) == 0.0  # one category: no information
    assert stats.tv_distance(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1])) == pytest.approx(0.25)
    assert stats.tv_distance(np.array([5, 5]), np.array([7, 7])) == pytest.approx(1.0)


def test_identical_distributions_give_uniform_p_values_and_no_rejections():
    rng = np.random.default_rng(0)
    perm = stats.Permuter(128, 128, 199, seed=1)
    p = np.array([perm.test(rng.choice(30, 128, p=GEOM), rng.choice(30, 128, p=GEOM)).p_value for _ in range(300)])
    for level in (0.05, 0.2, 0.5):
        assert abs((p <= level).mean() - level) < 0.07, (level, (p <= level).mean())
    assert not stats.benjamini_hochberg(p, 0.05).any()


def test_shifted_distribution_is_rejected():
    rng = np.random.default_rng(1)
    a = rng.choice(30, 256, p=GEOM)
    b = rng.choice(30, 256, p=stats.swap_mass(GEOM, 0.2))
    r = stats.permutation_test(a, b, 999, seed=2)
    assert r.p_value <= 0.002 and r.exceed <= 1
    assert stats.tv_distance(a, b) > 0.15


def test_constant_cell_has_p_one():
    r = stats.permutation_test(np.full(10, 7), np.full(12, 7), 99)
    assert r.p_value == 1.0 and r.support == 1


def test_refine_sharpens_floor_p_values():
    rng = np.random.default_rng(3)
    a, b = rng.choice(30, 128, p=GEOM), rng.choice(30, 128, p=stats.swap_mass(GEOM, 0.4))
    perm = stats.Permuter(128, 128, 99, seed=4, chunk=500)
    r = perm.test(a, b)
    assert r.p_value == 1 / 100
    r2 = perm.refine(a, b, r, upto=2000)
    assert r2.permutations >= 2000 and r2.p_value < 1 / 1000


def test_benjamini_hochberg_on_a_known_vector():
    p = [0.01, 0.04, 0.03, 0.5, 0.001]
    # sorted 0.001, 0.01, 0.03, 0.04, 0.5 vs k q / m = 0.01, 0.02, 0.03, 0.04, 0.05: k* = 4
    assert stats.benjamini_hochberg(p, 0.05).tolist() == [True, True, True, False, True]
    assert np.allclose(stats.bh_adjusted(p), [0.025, 0.05, 0.05, 0.5, 0.005])
    # the step-up: p_(2) fails its own threshold but p_(3) passes, so both are rejected
    p2 = [0.001, 0.0125, 0.014, 0.9]  # thresholds 0.0125, 0.025, 0.0375, 0.05
    assert stats.benjamini_hochberg(p2, 0.05).tolist() == [True, True, True, False]
    assert stats.benjamini_hochberg([0.02, 0.03], 0.01).tolist() == [False, False]
    assert stats.benjamini_hochberg([], 0.05).size == 0


def test_min_detectable_tv_is_conservative_by_simulation():
    n, alpha = 128, 0.05
    mde = stats.min_detectable_tv(GEOM, n, n, alpha)
    assert 0 < mde < GEOM[0]
    power = stats.simulated_power(GEOM, stats.swap_mass(GEOM, mde), n, n, alpha, sims=80, permutations=199)
    assert power >= 0.7, power
    assert stats.min_detectable_tv(GEOM, n, n, alpha / 100) > mde  # stricter level, larger MDE
    assert stats.min_detectable_tv(GEOM, 4 * n, 4 * n, alpha) < mde  # more samples, smaller MDE
    assert stats.min_detectable_tv(np.ones(500), n, n, alpha) == math.inf  # too flat for a swap


# ---- gate pieces -----------------------------------------------------------------------------------
def test_parse_configs_and_options():
    cs = parse_configs("t=1.0; t=0.7,p=0.9 ;temperature=1,top_k=20")
    assert [c.name for c in cs] == ["t1", "t0.7-p0.9", "t1-k20"]
    assert cs[2] == SamplingConfig("t1-k20", 1.0, 1.0, 20)
    # the default set: T 0.6 with top-p, T 0.7 alone (no truncation), T 1.3 with top-k (docs/sampled.md)
    assert sorted(c.temperature for c in DEFAULT_CONFIGS) == [0.6, 0.7, 1.3]
    assert [c.name for c in DEFAULT_CONFIGS if c.top_p == 1 and not c.top_k] == ["t0.7"]
    assert any(c.top_p < 1 for c in DEFAULT_CONFIGS) and any(c.top_k for c in DEFAULT_CONFIGS)
    from specbench.cli.sampled import sampled as sampled_cli  # the CLI's help names the same set

    assert "t=0.6,p=0.95; t=0.7; t=1.3,k=3" in str(inspect.signature(sampled_cli).parameters["configs"].default.help)
    assert DEFAULT_CONFIGS_TEXT.replace(";", "; ") == "t=0.6,p=0.95; t=0.7; t=1.3,k=3"
    assert SampledGateOptions().prompt_sets == ("echo", "repeat")
    assert SampledGateOptions(prompt_set="gsm8k, repeat").prompt_sets == ("gsm8k", "repeat")
    for bad in ("nope", "echo,echo", "", ","):
        with pytest.raises(SampledError, match="--prompt-set"):
            SampledGateOptions(prompt_set=bad)
    for bad in ("t=0", "x=1", "t=abc", "p=1.5", "k=2.5", ";"):
        with pytest.raises(SampledError):
            parse_configs(bad)
    with pytest.raises(SampledError, match="--positions"):
        SampledGateOptions(positions=0)
    with pytest.raises(SampledError, match="--q"):
        SampledGateOptions(q=1.5)


def test_seeds_are_distinct_disjoint_and_fit_32_bits():
    from specbench.suites.sampled.gate import seed_of

    cells, n = 3, 5
    seeds = [seed_of(s, arm, c, i, cells, n) for s in range(4) for arm in range(3) for c in range(cells) for i in range(n)]
    assert all(0 <= x < 2**31 for x in seeds)
    assert len({x % 2**32 for x in seeds}) == len(seeds)  # engines keep only the low 32 bits


def test_verdicts():
    from specbench.suites.sampled.gate import Cell, Comparison, missing_of

    spec = {"num_drafts": 10, "num_accepted_tokens": 3}
    cell = Cell("p", "t1", 1, 8, 8, 3, 0.5, 0.7, 99, 0.1, 0.5, 0.4)
    ok = [Comparison("spec", ("a", "b"), [cell])]
    assert verdict_of(ok, spec, []) == "PASS"
    # no counters and no other evidence that the candidate speculated: no pass (CANNOT TEST), unless the user
    # asserts it; other evidence decides like counters (tests/test_verdict_evidence.py)
    assert verdict_of(ok, None, []) == "CANNOT TEST"
    assert verdict_of(ok, None, [], evidence=AcceptanceEvidence("none", assumed=True)) == PASS_ASSERTED
    assert verdict_of(ok, None, [], evidence=AcceptanceEvidence("stream chunks", multi_token_chunks=3)) == "PASS"
    assert verdict_of(ok, {"num_drafts": 0, "num_accepted_tokens": 0}, []) == "NOT SPECULATING"
    assert verdict_of(ok, {"num_drafts": 5, "num_accepted_tokens": 0}, []) == "NO DRAFT ACCEPTED"
    assert verdict_of(ok, spec, ["r1: boom"]) == "INCOMPLETE"
    # no evidence is never a pass: no comparison, no testable cell, unreadable samples
    assert verdict_of([], spec, []) == "CANNOT TEST"
    flat = [Comparison("spec", ("a", "b"), [Cell("p", "t1", 0, 8, 8, 1, 0.0, 1.0, 99, 0.0, 1.0, 1.0, testable=False)])]
    assert missing_of(flat, []) and verdict_of(flat, spec, [], missing_of(flat, [])) == "CANNOT TEST"
    assert verdict_of(ok, None, [], missing_of(ok, ["r: no token"])) == "CANNOT TEST"
    rejected = Cell("p", "t1", 2, 8, 8, 3, 5.0, 0.001, 99, 0.9, 0.5, 0.4, rejected=True)
    assert verdict_of([Comparison("spec", ("a", "b"), [rejected])], spec, [], ["x"]) == "FAIL"  # FAIL wins
    assert END == -1


# ---- the gate end to end on a fake engine (no model) -----------------------------------------------
FAKE_LAW = np.array([0.4, 0.2, 0.15, 0.1, 0.1, 0.05])


class FakeEngine(EngineAdapter):
    """Token j of a sample ~ a fixed distribution over 6 tokens (seeded by the request); `bias` moves mass
    at positions >= 1 from token 0 to token 1; `text_only` reports text, not ids; `counters` None = none."""

    kind = "fake"

    def __init__(self, bias: float = 0.0, text_only: bool = False, counters: tuple | None = (10, 3),
                 fail_every: int = 0, name: str = "fake", full: int | None = None,
                 idle_temp: float | None = None, unseeded: bool = False, scores: bool = False) -> None:
        super().__init__(name)
        self.scores = scores  # teacher-forced scores of the unbiased law (the fit test's target), prompt ids reported
        self.score_law = FAKE_LAW  # the law the scores report (another one: scores that are not the engine's)
        self.unseeded = unseeded  # the request's seed ignored: same law, no reproduction
        self._rng = np.random.default_rng(12345)
        self.bias, self.text_only, self.counters, self.fail_every = bias, text_only, counters, fail_every
        self.full, self.idle_temp = full, idle_temp  # full accepts per call; a temperature that never speculates
        self.calls = self.spec_calls = 0

    async def generate_one(self, req):
        self.calls += 1
        self.spec_calls += req.temperature != self.idle_temp
        if self.fail_every and self.calls % self.fail_every == 0:
            return GenResult(rid=req.rid or "x", ok=False, error="boom")
        rng = self._rng if self.unseeded else np.random.default_rng(req.seed if req.seed is not None else 0)
        ids = []
        for j in range(req.max_tokens):
            p = FAKE_LAW.copy()
            if j >= 1:
                p[0] -= self.bias
                p[1] += self.bias
            ids.append(int(rng.choice(6, p=p)))
        return GenResult(rid=req.rid or "x", ok=True, text=" ".join(map(str, ids)),
                         output_ids=None if self.text_only else ids, prompt_ids=[7, 8, 9] if self.scores else None)

    async def score(self, prompt_ids, continuation_ids, top_k=1):
        if not self.scores:
            return None
        lp = np.log(self.score_law)
        return ScoreResult([PosLogprobs(t, float(lp[t]), {i: float(v) for i, v in enumerate(lp)})
                            for t in continuation_ids])

    async def tokenize(self, text):
        return [int(t) for t in text.split()]

    async def spec_counters(self):
        if self.counters is None:
            return None
        d, a, n = *self.counters, self.spec_calls
        out = {"num_drafts": d * n, "num_draft_tokens": 2 * d * n, "num_accepted_tokens": a * n,
               "accepted_per_pos": [a * n], "source": "fake"}
        if self.full is not None:
            out["num_full_accepts"] = self.full * n
        return out

    def describe(self):
        return {"name": self.name, "kind": "fake", "config": {}}


FAKE_OPTS = dict(num_prompts=2, positions=3, samples=200, permutations=199, concurrency=64, prompt_set="gsm8k")


def test_gate_end_to_end_on_a_fake_engine():
    from specbench.suites.sampled import report
    from specbench.suites.sampled.gate import configurations, run_gate

    cfgs = parse_configs("t=1")
    res = run_gate(FakeEngine(), FakeEngine(text_only=True), SampledGateOptions(**FAKE_OPTS, null=True), cfgs)
    assert res.verdict == "PASS", res.summary()
    assert [len(c.cells) for c in res.comparisons] == [6, 6]  # 2 prompts x 1 config x 3 positions, each
    assert res.spec["num_drafts"] > 0 and res.spec["mean_accept_len"] == pytest.approx(1.3)
    md = report.render(res)
    assert "Sampled equivalence gate: PASS" in md and "## null" in md
    bad = run_gate(FakeEngine(), FakeEngine(bias=0.2), SampledGateOptions(**FAKE_OPTS), cfgs)
    assert bad.verdict == "FAIL"
    assert {(c.position) for c in bad.comparisons[0].rejected} <= {1, 2}  # position 0 is untouched
    assert len(bad.comparisons[0].rejected) >= 3 and "Rejected cells" in report.render(bad)
    assert run_gate(FakeEngine(), FakeEngine(counters=(0, 0)), SampledGateOptions(**FAKE_OPTS), cfgs).verdict == \
        "NOT SPECULATING"
    blind = run_gate(FakeEngine(), FakeEngine(counters=None), SampledGateOptions(**FAKE_OPTS), cfgs)
    assert blind.verdict == "CANNOT TEST" and blind.missing == [NO_SPEC_EVIDENCE] and blind.exit_code == 3
    told = run_gate(FakeEngine(), FakeEngine(counters=None), SampledGateOptions(**FAKE_OPTS, assume_speculating=True),
                    cfgs)
    assert told.verdict == PASS_ASSERTED and told.exit_code == 0
    assert {x["verdict"] for x in configurations(told)} == {PASS_ASSERTED}
    assert "asserted by the user" in report.render(told)
    inc = run_gate(FakeEngine(), FakeEngine(fail_every=50), SampledGateOptions(**FAKE_OPTS), cfgs)
    assert inc.verdict == "INCOMPLETE" and inc.failed


def test_the_fit_test_sees_a_bias_below_every_cells_reach():
    """0.03 of the mass moved at two of three positions: no cell of the two-sample comparison rejects (min p 0.02 at
    1,000 samples per arm), the one-sample fit against the baseline's scores does (p 1e-4 at level 0.025), and the
    candidate FAILs. Scores that are not the engine's law fail the control: the fit is CANNOT TEST, never FAIL.
    No scores at all: the fit does not run and the comparison decides alone."""
    from specbench.suites.sampled import report
    from specbench.suites.sampled.gate import run_gate

    cfgs, opts = parse_configs("t=1"), SampledGateOptions(**dict(FAKE_OPTS, samples=1000))
    thin = run_gate(FakeEngine(scores=True), FakeEngine(bias=0.03, scores=True), opts, cfgs)
    fit = thin.fit["candidates"][""]
    assert not any(c.rejected for c in thin.comparisons) and thin.verdict == "FAIL", thin.summary()
    assert fit["verdict"] == "FAIL" and fit["p_value"] < fit["level"] and fit["positions"] == 6000
    assert not thin.fit["control"]["rejected"] and any(n.startswith("fit: FAIL") for n in thin.notes)
    assert 0 < fit["detectable_tv"]["toward"] < 0.05
    md = report.render(thin)
    assert "## Fit: every sample against the target's own law" in md and "| candidate | FAIL |" in md
    clean = run_gate(FakeEngine(scores=True), FakeEngine(scores=True), opts, cfgs)
    assert clean.verdict == "PASS" and clean.fit["candidates"][""]["verdict"] == "PASS"
    assert thin.summary()["fit"]["candidates"][""]["verdict"] == "FAIL"
    wrong = FakeEngine(scores=True)
    wrong.score_law = np.array([0.2, 0.4, 0.15, 0.1, 0.1, 0.05])
    blind = run_gate(wrong, FakeEngine(bias=0.03, scores=True), opts, cfgs)
    assert blind.fit["control"]["rejected"] and blind.fit["candidates"][""]["verdict"].startswith("CANNOT TEST")
    assert blind.verdict == "PASS" and any("the control failed" in n for n in blind.notes)
    pen = run_gate(FakeEngine(scores=True), FakeEngine(scores=True), opts, parse_configs("t=1;t=1,rp=1.2"))
    assert pen.fit["control"]["skipped"] == ["t1-rp1.2: penalties (the law depends on the history; raw scores do "
                                             "not give it)"]  # named once, not once per sample
    none = run_gate(FakeEngine(), FakeEngine(bias=0.03), opts, cfgs)
    assert none.verdict == "PASS" and none.fit["why"] and "Not run:" in report.render(none)


def test_seed_repeat_on_fakes():
    """With --seed-repeat-gate a candidate that ignores seeds fails (its law is right: any cell it rejects is chance),
    without it the check is advisory (noted); a baseline that ignores them
    leaves the check CANNOT TEST (noted, the gate's verdict unchanged); 0 turns it off."""
    from specbench.suites.sampled.gate import SeedRepeat, run_gate, seed_check

    cfgs = parse_configs("t=1")
    res = run_gate(FakeEngine(), FakeEngine(unseeded=True), SampledGateOptions(**FAKE_OPTS, seed_repeat_gate=True),
                   cfgs)
    chk = res.seed_repeat[""]
    assert res.verdict == "FAIL", res.summary()
    assert chk["verdict"] == "FAIL" and chk["baseline"]["differ"] == 0 and chk["candidate"]["compared"] == 128 + 64
    assert res.summary()["seed_repeat"][""]["candidate"][0] >= 100
    advisory = run_gate(FakeEngine(), FakeEngine(unseeded=True), SampledGateOptions(**FAKE_OPTS), cfgs)
    assert advisory.seed_repeat[""]["verdict"] == "FAIL" and not advisory.seed_repeat[""]["enforced"]
    assert any("advisory" in n for n in advisory.notes)
    assert advisory.verdict == ("FAIL" if any(c.rejected for c in advisory.comparisons) else "PASS")
    res = run_gate(FakeEngine(unseeded=True), FakeEngine(unseeded=True), SampledGateOptions(**FAKE_OPTS), cfgs)
    assert res.verdict == "PASS" and res.seed_repeat[""]["verdict"].startswith("CANNOT TEST")
    assert any("does not honour seeds" in n for n in res.notes)
    res = run_gate(FakeEngine(), FakeEngine(), SampledGateOptions(**FAKE_OPTS, seed_repeat=0), cfgs)
    assert res.verdict == "PASS" and res.seed_repeat == {}
    # the rule: significantly more differences than the baseline's; a few noisy repeats pass
    assert seed_check(SeedRepeat("b", 24, 0), SeedRepeat("c", 24, 2))["verdict"] == "PASS"
    assert seed_check(SeedRepeat("b", 24, 1), SeedRepeat("c", 24, 12))["verdict"] == "FAIL"
    assert seed_check(SeedRepeat("b", 0, 0), SeedRepeat("c", 24, 12))["verdict"].startswith("CANNOT TEST")


def test_several_candidates_share_the_baseline_each_its_own_bh_family():
    from specbench.suites.sampled import report, stats
    from specbench.suites.sampled.gate import configurations, run_gate

    cfgs = parse_configs("t=1;t=0.5")
    opts = SampledGateOptions(**FAKE_OPTS)
    res = run_gate(FakeEngine(), [FakeEngine(name="good", full=2), FakeEngine(bias=0.2, name="bad", full=2)], opts,
                   cfgs)
    assert res.verdict == "FAIL" and res.candidates == ["good", "bad"]
    assert res.candidate_verdicts == {"good": "PASS", "bad": "FAIL"}
    good, bad = res.comparisons  # no null run: one spec comparison per candidate, against the same baseline
    assert (good.label, bad.label, good.arms[0], bad.arms[0]) == ("spec:good", "spec:bad", "baseline", "baseline")
    assert not good.rejected and bad.rejected
    # each candidate its own BH family at q / 2: each cell's q-value is BH over its own candidate's cells, and a cell
    # is rejected when that is at most q / 2 (one candidate's cells never move another's threshold)
    for comp in res.comparisons:
        cells = [c for c in comp.cells if c.testable]
        adj = stats.bh_adjusted([c.p_value for c in cells])
        assert [c.q_value for c in cells] == pytest.approx(list(adj))
        assert [c.rejected for c in cells] == list(stats.benjamini_hochberg([c.p_value for c in cells], opts.q / 2))
    cells = [c for comp in res.comparisons for c in comp.cells if c.testable]
    assert len(cells) == 2 * 2 * 2 * 3 and all(math.isfinite(c.mde_all) or c.mde_all == math.inf for c in cells)
    assert res.summary()["family"]["q_per_candidate"] == pytest.approx(opts.q / 2)
    confs = {(x["candidate"], x["config"]): x for x in configurations(res)}
    assert confs[("good", "t1")]["verdict"] == "PASS" and confs[("good", "t1")]["bonus_rows"] == 2 * 400
    assert confs[("bad", "t1")]["verdict"] == "FAIL" and confs[("bad", "t1")]["rejected"] > 0
    md = report.render(res)
    assert "## Configurations" in md and "| bad | t1 |" in md and "## spec:bad: baseline vs candidate[bad]" in md
    assert set(res.engines) == {"baseline", "candidate:good", "candidate:bad"}
    with pytest.raises(SampledError, match="distinct names"):
        run_gate(FakeEngine(), [FakeEngine(name="x"), FakeEngine(name="x")], opts, cfgs)


def test_a_configuration_that_reached_neither_branch_is_not_a_pass():
    from specbench.suites.sampled import report
    from specbench.suites.sampled.gate import configuration_verdict, configurations, run_gate

    cfgs = parse_configs("t=1;t=0.5")
    opts = SampledGateOptions(**FAKE_OPTS)
    # no verify step at all at T = 0.5: neither a bonus row nor a rejection was tested there
    res = run_gate(FakeEngine(), FakeEngine(full=2, idle_temp=0.5), opts, cfgs)
    by = {x["config"]: x for x in configurations(res)}
    assert by["t1"]["verdict"] == "PASS" and by["t0.5"]["verdict"].startswith("CANNOT TEST")
    assert res.verdict == "CANNOT TEST" and any("configuration t0.5" in m for m in res.missing), res.missing
    assert res.exit_code == 3 and "CANNOT TEST (no verify step" in report.render(res)
    # a branch the configuration never reached is stated in its verdict, not hidden in a PASS
    full = run_gate(FakeEngine(), FakeEngine(full=10), opts, cfgs)  # every verify step fully accepted
    assert full.verdict == "PASS"
    assert {x["verdict"] for x in configurations(full)} == {"PASS (no rejection tested)"}
    assert configuration_verdict(4, 0, {"num_drafts": 5, "full_accepts": 0, "rejections": 5}) == \
        "PASS (no bonus row tested)"
    assert configuration_verdict(4, 0, {"num_drafts": 5, "full_accepts": None, "rejections": None}) == \
        "PASS (bonus rows and rejections not counted)"
    assert configuration_verdict(0, 0, None).startswith("CANNOT TEST")
    assert configuration_verdict(4, 1, None) == "FAIL"
    # without counters the candidate's other evidence decides: none is no pass, the user's word is said
    assert configuration_verdict(4, 0, None) == "CANNOT TEST (no evidence that the candidate speculated)"
    assert configuration_verdict(4, 0, None, "PASS") == "PASS (bonus rows and rejections not counted)"
    assert configuration_verdict(4, 0, None, PASS_ASSERTED) == PASS_ASSERTED


# ---- the gate on the tiny pair ---------------------------------------------------------------------
# The CI configuration (docs/sampled.md "Self-test"): the default configuration set's two candidates (the
# soft-q n-gram and the bundled DFlash drafter) on one echo and one repeat prompt, at the one default-set
# config that alone reaches every fault with both candidates (t=1.3,k=3), P = 4, 256 samples per arm; the
# clean run with its null run, then each fault armed on both candidates. One BH family per run at q = 0.05.
CI_OPTS = dict(num_prompts=1, positions=4, samples=256, permutations=999, prompt_chars=200, prompt_set="echo,repeat")
CI_CONFIGS = "t=1.3,k=3"
CI_CANDIDATES = (("ngram-soft", "ngram", float(SOFT_Q_MIX)), ("dflash", "dflash", 0.0))


def _candidate(tiny_pair, spec: str, fault: str | None = None, mix: float = 0.0, name: str | None = None):
    from specbench.harness.adapters.local import LocalAdapter

    target, draft = tiny_pair
    kw = {"faults": (fault,)} if fault else {}
    return LocalAdapter.from_dirs(target, draft=draft if spec == "dflash" else None, spec=spec, ngram_mix=mix,
                                  name=name or f"{spec}-{fault or 'clean'}", **kw)


@pytest.fixture(scope="module")
def selftest_ci(tiny_pair):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.sampled.selftest import FAULT_CASES, run_selftest

    base = LocalAdapter.from_dirs(tiny_pair[0], spec="off", name="baseline")
    opts, cfgs = SampledGateOptions(**CI_OPTS, null=True), parse_configs(CI_CONFIGS)
    cands = [_candidate(tiny_pair, spec, mix=mix, name=label) for label, spec, mix in CI_CANDIDATES]
    try:
        rows, results = run_selftest(base, cands, opts, cfgs, cases=("clean", *FAULT_CASES))
    finally:
        base.close()
    return {r["case"]: r for r in rows}, results


def test_gate_passes_clean_engines_with_null_run(selftest_ci):
    rows, results = selftest_ci
    res = results["clean"]
    assert res.verdict == "PASS", res.summary()
    assert [c.label for c in res.comparisons] == ["spec:ngram-soft", "null:ngram-soft", "spec:dflash", "null:dflash"]
    assert all(not c.rejected for c in res.comparisons)
    for lab in ("ngram-soft", "dflash"):
        s = res.spec_by_candidate[lab]
        assert s["num_drafts"] > 0 and s["mean_accept_len"] > 1.2, s  # the accept path was exercised
    # both branches reached by every configuration (the report states the counts)
    for conf in rows["clean"]["configurations"]:
        assert conf["verdict"] == "PASS" and conf["bonus_rows"] > 50 and conf["rejections"] > 50, conf


@pytest.mark.parametrize("fault", ["biased_accept", "resample_from_p", "reused_uniform", "q_next_row",
                                   "bonus_residual"])
def test_gate_catches_each_sampling_fault(selftest_ci, fault):
    rows, results = selftest_ci
    assert rows[fault]["verdict"] == "FAIL" and rows[fault]["ok"], rows[fault]
    assert any(c.rejected for c in results[fault].comparisons)


def test_the_fit_passes_the_clean_engines_and_fails_faults_that_change_the_law(selftest_ci):
    """The one-sample fit (every candidate token against the baseline's scores at its prefix) on the CI config
    (t=1.3, k=3): both clean candidates fit and so does the control; resample_from_p and biased_accept fail it in
    both candidates, biased_accept with tokens outside the top-3 support (exact evidence); the law-exact faults
    are the seed repeat's, not the fit's."""
    _, results = selftest_ci
    clean = results["clean"].fit
    assert not clean["control"]["rejected"] and clean["control"]["positions"] > 1500
    assert {lab: j["verdict"] for lab, j in clean["candidates"].items()} == {"ngram-soft": "PASS", "dflash": "PASS"}
    for fault in ("biased_accept", "resample_from_p"):
        fit = results[fault].fit["candidates"]
        assert all(j["verdict"] == "FAIL" for j in fit.values()), (fault, fit)
    assert all(j["counts"]["outside"] > 0 for j in results["biased_accept"].fit["candidates"].values())
    rows, _ = selftest_ci
    assert any(c["configuration"].startswith("fit") for c in rows["resample_from_p"]["caught_by"])


def test_unseeded_accept_is_caught_by_the_seed_repeat_alone(selftest_ci):
    """Uniforms from the process's generator leave the law exact (no cell needs to reject) but the seeded samples
    stop reproducing: the seed-repeat check fails the candidate; on the clean engines every repeat reproduced."""
    rows, results = selftest_ci
    assert rows["unseeded_accept"]["verdict"] == "FAIL" and rows["unseeded_accept"]["ok"]
    seeds = results["unseeded_accept"].seed_repeat
    assert {lab: chk["verdict"] for lab, chk in seeds.items()} == {"ngram-soft": "FAIL", "dflash": "FAIL"}
    assert all(chk["p_value"] < 1e-6 for chk in seeds.values()), seeds
    assert any("seed repeat" in c["configuration"] for c in rows["unseeded_accept"]["caught_by"])
    clean = results["clean"].seed_repeat
    assert all(chk["verdict"] == "PASS" and chk["candidate"]["differ"] == 0 == chk["baseline"]["differ"]
               and chk["candidate"]["compared"] == 128 + 64 and chk["candidate"]["neighbours"] == 64
               for chk in clean.values()), clean


def test_row_params_first_is_caught_by_the_mixed_repeat_alone(selftest_ci):
    """Every sampled verify row transformed with the first request's parameters: right whenever one config fills
    the batch, which every distribution batch does (CI_CONFIGS is one config), wrong in the seed repeat's batch,
    whose neighbours sample at another config."""
    rows, results = selftest_ci
    assert rows["row_params_first"]["verdict"] == "FAIL" and rows["row_params_first"]["ok"]
    seeds = results["row_params_first"].seed_repeat
    assert all(chk["verdict"] == "FAIL" for chk in seeds.values()), seeds


def test_bonus_residual_is_caught_at_the_bonus_position_of_the_repeat_prompt(selftest_ci):
    """The fault changes only the token drawn after a fully accepted run: on the repeat prompt (P = 4, the first
    verify has 2 drafts) that is position 3, for the DFlash drafter as for the soft-q n-gram."""
    _, results = selftest_ci
    hits = {(c.candidate, x.prompt.split("-")[-1], x.position) for c in results["bonus_residual"].comparisons
            for x in c.rejected}
    assert ("dflash", "repeat", 3) in hits and ("ngram-soft", "repeat", 3) in hits, hits
    assert all(pos >= 2 for _, _, pos in hits)  # positions 0-1 never come from a bonus row here


# ---- CLI -------------------------------------------------------------------------------------------
def _cli(args: list[str]):
    from typer.testing import CliRunner

    from specbench.cli.app import _register, app

    _register()
    return CliRunner().invoke(app, ["sampled", *args])


def test_cli_exit_codes(tiny_pair, tmp_path):
    target, draft = tiny_pair
    small = ["--num-prompts", "1", "--positions", "4", "--samples", "48", "--configs", "t=0.5", "--permutations", "99",
             "--results", str(tmp_path / "res")]
    base, cand = f"local:{target},spec=off", f"local:{target},draft={draft},spec=dflash"
    r = _cli(["--baseline", base, "--candidate", cand, *small, "--json", "--report", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    summ = json.loads(r.output.strip().splitlines()[-1])
    assert summ["verdict"] == "PASS" and summ["spec"]["num_drafts"] > 0
    assert "Sampled equivalence gate: PASS" in (tmp_path / "r.md").read_text()
    # the baseline as its own candidate never speculates: flagged, not passed
    r = _cli(["--baseline", base, "--candidate", base, *small])
    assert r.exit_code == 1 and "NOT SPECULATING" in r.output
    for bad in (["--configs", "t=0"], ["--candidate", "nope:x"], ["--positions", "0"], ["--q", "2"],
                ["--selftest", "--candidate", "openai:http://127.0.0.1:1"], ["--selftest", "--positions", "3"],
                ["--repeat", "2"], ["--prompt-set", "echo,nope"]):
        r = _cli(["--baseline", base, "--candidate", cand, *small, *bad])
        assert r.exit_code == 2, (bad, r.output)


def test_cli_default_configuration_set(tiny_pair, tmp_path):
    """No engine named: the bundled target spec off against the default candidates (soft-q n-gram, DFlash, DFlash2),
    and the summary states per configuration the bonus rows and rejections its generations reached."""
    r = _cli(["--num-prompts", "1", "--positions", "4", "--samples", "32", "--configs", "t=1.3,k=3",
              "--permutations", "99", "--json", "--no-record", "--report", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    summ = json.loads(r.output.strip().splitlines()[-1])
    assert summ["verdict"] == "PASS" and summ["candidates"] == ["ngram-soft", "dflash", "dflash2"]
    assert summ["num_prompts"] == 2  # one echo and one repeat prompt
    confs = summ["configurations"]
    assert [(c["candidate"], c["config"]) for c in confs] == [("ngram-soft", "t1.3-k3"), ("dflash", "t1.3-k3"),
                                                               ("dflash2", "t1.3-k3")]
    assert all(c["bonus_rows"] > 0 and c["rejections"] > 0 and c["verdict"] == "PASS" for c in confs), confs
    md = (tmp_path / "r.md").read_text()
    assert "## Configurations" in md and "| dflash | t1.3-k3 |" in md


# ---- the full-size self-test (slow) ----------------------------------------------------------------
@pytest.mark.slow
def test_selftest_full_size(tiny_pair, request):
    """`specbench sampled --selftest` as shipped (both default candidates, the default configs, 5 clean runs
    at q / 5 each, the null run with the first): about 10 minutes on 2 CPU cores."""
    if "slow" not in request.config.getoption("markexpr") or "not slow" in request.config.getoption("markexpr"):
        pytest.skip("slow: run with pytest -m slow")
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.sampled.selftest import (
        SELFTEST_CONFIGS,
        SELFTEST_OPTIONS,
        SELFTEST_REPEAT,
        run_selftest,
    )

    base = LocalAdapter.from_dirs(tiny_pair[0], spec="off", name="baseline")
    cands = [_candidate(tiny_pair, spec, mix=mix, name=label) for label, spec, mix in CI_CANDIDATES]
    try:
        rows, results = run_selftest(base, cands, SampledGateOptions(**SELFTEST_OPTIONS, null=True),
                                     parse_configs(SELFTEST_CONFIGS), repeat=SELFTEST_REPEAT)
    finally:
        base.close()
    assert all(r["ok"] for r in rows), rows
    assert len([r for r in rows if r["case"].startswith("clean")]) == SELFTEST_REPEAT
    assert not any(c.rejected for c in results["clean"].comparisons)


def test_default_candidates_run_where_the_baseline_runs():
    """The default configuration set's candidates take the baseline's placement (device, dtype, attention...):
    `--selftest --baseline local,spec=off,device=cuda` tests CUDA candidates, not CPU ones against a CUDA baseline."""
    from specbench.cli.sampled import _default_candidates
    from specbench.harness.engines import parse_engine

    cuda = _default_candidates(parse_engine("local,spec=off,device=cuda,dtype=bfloat16,attention=torch,num_pages=64"))
    assert [c.options["name"] for c in cuda] == ["ngram-soft", "dflash", "dflash2"]
    assert cuda[2].options["draft"].endswith("tiny-dflash2/draft") and cuda[1].options["draft"].endswith("tiny/draft")
    for c in cuda:
        assert {k: c.options[k] for k in ("device", "dtype", "attention", "num_pages")} == \
            {"device": "cuda", "dtype": "bfloat16", "attention": "torch", "num_pages": "64"}
        assert c.options["spec"] in ("ngram", "dflash") and "faults" not in c.options
    plain = _default_candidates(parse_engine("local,spec=off"))
    assert all("device" not in c.options for c in plain)


def test_selftest_progress_plans_what_it_runs(tiny_pair):
    """The self-test's progress plan counts every request it sends, the seed repeats of every run included (it
    counted samples only: 40,192 done of a 38,400 plan in the shipped self-test)."""
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.sampled.selftest import run_selftest

    class Recorder:
        planned = done = 0

        def plan(self, total: int) -> None:
            self.planned = total

        def phase(self, name: str, n: int | None) -> None:
            pass

        def advance(self, result: object = None, n: int = 1) -> None:
            self.done += n

    base = LocalAdapter.from_dirs(tiny_pair[0], spec="off", name="baseline")
    cand = _candidate(tiny_pair, "ngram", mix=float(SOFT_Q_MIX), name="ngram-soft")
    rec = Recorder()
    opts = SampledGateOptions(**{**CI_OPTS, "samples": 16, "permutations": 99, "prompt_set": "echo"}, seed_repeat=4)
    try:
        run_selftest(base, [cand], opts, parse_configs(CI_CONFIGS), cases=("clean", "unseeded_accept"), repeat=1,
                     progress=rec)
    finally:
        base.close()
    assert rec.planned == rec.done > 0, (rec.planned, rec.done)
