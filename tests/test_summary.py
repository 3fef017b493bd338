"""Every long command ends with one summary table of its results (cli/summary.py), on stderr so that stdout (markdown,
tables, the one JSON document of --json) is what it was; --quiet prints neither it nor the progress display.
sweep and tune here (fake engines); lossless, selftest and eval in tests/test_progress.py beside their progress."""

from __future__ import annotations

import io
import tempfile

from test_progress import _fake_sweep_arms, _no_run_path, _sweep_args
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.cli.summary import Summary, selftest_summary, show


def _invoke(args: list[str]):
    _register()
    return CliRunner().invoke(app, args)


def _tail(err: str, title: str) -> list[str]:
    """stderr from the summary's title on; the title must come after the progress display's last line."""
    lines = err.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith(title)]
    assert len(starts) == 1, err
    assert not any(x.startswith(("done: ", "stopped at: ")) for x in lines[starts[0]:]), err
    return lines[starts[0]:]


def _cells(tail: list[str]) -> list[list[str]]:
    return [[c.strip() for c in x.split("│")[1:-1]] for x in tail if x.startswith("│")]


def test_sweep_ends_with_a_summary_table_and_quiet_drops_it(monkeypatch, tmp_path) -> None:
    _fake_sweep_arms(monkeypatch)
    r = _invoke(_sweep_args(tmp_path))
    assert r.exit_code == 0, r.output
    tail = _tail(r.stderr, "sweep: 2 levels x 2 arms (baseline A)")
    header = next(x for x in tail if "tok/s" in x)
    for col in ("vs baseline", "TTFT p50 ms", "TPOT p50 ms", "accept len", "requests ok"):
        assert col in header
    rows = _cells(tail)
    assert [(x[0], x[1]) for x in rows] == [("c1", "A"), ("c1", "B"), ("c2", "A"), ("c2", "B")]  # no noise copy
    assert rows[0][3] == "baseline" and rows[1][3].endswith("×") and float(rows[1][2]) > 0
    assert rows[0][6] == "—" and float(rows[1][6]) > 1  # the spec arm's acceptance; the plain one has none
    assert all(x[7] == "2/2" for x in rows)
    (run_dir,) = (tmp_path / "res").iterdir()
    assert tail[-2:] == [f"records: {run_dir}", f"full report: specbench report {run_dir}"]
    assert "TTFT" not in r.stdout  # stdout is unchanged: no table there
    for flag in ("--quiet", "-q", "--no-progress"):  # no display, no summary, the same stdout
        q = _invoke(_sweep_args(tmp_path, flag))
        assert q.exit_code == 0 and q.stderr == "", (flag, q.stderr)
        assert _no_run_path(q.stdout) == _no_run_path(r.stdout)


def test_sweep_no_record_writes_the_report_then_keeps_nothing(monkeypatch, tmp_path) -> None:
    _fake_sweep_arms(monkeypatch)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    rep = tmp_path / "sweep.md"
    r = _invoke(_sweep_args(tmp_path, "--no-record", "--report", str(rep)))
    assert r.exit_code == 0, r.output
    assert "records: not kept (--no-record; complete)" in r.stdout
    assert not (tmp_path / "res").exists() and not list(scratch.iterdir())  # the scratch store is gone
    assert "## Run `sweep-" in rep.read_text()  # rendered from the scratch store's records before that
    tail = _tail(r.stderr, "sweep: 2 levels x 2 arms")
    assert tail[-1] == f"full report: {rep}" and not any(x.startswith("records:") for x in tail)


def test_tune_ends_with_its_choice_per_concurrency(monkeypatch, tmp_path) -> None:
    from test_sweep import FakeAdapter, fake_builder

    from specbench.harness import engines

    monkeypatch.setattr(engines, "build_adapter", fake_builder({"plain": FakeAdapter("plain"),
                                                                "spec": FakeAdapter("spec", spec=True)}))
    args = ["tune", "--arms", "plain=openai:http://a;spec=openai:http://b", "-c", "1,2", "--prompts-per-level", "1",
            "--rounds", "1", "--warmup", "0", "--max-tokens", "4", "--results-dir", str(tmp_path / "res")]
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    tail = _tail(r.stderr, "tune: 2 arms, baseline plain")
    rows = _cells(tail)
    assert [x[0] for x in rows] == ["c1", "c2"] and all(x[3] in ("plain", "spec") for x in rows)
    assert all(x[2].startswith("±") and x[2].endswith("%") for x in rows)  # the noise floor
    assert any(x.startswith("crossover: spec ") for x in tail) and any(x.startswith("recommendation: ") for x in tail)
    q = _invoke([*args, "-q"])
    assert q.exit_code == 0 and q.stderr == ""
    assert q.stdout.splitlines()[:4] == r.stdout.splitlines()[:4]  # the markdown, as before (figures differ run to run)


def test_selftest_summary_names_missed_faults_and_false_alarms() -> None:
    from specbench.suites.lossless.selftest import EngineRow, SelftestOutcome

    gates = ("greedy", "concurrent")
    clean = [EngineRow("clean #1", (), "", {"greedy": "PASS", "concurrent": "PASS"}, accept_len=2.5, wall_s=1.0),
             EngineRow("clean #2", (), "", {"greedy": "PASS", "concurrent": "CANNOT TEST"}, wall_s=1.0)]
    faults = [EngineRow("wrong_bonus", ("wrong_bonus",), "", {"greedy": "FAIL", "concurrent": "PASS"}, wall_s=2.0),
              EngineRow("skip_rollback", ("skip_rollback",), "", {"greedy": "PASS", "concurrent": "PASS"}, wall_s=2.0)]
    out = SelftestOutcome({}, faults, clean, 2, 16, 0.2, None, wall_s=6.0, gate_names=gates)
    s = selftest_summary(out, "results/selftest-x")
    assert s.title == "selftest: FAIL (2 faults, 2 clean runs, 6.0 s)"
    assert [r[2] for r in s.rows] == ["no alarm (every gate PASS)", "FALSE ALARM: concurrent", "greedy", "MISSED"]
    assert s.rows[0][3] == "2.50" and s.rows[1][3] is None
    assert s.notes == ["records: results/selftest-x (full report: specbench report results/selftest-x)"]


def test_summary_table_is_120_columns_without_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    cols = [f"column {i}" for i in range(10)]
    show(Summary("t", cols, [[f"value {i}" for i in range(10)]], ["a note"]), quiet=False, stream=buf)
    lines = buf.getvalue().splitlines()
    assert max(len(x) for x in lines) <= 120 and any(all(c in x for c in cols) for x in lines)  # one header line
    assert lines[-1] == "a note"
    buf = io.StringIO()
    show(Summary("t", cols, []), quiet=True, stream=buf)
    assert buf.getvalue() == ""
