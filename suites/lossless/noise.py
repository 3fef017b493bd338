"""Reduction-order noise as a measured baseline, and speculation judged against it (`lossless --suite noise`).

Greedy output of a correct engine changes with the order its sums are reduced in: the tensor-parallel degree
(the all-reduce), the batch, the attention backend. A gate calibrated on one configuration cries wolf on another
or is loosened until it misses bugs. This suite measures the noise first, then judges speculation against it.

Contract (docs/noise.md):
- Three arms. `reference` and `baseline` run speculation off in two configurations that should agree up to
  reduction order (TP 1 and TP 2, `local:PAIR` and `local:PAIR,tp_emulate=2`; one engine at two batch sizes with
  `noise_concurrency`; two attention backends); `candidate` runs speculation on in the baseline's configuration.
- Noise phase ("noise"): the greedy gate (greedy.run_greedy: the same token ids, re-anchoring after every flip)
  with the reference as the judge and the baseline as the subject (at `noise_concurrency` requests in flight, the
  reference one at a time). Every divergence is scored by the regret rule (regret.py) under the reference's
  top-k at the ceiling `max_noise_regret` (NOISE_CEILING, 1 nat: the pick at most e^-1 of the top token's
  probability), not at the gate's tolerance, so the whole distribution of near-tie flips is measured. A regret
  above the ceiling, a pick outside the top-k, a length mismatch or a failed request FAILs the noise phase: two
  configurations that differ by more than a near-tie are not equal up to reduction order, and the verdict says so.
- The bound: a test divergence is judged by the regret rule at max(the gate's tolerance, the largest regret of
  the noise phase): regrets the noise baseline showed without speculation are not held against speculation.
  The gate's tolerance is greedy.resolve_rule's (strict in fp32 unless a margin is typed, else the margin).
- Test phase ("spec-on vs spec-off"): the greedy gate, baseline vs candidate at `concurrency`, at the bound
  (re-scoring as configured); its verdict is the greedy gate's own (a regret above the bound, a pick outside the
  top-k, a length mismatch, a failed run check, NOT SPECULATING, CANNOT TEST for want of evidence).
- The comparison with the noise: the divergence rate (rate.py: `sample_from_checks`, `rate_test`, the one-sided
  exact conditional binomial test with its power rule) and the regret distribution (`regret_test`: one-sided
  Mann-Whitney U, scipy.stats.mannwhitneyu, H1 spec-on regrets stochastically larger; its power rule: the
  smallest probability of superiority P(test regret > noise regret) detectable with `power` at `alpha`, normal
  approximation, must be at most DETECT_SUPERIORITY, else it is underpowered). Either test significant FAILs.
- Verdict (harness/verdicts.combine of the parts): FAIL if the noise phase or the test phase fails, or either
  test is significant; NOT SPECULATING from the test phase; CANNOT TEST where the noise phase compared nothing
  or could not collect its evidence, where the test phase could not, or where a spec-on divergence above the
  gate's tolerance passes only by the noise bound and a test lacks the power to back it; else the test
  phase's PASS. Where no spec-on divergence leans on the noise bound, an underpowered test leaves the verdict to
  the regret rule at the gate's tolerance (the plain greedy gate's rule); the reasons say which decided.
  Zero noise divergences is a valid baseline: the bound is then the gate's tolerance.
- Records (a results `Run`): "noise" (one per noise-phase prompt) and "checks" (one per test-phase prompt) as
  they are judged, "gates" (each phase without its prompts); `NoiseOutcome.to_dict()` is the run's summary and
  `summary_markdown` renders it (the --report file and `specbench report RUN`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specbench.harness.adapters.base import EngineAdapter, refuse_synthetic
from specbench.harness.verdicts import (
    CANNOT_TEST,
    FAIL,
    PASS,
    CannotTest,
    combine,
    exit_code,
    is_cannot_test,
    is_pass,
)

from .greedy import (
    GateRun,
    GreedyGateOptions,
    LosslessError,
    PromptCheck,
    resolve_rule,
    run_greedy,
    tokenize_prompts,
)
from .prompts import load_prompts
from .rate import ALPHA, DETECT_PER_1K, RateSample, RateTest, rate_test, sample_from_checks
from .regret import FAIL_OUTSIDE, MARGIN_TOL, STRICT_FP32_TOL, TOP_K, within_tol

SUITE = "lossless-noise"
SUITE_VERSION = "1"
# The noise phase's tolerance: a flip costing more than this is no near-tie a reduction order could make (the pick at
# most e^-1 = 37% of the top token's probability); below it every divergence re-anchors and is measured, and each is
# classified against the gate's tolerance after. Reduction-order flips measured so far stay below 0.05 nat (docs/noise.md).
NOISE_CEILING = 1.0
MARGINS = (1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)  # nat: how many divergences each margin would call benign
QUANTILES = (0.5, 0.9, 0.99, 1.0)
POWER = 0.8  # the regret test's power at its minimum detectable effect
DETECT_SUPERIORITY = 0.8  # the regret test is powered when it sees P(test > noise) = 0.8 with POWER at alpha


@dataclass(frozen=True)
class NoiseConfig:
    dataset: str = "gsm8k"
    num_prompts: int = 8
    max_tokens: int = 64
    max_divergences: int = 8
    rescore: bool = True
    concurrency: int = 1  # candidate requests in flight in the test phase
    noise_concurrency: int | None = None  # the baseline's in the noise phase (None: `concurrency`)
    margin_tol: float | None = None  # None: not typed (MARGIN_TOL, or strict mode where both engines run fp32)
    strict: bool | None = None
    strict_tol: float = STRICT_FP32_TOL
    alpha: float = ALPHA
    detect_per_1k: float = DETECT_PER_1K
    power: float = POWER
    max_noise_regret: float = NOISE_CEILING
    top_k: int = TOP_K
    max_prompt_chars: int = 1000
    min_accept_len: float = 1.05
    assume_speculating: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("num_prompts", 1), ("max_tokens", 1), ("max_divergences", 1), ("concurrency", 1),
                         ("top_k", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise LosslessError(f"{name}={v!r} is invalid: expected an integer >= {lo}")
        if self.noise_concurrency is not None and self.noise_concurrency < 1:
            raise LosslessError(f"--noise-concurrency {self.noise_concurrency!r} is invalid: expected an integer >= 1")
        if not 0 < self.alpha < 1:
            raise LosslessError(f"--rate-alpha {self.alpha!r} is invalid: expected 0 < alpha < 1")
        if not self.detect_per_1k > 0:
            raise LosslessError(f"--rate-detect {self.detect_per_1k!r} is invalid: expected > 0 per 1,000 tokens")
        if not (math.isfinite(self.max_noise_regret) and self.max_noise_regret > 0):
            raise LosslessError(f"--noise-max-regret {self.max_noise_regret!r} is invalid: expected a number of nats > 0")
        if not 0 < self.power < 1:
            raise LosslessError(f"power={self.power!r} is invalid: expected 0 < power < 1")
        if self.margin_tol is not None and self.strict:
            raise LosslessError("--margin-tol and --strict exclude each other: strict mode judges by --strict-tol")

    @property
    def gate_options(self) -> GreedyGateOptions:
        return GreedyGateOptions(margin_tol=MARGIN_TOL if self.margin_tol is None else self.margin_tol,
                                 top_k=self.top_k, max_divergences=self.max_divergences, rescore=self.rescore,
                                 min_accept_len=self.min_accept_len, strict=self.strict, strict_tol=self.strict_tol,
                                 margin_given=self.margin_tol is not None,
                                 assume_speculating=self.assume_speculating)


# ---- the regret distribution -----------------------------------------------------------------------------------
@dataclass
class RegretSample:
    """The regrets of one phase's divergences (the prompts `rate.sample_from_checks` counts: errors and untestable
    prompts left out). `regrets`: every scored divergence, exact, or the lower bound of a pick outside the top-k
    (`outside` of them); `unscored`: divergences with no regret (a length mismatch, no distribution there)."""

    label: str
    regrets: list[float] = field(default_factory=list)
    outside: int = 0
    unscored: int = 0

    @property
    def n(self) -> int:
        return len(self.regrets)

    def quantiles(self) -> dict[str, float | None]:
        """The regret quantiles (QUANTILES; 'q1' is the largest), None where there is no divergence."""
        import numpy as np

        vals = np.asarray(self.regrets, dtype=float)
        return {f"q{q:g}": (float(np.quantile(vals, q)) if vals.size else None) for q in QUANTILES}

    def at_margins(self, margins: Sequence[float] = MARGINS) -> list[tuple[float, int]]:
        """(margin, how many regrets the regret rule would call benign at that margin)."""
        return [(m, sum(within_tol(r, m) for r in self.regrets)) for m in margins]

    def above(self, tol: float) -> list[float]:
        return sorted(r for r in self.regrets if not within_tol(r, tol))

    @property
    def largest(self) -> float | None:
        return max(self.regrets) if self.regrets else None

    def describe(self) -> str:
        if not self.regrets:
            return f"{self.label}: no scored divergence" + (f" ({self.unscored} unscored)" if self.unscored else "")
        q = self.quantiles()
        return (f"{self.label}: {self.n} scored divergence(s), regret median {q['q0.5']:.3g}, p90 {q['q0.9']:.3g}, "
                f"max {q['q1']:.3g} nat" + (f"; {self.outside} outside the top-k (lower bounds)" if self.outside else "")
                + (f"; {self.unscored} unscored" if self.unscored else ""))

    def to_dict(self) -> dict:
        return {"label": self.label, "n": self.n, "regrets": list(self.regrets), "outside": self.outside,
                "unscored": self.unscored, "quantiles": self.quantiles(),
                "at_margins": [list(x) for x in self.at_margins()]}


def regret_sample(checks: Iterable[PromptCheck], label: str) -> RegretSample:
    s = RegretSample(label)
    for p in checks:
        if p.status in ("error", "untestable"):
            continue
        for d in p.divergences:
            j = d.judgement
            v = j.regret_or_bound if j is not None else None
            if v is None:
                s.unscored += 1
                continue
            s.regrets.append(float(v))
            s.outside += j is not None and j.kind == FAIL_OUTSIDE
    return s


@dataclass
class RegretTest:
    """One-sided Mann-Whitney U of the test regrets against the noise regrets (module docstring)."""

    verdict: str
    n_test: int
    n_noise: int
    alpha: float
    power: float
    p_value: float | None = None
    superiority: float | None = None  # observed P(test > noise) + P(=) / 2 = U / (n_test x n_noise)
    detectable: float | None = None  # the smallest superiority seen with `power` at `alpha` at these sizes
    detail: str = ""
    missing: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def detectable_superiority(n_test: int, n_noise: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The probability of superiority a one-sided Mann-Whitney U test at `alpha` detects with `power` (normal
    approximation: 0.5 + (z_(1-alpha) + z_power) x sqrt((n1 + n2 + 1) / (12 n1 n2)); above 1: no shift would be)."""
    from scipy.stats import norm

    se = math.sqrt((n_test + n_noise + 1) / (12.0 * n_test * n_noise))
    return 0.5 + float(norm.ppf(1 - alpha) + norm.ppf(power)) * se


