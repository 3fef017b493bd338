"""Write the README's "Measured on one H200" section from the committed report files, so the README claims
exactly what the shipped reports hold.

    .venv/bin/python scripts/readme_numbers.py          # rewrite the section in README.md
    .venv/bin/python scripts/readme_numbers.py --check  # exit 1 (with a diff) if README.md differs

The whole section, from its heading to the next `## `, is this script's output: a number typed into it by
hand fails the check (tests/test_readme_numbers.py, run by `make test`). Sources:

- the engine speed report: the newest complete `reports/h200-engine/*/speed.json` (benchmarks/speed.py;
  plain decode against the dense floor, step costs, spec vs plain at synthetic acceptance);
- the harness sweep at synthetic acceptance: `reports/h200-qwen3-4b-shape/sweep.md` (`specbench sweep`
  through the local adapter, its own table);
- beside vLLM: `reports/h200-vllm/h200-vllm.json` (docs/vllm.md; the bundled engine's spec-off tok/s over
  vLLM's, per level, with the run's paired noise floor);
- load-aware speculation: `reports/h200-levers/levers.json` (`specbench tune` sections, docs/levers.md): per
  synthetic tau and workload (every request one length, or lengths spread), the newest run with the automatic
  span policy.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Measured on one H200"


class ReportMissing(RuntimeError):
    pass


def _rel(p: Path, root: Path) -> str:
    return str(p.relative_to(root))


def speed_report(root: Path) -> tuple[Path, dict]:
    """The newest complete engine speed report (by its own date, then path)."""
    found = []
    for p in sorted((root / "reports" / "h200-engine").glob("*/speed.json")):
        d = json.loads(p.read_text(encoding="utf-8"))
        if d.get("complete"):
            found.append((str(d["environment"]["date"]), str(p), p, d))
    if not found:
        raise ReportMissing("no complete reports/h200-engine/*/speed.json")
    _, _, p, d = max(found)
    return p, d


# a row of the sweep report's throughput table: | c1 | 70.0 | 39.6 | ~0.63× [0.46–0.80] | ±73.5% (A'/A 1.708) | ...
SWEEP_ROW = re.compile(r"^\| c(\d+) \| ([\d.]+) \| ([\d.]+) \| (~?)([\d.]+)× \[([\d.]+)–([\d.]+)\] \| ±([\d.]+)% ")


def sweep_report(root: Path) -> tuple[Path, dict]:
    p = root / "reports" / "h200-qwen3-4b-shape" / "sweep.md"
    text = p.read_text(encoding="utf-8")
    levels = {}
    for line in text.splitlines():
        m = SWEEP_ROW.match(line)
        if m:
            c, base, arm, within, med, lo, hi, noise = m.groups()
            levels[int(c)] = {"base": float(base), "arm": float(arm), "within_noise": bool(within),
                              "median": float(med), "min": float(lo), "max": float(hi), "noise_pct": float(noise)}
    tau = re.search(r"synthetic acceptance tau=([\d.]+)", text)
    started = re.search(r"started (\d{4}-\d\d-\d\d)", text)
    if not levels or not tau or not started:
        raise ReportMissing(f"{p}: no throughput table with a synthetic tau and a start date")
    return p, {"levels": levels, "tau": tau.group(1), "date": started.group(1)}


def vllm_report(root: Path) -> tuple[Path, dict]:
    """The newest run: reports/h200-vllm/<date>/h200-vllm.json (scripts/vllm_report.py), else the first run's."""
    base = root / "reports" / "h200-vllm"
    dated = sorted(base.glob("20*/h200-vllm.json"))
    p = dated[-1] if dated else base / "h200-vllm.json"
    return p, json.loads(p.read_text(encoding="utf-8"))


