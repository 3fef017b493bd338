"""The divergence-rate test (suites/lossless/rate.py) and the batch gates (batch.py) on synthetic inputs.

Pure statistics first (p-values, the critical count, the power rule, PASS / FAIL / CANNOT TEST), then the
batch-invariance machinery on a fake engine whose output depends on its batch: near-tie flips only when
more than one request is in flight (each benign, too many of them), a non-tie flip under batching, and a
batch-invariant engine.
"""

from __future__ import annotations

import asyncio

import pytest
from lossless_fakes import V, dist, top

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, PosLogprobs
from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS
from specbench.suites.lossless.batch import (
    BatchOptions,
    RateGateRun,
    compare_outputs,
    mixed_lengths,
    parse_levels,
    run_batch_invariance,
    run_rate_gate,
)
from specbench.suites.lossless.checks import AcceptanceEvidence
from specbench.suites.lossless.greedy import (
    Divergence,
    GateRun,
    GreedyGateOptions,
    LosslessError,
    Prompt,
    PromptCheck,
)
from specbench.suites.lossless.rate import RateSample, critical_count, p_value, rate_test, sample_from_checks
from specbench.suites.lossless.regret import judge_pick


# ---- the statistics ---------------------------------------------------------------------------------
def test_p_value_is_the_exact_conditional_binomial_tail():
    # no noise event, equal exposures: P(all x events fall in the test sample) = 0.5^x
    assert p_value(7, 1000, 0, 1000) == pytest.approx(0.5 ** 7)
    assert p_value(0, 1000, 3, 1000) == 1.0
    # 3 vs 1 in equal exposures: P(Bin(4, 1/2) >= 3) = 5/16
    assert p_value(3, 500, 1, 500) == pytest.approx(5 / 16)
    # the exposure ratio sets p0: 2 events, test twice the exposure: p0 = 2/3, P(X >= 2 | n = 2) = 4/9
    assert p_value(2, 2000, 0, 1000) == pytest.approx(4 / 9)
    with pytest.raises(ValueError):
        p_value(1, 0, 0, 10)


def test_critical_count():
    assert critical_count(2000, 0, 2000, 0.01) == 7  # 0.5^7 = 0.0078 <= 0.01 < 0.5^6
    assert critical_count(2000, 1, 2000, 0.01) == 10
    assert critical_count(5, 0, 5, 0.01) is None  # at most 5 events in 5 tokens: nothing could reject


def test_rate_test_pass_fail_cannot_test():
    noise = RateSample("noise", 2, 4000, 40)
    # the same rate, enough tokens: PASS with the p-value in the detail
    ok = rate_test(RateSample("test", 2, 4000, 40), noise)
    assert ok.verdict == PASS and ok.p_value is not None and ok.p_value > 0.01 and "p = " in ok.detail
    # many more flips than the noise, each maybe benign: FAIL
    bad = rate_test(RateSample("test", 15, 4000, 40), noise)
    assert bad.verdict == FAIL and bad.p_value < 0.01 and "more divergences" in bad.detail
    # too few tokens for a 5-per-1,000 excess to show: CANNOT TEST, never a pass
    few = rate_test(RateSample("test", 0, 300, 3), RateSample("noise", 0, 300, 3))
    assert few.verdict == CANNOT_TEST and few.missing and "underpowered" in few.detail
    # FAIL wins over the power rule: evidence of an excess is a finding even in a small sample
    assert rate_test(RateSample("test", 9, 300, 3), RateSample("noise", 0, 300, 3)).verdict == FAIL
    # nothing compared on either side
    assert rate_test(RateSample("test"), noise).verdict == CANNOT_TEST
    assert rate_test(RateSample("test", 1, 100), RateSample("noise")).missing == "compared tokens (the noise baseline)"


def test_power_rule_follows_the_noise_rate():
    # noise at 20 per 1,000: the test must see 2 x 20 = 40 per 1,000, not the 5 floor
    r = rate_test(RateSample("t", 20, 1000), RateSample("n", 20, 1000))
    assert r.detect_per_1k == pytest.approx(40.0) and r.verdict == PASS
    # ... and with 200 tokens a 40-per-1,000 excess (8 expected) cannot reach the critical count
    r = rate_test(RateSample("t", 4, 200), RateSample("n", 4, 200))
    assert r.verdict == CANNOT_TEST and r.x_crit is not None and r.expected_at_detect < r.x_crit
    with pytest.raises(ValueError):
        rate_test(RateSample("t", 1, 10), RateSample("n", 1, 10), alpha=0)


