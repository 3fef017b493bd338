"""The reader-neutral trace model that every reader produces and the analysis consumes.

Contract:
- Times are integer nanoseconds on one clock per trace (whatever the profiler used); only
  differences matter. Readers convert exactly (no float rounding of 16-digit microsecond stamps).
- An `Activity` is one GPU interval that counts as busy: a kernel, a memcpy, a memset, or an opaque
  CUDA-graph replay (nsys graph-mode exports, where the graph's kernels are absent). Synchronization
  rows are never activities.
- `end >= start` always (readers clamp and report inverted rows in `Trace.notes`).
- `phase` is the name of the profiler range (NVTX / record_function) the activity was assigned to, or
  None. Readers fill it only when asked for phases; how they pick the range is in `ranges.py`.
- `resolution_ns` is the timestamp granularity: 1 for nsys and ns-precision Kineto, 1000 for Kineto
  traces with integer-microsecond stamps (then gaps below ~3 us cannot be resolved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("kernel", "memcpy", "memset", "graph")


class GapsError(Exception):
    """Bad input: an unreadable or unsupported trace, a bad rule file. The CLI maps it to exit code 2."""


@dataclass(slots=True)
class Activity:
    start: int
    end: int
    device: str
    stream: str
    kind: str
    name: str
    phase: str | None = None

    @property
    def dur(self) -> int:
        return self.end - self.start


@dataclass
class Trace:
    path: Path
    format: str
    activities: list[Activity]
    resolution_ns: int = 1
    notes: list[str] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    has_ranges: bool = False

    def devices(self) -> list[str]:
        """Device labels in a stable order (numeric ones numerically)."""
        labels = {a.device for a in self.activities}
        return sorted(labels, key=lambda d: (0, int(d), d) if d.isdigit() else (1, 0, d))

    def by_device(self) -> dict[str, list[Activity]]:
        out: dict[str, list[Activity]] = {d: [] for d in self.devices()}
        for a in self.activities:
            out[a.device].append(a)
        return out


def ns_from_decimal(text: str | int | float, scale: int) -> int:
    """Exact integer nanoseconds from a decimal number in a unit `scale` ns wide (1000 for us).

    JSON microsecond stamps like 1712195495506161.2 carry 17 significant digits, more than a float
    keeps, so readers pass the literal text here instead of a parsed float.
    """
    if isinstance(text, int):
        return text * scale
    if isinstance(text, float):
        return round(text * scale)
    s = text.strip()
    if not s:
        raise ValueError("empty number")
    if "e" in s or "E" in s:
        from decimal import Decimal

        return int((Decimal(s) * scale).to_integral_value())
    neg = s.startswith("-")
    if neg or s.startswith("+"):
        s = s[1:]
    whole, _, frac = s.partition(".")
    digits = len(str(scale)) - 1  # scale is a power of ten
    frac_scaled = (frac + "0" * digits)[:digits]
    value = int(whole or "0") * scale + int(frac_scaled or "0")
    rest = frac[digits:]
    if rest and rest[0] >= "5":
        value += 1
    return -value if neg else value
