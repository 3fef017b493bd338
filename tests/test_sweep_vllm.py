"""vLLM bench's result format both ways: every sweep cell writes one, read here with vLLM's field names
only; a committed file of vLLM's exact schema imports and renders beside a specbench run; the vLLM flag
aliases mean what they mean there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness.fake_endpoint import FakeEndpoint
from specbench.suites.sweep.vllm_format import VllmFormatError, from_vllm

SAMPLE = Path(__file__).parent / "data" / "vllm_bench" / "openai-infqps-concurrency2-Qwen3-8B-20261130-141502.json"

# vllm/benchmarks/serve.py: the keys of `result_json` (header + `benchmark()`'s result) with --save-detailed
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "queue_times", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx"} | \
    {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50", "p90", "p99")}


@pytest.fixture
def cli() -> CliRunner:
    _register()
    return CliRunner()


def _sweep(cli: CliRunner, url: str, out: Path, *extra: str) -> tuple[int, str, Path | None]:
    r = cli.invoke(app, ["sweep", "--num-prompts", "4", "--rounds", "1", "--warmup", "0", "--no-progress",
                         "--no-noise-floor", "--arms", f"openai:{url},name=fake", "--out", str(out), *extra])
    runs = sorted(out.glob("sweep-*")) if out.is_dir() else []
    return r.exit_code, r.output, runs[-1] if runs else None


def test_sweep_cells_write_vllm_results_read_by_vllm_names(cli: CliRunner, tmp_path: Path) -> None:
    """Only vLLM's field names: totals agree with the per-request lists, ITL is per chunk (2 tokens each here)."""
    with FakeEndpoint(tokens_per_chunk=2, chunk_interval=0.002) as ep:
        code, out, run = _sweep(cli, ep.url, tmp_path / "res", "--max-concurrency", "1,2", "--max-tokens", "8",
                                "--result-dir", str(tmp_path / "vb"))
    assert code == 0, out
    assert run is not None
    files = sorted((run / "vllm-bench").glob("*.json"))
    assert [f.name for f in files] == ["fake-c1-r0.json", "fake-c2-r0.json"]
    copies = sorted((tmp_path / "vb").glob("*.json"))
    assert len(copies) == 2 and copies[0].name.startswith("fake-infqps-concurrency1-fake-model-")
    for f in files:
        d = json.loads(f.read_text())
        assert VLLM_KEYS <= set(d), VLLM_KEYS - set(d)
        assert d["completed"] == d["num_prompts"] == 4 and d["failed"] == 0 and d["request_rate"] == "inf"
        assert d["output_lens"] == [8] * 4 and d["total_output_tokens"] == 32
        assert d["output_throughput"] == pytest.approx(d["total_output_tokens"] / d["duration"])
        assert d["request_throughput"] == pytest.approx(d["completed"] / d["duration"])
        assert all(len(g) == 3 for g in d["itls"])  # 8 tokens in 4 chunks of 2: 3 gaps, per chunk as in vLLM
        gaps = [x for g in d["itls"] for x in g]
        assert d["mean_itl_ms"] == pytest.approx(np.mean(gaps) * 1e3)
        assert d["std_ttft_ms"] == pytest.approx(np.std(d["ttfts"]) * 1e3)
        assert d["p99_e2el_ms"] == pytest.approx(np.percentile(d["latencies"], 99) * 1e3)
        assert d["mean_tpot_ms"] == pytest.approx(np.mean([(lat - t) / 7 for lat, t in zip(d["latencies"],
                                                                                          d["ttfts"], strict=True)]) * 1e3)
        assert np.mean(gaps) > 0.001  # the server's 2 ms between chunks (a busy client may read two at once)
        # specbench's per-token ITL is the chunk gap spread over its 2 tokens
        assert d["specbench"]["itl_per_token_ms"]["mean"] == pytest.approx(d["mean_itl_ms"] / 2)
        assert "spec_decode_acceptance_rate" not in d  # no speculation, no spec fields (as vLLM)
        assert from_vllm(d)["stats"]["chunk_gap"]["mean"] == pytest.approx(d["mean_itl_ms"] / 1e3)