def regret_test(test: RegretSample, noise: RegretSample, alpha: float = ALPHA, power: float = POWER,
                detect: float = DETECT_SUPERIORITY) -> RegretTest:
    """PASS / FAIL / CANNOT TEST: are the test regrets larger than the noise regrets (module docstring)?"""
    out = RegretTest(CANNOT_TEST, test.n, noise.n, alpha, power)
    if not test.n or not noise.n:
        which = "the test phase" if not test.n else "the noise baseline"
        out.detail = f"{which} has no scored divergence: no regret distribution to compare"
        out.missing = f"divergences to compare regret distributions ({which})"
        return out
    from scipy.stats import mannwhitneyu

    res = mannwhitneyu(test.regrets, noise.regrets, alternative="greater", method="auto")
    out.p_value = float(res.pvalue)
    out.superiority = float(res.statistic) / (test.n * noise.n)
    out.detectable = detectable_superiority(test.n, noise.n, alpha, power)
    head = (f"regrets {test.n} spec-on vs {noise.n} noise; P(spec-on regret > noise regret) = {out.superiority:.2f}; "
            f"one-sided Mann-Whitney U p = {out.p_value:.3g}")
    if out.p_value <= alpha:
        out.verdict, out.detail = FAIL, head + f" <= alpha {alpha:g}: spec-on flips cost more than the noise's"
    elif out.detectable > detect:
        out.missing = "divergences for the regret-distribution test to have power"
        out.detail = (head + f"; underpowered: at these sizes only P(test > noise) >= {min(out.detectable, 1):.2f} "
                      f"would be seen with power {power:g} at alpha {alpha:g} (needs <= {detect:g})")
    else:
        out.verdict = PASS
        out.detail = head + f" > alpha {alpha:g} (P(test > noise) >= {out.detectable:.2f} would be seen with power {power:g})"
    return out


