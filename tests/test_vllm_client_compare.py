"""specbench's client against `vllm bench serve` (issue 28 item 3, scripts/vllm_suite.py --part client): the
per-round figures read from both clients' vLLM-format files, the paired ratios, each client's own noise
floor, the verdicts, the acceptance check counters vs stream, and the markdown. No GPU, no vLLM: vLLM's
side is the committed sample of its schema and hand-made files of the same fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness.fake_endpoint import FakeEndpoint
from specbench.suites.sweep.client_compare import (
    compare_clients,
    compare_metric,
    render_markdown,
    round_metrics,
    spread,
    stream_check,
)

SAMPLE = Path(__file__).parent / "data" / "vllm_bench" / "openai-infqps-concurrency2-Qwen3-8B-20261130-141502.json"


def vfile(tok_s: float, ttft: float = 20.0, tpot: float = 4.0, itl: float = 4.0, *, level: int = 1,
          outs: tuple[int, ...] = (128, 128), gaps: int = 127, spec: tuple[int, int, int] | None = None) -> dict:
    """A `vllm bench serve --save-result --save-detailed` dict with the fields the comparison reads."""
    d = {"date": "20261201-000000", "backend": "vllm", "label": "vllm-bench", "model_id": "q3", "num_prompts": len(outs),
         "request_rate": "inf", "burstiness": 1.0, "max_concurrency": level, "duration": sum(outs) / tok_s,
         "completed": len(outs), "failed": 0, "total_input_tokens": 128 * len(outs), "total_output_tokens": sum(outs),
         "request_throughput": len(outs) / (sum(outs) / tok_s), "output_throughput": tok_s,
         "total_token_throughput": 2 * tok_s, "output_lens": list(outs), "ttfts": [ttft / 1e3] * len(outs),
         "itls": [[itl / 1e3] * gaps for _ in outs], "latencies": [1.0] * len(outs), "errors": [""] * len(outs)}
    for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", 500.0)):
        d.update({f"mean_{m}_ms": v, f"median_{m}_ms": v, f"p90_{m}_ms": v, f"p99_{m}_ms": v})
    if spec:
        drafts, draft_tokens, accepted = spec
        d.update(spec_decode_num_drafts=drafts, spec_decode_draft_tokens=draft_tokens,
                 spec_decode_accepted_tokens=accepted, spec_decode_acceptance_rate=100 * accepted / draft_tokens,
                 spec_decode_acceptance_length=1 + accepted / drafts)
    return d


def test_round_metrics_reads_vllms_own_file() -> None:
    """vLLM's exact schema (the committed sample): its aggregates as they are, acceptance as a fraction, and
    the stream's tokens per chunk gap from the per-request lists (6 requests, 673 tokens, 257 gaps)."""
    obj = json.loads(SAMPLE.read_text())
    m = round_metrics(obj)
    assert m["output_tok_s"] == pytest.approx(obj["output_throughput"])
    assert m["ttft_ms"] == pytest.approx(obj["median_ttft_ms"])
    assert m["tpot_ms"] == pytest.approx(obj["median_tpot_ms"])
    assert m["itl_ms"] == pytest.approx(obj["median_itl_ms"])  # per chunk: vLLM's own
    assert m["itl_per_token_ms"] is None  # vLLM records no tokens per chunk
    assert m["acceptance_length"] == pytest.approx(obj["spec_decode_acceptance_length"])
    assert m["acceptance_rate"] == pytest.approx(obj["spec_decode_acceptance_rate"] / 100)
    toks = sum(n - 1 for n in obj["output_lens"])
    gaps = sum(len(g) for g in obj["itls"])
    assert (m["stream_requests"], m["stream_gaps"]) == (6, gaps)
    assert m["stream_al"] == pytest.approx(toks / gaps)
    no_lists = {k: v for k, v in obj.items() if k not in ("itls", "output_lens", "ttfts", "latencies")}
    assert round_metrics(no_lists)["stream_al"] is None  # without --save-detailed the stream is unknown


