"""Markdown and console renderings of lossless runs and of the self-test (pure functions of the outcome).

Contract: `render_markdown(outcome)` -> a report with the verdict first, the engines and settings, one
summary row per gate, the run checks, the per-prompt table of every gate (status, first divergence,
regret, tokens compared, re-anchors, accepted length) and every divergence with its baseline regret and
the candidate's re-scored regret, the engines' capability records (docs/adapters.md) and every check
that could not run with its reason. `render_console(outcome)` is the short form the CLI prints.
`render_selftest(st)` renders the fault -> gates matrix and the clean repetitions. Nothing here runs an
engine or reads files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specbench.harness.verdicts import FAIL, NOT_SPECULATING, PASS, PASS_ASSERTED, is_cannot_test

from .greedy import GateRun, PromptCheck
from .regret import MARGIN_TOL

if TYPE_CHECKING:
    from .selftest import SelftestOutcome
    from .suite import LosslessOutcome


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _reg(x: float | None) -> str:
    """A regret: 3 decimals, or scientific below 0.01 (strict-mode flips are ~1e-4 nat)."""
    if x is None:
        return "-"
    return f"{x:.3f}" if x == 0 or x >= 0.01 else f"{x:.2e}"


def _cell(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _engine_line(d: dict) -> str:
    config = d.get("config")
    cfg = config if isinstance(config, dict) else {}
    bits = [f"`{d.get('name')}` ({d.get('kind')})", f"model `{d.get('model')}`"]
    for k in ("draft", "spec", "k", "dtype", "device", "attention_backend", "eager", "faults"):
        if cfg.get(k) not in (None, [], ""):
            bits.append(f"{k}={cfg[k]}")
    if cfg.get("tp_emulate", 1) != 1:  # an emulated TP-N reduction order (docs/noise.md)
        bits.append(f"tp_emulate={cfg['tp_emulate']}")
    return ", ".join(bits)


def _status(p: PromptCheck) -> str:
    s = {"identical": f"{PASS} (identical)", "flip": f"{PASS} (benign flips)", "fail": "**FAIL**",
         "error": "**ERROR**", "untestable": "**CANNOT TEST**"}[p.status]
    return s + ("" if p.complete or not p.ok else " (partial)")


def _accept(p: PromptCheck) -> str:
    sp = p.spec or {}
    if "num_drafts" not in sp:  # no per-request verify steps (llama.cpp reports draft tokens only)
        return f"{sp['num_accepted_tokens']}/{sp['num_draft_tokens']} drafts acc." if sp.get("num_draft_tokens") else "-"
    return _f(sp.get("mean_accept_len"), 2) if sp.get("num_drafts") else "1.00"


def gate_summary_rows(gates: list[GateRun]) -> list[str]:
    rows = ["| gate | verdict | tolerance | requests | identical | benign flips | failed | cannot test "
            "| tokens compared | re-anchors | drafts | mean accepted length | wall s |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in gates:
        ps = g.prompts
        rows.append(f"| {g.name} | {'**' + g.verdict + '**' if g.verdict != PASS else g.verdict} "
                    f"| {_cell(rule_short(g.rule))} | {len(ps)} "
                    f"| {sum(p.status == 'identical' for p in ps)} | {sum(p.status == 'flip' for p in ps)} "
                    f"| {sum(not p.ok and not p.untestable for p in ps)} | {sum(p.untestable for p in ps)} "
                    f"| {sum(p.tokens_compared for p in ps)} "
                    f"| {sum(p.reanchors for p in ps)} | {g.stats.num_drafts if g.stats.known else '-'} "
                    f"| {_f(g.stats.mean_accept_len, 2)} | {g.wall_s:.1f} |")
    return rows


def prompt_rows(g: GateRun) -> list[str]:
    rows = ["| prompt | status | first divergence | max regret (nat) | tokens compared | re-anchors "
            "| accepted length | note |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for p in g.prompts:
        fd = "-" if p.first_divergence is None else str(p.first_divergence)
        rows.append(f"| {_cell(p.pid)} | {_status(p)} | {fd} | {_f(p.max_regret)} "
                    f"| {p.tokens_compared}/{p.candidate_tokens} | {p.reanchors} | {_accept(p)} | {_cell(p.reason)} |")
    return rows


def divergence_rows(gates: list[GateRun]) -> list[str]:
    rows = ["| gate | prompt | position | candidate pick | baseline top1 | baseline regret (nat) "
            "| candidate re-scored regret | verdict |", "|---|---|---:|---:|---:|---:|---:|---|"]
    n = 0
    for g in gates:
        for p in g.prompts:
            for d in p.divergences:
                j = d.judgement
                rs = d.rescore or {}
                rsc = _reg(rs.get("regret")) if rs.get("status") == "ok" else (rs.get("status") or "-")
                if rs.get("status") == "ok":
                    rsc += " (agrees with pick)" if rs.get("agrees_with_pick") else f" (prefill top1 {rs.get('top1')})"
                if j is None and d.kind == "token":
                    reg, verdict = "-", "**CANNOT TEST** (no baseline logprobs here)"
                elif j is None:
                    reg, verdict = "-", "**FAIL** " + d.kind
                else:
                    reg = _reg(j.regret) if j.regret is not None else f">= {_f(j.lower_bound)}"
                    verdict = ("**FAIL** (rescore: the candidate's own prefill disagrees)" if d.rescore_fail else
                               "benign" if j.ok else f"**FAIL** ({j.kind})")
                    if d.dist_source != "generation":
                        reg += f" ({d.dist_source})"
                top1 = j.top1 if j else d.baseline_token
                rows.append(f"| {g.name} | {_cell(p.pid)} | {d.position} | {d.pick} | {top1} | {reg} | {rsc} "
                            f"| {verdict} |")
                n += 1
    return rows if n else []


def check_rows(gates: list[GateRun]) -> list[str]:
    rows = ["| gate | check | result | detail |", "|---|---|---|---|"]
    for g in gates:
        for c in g.checks:
            res = "skipped" if c.skipped else ("ok" if c.ok else "**FAIL**")
            rows.append(f"| {g.name} | {c.name} | {res} | {_cell(c.detail)} |")
        res = "ok" if g.stats.speculating else (g.verdict if g.require_spec else "not judged")
        rows.append(f"| {g.name} | speculating | {res} | {_cell(g.stats.describe())} |")
    return rows


CAPS = (("dialect", "dialect"), ("server", "version / build"), ("tokenize", "tokenize"),
        ("token_id_prompts", "token-id prompts"), ("generate_route", "generation route"),
        ("output_ids", "output ids"), ("logprobs", "logprobs shape"), ("top_logprobs", "top-k depth"),
        ("prompt_logprobs", "prompt logprobs (echo)"), ("scoring", "teacher-forced scoring"),
        ("usage", "streamed usage"), ("metrics_prefix", "counter prefix"), ("spec_counters", "spec counters"),
        ("per_request_spec", "per-request draft counts"), ("prompt_cache", "prompt-cache control"),
        ("sampler_defaults", "server sampler defaults"), ("speculated_logprobs", "logprobs of speculated tokens"))


def _cap_value(key: str, v: object) -> str:
    if key == "server" and isinstance(v, dict):
        return str(v.get("version") or v.get("build") or "-")
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x}" for k, x in v.items())
    return str(v).lower() if isinstance(v, bool) else str(v)


def capability_rows(engines: dict[str, dict]) -> list[str]:
    """The engines' capability records side by side (only engines that were probed have one)."""
    arms = [(a, d["capabilities"]) for a, d in engines.items()
            if isinstance(d, dict) and isinstance(d.get("capabilities"), dict)]
    if not arms:
        return []
    rows = ["| capability | " + " | ".join(a for a, _ in arms) + " |", "|---|" + "---|" * len(arms)]
    for key, label in CAPS:
        rows.append(f"| {label} | " + " | ".join(_cell(_cap_value(key, c.get(key))) for _, c in arms) + " |")
    rows.append("| missing | " + " | ".join(_cell(", ".join(c.get("missing") or []) or "none") for _, c in arms) + " |")
    return rows


