"""Latency metrics of one request, REFERENCE.md section 3: the one home of TTFT, E2EL, TPOT, per-token ITL and
chunk gaps. A live `GenResult` (harness/adapters/base.py), a stored request record (suites/sweep/metrics.py)
and the engine load benchmark (benchmarks/load.py) call these functions, each with the timings it holds.

Contract (pure functions of numbers; seconds in, seconds out):
- `since(t0, t)`: t - t0, None where t is None. TTFT = since(send, first content chunk), E2EL = since(send,
  last token). `offsets(t0, times)`: each chunk's arrival - send, the chunk times a request record stores (and
  the ones a live result's ITLs and chunk gaps are computed from, so both give the same bits).
- `tpot(ttft, e2el, n)` = (E2EL - TTFT) / (n - 1), n the engine's usage count of output tokens; None for
  fewer than two tokens or a missing time.
- `reconcile_chunks(tokens, n)`: per-chunk token counts made to sum to the usage count n: tokens streamed past
  n (tokens after EOS) are dropped, a shortfall is booked to the last chunk; n None: the counts as streamed
  (negatives as 0).
- `counted_chunks(times, tokens, n)`: (time, tokens) of the chunks that carry counted tokens after
  `reconcile_chunks` (a chunk left with none is no chunk); no per-chunk counts: one token per chunk.
- `token_itls(chunks)`: each gap between counted chunks spread evenly over the later chunk's tokens, so the
  ITLs of a request sum to its last counted chunk - its first. `chunk_gaps(chunks)`: the raw gaps (under
  speculation a chunk carries about an acceptance length of tokens).
"""

from __future__ import annotations

from collections.abc import Sequence


def since(t0: float, t: float | None) -> float | None:
    """t - t0, or None where t was never taken."""
    return None if t is None else t - t0


def offsets(t0: float, times: Sequence[float]) -> list[float]:
    """Each time - t0 (chunk arrivals as offsets from the send)."""
    return [t - t0 for t in times]


def tpot(ttft: float | None, e2el: float | None, n: int | None) -> float | None:
    """(E2EL - TTFT) / (n - 1): the decode time per output token after the first; None where n < 2 or a
    time is missing."""
    if ttft is None or e2el is None or not n or n < 2:
        return None
    return (e2el - ttft) / (n - 1)


def reconcile_chunks(tokens: Sequence[int], n: int | None) -> list[int]:
    """Per-chunk token counts made to sum to the usage count `n` (see the module docstring)."""
    counts = [max(0, int(c)) for c in tokens]
    if n is None or not counts:
        return counts
    out, left = [], n
    for c in counts:
        take = min(c, left)
        out.append(take)
        left -= take
    if left > 0:
        out[-1] += left
    return out


def counted_chunks(times: Sequence[float], tokens: Sequence[int] | None, n: int | None) -> list[tuple[float, int]]:
    """(arrival, tokens) of each chunk that carries counted output tokens (see the module docstring)."""
    counts = reconcile_chunks(tokens or [1] * len(times), n)
    return [(t, c) for t, c in zip(times, counts, strict=False) if c > 0]


def token_itls(chunks: Sequence[tuple[float, int]]) -> list[float]:
    """Per-token inter-token latencies of `counted_chunks`: each gap spread over the later chunk's tokens."""
    out: list[float] = []
    for (ta, _), (tb, c) in zip(chunks, chunks[1:], strict=False):
        out += [(tb - ta) / c] * c
    return out


def chunk_gaps(chunks: Sequence[tuple[float, int]]) -> list[float]:
    """The raw gaps between consecutive `counted_chunks`."""
    return [tb - ta for (ta, _), (tb, _) in zip(chunks, chunks[1:], strict=False)]
