"""The sweep runner and command: interleaving, warm-up, open-loop arrivals, bad input, interrupts, and the
same sweep through `local` and through `openai` to `specbench serve` agreeing."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness import engines
from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult
from specbench.suites.sweep import (
    Arm,
    SweepConfig,
    SweepRunner,
    Workload,
    arm_labels,
    arrival_offsets,
    run_sweep,
    schedule,
    split_arms,
    with_noise_copy,
)


class FakeAdapter(EngineAdapter):
    """Streams `tokens` tokens in chunks of `chunk` every `gap` seconds; optional per-request spec counts."""

    kind = "fake"

    def __init__(self, name: str, tokens: int = 6, chunk: int = 2, gap: float = 0.001, spec: bool = False,
                 interrupt_at: int | None = None, down: bool = False) -> None:
        super().__init__(name)
        self.tokens, self.chunk, self.gap, self.spec, self.down = tokens, chunk, gap, spec, down
        self.interrupt_at, self.calls, self.sent = interrupt_at, 0, []

    async def generate_one(self, req: GenRequest) -> GenResult:
        self.calls += 1
        if self.down:
            return GenResult(rid=self._rid(req), ok=False, error="ConnectError: refused", meta=dict(req.meta))
        if self.interrupt_at is not None and self.calls == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered to asyncio.run's handler
        res = GenResult(rid=self._rid(req), ok=True, t_send=time.perf_counter(), wall_send=time.time(),
                        meta=dict(req.meta), prompt_tokens=len(req.prompt or []))
        self.sent.append((res.t_send, req.meta.get("round"), req.meta.get("warmup")))
        left = req.max_tokens if req.ignore_eos else min(req.max_tokens, self.tokens)
        while left > 0:
            await asyncio.sleep(self.gap)
            n = min(self.chunk, left)
            res.chunk_times.append(time.perf_counter())
            res.chunk_tokens.append(n)
            left -= n
        res.t_first, res.t_end = res.chunk_times[0], res.chunk_times[-1]
        res.completion_tokens = sum(res.chunk_tokens)
        if self.spec:
            steps = len(res.chunk_tokens)
            res.spec = {"num_drafts": steps, "num_draft_tokens": 3 * steps,
                        "num_accepted_tokens": res.completion_tokens - steps, "accepted_per_pos": [steps, 0, 0]}
        return res

    async def tokenize(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "version": "0", "model": "fake", "config": {}}


class ListSink:
    def __init__(self) -> None:
        self.requests: list[tuple[str, int, GenResult]] = []
        self.cells: list[dict] = []

    def request(self, res: GenResult, arm: str, idx: int, round: int) -> None:
        self.requests.append((arm, round, res))

    def cell(self, record: dict) -> None:
        self.cells.append(record)


def test_schedule_interleaves_rounds_across_arms() -> None:
    assert schedule(["A", "B", "A#2"], 2) == [(0, "A"), (0, "B"), (0, "A#2"), (1, "A"), (1, "B"), (1, "A#2")]
    arms = with_noise_copy([Arm("off", "local"), Arm("on", "local,spec=dflash")])
    assert [(a.label, a.copy_of) for a in arms] == [("off", None), ("on", None), ("off#2", "off")]
    assert with_noise_copy(arms[:2], "on")[-1].copy_of == "on"
    with pytest.raises(ValueError, match="baseline arm 'x'"):
        with_noise_copy(arms, "x")


def test_runner_order_warmup_and_records() -> None:
    cfg = SweepConfig(levels=(1, 2), num_prompts=3, max_tokens=4, rounds=2, warmup=1, dataset="gsm8k")
    arms = with_noise_copy([Arm("A", "a"), Arm("B", "b")])
    a, b = FakeAdapter("A"), FakeAdapter("B", spec=True)
    wl = Workload.build("gsm8k", 4)
    asyncio.run(wl.tokenize("A", a))
    asyncio.run(wl.tokenize("B", b))
    wl.share("A", "A#2")
    sink = ListSink()
    asyncio.run(SweepRunner(cfg, arms, {"A": a, "B": b}, wl, sink, progress=False).run())
    order = [(c["level"], c["round"], c["arm"]) for c in sink.cells]
    expect = []
    for lv in (1, 2):
        expect += [(lv, -1, "A"), (lv, -1, "B")]  # warm-up: once per engine, not for the copy
        expect += [(lv, r, arm) for r, arm in schedule(["A", "B", "A#2"], 2)]
    assert order == expect
    assert all(c["warmup"] == (c["round"] == -1) for c in sink.cells)
    # every cell's requests were recorded as they finished, tagged with level/round/warm-up
    warm = [(c["level"], c["arm"], c["requests"]) for c in sink.cells if c["warmup"]]
    assert warm == [(1, "A", 1), (1, "B", 1), (2, "A", 2), (2, "B", 2)]  # one wave: C requests at level C
    assert len(sink.requests) == (2 * 1 + 2 * 3 * 3) + (2 * 2 + 2 * 3 * 3)
    for arm, rnd, res in sink.requests:
        assert res.meta["arm"] == arm and res.meta["round"] == rnd and res.meta["warmup"] == (rnd == -1)
    # the copy ran on A's adapter; the same prompts in every cell
    assert a.calls == (1 + 2 + 2 * 2 * 2 * 3) and b.calls == (1 + 2 + 2 * 2 * 3)
    prompts = {(arm, rnd): sorted(r.meta["prompt_idx"] for x, y, r in sink.requests if (x, y) == (arm, rnd))
               for arm, rnd, _ in sink.requests if rnd >= 0}
    assert len({tuple(v) for v in prompts.values()}) == 1
    assert sink.cells[-1]["counters"] is None  # the fake has no counters: acceptance comes per request


def test_arrival_offsets() -> None:
    off = arrival_offsets(4000, 10.0, "poisson", seed=1)
    gaps = np.diff(off)
    assert off[0] == 0.0 and np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.1, rel=0.08)  # exponential: sd = mean
    bursty = np.diff(arrival_offsets(4000, 10.0, "gamma", burstiness=0.25, seed=1))
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.1) and np.std(bursty) > 1.5 * np.std(gaps)
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    assert arrival_offsets(5, 2.0, seed=3) == arrival_offsets(5, 2.0, seed=3)


def test_open_loop_sends_on_schedule() -> None:
    cfg = SweepConfig(levels=(50.0,), mode="open", num_prompts=6, max_tokens=2, rounds=1, warmup=0,
                      noise_floor=False)
    ad = FakeAdapter("A")
    wl = Workload.build("gsm8k", 6)
    sink = ListSink()
    asyncio.run(SweepRunner(cfg, [Arm("A", "a")], {"A": ad}, wl, sink, progress=False).run())
    offsets = arrival_offsets(6, 50.0, seed=0)
    start = sink.cells[0]["wall_start"]  # taken just before the cell's first offset starts counting
    rel = sorted(r.wall_send - start for _, _, r in sink.requests)
    assert all(x >= o - 1e-3 for x, o in zip(rel, offsets, strict=True))  # never early; late is the machine
    assert sink.cells[0]["level_kind"] == "rate"


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="concurrency 0 is invalid"):
        SweepConfig(levels=(0,))
    with pytest.raises(ValueError, match="rounds=0"):
        SweepConfig(rounds=0)
    with pytest.raises(ValueError, match="arrival='x'"):
        SweepConfig(arrival="x")
    assert SweepConfig(levels=(16,), prompts_per_level=4).prompts_at(16) == 64
    assert SweepConfig(levels=(1,), prompts_per_level=4).prompts_at(1) == 8  # floor
    assert SweepConfig(num_prompts=5).prompts_at(64) == 5


def test_split_arms_and_labels() -> None:
    s = "local:/m,draft=/d,spec=dflash,openai:http://h:8000/v1,model=x,local,spec=off;hf:/m"
    assert split_arms(s) == ["local:/m,draft=/d,spec=dflash", "openai:http://h:8000/v1,model=x", "local,spec=off",
                             "hf:/m"]
    specs = [engines.parse_engine(x) for x in ("local,spec=off", "local,spec=ngram", "openai:http://h,name=vllm",
                                               "openai:http://h2")]
    assert arm_labels(specs) == ["spec-off", "spec-ngram", "vllm", "openai-4"]
    assert arm_labels(specs[:2], ["a", "a"]) == ["a", "a-2"]
    with pytest.raises(ValueError, match="--labels has 1 labels for 2 arms"):
        arm_labels(specs[:2], ["a"])


@pytest.fixture
def cli() -> CliRunner:
    _register()
    return CliRunner()


@pytest.mark.parametrize("args, option", [
    (["--concurrency", "0,x"], "--concurrency"),
    (["--concurrency", "1,1"], "--concurrency"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--dataset", "nope"], "--dataset"),
    (["--rounds", "0"], "--rounds"),
    (["--num-prompts", "4", "--prompts-per-level", "2"], "--num-prompts"),
    (["--arrival", "uniform"], "--arrival"),
    (["--arms", "bogus:x"], "--arms"),
    (["--arms", "local:/no/such/dir"], "--arms"),
])
def test_cli_bad_input_exits_2_naming_the_option(cli: CliRunner, args: list[str], option: str, tmp_path: Path) -> None:
    r = cli.invoke(app, ["sweep", *args, "--out", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert option in r.output
    assert not list(tmp_path.iterdir())  # nothing started


def fake_builder(adapters: dict[str, FakeAdapter]):
    def build(spec, name=None):
        return adapters[name]
    return build


def test_interrupted_sweep_keeps_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from specbench.harness.results import load_stored_run

    fakes = {"A": FakeAdapter("A", gap=0.002), "B": FakeAdapter("B", gap=0.002, interrupt_at=12)}
    monkeypatch.setattr(engines, "build_adapter", fake_builder(fakes))
    cfg = SweepConfig(levels=(1, 2), num_prompts=4, max_tokens=4, rounds=3, warmup=0)
    out = run_sweep(cfg, ["openai:http://a,name=A", "openai:http://b,name=B"], out_dir=tmp_path, progress=False)
    assert out.complete is False and out.run_dir is not None
    run = load_stored_run(out.run_dir)
    assert run.status == "incomplete" and "interrupted" in (run.meta.get("error") or "")
    reqs, cells = run.records("requests"), run.records("cells")
    assert len(reqs) >= 11 and len(cells) >= 2  # everything finished before Ctrl-C is on disk
    assert fakes["A"].calls < 2 * 3 * 4 * 2  # and the sweep stopped
    from specbench.suites.report import load_run_summary

    s = load_run_summary(out.run_dir)
    assert not s.complete and s.get("A", 1.0) is not None


def test_local_and_openai_sweeps_agree(tiny_pair, tmp_path: Path) -> None:
    """One sweep, two arms: the reference engine in process, and the same engine behind `specbench serve`
    reached through the openai adapter. Same prompts (as token ids), greedy: same tokens, same acceptance."""
    from specbench.engine import EngineConfig, LLMEngine, SpecConfig
    from specbench.harness.server import ServerThread, make_app
    from specbench.suites.report import load_run_summary

    target, draft = tiny_pair
    eng = LLMEngine(EngineConfig(model=target, draft=draft, spec=SpecConfig(method="dflash"), num_pages=256))
    app, loop = make_app(eng, served_name="tiny")
    cfg = SweepConfig(levels=(1, 3), num_prompts=4, max_tokens=24, rounds=1, warmup=0, noise_floor=False)
    try:
        with ServerThread(app) as srv:
            out = run_sweep(cfg, [f"local:{target},draft={draft},num_pages=256", f"openai:{srv.url},model=tiny"],
                            labels=["local", "openai"], out_dir=tmp_path, progress=False)
    finally:
        loop.close()
    assert out.complete
    s = load_run_summary(out.run_dir)
    reqs = [r for r in out.records if r["kind"] == "request"]
    assert reqs and all(r["ok"] for r in reqs)
    by = {(r["arm"], r["meta"]["level"], r["item_id"]): r for r in reqs}
    for (arm, lv, item), r in by.items():
        if arm == "local":
            o = by[("openai", lv, item)]
            assert o["completion_tokens"] == r["completion_tokens"] and o["output_ids"] == r["output_ids"]
            assert o["prompt_tokens"] == r["prompt_tokens"]
            assert sum(o["chunk_tokens"]) == o["completion_tokens"]  # exact per-chunk counts over SSE
    for lv in (1.0, 3.0):
        a, b = s.get("local", lv), s.get("openai", lv)
        assert a.stats["output_tokens"] == b.stats["output_tokens"] > 0
        assert a.acceptance is not None and b.acceptance is not None and a.acceptance["num_drafts"] > 0
        assert b.acceptance["source"] == "request"
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"):
            assert a.acceptance[k] == b.acceptance[k], k


def test_cli_open_loop_sweep_and_report(cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fakes = {"A": FakeAdapter("A"), "B": FakeAdapter("B", spec=True)}
    monkeypatch.setattr(engines, "build_adapter", fake_builder(fakes))
    r = cli.invoke(app, ["sweep", "--request-rate", "500,inf", "--concurrency", "2", "--num-prompts", "3",
                         "--max-tokens", "4", "--rounds", "2", "--warmup", "0", "--no-progress",
                         "--arms", "openai:http://a,name=A,openai:http://b,name=B", "--out", str(tmp_path / "res"),
                         "--report", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    assert "(complete)" in r.output and "| rate | A tok/s | B tok/s | B vs A |" in r.output
    md = (tmp_path / "r.md").read_text()
    assert "open loop (poisson arrivals" in md and "| 500 req/s |" in md and "| inf |" in md
    assert "| 500 req/s | 33.3% | 2.000 | 2.000 | per-request |" in md  # fake: 2 tokens per step, K=3


def test_cli_refuses_an_engine_that_cannot_serve(cli: CliRunner, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    fakes = {"A": FakeAdapter("A"), "B": FakeAdapter("B", down=True)}
    monkeypatch.setattr(engines, "build_adapter", fake_builder(fakes))
    r = cli.invoke(app, ["sweep", "-c", "1", "--num-prompts", "2", "--rounds", "1", "--no-progress",
                         "--arms", "openai:http://a,name=A,openai:http://b,name=B", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "arm 'B'" in r.output and "probe" in r.output and "ConnectError" in r.output
    assert not list(tmp_path.iterdir())  # refused before a run was opened


def test_output_length_spread_is_per_position_and_the_same_for_every_arm() -> None:
    """--max-tokens-spread S: each request's max_tokens uniform in [M (1 - S), M (1 + S)], one seeded draw per
    prompt position, so every arm and round gets the same lengths (with S = 0 and ignore_eos the requests of a
    wave finish in lockstep, and their successors' prefills share a step: a batch no traffic has)."""
    from specbench.suites.sweep.workload import output_len_range

    assert output_len_range(128, 0.5) == (64, 192) and output_len_range(128, 0.0) == (128, 128)
    assert output_len_range(1, 0.9) == (1, 2)
    cfg = SweepConfig(levels=(4,), num_prompts=32, max_tokens=8, max_tokens_spread=0.5, rounds=2, warmup=0,
                      ignore_eos=True, dataset="gsm8k")
    assert cfg.max_tokens_hi == 12
    arms = [Arm("A", "a"), Arm("B", "b")]
    a, b = FakeAdapter("A"), FakeAdapter("B")
    wl = Workload.build("gsm8k", 40)
    asyncio.run(wl.tokenize("A", a))
    asyncio.run(wl.tokenize("B", b))
    sink = ListSink()
    asyncio.run(SweepRunner(cfg, arms, {"A": a, "B": b}, wl, sink, progress=False).run())
    lens: dict[tuple[str, int], list[int]] = {}
    for arm, rnd, res in sink.requests:
        lens.setdefault((arm, rnd), []).append((int(res.rid.rsplit("/", 1)[1]), res.completion_tokens))
    per = {k: [n for _, n in sorted(v)] for k, v in lens.items()}
    first = per[("A", 0)]
    assert all(v == first for v in per.values()), per  # same position, same length: every arm, every round
    assert all(4 <= n <= 12 for n in first) and len(set(first)) >= 5, first  # spread over the range
    with pytest.raises(ValueError, match="max_tokens_spread=1.0 is invalid"):
        SweepConfig(max_tokens_spread=1.0)
    fixed = SweepConfig(levels=(4,), num_prompts=8, max_tokens=8, rounds=1, warmup=0, ignore_eos=True)
    assert fixed.max_tokens_hi == 8 and wl.requests("A", list(range(8)), 8, True)[0].max_tokens == 8


def test_tune_and_sweep_refuse_a_bad_spread() -> None:
    _register()
    r = CliRunner().invoke(app, ["sweep", "--arms", "local", "--max-tokens-spread", "1.5"])
    assert r.exit_code == 2 and "--max-tokens-spread" in r.output and "[0, 1)" in r.output, r.output
    r = CliRunner().invoke(app, ["tune", "--max-tokens-spread", "-0.1"])
    assert r.exit_code == 2 and "--max-tokens-spread" in r.output, r.output
