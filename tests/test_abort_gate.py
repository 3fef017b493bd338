"""The abort-in-flight gate on the bundled pair: clients that go away mid-generation.

Clean engine: PASS with at least one victim cancelled while the survivors decoded (the gate's own evidence),
every page back once idle. `abort_keeps_pages` (an aborted request leaves the batch, its pages never freed):
FAIL, by the run-time invariants (the survivors' steps fail) or, with them off, by the kv-leak check."""

from __future__ import annotations

import asyncio

import pytest

from specbench.harness.adapters.local import LocalAdapter
from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt
from specbench.suites.lossless.registry import GATES


@pytest.fixture(scope="module")
def base_and_prompts(tiny_target, gsm8k_prompts):
    base = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=256, name="baseline")
    yield base, [Prompt(f"p{i}", base.engine.tokenizer.encode(p)) for i, p in enumerate(gsm8k_prompts[:4])]
    base.close()


def _run(base_and_prompts, tiny_target, tiny_draft, **kw):
    base, prompts = base_and_prompts
    cand = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", num_pages=256, name="cand", **kw)
    try:
        return asyncio.run(GATES["abort-in-flight"](base, cand, prompts, 48, GreedyGateOptions()))
    finally:
        cand.close()


def test_clean_engine_passes_with_aborts_in_flight(base_and_prompts, tiny_target, tiny_draft):
    run = _run(base_and_prompts, tiny_target, tiny_draft, check_invariants=True)
    checks = {c.name: c for c in run.checks}
    assert run.verdict == "PASS", [c.to_dict() for c in run.checks]
    assert not checks["aborted-in-flight"].skipped and not checks["aborted-in-flight"].detail.startswith("0 ")
    assert checks["kv-leak"].ok and not checks["kv-leak"].skipped
    assert [p.pid.endswith("after-aborts") for p in run.prompts] == [False, False, True]
    assert run.stats.speculating


@pytest.mark.parametrize("invariants", [True, False])
def test_abort_keeps_pages_fails(base_and_prompts, tiny_target, tiny_draft, invariants):
    run = _run(base_and_prompts, tiny_target, tiny_draft, faults=("abort_keeps_pages",), check_invariants=invariants)
    checks = {c.name: c for c in run.checks}
    assert run.verdict == "FAIL"
    assert not checks["kv-leak"].ok and "leaked" in checks["kv-leak"].detail
    if invariants:  # the survivors' next step after the abort raises InvariantError
        assert any(p.status == "error" and "InvariantError" in (p.reason or "") for p in run.prompts)
