"""The regret rule: is a candidate's pick at a divergence a benign tie flip or a real error?

Contract (pure functions, no engine, no I/O):
- `first_divergence(candidate, baseline)` is the first index where two token lists differ, the shorter
  length when one is a proper prefix of the other, or None when they are equal.
- `judge_pick(pick, dist, margin_tol)` scores the candidate's pick under the baseline's reported top-k
  distribution at that position (`dist`: token id -> logprob, the baseline's own token included):
  regret = logp(top1) - logp(pick).
  * pick inside the reported top-k and regret <= margin_tol -> benign ("flip");
  * pick inside the top-k and regret > margin_tol -> FAIL ("regret");
  * pick outside the top-k -> FAIL ("outside_topk") with a lower bound on the regret:
    logp(top1) - min(reported logprobs), since the pick's logprob is at most the smallest one reported.
    Where the exact logprob of the pick is known (teacher-forced scoring), it is reported too, but the
    verdict stays FAIL: a pick the baseline ranked below its top-k is not a near-tie.
  An exact tie has regret 0 and is benign. A tolerance of 1e-9 nat absorbs float rounding of the
  subtraction (0.20 is not exactly representable); it is far below any meaningful margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from specbench.harness.verdicts import FAIL

MARGIN_TOL = 0.20  # nat; the seed engine's MARGIN_TOL (REFERENCE.md section 2); for bf16 / fp16 runs
# Strict mode (both engines fp32): 10x the largest fp32 noise measured between correct code paths of one engine
# (benchmarks/fp32_noise.py, reports/fp32-noise/: the change of any top-20 token's logprob gap to the argmax
# between batched decode / one-at-a-time decode / prefill / chunked prefill, speculation off; max 4.0e-5 nat on
# the Qwen3-4B-shaped pair, CUDA fp32; 2.8e-5 on the tiny pair, CPU fp32; 0 spec-on flips in 4,446 tokens),
# rounded to one significant figure. docs/lossless.md, "Strict mode".
STRICT_FP32_TOL = 4e-4
TOP_K = 20  # logprobs the baseline is asked for
_EPS = 1e-9

BENIGN = "flip"
FAIL_REGRET = "regret"
FAIL_OUTSIDE = "outside_topk"
FAIL_NO_DIST = "no_logprobs"


@dataclass(frozen=True)
class PickJudgement:
    """The verdict on one divergence. `regret` is exact when the pick was inside the top-k."""

    ok: bool
    kind: str  # BENIGN | FAIL_REGRET | FAIL_OUTSIDE | FAIL_NO_DIST
    pick: int
    top1: int | None
    top1_logprob: float | None
    pick_logprob: float | None  # None when the pick was outside the reported top-k (and not scored)
    regret: float | None  # exact regret (inside top-k, or scored exactly)
    lower_bound: float | None  # outside the top-k: the regret is at least this
    top_k: int  # how many tokens the baseline reported at this position
    margin_tol: float

    @property
    def regret_or_bound(self) -> float | None:
        return self.regret if self.regret is not None else self.lower_bound

    def describe(self) -> str:
        if self.kind == FAIL_NO_DIST:
            return "the baseline reported no logprobs at this position: cannot judge"
        if self.kind == FAIL_OUTSIDE:
            s = (f"pick {self.pick} is outside the baseline's top-{self.top_k} (top1 {self.top1}); "
                 f"regret >= {self.lower_bound:.3f} nat")
            if self.regret is not None:
                s += f" (exact {self.regret:.3f} by teacher-forced scoring)"
            return s
        assert self.regret is not None  # a pick inside the top-k (BENIGN, FAIL_REGRET) has its exact regret
        rel = "<=" if self.ok else ">"
        word = "benign tie flip" if self.ok else FAIL
        reg = f"{self.regret:.3f}" if self.regret >= 0.01 or self.regret == 0 else f"{self.regret:.2e}"
        return f"{word}: pick {self.pick} vs top1 {self.top1}, regret {reg} {rel} {self.margin_tol:g} nat"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["describe"] = self.describe()
        return d


def first_divergence(candidate: Sequence[int], baseline: Sequence[int]) -> int | None:
    n = min(len(candidate), len(baseline))
    for i in range(n):
        if candidate[i] != baseline[i]:
            return i
    return None if len(candidate) == len(baseline) else n


def merged_dist(top: Mapping[int, float] | None, token_id: int | None = None,
                logprob: float | None = None) -> dict[int, float]:
    """The reported top-k plus the position's own (chosen) token, which some engines list separately."""
    out = {int(t): float(lp) for t, lp in (top or {}).items() if lp is not None}
    if token_id is not None and logprob is not None and int(token_id) not in out:
        out[int(token_id)] = float(logprob)
    return out


def within_tol(regret: float, tol: float) -> bool:
    """The rule's one comparison: a regret at most `tol` (plus 1e-9 nat of rounding slack) is a benign tie flip."""
    return regret <= tol + _EPS


def judge_pick(pick: int, dist: Mapping[int, float], margin_tol: float = MARGIN_TOL,
               exact_pick_logprob: float | None = None) -> PickJudgement:
    """Judge the candidate's `pick` under the baseline distribution `dist` (token -> logprob)."""
    if margin_tol < 0 or not math.isfinite(margin_tol):
        raise ValueError(f"margin_tol={margin_tol!r} is invalid: expected a finite number >= 0")
    finite = {t: lp for t, lp in dist.items() if lp is not None and not math.isnan(lp)}
    if not finite:
        return PickJudgement(False, FAIL_NO_DIST, pick, None, None, None, None, None, 0, margin_tol)
    # Highest logprob first; an exact tie is broken towards the lower id (any choice gives regret 0).
    top1, lp1 = min(finite.items(), key=lambda kv: (-kv[1], kv[0]))
    k = len(finite)
    if pick in finite:
        regret = max(0.0, lp1 - finite[pick])
        ok = within_tol(regret, margin_tol)
        return PickJudgement(ok, BENIGN if ok else FAIL_REGRET, pick, top1, lp1, finite[pick], regret, None, k,
                             margin_tol)
    bound = max(0.0, lp1 - min(finite.values()))
    exact = None if exact_pick_logprob is None else max(0.0, lp1 - exact_pick_logprob)
    return PickJudgement(False, FAIL_OUTSIDE, pick, top1, lp1, exact_pick_logprob, exact, bound, k, margin_tol)
