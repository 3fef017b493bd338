"""Honest accounting and secrets, over real HTTP: retries counted from the first send, failed requests
exit 4 unless --allow-failures, API keys in no artifact (a fault-injecting fake endpoint and the bundled
server); chat endpoints and the dataset flags against the bundled server."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness.adapters.base import GenRequest
from specbench.harness.adapters.openai_api import OpenAIAdapter
from specbench.harness.fake_endpoint import FakeEndpoint, Faults

KEY = "sk-specbench-test-9f8e7d6c5b4a"


@pytest.fixture
def cli() -> CliRunner:
    _register()
    return CliRunner()


def _artifacts(*roots: Path) -> list[Path]:
    return [p for r in roots if r.exists() for p in ([r] if r.is_file() else r.rglob("*")) if p.is_file()]


def test_retried_request_counts_from_its_first_send() -> None:
    with FakeEndpoint(tokens_per_chunk=1, max_tokens=4, faults=Faults(fail_first=2)) as ep:
        ad = OpenAIAdapter(ep.url, backoff=0.05, retries=3)
        res = ad.generate_sync([GenRequest(prompt="one prompt", max_tokens=4)])[0]
        give_up = OpenAIAdapter(ep.url, backoff=0.05, retries=1)
        bad = give_up.generate_sync([GenRequest(prompt="another prompt", max_tokens=4)])[0]
    assert res.ok and res.attempts == 3 and res.completion_tokens == 4
    errs = res.meta["attempt_errors"]
    assert [e["attempt"] for e in errs] == [1, 2] and all("HTTP 503" in e["error"] for e in errs)
    assert errs[1]["after_s"] >= 0.05  # the first backoff lies between the two failed sends
    assert res.ttft is not None and res.ttft >= 0.05 + 0.1  # both backoffs are inside the latency
    assert res.e2el is not None and res.e2el >= res.ttft
    assert not bad.ok and bad.attempts == 2 and "gave up after 2 attempts" in (bad.error or "")
    assert bad.e2el is not None and bad.e2el >= 0.05 and len(bad.meta["attempt_errors"]) == 2


def _custom(tmp_path: Path, texts: list[str]) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return f


def test_failed_requests_exit_4_and_the_status_says_so(cli: CliRunner, tmp_path: Path) -> None:
    data = _custom(tmp_path, ["a fine prompt", "BOOM this one always fails", "another fine prompt"])
    args = ["sweep", "-c", "1", "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3",
            "--max-tokens", "4", "--rounds", "1", "--warmup", "0", "--no-progress", "--no-noise-floor"]
    with FakeEndpoint(faults=Faults(fail_marker="BOOM")) as ep:
        arms = ["--arms", f"openai:{ep.url},name=fake,retries=1"]
        r = cli.invoke(app, [*args, *arms, "--out", str(tmp_path / "a"), "--report", str(tmp_path / "a.md")])
        ok = cli.invoke(app, [*args, *arms, "--out", str(tmp_path / "b"), "--allow-failures"])
    assert r.exit_code == 4, r.output
    assert "complete_with_failures: 1 of 3 requests FAILED" in r.output and "1 failed, 1 retried" in r.output
    assert "exit 4" in r.output
    run = json.loads(next((tmp_path / "a").glob("*/run.json")).read_text())
    assert run["status"] == "complete_with_failures"
    acc = run["summary"]["requests"]
    assert (acc["requests"], acc["failed"], acc["retried"], acc["extra_attempts"]) == (3, 1, 1, 1)
    assert "**1 FAILED**" in (tmp_path / "a.md").read_text()
    vb = json.loads(next((tmp_path / "a").glob("*/vllm-bench/*.json")).read_text())
    assert vb["failed"] == 1 and vb["completed"] == 2 and sum(1 for e in vb["errors"] if e) == 1
    assert ok.exit_code == 0, ok.output
    assert json.loads(next((tmp_path / "b").glob("*/run.json")).read_text())["status"] == "complete_with_failures"


def test_api_key_reaches_no_artifact(cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """The key is sent (the endpoint refuses requests without it), and no record, vLLM file, report, log line or
    printed message holds it: not from --api-key, not from api_key= in an engine string, not from
    $OPENAI_API_KEY, not from a server that echoes the Authorization header in its errors."""
    caplog.set_level(logging.DEBUG)
    data = _custom(tmp_path, ["first prompt", "LEAK please fail", "third prompt"])
    args = ["sweep", "-c", "1,2", "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3",
            "--max-tokens", "4", "--rounds", "1", "--warmup", "0", "--no-progress", "--allow-failures"]
    outputs = []
    with FakeEndpoint(faults=Faults(api_key=KEY, fail_marker="LEAK", echo_auth=True)) as ep:
        monkeypatch.setattr(sys, "argv", ["specbench", "sweep", "--api-key", KEY, f"--api-key={KEY}"])  # provenance
        r = cli.invoke(app, [*args, "--arms", f"openai:{ep.url},name=flag,retries=0", "--api-key", KEY,
                             "--out", str(tmp_path / "res"), "--report", str(tmp_path / "rep" / "r.md"),
                             "--result-dir", str(tmp_path / "vb")])
        outputs.append(r.output)
        assert r.exit_code == 0, r.output
        r = cli.invoke(app, [*args, "--arms", f"openai:{ep.url},name=opt,retries=0,api_key={KEY}",
                             "--out", str(tmp_path / "res")])
        outputs.append(r.output)
        assert r.exit_code == 0, r.output
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        r = cli.invoke(app, [*args, "--arms", f"openai:{ep.url},name=env,retries=0", "--out", str(tmp_path / "res")])
        outputs.append(r.output)
        assert r.exit_code == 0, r.output
        sent = [s["headers"].get("authorization") for s in ep.seen if s["path"] == "/v1/completions"]
    assert sent and all(h == f"Bearer {KEY}" for h in sent)
    files = _artifacts(tmp_path / "res", tmp_path / "rep", tmp_path / "vb")
    assert len(files) >= 3 * 5 + 2 and any(f.suffix == ".md" for f in files)
    leaks = [str(f) for f in files if KEY in f.read_text(errors="replace")]
    assert not leaks, leaks
    assert all(KEY not in o for o in outputs) and KEY not in caplog.text
    # what the leaky server echoed is kept, masked: the failure is still explained
    errors = [json.loads(x)["error"] for f in files if f.name == "requests.jsonl" for x in f.read_text().splitlines()
              if not json.loads(x)["ok"]]
    assert errors and all("injected failure" in e and "Authorization: Bearer ***" in e for e in errors)
    argvs = [json.loads(f.read_text())["provenance"]["argv"] for f in files if f.name == "run.json"]
    assert ["specbench", "sweep", "--api-key", "***", "--api-key=***"] in argvs


def test_chat_dataset_flags_and_key_against_the_bundled_server(cli: CliRunner, tiny_pair, tmp_path: Path) -> None:
    """Over real HTTP to `specbench serve`: --endpoint-type chat at T = 0 and T > 0 (tokens from usage and the
    streamed chunks), --dataset-name random --random-input-len in tokens, a custom file, the key in no file."""
    from specbench.engine import EngineConfig, LLMEngine, SpecConfig
    from specbench.harness.server import ServerThread, make_app

    target, draft = tiny_pair
    eng = LLMEngine(EngineConfig(model=target, draft=draft, spec=SpecConfig(method="dflash"), num_pages=256))
    app_, loop = make_app(eng, served_name="tiny")
    data = _custom(tmp_path, ["Question: What is 2 + 3?\nAnswer:", "Question: Name a colour.\nAnswer:"])
    base = ["sweep", "-c", "1", "--num-prompts", "2", "--max-tokens", "8", "--rounds", "1", "--warmup", "0",
            "--no-progress", "--no-noise-floor", "--api-key", KEY]
    runs = {}
    try:
        with ServerThread(app_) as srv:
            arm = ["--arms", f"openai:{srv.url},model=tiny,name=serve"]
            for name, extra in (("chat0", ["--endpoint-type", "chat", "--dataset-name", "custom", "--dataset-path",
                                           str(data)]),
                                ("chat_t", ["--endpoint", "/v1/chat/completions", "--temperature", "0.8",
                                            "--dataset-name", "spec-bench"]),
                                ("random", ["--dataset-name", "random", "--random-input-len", "12"])):
                r = cli.invoke(app, [*base, *arm, *extra, "--out", str(tmp_path / name)])
                assert r.exit_code == 0, (name, r.output)
                runs[name] = next((tmp_path / name).glob("sweep-*"))
    finally:
        loop.close()
    for name, run in runs.items():
        reqs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
        assert len(reqs) == 2 and all(r["ok"] for r in reqs), name
        for r in reqs:
            assert r["completion_tokens"] and sum(r["chunk_tokens"]) == r["completion_tokens"], (name, r)
            assert r["token_count_method"] in ("token_ids", "logprobs", "usage"), r["token_count_method"]
        if name.startswith("chat"):
            # the server applied its chat template: more prompt tokens than the user text alone
            assert all(r["prompt_tokens"] > 8 for r in reqs)
        else:
            assert all(r["prompt_tokens"] == 12 for r in reqs)  # tokens, not words
            wl = json.loads((run / "run.json").read_text())["dataset"]
            assert wl["length_unit"] == "tokens" and wl["random_exact"] == {"serve": True}
        leaks = [str(f) for f in _artifacts(run) if KEY in f.read_text(errors="replace")]
        assert not leaks, leaks


def test_redaction_masks_keys_but_never_generated_text(tmp_path: Path) -> None:
    from specbench.harness.redact import redact_argv, redact_text
    from specbench.harness.results import open_run

    text = 'def f(): return call(api_key=API_KEY)  # the bearer bonds; Authorization: granted'
    with open_run("t", results=tmp_path, secrets=[KEY], config={"engine": f"openai:http://h,api_key={KEY}"}) as run:
        run.write("requests", {"text": text, "error": f"echoed {KEY}"})
    line = json.loads((run.path / "requests.jsonl").read_text())
    assert line == {"text": text, "error": "echoed ***"}  # output text as generated; the known key masked
    assert KEY not in (run.path / "run.json").read_text()
    assert redact_text("Authorization: Bearer abc12345xyz") == "Authorization: Bearer ***"
    assert redact_text("bearer bonds and Bearer tokens") == "bearer bonds and Bearer tokens"
    assert redact_argv(["x", "--api-key", "k", "--arms", "openai:http://h,api_key=k2"]) == \
        ["x", "--api-key", "***", "--arms", "openai:http://h,api_key=***"]