# ---- the outcome -----------------------------------------------------------------------------------------------
@dataclass
class NoiseOutcome:
    engines: dict
    config: dict
    rule: dict = field(default_factory=dict)  # the gate's tolerance (GreedyGateOptions.rule_dict)
    bound: float | None = None  # the test phase's tolerance: max(the gate's, the largest noise regret)
    noise: GateRun | None = None
    test: GateRun | None = None
    noise_rate: RateSample | None = None
    test_rate: RateSample | None = None
    noise_regrets: RegretSample | None = None
    test_regrets: RegretSample | None = None
    rate: RateTest | None = None
    regret: RegretTest | None = None
    verdict: str = CANNOT_TEST
    reasons: list[str] = field(default_factory=list)  # what decided the verdict, one line each
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    run_id: str | None = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict:
        def gate(g: GateRun | None) -> dict | None:
            if g is None:
                return None
            d = g.to_dict()
            d.pop("prompts")
            return d

        return {"suite": SUITE, "verdict": self.verdict, "reasons": list(self.reasons), "missing": list(self.missing),
                "rule": dict(self.rule), "bound": self.bound, "engines": self.engines, "config": self.config,
                "noise_rate": self.noise_rate.to_dict() if self.noise_rate else None,
                "test_rate": self.test_rate.to_dict() if self.test_rate else None,
                "noise_regrets": self.noise_regrets.to_dict() if self.noise_regrets else None,
                "test_regrets": self.test_regrets.to_dict() if self.test_regrets else None,
                "rate": self.rate.to_dict() if self.rate else None,
                "regret": self.regret.to_dict() if self.regret else None,
                "noise": gate(self.noise), "test": gate(self.test), "notes": list(self.notes),
                "wall_s": self.wall_s, "run_id": self.run_id}