def rule_short(rule: dict | None) -> str:
    """The tolerance a gate was judged by, in a few words ("strict 0.0004 nat", "margin 0.2 nat"); "-" for a gate
    no regret tolerance judged (the divergence-rate test's own gate)."""
    if not rule or rule.get("tol") is None:
        return "-"
    return f"{'strict' if rule.get('mode') == 'strict' else 'margin'} {rule['tol']:g} nat"


def rule_line(rule: dict, cfg: dict) -> str:
    """The tolerance and why: the user's margin (typed or the default) or strict fp32 exactness."""
    tol = rule.get("tol")
    if tol is None:
        tol = cfg.get("margin_tol") if cfg.get("margin_tol") is not None else MARGIN_TOL
    mode = rule.get("mode", "margin")
    what = (f"strict fp32 exactness ({rule.get('reason')})" if mode == "strict"
            else f"the margin ({rule.get('reason') or '--margin-tol'})")
    return f"benign if <= {tol:g} nat, {what}"


def tolerance_summary(gates: list[GateRun]) -> str:
    """Which tolerance judged each gate, in one phrase: one rule for every gate (the usual case), else per gate."""
    ruled = [g for g in gates if g.rule]
    rules = {rule_short(g.rule): g.rule for g in ruled}
    if not rules:
        return "no gate was judged by a tolerance"
    if len(rules) == 1:
        (short, r), = rules.items()
        return f"{short} for {'every gate' if len(ruled) == len(gates) else ', '.join(g.name for g in ruled)} " \
               f"({r.get('reason')})"
    return "; ".join(f"{g.name}: {rule_short(g.rule)} ({g.rule.get('reason')})" for g in ruled)


