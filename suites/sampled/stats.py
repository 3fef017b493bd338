"""Two-sample tests for the sampled equivalence gate: permutation test, Benjamini-Hochberg, TV, power.

Contract:
- A sample is a 1-D integer array of categories (token ids; the gate uses -1 for "the output had ended").
- `max_studentized(ca, cb, na, nb)`: the statistic T = max over categories v of
  |ca_v/na - cb_v/nb| / sqrt(f_v (1 - f_v) (1/na + 1/nb)), f_v the pooled frequency. Categories with
  f_v in {0, 1} contribute 0. The pooled counts are invariant under relabelling, so each category's
  studentizer is a constant of the cell and only the A-side counts change between permutations.
- `Permuter(na, nb, permutations, seed)` holds B random relabellings of na + nb pooled observations
  (shared by every cell of one run: the same B is used for each cell). `Permuter.test(a, b)` returns a
  `PermResult` with the permutation p-value (1 + #{T_perm >= T_obs}) / (1 + B), valid at any B
  (Phipson & Smyth 2010); its smallest value is 1 / (1 + B). `refine(...)` adds fresh permutations.
- `benjamini_hochberg(p, q)`: the BH step-up rejections (a boolean array in input order).
- `tv_distance(a, b)`: the plug-in total-variation distance of the two empirical distributions (biased
  upward at small n: under H0 it is about sqrt(support / n) / 2, never zero).
- `min_detectable_tv(freqs, na, nb, alpha, power)`: analytic normal approximation of the smallest TV the
  test detects with the given power at level alpha, for the alternative "mass delta moves from the most
  frequent token to the second most frequent one" (TV = delta), with a Bonferroni critical value over
  the cell's support (conservative for a maximum). Returns inf when no delta <= the modal frequency is
  detectable. `simulated_power` checks it by simulation with the real permutation test.
Everything is numpy; randomness only through explicit `numpy.random.Generator`s (reproducible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_N = NormalDist()


def encode(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """Pooled category codes 0..K-1 (A's observations first, then B's) and K."""
    _, codes = np.unique(np.concatenate([a, b]), return_inverse=True)
    return codes.astype(np.int64), int(codes.max()) + 1 if codes.size else 0


def _studentizer(total: np.ndarray, na: int, nb: int) -> np.ndarray:
    f = total / (na + nb)
    var = f * (1.0 - f) * (1.0 / na + 1.0 / nb)
    with np.errstate(divide="ignore"):
        return np.where(var > 0, 1.0 / np.sqrt(np.where(var > 0, var, 1.0)), 0.0)


def max_studentized(ca: np.ndarray, cb: np.ndarray, na: int, nb: int) -> float:
    """T for count vectors ca, cb (same categories); 0 when the pooled sample has one category."""
    inv = _studentizer(ca + cb, na, nb)
    return float(np.max(np.abs(ca / na - cb / nb) * inv)) if ca.size else 0.0


def tv_distance(a: np.ndarray, b: np.ndarray) -> float:
    codes, k = encode(a, b)
    ca = np.bincount(codes[:len(a)], minlength=k) / max(len(a), 1)
    cb = np.bincount(codes[len(a):], minlength=k) / max(len(b), 1)
    return float(0.5 * np.abs(ca - cb).sum())


def benjamini_hochberg(p: np.ndarray | list[float], q: float) -> np.ndarray:
    """Reject H_(1..k*) where k* = max{k : p_(k) <= k q / m} (step-up); input order kept."""
    p = np.asarray(p, dtype=float)
    m = p.size
    if m == 0:
        return np.zeros(0, dtype=bool)
    if not 0 < q < 1:
        raise ValueError(f"q={q} is invalid: expected 0 < q < 1")
    order = np.argsort(p, kind="stable")
    ok = p[order] <= q * np.arange(1, m + 1) / m
    out = np.zeros(m, dtype=bool)
    if ok.any():
        out[order[:int(np.nonzero(ok)[0].max()) + 1]] = True
    return out


def bh_adjusted(p: np.ndarray | list[float]) -> np.ndarray:
    """BH-adjusted p-values (q-values): cell i is rejected at level q iff adjusted_i <= q."""
    p = np.asarray(p, dtype=float)
    m = p.size
    if m == 0:
        return p
    order = np.argsort(p, kind="stable")
    adj = np.minimum.accumulate((p[order] * m / np.arange(1, m + 1))[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out


@dataclass
class PermResult:
    stat: float
    exceed: int  # permutations with T_perm >= T_obs
    permutations: int
    support: int  # distinct categories in the pooled sample

    @property
    def p_value(self) -> float:
        return (1 + self.exceed) / (1 + self.permutations)


class Permuter:
    """B shared random relabellings of na + nb observations; `test` runs one cell against them."""

    def __init__(self, na: int, nb: int, permutations: int, seed: int = 0, chunk: int = 2048) -> None:
        if na < 1 or nb < 1:
            raise ValueError(f"sample sizes na={na}, nb={nb} are invalid: expected >= 1 each")
        if permutations < 1:
            raise ValueError(f"permutations={permutations} is invalid: expected an integer >= 1")
        self.na, self.nb, self.permutations, self.chunk = na, nb, permutations, chunk
        self.rng = np.random.default_rng(seed)
        self._base = self._draw(permutations)
        self._extra: list[np.ndarray] = []  # lazily drawn chunks for refinement, shared by all cells

    def _draw(self, b: int) -> np.ndarray:
        """[b, na] indices into the pooled sample: the observations relabelled 'A'."""
        n = self.na + self.nb
        dtype = np.int16 if n < 2**15 else np.int32
        return np.argsort(self.rng.random((b, n)), axis=1)[:, :self.na].astype(dtype)

    def _exceed(self, codes: np.ndarray, k: int, idx: np.ndarray, t_obs: float, inv: np.ndarray,
                total: np.ndarray) -> int:
        b = idx.shape[0]
        ca = np.bincount((codes[idx] + (np.arange(b) * k)[:, None]).ravel(), minlength=b * k).reshape(b, k)
        cb = total[None, :] - ca
        t = (np.abs(ca / self.na - cb / self.nb) * inv[None, :]).max(axis=1)
        # A relative tolerance keeps ties (equal statistics up to rounding) counted as exceedances.
        return int(np.count_nonzero(t >= t_obs * (1 - 1e-12)))

    def _prep(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, float]:
        if len(a) != self.na or len(b) != self.nb:
            raise ValueError(f"samples of size ({len(a)}, {len(b)}) given to a Permuter for ({self.na}, {self.nb})")
        codes, k = encode(np.asarray(a), np.asarray(b))
        total = np.bincount(codes, minlength=k)
        inv = _studentizer(total, self.na, self.nb)
        ca = np.bincount(codes[:self.na], minlength=k)
        t_obs = float(np.max(np.abs(ca / self.na - (total - ca) / self.nb) * inv))
        return codes, k, total, inv, t_obs

    def test(self, a: np.ndarray, b: np.ndarray) -> PermResult:
        codes, k, total, inv, t_obs = self._prep(a, b)
        if k <= 1 or t_obs == 0.0:
            return PermResult(0.0, self.permutations, self.permutations, k)
        exceed = 0
        for s in range(0, self.permutations, self.chunk):
            exceed += self._exceed(codes, k, self._base[s:s + self.chunk], t_obs, inv, total)
        return PermResult(t_obs, exceed, self.permutations, k)

    def refine(self, a: np.ndarray, b: np.ndarray, res: PermResult, upto: int, stop_exceed: int = 10) -> PermResult:
        """Add shared extra permutations (chunks) until `upto` in all or `stop_exceed` exceedances."""
        codes, k, total, inv, t_obs = self._prep(a, b)
        exceed, used, i = res.exceed, res.permutations, 0
        while used < upto and exceed < stop_exceed:
            if i == len(self._extra):
                self._extra.append(self._draw(self.chunk))
            exceed += self._exceed(codes, k, self._extra[i], t_obs, inv, total)
            used += self.chunk
            i += 1
        return PermResult(res.stat, exceed, used, res.support)


def permutation_test(a: np.ndarray, b: np.ndarray, permutations: int = 1999, seed: int = 0) -> PermResult:
    """One-off test of two samples (a fresh Permuter)."""
    return Permuter(len(a), len(b), permutations, seed).test(np.asarray(a), np.asarray(b))


def _swap_power_z(delta: float, p1: float, p2: float, na: int, nb: int) -> float:
    """Expected |z| of the stronger of the two moved tokens (normal approximation)."""
    h = 1.0 / na + 1.0 / nb
    best = 0.0
    for f in (p1 - delta / 2, p2 + delta / 2):  # pooled frequency of each moved token
        var = f * (1 - f) * h
        if var > 0:
            best = max(best, delta / math.sqrt(var))
    return best


def min_detectable_tv(freqs: np.ndarray | list[float], na: int, nb: int, alpha: float,
                      power: float = 0.8) -> float:
    """Smallest delta (= TV) of a modal -> second token mass shift detected with `power` at `alpha`."""
    f = np.sort(np.asarray(freqs, dtype=float))[::-1]
    f = f[f > 0] / f[f > 0].sum() if f.size and f.sum() > 0 else np.array([1.0])
    p1 = float(f[0])
    p2 = float(f[1]) if f.size > 1 else 0.0
    support = max(int(f.size) + (1 if f.size == 1 else 0), 2)
    crit = _N.inv_cdf(1 - alpha / (2 * support)) + _N.inv_cdf(power)
    if _swap_power_z(p1, p1, p2, na, nb) < crit:
        return math.inf
    lo, hi = 0.0, p1
    for _ in range(60):
        mid = (lo + hi) / 2
        if _swap_power_z(mid, p1, p2, na, nb) >= crit:
            hi = mid
        else:
            lo = mid
    return hi


def swap_mass(freqs: np.ndarray, delta: float) -> np.ndarray:
    """The alternative of `min_detectable_tv`: delta moved from the modal category to the second one."""
    f = np.asarray(freqs, dtype=float).copy()
    order = np.argsort(f)[::-1]
    d = min(delta, f[order[0]])
    f[order[0]] -= d
    f[order[1]] += d
    return f


def simulated_power(p: np.ndarray, q: np.ndarray, na: int, nb: int, alpha: float, sims: int = 200,
                    permutations: int = 999, seed: int = 0) -> float:
    """Fraction of `sims` pairs (na draws from p, nb from q) the permutation test rejects at alpha."""
    rng = np.random.default_rng(seed)
    perm = Permuter(na, nb, permutations, seed + 1)
    cats = np.arange(len(p))
    hits = 0
    for _ in range(sims):
        a = rng.choice(cats, size=na, p=p / p.sum())
        b = rng.choice(cats, size=nb, p=q / q.sum())
        hits += perm.test(a, b).p_value <= alpha
    return hits / sims