def judge(out: NoiseOutcome, tol: float) -> None:
    """The verdict from the phases and the two tests (module docstring); `out.reasons` say what decided it."""
    parts: list[str] = []
    reasons, missing = out.reasons, out.missing
    n = out.noise
    if n is not None:
        nv = n.verdict
        parts.append(nv)
        if nv == FAIL:
            first = next((p.reason for p in n.prompts if not p.ok and not p.untestable), "") or \
                "; ".join(c.detail for c in n.failed_checks)
            reasons.append("noise phase FAIL: the two spec-off configurations disagree by more than a near-tie (a "
                           "regret above --noise-max-regret, a pick outside the reference's top-k, a length mismatch "
                           f"or a failed request; first: {first}): they are not equal up to reduction order, so they "
                           "are no noise baseline")
        elif is_cannot_test(nv):
            reasons.append(f"noise phase: {nv} ({'; '.join(n.missing)}): no noise baseline, so nothing to judge "
                           "speculation against")
            missing += [f"noise phase: {m}" for m in n.missing]
    t = out.test
    if t is not None:
        parts.append(t.verdict)
        if is_cannot_test(t.verdict):
            reasons.append(f"spec-on vs spec-off: {t.verdict} ({'; '.join(t.missing)})")
            missing += [f"test phase: {m}" for m in t.missing]
        elif t.verdict != PASS:
            bad = [p for p in t.prompts if not p.ok and not p.untestable]
            why = (f"{len(bad)} of {len(t.prompts)} prompts; first: {bad[0].pid}: {bad[0].reason}" if bad else
                   "; ".join(f"{c.name}: {c.detail}" for c in t.failed_checks) or t.stats.describe())
            reasons.append(f"spec-on vs spec-off: {t.verdict} ({why})")
    for name, test in (("divergence rate", out.rate), ("regret distribution", out.regret)):
        if test is not None and test.verdict == FAIL:
            parts.append(FAIL)
            reasons.append(f"{name}: FAIL: {test.detail}")
    leaning = out.test_regrets.above(tol) if out.test_regrets is not None else []
    unpowered = [name for name, test in (("divergence rate", out.rate), ("regret distribution", out.regret))
                 if test is None or test.verdict != PASS]
    if leaning and unpowered and FAIL not in parts:
        parts.append(CANNOT_TEST)
        what = (f"{len(leaning)} spec-on divergence(s) cost more than the gate's tolerance {tol:g} nat (up to "
                f"{max(leaning):.3g}) and pass only by the noise bound {out.bound:.3g}; the "
                f"{' and '.join(unpowered)} test(s) cannot back it: compare more tokens (--num-prompts, --max-tokens)")
        reasons.append(f"{CANNOT_TEST}: " + what)
        missing.append("power for the noise comparison (" + ", ".join(unpowered) + ")")
    out.verdict = combine(parts) if parts else CANNOT_TEST
    if is_pass(out.verdict):
        if leaning:
            reasons.append(f"{PASS}: {len(leaning)} spec-on divergence(s) above the gate's tolerance are within the "
                           f"measured noise, and both tests found no excess with power")
        elif unpowered:
            reasons.append(f"{PASS} by the regret rule at the gate's tolerance {tol:g} nat (every spec-on divergence "
                           f"within it); the {' and '.join(unpowered)} test(s) had no power here and decided nothing")
        else:
            reasons.append(f"{PASS}: every spec-on divergence within the gate's tolerance, and neither the rate nor the "
                           "regret distribution exceeds the measured noise (both tests powered)")


