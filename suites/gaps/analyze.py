"""Busy/idle analysis of a GPU timeline, per device.

Contract (each is checked by `check_invariants` and by the tests on every shipped trace):
- span = last end - first start over the device's activities (kernels, memcpys, memsets, opaque graph
  replays) on all its streams.
- busy = length of the union of those intervals; idle = span - busy.
- A gap is a maximal interval inside the span that no activity covers; the gaps sum to idle exactly
  (integer ns).
- Each gap's whole length is attributed to the activity that starts at the gap's end, i.e. the op the
  GPU was waiting for (its class, its name, its phase). So idle by class, by kernel and by phase each
  sum to idle. Ties at the same start go to the shorter activity.
- Busy by class / phase: walking activities in start order, each one is credited with the part of its
  interval that no earlier-starting activity already covered; the credits sum to busy exactly.
- Histogram buckets are half-open [lo, hi): < 1 us, 1-3 us, 3-10 us, 10-100 us, >= 100 us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .classify import RULES, Classifier
from .trace import Activity, Trace

BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("< 1 us", 0, 1_000),
    ("1-3 us", 1_000, 3_000),
    ("3-10 us", 3_000, 10_000),
    ("10-100 us", 10_000, 100_000),
    ("> 100 us", 100_000, None),
)
NO_PHASE = "(none)"


@dataclass(slots=True)
class Gap:
    start: int
    end: int
    next_name: str
    next_class: str
    phase: str

    @property
    def dur(self) -> int:
        return self.end - self.start


@dataclass
class PhaseStats:
    busy_ns: int = 0
    idle_ns: int = 0
    n_gaps: int = 0
    idle_by_class: dict[str, int] = field(default_factory=dict)


@dataclass
class KernelIdle:
    name: str
    cls: str
    idle_ns: int = 0
    n_gaps: int = 0


@dataclass
class DeviceReport:
    device: str
    span_start: int
    span_end: int
    busy_ns: int
    idle_ns: int
    n_activities: int
    n_streams: int
    gaps: list[Gap]
    histogram: list[tuple[str, int, int]]  # (label, n_gaps, idle_ns)
    idle_by_class: dict[str, int]
    gaps_by_class: dict[str, int]
    busy_by_class: dict[str, int]
    idle_by_kernel: list[KernelIdle]  # sorted by idle, descending
    phases: dict[str, PhaseStats] | None = None

    @property
    def span_ns(self) -> int:
        return self.span_end - self.span_start


@dataclass
class GapsReport:
    trace: str
    format: str
    resolution_ns: int
    notes: list[str]
    meta: dict[str, str]
    devices: list[DeviceReport]
    classes: list[str]
    extra_rules: list[tuple[str, str]] = field(default_factory=list)
    phases: bool = False
    phase_pick: str = "innermost"
    phase_filter: str | None = None


def bucket_of(dur_ns: int) -> int:
    for i, (_, lo, hi) in enumerate(BUCKETS):
        if dur_ns >= lo and (hi is None or dur_ns < hi):
            return i
    raise ValueError(f"gap length {dur_ns} ns is negative")


def analyze_device(device: str, acts: list[Activity], classify: Callable[[str], str],
                   phases: bool = False) -> DeviceReport:
    if not acts:
        raise ValueError(f"device {device}: no activities")
    order = sorted(acts, key=lambda a: (a.start, a.end, a.name))
    gaps: list[Gap] = []
    busy_by_class: dict[str, int] = {}
    idle_by_class: dict[str, int] = {}
    gaps_by_class: dict[str, int] = {}
    by_kernel: dict[str, KernelIdle] = {}
    phase_stats: dict[str, PhaseStats] = {}
    busy = 0
    cur_end = order[0].start
    for a in order:
        cls = classify(a.name)
        ph = (a.phase or NO_PHASE) if phases else NO_PHASE
        if a.start > cur_end:
            gap = Gap(cur_end, a.start, a.name, cls, ph)
            gaps.append(gap)
            idle_by_class[cls] = idle_by_class.get(cls, 0) + gap.dur
            gaps_by_class[cls] = gaps_by_class.get(cls, 0) + 1
            k = by_kernel.setdefault(a.name, KernelIdle(a.name, cls))
            k.idle_ns += gap.dur
            k.n_gaps += 1
            if phases:
                ps = phase_stats.setdefault(ph, PhaseStats())
                ps.idle_ns += gap.dur
                ps.n_gaps += 1
                ps.idle_by_class[cls] = ps.idle_by_class.get(cls, 0) + gap.dur
        new = a.end - max(a.start, cur_end)
        if new > 0:
            busy += new
            busy_by_class[cls] = busy_by_class.get(cls, 0) + new
            if phases:
                phase_stats.setdefault(ph, PhaseStats()).busy_ns += new
        cur_end = max(cur_end, a.end)
    span_start, span_end = order[0].start, cur_end
    n_in = [0] * len(BUCKETS)  # gaps per bucket
    ns_in = [0] * len(BUCKETS)  # idle ns per bucket
    for g in gaps:
        i = bucket_of(g.dur)
        n_in[i] += 1
        ns_in[i] += g.dur
    return DeviceReport(
        device=device, span_start=span_start, span_end=span_end, busy_ns=busy,
        idle_ns=(span_end - span_start) - busy, n_activities=len(acts),
        n_streams=len({a.stream for a in acts}), gaps=gaps,
        histogram=[(label, n_in[i], int(ns_in[i])) for i, (label, _, _) in enumerate(BUCKETS)],
        idle_by_class=_desc(idle_by_class), gaps_by_class=gaps_by_class, busy_by_class=_desc(busy_by_class),
        idle_by_kernel=sorted(by_kernel.values(), key=lambda k: -k.idle_ns),
        phases=dict(sorted(phase_stats.items(), key=lambda kv: (-kv[1].idle_ns, -kv[1].busy_ns, kv[0])))
        if phases else None,
    )


def _desc(d: dict[str, int]) -> dict[str, int]:
    return dict(sorted(d.items(), key=lambda kv: -kv[1]))


def analyze(trace: Trace, classifier: Classifier | None = None, phases: bool = False,
            phase_pick: str = "innermost", phase_filter: str | None = None) -> GapsReport:
    """Analyze every device of `trace`. With `phases`, busy and idle are also split by Activity.phase."""
    classifier = classifier or Classifier.build()
    devices = [analyze_device(d, acts, classifier, phases=phases) for d, acts in trace.by_device().items()]
    extra = list(classifier.rules[: len(classifier.rules) - len(RULES)])
    return GapsReport(
        trace=trace.path.name, format=trace.format, resolution_ns=trace.resolution_ns, notes=list(trace.notes),
        meta=dict(trace.meta), devices=devices, classes=classifier.classes(), extra_rules=extra, phases=phases,
        phase_pick=phase_pick, phase_filter=phase_filter,
    )


def check_invariants(report: GapsReport) -> None:
    """Raise AssertionError when a device's numbers do not add up (they are integers: exact)."""
    for d in report.devices:
        where = f"{report.trace} device {d.device}"
        assert d.busy_ns + d.idle_ns == d.span_ns, f"{where}: busy + idle != span"
        assert 0 <= d.busy_ns <= d.span_ns, f"{where}: busy outside [0, span]"
        assert sum(g.dur for g in d.gaps) == d.idle_ns, f"{where}: gaps do not sum to idle"
        assert all(g.dur > 0 for g in d.gaps), f"{where}: empty gap"
        assert sum(d.idle_by_class.values()) == d.idle_ns, f"{where}: idle by class != idle"
        assert sum(k.idle_ns for k in d.idle_by_kernel) == d.idle_ns, f"{where}: idle by kernel != idle"
        assert sum(t for _, _, t in d.histogram) == d.idle_ns, f"{where}: histogram != idle"
        assert sum(n for _, n, _ in d.histogram) == len(d.gaps), f"{where}: histogram count != gaps"
        assert sum(d.busy_by_class.values()) == d.busy_ns, f"{where}: busy by class != busy"
        if d.phases is not None:
            assert sum(p.idle_ns for p in d.phases.values()) == d.idle_ns, f"{where}: idle by phase != idle"
            assert sum(p.busy_ns for p in d.phases.values()) == d.busy_ns, f"{where}: busy by phase != busy"
            for name, p in d.phases.items():
                assert sum(p.idle_by_class.values()) == p.idle_ns, f"{where} phase {name}: class split != idle"
