"""The sweep's acceptance / metrics audit end to end (runner -> records -> audit), against endpoints that are
honest, late or lying (tests/audit_fakes.py): a healthy server PASSes every cell, also one that publishes its
counts several scrapes after answering; one whose counters never settle, or carry another client's request, is
CANNOT TEST for those cells, named, never FAIL; one request missing, tokens double-counted and acceptance
overstated each FAIL. The sharded client sends no probe of its own into a cell. Every outcome is set by counts
(requests, scrapes), never by time: the settle's pauses are zeroed here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from audit_fakes import SpecFake
from typer.testing import CliRunner

from specbench.harness import engines
from specbench.harness.fake_endpoint import FakeEndpoint
from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS
from specbench.suites import metrics_audit
from specbench.suites.sweep.runner import SweepConfig
from specbench.suites.sweep.session import run_sweep

CFG = SweepConfig(levels=(1, 4), num_prompts=4, max_tokens=8, rounds=2, warmup=1, noise_floor=False)
CELLS = 2 * (1 + 2)  # per arm: per level one warm-up cell and two rounds


@pytest.fixture(autouse=True)
def _no_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_audit, "SETTLE_FIRST_S", 0.0)
    monkeypatch.setattr(metrics_audit, "SETTLE_MAX_S", 0.0)


def _sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake: SpecFake, cfg: SweepConfig = CFG) -> dict:
    monkeypatch.setattr(engines, "build_adapter", lambda spec, name=None: fake)
    out = run_sweep(cfg, [f"openai:http://127.0.0.1:9/v1,name={fake.name}"], out_dir=tmp_path)
    assert out.complete and out.audit is not None
    return out.audit


def _arm(audit: dict) -> dict:
    assert len(audit["arms"]) == 1
    return audit["arms"][0]


@pytest.mark.parametrize("kw", [{}, {"per_step": False}, {"per_request": True}, {"lag": 3},
                                {"lag": 3, "per_step": False, "per_request": True}],
                         ids=["per-step", "vllm", "per-request", "late-3", "late-3-vllm-per-request"])
def test_a_healthy_server_passes_every_cell(monkeypatch, tmp_path, kw) -> None:
    a = _arm(_sweep(monkeypatch, tmp_path, SpecFake("ok", **kw)))
    assert a["verdict"] == PASS and not a["problems"] and not a["unattributed"], a
    assert a["cell_verdicts"] == {PASS: CELLS, FAIL: 0, CANNOT_TEST: 0}
    assert any(c.startswith(f"client-side metrics audit on {CELLS}/{CELLS}") for c in a["checks"]), a["checks"]


def test_a_server_that_publishes_later_than_the_settle_waits_is_cannot_test_never_fail(monkeypatch, tmp_path):
    """The same late server with a settle of one scrape: nothing settles, so nothing is judged (the old audit took
    the first scrape after a cell as final and FAILed it: 'output-token counter delta 224 != 256')."""
    monkeypatch.setattr(metrics_audit, "SETTLE_SCRAPES", 1)
    audit = _sweep(monkeypatch, tmp_path, SpecFake("late", lag=3))
    a = _arm(audit)
    assert a["verdict"] == CANNOT_TEST and audit["verdict"] == CANNOT_TEST and not a["problems"], a
    assert a["cell_verdicts"][FAIL] == 0 and a["cell_verdicts"][CANNOT_TEST] == CELLS
    assert all("still moving after 1 scrapes" in u for u in a["unattributed"])


def test_counters_that_never_settle_are_cannot_test_and_named(monkeypatch, tmp_path) -> None:
    audit = _sweep(monkeypatch, tmp_path, SpecFake("busy", moving=True))
    a = _arm(audit)
    assert a["verdict"] == CANNOT_TEST and not a["problems"] and a["cell_verdicts"][FAIL] == 0, a
    assert a["cell_verdicts"][CANNOT_TEST] == CELLS
    assert "busy level 1 warm-up: the server's counters were still moving after 12 scrapes" in a["unattributed"][0]
    assert "could not be attributed" in a["missing"] and audit["missing"]


def test_another_clients_request_in_a_cell_makes_that_cell_cannot_test(monkeypatch, tmp_path) -> None:
    # served requests: 1 the sweep's probe, 2 the c1 warm-up, 3..6 c1 round 0, 7..10 c1 round 1
    a = _arm(_sweep(monkeypatch, tmp_path, SpecFake("shared", foreign_at=8)))
    assert a["verdict"] == CANNOT_TEST and not a["problems"], a
    assert a["cell_verdicts"] == {PASS: CELLS - 1, FAIL: 0, CANNOT_TEST: 1}
    assert len(a["unattributed"]) == 1 and a["unattributed"][0].startswith("shared level 1 round 1: 1 more finished "
                                                                           "requests than the client sent")


@pytest.mark.parametrize("lie, per_step, lag, needle", [
    ("drop_request", True, 0, "request counter delta 3 != 4 requests"),
    ("drop_request", False, 0, "output-token counter delta 24 != 32"),
    ("drop_request", True, 3, "request counter delta 3 != 4 requests"),  # late and lying: still a FAIL
    ("double_tokens", True, 0, "output-token counter delta 64 != 32"),
    ("double_tokens", False, 3, "output-token counter delta"),
    ("overstate", True, 0, "the counters overstate acceptance"),
    ("overstate", False, 0, "the counters count tokens the client never received"),
])
def test_a_lying_server_fails(monkeypatch, tmp_path, lie, per_step, lag, needle) -> None:
    audit = _sweep(monkeypatch, tmp_path, SpecFake("liar", lie=lie, per_step=per_step, step=2, lag=lag))
    a = _arm(audit)
    assert a["verdict"] == FAIL and audit["verdict"] == FAIL, a
    assert any(needle in p for p in a["problems"]), a["problems"]
    if lie == "drop_request":  # the third request served is the first of c1 round 0: that cell alone
        assert a["cell_verdicts"] == {PASS: CELLS - 1, FAIL: 1, CANNOT_TEST: 0}
        assert all(p.startswith("liar level 1 round 0: ") for p in a["problems"])
    else:
        assert a["cell_verdicts"][FAIL] == CELLS


def test_the_audit_gate_exit_codes(monkeypatch, tmp_path) -> None:
    """--audit: 0 on a late but honest server, 3 when the counters never settle, 1 on a missing request."""
    from specbench.cli.app import _register, app

    _register()
    cli = CliRunner()
    for fake, code in ((SpecFake("a", lag=2), 0), (SpecFake("a", moving=True), 3), (SpecFake("a", lie="drop_request"), 1)):
        monkeypatch.setattr(engines, "build_adapter", lambda spec, name=None, f=fake: f)
        r = cli.invoke(app, ["sweep", "--arms", "openai:http://127.0.0.1:9/v1,name=a", "--concurrency", "1,4",
                             "--num-prompts", "4", "--max-tokens", "8", "--rounds", "1", "--no-noise-floor",
                             "--audit", "--out", str(tmp_path), "--quiet"])
        assert r.exit_code == code, (fake.__dict__, r.output)


def test_client_processes_send_no_probe_of_their_own(monkeypatch) -> None:
    """A sharded arm's workers take the parent's capability record: the endpoint sees the parent's one probe and the
    cell's requests, nothing else (each worker's own probe landed in the first cell's server counters: 4 requests
    and 8 output tokens too many at c128 with two workers, on every server)."""
    from specbench.harness.adapters import GenRequest
    from specbench.harness.adapters.openai_api import OpenAIAdapter
    from specbench.harness.adapters.sharded import ShardedAdapter

    with FakeEndpoint(max_tokens=4) as ep:
        inner = OpenAIAdapter(ep.url, model="fake-model", probe=True)
        sh = ShardedAdapter(inner, f"openai:{ep.url},model=fake-model", 2)

        def posts() -> int:
            return sum(1 for s in ep.seen if s["method"] == "POST" and s["path"] == "/v1/completions")

        try:
            inner.probe()
            probed = posts()
            assert probed >= 1
            reqs = [GenRequest(prompt=f"p {i}", max_tokens=4) for i in range(4)]
            res = asyncio.run(sh.generate(reqs, concurrency=4))
            assert len(res) == 4 and all(r.ok for r in res) and len(sh.client_cpu_by_proc) == 2
            assert posts() == probed + 4, [s["path"] for s in ep.seen]
        finally:
            sh.close()
