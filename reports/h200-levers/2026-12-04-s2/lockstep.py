"""How a sweep cell's requests shared the engine's steps: per arm and round at one concurrency, from a sweep's
requests.jsonl (the per-request records `specbench sweep` / `tune` keep in their results store).

  finish clusters   groups of requests finishing within 2 ms of each other: a wave of equal lengths that runs in
                    lockstep finishes in a few, and its successors' prefills share a few steps
  long steps        the gaps between consecutive token arrivals (any request) of 7-30 ms: on the H200 at c64 a
                    one-token round takes ~4 ms, a step that carries a new request's prefill 12-30 ms
  TPOT              the median over requests

Usage: python reports/h200-levers/2026-12-04-s2/lockstep.py RUN_DIR [--level 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def analyse(run: Path, level: int) -> list[dict]:
    rows = [json.loads(x) for x in (run / "requests.jsonl").open()]
    out = []
    keys = sorted({(r["arm"], r["round"]) for r in rows if r["round"] >= 0 and f"/c{level}/" in r["rid"]},
                  key=lambda k: (k[1], k[0]))
    for arm, rnd in keys:
        sel = [r for r in rows if r["arm"] == arm and r["round"] == rnd and f"/c{level}/" in r["rid"] and r["ok"]]
        t0 = min(r["wall_send"] for r in sel)
        fins = sorted(r["wall_send"] + r["e2el"] for r in sel)
        clusters = 0
        last = None
        for f in fins:
            if last is None or f - last > 0.002:
                clusters += 1
            last = f
        arrivals = sorted(r["wall_send"] + o for r in sel for o in r["chunk_offsets"])
        steps: list[float] = []
        for t in arrivals:
            if not steps or t - steps[-1] > 0.0008:
                steps.append(t)
        gaps = [(b - a) * 1e3 for a, b in zip(steps, steps[1:], strict=False)]
        long_ = [g for g in gaps if 7 < g < 30]
        out.append({"arm": arm, "round": rnd, "requests": len(sel), "wall_s": round(fins[-1] - t0, 3),
                    "finish_clusters": clusters, "long_steps": len(long_), "long_steps_ms": round(sum(long_), 1),
                    "tpot_ms": round(statistics.median(r["tpot"] for r in sel if r.get("tpot")) * 1e3, 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--level", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res = analyse(a.run, a.level)
    print("| arm | round | wall s | finish clusters | steps of 7-30 ms | their ms | TPOT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for x in res:
        print(f"| {x['arm']} | {x['round']} | {x['wall_s']:.3f} | {x['finish_clusters']} | {x['long_steps']} | "
              f"{x['long_steps_ms']:.0f} | {x['tpot_ms']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"run": a.run.name, "level": a.level, "cells": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
