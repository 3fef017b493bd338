"""Sweep records -> `RunSummary`: per level and arm figures, paired speedups, the noise floor.

Contract: a pure function of the records one sweep wrote (`sweep` meta record, `request` and `cell`
records, see suites/sweep/runner.py). Warm-up records are ignored. For each (arm, level):
- `tok_s[r]`, `req_s[r]`: output tok/s and req/s of round r's cell (completed requests' usage tokens
  / cell wall time); the table figures are medians over rounds.
- `stats`: `metrics.cell_stats` over the requests of all rounds pooled (latency distributions, token
  totals; throughput there is pooled over the summed cell time).
- `acceptance`: per-request counts of all rounds, else the summed counter deltas of its cells.
Speedups pair each arm with the baseline round by round (`compare.speedup`); the noise floor pairs the
baseline with its copy (`compare.noise_floor`). A run with missing cells (interrupted) still
summarizes; `complete` says whether every planned cell is there. `audit` is the acceptance / metrics
audit over all the records, warm-up included (suites/sweep/audit.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from specbench.suites.sweep.audit import audit_records
from specbench.suites.sweep.compare import noise_floor, speedup
from specbench.suites.sweep.metrics import acceptance, cell_stats, finish_groups


@dataclass
class ArmLevel:
    arm: str
    level: float
    tok_s: dict[int, float | None]
    stats: dict
    acceptance: dict | None
    req_s: dict[int, float | None] = field(default_factory=dict)
    client_busy: float | None = None  # the client's event loop, busiest round (cell `client.busy`)
    client_saturated: bool = False  # some round's cell says the client was saturated
    finish_groups: float | None = None  # finish groups per request (metrics.finish_groups): ~1/c = lockstep waves

    @property
    def tok_s_median(self) -> float | None:
        return _median(self.tok_s)

    @property
    def req_s_median(self) -> float | None:
        return _median(self.req_s)


def _median(d: dict[int, float | None]) -> float | None:
    import numpy as np

    v = [x for x in d.values() if x is not None]
    return float(np.median(v)) if v else None


@dataclass
class RunSummary:
    run_id: str
    meta: dict
    arms: list[dict]  # {label, engine, copy_of, description}
    baseline: str | None
    noise_arm: str | None
    level_kind: str  # "concurrency" | "rate"
    levels: list[float]
    cells: dict[tuple[str, float], ArmLevel] = field(default_factory=dict)
    speedups: dict[tuple[str, float], dict | None] = field(default_factory=dict)
    noise: dict[float, dict | None] = field(default_factory=dict)
    complete: bool = True
    audit: dict | None = None

    @property
    def compared_arms(self) -> list[str]:
        """Arms shown in tables: all but the noise copy."""
        return [a["label"] for a in self.arms if not a.get("copy_of")]

    @property
    def spec_arms(self) -> list[str]:
        return [a for a in self.compared_arms
                if any(c.acceptance for (arm, _), c in self.cells.items() if arm == a)]

    def get(self, arm: str, level: float) -> ArmLevel | None:
        return self.cells.get((arm, level))


def _sum_counters(items: list[dict | None]) -> dict | None:
    counted = [c for c in items if c and c.get("num_drafts") is not None]
    if not counted:
        return None
    width = max(len(c.get("accepted_per_pos") or []) for c in counted)
    per_pos = [0] * width
    out: dict = {"source": counted[0].get("source"), "accepted_per_pos": per_pos}
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        out[k] = sum(int(c.get(k) or 0) for c in counted)
    for c in counted:
        for i, v in enumerate(c.get("accepted_per_pos") or []):
            per_pos[i] += int(v)
    return out


def _pool_given(items: list[dict]) -> dict:
    """Imported cells' own stats over rounds: totals summed, throughput over the summed time, latency means
    weighted by completed requests; percentiles only for a single round (they do not pool)."""
    if len(items) == 1:
        return items[0]
    out: dict = {k: sum(int(x.get(k) or 0) for x in items)
                 for k in ("requests", "completed", "failed", "output_tokens", "input_tokens")}
    dur = sum(float(x.get("duration") or 0.0) for x in items)
    out["duration"] = dur
    for k, num in (("output_tok_s", "output_tokens"), ("req_s", "completed")):
        out[k] = out[num] / dur if dur > 0 else None
    out["total_tok_s"] = (out["output_tokens"] + out["input_tokens"]) / dur if dur > 0 else None
    for m in ("ttft", "tpot", "e2el", "itl", "chunk_gap"):
        w = [(x[m]["mean"], x["completed"]) for x in items if x.get(m) and x[m].get("mean") is not None]
        n = sum(c for _, c in w)
        out[m] = {"n": n, "mean": sum(v * c for v, c in w) / n if n else None, "median": None, "p90": None,
                  "p99": None}
    return out


def _flat(r: dict) -> dict:
    """A stored request record with the sweep keys its meta carries lifted to the top."""
    m = r.get("meta") or {}
    return {**r, **{k: m[k] for k in ("level", "level_kind", "warmup", "copy_of") if k in m}}


def summarize(records: list[dict], run_id: str = "run", run_meta: dict | None = None) -> RunSummary:
    """`records`: the run's sweep meta, request and cell records, each tagged with "kind"."""
    meta = next((r for r in records if r.get("kind") == "sweep"), {})
    cfg = meta.get("config", {})
    arms = list(meta.get("arms") or [])
    cells = [r for r in records if r.get("kind") == "cell" and not r.get("warmup")]
    reqs = [f for r in records if r.get("kind") == "request" and not (f := _flat(r)).get("warmup")
            and f.get("level") is not None]
    if not arms:  # meta missing (a truncated file): recover arms from the records themselves
        seen: dict[str, dict] = {}
        for r in cells + reqs:
            seen.setdefault(r["arm"], {"label": r["arm"], "engine": None, "copy_of": r.get("copy_of")})
        arms = list(seen.values())
    kind = (cells or reqs or [{}])[0].get("level_kind") or ("rate" if cfg.get("mode") == "open" else "concurrency")
    planned = [float(x) for x in cfg.get("levels") or []]
    seen_levels = sorted({float(r["level"]) for r in cells + reqs})
    levels = [x for x in planned if x in seen_levels] + [x for x in seen_levels if x not in planned]
    copy = next((a for a in arms if a.get("copy_of")), None)
    baseline = meta.get("baseline") or (copy["copy_of"] if copy else (arms[0]["label"] if arms else None))
    s = RunSummary(run_id=run_id, meta={**(run_meta or {}), **meta}, arms=arms, baseline=baseline,
                   noise_arm=copy["label"] if copy else None, level_kind=kind, levels=levels,
                   audit=audit_records(records))

    by_cell: dict[tuple[str, float, int], list[dict]] = defaultdict(list)
    for r in reqs:
        by_cell[(r["arm"], float(r["level"]), int(r["round"]))].append(r)
    cell_rec = {(c["arm"], float(c["level"]), int(c["round"])): c for c in cells}
    for a in arms:
        for lv in levels:
            rounds = sorted({k[2] for k in set(by_cell) | set(cell_rec) if k[0] == a["label"] and k[1] == lv})
            if not rounds:
                continue
            tok_s: dict[int, float | None] = {}
            req_s: dict[int, float | None] = {}
            all_reqs: list[dict] = []
            total_time, counters = 0.0, []
            given: list[dict | None] = []
            busy: list[float] = []
            sat = False
            for rnd in rounds:
                rr, c = by_cell.get((a["label"], lv, rnd), []), cell_rec.get((a["label"], lv, rnd))
                if c is None:  # an interrupted cell: its requests stay in the pooled latencies only
                    all_reqs += rr
                    continue
                # an imported cell (suites/sweep/vllm_import.py) carries the other tool's own figures as `stats`
                st = c.get("stats") or cell_stats(rr, duration=c.get("duration"), counters=c.get("counters"))
                tok_s[rnd], req_s[rnd] = st["output_tok_s"], st["req_s"]
                all_reqs += rr
                total_time += c.get("duration") or 0.0
                counters.append(c.get("counters"))
                given.append(c.get("stats"))
                b = (c.get("client") or {}).get("busy")
                if b is not None:
                    busy.append(float(b))
                sat = sat or bool((c.get("client") or {}).get("saturated"))
            summed = _sum_counters(counters)
            if given and all(g is not None for g in given):
                pooled = _pool_given(given)  # type: ignore[arg-type]
            else:
                pooled = cell_stats(all_reqs, duration=total_time or None, counters=summed)
            s.cells[(a["label"], lv)] = ArmLevel(a["label"], lv, tok_s, pooled, acceptance(all_reqs, summed), req_s,
                                                 max(busy) if busy else None, sat, finish_groups(all_reqs))
    for lv in levels:
        base = s.get(baseline, lv) if baseline else None
        for a in s.compared_arms:
            cur = s.get(a, lv)
            if a != baseline and base and cur:
                s.speedups[(a, lv)] = speedup(base.tok_s, cur.tok_s)
        cp = s.get(s.noise_arm, lv) if s.noise_arm else None
        s.noise[lv] = noise_floor(base.tok_s, cp.tok_s) if base and cp else None
    n_rounds = int(cfg.get("rounds") or 0)
    expected = len(planned) * len(arms) * n_rounds if planned and n_rounds else None
    s.complete = bool(meta) and expected is not None and len(cells) >= expected and \
        not (run_meta or {}).get("incomplete", False)
    return s
