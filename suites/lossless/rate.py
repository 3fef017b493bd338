"""The divergence-rate test: more divergences than the engine's own noise, even if each one is a tie?

The regret rule judges one divergence at a time; a bug that only ever makes tiny flips (a verify path whose
logits are off by a few hundredths of a nat, an acceptance rule with a tolerance) passes it every time.
This test counts them instead and holds the count against a measured noise baseline: the same engine,
speculation off, compared with itself under a changed batch composition (same prompts, another
concurrency and order). Pure functions, no engine, no I/O.

Definitions (docs/lossless.md, "The statistics of each rule"):
- A comparison is one output checked token by token against a reference that saw the same prefix. It ends
  at its first divergence: after it the two continuations differ and say nothing about each other. Its
  exposure is the number of tokens compared, up to and including that first divergence (the whole
  shorter output when there is none). A re-anchored continuation of the greedy gate (a fresh baseline
  from prompt + the candidate's tokens up to the flip) is a comparison of its own, so a greedy prompt
  contributes `tokens_compared` tokens and one event per divergence.
- rate = events / exposure, reported per 1,000 compared tokens.

Model: divergences occur at a constant per-token hazard lambda, so a sample's count is Poisson(lambda x
exposure) (events / exposure is the maximum-likelihood estimate of lambda with the censored comparisons
included).

Test (one-sided, exact, conditional; Przyborowski & Wilenski 1940): H0 lambda_test <= lambda_noise
against H1 lambda_test > lambda_noise. Given n = x_test + x_noise events in all, x_test is
Binomial(n, p0) with p0 = e_test / (e_test + e_noise) at the boundary lambda_test = lambda_noise; the
p-value is P(X >= x_test) (`scipy.stats.binomtest(..., alternative="greater")`). FAIL when p <= alpha
(default 0.01). The test never needs a large-sample approximation and holds its level at any size; it is
conservative (discrete).

Power rule (CANNOT TEST): x_crit is the smallest x_test that would give p <= alpha with this noise sample
(x_noise events in e_noise tokens) and this test exposure. The test is powered when a candidate whose
rate is `detect` = max(floor, 2 x the observed noise rate) (floor: 5 per 1,000 tokens by default) would
be expected to show at least x_crit divergences here: e_test x detect >= x_crit, i.e. at least about even
odds of catching an excess of that size. Otherwise, or when either sample compared no token, the verdict
is CANNOT TEST, with the numbers that say how much more to compare.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS

ALPHA = 0.01
DETECT_PER_1K = 5.0  # the floor of the rate excess the test must be able to see (per 1,000 tokens)
NOISE_FACTOR = 2.0  # ... and at least this multiple of the observed noise rate


@dataclass
class RateSample:
    """Divergence events over compared tokens (see the module docstring for the definitions)."""

    label: str
    events: int = 0
    exposure: int = 0  # compared tokens
    comparisons: int = 0  # outputs (and re-anchored continuations) compared
    skipped: int = 0  # outputs that could not be compared (errors, untestable)
    sources: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float | None:
        return self.events / self.exposure if self.exposure else None

    @property
    def per_1k(self) -> float | None:
        r = self.rate
        return None if r is None else 1000.0 * r

    def ci_per_1k(self, level: float = 0.95) -> tuple[float, float] | None:
        """Exact (Garwood) two-sided Poisson interval of the rate, per 1,000 tokens."""
        if not self.exposure:
            return None
        from scipy.stats import chi2

        a = 1.0 - level
        lo = 0.0 if self.events == 0 else chi2.ppf(a / 2, 2 * self.events) / 2
        hi = chi2.ppf(1 - a / 2, 2 * self.events + 2) / 2
        return 1000.0 * lo / self.exposure, 1000.0 * hi / self.exposure

    def add(self, other: RateSample) -> RateSample:
        return RateSample(self.label, self.events + other.events, self.exposure + other.exposure,
                          self.comparisons + other.comparisons, self.skipped + other.skipped,
                          self.sources + [s for s in other.sources if s not in self.sources])

    def describe(self) -> str:
        if not self.exposure:
            return f"{self.label}: no token compared"
        ci = self.ci_per_1k()
        assert ci is not None
        return (f"{self.label}: {self.events} divergence(s) in {self.exposure} compared tokens "
                f"({self.per_1k:.2f} per 1,000; 95% CI {ci[0]:.2f}-{ci[1]:.2f}; {self.comparisons} comparisons)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(rate_per_1k=self.per_1k, ci95_per_1k=self.ci_per_1k())
        return d


def sample_from_checks(checks: Iterable, label: str, source: str = "") -> RateSample:
    """A sample from PromptChecks (greedy.py): every divergence is an event, `tokens_compared` the exposure
    (re-anchored continuations included: each is a comparison of its own). Errors and untestable prompts
    are skipped (counted in `skipped`)."""
    s = RateSample(label, sources=[source] if source else [])
    for p in checks:
        if p.status in ("error", "untestable"):
            s.skipped += 1
            continue
        s.events += len(p.divergences)
        s.exposure += int(p.tokens_compared)
        s.comparisons += 1 + int(getattr(p, "reanchors", 0))
    return s


def p_value(x_test: int, e_test: int, x_noise: int, e_noise: int) -> float:
    """One-sided exact conditional p-value of H0 rate_test <= rate_noise (module docstring)."""
    if e_test <= 0 or e_noise <= 0:
        raise ValueError("both samples need a positive exposure")
    n = x_test + x_noise
    if n == 0 or x_test == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(x_test, n, e_test / (e_test + e_noise), alternative="greater").pvalue)


def critical_count(e_test: int, x_noise: int, e_noise: int, alpha: float = ALPHA, limit: int | None = None) -> int | None:
    """The smallest x_test with p <= alpha (None if none up to `limit`, default the test exposure)."""
    top = e_test if limit is None else limit
    lo, hi = 1, max(1, top)
    if p_value(hi, e_test, x_noise, e_noise) > alpha:
        return None
    while lo < hi:  # the p-value falls as x_test grows (x_noise fixed)
        mid = (lo + hi) // 2
        if p_value(mid, e_test, x_noise, e_noise) <= alpha:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class RateTest:
    """The verdict of one test sample against one noise sample."""

    test: RateSample
    noise: RateSample
    alpha: float
    detect_per_1k: float  # the rate the power rule asks the test to see (per 1,000)
    verdict: str
    p_value: float | None = None
    x_crit: int | None = None
    expected_at_detect: float | None = None
    detail: str = ""
    missing: str | None = None

    @property
    def ratio(self) -> float | None:
        a, b = self.test.rate, self.noise.rate
        if a is None or b is None:
            return None
        return math.inf if b == 0 and a > 0 else (a / b if b else None)

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "p_value": self.p_value, "alpha": self.alpha,
                "detect_per_1k": self.detect_per_1k, "x_crit": self.x_crit,
                "expected_at_detect": self.expected_at_detect, "detail": self.detail, "missing": self.missing,
                "test": self.test.to_dict(), "noise": self.noise.to_dict()}


def rate_test(test: RateSample, noise: RateSample, alpha: float = ALPHA,
              detect_per_1k: float = DETECT_PER_1K, noise_what: str = "the engine's own batch noise") -> RateTest:
    """PASS / FAIL / CANNOT TEST of `test` against `noise` (module docstring: the test and the power rule);
    `noise_what` names the noise in the FAIL's detail."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} is invalid: expected 0 < alpha < 1")
    if not detect_per_1k > 0:
        raise ValueError(f"detect_per_1k={detect_per_1k!r} is invalid: expected > 0")
    nr = noise.per_1k or 0.0
    detect = max(detect_per_1k, NOISE_FACTOR * nr)
    if not test.exposure or not noise.exposure:
        which = "the test sample" if not test.exposure else "the noise baseline"
        return RateTest(test, noise, alpha, detect, CANNOT_TEST, detail=f"{which} compared no token",
                        missing=f"compared tokens ({which})")
    p = p_value(test.events, test.exposure, noise.events, noise.exposure)
    xc = critical_count(test.exposure, noise.events, noise.exposure, alpha)
    expected = test.exposure * detect / 1000.0
    head = (f"{test.per_1k:.2f} vs {nr:.2f} divergences per 1,000 tokens ({test.events}/{test.exposure} vs "
            f"{noise.events}/{noise.exposure}); one-sided exact conditional binomial test p = {p:.3g}")
    out = RateTest(test, noise, alpha, detect, PASS, p, xc, expected)
    if p <= alpha:
        out.verdict = FAIL
        out.detail = head + f" <= alpha {alpha:g}: more divergences than {noise_what}"
        return out
    if xc is None or expected < xc:
        need = "no count" if xc is None else f"{xc} divergences"
        out.verdict = CANNOT_TEST
        out.missing = "compared tokens for the divergence-rate test to have power"
        out.detail = (head + f"; underpowered: a rate of {detect:.1f} per 1,000 would show {expected:.1f} "
                      f"divergences in {test.exposure} tokens, and {need} would be needed for p <= {alpha:g}: "
                      "compare more tokens (more prompts or a larger --max-tokens)")
        return out
    out.detail = head + f" > alpha {alpha:g} (a rate of {detect:.1f} per 1,000 would show {expected:.1f}; {xc} reject)"
    return out
