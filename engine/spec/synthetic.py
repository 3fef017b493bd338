"""Synthetic acceptance for speed curves on random-weight models (whose drafters accept nothing).

The draft and the verify run for real; only the number of accepted drafts is drawn: position i (0-based)
is accepted, given all before it were, with probability r_i. From a target mean committed length tau
(incl. the bonus) with K drafts, a constant rate r solves sum_{i=1..K} r^i = tau - 1. Outputs are not
the target's greedy text: every record and report that uses this mode is labelled synthetic, and the
lossless suites refuse it.
"""

from __future__ import annotations

import torch

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


class SyntheticAcceptance:
    def __init__(self, tau: float, k: int, seed: int = 0) -> None:
        self.tau = tau
        self.rate = rate_for_tau(tau, k)
        self.gen = torch.Generator().manual_seed(seed)

    def draw(self, k: int) -> int:
        u = torch.rand(k, generator=self.gen)
        m = 0
        while m < k and u[m].item() < self.rate:
            m += 1
        return m