def test_spread_is_the_relative_range() -> None:
    s = spread([100.0, 104.0, None, 98.0])
    assert (s["median"], s["min"], s["max"], s["rounds"]) == (100.0, 98.0, 104.0, 3)
    assert s["noise"] == pytest.approx(0.06)
    assert spread([5.0])["noise"] is None  # one round: no noise floor
    assert spread([None, None]) is None


def test_verdicts_within_noise_differs_and_the_rest() -> None:
    # specbench 1 % faster in every round, each client spreading 4 %: within noise
    cm = compare_metric([100.0, 102.0, 98.0], [101.0, 103.02, 98.98])
    assert cm["ratio"]["median"] == pytest.approx(1.01)
    assert cm["noise"] == pytest.approx(0.04) and cm["verdict"] == "within noise"
    # 10 % slower, spreads 2 %: differs
    cm = compare_metric([100.0, 101.0, 99.0], [90.0, 90.9, 89.1])
    assert cm["verdict"] == "differs" and cm["ratio"]["median"] == pytest.approx(0.9)
    assert compare_metric([100.0], [100.0])["verdict"] == "no noise floor"
    assert compare_metric([100.0, 101.0], [None, None])["verdict"] == "missing"
    assert compare_metric([None], [None])["verdict"] == "n/a"  # neither has it (no speculation)
    # rounds pair by index: a round missing on one side is left out, never imputed
    cm = compare_metric([100.0, None, 100.0], [100.0, 50.0, 100.0])
    assert cm["ratio"]["per_round"] == [1.0, 1.0]


def test_compare_clients_per_level() -> None:
    v = {1: [round_metrics(vfile(t)) for t in (270.0, 268.0, 272.0)],
         8: [round_metrics(vfile(t, ttft=50.0, level=8)) for t in (2000.0, 1990.0, 2010.0)]}
    s = {1: [round_metrics(vfile(t)) for t in (271.0, 269.0, 270.0)],
         8: [round_metrics(vfile(t, ttft=80.0, level=8)) for t in (1700.0, 1710.0, 1690.0)] + [None]}
    doc = compare_clients(v, s)
    c1, c8 = doc["levels"]
    assert (c1["level"], c8["level"]) == (1, 8)
    assert c1["metrics"]["output_tok_s"]["verdict"] == "within noise"
    assert c8["metrics"]["output_tok_s"]["verdict"] == "differs"
    assert c8["metrics"]["ttft_ms"]["ratio"]["median"] == pytest.approx(1.6)
    assert c8["rounds"] == {"vllm": 3, "specbench": 3}
    assert c1["metrics"]["acceptance_length"]["verdict"] == "n/a"  # spec off: no counters on either side
    assert c1["stream_check"]["vllm"]["verdict"] == "no counters"
    assert c1["metrics"]["stream_al"]["vllm"]["median"] == pytest.approx(1.0)  # one token per chunk
    assert doc["verdicts"]["differs"] >= 2 and doc["verdicts"]["within noise"] >= 1
    json.dumps(doc)  # the summary JSON takes it as it is


def test_stream_check_counters_vs_stream() -> None:
    """2 requests of 128 tokens, K = 7. Counters AL 4.0; the stream's tokens per gap: 127 / 31.75 = 4.0 (equal),
    or 127 / 33 = 3.85 (below the counters by 0.15, within the truncation bound 7 x 2 / 66 = 0.21: the last
    verify step of a request at max_tokens accepts tokens cut from the output), or 127 / 42 = 3.02 (differs)."""
    spec = (64, 448, 192)  # 1 + 192 / 64 = 4.0
    eq = [round_metrics(vfile(300.0, outs=(128, 128), gaps=g, spec=spec)) for g in (32, 32)]
    for r in eq:  # 254 tokens over 63.5 gaps: set the pooled figure exactly
        r.update(stream_al=4.0, stream_gaps=63)
    assert stream_check(eq, k=7)["verdict"] == "equal within noise"
    tr = [round_metrics(vfile(300.0, outs=(128, 128), gaps=33, spec=spec)) for _ in range(3)]
    sc = stream_check(tr, k=7)
    assert sc["stream"]["median"] == pytest.approx(127 / 33)
    assert sc["truncation_bound"] == pytest.approx(7 * 2 / 66)
    assert sc["verdict"] == "explained: truncated last block"
    assert stream_check(tr, k=None)["verdict"] == "differs"  # no K: nothing to explain it with
    far = [round_metrics(vfile(300.0, outs=(128, 128), gaps=42, spec=spec)) for _ in range(3)]
    assert stream_check(far, k=7)["verdict"] == "differs"
    no_lists = [dict(r, stream_al=None, stream_gaps=0) for r in tr]
    assert stream_check(no_lists, k=7)["verdict"] == "no stream lists"


