"""`specbench report` renders one record of every run kind (suites/report/kinds.py, cli/report.py): lossless
and gaps from runs the commands themselves record, selftest / sampled / eval from records their suites'
own serialisers write (a real run of those takes minutes); the default output is under results/, never
the tracked reports/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness.results import open_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cli() -> CliRunner:
    _register()
    return CliRunner()


def _only_run(results: Path, suite: str) -> Path:
    runs = [p.parent for p in results.glob(f"{suite}-*/run.json")]
    assert len(runs) == 1, runs
    return runs[0]


def _report(cli: CliRunner, *args: str) -> str:
    res = cli.invoke(app, ["report", *args, "--out", "-"])
    assert res.exit_code == 0, res.output
    return res.output


def test_lossless_run_renders(cli, tmp_path) -> None:
    res = cli.invoke(app, ["lossless", "--num-prompts", "1", "--max-tokens", "8", "--no-check-draft",
                           "--no-accept-reference", "--results", str(tmp_path)])
    assert res.exit_code == 0, res.output
    run = _only_run(tmp_path, "lossless")
    md = _report(cli, str(run))
    assert md.startswith("# specbench lossless report")
    assert f"## lossless run `{run.name}`" in md and "**PASS**: 1 prompts, 0 failed" in md
    assert "| greedy | PASS |" in md and "### Prompts: 1 checked, 0 not ok" in md
    # default output: the results store, not reports/
    res = cli.invoke(app, ["report", str(run), "--results", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "reports" / f"{run.name}.md").read_text() == md


def test_prefix_run_renders_as_the_run_printed_it(cli, tmp_path) -> None:
    """`lossless --suite prefix`: the report is the gate's own rendering, rebuilt from the records."""
    res = cli.invoke(app, ["lossless", "--suite", "prefix", "--num-prompts", "1", "--results", str(tmp_path)])
    assert res.exit_code == 0, res.output
    printed = [line for line in res.output.splitlines() if line.startswith("|")]
    md = _report(cli, str(_only_run(tmp_path, "lossless-prefix")))
    assert "### Prefix gate: PASS" in md and "no warm turn fell back" in md
    assert [line for line in md.splitlines() if line.startswith("|")] == printed and len(printed) == 8  # 6 cases