async def run_noise(reference: EngineAdapter, baseline: EngineAdapter, candidate: EngineAdapter, cfg: NoiseConfig,
                    run: Any = None, log: Callable[[str], None] | None = None) -> NoiseOutcome:
    """The noise phase, the test phase, the two tests, one verdict (module docstring)."""
    t0 = time.perf_counter()
    say = log or (lambda s: None)
    engines = {"reference": reference.describe(), "baseline": baseline.describe(), "candidate": candidate.describe()}
    refuse_synthetic(engines, "the noise baseline", LosslessError)
    out = NoiseOutcome(engines, asdict(cfg))
    if run is not None:
        out.run_id = run.run_id
        run.update(engines=engines)
    opts = resolve_rule(cfg.gate_options, baseline, candidate)
    tol = opts.tol
    out.rule = opts.rule_dict()

    def finish() -> NoiseOutcome:
        out.wall_s = time.perf_counter() - t0
        if run is not None:
            run.update(summary=out.to_dict())
        return out

    try:
        texts = load_prompts(cfg.dataset, cfg.num_prompts, cfg.max_prompt_chars)
        prompts, notes = await tokenize_prompts(reference, baseline, texts)
    except CannotTest as e:
        out.missing.append(f"{e.capability}: {e.detail}")
        out.reasons.append(f"{CANNOT_TEST}: {e}")
        return finish()
    out.notes += notes

    def record(kind: str, rule: dict) -> Callable[[PromptCheck], None]:
        return lambda pc: run.write(kind, {"tolerance": rule, **pc.to_dict()}) if run is not None else None

    # the noise phase: every divergence inside the reference's top-k is measured and re-anchored
    ceiling = cfg.max_noise_regret
    nopts = replace(opts, margin_tol=ceiling, strict_tol=ceiling, rescore=False, rule="margin",
                    rule_reason=f"noise measurement: every near-tie flip up to {ceiling:g} nat re-anchors and is "
                                f"measured (classified against the gate's {tol:g} nat afterwards); above it the two "
                                "configurations differ by more than reduction order")
    nc = cfg.noise_concurrency or cfg.concurrency
    say(f"[noise] noise phase: reference vs baseline (both spec off), {len(prompts)} prompts, baseline at c{nc}")
    out.noise = await run_greedy(reference, baseline, prompts, cfg.max_tokens, nopts, concurrency=nc, name="noise",
                                 baseline_concurrency=1, on_prompt=record("noise", nopts.rule_dict()))
    out.noise.require_spec = False
    out.noise_rate = sample_from_checks(out.noise.prompts, "noise: baseline vs reference (spec off)", "noise")
    out.noise_regrets = regret_sample(out.noise.prompts, "noise")
    say(f"[noise] {out.noise.verdict}; {out.noise_rate.describe()}; {out.noise_regrets.describe()}")
    if run is not None:
        d = out.noise.to_dict()
        d.pop("prompts")
        run.write("gates", d)
    if out.noise.verdict != PASS:  # a FAIL, or nothing compared / no evidence (GateRun.missing names it)
        judge(out, tol)
        return finish()

    # a passed noise phase has no pick outside the top-k: every regret is exact
    out.bound = max(tol, out.noise_regrets.largest or 0.0)
    raised = out.bound > tol
    reason = opts.rule_reason + (f"; raised to {out.bound:.3g} nat, the noise baseline's largest regret"
                                 if raised else "")
    topts = (replace(opts, strict_tol=out.bound, rule_reason=reason) if opts.rule == "strict"
             else replace(opts, margin_tol=out.bound, rule_reason=reason))
    say(f"[noise] test phase: baseline vs candidate (spec on), bound {out.bound:.3g} nat"
        + (f" (the gate's {tol:g} raised by the noise)" if raised else ""))
    out.test = await run_greedy(baseline, candidate, prompts, cfg.max_tokens, topts, concurrency=cfg.concurrency,
                                name="spec-on vs spec-off", on_prompt=record("checks", topts.rule_dict()))
    out.test_rate = sample_from_checks(out.test.prompts, "spec-on vs spec-off", "test")
    out.test_regrets = regret_sample(out.test.prompts, "spec-on vs spec-off")
    if run is not None:
        d = out.test.to_dict()
        d.pop("prompts")
        run.write("gates", d)
    if out.test_rate.exposure:
        out.rate = rate_test(out.test_rate, out.noise_rate, cfg.alpha, cfg.detect_per_1k,
                             noise_what="the measured noise between the two spec-off configurations")
        out.regret = regret_test(out.test_regrets, out.noise_regrets, cfg.alpha, cfg.power)
    say(f"[noise] test phase {out.test.verdict}; {out.test_rate.describe()}; {out.test_regrets.describe()}")
    judge(out, tol)
    return finish()


