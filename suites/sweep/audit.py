"""The sweep's acceptance / metrics audit: are the acceptance figures the report shows backed by evidence?

Contract: `audit_records(records)` is a pure function of one sweep's records (`cell` records with their
counter deltas, `request` records with their per-request spec counts; warm-up cells included: their
counters are real traffic). Per arm (noise copies are arms of their own) it returns PASS, FAIL or
CANNOT TEST (harness/verdicts.py) with the checks that ran, `cell_verdicts` (its cells counted by verdict)
and `unattributed` (the cells not judged, each with its reason), and one overall verdict (FAIL beats
CANNOT TEST beats PASS).

A cell whose client-side window cannot be attributed to it (suites/metrics_audit.py `audit_window`: the
server busy before it, counters still moving when the settle gave up, more finished requests than the
client sent, with tokens of their own) is CANNOT TEST and none of its counters is judged (not the
invariants, not the cross-check): its deltas may hold someone else's traffic. Its arm is CANNOT TEST
unless another cell FAILs.

Checks, per cell:
- invariants of the counter delta (REFERENCE.md section 3): sum(accepted_per_pos) == accepted;
  accepted_per_pos non-increasing; accepted_per_pos[0] <= drafts; accepted <= draft tokens;
  draft tokens <= K x drafts, K = the length of accepted_per_pos (the engine's widest draft);
- cross-check: where every request of the cell succeeded and carries per-request counts (vLLM-style
  `spec_decode`, the local engine, llama.cpp's `timings.draft_n` / `draft_n_accepted`), their sums must
  equal the counter delta (draft tokens, accepted tokens; drafts too where requests report them).
  Server-wide counters include other clients' traffic: audit an otherwise idle server.
- the client-side metrics audit (suites/metrics_audit.py), where the cell carries `server_metrics`
  (the audited /metrics families before and, settled, after it): request, output- and prompt-token
  counters against what the client received, spec counters against the output tokens and the tokens per
  streamed chunk, and gauges still non-zero after the cell (stale). Its problems are the arm's problems.
An arm with neither counters nor per-request counts in any cell is CANNOT TEST ("spec counters and
per-request draft counts"); one with per-request counts only gets the invariants on their sums.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS, combine

from ..lossless.checks import counter_violations
from ..metrics_audit import audit_window


def counter_invariants(c: dict) -> list[str]:
    """Violations of the counter invariants in one delta (empty: consistent)."""
    return counter_violations(c.get("num_drafts") or 0, c.get("num_draft_tokens") or 0,
                              c.get("num_accepted_tokens") or 0, c.get("accepted_per_pos") or [])


def _cell_key(r: dict) -> tuple:
    m = r.get("meta") or {}
    return (r.get("arm") or m.get("arm"), m.get("level", r.get("level")), m.get("round", r.get("round")),
            bool(m.get("warmup", r.get("warmup"))))


def _name(key: tuple) -> str:
    arm, level, rnd, warm = key
    return f"{arm} level {level:g} " + ("warm-up" if warm else f"round {rnd}")


def audit_records(records: Sequence[dict]) -> dict:
    cells = [r for r in records if r.get("kind") == "cell"]
    reqs: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "request":
            reqs[_cell_key(r)].append(r)
    arms: dict[str | None, dict] = {}  # by arm name (None: a cell record that names none)
    for c in cells:
        key = (c.get("arm"), c.get("level"), c.get("round"), bool(c.get("warmup")))
        a = arms.setdefault(key[0], {"arm": key[0], "cells": 0, "counter_cells": 0, "request_cells": 0,
                                     "cross_checked": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0,
                                     "sources": set(), "problems": [], "metrics_cells": 0,
                                     "metrics_missing": set(), "unattributed": [],
                                     "cell_verdicts": {PASS: 0, FAIL: 0, CANNOT_TEST: 0}})
        a["cells"] += 1
        n_problems = len(a["problems"])
        delta: dict = c.get("counters") or {}
        have_counters = delta.get("num_drafts") is not None
        rs = reqs.get(key, [])
        ok = [r for r in rs if r.get("ok")]
        per = [p for p in (r.get("spec") for r in ok) if isinstance(p, dict)]
        # every request of the cell succeeded and carries its per-request draft counts
        have_per = bool(ok) and len(per) == len(rs) and all(p.get("num_draft_tokens") is not None for p in per)
        sm = c.get("server_metrics")
        why, windowed = None, False
        if isinstance(sm, dict):
            w = audit_window(sm.get("before"), sm.get("after"), rs, k=sm.get("k"), per_step=bool(sm.get("per_step")),
                             label=_name(key))
            why, windowed = w.get("unattributed"), w["verdict"] != CANNOT_TEST
            a["metrics_cells"] += windowed
            a["problems"] += w["problems"]
            a["metrics_missing"] |= {m.split(": ", 1)[-1] for m in w["missing"]} - {why}
        if why:  # the cell's counter delta is not this cell's alone: nothing of it is judged (never a FAIL)
            a["unattributed"].append(f"{_name(key)}: {why}")
            a["cell_verdicts"][CANNOT_TEST] += 1
            continue
        if have_counters:
            a["counter_cells"] += 1
            a["sources"].add(f"counters ({delta.get('prefix') or delta.get('source') or '?'})")
            a["drafts"] += int(delta.get("num_drafts") or 0)
            a["draft_tokens"] += int(delta.get("num_draft_tokens") or 0)
            a["accepted"] += int(delta.get("num_accepted_tokens") or 0)
            a["problems"] += [f"{_name(key)}: {b}" for b in counter_invariants(delta)]
        if have_per:
            a["request_cells"] += 1
            a["sources"].add("per-request (" + ", ".join(sorted({str(p.get("source") or "engine") for p in per})) + ")")
            sums = {k: sum(int(p.get(k) or 0) for p in per) for k in ("num_draft_tokens", "num_accepted_tokens")}
            if all(p.get("num_drafts") is not None for p in per):
                sums["num_drafts"] = sum(int(p["num_drafts"]) for p in per)
            if have_counters:
                a["cross_checked"] += 1
                for k, v in sums.items():
                    cv = delta.get(k)
                    if cv is not None and int(cv) != v:
                        a["problems"].append(f"{_name(key)}: per-request {k} sum {v} != counters {int(cv)}")
            elif "num_drafts" in sums:
                pp: list[int] = []
                for p in per:
                    for i, x in enumerate(p.get("accepted_per_pos") or []):
                        pp += [0] * (i + 1 - len(pp))
                        pp[i] += int(x)
                a["problems"] += [f"{_name(key)}: {b}" for b in counter_invariants({**sums, "accepted_per_pos": pp})]
        judged = have_counters or have_per or windowed
        a["cell_verdicts"][FAIL if len(a["problems"]) > n_problems else (PASS if judged else CANNOT_TEST)] += 1
    out_arms = []
    for a in arms.values():
        a["sources"] = sorted(a["sources"])
        a["metrics_missing"] = sorted(a["metrics_missing"])
        if a["problems"]:
            a["verdict"] = FAIL
        elif not a["counter_cells"] and not a["request_cells"]:
            a["verdict"] = CANNOT_TEST
            a["missing"] = "spec counters and per-request draft counts" + (
                f"; {len(a['unattributed'])} cells whose counters could not be attributed" if a["unattributed"] else "")
        elif a["unattributed"]:
            a["verdict"] = CANNOT_TEST
            a["missing"] = (f"{len(a['unattributed'])} of {a['cells']} cells whose counters could not be attributed "
                            f"to them: {'; '.join(a['unattributed'][:3])}"
                            + (f" and {len(a['unattributed']) - 3} more" if len(a["unattributed"]) > 3 else ""))
        else:
            a["verdict"] = PASS
        checks = []
        if a["counter_cells"]:
            checks.append(f"counter invariants on {a['counter_cells']}/{a['cells']} cells")
        if a["cross_checked"]:
            checks.append(f"per-request sums = counters on {a['cross_checked']} cells")
        elif a["counter_cells"]:
            checks.append("no per-request counts to cross-check the counters with")
        if a["request_cells"] and not a["counter_cells"]:
            checks.append(f"per-request counts on {a['request_cells']} cells (no counters)")
        if a["metrics_cells"]:
            checks.append(f"client-side metrics audit on {a['metrics_cells']}/{a['cells']} cells (requests, tokens, "
                          "spec counters vs output, gauges after)"
                          + (f"; not checked: {', '.join(a['metrics_missing'])}" if a["metrics_missing"] else ""))
        a["checks"] = checks
        out_arms.append(a)
    verdict = combine([a["verdict"] for a in out_arms]) if out_arms else CANNOT_TEST
    missing = [f"{a['arm']}: {a['missing']}" for a in out_arms if a.get("missing")]
    if not out_arms:
        missing.append("no cell was recorded")
    return {"verdict": verdict, "arms": out_arms, "missing": missing}
