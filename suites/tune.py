"""`specbench tune`: where speculation stops paying, and which setting keeps it paying, per concurrency.

Contract:
- `tune_arms(base, ks, trims, gates, policies, each)`: for the bundled engine, the arms of one sweep: "plain"
  (the base engine's spec-off twin, the baseline), then one arm per grid point (K x trim x gate x policy, or
  with `each` one lever at a time; a trim not below K and repeated points are dropped), labelled by their
  settings ("spec" = no lever). Local CUDA arms share the device (harness/engines.py `share_gpu`). For a remote
  engine the user passes the arms (`remote_arms`: label=engine-string pairs, e.g. several vLLM
  `num_speculative_tokens`), the first (or `--baseline`) being spec off.
- `run_tune(cfg, engines, labels, out_dir, baseline, progress)`: ONE interleaved sweep over every arm
  (suites/sweep: rounds interleaved, the baseline run twice for the paired noise floor), then `analyze`.
  `progress` (cli/progress.py RunProgress, or None) is the sweep's: requests done / total over every cell,
  the cell, the ETA of the whole tune (suites/sweep/runner.py).
- `analyze(summary, records)`: per concurrency, each arm's output tok/s (median over rounds), its median
  paired ratio to plain, the noise floor, whether the ratio is resolved (|ratio - 1| > noise), the span
  histogram the arm's engine reported (local engines: the step-span counters of spec/policy.py); per arm its
  crossover (the lowest concurrency from which it loses to plain beyond the noise floor and keeps losing); per
  concurrency the best arm (highest median tok/s; plain when no arm beats plain beyond the noise floor); the
  recommendation: the arm that never loses beyond the noise floor with the best geometric-mean ratio, else
  the per-concurrency choice.
- `render(result)`: markdown; `merge(path, section, result)`: several tune results (e.g. one per synthetic
  tau) in one JSON + markdown (scripts/gpu.sh levers: reports/h200-levers/levers.{json,md}).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLAIN = "plain"
AA = "plain-aa"  # --aa: a second engine of the baseline's setting, built apart (the between-engine noise floor)


def _label(k: int | None, trim: int, gate: int, policy: str) -> str:
    parts = ([f"k{k}"] if k else []) + ([f"trim{trim}"] if trim else []) + ([f"gate{gate}"] if gate else []) + \
        (["auto"] if policy == "auto" else [])
    return "spec" + ("-" + "-".join(parts) if parts else "")


def tune_arms(base: str, ks: Sequence[int | None] = (None,), trims: Sequence[int] = (0,), gates: Sequence[int] = (0,),
              policies: Sequence[str] = ("off",), each: bool = False, aa: bool = False) -> tuple[list[str], list[str]]:
    """(engine strings, labels) for a bundled-engine grid: plain first, then every grid point (each=True: one
    lever at a time instead of the product: spec without levers, then every non-default value of each knob
    alone, the levers report's layout). `aa`: a second plain engine (`AA`), built apart from the first: its
    ratio to plain is the noise between two engines of one setting, which every arm (an engine of its own) carries
    and the noise floor (one engine run twice) does not see."""
    from specbench.harness.engines import parse_engine, spec_off_twin  # noqa: PLC0415

    spec = parse_engine(base)
    if spec.kind != "local":
        raise ValueError(f"--base {base!r}: a grid needs the bundled engine (local:...); for a remote engine give "
                         "--arms label=openai:...;label=openai:...")
    drop = ("k", "trim", "gate", "policy", "name")
    core = ",".join(f"{k}={v}" for k, v in spec.options.items() if k not in drop)
    head = f"local:{spec.target}" if spec.target else "local"
    plain = spec_off_twin(spec, name=PLAIN).raw
    engines, labels = [plain], [PLAIN]
    if aa:
        engines.append(spec_off_twin(spec, name=AA).raw + f",name={AA}")
        labels.append(AA)
    if each:
        k0 = ks[0] if ks else None
        points = [(k0, 0, 0, "off")] + [(k, 0, 0, "off") for k in ks[1:]] + [(k0, t, 0, "off") for t in trims if t] \
            + [(k0, 0, g, "off") for g in gates if g] + [(k0, 0, 0, p) for p in policies if p != "off"]
    else:
        points = list(itertools.product(ks, trims, gates, policies))
    for k, trim, gate, policy in points:
        if k is not None and trim >= k:
            continue
        lab = _label(k, trim, gate, policy)
        if lab in labels:
            continue
        opts = [core] if core else []
        opts += ([f"k={k}"] if k else []) + ([f"trim={trim}"] if trim else []) + ([f"gate={gate}"] if gate else [])
        opts += [f"policy={policy}", f"name={lab}"]
        engines.append(",".join([head, *opts]))
        labels.append(lab)
    return engines, labels


def remote_arms(text: str) -> tuple[list[str], list[str]]:
    """'label=engine;label=engine;...' (';' between arms; an item without 'label=' is labelled armN) ->
    (engine strings, labels)."""
    import re  # noqa: PLC0415

    engines, labels = [], []
    for i, item in enumerate(x.strip() for x in text.split(";") if x.strip()):
        m = re.match(r"^([\w.+-]+)=((?:local|openai|hf)(?::|,|$).*)$", item)
        lab, eng = (m.group(1), m.group(2)) if m else (f"arm{i + 1}", item)
        engines.append(eng.strip())
        labels.append(lab)
    return engines, labels


def run_tune(cfg: Any, engines: list[str], labels: list[str], out_dir: str | Path, baseline: str = PLAIN,
             progress: Any = None) -> dict:
    """One sweep over every arm (suites/sweep), then `analyze`; raises ValueError on a refused arm."""
    from specbench.harness.engines import parse_engine, share_gpu  # noqa: PLC0415
    from specbench.suites.report import ReportError, load_run_summary  # noqa: PLC0415
    from specbench.suites.sweep.session import run_sweep  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engines = [s.raw for s in share_gpu([parse_engine(e) for e in engines])]  # several CUDA engines, one device
    outcome = run_sweep(cfg, engines, labels, out_dir=out, baseline=baseline, progress=progress, keep_records=True)
    if outcome.run_dir is None:
        raise KeyboardInterrupt
    try:
        summary = load_run_summary(outcome.run_dir)
    except ReportError:
        if outcome.complete:
            raise
        raise KeyboardInterrupt from None  # stopped before its first cell: nothing to analyse
    res = analyze(summary, outcome.records)
    res["run_dir"] = str(outcome.run_dir)
    res["complete"] = bool(outcome.complete)
    res["no_tokens"] = list(outcome.accounting.get("no_tokens") or [])  # cells that measured nothing (session.py)
    res["arms"] = [{"label": lab, "engine": e} for lab, e in zip(labels, engines, strict=True)]
    res["settings"] = workload_settings(cfg)
    return res


def workload_settings(cfg: Any) -> dict:
    """The sweep settings a tune section is read with (scripts/readme_numbers.py: which workload it measured)."""
    from specbench.suites.sweep.workload import output_len_range  # noqa: PLC0415

    out = {k: getattr(cfg, k, None) for k in ("dataset", "max_tokens", "max_tokens_spread", "ignore_eos", "rounds",
                                              "prompts_per_level", "warmup")}
    if out["max_tokens_spread"]:
        out["max_tokens_range"] = list(output_len_range(cfg.max_tokens, cfg.max_tokens_spread))
    return out


# ---- analysis -----------------------------------------------------------------------------------------
def _spans(records: list[dict], arm: str, level: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.get("kind") != "cell" or r.get("arm") != arm or float(r.get("level", -1)) != level or r.get("warmup"):
            continue
        for s, n in ((r.get("counters") or {}).get("span_hist") or {}).items():
            out[str(s)] = out.get(str(s), 0) + int(n)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def finish_groups(records: list[dict], arm: str, level: float) -> float | None:
    """`suites.sweep.metrics.finish_groups` of an arm's measured requests at a level (warm-up excluded)."""
    from specbench.suites.sweep.metrics import finish_groups as groups  # noqa: PLC0415

    return groups([r for r in records if r.get("kind") == "request" and r.get("arm") == arm
                   and not (r.get("meta") or {}).get("warmup")
                   and float((r.get("meta") or {}).get("level", -1)) == level])


def analyze(summary: Any, records: list[dict]) -> dict:
    base = summary.baseline
    arms = [a for a in summary.compared_arms if a not in (base, AA)]
    levels = list(summary.levels)
    per_level: list[dict] = []
    for lv in levels:
        nf = summary.noise.get(lv)
        noise = nf["noise"] if nf else None
        aa = summary.speedups.get((AA, lv))  # --aa: two engines of the baseline's setting, paired rounds
        engine_noise = abs(aa["median"] - 1.0) if aa else None
        floor = max(x for x in (noise, engine_noise) if x is not None) if (noise, engine_noise) != (None, None) \
            else None
        b = summary.get(base, lv)
        row: dict = {"level": lv, "plain_tok_s": b.tok_s_median if b else None, "noise": noise,
                     "engine_noise": engine_noise, "arms": {},
                     "plain_finish_groups": finish_groups(records, base, lv)}
        best, best_tps = base, (b.tok_s_median if b else None) or 0.0
        for a in arms:
            c = summary.get(a, lv)
            sp = summary.speedups.get((a, lv))
            ratio = sp["median"] if sp else None
            resolved = None if ratio is None or floor is None else abs(ratio - 1.0) > floor
            tps = c.tok_s_median if c else None
            row["arms"][a] = {"tok_s": tps, "ratio": ratio, "resolved": resolved, "spans": _spans(records, a, lv),
                              "finish_groups": finish_groups(records, a, lv)}
            wins = ratio is not None and ratio > 1.0 and (resolved is not False)
            if tps is not None and wins and tps > best_tps:
                best, best_tps = a, tps
        row["best"] = best
        per_level.append(row)
    crossover: dict[str, float | None] = {}
    for a in arms:
        cx = None
        for row in reversed(per_level):  # the lowest level from which the arm keeps losing beyond the noise floor
            x = row["arms"][a]
            if x["ratio"] is not None and x["ratio"] < 1.0 and x["resolved"]:
                cx = row["level"]
            else:
                break
        crossover[a] = cx
    never_loses = []
    for a in arms:
        rs = [row["arms"][a] for row in per_level]
        if all(x["ratio"] is not None for x in rs) and not any(x["ratio"] < 1.0 and x["resolved"] for x in rs):
            gm = math.exp(sum(math.log(max(x["ratio"], 1e-9)) for x in rs) / len(rs))
            never_loses.append((gm, a))
    rec = max(never_loses)[1] if never_loses else None
    return {"baseline": base, "levels": levels, "per_level": per_level, "crossover": crossover,
            "recommendation": {"one_setting": rec, "per_level": {str(r["level"]): r["best"] for r in per_level}}}


# ---- rendering ----------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def lockstep_lines(res: dict, arms: list[str]) -> list[str]:
    """The finish groups per request by level and arm, and a warning where plain decode ran in lockstep waves
    that an arm broke (its ratio there measures the lockstep as much as the arm)."""
    rows = [r for r in res["per_level"] if r.get("plain_finish_groups") is not None]
    if not rows:
        return []
    lines = ["Finish groups per request (requests ending in the same engine step count once; ~1/c = lockstep "
             "waves, ~1 = every request apart):", "", "| c | plain | " + " | ".join(arms) + " |",
             "|---|---|" + "---|" * len(arms)]
    lines += [f"| {r['level']:g} | {_f(r['plain_finish_groups'], '{:.2f}')} | "
              + " | ".join(_f(r["arms"][a].get("finish_groups"), "{:.2f}") for a in arms) + " |" for r in rows]
    from specbench.suites.sweep.metrics import broke_lockstep  # noqa: PLC0415

    broke = [(r["level"], a) for r in rows for a in arms
             if broke_lockstep(r["level"], r["plain_finish_groups"], r["arms"][a].get("finish_groups"))]
    if broke:
        lines += ["", "Warning: plain decode ran in lockstep waves (requests of one length finishing together, their "
                  "successors' prefills sharing a step) at " + ", ".join(sorted({f"c{lv:g}" for lv, _ in broke}))
                  + ", and " + ", ".join(sorted({a for _, a in broke})) + " spread the finishes, paying a "
                  "prefill-mixed step per arrival: those ratios measure the lockstep as much as the setting. "
                  "Lengths that differ (`--max-tokens-spread 0.5`, or a data set without --ignore-eos) measure "
                  "without it."]
    return lines + [""]


def render(res: dict, title: str = "specbench tune") -> str:
    arms = list(res["per_level"][0]["arms"]) if res["per_level"] else []
    aa = any(row.get("engine_noise") is not None for row in res["per_level"])
    floor = ("the larger of the noise floor (plain run twice) and the A/A noise (|`plain-aa` / plain - 1|: a second "
             "plain engine, built apart)" if aa else "the noise floor (plain run twice)")
    lines = [f"## {title}", "", f"Baseline: `{res['baseline']}` (speculation off). Ratios: median paired tok/s ratio "
             f"to plain over interleaved rounds; `*` = within {floor}.", "",
             "| c | plain tok/s | noise | " + ("A/A | " if aa else "") + " | ".join(arms) + " | best |",
             "|---|---|---|" + ("---|" if aa else "") + "---|" * len(arms) + "---|"]
    for row in res["per_level"]:
        cells = []
        for a in arms:
            x = row["arms"][a]
            cells.append(_f(x["ratio"], "{:.3f}") + ("*" if x["resolved"] is False else ""))
        lines.append(f"| {row['level']:g} | {_f(row['plain_tok_s'])} | {_f(row['noise'], '{:.3f}')} | "
                     + (f"{_f(row.get('engine_noise'), '{:.3f}')} | " if aa else "")
                     + " | ".join(cells) + f" | {row['best']} |")
    lines += ["", "Output tok/s (median over rounds):", "", "| c | plain | " + " | ".join(arms) + " |",
              "|---|---|" + "---|" * len(arms)]
    lines += [f"| {row['level']:g} | {_f(row['plain_tok_s'])} | "
              + " | ".join(_f(row["arms"][a]["tok_s"]) for a in arms) + " |" for row in res["per_level"]]
    lines += ["", "Crossover (the lowest concurrency from which an arm loses to plain beyond the noise floor): "
              + ", ".join(f"{a} " + (f"c{c:g}" if c is not None else "none") for a, c in res["crossover"].items()), ""]
    spans = [(a, row["level"], row["arms"][a]["spans"]) for row in res["per_level"] for a in arms
             if row["arms"][a]["spans"]]
    if spans:
        lines += ["Chosen verify spans (steps per span, 1 = a one-token round):", "",
                  "| arm | c | spans |", "|---|---|---|"]
        lines += [f"| {a} | {lv:g} | " + ", ".join(f"{s}: {n}" for s, n in sp.items()) + " |" for a, lv, sp in spans]
        lines.append("")
    lines += lockstep_lines(res, arms)
    rec = res["recommendation"]
    lines.append("Recommendation: " + (f"`{rec['one_setting']}` never loses to plain beyond the noise floor "
                                         "(best geometric-mean ratio)" if rec["one_setting"] else
                                         "no single setting avoids a loss; per concurrency: "
                                         + ", ".join(f"c{lv} {a}" for lv, a in rec["per_level"].items())))
    return "\n".join(lines) + "\n"


def merge(path: str | Path, section: str, res: dict, title: str = "Load-aware speculation") -> tuple[Path, Path]:
    """Add (or replace) one section of a combined tune JSON and re-render its markdown beside it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(p.read_text()) if p.is_file() else {"sections": {}}
    doc["sections"][section] = res
    p.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = p.with_suffix(".md")
    body = [f"# {title}", "", "Written by `specbench tune` (suites/tune.py); one section per run.", ""]
    for name, r in doc["sections"].items():
        body.append(render(r, title=name))
    md.write_text("\n".join(body))
    return p, md
