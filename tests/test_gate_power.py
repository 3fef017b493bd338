"""Gate power (issue 47): engine bugs of our own, planted the way a real PR would write them (one line, at sites
the named faults of engine/faults.py do not touch), must fail the default gate set; the clean engine passes the
same command.

Each plant is a monkeypatch of the bundled engine, run through the CLI in-process: `specbench lossless
--no-record` with the gate set at its defaults (two prompts and 32 tokens to keep CI's time down: the
prefix-cache gate uses the first two prompts whatever the count), and `specbench sampled` at the default
configuration that reaches the plant (one prompt of each default set, 128 samples: the full default run is
docs/sampled.md's measurement)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.engine import accept_step, kv_cache
from specbench.engine.spec import dflash
from specbench.suites.sampled.config import DEFAULT_CONFIGS

cli._register()
runner = CliRunner()
ARGS = ["lossless", "--no-record", "--num-prompts", "2", "--max-tokens", "32"]


def _capture_cut_at_block_end(monkeypatch) -> None:
    """A capture that ends exactly at a block's end does not count as covering that block (`>` for `>=`)."""
    seal = kv_cache.PagePool.seal
    monkeypatch.setattr(kv_cache.PagePool, "seal", lambda self, rid, tokens, upto, cap:
                        seal(self, rid, tokens, upto, None if cap is None else cap - 1))


def _restore_one_row_short(monkeypatch) -> None:
    """A prefix hit restores the drafter's context one row short of the hit."""
    restore = dflash.DFlashProposer.restore
    monkeypatch.setattr(dflash.DFlashProposer, "restore", lambda self, req, n, captured:
                        restore(self, req, n - 1 if captured and n else n, captured))


def _gated_round_skips_drafter_context(monkeypatch) -> None:
    """A one-token round (the gate, the policy) leaves the drafter's context behind: decode spans not observed."""
    observe = dflash.DFlashProposer.observe
    monkeypatch.setattr(dflash.DFlashProposer, "observe", lambda self, spans, committed, taps, eligible, ctx_shift=0:
                        observe(self, spans, committed, taps,
                                [ok and s.kind != "decode" for s, ok in zip(spans, eligible, strict=True)], ctx_shift))


def _lossless(*extra: str):
    r = runner.invoke(cli.app, [*ARGS, *extra])
    return r.exit_code, r.output


def test_the_clean_engine_passes_the_default_set():
    code, out = _lossless()
    assert code == 0, out[-3000:]
    assert "[lossless] prefix-cache: PASS" in out and "[lossless] levers: PASS" in out


@pytest.mark.parametrize("plant, candidate", [
    (_capture_cut_at_block_end, None),
    (_restore_one_row_short, None),  # the run-time invariants refuse the step
    (_restore_one_row_short, "local,spec=dflash,invariants=0"),  # an engine we cannot look inside
])
def test_a_planted_prefix_bug_fails_the_default_set(monkeypatch, plant, candidate):
    plant(monkeypatch)
    code, out = _lossless(*(["--candidate", candidate] if candidate else []))
    assert code == 1 and "VERDICT: FAIL" in out, out[-3000:]
    assert "[lossless] prefix-cache: FAIL" in out
    if candidate:  # without invariants: lossless tokens, caught by speculation silently off
        assert "speculation silently off" in out


def _gated_round_shifts_drafter_context(monkeypatch) -> None:
    """A one-token round (the gate, the policy) writes the drafter's context rows one position late."""
    observe = dflash.DFlashProposer.observe
    monkeypatch.setattr(dflash.DFlashProposer, "observe", lambda self, spans, committed, taps, eligible, ctx_shift=0:
                        observe(self, spans, committed, taps, eligible,
                                1 if any(s.kind == "decode" for s in spans) else ctx_shift))


def test_a_lever_bug_that_keeps_tokens_exact_fails_on_its_acceptance_trace(monkeypatch, tiny_pair):
    """A lever path whose drafter context is wrong, in an engine without run-time invariants: the tokens stay
    lossless (the verify is right), the drafts after each gated round are worse; the levers gate holds every
    variant's steps to the drafter's replay (accept_trace.py `judge_traces`)."""
    from specbench.harness.adapters.local import LocalAdapter

    _gated_round_shifts_drafter_context(monkeypatch)
    t, d = tiny_pair
    run = _levers_gate(LocalAdapter.from_dirs(t, d, spec="dflash", check_invariants=False),
                       LocalAdapter.from_dirs(t, spec="off"), n=2, max_tokens=32)
    assert run.verdict == "FAIL" and all(p.ok for p in run.prompts if not p.pid.startswith("trace:")), run.notes
    failed = [c for c in run.failed_checks if c.name.endswith(": accept-trace: exact")]
    assert failed and failed == run.failed_checks, run.notes  # caught by the trace alone
    assert all("the replayed drafter earns" in c.detail for c in failed)


def test_a_planted_lever_bug_fails_the_default_set(monkeypatch):
    """Only a lever takes this path (levers are off by default): the levers gate runs gate 1, and the run-time
    invariants of the gate command's engines refuse the step. Without them the tokens stay lossless and the gate-1
    variant stops drafting after its first gated round (the drafter is never ready again): gate 1 is not held to
    drafting, so that escape remains (the test above plants a context bug that keeps drafting: the trace sees it)."""
    _gated_round_skips_drafter_context(monkeypatch)
    code, out = _lossless()
    assert code == 1 and "[lossless] levers: FAIL" in out, out[-3000:]
    assert "drafter context" in out