def test_markdown_names_the_verdicts_and_the_conventions() -> None:
    spec = (64, 448, 192)
    v = {1: [round_metrics(vfile(t, spec=spec, gaps=33)) for t in (270.0, 268.0, 272.0)]}
    s = {1: [round_metrics(vfile(t, spec=spec, gaps=33)) for t in (271.0, 269.0, 270.0)]}
    job = {"tag": "client-tiny-l12", "server": "vllm-tiny-l12", "workload": "gsm8k x 64", "commands": ["vllm bench serve"],
           "comparison": compare_clients(v, s, k=7)}
    md = render_markdown([job])
    assert "## client-tiny-l12: vllm-tiny-l12" in md and "```bash\nvllm bench serve\n```" in md
    assert "| c1 | output tok/s | 270 [268, 272] | 270 [269, 271] |" in md
    assert "within noise" in md and "explained: truncated last block" in md
    assert "| c1 | ITL median, per chunk (ms) |" in md
    assert "## Conventions" in md and "excluded on both sides" in md  # TPOT leaves out the first token


@pytest.fixture
def cli() -> CliRunner:
    _register()
    return CliRunner()


def test_specbench_files_from_a_real_sweep(cli: CliRunner, tmp_path: Path) -> None:
    """The specbench side as the suite produces it: `specbench sweep --result-dir` against a speculating fake
    server (every chunk of 3 tokens is one verify step of K = 3 drafts, 2 accepted), two one-round sweeps; the
    same files stand in for both clients, so every figure is within noise. The fake's first chunk carries 3
    tokens where a real server's carries the prefill's one, so the stream figure (output tokens - 1) / gaps
    reads 8 / 2 = 4 against the counters' 3: the check says so rather than hiding it."""
    rounds: dict[int, list] = {1: [], 2: []}
    with FakeEndpoint(tokens_per_chunk=3, spec_k=3, max_tokens=9, chunk_interval=0.001) as ep:
        for r in range(2):
            rdir = tmp_path / f"r{r}"
            res = cli.invoke(app, ["sweep", "--arms", f"openai:{ep.url},name=specbench", "-c", "1,2", "--max-tokens",
                                   "9", "--ignore-eos", "--num-prompts", "4", "--rounds", "1", "--warmup", "0",
                                   "--no-noise-floor", "--no-progress", "--result-dir", str(rdir), "--out",
                                   str(tmp_path / "res")])
            assert res.exit_code == 0, res.output
            for f in sorted(rdir.glob("*.json")):
                d = json.loads(f.read_text())
                rounds[int(d["max_concurrency"])].append(round_metrics(d, str(f)))
    assert [len(v) for v in rounds.values()] == [2, 2]
    m = rounds[1][0]
    assert m["acceptance_length"] == pytest.approx(3.0) and m["stream_al"] == pytest.approx(4.0)
    assert m["itl_per_token_ms"] is not None and m["itl_ms"] == pytest.approx(3 * m["itl_per_token_ms"], rel=0.05)
    doc = compare_clients(rounds, rounds, k=3)
    for row in doc["levels"]:
        assert all(cm["verdict"] == "within noise" for cm in row["metrics"].values()), row["metrics"]
        assert row["stream_check"]["specbench"]["verdict"] == "differs"
