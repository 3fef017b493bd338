"""Synthetic acceptance for speed curves on random-weight models (whose drafters accept nothing).

The draft and the verify run for real; only the number of accepted drafts is drawn: position i (0-based)
is accepted, given all before it were, with probability r_i. From a target mean committed length tau
(incl. the bonus) with K drafts, a constant rate r solves sum_{i=1..K} r^i = tau - 1. Outputs are not
the target's greedy text: every record and report that uses this mode is labelled synthetic, and the
lossless suites refuse it.

Common random numbers: whether a draft for sequence position q of a request is acceptable is one
Bernoulli(r) draw fixed by (seed, the request's prompt ids, q), and a verify span starting at position p
accepts drafts while positions p + 1, p + 2, ... are acceptable. Each span reads positions no earlier span
read (the rejected one is replaced by the target's token), so a span's count has the same law as before
(P(m >= j) = r^j, capped at its drafts); but two engines given the same prompts now see the same acceptable
positions whatever their spans, batches and step order, so arms compared at one synthetic tau differ by their
settings, not by their draws. With one generator per engine in step order (before), arms of the same steps drew
alike but an arm whose spans differed drew other acceptance: at c1 and tau 3.5 the automatic policy realized
3.60 and 3.45 where span 16 realized 3.66 and 3.39 (reports/h200-levers/2026-12-04-s2/, the cells' counters).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..config import ConfigError


def rate_for_tau(tau: float, k: int) -> float:
    if not 1.0 <= tau <= k + 1:
        raise ConfigError(f"spec.synthetic_tau={tau} is invalid: expected 1 <= tau <= K + 1 = {k + 1}")
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) < tau - 1:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


KEEP = 4096  # requests whose acceptable positions are kept (least recently drawn dropped first)


class SyntheticAcceptance:
    def __init__(self, tau: float, k: int, seed: int = 0) -> None:
        self.tau = tau
        self.rate = rate_for_tau(tau, k)
        self.seed = seed
        # request id (or the prompt itself) -> acceptable positions; keyed by the id when the caller gives one, so
        # a step does not hash every long prompt again (the seed still comes from the prompt: common to engines)
        self._bits: OrderedDict[object, np.ndarray] = OrderedDict()

    def reseed(self, seed: int) -> None:
        """Draw every position again from `seed` (benchmarks/speed.py: the arms of one repeat share a seed, repeats
        differ)."""
        self.seed = seed
        self._bits.clear()

    def acceptable(self, prompt_ids: Sequence[int], n: int, rid: str | None = None) -> np.ndarray:
        """Whether a draft for each sequence position 0..n-1 of a request with these prompt ids is acceptable
        (bool [>= n]): one seeded stream per (seed, prompt), so a longer read extends a shorter one. `rid`: the
        request's id, the cache key (ids are unique among running requests; a finished one's entry ages out)."""
        # the id with the prompt list's identity and length: a later request that reuses an id gets its own entry
        key: object = (rid, id(prompt_ids), len(prompt_ids)) if rid is not None else tuple(prompt_ids)
        bits = self._bits.get(key)
        if bits is None or len(bits) < n:
            h = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8,
                                key=int(self.seed).to_bytes(8, "little", signed=True))
            rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
            bits = rng.random(max(n, 2 * len(bits) if bits is not None else n)) < self.rate
            self._bits[key] = bits
        self._bits.move_to_end(key)
        while len(self._bits) > KEEP:
            self._bits.popitem(last=False)
        return bits

    def draw(self, prompt_ids: Sequence[int], start: int, k: int, rid: str | None = None) -> int:
        """Accepted drafts of a verify span at sequence position `start` carrying k drafts (for positions
        start + 1 .. start + k): the run of acceptable positions from start + 1, at most k."""
        window = self.acceptable(prompt_ids, start + 1 + k, rid)[start + 1: start + 1 + k]
        miss = np.flatnonzero(~window)
        return int(miss[0]) if len(miss) else k