# ---- rendering -------------------------------------------------------------------------------------------------
def _g(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if x == 0 or x >= 0.01 else f"{x:.2e}")


def _rate_row(label: str, s: dict | None) -> str:
    if not s:
        return f"| {label} | - | - | - | - |"
    ci = s.get("ci95_per_1k")
    r = s.get("rate_per_1k")
    return (f"| {label} | {s['events']} | {s['exposure']} | {'-' if r is None else f'{r:.2f}'} | "
            f"{'-' if not ci else f'{ci[0]:.2f}-{ci[1]:.2f}'} |")


def summary_markdown(d: dict) -> list[str]:
    """The noise run from its summary (`NoiseOutcome.to_dict()`, run.json's summary): verdict, engines, the noise
    distribution beside the spec-on one, the tests. Pure; the --report file and `specbench report` use it."""
    from .report import _engine_line

    cfg, rule = d.get("config") or {}, d.get("rule") or {}
    eng = {k: v if isinstance(v, dict) else {} for k, v in (d.get("engines") or {}).items()}
    bound = "-" if d.get("bound") is None else f"{d['bound']:.3g} nat"
    lines = [f"# Noise baseline: {d.get('verdict')}", ""]
    lines += [f"- {r}" for r in d.get("reasons") or []]
    if d.get("missing"):
        lines.append(f"- missing: {'; '.join(d['missing'])}")
    lines += ["", f"- noise reference (spec off): {_engine_line(eng.get('reference', {}))}",
              f"- baseline (spec off, the configuration under test): {_engine_line(eng.get('baseline', {}))}",
              f"- candidate (spec on, same configuration): {_engine_line(eng.get('candidate', {}))}",
              f"- prompts: {cfg.get('num_prompts')} from `{cfg.get('dataset')}`, max_tokens {cfg.get('max_tokens')}; "
              f"candidate at c{cfg.get('concurrency')}, noise baseline at c{cfg.get('noise_concurrency') or cfg.get('concurrency')}",
              f"- gate tolerance: {rule.get('mode', 'margin')} {rule.get('tol')} nat ({rule.get('reason')}); test-phase "
              f"bound: {bound} (max of the tolerance and the "
              "largest noise regret)",
              f"- tests: alpha {cfg.get('alpha')}; rate power rule {cfg.get('detect_per_1k')} per 1,000 or 2x the noise; "
              f"regret test power {cfg.get('power')} at P(spec-on > noise) <= {DETECT_SUPERIORITY}",
              f"- run id: {'`' + d['run_id'] + '`' if d.get('run_id') else 'not recorded'}, wall {d.get('wall_s', 0):.1f} s"]
    lines += [f"- note: {n}" for n in d.get("notes") or []]
    lines += ["", "## How often", "", "| comparison | divergences | compared tokens | per 1,000 | 95% CI |",
              "|---|---:|---:|---:|---:|", _rate_row("noise: baseline vs reference, spec off", d.get("noise_rate")),
              _rate_row("spec-on vs spec-off", d.get("test_rate"))]
    nr, tr = d.get("noise_regrets") or {}, d.get("test_regrets") or {}
    lines += ["", "## How large (regret, nat)", "", "| comparison | scored | median | p90 | p99 | max | outside top-k "
              "| unscored |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in (("noise", nr), ("spec-on vs spec-off", tr)):
        q = s.get("quantiles") or {}
        lines.append(f"| {label} | {s.get('n', '-')} | {_g(q.get('q0.5'))} | {_g(q.get('q0.9'))} | {_g(q.get('q0.99'))} "
                     f"| {_g(q.get('q1'))} | {s.get('outside', '-')} | {s.get('unscored', '-')} |")
    lines += ["", "## At which margins", "", "Divergences a margin would call benign (regret <= margin):", "",
              "| margin (nat) | noise | spec-on vs spec-off |", "|---:|---:|---:|"]
    na, ta = dict((m, c) for m, c in nr.get("at_margins") or []), dict((m, c) for m, c in tr.get("at_margins") or [])
    for m in MARGINS:
        lines.append(f"| {m:g} | {na.get(m, '-')}/{nr.get('n', 0)} | {ta.get(m, '-')}/{tr.get('n', 0)} |")
    lines += ["", "## Against the noise", ""]
    for name, t in (("divergence rate (exact conditional binomial, one-sided)", d.get("rate")),
                    ("regret distribution (Mann-Whitney U, one-sided)", d.get("regret"))):
        lines.append(f"- {name}: **{t['verdict']}**: {t['detail']}" if t else f"- {name}: not run (no test phase)")
    rt, gt, e = d.get("rate") or {}, d.get("regret") or {}, (d.get("test_rate") or {}).get("exposure")
    if rt.get("x_crit") and e:
        lines.append(f"- smallest effect these samples see: a spec-on rate of {1000.0 * rt['x_crit'] / e:.1f} per 1,000 "
                     f"({rt['x_crit']} divergences in {e} tokens reject at alpha {rt.get('alpha')}: about even odds at "
                     "that rate)" + (f"; P(spec-on regret > noise regret) = {min(gt['detectable'], 1.0):.2f} with "
                                     f"power {gt.get('power')}" if gt.get("detectable") is not None else ""))
    return lines


def render_markdown(out: NoiseOutcome) -> str:
    from .report import divergence_rows, prompt_rows

    gates = [g for g in (out.noise, out.test) if g is not None]
    lines = summary_markdown(out.to_dict())
    for g in gates:
        lines += ["", f"## {g.name}: {g.verdict}", ""] + [f"_{n}_" for n in g.notes] + prompt_rows(g)
    div = divergence_rows(gates)
    lines += ["", "## Divergences", ""] + (div or ["None."])
    lines += ["", "Verdicts: PASS = every spec-on divergence within the bound and no excess over the measured noise "
              "(or, where no divergence leans on the noise, the regret rule at the gate's tolerance); FAIL = a "
              "divergence beyond the bound, a significant excess in rate or regret, or a noise pair that differs by more "
              "than a tie; CANNOT TEST = nothing to compare, or a pass that would lean on the noise without the power to "
              "back it. See docs/noise.md.", ""]
    return "\n".join(lines)


def render_console(out: NoiseOutcome) -> str:
    d = out.to_dict()
    lines = summary_markdown(d)[2:]
    lines.append(f"VERDICT: {out.verdict}" + (f" [missing: {'; '.join(out.missing)}]" if out.missing else "")
                 + f"  ({out.wall_s:.1f} s)")
    return "\n".join(lines)
