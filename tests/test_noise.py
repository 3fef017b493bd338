"""`lossless --suite noise` (suites/lossless/noise.py): reduction-order noise measured, speculation judged against it.

The statistics first (the regret-distribution test and its power rule, the regret sample), then the whole suite on
fake engines with crafted noise (lossless_fakes.FakeAdapter `swap`: a configuration whose logits trade its top two
tokens at chosen near-ties, flipping self-consistently): a candidate that flips as often and as little as the noise
PASSes with both tests powered; one that flips four times as often, or at larger (still benign) regrets, FAILs on
the rate or the regret distribution though every flip is within the margin; regrets above the margin pass only
where the noise showed them and a powered test backs it (else CANNOT TEST); zero noise leaves the verdict to the
regret rule; two configurations that differ beyond a tie FAIL the noise phase. Then the CLI on the bundled tiny
pair at emulated TP 2 (tests/test_noise_engine.py has the engine runs).
"""

from __future__ import annotations

import asyncio

import pytest
from lossless_fakes import FakeAdapter

from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS
from specbench.suites.lossless.greedy import GreedyGateOptions, run_greedy, tokenize_prompts
from specbench.suites.lossless.noise import (
    NoiseConfig,
    RegretSample,
    detectable_superiority,
    regret_test,
    render_markdown,
    run_noise,
    summary_markdown,
)
from specbench.suites.lossless.prompts import load_prompts


