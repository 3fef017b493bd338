"""reports/foreign/llamacpp.md from the records of one run of tests/foreign (issue #27).

    scripts/foreign-report.sh [OUT_DIR]                        # the one command: run, then render
    python -m specbench.suites.report.foreign RESULTS --out reports/foreign/llamacpp.md   # render only

RESULTS is what the llama.cpp tests leave with $SPECBENCH_LLAMACPP_RESULTS set (harness/foreign/records.py):
foreign.jsonl (build, models, server, scenario and finding records), one results run per scenario
(<scenario>/<run-id>/run.json, checks.jsonl, audit.jsonl, ...) and pytest's junit.xml.

Contract: `load(dir)` reads the records; `render(loaded)` is a pure function of them (the same records
give the same text; every number in the report comes from a record). Sections: versions, test session,
servers, verdicts (each scenario's verdict, exit code and expected exit code), the endpoint capability
table (each endpoint's describe()["capabilities"]), the sweep table and the metrics audit (the sweep
report's own renderers over the sweep run), the findings with their reproductions, and what could not
run. A run with no scenario record (llama.cpp skipped or never reached) is refused (`ReportError`),
never rendered as a report; `problems(loaded)` lists what makes a run not clean (a test that did not
pass, a scenario whose exit code is not the expected one, an incomplete results run), and the command
exits 1 when there are any, after writing the report with them at the top.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from specbench.harness.foreign import records
from specbench.harness.verdicts import exit_code as verdict_exit

from . import ReportError, load_run_summary
from .markdown import _cap, _table, acceptance_table, audit_section, throughput_table

CAP_KEYS = ("dialect", "token_id_prompts", "tokenize", "tokenizer", "generate_route", "output_ids", "logprobs",
            "top_logprobs", "prompt_logprobs", "scoring", "usage", "metrics_prefix", "spec_counters",
            "per_request_spec", "prompt_cache", "speculated_logprobs", "missing")


# ---- loading -----------------------------------------------------------------------------------------
def _runs(d: Path) -> list[dict]:
    out = []
    for f in sorted(d.glob("*/run.json")):
        meta = json.loads(f.read_text())
        meta["_dir"] = str(f.parent)
        meta["_checks"] = [json.loads(x) for x in (f.parent / "checks.jsonl").read_text().splitlines() if x.strip()] \
            if (f.parent / "checks.jsonl").is_file() else []
        out.append(meta)
    return out


def junit(path: Path) -> dict | None:
    """pytest's counts, time and the tests that did not pass, from junit.xml."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["time"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    out["not_passed"] = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                out["not_passed"].append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": tag,
                                          "message": (el.get("message") or "")[:300]})
    out["slowest"] = sorted(((round(float(c.get("time", 0)), 2), f"{c.get('classname')}::{c.get('name')}")
                             for c in root.iter("testcase")), reverse=True)[:5]
    return out


def load(results: str | Path) -> dict:
    """Everything the report needs from a results directory (see the module docstring)."""
    d = Path(results)
    recs = records.read(d)
    by: dict[str, list[dict]] = {k: [r for r in recs if r.get("kind") == k] for k in records.KINDS}
    scenarios = []
    for sc in by["scenario"]:
        runs = _runs(d / sc["results"]) if sc.get("results") else []
        scenarios.append({**sc, "runs": runs})
    sweep = None
    for sc in scenarios:
        for run in sc["runs"]:
            if run.get("suite") == "sweep":
                try:
                    sweep = {"scenario": sc["name"], "summary": load_run_summary(run["_dir"]),
                             "report": next((str(p.relative_to(d)) for p in (d / sc["results"]).glob("*.md")), None)}
                except ReportError:
                    sweep = None
    return {"dir": str(d), "build": (by["build"] or [None])[-1], "models": (by["models"] or [None])[-1],
            "servers": by["server"], "scenarios": scenarios, "findings": by["finding"], "sweep": sweep,
            "junit": junit(d / "junit.xml")}