def test_gaps_run_renders(cli, tmp_path) -> None:
    trace = ROOT / "tests" / "data" / "traces" / "hta_critical_path_alexnet_a100.json.gz"
    res = cli.invoke(app, ["gaps", str(trace), "--json", "--results", str(tmp_path)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    run = _only_run(tmp_path, "gaps")
    md = _report(cli, str(run))
    assert f"## gaps run `{run.name}`" in md and trace.name in md
    dev = doc["devices"][0]
    assert f"### device {dev['device']}: busy" in md and f"{dev['n_ops']} ops, {dev['n_gaps']} gaps" in md
    top = max(dev["by_class"], key=lambda c: c["idle_ns"])
    assert f"| {top['class']} |" in md


def test_selftest_run_renders(cli, tmp_path) -> None:
    from specbench.suites.lossless.selftest import EngineRow, SelftestOutcome

    verdicts = {"greedy": "PASS", "concurrent": "FAIL"}
    rule = {"mode": "strict", "tol": 4e-4, "reason": "both engines run float32 (no --margin-tol typed)",
            "margin_tol": 0.2, "strict_tol": 4e-4, "margin_given": False}  # a strict run: the rule that judged
    out = SelftestOutcome(engine={"name": "candidate"}, num_prompts=2, max_tokens=16, margin_tol=0.2,
                          reference_accept=2.5, rule=rule,
                          faults=[EngineRow("kv_offset", ("kv_offset",), "KV offset", dict(verdicts)),
                                  EngineRow("skip_rollback", ("skip_rollback",), "rollback", {"greedy": "PASS"})],
                          clean=[EngineRow("clean-1", (), "clean", {"greedy": "PASS"}, accept_len=2.5)])
    with open_run("selftest", results=tmp_path, run_id="st") as run:
        run.update(summary=out.to_dict())
    md = _report(cli, str(tmp_path / "st"))
    assert "**FAIL**: 2 faults, missed skip_rollback" in md
    # the tolerance that judged, not the margin that did not (a strict run once read "margin tol 0.2")
    assert "tolerance strict 0.0004 nat (both engines run float32 (no --margin-tol typed))" in md
    assert "margin tol" not in md
    assert "| kv_offset | kv_offset | concurrent | concurrent: FAIL |" in md
    assert "| skip_rollback | skip_rollback | MISSED | all PASS |" in md
    assert "| clean-1 | none | no alarm | all PASS | 2.5 |" in md


def test_sampled_run_renders(cli, tmp_path) -> None:
    summary = {"verdict": "PASS", "passed": True, "missing": [], "untestable_samples": 0, "spec": None,
               "spec_by_config": {}, "not_tested": ["t1: no fully accepted verify step"],
               "comparisons": {"spec-vs-off": {"cells": 12, "testable": 10, "rejected": 0, "rejected_cells": [],
                                               "min_p": 0.031, "max_tv": 0.12, "median_mde_lone": 0.2,
                                               "median_mde_all": 0.1, "frac_detectable_lone": 1.0}},
               "options": {}, "configs": ["t1", "t0.7"], "num_prompts": 4, "failed": 0, "seconds": 12.5}
    with open_run("sampled", results=tmp_path, run_id="sp") as run:
        run.write("cells", {"case": None, "comparison": "spec-vs-off", "prompt": 0, "config": 0})
        run.update(summary=summary)
    md = _report(cli, str(tmp_path / "sp"))
    assert "**PASS**: configs t1, t0.7; 4 prompts, 0 failed" in md
    assert "| spec-vs-off | 12 | 10 | 0 | 0.031 | 0.12 | 0.2 |" in md
    assert "Not tested: t1: no fully accepted verify step" in md and "1 cells recorded" in md


def test_eval_run_renders(cli, tmp_path) -> None:
    from specbench.suites.evalparity.parity import ParityRow, Score
    from specbench.suites.evalparity.report import ArmInfo, ParityRun, to_json

    row = ParityRow("gsm8k", "strict-match", "exact_match", 50, Score(0.42, 0.07), Score(0.44, 0.07), 0.02,
                    0.099, 0.03, 1)
    arm = ArmInfo("baseline", "b", "local", "m", "http://127.0.0.1:1", "remote", None, 1.0, "0.4.9", "")
    pr = ParityRun(["gsm8k"], 5, 50, 4, [row], [arm, arm])
    with open_run("evalparity", results=tmp_path, run_id="ev") as run:
        (run.path / "report.json").write_text(json.dumps(to_json(pr), default=str))
        run.update(summary={"verdict": pr.verdict})
    md = _report(cli, str(tmp_path / "ev"))
    assert f"**{pr.verdict}**: tasks gsm8k; few-shot 5, limit 50" in md
    assert "| gsm8k | strict-match | exact_match | 50 | 0.42 ± 0.07 | 0.44 ± 0.07 | 0.02 | 0.099 |" in md


def test_runs_of_one_kind_side_by_side_and_kinds_not_mixed(cli, tmp_path) -> None:
    for rid, ok in (("a", True), ("b", False)):
        with open_run("selftest", results=tmp_path, run_id=rid) as run:
            run.update(summary={"ok": ok, "faults": [], "clean": [], "num_prompts": 3})
    md = _report(cli, str(tmp_path / "a"), str(tmp_path / "b"))
    assert md.startswith("# specbench selftest report: 2 runs") and "## Runs side by side" in md
    assert "| `a` | complete | PASS | 3 |" in md and "| `b` | complete | FAIL | 3 |" in md
    with open_run("sweep", results=tmp_path, run_id="sw"):
        pass
    bad = cli.invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "sw")])
    assert bad.exit_code == 2 and "render them separately" in bad.output
    with open_run("mystery", results=tmp_path, run_id="mx"):
        pass
    bad = cli.invoke(app, ["report", str(tmp_path / "mx")])
    assert bad.exit_code == 2 and "expected runs of sweep, lossless" in bad.output