def levers_report(root: Path) -> tuple[Path, list[dict]]:
    """Per (synthetic tau, workload) the newest `specbench tune` section with the automatic policy: workload
    "spread" where its settings (or, for runs before they were recorded, its name) say output lengths differ."""
    p = root / "reports" / "h200-levers" / "levers.json"
    if not p.is_file():
        return p, []
    newest: dict[tuple[str, bool], dict] = {}
    for name, res in json.loads(p.read_text(encoding="utf-8"))["sections"].items():
        tau = re.match(r"synthetic tau ([\d.]+)", name)
        stamp = re.search(r"sweep-(\d{8})-(\d{6})", str(res.get("run_dir") or ""))
        if not tau or not stamp or not res.get("per_level") or "spec-auto" not in res["per_level"][0]["arms"]:
            continue
        spread = float((res.get("settings") or {}).get("max_tokens_spread") or 0.0) > 0 or "output lengths" in name
        key = (tau.group(1), spread)
        run = {"name": name, "tau": tau.group(1), "spread": spread, "stamp": stamp.groups(), "res": res}
        if key not in newest or run["stamp"] > newest[key]["stamp"]:
            newest[key] = run
    return p, sorted(newest.values(), key=lambda r: (r["spread"], -float(r["tau"])))


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _span(s: dict) -> str:
    return f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"


