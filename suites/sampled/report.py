"""Markdown for the sampled gate: a pure function of a `GateResult` (and of a self-test matrix).

Contract: `render(result)` and `render_selftest(rows)` return markdown strings and touch nothing else.
Every table states n, the number of permutations, q and how the power figure is computed, so a reader
can tell a pass from a run that could not have seen a difference.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from .gate import Cell, Comparison, GateResult, not_tested

POWER_NOTE = (
    "Power: `MDE` is the smallest total-variation distance the test detects with 80% power for the "
    "alternative \"mass moves from the cell's most frequent token to its second\" (TV = the mass moved), "
    "by a normal approximation with a Bonferroni critical value over the cell's support (conservative: "
    "simulated power at the stated TV was 0.84-0.99 on four distribution shapes, docs/sampled.md). "
    "`lone` is the level q/m at which a single differing cell survives BH; `all` is level q, the regime "
    "of a fault that shifts every cell. `inf`: no such shift is detectable (the cell is too flat).")


def _n(x: int | None) -> str:
    return "unknown" if x is None else str(x)


def _f(x: float, nd: int = 3) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.{nd}f}"


def _p(x: float) -> str:
    return f"{x:.1e}" if x < 1e-3 else f"{x:.3f}"


def _spec_lines(spec: dict | None) -> list[str]:
    if spec is None:
        return ["The candidate exposes no speculation counters: that speculation engaged is **unverified**.", ""]
    per = ", ".join(f"{r:.2f}" for r in spec["per_position_rate"]) or "-"
    return ["| drafts | draft tokens | accepted | acceptance rate | mean accepted length | per-position rate |",
            "|---:|---:|---:|---:|---:|---|",
            f"| {spec['num_drafts']} | {spec['num_draft_tokens']} | {spec['num_accepted_tokens']} | "
            f"{spec['acceptance_rate']:.3f} | {spec['mean_accept_len']:.2f} | {per} |", ""]


def _grid(cells: Sequence[Cell]) -> list[str]:
    by: dict[tuple[str, int], list[Cell]] = defaultdict(list)
    for c in cells:
        by[(c.config, c.position)].append(c)
    lines = ["| config | pos | cells (testable) | rejected | min p | min BH q | median TV | max TV | "
             "median MDE lone | median MDE all |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (cfg, pos), cs in by.items():
        t = [c for c in cs if c.testable]
        med = (lambda xs: float(np.median(xs)) if xs else math.inf)
        lines.append(f"| {cfg} | {pos} | {len(cs)} ({len(t)}) | {sum(c.rejected for c in cs)} | "
                     f"{_p(min((c.p_value for c in t), default=1.0))} | {_p(min((c.q_value for c in t), default=1.0))} | "
                     f"{_f(med([c.tv for c in t]))} | {_f(max((c.tv for c in t), default=0.0))} | "
                     f"{_f(med([c.mde_lone for c in t]))} | {_f(med([c.mde_all for c in t]))} |")
    return lines


def _comparison(c: Comparison, q: float) -> list[str]:
    t = [x for x in c.cells if x.testable]
    n_a = t[0].n_a if t else 0
    perms = max((x.permutations for x in t), default=0)
    lines = [f"## {c.name}: {c.arms[0]} vs {c.arms[1]}", "",
             f"{len(c.cells)} cells, {len(t)} testable (the rest: both arms produced one and the same token), "
             f"**{len(c.rejected)} rejected** at BH q = {q}; n = {n_a} per arm per cell; "
             f"up to {perms} permutations per cell.", ""]
    lines += _grid(c.cells) + [""]
    if c.rejected:
        lines += ["Rejected cells (by BH q-value):", "", "| prompt | config | pos | n | p | BH q | TV | support |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for x in sorted(c.rejected, key=lambda x: x.q_value)[:30]:
            lines.append(f"| {x.prompt} | {x.config} | {x.position} | {x.n_a} | {_p(x.p_value)} | {_p(x.q_value)} | "
                         f"{x.tv:.3f} | {x.support} |")
        if len(c.rejected) > 30:
            lines.append(f"| ... {len(c.rejected) - 30} more | | | | | | | |")
        lines.append("")
    return lines


def render(r: GateResult, title: str = "Sampled equivalence gate") -> str:
    o = r.options
    cfgs = ", ".join(f"{c['name']} (T={c['temperature']:g}, top_p={c['top_p']:g}, top_k={c['top_k']})"
                     for c in r.configs)
    lines = [f"# {title}: {r.verdict}", "",
             f"- baseline: `{r.engines['baseline'].get('name')}` {_desc(r.engines['baseline'])}",
             f"- candidate: `{r.engines['candidate'].get('name')}` {_desc(r.engines['candidate'])}",
             f"- {len(r.prompts)} prompts x {len(r.configs)} configs x {o['positions']} output positions; "
             f"{o['samples']} samples per arm per (prompt, config); max_tokens = {o['positions']}",
             f"- configs: {cfgs}",
             f"- test: permutation test on the max studentized token-frequency difference, "
             f"{o['permutations']} permutations (refined near the floor: {o['refine']}), BH at q = {o['q']}; "
             f"seed {o['seed']}",
             "- time: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items()), ""]
    if r.notes:
        lines += [f"- {n}" for n in r.notes] + [""]
    if r.failed:
        lines += [f"**{len(r.failed)} requests failed** (the run is INCOMPLETE); first: `{r.failed[0]}`", ""]
    if r.missing:
        lines += ["**CANNOT TEST**: the gate could not collect the evidence a verdict needs:", ""]
        lines += [f"- {m}" for m in r.missing] + [""]
    lines += ["## Checks that could not run", ""] + (_not_run(r) or ["- none: every check ran"]) + [""]
    lines += ["## Speculation (candidate, over its generations)", ""] + _spec_lines(r.spec)
    lines += _branch_lines(r.spec_by_config)
    for c in r.comparisons:
        lines += _comparison(c, o["q"])
    lines += [POWER_NOTE, ""]
    return "\n".join(lines)


def _branch_lines(by_config: dict[str, dict | None]) -> list[str]:
    """Per sampling config: verify steps, those fully accepted (a bonus row drawn from the row after the last
    draft) and those ended on a rejection (a residual draw); zero of either is stated, not implied."""
    if not by_config:
        return []
    lines = ["Accept-path branches the candidate's generations reached, per config (engine counters):", "",
             "| config | verify steps | bonus rows (fully accepted) | rejections (residual draws) | "
             "acceptance rate | mean accepted length |", "|---|---:|---:|---:|---:|---:|"]
    for name, s in by_config.items():
        if not s:
            lines.append(f"| {name} | unknown | unknown | unknown | - | - |")
            continue
        fa, rj = s.get("full_accepts"), s.get("rejections")
        lines.append(f"| {name} | {s['num_drafts']} | {'unknown' if fa is None else fa} | "
                     f"{'unknown' if rj is None else rj} | {s['acceptance_rate']:.3f} | {s['mean_accept_len']:.2f} |")
    gaps = not_tested(by_config)
    lines.append("")
    if gaps:
        lines += ["**Not tested** (no cell of these configs saw the branch):", ""] + [f"- {g}" for g in gaps]
        lines.append("")
    return lines


def _not_run(r: GateResult) -> list[str]:
    out = [f"- {m}" for m in r.missing]
    out += [f"- {g}" for g in not_tested(r.spec_by_config)]
    if r.spec_by_config and any(s and s.get("full_accepts") is None for s in r.spec_by_config.values()):
        out.append("- bonus rows / rejections: the candidate does not count fully accepted verify steps")
    if r.spec is None:
        out.append("- speculation check: the candidate exposes no spec counters (speculation unverified)")
    for arm, d in r.engines.items():
        caps = d.get("capabilities") if isinstance(d, dict) else None
        if isinstance(caps, dict):
            out.append(f"- {arm}: {caps.get('dialect')} endpoint; output ids via {caps.get('output_ids')}, "
                       f"tokenize via {caps.get('tokenize')}, counters {caps.get('metrics_prefix')}"
                       + (f"; lacks {', '.join(caps['missing'])}" if caps.get("missing") else ""))
    return out


def _desc(d: dict) -> str:
    cfg = d.get("config") or {}
    keys = ("spec", "k", "draft", "dtype", "device", "faults")
    return "(" + ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg and cfg[k] not in (None, [], "")) + ")"


def render_selftest(rows: Sequence[dict], options: dict) -> str:
    """rows: {case, expect, verdict, ok, rejected, testable, min_p, max_tv, mean_accept_len, bonus_rows,
    rejections, seconds}."""
    o = options
    lines = ["# Sampled gate self-test", "",
             f"{o['num_prompts']} prompts x {len(o.get('configs', [])) or '?'} configs x {o['positions']} positions, "
             f"{o['samples']} samples per arm, {o['permutations']} permutations, BH q = {o['q']}. "
             "Each fault must be caught (some cell rejected); the clean engine must pass.", "",
             "| case | expected | verdict | rejected / testable | min p | max TV | mean accepted length | "
             "bonus rows | rejections | time (s) | ok |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in rows:
        lines.append(f"| {x['case']} | {x['expect']} | {x['verdict']} | {x['rejected']} / {x['testable']} | "
                     f"{_p(x['min_p'])} | {x['max_tv']:.3f} | {x['mean_accept_len']:.2f} | {_n(x.get('bonus_rows'))} | "
                     f"{_n(x.get('rejections'))} | {x['seconds']:.1f} | "
                     f"{'yes' if x['ok'] else '**NO**'} |")
    return "\n".join(lines + [""])
