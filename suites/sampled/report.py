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

from specbench.harness.verdicts import is_pass

from .gate import Cell, Comparison, GateResult, config_key, configurations, not_tested

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


def _spec_lines(spec: dict | None, seen: dict | None = None) -> list[str]:
    if spec is None:
        how = (seen or {}).get("describe") or "no evidence that the candidate speculated"
        return [f"The candidate exposes no speculation counters; other evidence: {how} "
                f"(verdict: {(seen or {}).get('verdict', '-')}).", ""]
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
    lines = [f"## {c.label}: {c.arms[0]} vs {c.arms[1]}", "",
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
    lines = [f"# {title}: {r.verdict}", ""]
    lines += [f"- {arm}: `{d.get('name')}` {_desc(d)}" for arm, d in r.engines.items()]
    if r.candidates:
        lines.append(f"- {len(r.candidates)} candidates against the same baseline samples, each judged on its own: "
                     f"each candidate's spec comparison is its own BH family at q / {len(r.candidates)} = "
                     f"{o['q'] / len(r.candidates):.3g} (its null comparison another), so one candidate's cells never "
                     f"move another's threshold and a run of correct candidates fails with probability about q = "
                     f"{o['q']}")
    lines += [f"- {len(r.prompts)} prompts ({o.get('prompt_set', 'gsm8k')}) x {len(r.configs)} configs x "
              f"{o['positions']} output positions; {o['samples']} samples per arm per (prompt, config); "
              f"max_tokens = {o['positions']}",
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
    if r.candidates:
        for lab in r.candidates:
            lines += [f"## Speculation ({lab}, over its generations): {r.candidate_verdicts.get(lab, '')}", ""]
            lines += _spec_lines(r.spec_by_candidate.get(lab), r.speculation.get(lab))
    else:
        lines += ["## Speculation (candidate, over its generations)", ""] + _spec_lines(r.spec, r.speculation.get(""))
    lines += _configuration_lines(r)
    lines += _fit_lines(r)
    lines += _seed_lines(r)
    for c in r.comparisons:
        lines += _comparison(c, o["q"])
    lines += [POWER_NOTE, ""]
    return "\n".join(lines)


def _fit_lines(r: GateResult) -> list[str]:
    """The one-sample fit test (fit.py): per arm the positions tested, those not (and why), the Cramer-von Mises
    p-values pooled and per config, the tokens outside the support, the smallest per-step TV it detects."""
    f = r.fit
    if not f:
        return []
    lines = ["## Fit: every sample against the target's own law at its prefix", ""]
    if f.get("why"):
        return lines + [f"Not run: {f['why']}. The two-sample comparison below decides alone.", ""]
    lines += [f"The baseline scored every sample (teacher-forced top-{f['top_k']} logprobs); each sampled token is "
              "tested against the config's law (temperature, top-k, top-p) rebuilt on the tokens surely in its "
              f"support (noise margin {f['margin']:g} logits), by its randomized probability integral transform, "
              "uniform and independent under the null; Cramer-von Mises pooled and per config, Bonferroni over "
              "those tests; a token surely outside the support fails on its own. The control is the baseline's own "
              "samples: a control that does not fit makes the fit CANNOT TEST. `detectable TV`: the smallest "
              "per-step total variation, mass moved toward / away from each position's most likely token, the "
              f"pooled test detects with power {r.options.get('power', 0.8)} at its level (simulated on this run's "
              "laws).", "",
              "| arm | verdict | positions tested | one-token laws | not sure in the support | outside | pooled p | "
              "level | per config p | detectable TV (toward / away) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    rows = ([("control (baseline)", f["control"], None)] if f.get("control") else []) + \
        [(lab or "candidate", j, j) for lab, j in f.get("candidates", {}).items()]
    for name, j, cand in rows:
        if not j.get("counts"):
            lines.append(f"| {name} | {j.get('verdict', '-')} | - | - | - | - | - | - | - | - |")
            continue
        c = j["counts"]
        per = "; ".join(f"{k} {_p(v['p_value'])}" for k, v in j["per_config"].items()) or "-"
        tv = (cand or {}).get("detectable_tv")
        tvs = f"{_f(tv['toward'])} / {_f(tv['away'])}" if tv else "-"
        verdict = j.get("verdict") or ("rejected" if j["rejected"] else "fits")
        lines.append(f"| {name} | {verdict} | {j['positions']} | {c['single']} | {c['unsure']} | {c['outside']} | "
                     f"{_p(j['p_value'])} | {j['level']:.2g} | {per} | {tvs} |")
    outside = [(lab, x) for lab, j in f.get("candidates", {}).items() for x in j.get("outside", [])]
    if outside:
        lines += ["", "Tokens outside the support (first ones):", ""] + [f"- {lab or 'candidate'}: {x}"
                                                                          for lab, x in outside[:10]]
    return lines + [""]


def _configuration_lines(r: GateResult) -> list[str]:
    """Per configuration (candidate x sampling config): the verify steps its generations ran, those fully
    accepted (a bonus row drawn from the row after the last draft) and those ended on a rejection (a residual
    draw), its cells and its verdict; a configuration that reached neither branch is CANNOT TEST, not PASS."""
    rows = configurations(r)
    if not rows:
        return []
    lines = ["## Configurations", "",
             "Accept-path branches each configuration's candidate generations reached (engine counters), and its "
             "cells in the spec comparison:", "",
             "| candidate | config | verify steps | bonus rows (fully accepted) | rejections (residual draws) | "
             "acceptance rate | mean accepted length | cells (testable) | rejected | min p | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in rows:
        s = r.spec_by_config.get(config_key(x["candidate"], x["config"]))
        acc = f"{s['acceptance_rate']:.3f} | {s['mean_accept_len']:.2f}" if s else "- | -"
        lines.append(f"| {x['candidate'] or 'candidate'} | {x['config']} | {_n(x['verify_steps'])} | "
                     f"{_n(x['bonus_rows'])} | {_n(x['rejections'])} | {acc} | {x['cells']} ({x['testable']}) | "
                     f"{x['rejected']} | {_p(x['min_p'])} | {x['verdict']} |")
    gaps = not_tested(r.spec_by_config)
    lines.append("")
    if gaps:
        lines += ["**Not tested** (no cell of these configurations saw the branch):", ""] + [f"- {g}" for g in gaps]
        lines.append("")
    return lines


def _seed_lines(r: GateResult) -> list[str]:
    """The seed-repeat check: each arm's seeded samples sent again one at a time, how many came back different."""
    if not r.seed_repeat:
        return []
    lines = ["## Seed repeat", "",
             "Seeded samples sent again in one batch, sampling configs mixed, beside requests of other parameters "
             "(each run alone first); their first draws ran one config per batch. An engine that honours per-request "
             "seeds and gives each row its own parameters draws the same tokens. The check fails when the candidate's "
             "differ significantly more often than the baseline's (one-sided Fisher exact, alpha 1e-3); it decides the "
             "verdict only with --seed-repeat-gate (an engine whose speculation adapts to load draws differently in "
             "another batch by design):", "",
             "| candidate | baseline differ / repeated | candidate differ / repeated | p | check | decides the verdict | "
             "first differences |",
             "|---|---:|---:|---:|---|---|---|"]
    for lab, chk in r.seed_repeat.items():
        b, c = chk["baseline"], chk["candidate"]
        p = _p(chk["p_value"]) if chk["p_value"] is not None else "-"
        lines.append(f"| {lab or 'candidate'} | {b['differ']} / {b['compared']} | {c['differ']} / {c['compared']} | "
                     f"{p} | {chk['verdict']} | {'yes' if chk.get('enforced') else 'no (advisory)'} | "
                     f"{'; '.join(c['examples']) or '-'} |")
    return lines + [""]


def _not_run(r: GateResult) -> list[str]:
    out = [f"- {m}" for m in r.missing]
    out += [f"- {g}" for g in not_tested(r.spec_by_config)]
    if r.spec_by_config and any(s and s.get("full_accepts") is None for s in r.spec_by_config.values()):
        out.append("- bonus rows / rejections: the candidate does not count fully accepted verify steps")
    for lab, seen in r.speculation.items():
        if seen.get("source") != "counters" and is_pass(seen.get("verdict")):
            out.append(f"- speculation check{' (' + lab + ')' if lab else ''}: no spec counters; {seen.get('describe')}")
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
    """rows: selftest._row dicts (case, expect, verdict, ok, rejected, testable, min_p, min_q, q_run, caught_by,
    configurations, bonus_rows, rejections, seconds). One line per case, then the fault x configuration
    matrix: per configuration, the rejected cells (and the smallest p-value) of each case."""
    o = options
    rep = int(o.get("repeat", 1))
    q_run = o["q"] / rep
    cands = ", ".join(o.get("candidates") or []) or "the candidate"
    lines = ["# Sampled gate self-test", "",
             f"Candidates: {cands}; {o['num_prompts']} prompt(s) of each set ({o.get('prompt_set', 'gsm8k')}) x "
             f"{len(o.get('configs', [])) or '?'} configs x {o['positions']} positions, {o['samples']} samples per "
             f"arm, {o['permutations']} permutations. Every run is judged at q / repeat = {o['q']:g} / {rep} = "
             f"{q_run:.3g}, each candidate's cells their own BH family at that level divided by the number of "
             f"candidates, so a correct engine raises an alarm in any of the {rep} clean run(s) with probability "
             f"at most {o['q']:g} (Bonferroni over the runs and the candidates). Each fault must be caught (some "
             "cell rejected); every clean run must pass.", "",
             "| case | expected | verdict | rejected / testable | min p | min BH q | caught by (rejected cells) | "
             "bonus rows | rejections | time (s) | ok |", "|---|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for x in rows:
        by = "; ".join(f"{c['configuration']} ({c['rejected']})" for c in x.get("caught_by", [])) or "-"
        lines.append(f"| {x['case']} | {x['expect']} | {x['verdict']} | {x['rejected']} / {x['testable']} | "
                     f"{_p(x['min_p'])} | {_p(x.get('min_q', 1.0))} | {by} | {_n(x.get('bonus_rows'))} | "
                     f"{_n(x.get('rejections'))} | {x['seconds']:.1f} | {'yes' if x['ok'] else '**NO**'} |")
    keys = [config_key(c["candidate"], c["config"]) for c in (rows[0].get("configurations") or [])] if rows else []
    if keys:
        lines += ["", "Rejected cells per configuration (smallest p-value in brackets; `-`: none rejected), with the "
                  "bonus rows and rejections each run's generations reached there:", "",
                  "| case | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for x in rows:
            cells = []
            for c in x.get("configurations") or []:
                hit = f"**{c['rejected']}** ({_p(c['min_p'])})" if c["rejected"] else "-"
                cells.append(f"{hit}; {_n(c['bonus_rows'])} / {_n(c['rejections'])}")
            lines.append(f"| {x['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])
