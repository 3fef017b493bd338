"""PNG plots of sweep summaries (matplotlib, Agg backend, no display needed).

Contract: each function writes one PNG at `path` and returns it. Several runs go on one set of axes,
each line labelled run/arm (just the arm for a single run). The x axis is the load level (concurrency
or request rate, log2 scale when it spans more than a factor of 4).
- tok/s vs load per arm; TPOT (mean) vs load per arm;
- acceptance per position (one line per spec arm and level);
- speedup vs load per non-baseline arm: the median paired ratio with its per-round min-max as error
  bars, and the noise band 1 ± noise floor shaded.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .summarize import RunSummary  # noqa: E402


def _label(runs: list[RunSummary], s: RunSummary, arm: str) -> str:
    return arm if len(runs) == 1 else f"{s.run_id}/{arm}"


def _xaxis(ax: plt.Axes, runs: list[RunSummary]) -> None:
    lv = sorted({x for s in runs for x in s.levels if x != float("inf")})
    ax.set_xlabel("concurrency" if runs[0].level_kind == "concurrency" else "request rate (req/s)")
    if lv and lv[0] > 0 and lv[-1] / lv[0] > 4:
        ax.set_xscale("log", base=2)
    if lv:
        ax.set_xticks(lv)
        ax.set_xticklabels([f"{x:g}" for x in lv])
        ax.minorticks_off()
    ax.grid(True, alpha=0.3)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tok_s(runs: list[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in runs:
        for a in s.compared_arms:
            pts = [(lv, c.tok_s_median) for lv in s.levels if (c := s.get(a, lv)) and c.tok_s_median is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=_label(runs, s, a))
    ax.set_ylabel("output tok/s (median over rounds)")
    ax.set_title("Output throughput vs load")
    _xaxis(ax, runs)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_tpot(runs: list[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in runs:
        for a in s.compared_arms:
            pts = [(lv, c.stats["tpot"]["mean"] * 1e3) for lv in s.levels
                   if (c := s.get(a, lv)) and c.stats["tpot"]["mean"] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=_label(runs, s, a))
    ax.set_ylabel("TPOT mean (ms)")
    ax.set_title("Time per output token vs load")
    _xaxis(ax, runs)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_acceptance(runs: list[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for s in runs:
        for a in s.spec_arms:
            for lv in s.levels:
                c = s.get(a, lv)
                if c and c.acceptance and c.acceptance["per_pos"]:
                    pp = c.acceptance["per_pos"]
                    lvl = f"c{int(lv)}" if s.level_kind == "concurrency" else f"{lv:g}/s"
                    ax.plot(range(1, len(pp) + 1), [p * 100 for p in pp], marker=".",
                            label=f"{_label(runs, s, a)} {lvl}")
                    drawn = True
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("accepted at position (% of verify steps)")
    ax.set_title("Acceptance per draft position")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no speculative arm", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_speedup(runs: list[RunSummary], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.axhline(1.0, color="k", lw=0.8)
    for s in runs:
        band = [(lv, nf["noise"]) for lv in s.levels if (nf := s.noise.get(lv))]
        if band:
            xs, ns = [lv for lv, _ in band], [n for _, n in band]
            ax.fill_between(xs, [1 - n for n in ns], [1 + n for n in ns], alpha=0.2,
                            label=f"noise floor{'' if len(runs) == 1 else ' ' + s.run_id}")
        for a in s.compared_arms:
            if a == s.baseline:
                continue
            pts = [(lv, sp) for lv in s.levels if (sp := s.speedups.get((a, lv)))]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            med = [p[1]["median"] for p in pts]
            err = [[m - p[1]["min"] for m, p in zip(med, pts, strict=True)],
                   [p[1]["max"] - m for m, p in zip(med, pts, strict=True)]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=f"{_label(runs, s, a)} / {s.baseline}")
    ax.set_ylabel("speedup (median paired ratio)")
    ax.set_title("Speedup over the baseline, with the noise band")
    _xaxis(ax, runs)
    ax.legend(fontsize=8)
    return _save(fig, path)


PLOTS = {"tok_s": plot_tok_s, "tpot": plot_tpot, "acceptance": plot_acceptance, "speedup": plot_speedup}