def test_vllm_sample_imports_and_renders_beside_a_specbench_run(cli: CliRunner, tmp_path: Path) -> None:
    sample = json.loads(SAMPLE.read_text())
    assert VLLM_KEYS | {"generated_texts"} <= set(sample)  # the committed file has vLLM's schema
    r = cli.invoke(app, ["import", "vllm-bench", str(SAMPLE), "--out", str(tmp_path / "imp")])
    assert r.exit_code == 0, r.output
    imported = next((tmp_path / "imp").glob("sweep-*"))
    with FakeEndpoint() as ep:
        code, out, ours = _sweep(cli, ep.url, tmp_path / "res", "-c", "2", "--max-tokens", "4")
    assert code == 0, out
    r = cli.invoke(app, ["report", str(ours), str(imported), "-o", "-"])
    assert r.exit_code == 0, r.output
    md = r.output
    assert f"{imported.name}/vllm-eagle3 tok/s" in md and f"{ours.name}/fake tok/s" in md  # side by side
    assert f"| c2 | {sample['output_throughput']:.1f} |" in md  # vLLM's own throughput, not a recomputation
    ttft = f"{sample['mean_ttft_ms']:.1f} / {sample['median_ttft_ms']:.1f} / {sample['p90_ttft_ms']:.1f} / " \
           f"{sample['p99_ttft_ms']:.1f}"
    assert ttft in md
    # acceptance: vLLM's percent becomes specbench's fraction, labelled by its source
    assert f"{sample['spec_decode_acceptance_rate']:.1f}%" in md and "vLLM bench (counters, server-wide)" in md
    assert f"{sample['spec_decode_acceptance_length']:.3f}" in md
    assert "71.2%" in md  # per-position rate 0.7121 (a fraction in vLLM's file)


