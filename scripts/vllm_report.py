#!/usr/bin/env python3
"""Build a run's `h200-vllm.json` (what scripts/readme_numbers.py and the README read) from what
`scripts/gpu.sh vllm` / `vllm-client` brought back: the suite's summary-*.json, each gate's JSON and the sweep's
sweep-summary.json (scripts/vllm_suite.py writes them all under $W/vllm/).

    python scripts/vllm_report.py --run DIR --out reports/h200-vllm/DATE/h200-vllm.json [--client DIR]

DIR is the unpacked `vllm/` folder of a call's results.tgz. Nothing is typed in by hand: every figure comes
from those files, so the report can be rebuilt and checked."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAIRS = (("sb-4b-off", "vllm-4b-off"), ("sb-4b-ngram", "vllm-4b-ngram"), ("sb-4b-dflash", "vllm-4b-off"))


def _ms(stats: dict, key: str, q: str = "median") -> float | None:
    v = (stats or {}).get(key)
    return round(v[q] * 1000, 2) if isinstance(v, dict) and v.get(q) is not None else None


def verdicts(run: Path) -> dict:
    out = {}
    for p in sorted(run.glob("*.json")):
        if p.name.startswith(("summary", "sweep", "client")):
            continue
        d = json.loads(p.read_text())
        if not isinstance(d, dict) or "verdict" not in d:
            continue
        s = d.get("summary") if isinstance(d.get("summary"), dict) else {}
        row = {"verdict": d["verdict"]}
        if s:
            row.update(gates=s.get("gates"), mean_accept_len=s.get("mean_accept_len"), flips=s.get("flips"),
                       prompts=s.get("prompts"), failed_prompts=s.get("failed_prompts"))
        if "comparisons" in d:  # the sampled gate
            row.update(cells={k: {"testable": v.get("testable"), "rejected": v.get("rejected")}
                              for k, v in d["comparisons"].items()},
                       mean_accept_len=(d.get("spec") or {}).get("mean_accept_len"))
        out[p.stem] = row
    return out


def sweep(run: Path) -> dict | None:
    p = run / "sweep-summary.json"
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    levels = []
    for L in d["levels"]:
        row: dict = {"concurrency": int(L["level"]), "noise_floor": (L.get("noise") or {}).get("noise"),
                     "noise_rounds": (L.get("noise") or {}).get("ratios")}
        for arm in [a["label"] for a in d["arms"]]:
            a = L.get(arm)
            if not a:
                continue
            acc = a.get("acceptance") or {}
            row[arm] = {"tok_s_per_round": list(a["tok_s_rounds"].values()), "tok_s_median": a["tok_s_median"],
                        "tpot_ms_median": _ms(a["stats"], "tpot"), "ttft_ms_median": _ms(a["stats"], "ttft"),
                        "ttft_ms_p90": _ms(a["stats"], "ttft", "p90"), "acceptance_length": acc.get("length"),
                        "acceptance_source": acc.get("source")}
        for x, y in PAIRS:
            r = L.get(f"{x}/{y}")
            if r and r.get("median") is not None:
                row[f"ratio {x}/{y}"] = r
        levels.append(row)
    return {"run_id": d["run_id"], "complete": d["complete"], "baseline": d["baseline"], "noise_arm": d["noise_arm"],
            "config": (d.get("meta") or {}).get("config"), "levels": levels}


def build(run: Path, client: Path | None) -> dict:
    summ = json.loads(next(iter(sorted(run.glob("summary-*.json")))).read_text())
    ver = summ.get("versions") or {}
    servers = {n: {"argv": s.get("argv"), "startup_s_to_health": s.get("startup_s"), "gpu_mib": s.get("gpu_mib"),
                   "bundled_warm_up": s.get("warm"), "warmup_s": s.get("warmup_s")}
               for n, s in (summ.get("servers") or {}).items() if s.get("argv")}
    doc = {"date": summ["started"][:10], "commit": ver.get("commit"), "device": ver.get("driver"), "versions": ver,
           "servers": servers, "verdicts": verdicts(run), "sweep": sweep(run)}
    cp = (client or run) / "client-compare.json"
    if cp.is_file():
        doc["client_compare"] = json.loads(cp.read_text())
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, type=Path, help="the unpacked vllm/ folder of a gpu.sh vllm call")
    ap.add_argument("--client", type=Path, help="the vllm/ folder of a vllm-client call (client-compare.json)")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(build(a.run, a.client), indent=1, default=str) + "\n")
    print(a.out)


if __name__ == "__main__":
    main()
