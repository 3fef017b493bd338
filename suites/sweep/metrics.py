"""Serving metrics of a sweep, per request and per cell (one arm at one load level in one round).

Definitions follow REFERENCE.md section 3:
- TTFT = first content chunk - send; E2EL = the chunk that completes the last output token - send;
  TPOT = (E2EL - TTFT) / (output_tokens - 1), None for a single-token output.
- Output tokens are the engine's usage count. Streamed per-chunk counts are reconciled to it
  (`reconcile_chunks`): tokens streamed past the usage count (tokens after EOS) are dropped, a
  shortfall is booked to the last chunk. So an EOS inside a multi-token chunk counts only the tokens
  up to it, and E2EL ends at the chunk carrying the last counted token.
- Per-token ITL spreads each chunk gap evenly over the tokens that chunk carries; raw chunk gaps are
  reported separately (under speculation a chunk carries ~acceptance-length tokens).
- Failed requests count in `failed` only: no tokens, no latencies.
- Acceptance: per-request spec counts where every successful request has them (source "request"; or
  "counters-c1" when they are counter deltas around each request at c1, suites/sweep/runner.py),
  else the cell's spec-counter delta (source "counters": server-wide, may include other traffic),
  else none. Rate = accepted / draft tokens; length = 1 + accepted / drafts. Token-weighted length is
  pooled over all verify steps (total committed tokens per verify step, what the counters give);
  request-mean length is the mean over requests of each request's own length (needs per-request
  counts). Per-position rate i = accepted at position i / drafts (non-increasing in i).

Everything here is a pure function of request record dicts (harness.results.RequestRecord as stored,
or `request_record(GenResult)`), so a report recomputes it from the stored JSONL. Each per-request metric is
computed by its one function in harness/latency.py (which a live GenResult calls too); `derive` feeds it a
record's chunk offsets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from specbench.harness.latency import chunk_gaps, counted_chunks, offsets, token_itls, tpot
from specbench.harness.latency import (
    reconcile_chunks as reconcile_chunks,  # vllm_format.py reads it from here
)

LATENCIES = ("ttft", "e2el", "tpot", "itl", "chunk_gap")
PERCENTILES = (50, 90, 99)


def request_record(res: Any) -> dict:
    """The fields of one `GenResult` these metrics read, shaped like harness.results.RequestRecord:
    chunk_offsets are chunk arrival - send (s); ttft / e2el as the adapter measured them."""
    return {
        "rid": res.rid, "ok": bool(res.ok), "error": res.error, "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens, "wall_send": res.wall_send,
        "ttft": res.ttft, "e2el": res.e2el, "chunk_offsets": offsets(res.t_send, res.chunk_times),
        "chunk_tokens": list(res.chunk_tokens), "token_count_method": res.token_count_method, "spec": res.spec,
        "attempts": res.attempts, "meta": dict(res.meta),
    }


def _spec_counts(spec: dict | None) -> dict | None:
    if not spec:
        return None
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
    out = {k: spec[k] for k in keys if k in spec}
    return out if "num_drafts" in out and "num_accepted_tokens" in out else None


def derive(rec: dict) -> dict:
    """Per-request metrics of one request record: output_tokens, ttft, e2el, tpot, itls, chunk_gaps."""
    if not rec.get("ok"):
        return {"ok": False, "output_tokens": 0, "ttft": None, "e2el": None, "tpot": None, "itls": [],
                "chunk_gaps": []}
    times = list(rec.get("chunk_offsets") or [])
    n = rec.get("completion_tokens")
    if n is None:
        n = sum(rec.get("chunk_tokens") or [])
    kept = counted_chunks(times, rec.get("chunk_tokens"), n)
    ttft: float | None
    e2el: float | None
    if kept:
        ttft, e2el = kept[0][0], kept[-1][0]
    else:  # no streamed chunks: the whole response arrived at once
        ttft, e2el = rec.get("ttft"), rec.get("e2el")
        if ttft is None:
            ttft = e2el
    return {"ok": True, "output_tokens": int(n or 0), "ttft": ttft, "e2el": e2el, "tpot": tpot(ttft, e2el, n),
            "itls": token_itls(kept), "chunk_gaps": chunk_gaps(kept)}


def summary(values: Iterable[float | None]) -> dict:
    """mean / median / p90 / p99 (numpy linear percentiles) and n of the non-None values."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if v.size == 0:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None}
    p50, p90, p99 = (float(np.percentile(v, p)) for p in PERCENTILES)
    return {"n": int(v.size), "mean": float(v.mean()), "median": p50, "p90": p90, "p99": p99}


def acceptance(requests: Sequence[dict], counters: dict | None = None) -> dict | None:
    """Acceptance of a set of successful request records, else of a counter delta (labelled)."""
    ok = [r for r in requests if r.get("ok")]
    per_req = [_spec_counts(r.get("spec")) for r in ok]
    if ok and all(s is not None for s in per_req):
        c1 = all((r.get("spec") or {}).get("source") == "counters-c1" for r in ok)
        return _from_counts(per_req, "counters-c1" if c1 else "request")  # type: ignore[arg-type]
    if counters and counters.get("num_drafts") is not None:  # an imported file's counters keep their origin
        return _from_counts([counters], "vllm-bench" if counters.get("source") == "vllm-bench" else "counters")
    return None


