"""Markdown and JSON renderings of a parity run (pure functions of the rows and the arms' metadata).

Contract: `to_json(run)` is one JSON-serializable document (verdict, rule, rows with every differing
answer, arms with their provenance and wall time, the run's settings); `render_markdown(run)` shows the
same facts: the parity table, the differing answers, the arms and the rule. Neither reads files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .parity import ParityRow, overall

RULE = ("PARITY when |delta| <= combined stderr, where combined stderr = sqrt(se_baseline^2 + "
        "se_candidate^2) and each se is lm-eval's stderr of the mean (sample stddev / sqrt(n)); "
        "otherwise DIFFERENT (exit 1). The arms answer the same questions, so this bound is conservative; "
        "the paired stderr (stddev of per-question score differences / sqrt(n)) is shown beside it. "
        "Differing answers are listed whatever the verdict.")
MAX_ANSWER_CHARS = 40


@dataclass
class ArmInfo:
    role: str  # baseline | candidate
    name: str
    engine: str
    model: str
    endpoint: str
    tokenizer_backend: str
    max_length: int | None
    wall_s: float
    lm_eval_version: str
    model_args: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParityRun:
    tasks: list[str]
    num_fewshot: int | None
    limit: int | None
    concurrency: int
    rows: list[ParityRow]
    arms: list[ArmInfo]
    notes: list[str] = field(default_factory=list)
    run_id: str | None = None
    samples_path: str | None = None
    prompt_mismatch: dict[str, list[int]] = field(default_factory=dict)  # task -> doc ids

    @property
    def verdict(self) -> str:
        return overall(self.rows)


def to_json(run: ParityRun) -> dict[str, Any]:
    rows = []
    for r in run.rows:
        d = asdict(r)
        d["differ_ids"] = r.differ_ids
        d["n_differ"] = len(r.differ)
        rows.append(d)
    return {"suite": "evalparity", "verdict": run.verdict, "rule": RULE, "run_id": run.run_id,
            "tasks": run.tasks, "num_fewshot": run.num_fewshot, "limit": run.limit,
            "concurrency": run.concurrency, "rows": rows, "arms": [asdict(a) for a in run.arms],
            "notes": run.notes, "samples_path": run.samples_path,
            "prompt_mismatch": run.prompt_mismatch}


def _short(s: str | None) -> str:
    if s is None:
        return "(missing)"
    s = s.replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= MAX_ANSWER_CHARS else s[: MAX_ANSWER_CHARS - 1] + "…"


def _ids(ids: list[int], limit: int = 30) -> str:
    if not ids:
        return "-"
    shown = ", ".join(str(i) for i in ids[:limit])
    return shown + (f", … (+{len(ids) - limit})" if len(ids) > limit else "")


def _correct(x: float | None) -> str:
    return "-" if x is None else ("yes" if x >= 1.0 else "no")


def render_table(rows: list[ParityRow]) -> str:
    out = ["| task | filter | metric | n | baseline ± se | candidate ± se | delta | combined se | paired se "
           "| answers differ | raw outputs differ | verdict |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r.task} | {r.filter} | {r.metric} | {r.n} | {r.baseline.value:.4f} ± {r.baseline.stderr:.4f} "
                   f"| {r.candidate.value:.4f} ± {r.candidate.stderr:.4f} | {r.delta:+.4f} | {r.combined_stderr:.4f} "
                   f"| {r.paired_stderr:.4f} | {len(r.differ)} | {r.raw_differ} | **{r.verdict}** |")
    return "\n".join(out)


def render_differences(rows: list[ParityRow]) -> str:
    parts: list[str] = []
    for r in rows:
        if not r.differ:
            continue
        parts.append(f"\n**{r.task} / {r.filter}**: {len(r.differ)} of {r.n} extracted answers differ "
                     f"(doc ids: {_ids(r.differ_ids)})\n")
        parts.append("| doc id | target | baseline answer | candidate answer | baseline correct | candidate correct |")
        parts.append("|---:|---|---|---|---|---|")
        for d in r.differ:
            parts.append(f"| {d.doc_id} | {_short(d.target)} | {_short(d.baseline)} | {_short(d.candidate)} "
                         f"| {_correct(d.baseline_score)} | {_correct(d.candidate_score)} |")
    return "\n".join(parts) if parts else "\nNo extracted answer differs between the arms."


def _accept(a: ArmInfo) -> str:
    spec = a.extra.get("spec") or {}
    mal = spec.get("mean_accept_len")
    return f"{mal:.2f} ({spec['num_drafts']} verify steps)" if isinstance(mal, int | float) else "-"


def render_arms(arms: list[ArmInfo]) -> str:
    out = ["| arm | engine | model | endpoint | tokenizer | max_length | lm-eval wall time | mean accepted length |",
           "|---|---|---|---|---|---:|---:|---:|"]
    for a in arms:
        label = a.role if a.name == a.role else f"{a.role} ({a.name})"
        out.append(f"| {label} | `{a.engine}` | `{a.model}` | {a.endpoint} | {a.tokenizer_backend} "
                   f"| {a.max_length if a.max_length is not None else '-'} | {a.wall_s:.1f} s | {_accept(a)} |")
    return "\n".join(out)


def render_markdown(run: ParityRun) -> str:
    shots = "task default" if run.num_fewshot is None else str(run.num_fewshot)
    lines = [f"## Task-level parity: {', '.join(run.tasks)} — **{run.verdict}**", "",
             f"{shots}-shot, limit {run.limit if run.limit is not None else 'none'}, "
             f"{run.concurrency} concurrent requests per arm, greedy (the task's generation kwargs). "
             + (f"Run `{run.run_id}`." if run.run_id else ""), "",
             render_table(run.rows), "", "### Differing answers", render_differences(run.rows), "",
             "### Arms", "", render_arms(run.arms), ""]
    if run.arms:
        lines += [f"lm-eval {run.arms[0].lm_eval_version}, `local-completions`, model_args "
                  f"(baseline): `{run.arms[0].model_args}`", ""]
    if run.samples_path:
        lines += [f"Per-sample outputs: `{run.samples_path}`", ""]
    if run.notes:
        lines += ["### Notes", "", *[f"- {n}" for n in run.notes], ""]
    lines += ["### Rule", "", RULE, ""]
    return "\n".join(lines)