def render(root: Path = ROOT) -> str:
    sp, speed = speed_report(root)
    wp, sweep = sweep_report(root)
    vp, vllm = vllm_report(root)
    env, st = speed["environment"], speed["settings"]
    plain, dense = speed["plain_ms_per_step"], speed["dense_floor_ms"]
    steps, spec = speed["steps_b1"], speed["spec_speedup"]
    lv = [str(c) for c in st["levels"]]
    first, last = lv[0], lv[-1]
    lines = [
        HEADING,
        "",
        "Written by `scripts/readme_numbers.py` from the committed reports named in each row (`make test` fails "
        "if this section and the reports disagree); docs/gpu.md and docs/vllm.md have the commands.",
        "",
        "| what | figure | report |",
        "|---|---|---|",
    ]
    src = f"[{_rel(sp, root)}]({_rel(sp, root)}) ({env['date'][:10]}, `{env['commit'].split()[0]}`)"
    lines += [
        f"| plain decode step, c{first}, Qwen3-4B-shaped random pair, bf16 | {plain[first]['median']:.2f} ms "
        f"({_x(plain[first]['over_dense'])} the dense floor {dense[first]['median']:.2f} ms) | {src} |",
        f"| plain decode step, c{last} | {plain[last]['median']:.2f} ms ({_x(plain[last]['over_dense'])} the dense "
        f"floor) | {src} |",
        f"| verify step (span {steps['span']}) / batched DFlash draft, batch 1, context {steps['context']} | "
        f"{steps['verify_ms']['median']:.2f} ms / {steps['draft_ms']['median']:.2f} ms | {src} |",
    ]
    lines += [f"| spec vs plain tokens/s at synthetic tau {st['tau']}, c{c} (median [min, max] of "
              f"{spec[c]['n']}) | {_span(spec[c])} | {src} |" for c in (first, "32", last) if c in spec]
    wsrc = f"[{_rel(wp, root)}]({_rel(wp, root)}) ({sweep['date']})"
    for c, row in sorted(sweep["levels"].items()):
        note = " (within the noise floor)" if row["within_noise"] else ""
        lines.append(f"| `specbench sweep`, spec (synthetic tau {sweep['tau']}) vs off, c{c} | {row['median']:.2f}x "
                     f"[{row['min']:.2f}, {row['max']:.2f}], noise floor ±{row['noise_pct']:.1f}%{note} | {wsrc} |")
    vsrc = f"[{_rel(vp, root)}]({_rel(vp, root)}) ({vllm['date']})"
    vver = vllm["versions"]["vllm"]["vllm"]
    for L in vllm["sweep"]["levels"]:
        r = L.get("ratio sb-4b-off/vllm-4b-off")
        if r is None:
            continue
        rounds = len(r.get("per_round") or [])
        if L.get("noise_floor") is None:  # a level the run's deadline cut short: no interleaved baseline copy
            fig = f"{_x(r['median'])} ({rounds} round{'s' if rounds != 1 else ''}, no noise floor)"
        else:
            nf = L["noise_floor"] * 100
            note = " (within the noise floor)" if abs(r["median"] - 1) <= L["noise_floor"] else ""
            fig = f"{_x(r['median'])}, noise floor ±{nf:.1f}%{note}"
        lines.append(f"| bundled engine spec-off tokens/s over vLLM {vver} spec-off, c{L['concurrency']} | "
                     f"{fig} | {vsrc} |")
    lp, runs = levers_report(root)
    for run in runs:
        d = run["stamp"][0]
        lsrc = f"[{_rel(lp, root)}]({_rel(lp, root)}) ({d[:4]}-{d[4:6]}-{d[6:]}, section \"{run['name']}\")"
        cells = []
        for row in run["res"]["per_level"]:
            a = row["arms"]["spec-auto"]
            if a["ratio"] is None:
                continue
            fig = f"c{row['level']:g} {_x(a['ratio'])}" + ("*" if a["resolved"] is False else "")
            fixed = row["arms"].get("spec", {}).get("ratio")
            gate = row["arms"].get("spec-gate1", {}).get("ratio")
            extra = [f"span 16 {_x(fixed)}"] if fixed is not None else []
            extra += [f"gate 1 {_x(gate)}"] if gate is not None and row["level"] > 1 else []
            cells.append(fig + (f" ({', '.join(extra)})" if extra else ""))
        st = run["res"].get("settings") or {}
        rng = st.get("max_tokens_range")
        named = re.search(r"output lengths (\d+)-(\d+)", run["name"])
        if rng is None and named:
            rng = [int(named.group(1)), int(named.group(2))]
        if not run["spread"]:
            work = f"every request {st.get('max_tokens', 128)} tokens"
        else:
            work = f"output lengths {rng[0]}-{rng[1]}" if rng else "output lengths spread"
        lines.append(f"| `specbench tune`, automatic span policy vs plain decode tokens/s, synthetic tau {run['tau']}, "
                     f"{work} (`*`: within the noise floor) | {'; '.join(cells)} | {lsrc} |")
    lines += [
        "",
        "The step benchmark draws acceptance (synthetic tau) and times `LLM.generate` in process; the sweep sends "
        "requests through the harness's local adapter at a synthetic tau too, and is the older run (dates in the "
        "report column): the two disagree, and both are shown until the sweep is re-run on the current code. "
        "`specbench profile` attributes what is left to host time between steps (docs/gaps.md). With every request "
        "of one length the requests of a wave finish together, which plain decode profits from and speculation "
        "breaks (docs/levers.md); with lengths spread, plain decode pays for its arrivals too.",
        "",
        "",
    ]
    return "\n".join(lines)


def splice(readme: str, section: str) -> str:
    start = readme.find(HEADING + "\n")
    if start < 0:
        raise ReportMissing(f"README.md has no {HEADING!r} section")
    nxt = readme.find("\n## ", start + len(HEADING))
    end = len(readme) if nxt < 0 else nxt + 1
    return readme[:start] + section + readme[end:]


def check(root: Path = ROOT) -> list[str]:
    """The diff between README.md and what the reports say (empty when they agree)."""
    readme = (root / "README.md").read_text(encoding="utf-8")
    want = splice(readme, render(root))
    return list(difflib.unified_diff(readme.splitlines(), want.splitlines(), "README.md", "from reports", lineterm=""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff if README.md differs from the reports")
    a = ap.parse_args()
    if a.check:
        diff = check()
        if diff:
            print("\n".join(diff))
            print("README.md's numbers differ from the committed reports: run scripts/readme_numbers.py",
                  file=sys.stderr)
            return 1
        print("README.md's numbers match the committed reports")
        return 0
    readme = ROOT / "README.md"
    readme.write_text(splice(readme.read_text(encoding="utf-8"), render()), encoding="utf-8")
    print(f"rewrote the {HEADING[3:]!r} section of {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
