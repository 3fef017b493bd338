"""Long commands show one progress display with a total ETA and end with a summary table (cli/progress.py);
--quiet / --json keep them out. Exercised on `specbench sampled`, the command that ran ~20 min silent."""

from __future__ import annotations

import io
import json

from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.cli.progress import RunProgress


def test_plain_lines_carry_the_total_and_an_eta() -> None:
    buf = io.StringIO()
    with RunProgress(0, stream=buf, terminal=False) as p:
        p.plan(4)
        p.phase("baseline", 2)
        p.advance()
        p.advance()
        assert p.eta() is not None and p.eta() >= 0
        p.phase("candidate", 2)
        p.advance()
        p.advance()
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("baseline: 2 requests; 0/4 done") and "ETA" not in lines[0]
    assert lines[1].startswith("candidate: 2 requests; 2/4 done") and ", ETA " in lines[1]
    assert lines[2].startswith("done: 4/4 requests in ")


def test_terminal_bar_and_quiet() -> None:
    buf = io.StringIO()
    with RunProgress(0, stream=buf, terminal=True) as p:
        p.plan(3)
        p.phase("baseline", 3)
        for _ in range(3):
            p.advance()
    assert "baseline" in buf.getvalue() and "3/3 requests" in buf.getvalue() and "ETA" in buf.getvalue()
    buf = io.StringIO()
    for terminal in (True, False):
        with RunProgress(0, stream=buf, terminal=terminal, quiet=True) as p:
            p.plan(1)
            p.phase("x", 1)
            p.advance()
    assert buf.getvalue() == ""


def _sampled(tiny_pair, tmp_path, *extra: str):
    target, draft = tiny_pair
    _register()
    args = ["sampled", "--baseline", f"local:{target},spec=off", "--candidate", f"local:{target},draft={draft},spec=dflash",
            "--num-prompts", "1", "--positions", "4", "--samples", "16", "--configs", "t=0.5", "--permutations", "99",
            "--no-record", *extra]
    return CliRunner().invoke(app, args)


def test_sampled_shows_progress_then_a_summary_table(tiny_pair, tmp_path) -> None:
    r = _sampled(tiny_pair, tmp_path)
    assert r.exit_code == 0, r.output
    assert "baseline (spec off): 16 requests; 0/32 done" in r.stderr
    assert "candidate (spec on): 16 requests; 16/32 done" in r.stderr and "done: 32/32 requests" in r.stderr
    assert "sampled gate: PASS (1 prompts x t0.5, " in r.stdout  # the table's title (config names)
    assert "comparison" in r.stdout and "spec" in r.stdout and r.stdout.rstrip().splitlines()[-1].startswith(
        "sampled gate: PASS")


def test_sampled_quiet_and_json_print_no_progress(tiny_pair, tmp_path) -> None:
    r = _sampled(tiny_pair, tmp_path, "--quiet")
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and r.stdout.strip().startswith("sampled gate: PASS") and r.stdout.count("\n") == 1
    r = _sampled(tiny_pair, tmp_path, "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    assert json.loads(r.stdout.strip().splitlines()[-1])["verdict"] == "PASS"


def test_selftest_counts_engines_with_an_eta(tiny_pair, tmp_path) -> None:
    target, draft = tiny_pair
    _register()
    args = ["selftest", "--candidate", f"local:{target},draft={draft},spec=dflash", "--faults", "wrong_bonus",
            "--repeat", "2", "--num-prompts", "1", "--max-tokens", "16", "--no-record"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "clean #1: 1 engines; 0/3 done" in r.stderr and "wrong_bonus: 1 engines; 1/3 done" in r.stderr
    assert "clean #2: 1 engines; 2/3 done" in r.stderr and ", ETA " in r.stderr and "done: 3/3 engines" in r.stderr
    assert "[selftest] wrong_bonus: caught by" in r.stderr and r.stdout.startswith("# Self-test: PASS")
    q = CliRunner().invoke(app, [*args, "--quiet"])
    assert q.exit_code == 0 and q.stderr == "" and q.stdout.startswith("# Self-test: PASS")
