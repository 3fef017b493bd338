"""Phase assignment: which profiler range (NVTX push/pop or start/end, record_function) owns a GPU op.

Contract:
- A GPU activity belongs to the range that covers the CPU call that launched it (nsys: the
  CUDA runtime/driver row with the same correlationId; Kineto: the cuda_runtime/cuda_driver event
  with the same args.correlation), on the same thread. The GPU may run the op much later; the
  launch is what the range's code caused.
- Among nested ranges covering the launch, the INNERMOST one wins by default (the latest-starting
  one; ties go to the shorter). `pick="outermost"` takes the earliest-starting one instead.
- A range covers t when start <= t <= end.
- Range names are normalized so repeated ranges aggregate: `torch.autograd.profiler.emit_nvtx`
  suffixes (", op_id = 12", ", seq = 3", ", sizes = [...]") and trailing "#<digits>"
  ("ProfilerStep#101") are dropped.
- An optional name filter (a regex searched in the normalized name) keeps only matching ranges,
  e.g. "draft|verify|accept" to see speculative phases through a forest of per-op ranges.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

_EMIT_NVTX_SUFFIX = re.compile(r",\s*(?:seq|op_id|sizes|input_op_ids|stream)\s*=.*$")
_STEP_SUFFIX = re.compile(r"#\d+$")


def normalize_range_name(name: str) -> str:
    name = _EMIT_NVTX_SUFFIX.sub("", name.strip())
    return _STEP_SUFFIX.sub("", name).strip() or name


@dataclass(slots=True)
class Range:
    start: int
    end: int
    name: str


class RangeIndex:
    """Ranges grouped by a key (a thread, or a device for GPU-timeline ranges)."""

    def __init__(
        self,
        ranges: Iterable[tuple[Hashable, Range]],
        pick: str = "innermost",
        name_filter: re.Pattern[str] | None = None,
    ) -> None:
        if pick not in ("innermost", "outermost"):
            raise ValueError(f"pick={pick!r}: expected 'innermost' or 'outermost'")
        self.pick = pick
        self._by_key: dict[Hashable, list[Range]] = {}
        for key, r in ranges:
            r.name = normalize_range_name(r.name)
            if name_filter is not None and not name_filter.search(r.name):
                continue
            self._by_key.setdefault(key, []).append(r)
        for lst in self._by_key.values():
            lst.sort(key=lambda r: (r.start, -r.end))

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def names(self) -> set[str]:
        return {r.name for lst in self._by_key.values() for r in lst}

    def lookup(self, queries: Sequence[tuple[Hashable, int]]) -> list[str | None]:
        """Range name for each (key, time) query, in query order; None where nothing covers it."""
        out: list[str | None] = [None] * len(queries)
        grouped: dict[Hashable, list[int]] = {}
        for i, (key, _) in enumerate(queries):
            if key in self._by_key:
                grouped.setdefault(key, []).append(i)
        inner = self.pick == "innermost"
        for key, idxs in grouped.items():
            ranges = self._by_key[key]
            idxs.sort(key=lambda i: queries[i][1])
            active: list[Range] = []
            j = 0
            for i in idxs:
                t = queries[i][1]
                while j < len(ranges) and ranges[j].start <= t:
                    active.append(ranges[j])
                    j += 1
                active = [r for r in active if r.end >= t]
                if not active:
                    continue
                if inner:
                    best = max(active, key=lambda r: (r.start, -r.end))
                else:
                    best = min(active, key=lambda r: (r.start, -r.end))
                out[i] = best.name
        return out
