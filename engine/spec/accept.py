"""Greedy acceptance: the longest draft prefix equal to the target's argmax, then the target's own token.

With drafts d[0..k) and target argmax a[0..k] over the verify span [anchor, d0..d(k-1)] (a[i] is the
target's choice for the position after span row i): m = max{j : d[i] == a[i] for all i < j}; the step
commits d[0..m) + [a[m]], i.e. 1..k+1 tokens. Always at least one token of progress.
`accept_greedy_within` is the lossy variant the self-test's accept_tolerance fault asks for
(`AcceptRule.greedy_tol`): d[i] also matches when its target logit is within `tol` of row i's max.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def accept_greedy(drafts: list[int], argmax: list[int]) -> tuple[int, list[int]]:
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"verify rows={len(argmax)} must equal drafts+1={len(drafts) + 1}")
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return m, drafts[:m] + [argmax[m]]


def accept_greedy_within(drafts: list[int], argmax: list[int], logits: torch.Tensor, tol: float
                         ) -> tuple[int, list[int]]:
    """Greedy acceptance where a draft whose logit in its row (logits: [k + 1, V]) is within `tol` of the
    row's max is accepted too (lossy unless tol == 0)."""
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"verify rows={len(argmax)} must equal drafts+1={len(drafts) + 1}")
    top = logits.max(-1).values.tolist()
    got = [float(logits[i, d]) for i, d in enumerate(drafts)]
    m = 0
    while m < len(drafts) and (drafts[m] == argmax[m] or got[m] >= top[m] - tol):
        m += 1
    return m, drafts[:m] + [argmax[m]]
