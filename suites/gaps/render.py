"""Renderers for a GapsReport: a text table (terminal), one JSON document, a markdown section, a PNG bar chart.

Contract: pure functions of the report (no trace access, no clock); times are shown in ms with 3
decimals (1 us) and shares in percent of the device's span (busy, idle) or of its idle time (buckets,
classes, kernels, phases). `to_json` keeps integer ns so sums can be checked downstream.
matplotlib is imported only inside `plot_idle_by_class`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .analyze import BUCKETS, DeviceReport, GapsReport

TOP_KERNELS = 10
TOP_PHASES = 12


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _mid(name: str, width: int) -> str:
    """Shorten keeping both ends: range names differ at the end ("...|warmup|forward]")."""
    if len(name) <= width:
        return name
    head = (width - 3) // 2
    return name[:head] + "..." + name[len(name) - (width - 3 - head):]


def _header(r: GapsReport) -> str:
    bits = [r.format]
    if "EXPORT_SCHEMA_VERSION" in r.meta:
        bits.append(f"schema {r.meta['EXPORT_SCHEMA_VERSION']}")
    if "CUDA_GRAPH_TRACE_OPTIONS:MODE" in r.meta:
        bits.append(f"graph trace {r.meta['CUDA_GRAPH_TRACE_OPTIONS:MODE']}")
    bits.append(f"{r.resolution_ns} ns timestamps")
    return f"{r.trace}  [{', '.join(bits)}]"


def _phase_doc(r: GapsReport) -> str:
    flt = f", ranges matching /{r.phase_filter}/" if r.phase_filter else ""
    return f"{r.phase_pick} NVTX/record_function range around each op's launch{flt}"


def _top_class(p_idle_by_class: dict[str, int]) -> str:
    if not p_idle_by_class:
        return "-"
    cls, ns = max(p_idle_by_class.items(), key=lambda kv: kv[1])
    return f"{cls} ({_pct(ns, sum(p_idle_by_class.values()))})"


def render_text(r: GapsReport) -> str:
    out = [f"gaps: {_header(r)}"]
    out += [f"note: {n}" for n in r.notes]
    if r.extra_rules:
        out.append(f"extra rules (before the built-ins): {len(r.extra_rules)}")
    for d in r.devices:
        out += ["", f"device {d.device}  ({d.n_activities} GPU ops on {d.n_streams} stream{'s' if d.n_streams != 1 else ''})",
                f"  span {_ms(d.span_ns)} ms   busy {_ms(d.busy_ns)} ms ({_pct(d.busy_ns, d.span_ns)})   "
                f"idle {_ms(d.idle_ns)} ms ({_pct(d.idle_ns, d.span_ns)})   gaps {len(d.gaps)}",
                f"  {'gap length':<14}{'gaps':>8}{'idle ms':>12}{'of idle':>9}"]
        for label, n, ns in d.histogram:
            out.append(f"  {label:<14}{n:>8}{_ms(ns):>12}{_pct(ns, d.idle_ns):>9}")
        out.append(f"  {'idle before class':<26}{'idle ms':>12}{'of idle':>9}{'gaps':>8}{'busy ms':>12}")
        for cls in _classes_shown(d):
            ns = d.idle_by_class.get(cls, 0)
            out.append(f"  {cls:<26}{_ms(ns):>12}{_pct(ns, d.idle_ns):>9}{d.gaps_by_class.get(cls, 0):>8}"
                       f"{_ms(d.busy_by_class.get(cls, 0)):>12}")
        if d.idle_by_kernel:
            out.append(f"  top kernels after gaps{'':<4}{'idle ms':>12}{'of idle':>9}{'gaps':>8}  class: name")
            for k in d.idle_by_kernel[:TOP_KERNELS]:
                out.append(f"  {'':<26}{_ms(k.idle_ns):>12}{_pct(k.idle_ns, d.idle_ns):>9}{k.n_gaps:>8}  "
                           f"{k.cls}: {_short(k.name, 70)}")
        if d.phases is not None:
            out.append(f"  phases ({_phase_doc(r)}):")
            out.append(f"  {'phase':<34}{'busy ms':>12}{'idle ms':>12}{'of idle':>9}{'gaps':>8}  top class before gaps")
            for name, p in list(d.phases.items())[:TOP_PHASES]:
                out.append(f"  {_mid(name, 33):<34}{_ms(p.busy_ns):>12}{_ms(p.idle_ns):>12}"
                           f"{_pct(p.idle_ns, d.idle_ns):>9}{p.n_gaps:>8}  {_top_class(p.idle_by_class)}")
            if len(d.phases) > TOP_PHASES:
                out.append(f"  ... {len(d.phases) - TOP_PHASES} more phases (see --json)")
    return "\n".join(out) + "\n"


def _classes_shown(d: DeviceReport) -> list[str]:
    seen = set(d.idle_by_class) | set(d.busy_by_class)
    order = list(d.idle_by_class) + [c for c in d.busy_by_class if c not in d.idle_by_class]
    return [c for c in order if c in seen]


def to_json(r: GapsReport, top: int = 20) -> dict[str, Any]:
    """One JSON-serialisable document: integer ns plus shares in [0, 1]."""

    def share(part: int, whole: int) -> float:
        return round(part / whole, 6) if whole else 0.0

    devices = []
    for d in r.devices:
        dev: dict[str, Any] = {
            "device": d.device, "span_start_ns": d.span_start, "span_ns": d.span_ns, "busy_ns": d.busy_ns,
            "idle_ns": d.idle_ns, "busy_share": share(d.busy_ns, d.span_ns), "idle_share": share(d.idle_ns, d.span_ns),
            "n_ops": d.n_activities, "n_streams": d.n_streams, "n_gaps": len(d.gaps),
            "histogram": [{"bucket": label, "gaps": n, "idle_ns": ns, "share_of_idle": share(ns, d.idle_ns)}
                          for label, n, ns in d.histogram],
            "by_class": [{"class": c, "idle_ns": d.idle_by_class.get(c, 0),
                          "share_of_idle": share(d.idle_by_class.get(c, 0), d.idle_ns),
                          "gaps": d.gaps_by_class.get(c, 0), "busy_ns": d.busy_by_class.get(c, 0)}
                         for c in _classes_shown(d)],
            "top_kernels_after_gaps": [{"name": k.name, "class": k.cls, "idle_ns": k.idle_ns, "gaps": k.n_gaps}
                                       for k in d.idle_by_kernel[:top]],
            "longest_gaps": [{"start_ns": g.start, "dur_ns": g.dur, "next": g.next_name, "class": g.next_class,
                              "phase": g.phase} for g in sorted(d.gaps, key=lambda g: -g.dur)[:top]],
            "phases": None,
        }
        if d.phases is not None:
            dev["phases"] = [{"phase": name, "busy_ns": p.busy_ns, "idle_ns": p.idle_ns, "gaps": p.n_gaps,
                              "share_of_idle": share(p.idle_ns, d.idle_ns), "idle_by_class": p.idle_by_class}
                             for name, p in d.phases.items()]
        devices.append(dev)
    return {
        "trace": r.trace, "format": r.format, "resolution_ns": r.resolution_ns, "notes": r.notes, "meta": r.meta,
        "buckets": [label for label, _, _ in BUCKETS], "extra_rules": [list(x) for x in r.extra_rules],
        "phases": {"enabled": r.phases, "pick": r.phase_pick, "filter": r.phase_filter},
        "devices": devices,
    }


def render_markdown(r: GapsReport, plot: str | Path | None = None, level: int = 3) -> str:
    """A report section: one summary table over devices, then per device the histogram and the classes."""
    h = "#" * level
    out = [f"{h} GPU idle gaps: `{r.trace}`", "", f"{r.format}, {r.resolution_ns} ns timestamps."]
    out += [f"> {n}" for n in r.notes]
    out += ["", "| device | span ms | busy ms | idle ms | idle % | gaps | top class before gaps |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for d in r.devices:
        out.append(f"| {d.device} | {_ms(d.span_ns)} | {_ms(d.busy_ns)} | {_ms(d.idle_ns)} | "
                   f"{_pct(d.idle_ns, d.span_ns)} | {len(d.gaps)} | {_top_class(d.idle_by_class)} |")
    for d in r.devices:
        out += ["", f"Device {d.device}: gap histogram and idle attributed to the kernel class that follows each gap.",
                "", "| gap length | gaps | idle ms | % of idle |", "|---|---:|---:|---:|"]
        out += [f"| {label} | {n} | {_ms(ns)} | {_pct(ns, d.idle_ns)} |" for label, n, ns in d.histogram]
        out += ["", "| class | idle ms | % of idle | gaps | busy ms |", "|---|---:|---:|---:|---:|"]
        out += [f"| {c} | {_ms(d.idle_by_class.get(c, 0))} | {_pct(d.idle_by_class.get(c, 0), d.idle_ns)} | "
                f"{d.gaps_by_class.get(c, 0)} | {_ms(d.busy_by_class.get(c, 0))} |" for c in _classes_shown(d)]
        if d.phases is not None:
            out += ["", f"Phases ({_phase_doc(r)}):", "",
                    "| phase | busy ms | idle ms | % of idle | top class before gaps |", "|---|---:|---:|---:|---|"]
            out += [f"| {_mid(name, 60).replace('|', '/')} | {_ms(p.busy_ns)} | {_ms(p.idle_ns)} | "
                    f"{_pct(p.idle_ns, d.idle_ns)} | {_top_class(p.idle_by_class)} |"
                    for name, p in list(d.phases.items())[:TOP_PHASES]]
    if plot is not None:
        out += ["", f"![GPU idle by kernel class]({plot})"]
    return "\n".join(out) + "\n"


def plot_idle_by_class(r: GapsReport, path: str | Path, top_phases: int = 7) -> Path:
    """Horizontal stacked bars: idle ms per following-kernel class (all devices), one segment per phase
    (the top `top_phases` by idle, the rest merged) or, without phases, per device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segments: dict[str, dict[str, int]] = {}  # segment -> class -> idle ns
    for d in r.devices:
        if d.phases is not None:
            for name, p in d.phases.items():
                seg = segments.setdefault(name, {})
                for c, ns in p.idle_by_class.items():
                    seg[c] = seg.get(c, 0) + ns
        else:
            segments[f"device {d.device}"] = dict(d.idle_by_class)
    ranked = sorted(segments, key=lambda s: -sum(segments[s].values()))
    if len(ranked) > top_phases + 1:
        rest: dict[str, int] = {}
        for s in ranked[top_phases:]:
            for c, ns in segments.pop(s).items():
                rest[c] = rest.get(c, 0) + ns
        ranked = ranked[:top_phases] + ["other phases"]
        segments["other phases"] = rest
    totals: dict[str, int] = {}
    for seg in segments.values():
        for c, ns in seg.items():
            totals[c] = totals.get(c, 0) + ns
    classes = sorted((c for c in totals if totals[c] > 0), key=lambda c: totals[c])
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * max(1, len(classes))))
    left = [0.0] * len(classes)
    for s in ranked:
        vals = [segments[s].get(c, 0) / 1e6 for c in classes]
        ax.barh(classes, vals, left=left, label=_mid(s, 40))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("GPU idle before the class (ms)")
    by = "phase" if r.phases else "device"
    ax.set_title(f"GPU idle by the kernel class that follows each gap, stacked by {by}: {r.trace}", fontsize=9)
    if len(ranked) > 1 or r.phases:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