def test_import_refuses_what_is_not_a_vllm_result(cli: CliRunner, tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"completed": 3}))
    r = cli.invoke(app, ["import", "vllm-bench", str(bad), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "'duration'" in r.output and "x.json" in r.output
    r = cli.invoke(app, ["import", "vllm-bench-2", str(bad), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "vllm-bench" in r.output
    with pytest.raises(VllmFormatError, match="expected one per request"):
        d = json.loads(SAMPLE.read_text())
        d["itls"] = d["itls"][:-1]
        from_vllm(d)


@pytest.mark.parametrize("args, option", [
    (["--dataset-name", "nope"], "--dataset-name"),
    (["--dataset-name", "custom"], "--dataset-path"),
    (["--dataset-name", "random", "--dataset-path", "x.jsonl"], "--dataset-path"),
    (["--dataset-name", "custom", "--dataset-path", "/no/such.jsonl"], "--dataset-path"),
    (["--concurrency", "2", "--max-concurrency", "2"], "--max-concurrency"),
    (["--endpoint", "/v1/embeddings"], "--endpoint"),
    (["--endpoint-type", "embed"], "--endpoint-type"),
    (["--endpoint", "/v1/completions", "--endpoint-type", "chat"], "--endpoint"),
    (["--burstiness", "0.5", "--arrival", "poisson"], "--burstiness"),
    (["--random-output-len", "8", "--max-tokens", "9"], "--random-output-len"),
])
def test_vllm_flags_bad_input_exits_2_naming_the_flag(cli: CliRunner, args: list[str], option: str,
                                                       tmp_path: Path) -> None:
    r = cli.invoke(app, ["sweep", *args, "--out", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert option in r.output
    assert not list(tmp_path.iterdir())


def test_custom_dataset_file_errors_name_the_line(cli: CliRunner, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    r = cli.invoke(app, ["sweep", "--dataset-name", "custom", "--dataset-path", str(f), "--out", str(tmp_path / "o")])
    flat = " ".join(re.sub("[\u2500-\u257f]", " ", r.output).split())  # rich's error box wraps at the terminal width
    assert r.exit_code == 2 and "line 2" in flat and "'prompt'" in flat, r.output


def test_vllm_flags_drive_the_sweep(cli: CliRunner, tmp_path: Path) -> None:
    """--dataset-name custom --dataset-path, --random-output-len (ignore_eos), --request-rate + --max-concurrency
    (a cap), --burstiness (gamma), --endpoint chat: recorded as the same native config."""
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"my prompt number {i}"}) + "\n" for i in range(3)))
    with FakeEndpoint(max_tokens=64) as ep:
        code, out, run = _sweep(cli, ep.url, tmp_path / "res", "--dataset-name", "custom", "--dataset-path", str(f),
                                "--random-output-len", "5", "--request-rate", "200", "--max-concurrency", "2",
                                "--burstiness", "0.5", "--endpoint", "/v1/chat/completions", "--save-result")
        paths = [s["path"] for s in ep.seen]
    assert code == 0, out
    assert run is not None
    assert "vLLM bench results:" in out
    cfg = json.loads((run / "run.json").read_text())["config"]
    assert (cfg["dataset"], cfg["max_tokens"], cfg["ignore_eos"], cfg["mode"], cfg["max_concurrency"],
            cfg["arrival"], cfg["burstiness"], cfg["endpoint_type"]) == \
        ("custom", 5, True, "open", 2, "gamma", 0.5, "chat")
    assert paths.count("/v1/chat/completions") == 4 + 1  # every request (and the one-token probe) as chat
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
    assert reqs and all(r["ok"] and r["completion_tokens"] == 5 and sum(r["chunk_tokens"]) == 5 for r in reqs)
    d = json.loads(next((run / "vllm-bench").glob("*.json")).read_text())
    assert d["backend"] == "openai-chat" and d["request_rate"] == 200.0 and d["max_concurrency"] == 2
    assert d["burstiness"] == 0.5


def test_c1_spec_counts_per_request_from_counter_deltas(cli: CliRunner, tmp_path: Path) -> None:
    """An endpoint with only server-wide counters (no per-request spec fields): at c1 each request gets the
    counter delta around it, labelled; at c2 the cell's delta. Every chunk of 3 tokens is one verify step of
    K = 3 drafts with 2 accepted, so each request accepts 6 of 9 draft tokens in 3 steps."""
    with FakeEndpoint(tokens_per_chunk=3, spec_k=3, max_tokens=9) as ep:
        code, out, run = _sweep(cli, ep.url, tmp_path / "res", "-c", "1,2", "--max-tokens", "9", "--ignore-eos")
    assert code == 0, out
    assert run is not None
    reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
    c1 = [r for r in reqs if r["meta"]["level"] == 1 and r["meta"]["round"] >= 0]
    assert len(c1) == 4 and all(r["spec"]["source"] == "counters-c1" for r in c1)
    assert all((r["spec"]["num_drafts"], r["spec"]["num_accepted_tokens"], r["spec"]["accepted_per_pos"]) ==
               (3, 6, [3, 3, 0]) for r in c1)
    assert all(r["spec"] is None for r in reqs if r["meta"]["level"] == 2)
    d1 = json.loads((run / "vllm-bench" / "fake-c1-r0.json").read_text())
    d2 = json.loads((run / "vllm-bench" / "fake-c2-r0.json").read_text())
    assert d1["specbench"]["acceptance"]["source"] == "counters-c1" and d2["specbench"]["acceptance"]["source"] == "counters"
    for d in (d1, d2):
        assert d["spec_decode_acceptance_rate"] == pytest.approx(100 * 6 / 9)  # percent, as vLLM
        assert d["spec_decode_acceptance_length"] == pytest.approx(3.0)
        assert d["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 1.0, 0.0])
    assert d1["specbench"]["acceptance"]["length_request_mean"] == pytest.approx(3.0)
    md = cli.invoke(app, ["report", str(run), "-o", "-"]).output
    assert "counter deltas per request at c1" in md and "counters (server-wide)" in md


def test_dataset_files_in_vllm_benchs_formats(tmp_path: Path) -> None:
    """--dataset-path for sharegpt (a JSON list, first human turn) and spec-bench (JSONL turns, first turn),
    and the errors that name the file, the line and the field."""
    from specbench.suites.sweep.workload import WorkloadError, file_texts, load_texts

    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi there"},
                                                            {"from": "gpt", "value": "hello"}]},
                              {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
                              {"id": "c", "conversations": [{"from": "human", "value": "second"}]}]))
    assert file_texts("sharegpt", sg) == ["hi there", "second"]
    sb = tmp_path / "q.jsonl"
    sb.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["first turn", "second turn"]}) + "\n\n")
    assert file_texts("spec_bench", sb) == ["first turn"]
    texts, reps = load_texts("spec_bench", 3, 0, path=sb)
    assert texts == ["first turn"] * 3 and reps == 3  # a file smaller than n is cycled, and says so
    with pytest.raises(WorkloadError, match="expected a JSON list of conversations"):
        file_texts("sharegpt", sb)
    sb.write_text('{"turns": "not a list"}\n')
    with pytest.raises(WorkloadError, match=r"line 1: field 'turns' is 'not a list'"):
        file_texts("spec_bench", sb)
    with pytest.raises(WorkloadError, match="works with --dataset-name custom, sharegpt"):
        file_texts("gsm8k", sb)