def acceptance_lines(out: LosslessOutcome) -> list[str]:
    """The acceptance checks: the greedy gate against its reference, the concurrent gate's cN vs c1."""
    lines: list[str] = []
    ref = out.reference or {}
    for g in out.gates:
        for c in g.checks:
            if c.name in ("acceptance", "acceptance-vs-c1"):
                res = "skipped" if c.skipped else ("ok" if c.ok else "**FAIL**")
                lines.append(f"- {g.name} / {c.name}: {res}: {_cell(c.detail)}")
    if ref:
        src = ref.get("source") or "none (no reference recorded for this fingerprint yet)"
        lines.append(f"- reference (fingerprint `{ref.get('key')}`): {_cell(src)}")
        if ref.get("recorded"):
            lines.append(f"- recorded this run's acceptance as the reference: `{ref['recorded']}`")
    for g in out.gates:
        cmp = g.acceptance
        if cmp is None or not cmp.per_request:
            continue
        lines += ["", f"Per request, {g.name} gate (draft tokens accepted / drafted):", "",
                  "| request | max_tokens | at concurrency N | alone (c1) |", "|---|---:|---:|---:|"]
        for r in cmp.per_request:
            lines.append(f"| {_cell(r['rid'])} | {r['max_tokens'] if r['max_tokens'] is not None else '-'} "
                         f"| {r['test_accepted']}/{r['test_drafted']} | {r['ref_accepted']}/{r['ref_drafted']} |")
    return lines


def not_run_lines(out: LosslessOutcome) -> list[str]:
    lines = out.checks_not_run()
    return [f"- {_cell(x)}" for x in lines] if lines else ["- none: every check ran"]


def render_markdown(out: LosslessOutcome) -> str:
    cfg = out.config
    lines = [f"# Lossless gate: {out.verdict}", ""]
    if out.gates:
        lines += [f"Tolerance: {tolerance_summary(out.gates)}.", ""]
    lines += [f"- candidate (spec on): {_engine_line(out.engines.get('candidate', {}))}",
              f"- baseline (spec off): {_engine_line(out.engines.get('baseline', {}))}",
              f"- rule: greedy; at each divergence regret = logp(top1) - logp(pick) under the baseline's "
              f"top-{cfg.get('top_k')}; {rule_line(out.rule, cfg)}; re-anchoring after "
              f"each benign flip (at most {cfg.get('max_divergences')} per prompt); a flip the candidate's own "
              f"prefill re-scoring disagrees with beyond the tolerance fails",
              f"- prompts: {cfg.get('num_prompts')} from `{cfg.get('dataset')}`, max_tokens {cfg.get('max_tokens')}, "
              f"candidate concurrency {cfg.get('concurrency')}; re-scoring "
              f"{'on' if cfg.get('rescore') else 'off'}",
              f"- run id: {f'`{out.run_id}`' if out.run_id else 'not recorded'}, wall {out.wall_s:.1f} s"]
    lines += [f"- note: {n}" for n in out.notes]
    caps = capability_rows(out.engines)
    if caps:
        lines += ["", "## Endpoint capabilities", ""] + caps
    lines += ["", "## Checks that could not run", ""] + not_run_lines(out)
    lines += ["", "## Gates", ""] + (gate_summary_rows(out.gates) if out.gates else
                                     [f"No gate ran: CANNOT TEST ({out.cannot_test})."])
    for g in out.gates:
        lines += ["", f"## {g.name}: {g.verdict}", ""]
        lines += [f"_{n}_" for n in g.notes] + ([""] if g.notes else [])
        lines += prompt_rows(g) if g.prompts else ["(no per-request checks)"]
    acc = acceptance_lines(out)
    if acc:
        lines += ["", "## Acceptance", ""] + acc
    div = divergence_rows(out.gates)
    lines += ["", "## Divergences", ""] + (div or ["None: every candidate token equals the baseline's."])
    lines += ["", "## Run checks", ""] + check_rows(out.gates)
    lines += ["", "Verdicts: PASS = every token identical or a benign tie flip, speculation observed; "
              f"{PASS_ASSERTED} = the same, but nothing the candidate reported "
              "showed speculation and --assume-speculating asserted it; "
              f"{NOT_SPECULATING} = lossless but the engine never drafted (or accepted ~nothing), which proves "
              "nothing; FAIL = a pick above the tolerance, outside the baseline top-k, a length mismatch, a failed "
              "request or a failed run check; CANNOT TEST = the evidence a verdict needs could not be collected "
              "(a capability missing, nothing to compare, or no evidence that the candidate speculated), never a "
              "pass. See docs/lossless.md.", ""]
    return "\n".join(lines)