# ---- rendering ---------------------------------------------------------------------------------------
def _verdict(run: dict) -> str | None:
    s = run.get("summary") or {}
    return s.get("verdict") or (s.get("audit") or {}).get("verdict")


def problems(data: dict) -> list[str]:
    """What makes this run not clean: each is listed at the top of the report and makes the command exit 1."""
    out = []
    j = data.get("junit")
    if j is None:
        out.append("no junit.xml: the pytest session's outcome is unknown")
    else:
        out += [f"{t['outcome']}: {t['test']}: {t['message']}" for t in j["not_passed"]]
    for sc in data["scenarios"]:
        if sc["exit_code"] != sc["expect_exit"]:
            out.append(f"scenario {sc['name']}: exit {sc['exit_code']}, expected {sc['expect_exit']}"
                       + (f" ({sc['exception']})" if sc.get("exception") else ""))
        if not sc["runs"]:
            out.append(f"scenario {sc['name']}: no results run recorded")
        for run in sc["runs"]:
            if run.get("status") != "complete":
                out.append(f"scenario {sc['name']}: run {run.get('run_id')} is {run.get('status')}")
            v = _verdict(run)
            if v and sc["runs"] == [run] and verdict_exit(v) != sc["exit_code"]:
                out.append(f"scenario {sc['name']}: verdict {v} but exit {sc['exit_code']}")
    for f in data["findings"]:
        if f.get("status") != "present":
            out.append(f"finding {f['id']} changed: {f.get('observed')}")
    return out


