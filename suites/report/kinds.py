"""`specbench report` for the run kinds other than sweep: lossless (and lossless-noise, lossless-prefix), sampled, selftest, evalparity
(eval) and gaps, each rendered from what its run directory holds (run.json and the JSONL records), so a report is a
pure function of the records like the sweep's.

`render_stored_run(dir)` -> markdown for one run of any kind (sweep goes through summarize/markdown);
`KINDS` lists the suites it knows. Several runs of one kind are compared in one table first
(`render_runs`): the verdict and the headline figures of each run side by side (A/B of two engines, or
before/after of one).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specbench.harness.verdicts import FAIL, PASS

KINDS = ("sweep", "lossless", "lossless-noise", "lossless-prefix", "sampled", "selftest", "evalparity", "gaps")


class UnknownRunKind(ValueError):
    pass


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{nd}f}".rstrip("0").rstrip(".") or "0"
    return str(x).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]
    return out + [""]


def _header(run: Any, meta: dict) -> list[str]:
    lines = [f"## {run.meta.get('suite')} run `{meta.get('run_id')}`", "",
             f"- status **{meta.get('status')}**; started {meta.get('started') or '—'}; git {meta.get('git_sha') or '—'}; "
             f"device {meta.get('device') or '—'}"]
    engines = run.meta.get("engines") or {}
    for arm, d in engines.items():
        if isinstance(d, dict):
            lines.append(f"- {arm}: `{d.get('name')}` ({d.get('kind')}) {d.get('model') or ''}".rstrip())
    return lines + [""]


def _rule(rule: Any, why: bool = True) -> str:
    """The tolerance a lossless gate (or run) was judged by, from its record's `rule` (suites/lossless/greedy.py
    GreedyGateOptions.rule_dict): "strict 0.0004 nat (both engines run float32 ...)"; "—" where none is recorded."""
    if not isinstance(rule, dict) or rule.get("tol") is None:
        return "—"
    out = f"{'strict' if rule.get('mode') == 'strict' else 'margin'} {rule['tol']:g} nat"
    return f"{out} ({rule['reason']})" if why and rule.get("reason") else out


def _lossless(run: Any) -> list[str]:
    s = run.meta.get("summary") or {}
    lines = [f"**{s.get('verdict', 'no verdict')}**: {s.get('prompts', 0)} prompts, {s.get('failed_prompts', 0)} failed, "
             f"{s.get('untestable_prompts', 0)} untestable, {s.get('flips', 0)} benign flips; mean accepted length "
             f"{_f(s.get('mean_accept_len'))}; tolerance {_rule(s.get('rule'))}", ""]
    if s.get("missing"):
        lines += [f"Missing capabilities: {', '.join(map(str, s['missing']))}", ""]
    gates = run.records("gates")
    rows = []
    for g in gates:
        st = g.get("stats") or {}
        failed = [c["name"] for c in g.get("checks") or [] if not c.get("ok") and not c.get("skipped")]
        rows.append([g.get("name"), g.get("verdict"), _rule(g.get("rule"), why=False), st.get("mean_accept_len"),
                     st.get("acceptance_rate"), g.get("wall_s"), ", ".join(failed) or "—"])
    lines += ["### Gates", ""] + _table(["gate", "verdict", "tolerance", "mean accept len", "acceptance rate", "wall s",
                                        "failed checks"], rows)
    checks = run.records("checks")
    bad = [c for c in checks if not c.get("ok")]
    lines += [f"### Prompts: {len(checks)} checked, {len(bad)} not ok", ""]
    if bad:
        lines += _table(["gate", "prompt", "status", "tokens compared", "first divergence", "max regret", "reason"],
                        [[c.get("gate"), c.get("pid"), c.get("status"), c.get("tokens_compared"),
                          c.get("first_divergence"), c.get("max_regret"), c.get("reason") or "—"] for c in bad[:50]])
    return lines


def _sampled(run: Any) -> list[str]:
    s = run.meta.get("summary") or {}
    if "verdict" not in s and s:  # a self-test run: one summary per case
        rows = [[case, v.get("verdict"), v.get("num_prompts"), v.get("seconds")]
                for case, v in s.items() if isinstance(v, dict)]
        return ["### Cases", ""] + _table(["case", "verdict", "prompts", "seconds"], rows)
    lines = [f"**{s.get('verdict', 'no verdict')}**: configs {', '.join(s.get('configs') or []) or '—'}; "
             f"{s.get('num_prompts', 0)} prompts, {s.get('failed', 0)} failed, {s.get('untestable_samples', 0)} "
             f"untestable samples; {_f(s.get('seconds'))} s", ""]
    if s.get("not_tested"):
        lines += [f"Not tested: {'; '.join(map(str, s['not_tested']))}", ""]
    comps = s.get("comparisons") or {}
    lines += ["### Comparisons", ""] + _table(
        ["comparison", "cells", "testable", "rejected", "min p", "max TV", "median MDE (lone)"],
        [[name, c.get("cells"), c.get("testable"), c.get("rejected"), c.get("min_p"), c.get("max_tv"),
          c.get("median_mde_lone")] for name, c in comps.items()])
    cells = run.records("cells")
    lines += [f"{len(cells)} cells recorded (cells.jsonl)", ""]
    return lines


def _selftest(run: Any) -> list[str]:
    s = run.meta.get("summary") or {}
    lines = [f"**{PASS if s.get('ok') else FAIL}**: {len(s.get('faults') or [])} faults, "
             f"missed {', '.join(s.get('missed') or []) or 'none'}; false alarms "
             f"{'; '.join(s.get('false_alarms') or []) or 'none'}; {s.get('num_prompts')} prompts x "
             f"{s.get('max_tokens')} tokens, tolerance {_rule(s.get('rule'))}", ""]
    def row(r: dict, nobody: str) -> list[Any]:
        not_pass = "; ".join(f"{g}: {v}" for g, v in (r.get("verdicts") or {}).items() if v not in (PASS, "n/a"))
        return [r.get("label"), ", ".join(r.get("faults") or []) or "none", ", ".join(r.get("caught_by") or []) or nobody,
                not_pass or "all PASS", r.get("accept_len")]

    rows = [row(r, "MISSED") for r in s.get("faults") or []] + [row(r, "no alarm") for r in s.get("clean") or []]
    return lines + ["### Fault -> gates that caught it", ""] + _table(
        ["engine", "faults", "caught by", "gate verdicts", "mean accept len"], rows)


def _evalparity(run: Any) -> list[str]:
    s = run.meta.get("summary") or {}
    doc_path = run.path / "report.json"
    doc = json.loads(doc_path.read_text(encoding="utf-8")) if doc_path.is_file() else {}
    rows_src = doc.get("rows") or s.get("rows") or []
    lines = [f"**{doc.get('verdict') or s.get('verdict', 'no verdict')}**: tasks {', '.join(doc.get('tasks') or []) or '—'}; "
             f"few-shot {_f(doc.get('num_fewshot'))}, limit {_f(doc.get('limit'))}", ""]
    def score(x: Any) -> str:
        if isinstance(x, dict):
            return f"{_f(x.get('value'))} ± {_f(x.get('stderr'))}"
        return _f(x)

    lines += ["### Scores", ""] + _table(
        ["task", "filter", "metric", "n", "baseline", "candidate", "delta", "combined stderr", "answers differ", "verdict"],
        [[r.get("task"), r.get("filter"), r.get("metric"), r.get("n"), score(r.get("baseline")),
          score(r.get("candidate")), r.get("delta"), r.get("combined_stderr"), r.get("n_differ", r.get("raw_differ")),
          r.get("verdict")] for r in rows_src])
    return lines


def _gaps(run: Any) -> list[str]:
    s = run.meta.get("summary") or {}
    lines = [f"Trace `{(run.meta.get('config') or {}).get('trace', '—')}`", ""]
    for d in s.get("devices") or []:
        lines += [f"### device {d.get('device')}: busy {_f(100 * d.get('busy_share', 0), 1)} %, idle "
                  f"{_f(100 * d.get('idle_share', 0), 1)} % of {_f(d.get('span_ns', 0) / 1e6, 2)} ms; "
                  f"{d.get('n_ops')} ops, {d.get('n_gaps')} gaps", ""]
        lines += _table(["idle after", "idle ms", "share of idle", "gaps"],
                        [[c.get("class"), c.get("idle_ns", 0) / 1e6, c.get("share_of_idle"), c.get("gaps")]
                         for c in d.get("by_class") or []])
        if d.get("phases"):
            lines += _table(["phase", "busy ms", "idle ms", "gaps"],
                            [[p.get("phase"), p.get("busy_ns", 0) / 1e6, p.get("idle_ns", 0) / 1e6, p.get("gaps")]
                             for p in d["phases"]])
    return lines


def _noise(run: Any) -> list[str]:
    """`lossless --suite noise`: the summary's own rendering (suites/lossless/noise.py), headings under the run's."""
    from specbench.suites.lossless.noise import summary_markdown

    return [("##" + x if x.startswith("#") else x) for x in summary_markdown(run.meta.get("summary") or {})] + [""]


def _prefix(run: Any) -> list[str]:
    """`lossless --suite prefix`: the gate's own rendering (suites/lossless/prefix.py `render_markdown`), rebuilt
    from run.json's summary and the `cases` records, so it is the report the run printed; headings under the run's."""
    from specbench.suites.lossless.prefix import PrefixOutcome, render_markdown

    out = PrefixOutcome.from_records(run.meta.get("summary") or {}, run.records("cases"))
    return [("##" + x if x.startswith("#") else x) for x in render_markdown(out).splitlines()] + [""]


RENDERERS: dict[str, Callable[[Any], list[str]]] = {
    "lossless": _lossless, "lossless-noise": _noise, "lossless-prefix": _prefix, "sampled": _sampled, "selftest": _selftest, "evalparity": _evalparity, "gaps": _gaps}


def _headline(run: Any) -> list[Any]:
    s = run.meta.get("summary") or {}
    of_ok: dict[object, str] = {True: PASS, False: FAIL}
    verdict = s.get("verdict") or (of_ok.get(s.get("ok")) if "ok" in s else None)
    figure = s.get("mean_accept_len") or s.get("num_prompts") or s.get("prompts")
    return [f"`{run.run_id}`", run.meta.get("status"), verdict, figure, run.meta.get("started")]


def render_stored_run(run: Any, meta: dict) -> str:
    suite = run.meta.get("suite")
    if suite not in RENDERERS:
        raise UnknownRunKind(f"{run.path}: suite {suite!r} has no report (known: {', '.join(KINDS)})")
    return "\n".join(_header(run, meta) + RENDERERS[suite](run)).rstrip() + "\n"


def render_runs(runs: list[tuple[Any, dict]]) -> str:
    """One or more non-sweep runs: with several of one kind, a side-by-side table first."""
    kinds = sorted({r.meta.get("suite") for r, _ in runs})
    title = f"# specbench {' + '.join(str(k) for k in kinds)} report"
    lines = [title + (f": {len(runs)} runs" if len(runs) > 1 else ""), ""]
    if len(runs) > 1:
        lines += ["## Runs side by side", ""] + _table(["run", "status", "verdict", "headline", "started"],
                                                       [_headline(r) for r, _ in runs])
    body = [render_stored_run(r, m) for r, m in runs]
    return "\n".join(lines) + "\n".join(body)


def default_report_path(run_dirs: list[Path], run_id: str, results: str | Path | None = None) -> Path:
    """Under the results store (git-ignored), never the tracked reports/ unless asked with --out."""
    from specbench.harness.results import results_dir

    return results_dir(results) / "reports" / f"{run_id}.md"
