"""Long commands show one progress display with a total ETA and end with a summary table (cli/progress.py);
--quiet / --json keep them out. Exercised on `specbench sampled`, the command that ran ~20 min silent."""

from __future__ import annotations

import importlib.util
import io
import json
import re

import pytest
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
    out = _plain(buf.getvalue())  # drawn as on a terminal (colours, cursor moves) even into a StringIO
    assert "baseline" in out and "3/3 requests" in out and "ETA" in out
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
            "--prompt-set", "gsm8k", "--no-record", *extra]
    return CliRunner().invoke(app, args)


def test_sampled_shows_progress_then_a_summary_table(tiny_pair, tmp_path) -> None:
    r = _sampled(tiny_pair, tmp_path)
    assert r.exit_code == 0, r.output
    # 16 samples an arm, then its seed repeat: the 16 again beside 8 neighbours, each neighbour alone first (32);
    # then the fit: the baseline scores the control's 16 samples and the candidate's 16
    assert "baseline (spec off): 16 requests; 0/128 done" in r.stderr
    assert "seed repeat (baseline): 32 requests; 16/128 done" in r.stderr
    assert "candidate (spec on): 16 requests; 48/128 done" in r.stderr
    assert "fit (the baseline scores each sample): 32 requests; 96/128 done" in r.stderr
    assert "done: 128/128 requests" in r.stderr
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
    tail = r.stderr.split("selftest: PASS (1 faults, 2 clean runs, ")[-1].splitlines()  # the summary table, last
    assert [x.split("│")[1].strip() for x in tail if x.startswith("│ ") and x.split("│")[1].strip()] == [
        "clean #1", "clean #2", "wrong_bonus"] and tail[-1].startswith("└")
    q = CliRunner().invoke(app, [*args, "--quiet"])
    assert q.exit_code == 0 and q.stderr == "" and q.stdout.startswith("# Self-test: PASS")


# ---- sweep / tune: requests over every cell (warm-up included), the cell, the ETA of the whole run ----

def _sweep_args(tmp_path, *extra: str) -> list[str]:
    return ["sweep", "-c", "1,2", "--num-prompts", "2", "--max-tokens", "4", "--rounds", "1", "--warmup", "1",
            "--arms", "openai:http://a,name=A,openai:http://b,name=B", "--out", str(tmp_path / "res"), *extra]


def _fake_sweep_arms(monkeypatch):
    from test_sweep import FakeAdapter, fake_builder

    from specbench.harness import engines

    fakes = {"A": FakeAdapter("A"), "B": FakeAdapter("B", spec=True)}
    monkeypatch.setattr(engines, "build_adapter", fake_builder(fakes))
    return fakes


