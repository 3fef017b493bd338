"""`specbench demo` (issue 24 item 5): each exhibit says what it shows in one sentence, times its steady state with
start-up apart, and ends with where its full report is. The engine and the subprocesses are stand-ins here (the
real demo is `make demo`); the timing split is computed from real run records."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from specbench.cli import demo
from specbench.cli.app import _register, app


class _Clock:
    """The demo's perf_counter: moved only by the stand-in engine, so the figures do not depend on the machine."""

    t = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.t


class SlowStartLLM:
    """A first call that costs FIRST s (lazy initialisation), then STEADY s per call: what the demo must not mix."""

    FIRST, STEADY = 0.4, 0.02

    def __init__(self, target, draft=None, spec="off") -> None:
        self.spec, self.calls = spec, 0

    def generate(self, prompts, sp):
        self.calls += 1
        _Clock.t += self.FIRST if self.calls == 1 else self.STEADY
        return [SimpleNamespace(output_ids=list(range(64)), text=" 72 clips",
                                spec={"mean_accept_len": 1.0 if self.spec == "off" else 3.0})]


@pytest.fixture(autouse=True)
def _threads(monkeypatch):
    """The demo sets torch's thread count: give the rest of the session its own back."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_generate_exhibit_times_steady_state_apart_from_start_up(monkeypatch) -> None:
    import specbench.engine

    monkeypatch.setattr(specbench.engine, "LLM", SlowStartLLM)
    monkeypatch.setattr(demo, "time", _Clock)  # the calls take FIRST / STEADY s by this clock
    _register()
    r = CliRunner().invoke(app, ["demo", "--quick", "--threads", "2"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "torch CPU threads: 2 (--threads; OMP_NUM_THREADS=2 in the subprocesses)"
    assert lines[2] == f"[1/3] generate: {demo.SAYS['generate']}" and lines[2].count(".") == 1  # one sentence
    for label in ("spec off", "spec on (DFlash)"):
        start = next(x for x in lines if x.startswith(f"[{label}] start-up "))
        first = float(start.split("first call ")[1].split(" s")[0])
        assert first >= SlowStartLLM.FIRST  # the first call is start-up ...
        steady = next(x for x in lines if x.startswith(f"[{label}] steady state: "))
        dt = float(steady.split("64 tokens in ")[1].split(" s")[0])
        assert SlowStartLLM.STEADY <= dt < SlowStartLLM.FIRST / 2, steady  # ... and none of it is in the figure
        assert f"(median of {demo.STEADY_RUNS} calls)" in steady
    assert any(x.startswith("spec on vs off: ") and "the same text" in x for x in lines)
    assert lines[-1].startswith("full report: none for --quick")


def _sweep_run(monkeypatch, tmp_path):
    from test_sweep import FakeAdapter, fake_builder

    from specbench.harness import engines
    from specbench.suites.sweep import SweepConfig
    from specbench.suites.sweep.session import run_sweep

    fakes = {"A": FakeAdapter("A"), "B": FakeAdapter("B", spec=True)}
    monkeypatch.setattr(engines, "build_adapter", fake_builder(fakes))
    cfg = SweepConfig(levels=(1, 2), num_prompts=2, max_tokens=4, rounds=1, warmup=1)
    out = run_sweep(cfg, ["openai:http://a,name=A", "openai:http://b,name=B"], out_dir=tmp_path, progress=False)
    return out.run_dir


def test_sweep_timing_splits_the_wall_time_from_the_records(monkeypatch, tmp_path) -> None:
    from specbench.harness.results import load_stored_run

    run_dir = _sweep_run(monkeypatch, tmp_path)
    cells = load_stored_run(run_dir).records("cells")
    warm = sum(c["duration"] for c in cells if c["warmup"])
    measured = sum(c["duration"] for c in cells if not c["warmup"])
    lines = demo.sweep_timing(run_dir, wall=measured + warm + 5.0)
    assert lines[0] == (f"wall {measured + warm + 5.0:.1f} s = start-up 5.0 s (the process, the engines) + warm-up "
                        f"{warm:.1f} s (excluded) + measured cells {measured:.1f} s")
    assert [x.split(":")[0] for x in lines[1:]] == ["steady state c1", "steady state c2"]
    assert "A " in lines[1] and " tok/s (" in lines[1] and "of A)" in lines[1]  # B's paired ratio to A
    assert demo.sweep_timing(None, 3.0) == ["wall 3.0 s (no run record to split it)"]


def test_lossless_timing_uses_the_recorded_gate_time(tmp_path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"summary": {"wall_s": 4.0}}))
    assert demo.lossless_timing(tmp_path, 10.0) == ("wall 10.0 s = start-up 6.0 s (the process, both engines) + "
                                                    "gates 4.0 s")
    assert demo.lossless_timing(None, 2.0) == "wall 2.0 s (no run record to split it)"


def test_full_demo_says_each_exhibit_and_ends_with_the_reports(monkeypatch, tmp_path) -> None:
    import torch

    import specbench.engine

    monkeypatch.setattr(specbench.engine, "LLM", SlowStartLLM)
    monkeypatch.setenv("SPECBENCH_RESULTS", str(tmp_path / "store"))
    sweep_dir = _sweep_run(monkeypatch, tmp_path / "store")
    gate_dir = tmp_path / "store" / "lossless-x"
    gate_dir.mkdir()
    (gate_dir / "run.json").write_text(json.dumps({"summary": {"wall_s": 1.5}}))
    calls, envs = [], []

    def fake_run(args, store, env=None):
        calls.append(args)
        envs.append(env)
        return (0, 4.0, gate_dir) if args[0] == "lossless" else (0, 9.0, sweep_dir)

    monkeypatch.setattr(demo, "_run", fake_run)
    _register()
    r = CliRunner().invoke(app, ["demo"])  # the default: one thread here and in the subprocesses
    assert r.exit_code == 0, r.output
    assert torch.get_num_threads() == 1 and [e["OMP_NUM_THREADS"] for e in envs] == ["1", "1"]
    out = r.stdout.splitlines()
    rep = tmp_path / "store" / "reports"
    assert [a[a.index("--report") + 1] for a in calls] == [str(rep / "demo-lossless.md"), str(rep / "demo-sweep.md")]
    for i, name in ((2, "lossless"), (3, "sweep")):
        assert f"[{i}/3] {name}: {demo.SAYS[name]}" in out
        assert f"[{name}] full report: {rep / f'demo-{name}.md'}" in out
    assert any(x.startswith("[lossless] exit 0; wall 4.0 s = start-up 2.5 s") for x in out)
    assert any(x.startswith("[sweep] wall 9.0 s = start-up ") for x in out)
    assert out[-3:] == ["full reports:",
                        f"  lossless: {rep / 'demo-lossless.md'} (exit 0); records {gate_dir} (specbench report {gate_dir})",
                        f"  sweep: {rep / 'demo-sweep.md'} (exit 0); records {sweep_dir} (specbench report {sweep_dir})"]
