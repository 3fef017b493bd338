"""The summary a long command ends with (issue 24 item 2): its results at a glance, as one rich table.

One shape for every long command: `Summary(title, header, rows, notes)`, built from the command's own result by
a pure function here (`sweep_summary`, `tune_summary`, `lossless_summary`, `selftest_summary`, `eval_summary`),
and printed by `show` through `progress.summary_table`, the table sampled draws too. The summary goes to stderr,
beside the progress display: what a command prints on stdout (markdown, tables, the one JSON document of
--json, the records line) stays byte-for-byte what it was, piped or not. `--quiet` (and `--json`) print no
summary; the verdict and the exit code do not depend on it. The notes name where the records and the full
report are. docs/cli.md ("Summary") says what each command's table holds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from specbench.cli.progress import summary_table
from specbench.harness.verdicts import FAIL, INCOMPLETE, PASS


@dataclass
class Summary:
    title: str
    header: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)  # one line each, printed under the table


def show(s: Summary | None, *, quiet: bool, stream: TextIO | None = None) -> None:
    """Print the summary on stderr (or `stream`); nothing when quiet or when there is none."""
    if quiet or s is None:
        return
    out = stream or sys.stderr
    summary_table(s.title, s.header, s.rows, stream=out)
    for n in s.notes:
        print(n, file=out, flush=True)


def _ms(st: dict | None) -> str | None:
    return None if not st or not st.get("n") else f"{st['median'] * 1e3:.1f}"


def _num(x: Any, fmt: str) -> str | None:
    return fmt.format(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def sweep_summary(s: Any, run_dir: Any = None, report: Any = None) -> Summary:
    """A sweep's RunSummary (suites/report): per level and arm the median tok/s, the paired speedup over the
    baseline (`~`: within the noise floor), TTFT / TPOT medians, the acceptance length and the requests."""
    from specbench.suites.report.markdown import _lv, speedup_cell

    rows: list[list[Any]] = []
    for lv in s.levels:
        for a in s.compared_arms:
            c = s.get(a, lv)
            if c is None:
                continue
            st = c.stats or {}
            acc = c.acceptance or {}
            rows.append([_lv(s, lv), a, _num(c.tok_s_median, "{:.1f}"),
                         "baseline" if a == s.baseline else speedup_cell(s.speedups.get((a, lv)), s.noise.get(lv)),
                         _ms(st.get("ttft")), _ms(st.get("tpot")), _num(acc.get("length"), "{:.2f}"),
                         f"{st.get('completed', 0)}/{st.get('requests', 0)}"])
    state = "complete" if s.complete else INCOMPLETE.qualified("interrupted")
    notes = [f"~ = within the noise floor (the baseline run twice, interleaved); warm-up waves excluded; {state}"]
    if run_dir is not None:
        notes.append(f"records: {run_dir}")
    notes.append(f"full report: {report}" if report else
                 (f"full report: specbench report {run_dir}" if run_dir is not None else ""))
    return Summary(f"sweep: {len(s.levels)} levels x {len(s.compared_arms)} arms (baseline {s.baseline})",
                   [s.level_kind.replace("concurrency", "c"), "arm", "tok/s", "vs baseline", "TTFT p50 ms",
                    "TPOT p50 ms", "accept len", "requests ok"], rows, [n for n in notes if n])


def tune_summary(res: dict, report: Any = None) -> Summary:
    """specbench tune's analysis (suites/tune.py): per concurrency plain's tok/s, the best setting and its ratio;
    the crossover and the recommendation as notes."""
    rows: list[list[Any]] = []
    for row in res.get("per_level") or []:
        best = row.get("best")
        x = (row.get("arms") or {}).get(best) or {}
        ratio = x.get("ratio")
        mark = "*" if x.get("resolved") is False else ""
        rows.append([f"c{row['level']:g}", _num(row.get("plain_tok_s"), "{:.1f}"),
                     _num(100 * row["noise"] if isinstance(row.get("noise"), int | float) else None, "±{:.1f}%"), best,
                     f"{ratio:.3f}{mark}" if isinstance(ratio, int | float) else None])
    rec = res.get("recommendation") or {}
    notes = ["* = within the noise floor (plain run twice)",
             "crossover: " + (", ".join(f"{a} " + (f"c{c:g}" if c is not None else "none")
                                        for a, c in (res.get("crossover") or {}).items()) or "none"),
             "recommendation: " + (f"{rec['one_setting']} (never loses to plain beyond the noise floor)"
                                   if rec.get("one_setting") else "no single setting avoids a loss; per concurrency: "
                                   + ", ".join(f"c{lv} {a}" for lv, a in (rec.get("per_level") or {}).items()))]
    if res.get("run_dir"):
        notes.append(f"records: {res['run_dir']}")
    if report:
        notes.append(f"full report: {report}")
    return Summary(f"tune: {len(res.get('arms') or [])} arms, baseline {res.get('baseline')}"
                   + ("" if res.get("complete", True) else " (INCOMPLETE)"),
                   ["c", "plain tok/s", "noise", "best", "best / plain"], rows, notes)


def lossless_summary(out: Any, run_dir: Any = None, report: Any = None) -> Summary:
    """A LosslessOutcome (suites/lossless/suite.py): one row per gate."""
    rows: list[list[Any]] = []
    for g in out.gates:
        ps = g.prompts
        rows.append([g.name, g.verdict, len(ps), sum(p.status == "identical" for p in ps),
                     sum(p.status == "flip" for p in ps), sum(not p.ok and not p.untestable for p in ps),
                     sum(p.untestable for p in ps), _num(g.stats.mean_accept_len if g.stats.known else None, "{:.2f}"),
                     f"{g.wall_s:.1f}"])
    notes = [f"missing: {'; '.join(out.missing)}"] if getattr(out, "missing", None) else []
    if getattr(out, "not_tested", None):
        notes.append(f"not tested here (on by default, not deciding the verdict): {'; '.join(out.not_tested)}")
    if run_dir is not None:
        notes.append(f"records: {run_dir} (full report: specbench report {run_dir})")
    if report:
        notes.append(f"full report: {report}")
    return Summary(f"lossless: {out.verdict} ({out.wall_s:.1f} s)",
                   ["gate", "verdict", "requests", "identical", "benign flips", "failed", "cannot test",
                    "accept len", "wall s"], rows, notes)


def selftest_summary(out: Any, run_dir: Any = None, report: Any = None) -> Summary:
    """A SelftestOutcome (suites/lossless/selftest.py): one row per engine, the clean ones first."""
    rows: list[list[Any]] = []
    for r in out.clean:
        bad = [g for g in out.gate_names if r.not_pass(g)]
        rows.append([r.label, "none", "FALSE ALARM: " + ", ".join(bad) if bad else "no alarm (every gate PASS)",
                     _num(r.accept_len, "{:.2f}"), f"{r.wall_s:.1f}"])
    for r in out.faults:
        rows.append([r.label, ", ".join(r.faults), ", ".join(r.caught_by) if r.caught_by else "MISSED",
                     _num(r.accept_len, "{:.2f}"), f"{r.wall_s:.1f}"])
    notes = []
    if run_dir is not None:
        notes.append(f"records: {run_dir} (full report: specbench report {run_dir})")
    if report:
        notes.append(f"full report: {report}")
    return Summary(f"selftest: {PASS if out.ok else FAIL} ({len(out.faults)} faults, {len(out.clean)} clean runs, "
                   f"{out.wall_s:.1f} s)", ["engine", "faults", "caught by", "accept len", "wall s"], rows, notes)


def eval_summary(pr: Any, run_dir: Any = None, report: Any = None) -> Summary:
    """A ParityRun (suites/evalparity/report.py): one row per task, filter and metric."""
    rows = [[r.task, r.filter, r.metric, r.n, f"{r.baseline.value:.4f} ± {r.baseline.stderr:.4f}",
             f"{r.candidate.value:.4f} ± {r.candidate.stderr:.4f}", f"{r.delta:+.4f}", len(r.differ), r.verdict]
            for r in pr.rows]
    notes = []
    if run_dir is not None:
        notes.append(f"records: {run_dir} (full report: specbench report {run_dir})")
    if report:
        notes.append(f"full report: {report}")
    return Summary(f"eval: {pr.verdict} ({', '.join(pr.tasks)})",
                   ["task", "filter", "metric", "n", "baseline", "candidate", "delta", "answers differ", "verdict"],
                   rows, notes)