def _plain(text: str) -> str:
    """A terminal capture without its escape sequences (colours, cursor moves)."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def _no_run_path(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("records: "))


def test_sweep_plain_lines_count_cells_and_requests(monkeypatch, tmp_path) -> None:
    _fake_sweep_arms(monkeypatch)
    _register()
    r = CliRunner().invoke(app, _sweep_args(tmp_path))
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stderr.splitlines() if ", cell " in x or x.startswith("done")]
    # per level: a warm-up cell per engine (A, B: warmup x C requests), then A B A#2 (2 prompts each):
    # c1 2 + 6, c2 4 + 6 = 18 requests in 10 cells
    assert [x.split(";")[0] for x in lines[:-1]] == [
        "c1 warm-up A, cell 1/10: 1 requests", "c1 warm-up B, cell 2/10: 1 requests",
        "c1 round 1/1 A, cell 3/10: 2 requests", "c1 round 1/1 B, cell 4/10: 2 requests",
        "c1 round 1/1 A#2, cell 5/10: 2 requests", "c2 warm-up A, cell 6/10: 2 requests",
        "c2 warm-up B, cell 7/10: 2 requests", "c2 round 1/1 A, cell 8/10: 2 requests",
        "c2 round 1/1 B, cell 9/10: 2 requests", "c2 round 1/1 A#2, cell 10/10: 2 requests"]
    assert "; 0/18 done" in lines[0] and "ETA" not in lines[0]
    assert "; 8/18 done" in lines[5] and ", ETA " in lines[5] and "; 16/18 done" in lines[9]
    assert lines[-1].startswith("done: 18/18 requests in ")
    q = CliRunner().invoke(app, _sweep_args(tmp_path, "--no-progress"))
    assert q.exit_code == 0 and q.stderr == ""
    assert _no_run_path(q.stdout) == _no_run_path(r.stdout)  # stdout is the same with or without the display


def test_sweep_terminal_bar_keeps_stdout_for_the_pipe(monkeypatch, tmp_path) -> None:
    _fake_sweep_arms(monkeypatch)
    monkeypatch.setattr(RunProgress, "force_terminal", True)
    _register()
    r = CliRunner().invoke(app, _sweep_args(tmp_path))
    assert r.exit_code == 0, r.output
    err = _plain(r.stderr)
    assert "18/18 requests" in err and "ETA" in err and "cell 10/10" in err, err
    assert "records: " in r.stdout and "18/18" not in r.stdout  # the bar never reaches stdout
    q = CliRunner().invoke(app, _sweep_args(tmp_path, "--no-progress"))
    assert _no_run_path(q.stdout) == _no_run_path(r.stdout)


def test_interrupted_sweep_says_where_it_stopped(monkeypatch, tmp_path) -> None:
    from test_sweep import FakeAdapter, fake_builder

    from specbench.harness import engines
    from specbench.harness.results import load_stored_run

    fakes = {"A": FakeAdapter("A", gap=0.002), "B": FakeAdapter("B", gap=0.002, interrupt_at=5)}
    monkeypatch.setattr(engines, "build_adapter", fake_builder(fakes))
    _register()
    r = CliRunner().invoke(app, ["sweep", "-c", "1", "--num-prompts", "4", "--max-tokens", "4", "--rounds", "3",
                                 "--warmup", "0", "--arms", "openai:http://a,name=A,openai:http://b,name=B",
                                 "--out", str(tmp_path / "res")])
    assert r.exit_code == 130, r.output
    assert "INCOMPLETE" in r.stdout
    stopped = [x for x in r.stderr.splitlines() if x.startswith("stopped at: ")]
    assert len(stopped) == 1 and "/36 requests in " in stopped[0]
    done = int(stopped[0].removeprefix("stopped at: ").split("/")[0])
    run = load_stored_run(next((tmp_path / "res").iterdir()))
    assert run.status == "incomplete" and 0 < done < 36
    assert len(run.records("requests")) == done  # every request the display counted is in the store


def test_tune_counts_the_requests_of_its_sweep(monkeypatch, tmp_path) -> None:
    from test_sweep import FakeAdapter, fake_builder

    from specbench.harness import engines

    monkeypatch.setattr(engines, "build_adapter", fake_builder({"plain": FakeAdapter("plain"),
                                                                "spec": FakeAdapter("spec", spec=True)}))
    _register()
    args = ["tune", "--arms", "plain=openai:http://a;spec=openai:http://b", "-c", "1,2", "--prompts-per-level", "1",
            "--rounds", "1", "--warmup", "0", "--max-tokens", "4", "--out", str(tmp_path / "res")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    # at least 8 prompts a cell; plain, spec and plain's noise copy at c1 and c2: 6 cells, 48 requests
    cells = [x for x in r.stderr.splitlines() if ", cell " in x]
    assert [x.split(":")[0] for x in cells] == [f"c{c} round 1/1 {a}, cell {i}/6" for i, (c, a) in enumerate(
        [(1, "plain"), (1, "spec"), (1, "plain#2"), (2, "plain"), (2, "spec"), (2, "plain#2")], 1)]
    assert "; 24/48 done" in cells[3] and ", ETA " in cells[3] and "done: 48/48 requests" in r.stderr
    monkeypatch.setattr(RunProgress, "force_terminal", True)
    t = CliRunner().invoke(app, args)
    assert t.exit_code == 0 and "48/48 requests" in _plain(t.stderr) and "ETA" in t.stderr
    q = CliRunner().invoke(app, [*args, "--no-progress"])
    assert q.exit_code == 0 and q.stderr == ""
    # the same document every time; its measured rows, crossover and choice differ run to run (fake timings)
    shape = [[ln for ln in x.stdout.splitlines() if not ln.startswith(("| 1 ", "| 2 ", "Crossover", "Recommendation"))]
             for x in (r, t, q)]
    assert shape[0] == shape[1] == shape[2] and "| c | plain tok/s | noise | spec | best |" in q.stdout


# ---- lossless: prompts compared in the gates that judge prompt by prompt ----

def _lossless(tiny_pair, *extra: str):
    target, draft = tiny_pair
    _register()
    return CliRunner().invoke(app, ["lossless", "--baseline", f"local:{target},spec=off", "--candidate",
                                    f"local:{target},draft={draft},spec=dflash", "--num-prompts", "2",
                                    "--max-tokens", "12", "--no-check-draft", "--quick", *extra])


def test_lossless_counts_prompts_compared(tiny_pair, tmp_path, monkeypatch) -> None:
    r = _lossless(tiny_pair, "--concurrent", "--no-record")
    assert r.exit_code == 0, r.output
    assert "greedy: 2 prompts; 0/4 done" in r.stderr and "concurrent: 2 prompts; 2/4 done" in r.stderr
    assert ", ETA " in r.stderr and "done: 4/4 prompts in " in r.stderr
    assert r.stdout.startswith("[lossless] greedy ...") and "prompts;" not in r.stdout
    monkeypatch.setattr(RunProgress, "force_terminal", True)
    t = _lossless(tiny_pair, "--concurrent", "--no-record")
    assert t.exit_code == 0 and "4/4 prompts" in _plain(t.stderr) and "ETA" in t.stderr
    # the gate lines printed while the bar is up stay on stdout (which is not the terminal here)
    def gate_lines(out: str) -> list[str]:
        return [x.split(":")[0] for x in out.splitlines() if x.startswith("[lossless]")]

    assert gate_lines(t.stdout) == gate_lines(r.stdout) == ["[lossless] greedy ...", "[lossless] greedy",
                                                            "[lossless] concurrent ...", "[lossless] concurrent"]
    assert len(t.stdout.splitlines()) == len(r.stdout.splitlines())
    j = _lossless(tiny_pair, "--json", "--no-record")
    assert j.exit_code == 0 and "prompts;" not in j.stderr and "━" not in j.stderr
    assert json.loads(j.stdout)["verdict"] == "PASS"  # stdout is the one JSON document
    # the run ends with its summary table (cli/summary.py) on stderr: a row per gate; none with --json or --quiet
    err = r.stderr.splitlines()
    tail = err[next(i for i, x in enumerate(err) if x.startswith("lossless: PASS (")):]
    assert [[c.strip() for c in x.split("│")[1:3]] for x in tail if x.startswith("│")] == [["greedy", "PASS"],
                                                                                         ["concurrent", "PASS"]]
    assert "lossless: PASS" not in j.stderr
    q = _lossless(tiny_pair, "--concurrent", "--no-record", "--quiet")
    assert q.exit_code == 0 and q.stderr == "" and gate_lines(q.stdout) == gate_lines(r.stdout)
    assert len(q.stdout.splitlines()) == len(r.stdout.splitlines())


def test_interrupted_lossless_keeps_the_prompts_it_judged(tiny_pair, tmp_path, monkeypatch) -> None:
    from specbench.suites.lossless import greedy

    real, calls = greedy.check_output, []

    async def check_then_interrupt(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second prompt is judged
        return await real(*a, **kw)

    monkeypatch.setattr(greedy, "check_output", check_then_interrupt)
    r = _lossless(tiny_pair, "--results", str(tmp_path / "res"))
    assert r.exit_code != 0 and "stopped at: 1/2 prompts in " in r.stderr
    (run_dir,) = [p for p in (tmp_path / "res").iterdir() if p.name != "references"]
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "incomplete"
    assert len((run_dir / "checks.jsonl").read_text().splitlines()) == 1  # the judged prompt is kept


# ---- eval: documents over both arms, counted inside the lm-eval worker ----

def _fake_eval(monkeypatch) -> None:
    """specbench eval without lm-eval or servers: tests/fake_lm_eval_worker.py runs as the worker (the real
    count_requests around a fake lm-eval API model), the endpoints are stand-ins."""
    import contextlib
    import os
    from pathlib import Path

    from specbench.suites.evalparity import runner
    from specbench.suites.evalparity.endpoint import Endpoint

    @contextlib.contextmanager
    def endpoint(spec, name, log_path, timeout):
        yield Endpoint(name, spec.raw or "fake", "http://127.0.0.1:9", "fake")

    monkeypatch.setattr(runner, "check_lm_eval", lambda: None)
    monkeypatch.setattr(runner, "WORKER", "fake_lm_eval_worker")
    monkeypatch.setattr(runner, "open_endpoint", endpoint)
    monkeypatch.setattr(runner, "spec_counters", lambda ep: None)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


def test_eval_counts_documents_over_both_arms(monkeypatch, tmp_path) -> None:
    _fake_eval(monkeypatch)
    _register()
    args = ["eval", "--limit", "3", "--num-fewshot", "0", "--results", str(tmp_path)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("baseline: starting its server: 0/0 done")
    assert lines[1].startswith("baseline: lm-eval: 3 documents; 0/6 done")  # the candidate's 3 planned too
    assert lines[2].startswith("candidate: starting its server: 3/6 done") and ", ETA " in lines[2]
    assert lines[3].startswith("candidate: lm-eval: 3 documents; 3/6 done")
    assert lines[4].startswith("done: 6/6 documents in ")
    assert lines[5].startswith("eval: PARITY (gsm8k)")  # then the summary table (cli/summary.py), stderr too
    assert r.stdout.startswith("## Task-level parity: gsm8k — **PARITY**") and "| gsm8k | strict-match |" in r.stdout
    monkeypatch.setattr(RunProgress, "force_terminal", True)
    t = CliRunner().invoke(app, args)
    assert t.exit_code == 0 and "6/6 documents" in _plain(t.stderr) and "ETA" in t.stderr
    def doc(out: str) -> list[str]:  # the markdown without its run id, wall times and results path
        return [re.sub(r"evalparity-[0-9a-f-]+|\d+\.\d+( s|x)", "X", x) for x in out.splitlines()[:-1]]

    assert doc(t.stdout) == doc(r.stdout)
    j = CliRunner().invoke(app, [*args, "--json"])
    assert j.exit_code == 0 and j.stderr == "" and json.loads(j.stdout)["verdict"] == "PARITY"
    q = CliRunner().invoke(app, [*args, "--quiet"])  # no display, no summary; the same markdown
    assert q.exit_code == 0 and q.stderr == "" and doc(q.stdout) == doc(r.stdout)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")
def test_eval_counts_lm_evals_own_requests(tiny_target, tiny_draft, tmp_path) -> None:
    """The real worker around the real lm-eval API model: both arms' documents, each counted as answered."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specbench", "eval", "--task", "gsm8k", "--limit", "4", "--num-fewshot",
                        "0", "--concurrency", "2", "--baseline", f"local:{tiny_target},spec=off",
                        "--candidate", f"local:{tiny_target},draft={tiny_draft},spec=dflash", "--results",
                        str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if " done" in x or x.startswith("done: ")]
    assert [x.split(",")[0] for x in lines[:4]] == [
        "baseline: starting its server: 0/0 done", "baseline: lm-eval: 4 documents; 0/8 done",
        "candidate: starting its server: 4/8 done", "candidate: lm-eval: 4 documents; 4/8 done"], r.stderr[-3000:]
    assert len(lines) == 5 and lines[4].startswith("done: 8/8 documents in ")
    assert "## Task-level parity: gsm8k" in r.stdout
    progress_files = sorted(p.name for p in tmp_path.glob("*/*-progress.json"))
    assert progress_files == ["baseline-progress.json", "candidate-progress.json"]
    for p in tmp_path.glob("*/*-progress.json"):
        assert json.loads(p.read_text()) == {"total": 4, "done": 4}