def _from_counts(items: Sequence[dict], source: str) -> dict | None:
    drafts = sum(int(s.get("num_drafts") or 0) for s in items)
    if drafts <= 0:
        return None
    draft_tokens = sum(int(s.get("num_draft_tokens") or 0) for s in items)
    accepted = sum(int(s.get("num_accepted_tokens") or 0) for s in items)
    width = max((len(s.get("accepted_per_pos") or []) for s in items), default=0)
    per_pos = [0] * width
    for s in items:
        for i, v in enumerate(s.get("accepted_per_pos") or []):
            per_pos[i] += int(v)
    out = {"source": source, "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
           "rate": accepted / draft_tokens if draft_tokens else None, "length": 1.0 + accepted / drafts,
           "length_request_mean": None, "rate_request_mean": None,
           "per_pos": [v / drafts for v in per_pos], "accepted_per_pos": per_pos}
    if source in ("request", "counters-c1"):
        lens = [1.0 + s["num_accepted_tokens"] / s["num_drafts"] for s in items if s.get("num_drafts")]
        rates = [s["num_accepted_tokens"] / s["num_draft_tokens"] for s in items if s.get("num_draft_tokens")]
        out["length_request_mean"] = float(np.mean(lens)) if lens else None
        out["rate_request_mean"] = float(np.mean(rates)) if rates else None
    return out


def cell_stats(requests: Sequence[dict], duration: float | None = None, counters: dict | None = None) -> dict:
    """Aggregate of one cell. `duration` is the cell's wall time (first send to last response); when
    None it is taken from the records."""
    derived = [derive(r) for r in requests]
    ok = [(r, d) for r, d in zip(requests, derived, strict=True) if d["ok"]]
    if duration is None:
        sends = [r["wall_send"] for r in requests if r.get("wall_send") is not None]
        ends = [r["wall_send"] + r["e2el"] for r in requests if r.get("wall_send") is not None and r.get("e2el")]
        duration = (max(ends) - min(sends)) if sends and ends else None
    out_tok = sum(d["output_tokens"] for _, d in ok)
    in_tok = sum(int(r.get("prompt_tokens") or 0) for r, _ in ok)
    rate = (lambda x: x / duration) if duration and duration > 0 else (lambda x: None)
    stats: dict[str, Any] = {
        "requests": len(requests), "completed": len(ok), "failed": len(requests) - len(ok), "duration": duration,
        "output_tokens": out_tok, "input_tokens": in_tok, "output_tok_s": rate(out_tok), "req_s": rate(len(ok)),
        "total_tok_s": rate(out_tok + in_tok),
    }
    for name in ("ttft", "e2el", "tpot"):
        stats[name] = summary(d[name] for _, d in ok)
    stats["itl"] = summary(x for _, d in ok for x in d["itls"])
    stats["chunk_gap"] = summary(x for _, d in ok for x in d["chunk_gaps"])
    stats["acceptance"] = acceptance(requests, counters)
    return stats


def finish_groups(reqs: list[dict]) -> float | None:
    """Finish groups per request of one arm at one level, median over its rounds (request records: round,
    wall_send, e2el, tpot, ok): requests whose ends lie within half a TPOT (the round's median) of the one before
    finished in the same engine step. ~1/c: the level ran in lockstep waves (requests of one length that started
    together finish together, and their successors' prefills share a step); ~1: every request finished apart."""
    import statistics

    rounds: dict[int, list[tuple[float, float]]] = {}
    for r in reqs:
        if not r.get("ok") or r.get("wall_send") is None or r.get("e2el") is None:
            continue
        rounds.setdefault(int(r.get("round", 0)), []).append((r["wall_send"] + r["e2el"], r.get("tpot") or 0.0))
    out = []
    for ends in rounds.values():
        if len(ends) < 2:
            continue
        tpots = sorted(t for _, t in ends if t > 0)
        gap = 0.5 * tpots[len(tpots) // 2] if tpots else 0.0
        fins = sorted(e for e, _ in ends)
        out.append((1 + sum(1 for a, b in zip(fins, fins[1:], strict=False) if b - a > gap)) / len(fins))
    return statistics.median(out) if out else None


LOCKSTEP = 0.25  # the baseline's finish groups per request below this at a level >= 8: its waves ran in lockstep


def broke_lockstep(level: float, base: float | None, arm: float | None) -> bool:
    """Whether, at this concurrency, the baseline ran in lockstep waves (finish groups per request `base` below
    LOCKSTEP, from c8 on) and the arm spread its finishes (at least twice the baseline's groups): its speedup there
    measures the lockstep as much as the arm."""
    return level >= 8 and base is not None and base < LOCKSTEP and (arm or 0.0) >= 2 * base
