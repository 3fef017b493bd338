"""The DFlash2 fixture through the gates on CPU: greedy + concurrent lossless, sampled (T > 0) with the
selector's q, check-draft and its self-test (each broken variant caught, the clean drafter passing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft"


def _cli(args: list[str]):
    from typer.testing import CliRunner

    from specbench.cli.app import _register, app

    _register()
    return CliRunner().invoke(app, args)


def test_fixture_is_small_and_dflash2():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert (FIXTURE / "model.safetensors").stat().st_size < 4 * 2**20
    build = json.loads((FIXTURE.parent / "BUILD.json").read_text())["acceptance"]
    # measurably different from the DFlash1 drafter trained the same way (the committed tiny/draft)
    assert build["dflash2"]["mean_accept_len"] > build["dflash1"]["mean_accept_len"] + 0.5


def test_lossless_greedy_and_concurrent_gates_pass(tiny_target, tmp_path):
    r = _cli(["lossless", "--baseline", f"local:{tiny_target},spec=off",
              "--candidate", f"local:{tiny_target},draft={FIXTURE}", "--num-prompts", "4", "--max-tokens", "32",
              "--concurrent", "--no-accept-reference", "--results", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["verdict"] == "PASS"
    assert "check-draft" in r.output and "causality     PASS" in r.output


def test_lossless_fails_when_the_drafter_is_checked_wrong(tiny_target, tmp_path):
    """The lossless command runs check-draft on a local drafter: a DFlash2 checkpoint whose class name says
    DFlash1 (loaded by DFlash1 code) fails though every gate passes."""
    bad = tmp_path / "as_dflash1"
    bad.mkdir()
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(FIXTURE / "model.safetensors")
    r = _cli(["lossless", "--baseline", f"local:{tiny_target},spec=off", "--candidate",
              f"local:{tiny_target},draft={bad}", "--num-prompts", "1", "--max-tokens", "16",
              "--no-accept-reference", "--results", str(tmp_path / "res")])
    assert r.exit_code == 1, r.output
    assert "candidate_selector" in r.output and "drafts it as DFlash1" in r.output


@pytest.fixture(scope="module")
def sampled_runs(tiny_target):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.sampled.config import SampledGateOptions, parse_configs
    from specbench.suites.sampled.gate import collect, make_prompts, run_gate

    opts = SampledGateOptions(num_prompts=1, positions=4, samples=1024, permutations=999, prompt_chars=200,
                              prompt_set="echo")
    cfgs = parse_configs("t=1.5,k=2")
    base = LocalAdapter.from_dirs(tiny_target, spec="off", name="baseline")
    clean = LocalAdapter.from_dirs(tiny_target, draft=str(FIXTURE), spec="dflash", name="dflash2")
    wrong_q = LocalAdapter.from_dirs(tiny_target, draft=str(FIXTURE), spec="dflash", name="dflash2-wrong-q")
    _unselected_q(wrong_q.engine.proposer)
    try:
        prompts = make_prompts(base, opts)
        samples = collect(base, prompts, cfgs, opts, "baseline", 0)
        out = {name: run_gate(base, cand, opts, cfgs, prompts=prompts, baseline_samples=samples)
               for name, cand in (("clean", clean), ("wrong_q", wrong_q))}
    finally:
        for a in (base, clean, wrong_q):
            a.close()
    return out


def _unselected_q(proposer) -> None:
    """Drafts walked by the selector, but the verify given the unselected logits' distribution as q: what an
    engine that ignores the selector's q does. Rejection sampling with the wrong q is lossy."""
    import torch

    from specbench.engine.sampler import sampling_probs_rows

    orig = proposer._propose_group

    def group(g, kmap, tile_starts, selector, causal):
        orig(g, kmap, tile_starts, selector, causal)
        logits = proposer.draft_logits(g)
        for i, s in enumerate(g):
            if not s.req.params.greedy and s.drafts:
                k = len(s.drafts)
                s.draft_probs = sampling_probs_rows(logits[i, :k], [s.req.params] * k).to(torch.float32)

    proposer._propose_group = group


def test_sampled_gate_passes_with_the_selector_q(sampled_runs):
    res = sampled_runs["clean"]
    assert res.verdict == "PASS", res.summary()
    assert res.spec["num_drafts"] > 0 and res.spec["mean_accept_len"] > 1.2


def test_sampled_gate_fails_when_verify_ignores_the_selector_q(sampled_runs):
    res = sampled_runs["wrong_q"]
    assert res.verdict == "FAIL", res.summary()


def test_check_draft_cli_and_selftest(tiny_target, tiny_draft):
    r = _cli(["check-draft", str(FIXTURE), "--target", tiny_target, "--num-prompts", "2", "--max-tokens", "16",
              "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["verdict"] == "PASS" and doc["acceptance"]["nearest"] == "declared"
    r = _cli(["check-draft", str(FIXTURE), "--target", tiny_target, "--num-prompts", "4", "--max-tokens", "32",
              "--selftest", "--json"])
    assert r.exit_code == 0, r.output
    rows = {x["case"]: x for x in json.loads(r.output.strip().splitlines()[-1])["selftest"]}
    assert all(x["as_expected"] for x in rows.values()), rows
    assert "selector skipped" in rows["selector_skipped"]["detail"]
    assert "'causal'" in rows["causal_draft"]["detail"]
    # a DFlash1 drafter: the checks pass, the variants cannot be told apart (CANNOT TEST, exit 3)
    r = _cli(["check-draft", tiny_draft, "--target", tiny_target, "--num-prompts", "1", "--max-tokens", "16"])
    assert r.exit_code == 3, r.output
    assert _cli(["check-draft", "/nonexistent"]).exit_code == 2
    assert _cli(["check-draft", str(FIXTURE), "--arch", "Nope"]).exit_code == 2


def test_acceptance_sanity_over_http_names_the_variant_a_server_runs(tiny_target):
    """For any engine: a `specbench serve` endpoint whose engine skips the selector is matched, from its
    /metrics counters alone, to the 'selector skipped' variant."""
    pytest.importorskip("fastapi")
    from specbench.engine import EngineConfig, LLMEngine, SpecConfig
    from specbench.harness.adapters.openai_api import OpenAIAdapter
    from specbench.harness.draft_variants import run_variants
    from specbench.harness.server import ServerThread, make_app

    eng = LLMEngine(EngineConfig(model=tiny_target, draft=str(FIXTURE), spec=SpecConfig(method="dflash"),
                                 num_pages=256, faults=("selector_skipped",)))
    app, loop = make_app(eng, served_name="tiny", max_pending=64)
    srv = ServerThread(app).start()
    try:
        oa = OpenAIAdapter(srv.url, model="tiny", probe=True)
        rep = run_variants(tiny_target, str(FIXTURE), engine=oa, num_prompts=4, max_tokens=32)
        oa.close()
    finally:
        srv.stop()
        loop.close()
    assert rep.verdict == "FAIL" and rep.nearest == "selector skipped", rep.render()
