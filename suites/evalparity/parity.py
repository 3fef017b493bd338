"""The parity rule: two arms' lm-eval results -> one row per (task, filter, metric) and a verdict.

Contract (pure functions of the worker's JSON, no lm-eval import):
- Both arms ran the same task on the same documents with the same prompts; a document present in one
  arm only counts as a differing answer (its missing side shown as None).
- A row's `differ` lists every document whose extracted answer (lm-eval's filtered response) differs
  between the arms; `raw_differ` counts documents whose raw generations differ at all (a finer signal:
  a lossless engine under greedy decoding should have none, up to bf16 near-ties).
- Scores and their standard errors are lm-eval's own (`mean` aggregation: sample stddev / sqrt(n));
  where lm-eval gave none they are recomputed from the per-sample scores the same way.
- combined_stderr = sqrt(se_baseline^2 + se_candidate^2), the stderr of a difference of two
  independent means. The arms share their questions, so this is conservative (the paired stderr, also
  reported, is usually smaller). Verdict PARITY when |delta| <= combined_stderr, else DIFFERENT. A
  PARITY row still lists every differing answer; the run's verdict is DIFFERENT if any row is, and
  CANNOT TEST when no row compared a single document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specbench.harness.verdicts import CANNOT_TEST

PARITY = "PARITY"
DIFFERENT = "DIFFERENT"


@dataclass
class Score:
    value: float
    stderr: float


@dataclass
class DiffAnswer:
    doc_id: int
    baseline: str | None
    candidate: str | None
    target: str | None
    baseline_score: float | None
    candidate_score: float | None


@dataclass
class ParityRow:
    task: str
    filter: str
    metric: str
    n: int
    baseline: Score
    candidate: Score
    delta: float  # candidate - baseline
    combined_stderr: float
    paired_stderr: float
    raw_differ: int
    differ: list[DiffAnswer] = field(default_factory=list)
    verdict: str = PARITY

    @property
    def differ_ids(self) -> list[int]:
        return [d.doc_id for d in self.differ]


def mean_stderr(xs: list[float]) -> float:
    """lm-eval's closed form for `mean`: sample stddev (n - 1) / sqrt(n); 0 below two samples."""
    n = len(xs)
    if n < 2:
        return 0.0
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def final_answer(target: str | None) -> str | None:
    """gsm8k's reference answer is the text after '#### '; other targets are kept whole."""
    if target is None:
        return None
    return target.rsplit("#### ", 1)[-1].strip() if "#### " in target else target


def _by_doc(samples: list[dict], filt: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in samples if s["filter"] == filt}


def _score(info: dict | None, xs: list[float]) -> Score:
    value = info.get("value") if info else None
    stderr = info.get("stderr") if info else None
    if not isinstance(value, int | float):
        value = sum(xs) / len(xs) if xs else 0.0
    if not isinstance(stderr, int | float) or math.isnan(stderr):
        stderr = mean_stderr(xs)
    return Score(float(value), float(stderr))


def compare_task(task: str, base: dict, cand: dict) -> list[ParityRow]:
    """base / cand: one task's entry of the worker's JSON (filters, samples)."""
    rows: list[ParityRow] = []
    filters = list(dict.fromkeys([*base.get("filters", {}), *cand.get("filters", {})]))
    for filt in filters:
        metrics = list(dict.fromkeys([*base["filters"].get(filt, {}), *cand["filters"].get(filt, {})]))
        b_docs, c_docs = _by_doc(base["samples"], filt), _by_doc(cand["samples"], filt)
        ids = sorted(set(b_docs) | set(c_docs))
        raw_differ = sum(1 for i in ids if (b_docs.get(i) or {}).get("raw") != (c_docs.get(i) or {}).get("raw"))
        for metric in metrics:
            bx = [float(s["scores"][metric]) for s in b_docs.values() if metric in s["scores"]]
            cx = [float(s["scores"][metric]) for s in c_docs.values() if metric in s["scores"]]
            b = _score(base["filters"].get(filt, {}).get(metric), bx)
            c = _score(cand["filters"].get(filt, {}).get(metric), cx)
            diffs = []
            paired = []
            for i in ids:
                bs, cs = b_docs.get(i), c_docs.get(i)
                b_ans = bs["extracted"] if bs else None
                c_ans = cs["extracted"] if cs else None
                b_sc = bs["scores"].get(metric) if bs else None
                c_sc = cs["scores"].get(metric) if cs else None
                if b_sc is not None and c_sc is not None:
                    paired.append(float(c_sc) - float(b_sc))
                if bs is None or cs is None or b_ans != c_ans:
                    target = final_answer((bs or cs or {}).get("target"))
                    diffs.append(DiffAnswer(i, b_ans, c_ans, target, b_sc, c_sc))
            delta = c.value - b.value
            combined = math.sqrt(b.stderr ** 2 + c.stderr ** 2)
            verdict = PARITY if abs(delta) <= combined + 1e-12 else DIFFERENT
            rows.append(ParityRow(task, filt, metric, len(ids), b, c, delta, combined, mean_stderr(paired),
                                  raw_differ, diffs, verdict))
    return rows


def compare(base_tasks: dict[str, Any], cand_tasks: dict[str, Any]) -> list[ParityRow]:
    rows: list[ParityRow] = []
    for task in base_tasks:
        if task not in cand_tasks:
            raise ValueError(f"task {task!r} ran on the baseline only: both arms must run the same tasks")
        rows += compare_task(task, base_tasks[task], cand_tasks[task])
    return rows


def overall(rows: list[ParityRow]) -> str:
    """DIFFERENT if any row is; CANNOT TEST when no row holds a document (nothing was compared: never
    PARITY on no evidence, harness/verdicts.py); else PARITY."""
    if any(r.verdict == DIFFERENT for r in rows):
        return DIFFERENT
    if not any(r.n for r in rows):
        return CANNOT_TEST
    return PARITY