def test_rate_sample_ci_and_pooling():
    s = RateSample("a", 4, 2000, 10).add(RateSample("b", 0, 1000, 5))
    assert (s.events, s.exposure, s.comparisons) == (4, 3000, 15)
    lo, hi = s.ci_per_1k()
    assert 0 < lo < s.per_1k < hi
    assert RateSample("z", 0, 1000).ci_per_1k()[0] == 0.0


def _pc(status: str, compared: int, ndiv: int, reanchors: int = 0) -> PromptCheck:
    pc = PromptCheck("p", 5, 64, status=status, tokens_compared=compared, reanchors=reanchors)
    pc.divergences = [Divergence(i, "token", 1, 2, 0, judge_pick(1, {2: -0.1, 1: -0.15})) for i in range(ndiv)]
    return pc


def test_sample_from_checks_counts_compared_tokens_and_every_divergence():
    s = sample_from_checks([_pc("identical", 64, 0), _pc("flip", 64, 2, reanchors=2), _pc("flip", 11, 1),
                            _pc("error", 0, 0), _pc("untestable", 3, 1)], "greedy")
    assert (s.events, s.exposure, s.comparisons, s.skipped) == (3, 139, 5, 2)


def test_rate_gate_run_verdicts():
    ev = AcceptanceEvidence("none")

    def gate(test: RateSample, noise: RateSample) -> RateGateRun:
        from specbench.suites.lossless.batch import _rate_gate

        return _rate_gate("divergence-rate", test, noise, BatchOptions(), [], ev, [])

    assert gate(RateSample("t", 0, 3000), RateSample("n", 0, 3000)).verdict == PASS
    g = gate(RateSample("t", 12, 3000), RateSample("n", 0, 3000))
    assert g.verdict == FAIL and g.to_dict()["rate"]["p_value"] < 0.01
    g = gate(RateSample("t", 0, 100), RateSample("n", 0, 100))
    assert g.verdict == CANNOT_TEST and any("power" in m for m in g.missing)


def test_options():
    assert parse_levels("1, 8,32") == (1, 8, 32)
    for bad in ("", "1,x", "0,8"):
        with pytest.raises(LosslessError):
            parse_levels(bad)
    with pytest.raises(LosslessError):
        BatchOptions(alpha=1.5)
    assert BatchOptions(levels=(1, 8, 32)).others == [8, 32] and BatchOptions().prompts_needed == 32


def test_mixed_lengths():
    ps = [Prompt(f"q{i}", list(range(40))) for i in range(3)]
    out = mixed_lengths(ps, 8)
    assert len(out) == 8 and [len(p.ids) for p in out] == [40, 20, 10, 30, 40, 20, 10, 30]
    assert out[1].ids == list(range(20, 40))  # the tail is kept: the prompt still ends where it asks
    assert len({p.pid for p in out}) == 8


# ---- the batch gates on a fake engine ------------------------------------------------------------------
class BatchFake(EngineAdapter):
    """lossless_fakes' model; at the context lengths in `flip_at` it emits the runner-up, but only when the
    generate call had more than one request in flight (a batch-dependent numerical difference)."""

    kind = "fake"

    def __init__(self, gaps: dict[int, float] | None = None, flip_at: set[int] | None = None, name: str = "fake"):
        super().__init__(name)
        self.gaps, self.flip_at, self.batched = gaps or {}, flip_at or set(), False

    async def generate(self, requests, concurrency=None, on_result=None, offsets=None):
        self.batched = concurrency != 1 and len(requests) > 1
        try:
            return await super().generate(requests, concurrency, on_result, offsets)
        finally:
            self.batched = False

    async def generate_one(self, req: GenRequest) -> GenResult:
        ids = list(req.prompt)  # type: ignore[arg-type]
        n0, out, lps = len(ids), [], []
        while len(out) < req.max_tokens:
            d = dist(ids, self.gaps)
            best = max(d, key=lambda x: (d[x], -x))
            t = (best + 1) % V if self.batched and len(ids) in self.flip_at else best
            out.append(t)
            if req.logprobs is not None:
                lps.append(PosLogprobs(t, d[t], top(d, req.logprobs)))
            ids.append(t)
        return GenResult(rid=self._rid(req), ok=True, output_ids=out, finish_reason="length", prompt_tokens=n0,
                         completion_tokens=len(out), logprobs=lps if req.logprobs is not None else None)

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "version": "0", "model": None, "config": {}}


PROMPTS = [Prompt(f"q{i}", [i % V, (7 * i + 3) % V, (5 * i + 1) % V, 9, (i + 11) % V]) for i in range(40)]
OPTS = GreedyGateOptions()
FLIP_LEN = 5 + 10  # context length 15 = output position 10