def test_interrupted_eval_keeps_the_finished_arm(monkeypatch, tmp_path) -> None:
    from specbench.suites.evalparity import runner

    _fake_eval(monkeypatch)
    real = runner.read_progress

    def read(path):
        if path.name.startswith("candidate"):
            raise KeyboardInterrupt  # Ctrl-C while the candidate's worker runs
        return real(path)

    monkeypatch.setattr(runner, "read_progress", read)
    _register()
    r = CliRunner().invoke(app, ["eval", "--limit", "3", "--num-fewshot", "0", "--results", str(tmp_path)])
    assert r.exit_code != 0 and "stopped at: 3/6 documents in " in r.stderr
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "incomplete"
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 and {s["arm"] for s in samples} == {"baseline"}  # the baseline's, kept


def test_eta_extrapolates_planned_work_not_units() -> None:
    with RunProgress(0, stream=io.StringIO(), terminal=False) as p:
        p.plan(65, work=2.0)  # one request at c1 (a whole wave), then 64 at c64 (one wave together)
        p.advance(work=1.0)
        p._t0 -= 10.0  # the c1 request took 10 s
        assert 9.5 < p.eta() < 10.5  # one wave left: ~10 s, where counting requests would say ~640 s
        for _ in range(64):
            p.advance(work=1 / 64)
        assert p.done == 65 and p.eta() == pytest.approx(0.0, abs=1e-6)
    with RunProgress(0, stream=io.StringIO(), terminal=False) as p:  # no work planned: units
        p.plan(4)
        p.advance()
        p._t0 -= 10.0
        assert 29.5 < p.eta() < 30.5


def test_sweep_plans_requests_and_waves() -> None:
    from specbench.suites.sweep import Arm, SweepConfig, SweepRunner, with_noise_copy

    cfg = SweepConfig(levels=(1, 8), num_prompts=8, rounds=1, warmup=1)
    r = SweepRunner(cfg, with_noise_copy([Arm("A", "a"), Arm("B", "b")]), {}, None, None)  # type: ignore[arg-type]
    # c1: 2 warm-up cells of 1 request + A B A#2 of 8 = 26 requests, 26 waves; c8: 2 x 8 + 3 x 8 = 40, 5 waves
    assert r.planned() == (10, 66, 31.0)
