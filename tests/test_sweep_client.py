"""The client's own load: every cell records the event loop's CPU share (headroom), a client that burns
CPU shows it, a saturated cell is warned about and marked in the report; benchmarks/client.py's logic."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness import engines
from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult
from specbench.suites.sweep import runner
from specbench.suites.sweep.runner import client_load


class BusyAdapter(EngineAdapter):
    """Streams 4 chunks; with `spin`, burns `spin` s of this thread's CPU per chunk on the event loop."""

    kind = "fake"

    def __init__(self, name: str, spin: float = 0.0) -> None:
        super().__init__(name)
        self.spin = spin

    async def generate_one(self, req: GenRequest) -> GenResult:
        res = GenResult(rid=self._rid(req), ok=True, t_send=time.perf_counter(), wall_send=time.time(),
                        meta=dict(req.meta), prompt_tokens=3)
        for _ in range(4):
            if self.spin:
                t = time.thread_time()
                while time.thread_time() - t < self.spin:
                    pass
            else:
                await asyncio.sleep(0.005)
            res.chunk_times.append(time.perf_counter())
            res.chunk_tokens.append(1)
        res.t_first, res.t_end, res.completion_tokens = res.chunk_times[0], res.chunk_times[-1], 4
        return res

    async def tokenize(self, text: str) -> list[int]:
        return [1, 2, 3]

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "version": "0", "model": "fake", "config": {}}


def test_client_load_arithmetic() -> None:
    assert client_load(0.5, 1.0, 100) == {"cpu_s": 0.5, "busy": 0.5, "headroom": 0.5, "cpu_us_per_chunk": 5000.0,
                                          "saturated": False, "procs": 1}
    two = client_load(0.1, 1.0, 100, [0.3, 0.95])  # client processes: the busiest loop decides, CPU is summed
    assert two["busy"] == 0.95 and two["saturated"] and two["procs"] == 2 and two["cpu_s"] == pytest.approx(1.35)
    assert client_load(0.95, 1.0, 0)["saturated"] and client_load(0.95, 1.0, 0)["cpu_us_per_chunk"] is None
    assert client_load(1.2, 1.0, 10)["headroom"] == 0.0


def _run(cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fakes: dict) -> tuple[int, str, Path]:
    monkeypatch.setattr(engines, "build_adapter", lambda spec, name=None: fakes[name])
    r = cli.invoke(app, ["sweep", "-c", "2", "--num-prompts", "4", "--max-tokens", "4", "--rounds", "1", "--warmup",
                         "0", "--no-progress", "--no-noise-floor", "--arms",
                         ",".join(f"openai:http://{k},name={k}" for k in fakes), "--out", str(tmp_path)])
    return r.exit_code, r.output, next(tmp_path.glob("sweep-*"))