def _label(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    v = argv[argv.index(flag) + 1]
    return v.removeprefix("openai:")


def _evidence(sc: dict) -> str:
    """One cell of what the scenario's own records say: gates, accepted length, failures, what was missing."""
    parts = []
    for run in sc["runs"]:
        s = run.get("summary") or {}
        if run.get("suite") == "lossless":
            gates = s.get("gates") or {}
            if gates:
                parts.append(", ".join(f"{g} {v}" for g, v in gates.items()))
            if s.get("mean_accept_len") is not None:
                parts.append(f"mean accepted length {s['mean_accept_len']:.2f}")
            bad = [c for c in run["_checks"] if c.get("status") == "fail"]
            if bad:
                worst = max(bad, key=lambda c: c.get("max_regret") or 0.0)
                parts.append(f"{len(bad)} prompt-gate cells FAIL, max regret {worst['max_regret']:.3f} nat "
                             f"({worst.get('reason')})")
            if s.get("flips"):
                parts.append(f"{s['flips']} benign flips")
        elif run.get("suite") == "sampled":
            c = (s.get("comparisons") or {}).get("spec") or {}
            sp = s.get("spec") or {}
            parts.append(f"{c.get('testable', 0)}/{c.get('cells', 0)} cells testable, {c.get('rejected', 0)} rejected")
            if sp.get("num_draft_tokens"):
                parts.append(f"acceptance {sp['acceptance_rate']:.1%} ({sp.get('source')})")
            if s.get("untestable_samples"):
                parts.append(f"{s['untestable_samples']} samples unreadable")
        elif run.get("suite") == "sweep":
            a = s.get("audit") or {}
            parts.append("audit " + ", ".join(f"{k} {v}" for k, v in (a.get("arms") or {}).items()))
        for m in s.get("missing") or []:
            parts.append(f"missing: {m}")
    return "; ".join(parts).replace("|", "\\|") or "-"


def _versions(data: dict) -> list[str]:
    b, m = data.get("build") or {}, data.get("models") or {}
    info, pin = b.get("info") or {}, b.get("pin") or {}
    prov = next((r.get("provenance") or {} for sc in data["scenarios"] for r in sc["runs"]), {})
    git = prov.get("git") or {}
    pk = prov.get("packages") or {}
    caps = next((c for sc in data["scenarios"] for r in sc["runs"] for c in
                 [e.get("capabilities") for e in (r.get("engines") or {}).values()] if c), {})
    build_kind = "from the cache" if b.get("cached") else "built in this run"
    rows = [
        ["llama.cpp", f"`{info.get('version')}`; `/props` build_info `{(caps.get('server') or {}).get('build')}`"],
        ["source pin", f"`{pin.get('package')}=={pin.get('version')}` sdist (`{pin.get('sdist')}`, sha256 "
                       f"`{pin.get('sha256')}`), vendoring llama.cpp commit `{pin.get('llama_cpp_commit')}`"],
        ["build", f"{build_kind} ({b.get('setup_s')} s in this session); when built: configure "
                  f"{info.get('configure_s')} s + compile {info.get('build_s')} s = {info.get('total_s')} s at -j"
                  f"{info.get('jobs')} on {info.get('cpus')} CPUs, `{info.get('cxx')}`, {info.get('built_at')}"],
        ["cmake", " ".join(f"`{a}`" for a in info.get("cmake_args") or [])],
        ["GGUF fixtures", f"recipe {(m.get('info') or {}).get('recipe')}, perturbation "
                          f"{(m.get('info') or {}).get('perturb')}, DFlash taps {(m.get('info') or {}).get('dflash_taps')}; "
                          + ", ".join(f"`{v}`" for v in (m.get("files") or {}).values())],
        ["specbench", f"git `{(git.get('sha') or '?')[:12]}`{' (dirty tree)' if git.get('dirty') else ''}; "
                      + ", ".join(f"{k} {v}" for k, v in pk.items() if k in ("specbench", "torch", "tokenizers", "httpx"))],
        ["machine", f"{(prov.get('device') or {}).get('cpu')} x{(prov.get('device') or {}).get('cpu_count')}, "
                    f"{prov.get('platform')}, Python {prov.get('python')}"],
    ]
    return ["## Versions", "", *_table(["", ""], rows, left=2), ""]


def _session(data: dict) -> list[str]:
    j = data.get("junit")
    if j is None:
        return ["## Test session", "", "No junit.xml in the results: the session's outcome is unknown.", ""]
    passed = j["tests"] - j["failures"] - j["errors"] - j["skipped"]
    out = ["## Test session", "",
           f"`pytest tests/foreign`: {passed} passed, {j['failures']} failed, {j['errors']} errors, {j['skipped']} "
           f"skipped in {j['time']} s (pytest's own time; the build {'was cached' if (data.get('build') or {}).get('cached') else 'ran in it'}). "
           "Slowest: " + "; ".join(f"`{n.split('::')[-1]}` {t} s" for t, n in j["slowest"]) + ".", ""]
    if j["not_passed"]:
        out += _table(["test", "outcome", "message"], [[f"`{t['test']}`", t["outcome"], t["message"].replace("|", "\\|")]
                                                      for t in j["not_passed"]], left=3) + [""]
    return out


def _servers(data: dict) -> list[str]:
    rows = [[f"`{s['name']}`", f"`{' '.join(s['command'])}`", f"{s['start_s']}"] for s in data["servers"]]
    return ["## Servers", "",
            "Started by the session's fixtures (`harness/foreign/llamacpp.py`, `tests/foreign/conftest.py`) on free "
            "loopback ports; `$LLAMACPP` = the build cache directory, `$GGUF` = its converted fixtures. "
            "`python -m specbench.harness.foreign.llamacpp serve KIND` starts the same server by hand.", "",
            *_table(["kind", "command", "start s"], rows, left=2), ""]


def _verdicts(data: dict) -> list[str]:
    rows = []
    for sc in data["scenarios"]:
        v = next((_verdict(r) for r in sc["runs"] if _verdict(r)), None) or sc.get("verdict") or "-"
        ok = "yes" if sc["exit_code"] == sc["expect_exit"] else "**NO**"
        argv = sc["argv"][1:]
        shown = " ".join(a for i, a in enumerate(argv)  # the results directory the test chose: not part of it
                         if a not in ("--results", "--out") and (i == 0 or argv[i - 1] not in ("--results", "--out")))
        rows.append([f"`{sc['name']}`", sc.get("about") or "", f"`{shown}`".replace("|", "\\|"), f"**{v}**",
                     str(sc["exit_code"]), str(sc["expect_exit"]), ok, _evidence(sc)])
    return ["## Verdicts", "",
            "Each row is one `specbench` command run by `tests/foreign/test_llamacpp_gates.py` (through the CLI, "
            "in-process), its results run kept. Exit codes: 0 PASS, 1 FAIL, 3 CANNOT TEST (README). `<kind>` is "
            "the URL of that server; `<kind, /tokenize 404>` a pass-through proxy in front of it that answers "
            "/tokenize with 404. The test asserts the expected exit code and verdict.", "",
            *_table(["scenario", "what", "command", "verdict", "exit", "expected", "as expected", "evidence (records)"],
                    rows, left=8), ""]


def _capabilities(data: dict) -> list[str]:
    cols: dict[str, dict | None] = {}
    for sc in data["scenarios"]:
        for run in sc["runs"]:
            engines = run.get("engines") or {}
            argv = sc["argv"]
            if run.get("suite") == "sweep":
                labels = {a.split(",name=")[-1]: a.split(",name=")[0].removeprefix("openai:")
                          for a in (argv[argv.index("--arms") + 1].split(";") if "--arms" in argv else [])}
            else:
                labels = {"baseline": _label(argv, "--baseline"), "candidate": _label(argv, "--candidate")}
                if "--tokenizer" in argv:
                    labels = {k: f"{v} + --tokenizer" for k, v in labels.items()}
            for arm, desc in engines.items():
                name = labels.get(arm) or arm
                if name not in cols or cols[name] is None:
                    cols[name] = desc.get("capabilities")
    names = list(cols)
    rows = []
    for k in CAP_KEYS:
        row = [k]
        for n in names:
            c = cols[n]
            if c is None:
                row.append("not probed")
            elif k == "tokenizer" and isinstance(c.get(k), dict):
                t = c[k]
                row.append(f"local, agrees with endpoint: {_cap(t.get('agrees_with_endpoint'))}")
            else:
                row.append(_cap(c.get(k)))
        rows.append(row)
    rows.insert(1, ["version / build", *[_cap(((cols[n] or {}).get("server") or {}).get("build")) for n in names]])
    notes = next((c.get("notes") for c in cols.values() if c and c.get("dialect") == "llamacpp"), None) or []
    defaults = next((c.get("sampler_defaults") for c in cols.values() if c and c.get("sampler_defaults")), None)
    out = ["## Endpoint capabilities", "",
           "The `describe()[\"capabilities\"]` record of each endpoint as the OpenAI adapter probed it "
           "(`harness/adapters/dialect.py`), taken from the scenarios' run records. `not probed`: the engine "
           "string said `probe=0`.", "",
           *_table(["capability", *[f"`{n}`" for n in names]], rows, left=len(names) + 1), ""]
    if defaults:
        out += [f"Server-side sampler defaults (sent explicitly by every gate request): `{json.dumps(defaults)}`.", ""]
    if notes:
        out += ["Probe notes (llama.cpp):", "", *[f"- {n}" for n in notes], ""]
    return out


def _sweep(data: dict) -> list[str]:
    sw = data.get("sweep")
    if sw is None:
        return ["## Sweep", "", "No sweep run in the records.", ""]
    s = sw["summary"]
    out = ["## Sweep", "", f"Scenario `{sw['scenario']}`, run `{s.run_id}`"
           + (f"; the sweep's full report: `{sw['report']}`" if sw.get("report") else "") + ". A tiny model on two "
           "shared CPU cores: the figures show that the sweep runs against llama.cpp, not how fast llama.cpp is.", "",
           *throughput_table(s), "", *acceptance_table(s), ""]
    audit = audit_section(s)
    if audit:
        audit[0] = "## Metrics audit: " + audit[0].split(": ", 1)[-1]
    return out + (audit or ["## Metrics audit", "", "No audit record in the sweep run.", ""])


def _curl(req: dict) -> str:
    body = json.dumps(req["body"], ensure_ascii=False).replace("'", "'\\''")
    return f"curl -s $URL{req['route']} -H 'Content-Type: application/json' -d '{body}'"


def _findings(data: dict) -> list[str]:
    out = ["## Findings", "",
           "Reproduced in this run by `tests/foreign/test_llamacpp_findings.py` (regression checks: a finding that "
           "stops reproducing is a warning there and a problem here). Reproductions: start the server, set `URL` "
           "to the `base_url` it prints, send the requests.", ""]
    for i, f in enumerate(data["findings"], 1):
        out += [f"### {i}. {f['title']} ({f['status'].upper()})", "", f"- observed: {f['observed']}",
                f"- expected: {f['expected']}"]
        out += [f"- {k}: {f[k]}" for k in ("cause", "impact") if f.get(k)]
        r = f.get("repro") or {}
        cmds = [f"python -m specbench.harness.foreign.llamacpp serve {r.get('serve')} --seconds 600 &"
                "   # prints {\"base_url\": ...}", "URL=http://127.0.0.1:PORT"]
        for req in r.get("requests") or []:
            if req.get("note"):
                cmds.append(f"# {req['note']}")
            cmds.append(_curl(req))
        out += ["", "```bash", *cmds, "```", ""]
    return out


def _not_run(data: dict) -> list[str]:
    seen: dict[str, list[str]] = {}
    for sc in data["scenarios"]:
        for run in sc["runs"]:
            for c in (run.get("summary") or {}).get("checks_not_run") or []:
                seen.setdefault(c, []).append(sc["name"])
    if not seen:
        return []
    return ["## Checks that could not run", "",
            *[f"- {c} ({', '.join(dict.fromkeys(n))})" for c, n in seen.items()], ""]


def render(data: dict) -> str:
    """The markdown report: a pure function of `load(dir)`'s result."""
    if not data["scenarios"]:
        j = data.get("junit") or {}
        why = "; ".join(f"{t['outcome']}: {t['message']}" for t in j.get("not_passed", [])[:3]) or "no records"
        raise ReportError(f"{data['dir']}: no scenario was recorded (llama.cpp did not run: {why})")
    bad = problems(data)
    lines = ["# llama.cpp as the foreign engine: specbench's gates against `llama-server`", "",
             "Generated by `scripts/foreign-report.sh` from one run of `tests/foreign` (the llama.cpp tests of "
             "`make test`), rendered from its records alone by `python -m specbench.suites.report.foreign` "
             f"(issue #27; records: `{Path(data['dir']).name}/`).", ""]
    if bad:
        lines += ["**This run was not clean:**", "", *[f"- {p}" for p in bad], ""]
    lines += _versions(data) + _session(data) + _verdicts(data) + _capabilities(data) + _sweep(data) + \
        _findings(data) + _not_run(data) + _servers(data)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.suites.report.foreign", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="the directory $SPECBENCH_LLAMACPP_RESULTS pointed at")
    ap.add_argument("--out", type=Path, required=True, help="the markdown file to write")
    ap.add_argument("--pytest-exit", type=int, default=None, help="pytest's exit code (nonzero: exit 1)")
    args = ap.parse_args(argv)
    data = load(args.results)
    try:
        text = render(data)
    except ReportError as e:
        print(f"foreign report: {e}; {args.out} left as it was", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    bad = problems(data)
    if args.pytest_exit:
        bad.append(f"pytest exited {args.pytest_exit}")
    print(f"wrote {args.out}" + (f"; NOT CLEAN: {'; '.join(bad)}" if bad else ""), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