# ---- the statistics ---------------------------------------------------------------------------------------------
def test_detectable_superiority_shrinks_with_the_sample():
    # 0.5 + (z_0.99 + z_0.8) * sqrt((n1 + n2 + 1) / (12 n1 n2))
    assert detectable_superiority(20, 20, 0.01, 0.8) == pytest.approx(0.5 + 3.1679 * (41 / 4800) ** 0.5, abs=1e-3)
    sizes = [detectable_superiority(n, n) for n in (5, 10, 20, 40, 80)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1.0 and sizes[-1] < 0.7


def _spread(lo: float, hi: float, n: int) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def test_regret_test_pass_fail_cannot_test():
    noise = RegretSample("noise", _spread(0.001, 0.02, 30))
    same = regret_test(RegretSample("test", _spread(0.0012, 0.021, 30)), noise)
    assert same.verdict == PASS and same.p_value > 0.01 and same.detectable <= 0.8
    larger = regret_test(RegretSample("test", _spread(0.05, 0.18, 30)), noise)
    assert larger.verdict == FAIL and larger.p_value < 1e-6 and larger.superiority == 1.0
    # smaller regrets than the noise are no finding (one-sided)
    assert regret_test(RegretSample("test", _spread(0.0001, 0.0009, 30)), noise).verdict == PASS
    few = regret_test(RegretSample("test", [0.01, 0.012]), RegretSample("noise", [0.011, 0.013, 0.009]))
    assert few.verdict == CANNOT_TEST and "underpowered" in few.detail and few.missing
    # a significant excess FAILs at any size (evidence of a bug is a finding)
    small = regret_test(RegretSample("test", _spread(1.0, 2.0, 6)), RegretSample("noise", _spread(0.001, 0.002, 6)))
    assert small.verdict == FAIL
    none = regret_test(RegretSample("test"), noise)
    assert none.verdict == CANNOT_TEST and "no scored divergence" in none.detail and none.p_value is None


def test_regret_sample_quantiles_and_margins():
    s = RegretSample("x", [0.0, 0.001, 0.01, 0.1, 0.3])
    q = s.quantiles()
    assert q["q0.5"] == 0.01 and q["q1"] == 0.3
    margins = dict(s.at_margins((0.001, 0.2)))
    assert margins == {0.001: 2, 0.2: 4}
    assert s.above(0.2) == [0.3] and RegretSample("e").quantiles()["q0.5"] is None


# ---- the suite on fakes with crafted noise ---------------------------------------------------------------------
# Context lengths (the fake's positions) of near-ties: the noise flips at L % 16 == 0, a clean speculating engine at
# L % 16 == 8 (as often, as small), a rate fault at every L % 4 == 2, a size fault at L % 16 == 4 (gaps 0.10-0.19:
# each flip still within the 0.20 margin).
LENGTHS = range(0, 4000)


def _gaps(noise_gap: tuple[float, float] = (0.002, 0.012)) -> dict[int, float]:
    lo, hi = noise_gap
    out = {}
    for L in LENGTHS:
        i = (L // 16) % 11
        if L % 16 in (0, 8):
            out[L] = lo + (hi - lo) * i / 10
        elif L % 16 == 4:
            out[L] = 0.10 + 0.09 * i / 10
        elif L % 4 == 2:
            out[L] = 0.002 + 0.01 * i / 10
    return out


NOISE = frozenset(L for L in LENGTHS if L % 16 == 0)
CLEAN = frozenset(L for L in LENGTHS if L % 16 == 8)
RATE_FAULT = frozenset(L for L in LENGTHS if L % 4 == 2)
SIZE_FAULT = frozenset(L for L in LENGTHS if L % 16 == 4)


def _run(cand_swap, noise=NOISE, gaps=None, num_prompts=8, max_tokens=64, **kw):
    gaps = _gaps() if gaps is None else gaps
    ref = FakeAdapter(gaps, name="reference")
    base = FakeAdapter(gaps, swap=noise, name="baseline")
    cand = FakeAdapter(gaps, swap=noise | cand_swap, name="candidate")
    cfg = NoiseConfig(num_prompts=num_prompts, max_tokens=max_tokens, max_divergences=64, **kw)
    return asyncio.run(run_noise(ref, base, cand, cfg))


def test_clean_candidate_within_the_noise_passes_with_both_tests_powered():
    out = _run(CLEAN)
    assert out.verdict == PASS, out.reasons
    assert out.noise_rate.events >= 20 and out.test_rate.events >= 20
    assert out.rate.verdict == PASS and out.regret.verdict == PASS, (out.rate.detail, out.regret.detail)
    assert out.bound == pytest.approx(0.2) and out.rule["mode"] == "margin"
    assert "both tests powered" in out.reasons[-1]


def test_many_benign_flips_fail_on_the_rate():
    out = _run(RATE_FAULT)
    assert out.test.verdict == PASS  # every flip within the 0.20 margin: the regret rule alone passes it
    assert out.rate.verdict == FAIL and out.verdict == FAIL
    assert any(r.startswith("divergence rate: FAIL") for r in out.reasons)


def test_larger_benign_flips_fail_on_the_regret_distribution():
    out = _run(SIZE_FAULT)
    assert out.test.verdict == PASS and max(out.test_regrets.regrets) < 0.2
    assert out.rate.verdict == PASS  # as often as the noise
    assert out.regret.verdict == FAIL and out.verdict == FAIL
    assert any(r.startswith("regret distribution: FAIL") for r in out.reasons)


def test_regrets_above_the_margin_pass_only_within_measured_noise_with_power():
    """The noise itself flips at 0.25-0.35 nat (above the 0.20 margin): a clean candidate doing the same passes by
    the noise bound where both tests have power, is CANNOT TEST where they do not, and the plain gate cries wolf."""
    gaps = _gaps((0.25, 0.35))
    out = _run(CLEAN, gaps=gaps)
    assert out.bound == pytest.approx(0.35) and out.verdict == PASS, out.reasons
    assert out.test_regrets.above(0.2) and "within the measured noise" in out.reasons[-1]
    short = _run(CLEAN, gaps=gaps, num_prompts=2, max_tokens=24)
    assert short.verdict == CANNOT_TEST and any("power for the noise comparison" in m for m in short.missing)
    # the fixed tolerance alone fails the same clean candidate
    base, cand = FakeAdapter(gaps, swap=NOISE), FakeAdapter(gaps, swap=NOISE | CLEAN)

    async def plain():
        prompts, _ = await tokenize_prompts(base, cand, load_prompts("gsm8k", 8))
        return await run_greedy(base, cand, prompts, 64, GreedyGateOptions())

    assert asyncio.run(plain()).verdict == FAIL
    # flips beyond the largest noise regret still fail one by one
    big = {**gaps, **{L: 0.6 for L in CLEAN}}
    assert _run(CLEAN, gaps=big).test.verdict == FAIL


def test_zero_noise_leaves_the_verdict_to_the_regret_rule():
    quiet = _run(frozenset(), noise=frozenset())
    assert quiet.noise_rate.events == 0 and quiet.test_rate.events == 0 and quiet.verdict == PASS
    assert quiet.bound == pytest.approx(0.2) and "regret rule" in quiet.reasons[-1]
    # a flip the margin calls a real error fails with no noise to lean on
    gaps = {**_gaps(), **{L: 0.5 for L in CLEAN}}
    assert _run(CLEAN, noise=frozenset(), gaps=gaps).verdict == FAIL
    # many tiny flips against zero noise: the rate test
    assert _run(RATE_FAULT, noise=frozenset()).rate.verdict == FAIL


def test_noise_pair_that_differs_beyond_a_tie_fails():
    """A 'noise' configuration that picks a token the reference ranks outside its top-k is not reduction order."""
    gaps = _gaps()
    ref = FakeAdapter(gaps, name="reference")
    base = FakeAdapter(gaps, picks={L: 7 for L in range(0, 4000, 97)}, name="baseline")
    out = asyncio.run(run_noise(ref, base, FakeAdapter(gaps), NoiseConfig(num_prompts=4, max_tokens=64)))
    assert out.noise.verdict == FAIL and out.verdict == FAIL and out.test is None
    assert "not equal up to reduction order" in out.reasons[0]


def test_nothing_compared_is_cannot_test():
    class Mute(FakeAdapter):
        async def generate_one(self, req):
            r = await super().generate_one(req)
            r.output_ids, r.text = None, "words"
            return r

    gaps = _gaps()
    out = asyncio.run(run_noise(FakeAdapter(gaps), Mute(gaps), FakeAdapter(gaps), NoiseConfig(num_prompts=2)))
    assert out.verdict == CANNOT_TEST and out.missing and out.exit_code == 3 and out.test is None
    assert out.reasons[0].startswith("noise phase: CANNOT TEST") and "output token ids" in out.reasons[0]


def test_reports_render_the_distribution_and_the_tests():
    out = _run(SIZE_FAULT)
    md = render_markdown(out)
    for part in ("# Noise baseline: FAIL", "## How often", "## How large (regret, nat)", "## At which margins",
                 "Mann-Whitney", "| 0.2 |", "## noise: PASS", "## spec-on vs spec-off: PASS",
                 "smallest effect these samples see: a spec-on rate of"):
        assert part in md, part
    assert summary_markdown(out.to_dict())[0] == "# Noise baseline: FAIL"


def test_bad_config_is_refused_by_name():
    from specbench.suites.lossless.greedy import LosslessError

    with pytest.raises(LosslessError, match="--noise-concurrency"):
        NoiseConfig(noise_concurrency=0)
    with pytest.raises(LosslessError, match="--margin-tol and --strict"):
        NoiseConfig(margin_tol=0.1, strict=True)
    with pytest.raises(LosslessError, match="--rate-alpha"):
        NoiseConfig(alpha=1.5)