def test_cells_record_the_clients_cpu_share(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _register()
    cli = CliRunner()
    code, out, run = _run(cli, monkeypatch, tmp_path, {"idle": BusyAdapter("idle"), "busy": BusyAdapter("busy", 0.01)})
    assert code == 0, out
    cells = {c["arm"]: c for c in map(json.loads, (run / "cells.jsonl").read_text().splitlines()) if c["round"] >= 0}
    idle, busy = cells["idle"]["client"], cells["busy"]["client"]
    assert 0.0 <= idle["busy"] < 0.5 and idle["headroom"] > 0.5
    # 10 ms of the loop's CPU per chunk (4 requests x 4 chunks) is the client's load; sleeping is not
    assert busy["cpu_s"] >= 16 * 0.010 * 0.99 and busy["cpu_us_per_chunk"] >= 10_000 * 0.99
    assert idle["cpu_s"] < busy["cpu_s"] / 2 and busy["busy"] > idle["busy"]
    vb = json.loads((run / "vllm-bench" / "busy-c2-r0.json").read_text())
    assert vb["specbench"]["client"]["busy"] == busy["busy"]


def test_a_saturated_client_is_warned_about_and_marked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _register()
    cli = CliRunner()
    monkeypatch.setattr(runner, "CLIENT_SATURATED", 0.0)  # every cell counts as saturated
    code, out, run = _run(cli, monkeypatch, tmp_path, {"a": BusyAdapter("a")})
    assert code == 0, out
    assert "warning: the client was saturated" in out and "a c2 r0" in out
    assert json.loads((run / "run.json").read_text())["summary"]["requests"]["client_saturated"] == ["a c2 r0"]
    md = cli.invoke(app, ["report", str(run), "-o", "-"]).output
    assert "**SATURATED**" in md and "client busy (max)" in md


def test_client_benchmark_logic(capsys: pytest.CaptureFixture[str]) -> None:
    from specbench.benchmarks.client import main

    doc = main(["--levels", "1,2", "--max-tokens", "8", "--tokens-per-chunk", "2", "--min-requests", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(doc, default=str))
    rows = {(r["client"], r["concurrency"]): r for r in doc["rows"]}
    assert set(rows) == {("adapter", 1), ("raw", 1), ("adapter", 2), ("raw", 2)}
    for r in rows.values():
        assert r["tokens"] == r["requests"] * 8 and r["chunks"] == r["requests"] * 4  # 2 tokens per chunk
        assert r["chunks_s"] > 0 and r["cpu_us_per_chunk"] > 0


@pytest.mark.parametrize("chat", [False, True])
def test_raw_http_client_matches_httpx(monkeypatch: pytest.MonkeyPatch, chat: bool) -> None:
    """sse_http.py against httpx on the same endpoint: the same tokens, chunks, usage and errors, streamed and
    not; keep-alive connections reused; a connection the server dropped while idle is replaced, not failed."""
    from specbench.harness.adapters.openai_api import OpenAIAdapter
    from specbench.harness.fake_endpoint import FakeEndpoint, Faults

    def reqs() -> list[GenRequest]:
        mk = (lambda t: GenRequest(messages=[{"role": "user", "content": t}], max_tokens=7)) if chat else \
            (lambda t: GenRequest(prompt=t, max_tokens=7))
        return [mk(f"prompt {i}") for i in range(6)] + [mk("BOOM 400?")]

    out = {}
    for http in ("1", "0"):
        monkeypatch.setenv("SPECBENCH_RAW_HTTP", http)
        with FakeEndpoint(tokens_per_chunk=3, faults=Faults(fail_marker="BOOM")) as ep:
            for stream in (True, False):
                ad = OpenAIAdapter(ep.url, model="fake-model", stream=stream, retries=0)
                assert ad.describe()["config"]["http"] == ("raw" if http == "1" else "httpx")
                res = ad.generate_sync(reqs(), concurrency=1)
                out[(http, stream)] = [(r.ok, r.completion_tokens, r.chunk_tokens, r.text, r.finish_reason,
                                        (r.error or "")[:60]) for r in res]
            conns = ep.state.connections
        if http == "1":
            assert conns <= 4, conns  # keep-alive: not one connection per request (14 requests, 2 adapters)
    assert out[("1", True)] == out[("0", True)] and out[("1", False)] == out[("0", False)]
    ok, failed = out[("1", True)][:-1], out[("1", True)][-1]
    assert all(o[0] and o[1] == 7 and o[2] == [3, 3, 1] for o in ok)
    assert not failed[0] and "HTTP 500: injected failure" in failed[5]
    monkeypatch.setenv("SPECBENCH_RAW_HTTP", "1")
    with FakeEndpoint(faults=Faults(drop_idle=True)) as ep:
        ad = OpenAIAdapter(ep.url, model="fake-model", retries=0)
        res = ad.generate_sync(reqs()[:4], concurrency=1)
        assert all(r.ok and r.attempts == 1 for r in res) and ep.state.connections == 4


def test_client_procs_shard_the_load(tmp_path: Path) -> None:
    """--client-procs 2: the requests of a cell go out from two client processes (spawned, each with its own
    adapter and the key), come back complete and in order, and the cell records both processes' CPU."""
    from specbench.harness.fake_endpoint import FakeEndpoint, Faults

    _register()
    cli = CliRunner()
    key = "sk-sharded-test-12345678"
    with FakeEndpoint(tokens_per_chunk=2, max_tokens=6, faults=Faults(api_key=key)) as ep:
        r = cli.invoke(app, ["sweep", "-c", "1,4", "--num-prompts", "6", "--max-tokens", "6", "--rounds", "1",
                             "--warmup", "0", "--no-progress", "--no-noise-floor", "--client-procs", "2",
                             "--api-key", key, "--arms", f"openai:{ep.url},name=fake", "--out", str(tmp_path)])
        conns = ep.state.connections
    assert r.exit_code == 0, r.output
    run = next(tmp_path.glob("sweep-*"))
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
    measured = [x for x in reqs if x["meta"]["round"] >= 0]
    assert len(measured) == 12 and all(x["ok"] and x["completion_tokens"] == 6 for x in measured)
    cells = {c["level"]: c for c in map(json.loads, (run / "cells.jsonl").read_text().splitlines())}
    assert cells[1]["client"]["procs"] == 1 and cells[4]["client"]["procs"] == 2  # c1 stays in process
    assert cells[4]["completed"] == 6 and conns >= 3
    assert json.loads((run / "run.json").read_text())["engines"]["fake"]["client_procs"] == 2
    r = cli.invoke(app, ["sweep", "--client-procs", "0", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--client-procs" in r.output
