"""`specbench report`: markdown A/B tables and PNG plots from stored sweep runs.

Pipeline: `load_run_summary(dir)` (records + the run's own record) -> `summarize` (summarize.py: per level
and arm figures, paired speedups, the noise floor) -> `render_markdown` (markdown.py) + the PNGs of
plots.py. `write_report(run_dirs, out)` writes OUT.md and OUT-<plot>.png beside it (linked relatively)
and returns the paths. Reports are pure functions of the records: rendering twice gives the same text.
"""

from __future__ import annotations

from pathlib import Path

from .markdown import render_comparison, render_run
from .plots import PLOTS
from .summarize import ArmLevel, RunSummary, summarize

__all__ = ["ArmLevel", "ReportError", "RunSummary", "load_records", "load_run_summary", "run_meta", "render_markdown", "summarize", "write_report"]


class ReportError(ValueError):
    """A run directory that is missing or holds no sweep records."""


def load_records(run_dir: str | Path) -> tuple[list[dict], dict]:
    """(the run's sweep, request and cell records tagged with "kind", run meta for the report header)."""
    from specbench.harness import results

    try:
        run = results.load_stored_run(run_dir)
    except FileNotFoundError as e:
        raise ReportError(f"run directory {str(run_dir)!r}: {e}") from None
    records = [{"kind": kind, **r} for src, kind in (("sweep", "sweep"), ("requests", "request"), ("cells", "cell"))
               for r in run.records(src)]
    if run.meta.get("suite") != "sweep" or not any(r["kind"] == "cell" for r in records):
        raise ReportError(f"{run.path}: holds no sweep cells (suite {run.meta.get('suite')!r}); is it a sweep run?")
    return records, run_meta(run.meta, run.status)


def run_meta(meta: dict, status: str) -> dict:
    prov = meta.get("provenance") or {}
    git = prov.get("git") or {}
    dev = prov.get("device") or {}
    device = ", ".join(dev.get("gpus") or []) or (f"CPU {dev.get('cpu')} x{dev.get('cpu_count')}" if dev else None)
    sha = (git.get("sha") or "")[:10] + ("+dirty" if git.get("dirty") else "") if git.get("sha") else None
    return {"run_id": meta.get("run_id"), "status": status,
            "incomplete": status not in ("complete", "complete_with_failures"),
            "requests": (meta.get("summary") or {}).get("requests"),
            "started": meta.get("started"), "git_sha": sha, "device": device}


def load_run_summary(run_dir: str | Path) -> RunSummary:
    records, meta = load_records(run_dir)
    return summarize(records, run_id=str(meta.get("run_id") or Path(run_dir).name), run_meta=meta)


def render_markdown(runs: list[RunSummary], images: dict[str, str] | None = None) -> str:
    title = "# specbench sweep report" if len(runs) == 1 else f"# specbench sweep report: {len(runs)} runs"
    lines = [title, ""]
    if len(runs) > 1:
        lines += render_comparison(runs)
    for i, s in enumerate(runs):
        lines += render_run(s, images if i == 0 else None)
    return "\n".join(lines).rstrip() + "\n"


def write_report(runs: list[RunSummary], out: str | Path, plots: bool = True) -> list[Path]:
    """Write OUT (markdown) and, with plots, OUT-stem-<name>.png beside it; returns every path written."""
    out = Path(out)
    if out.suffix != ".md":
        out = out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    images: dict[str, str] = {}
    if plots:
        for name, fn in PLOTS.items():
            png = out.with_name(f"{out.stem}-{name}.png")
            written.append(fn(runs, png))
            images[name] = png.name
    out.write_text(render_markdown(runs, images))
    return [out, *written]