# ---- the sampled gate: a verify path that drops the temperature when nothing truncates --------------------------
def _verify_drops_bare_temperature(monkeypatch) -> None:
    """A verify "fast path": rows with no top-k / top-p / min-p skip the transform, so the temperature is lost."""
    from dataclasses import replace

    rows = accept_step.sampling_probs_rows
    monkeypatch.setattr(accept_step, "sampling_probs_rows", lambda logits, params: rows(logits, [
        replace(q, temperature=1.0) if q.top_k <= 0 and q.top_p == 1.0 and q.min_p == 0 else q for q in params]))


@pytest.mark.parametrize("planted", [False, True])
def test_the_default_sampled_set_reaches_a_bare_temperature(monkeypatch, planted):
    bare = [c for c in DEFAULT_CONFIGS if c.top_p == 1.0 and not c.top_k]
    assert [c.name for c in bare] == ["t0.7"]  # the default set holds a temperature with no truncation
    if planted:
        _verify_drops_bare_temperature(monkeypatch)
    r = runner.invoke(cli.app, ["sampled", "--no-record", "--configs", "t=0.7", "--num-prompts", "1", "--samples",
                                "128", "--permutations", "199", "--seed-repeat", "0"])
    want = (1, "sampled gate: FAIL; candidates: ngram-soft FAIL, dflash FAIL") if planted else \
        (0, "sampled gate: PASS; candidates: ngram-soft PASS, dflash PASS")
    assert r.exit_code == want[0] and want[1] in r.output, r.output[-3000:]


# ---- the levers gate's evidence rules ---------------------------------------------------------------------------
def _levers_gate(candidate, baseline, n: int = 2, max_tokens: int = 16):
    import asyncio

    from specbench.suites.lossless.gates.levers import levers
    from specbench.suites.lossless.greedy import GreedyGateOptions, tokenize_prompts
    from specbench.suites.lossless.prompts import load_prompts

    async def go():
        try:
            prompts, _ = await tokenize_prompts(baseline, candidate, load_prompts("gsm8k", n))
            return await levers(baseline, candidate, prompts, max_tokens, GreedyGateOptions())
        finally:
            await candidate.aclose()
            await baseline.aclose()
    return asyncio.run(go())


def test_levers_gate_is_cannot_test_without_levers_and_names_what_never_acted(tiny_pair):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    off = _levers_gate(LocalAdapter.from_dirs(t, spec="off"), LocalAdapter.from_dirs(t, spec="off"))
    assert off.verdict == "CANNOT TEST" and "does not speculate" in off.missing[0] and not off.results
    # K = 1: trim 2 is refused by the engine (that variant only); one request at a time: gate 1 never acts
    one = _levers_gate(LocalAdapter.from_dirs(t, d, spec="dflash", k=1), LocalAdapter.from_dirs(t, spec="off"), n=1)
    assert one.verdict == "CANNOT TEST" and one.results, one.missing
    assert any(m.startswith("trim=2: an engine with the lever set: refused") for m in one.missing)
    assert any(m.startswith("gate=1: the lever acting: it never acted") for m in one.missing)
    assert not any(m.startswith("policy=auto") for m in one.missing)  # the policy chose every step's span


def test_a_lever_path_that_silently_stops_speculating_fails(monkeypatch, tiny_pair):
    """A trim that proposes nothing (engine/spec/plan.py `fixed_drafts`: 0 instead of trim): the tokens stay lossless
    (plain decode), but speculation is silently off with the lever on: the levers gate fails it."""
    from specbench.engine.spec import plan
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    clean = _levers_gate(LocalAdapter.from_dirs(t, d, spec="dflash"), LocalAdapter.from_dirs(t, spec="off"))
    assert clean.verdict == "PASS", (clean.missing, [c for c in clean.checks if not c.ok])
    monkeypatch.setattr(plan.SpecPlan, "fixed_drafts", property(lambda self: 0 if self.trim else self.k))
    bad = _levers_gate(LocalAdapter.from_dirs(t, d, spec="dflash"), LocalAdapter.from_dirs(t, spec="off"))
    assert bad.verdict == "FAIL" and all(p.ok for p in bad.prompts)  # lossless tokens
    assert [c.name for c in bad.failed_checks] == ["trim=2: speculating"]
    assert "speculation silently off" in bad.failed_checks[0].detail


def test_the_clean_engine_passes_the_levers_gate_at_the_default_size(tiny_pair):
    """8 prompts x 64 tokens (the default command's, the demo's): under gate 1 the longest request ends at EOS
    before the next, so no request ever runs alone and none drafts; that is the lever working, not a fault (a false
    alarm the first "speculating" check raised on every gate 1 run of this size)."""
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny_pair
    run = _levers_gate(LocalAdapter.from_dirs(t, d, spec="dflash"), LocalAdapter.from_dirs(t, spec="off"), n=8,
                       max_tokens=64)
    assert run.verdict == "PASS", (run.missing, [c for c in run.checks if not c.ok])
    assert not run.missing and len(run.prompts) == 24
