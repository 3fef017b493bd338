"""Greedy acceptance: the longest draft prefix equal to the target's argmax, then the target's own token.

With drafts d[0..k) and target argmax a[0..k] over the verify span [anchor, d0..d(k-1)] (a[i] is the
target's choice for the position after span row i): m = max{j : d[i] == a[i] for all i < j}; the step
commits d[0..m) + [a[m]], i.e. 1..k+1 tokens. Always at least one token of progress.
"""

from __future__ import annotations


def accept_greedy(drafts: list[int], argmax: list[int]) -> tuple[int, list[int]]:
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"verify rows={len(argmax)} must equal drafts+1={len(drafts) + 1}")
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return m, drafts[:m] + [argmax[m]]
