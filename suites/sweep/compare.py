"""Paired A/B arithmetic over interleaved rounds: speedups and the noise floor.

Contract: an arm's figure at a level is one value per round (output tok/s of that round's cell).
Arms are paired by round: round r of arm B is compared with round r of the baseline A, which ran
next to it, so slow drift (thermals, other tenants) hits both sides of every ratio.
- speedup(B vs A) = median over rounds of B_r / A_r (with min and max of the per-round ratios).
- noise floor = the same computation for a second copy A' of the baseline arm, interleaved with the
  others: `median_ratio` = median A'_r / A_r (should be ~1) and `noise` = median over rounds of
  |A'_r / A_r - 1|, the typical round-to-round disagreement of identical arms. A speedup whose
  distance from 1 is within the noise is not resolved (`resolved`).
Rounds missing on either side (an interrupted run) are left out of the pairing, never imputed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def paired_ratios(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> list[float]:
    """b_r / a_r for every round r present (and positive) on both sides, in round order."""
    out = []
    for r in sorted(set(a) & set(b)):
        x, y = a[r], b[r]
        if x is not None and y is not None and x > 0:
            out.append(y / x)
    return out


def speedup(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> dict | None:
    """Median paired ratio b/a over rounds, with its spread; None when no round pairs."""
    r = paired_ratios(a, b)
    if not r:
        return None
    return {"median": float(np.median(r)), "min": float(min(r)), "max": float(max(r)), "rounds": len(r),
            "ratios": r}


def noise_floor(a: Mapping[int, float | None], a2: Mapping[int, float | None]) -> dict | None:
    """The paired noise floor of baseline A against its interleaved copy A2."""
    r = paired_ratios(a, a2)
    if not r:
        return None
    return {"median_ratio": float(np.median(r)), "noise": float(np.median([abs(x - 1.0) for x in r])),
            "max_dev": float(max(abs(x - 1.0) for x in r)), "rounds": len(r), "ratios": r}


def resolved(sp: dict | None, nf: dict | None) -> bool | None:
    """Is the speedup's distance from 1 larger than the noise floor? None when either is missing."""
    if sp is None or nf is None:
        return None
    return abs(sp["median"] - 1.0) > nf["noise"]