def render_console(out: LosslessOutcome) -> str:
    lines = []
    for g in out.gates:
        lines += [f"{g.name}: {g.verdict}"] + prompt_rows(g) + [""]
    lines += gate_summary_rows(out.gates) + [""]
    bad = [f"  {g.name}/{c.name}: {c.detail}" for g in out.gates for c in g.failed_checks]
    if bad:
        lines += ["failed checks:"] + bad
    nr = out.checks_not_run()
    if nr:
        lines += ["could not run:"] + [f"  {x}" for x in nr]
    if out.rule:
        lines.append(f"tolerance: {rule_line(out.rule, out.config)}")
    s = out.summary()
    why = f" [missing: {'; '.join(out.missing)}]" if out.missing and is_cannot_test(out.verdict) else ""
    if out.not_tested and not is_cannot_test(out.verdict):
        why += f" [not tested here: {'; '.join(out.not_tested)}]"
    tol = f", tolerance {tolerance_summary(out.gates)}" if out.gates else ""
    lines.append(f"VERDICT: {out.verdict}{why}  ({s['prompts']} prompts, {s['failed_prompts']} failed, {s['flips']} benign "
                 f"flips, mean accepted length {_f(s['mean_accept_len'], 2)}{tol}, {out.wall_s:.1f} s)")
    return "\n".join(lines)


def render_selftest(st: SelftestOutcome) -> str:
    gates = st.gate_names
    lines = [f"# Self-test: {PASS if st.ok else FAIL}", "",
             f"- engine: {_engine_line(st.engine)}",
             f"- {len(st.faults)} faults x {len(gates)} gates, clean engine x {len(st.clean)} repetitions; "
             f"{st.num_prompts} prompts, max_tokens {st.max_tokens}, tolerance "
             f"{rule_line(st.rule, {'margin_tol': st.margin_tol})}; "
             f"wall {st.wall_s:.1f} s",
             f"- reference acceptance (clean run 1, greedy gate): mean accepted length {_f(st.reference_accept, 3)}",
             "", "## Fault matrix", "",
             "| fault | what it breaks | caught by | " + " | ".join(gates) + " |",
             "|---|---|---|" + "---|" * len(gates)]
    for row in st.faults:
        cells = [("**caught**" if row.caught(g) else "pass") + (f" ({row.why(g)})" if row.caught(g) else "")
                 for g in gates]
        by = ", ".join(row.caught_by) or "**MISSED**"
        lines.append(f"| {row.label} | {_cell(row.description)} | {by} | " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "## Clean engine", "", "| run | verdicts | false alarms | mean accepted length | wall s |",
              "|---|---|---|---:|---:|"]
    for row in st.clean:
        verdicts = ", ".join(f"{g}: {row.verdicts.get(g, '-')}" for g in gates)
        lines.append(f"| {row.label} | {verdicts} | {', '.join(row.caught_by) or 'none'} "
                     f"| {_f(row.accept_len, 3)} | {row.wall_s:.1f} |")
    lines.append("")
    return "\n".join(lines)
