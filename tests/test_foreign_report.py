"""The llama.cpp report renderer (suites/report/foreign.py) on hand-made records: no llama.cpp needed.

It renders from records only, the same text twice; a scenario that exited otherwise than expected, a test
that did not pass or a finding that no longer reproduces makes the run not clean (listed at the top, exit
1); a results directory without any scenario (llama.cpp skipped) is refused, never a report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench.harness.foreign import records
from specbench.suites.report import ReportError
from specbench.suites.report import foreign as fr

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
skipped="{skipped}" tests="2" time="3.5"><testcase classname="tests.foreign.test_x" name="test_a" time="1.0"/>
<testcase classname="tests.foreign.test_x" name="test_b" time="2.5">{extra}</testcase></testsuite></testsuites>"""


def _results(tmp_path: Path, exit_code: int = 0, skipped: str = "") -> Path:
    d = tmp_path / "runs"
    records.append(d, "build", {"cached": True, "setup_s": 0.0, "pin": {"package": "llama-cpp-python", "version": "0.3.36"},
                                "info": {"version": "version: 0.5.0-dev (commit 0c1e570)", "total_s": 682.1}})
    records.append(d, "server", {"server": "off", "name": "off", "start_s": 0.12,
                                 "command": ["$LLAMACPP/bin/llama-server", "-m", "$GGUF/target-f32.gguf"]})
    records.append(d, "scenario", {"name": "lossless-draft", "about": "draft vs off", "exit_code": exit_code,
                                   "expect_exit": 0, "results": "lossless-draft", "verdict": "PASS", "exception": None,
                                   "argv": ["specbench", "lossless", "--baseline", "openai:<off>", "--candidate",
                                            "openai:<draft>", "--results", "$RESULTS/lossless-draft"]})
    records.append(d, "finding", {"id": "max-tokens-0", "title": "max_tokens 0 decodes one token", "status": "present",
                                  "observed": "completion_tokens 1", "expected": "none", "cause": None, "impact": None,
                                  "evidence": {}, "repro": {"serve": "off", "requests": [
                                      {"route": "/v1/completions", "body": {"prompt": "it's", "max_tokens": 0}}]}})
    run = d / "lossless-draft" / "lossless-1"
    run.mkdir(parents=True)
    caps = {"dialect": "llamacpp", "tokenize": "content", "output_ids": "tokens", "missing": [],
            "server": {"build": "b1-0c1e570"}, "notes": ["/version: HTTP 404"]}
    (run / "run.json").write_text(json.dumps({
        "run_id": "lossless-1", "suite": "lossless", "status": "complete",
        "engines": {"baseline": {"capabilities": caps}, "candidate": {"capabilities": caps}},
        "provenance": {"git": {"sha": "abc123def4567890", "dirty": False}},
        "summary": {"verdict": "PASS", "gates": {"greedy": "PASS"}, "mean_accept_len": 3.84,
                    "checks_not_run": ["greedy: kv-leak check skipped"]}}))
    (d / "junit.xml").write_text(JUNIT.format(skipped=1 if skipped else 0, extra=skipped))
    return d


def test_renders_from_records_only(tmp_path):
    d = _results(tmp_path)
    data = fr.load(d)
    md = fr.render(data)
    assert md == fr.render(fr.load(d)), "a pure function of the records"
    assert "| `lossless-draft` | draft vs off | `lossless --baseline openai:<off> --candidate openai:<draft>` | **PASS** " \
           "| 0 | 0 | yes | greedy PASS; mean accepted length 3.84 |" in md
    assert "$RESULTS" not in md and "not clean" not in md
    assert "`abc123def456`" in md and "version: 0.5.0-dev (commit 0c1e570)" in md
    assert "| capability | `<off>` | `<draft>` |" in md and "| tokenize | content | content |" in md
    assert "curl -s $URL/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"it'\\''s\"" in md
    assert "- greedy: kv-leak check skipped (lossless-draft)" in md
    assert fr.main([str(d), "--out", str(tmp_path / "r.md")]) == 0


def test_unexpected_exit_and_failed_tests_are_not_clean(tmp_path):
    d = _results(tmp_path, exit_code=3, skipped='<failure message="assert 3 == 0"/>')
    data = fr.load(d)
    bad = fr.problems(data)
    assert any("exit 3, expected 0" in p for p in bad) and any("verdict PASS but exit 3" in p for p in bad)
    assert any(p.startswith("failure: tests.foreign.test_x::test_b") for p in bad)
    md = fr.render(data)
    assert "**This run was not clean:**" in md and "**NO**" in md
    assert fr.main([str(d), "--out", str(tmp_path / "r.md")]) == 1
    assert fr.main([str(_results(tmp_path / "ok")), "--out", str(tmp_path / "r2.md"), "--pytest-exit", "1"]) == 1


def test_no_scenario_is_refused(tmp_path):
    """llama.cpp skipped (no toolchain): no report, never an empty one that reads as a pass."""
    d = tmp_path / "runs"
    d.mkdir()
    (d / "junit.xml").write_text(JUNIT.format(skipped=1, extra='<skipped message="llama.cpp: no C++ toolchain"/>'))
    with pytest.raises(ReportError, match="no C\\+\\+ toolchain"):
        fr.render(fr.load(d))
    out = tmp_path / "r.md"
    out.write_text("old")
    assert fr.main([str(d), "--out", str(out)]) == 1 and out.read_text() == "old"


def test_record_kinds(tmp_path):
    with pytest.raises(ValueError):
        records.append(tmp_path, "nonsense", {})
    with pytest.raises(ValueError):
        records.append(tmp_path, "server", {"kind": "off"})
    (tmp_path / records.FILE).write_text('{"kind": "build"}\n{"kind": "ser')  # a torn last line
    assert records.read(tmp_path) == [{"kind": "build"}]