def _bi(base: BatchFake, cand: BatchFake, n: int = 40, levels=(1, 8)) -> dict[str, GateRun]:
    gates = asyncio.run(run_batch_invariance(base, cand, PROMPTS[:n], 30, OPTS, BatchOptions(levels=levels)))
    return {g.name: g for g in gates}


def test_compare_outputs_judges_both_picks_under_the_engines_own_distribution():
    eng = BatchFake(gaps={FLIP_LEN: 0.05})
    p = PROMPTS[0]
    ref = asyncio.run(eng.generate([GenRequest(prompt=p.ids, max_tokens=30)], concurrency=1))[0]
    other = GenResult("x", True, output_ids=list(ref.output_ids[:10]) + [(ref.output_ids[10] + 1) % V] * 20)
    pc = asyncio.run(compare_outputs(eng, p, ref, other, 30, OPTS, 8))
    assert pc.status == "flip" and pc.tokens_compared == 11 and not pc.complete
    d = pc.divergences[0]
    assert d.position == 10 and d.judgement.ok and d.judgement.regret == pytest.approx(0.05)
    assert d.dist_source == "regenerated" and "c1 picked" in pc.reason
    # the same flip where the runner-up is 3 nat down: FAIL
    pc = asyncio.run(compare_outputs(BatchFake(), p, ref, other, 30, OPTS, 8))
    assert pc.status == "fail" and pc.divergences[0].judgement.regret == pytest.approx(3.0)
    # equal tokens, different lengths: a length mismatch is a FAIL; no ids: untestable
    short = GenResult("y", True, output_ids=list(ref.output_ids[:20]), finish_reason="stop")
    assert asyncio.run(compare_outputs(eng, p, ref, short, 30, OPTS, 8)).divergences[0].kind == "early_stop"
    none = GenResult("z", True, output_ids=None, text="abc")
    assert asyncio.run(compare_outputs(eng, p, ref, none, 30, OPTS, 8)).status == "untestable"


def test_batch_invariant_engine_passes():
    g = _bi(BatchFake(), BatchFake(), levels=(1, 8, 32))
    assert set(g) == {"batch c8 spec-off", "batch c32 spec-off", "batch c8 spec-on", "batch c32 spec-on", "batch-rate"}
    assert all(x.verdict == PASS for x in g.values()), {k: v.verdict for k, v in g.items()}
    assert g["batch-rate"].rate.test.exposure == 2 * 40 * 30  # pooled over c8 and c32


def test_many_benign_batch_flips_fail_the_rate_test_not_the_regret_rule():
    gaps = {FLIP_LEN: 0.02}  # a near-tie at position 10 of every prompt: each flip is benign
    g = _bi(BatchFake(gaps), BatchFake(gaps, flip_at={FLIP_LEN}))
    assert g["batch c8 spec-off"].verdict == PASS and g["batch c8 spec-on"].verdict == PASS
    assert all(p.status == "flip" for p in g["batch c8 spec-on"].prompts)
    r = g["batch-rate"]
    assert r.verdict == FAIL and r.rate.test.events == 40 and r.rate.noise.events == 0 and r.rate.p_value < 1e-10
    assert any(c.name == "divergence-rate" and not c.ok for c in r.checks)


def test_a_non_tie_batch_flip_fails_the_arm_it_happens_in():
    g = _bi(BatchFake(flip_at={FLIP_LEN}), BatchFake(), n=8)
    assert g["batch c8 spec-off"].verdict == FAIL and g["batch c8 spec-on"].verdict == PASS


def test_underpowered_batch_rate_is_cannot_test():
    g = _bi(BatchFake(), BatchFake(), n=4)  # 120 compared tokens per arm
    assert g["batch c8 spec-on"].verdict == PASS and g["batch-rate"].verdict == CANNOT_TEST


def test_rate_gate_measures_noise_on_the_same_prompts():
    base = BatchFake()
    greedy = GateRun("greedy", [_pc("flip", 30, 1) for _ in range(12)] + [_pc("identical", 30, 0) for _ in range(28)],
                     AcceptanceEvidence("none"))
    g = asyncio.run(run_rate_gate(base, PROMPTS, 30, OPTS, BatchOptions(levels=(1, 8, 32)), [greedy]))
    assert g.verdict == FAIL and g.rate.test.events == 12 and g.rate.test.exposure == 1200
    assert g.rate.noise.exposure == 2 * 40 * 30  # c8 and c32 against c1, no divergence
    assert len(g.prompts) == 80 and all(p.status == "identical" for p in g.prompts)
    # only 8 prompts: c8 and c32 are the same batch, measured once
    g = asyncio.run(run_rate_gate(base, PROMPTS[:8], 30, OPTS, BatchOptions(levels=(1, 8, 32)), [greedy]))
    assert g.rate.noise.exposure == 8 * 30
