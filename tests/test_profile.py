"""`specbench profile` on CPU: the phase ranges reach the trace; the CLI degrades clearly without a GPU."""

import json

import pytest
from typer.testing import CliRunner

from specbench.harness.adapters.local import LocalAdapter
from specbench.suites.gaps.profile import phase_host_times, run_profile


def test_profile_writes_trace_with_phase_ranges(tmp_path, tiny_target, tiny_draft):
    ad = LocalAdapter.from_dirs(tiny_target, draft=tiny_draft, spec="dflash", num_pages=64, trace_ranges=True)
    try:
        res = run_profile(ad, tmp_path, steps=3, batch=2, warmup=1, max_tokens=16)
        health = ad.run(ad.health())
    finally:
        ad.close()
    doc = json.loads(res.trace.read_text())
    assert doc["traceEvents"]
    host = phase_host_times(res.trace)
    assert {"schedule", "draft", "verify", "accept", "commit"} <= set(host)
    assert res.tokens >= 3
    # the window aborted what was unfinished: nothing running, every page back in the pool
    assert health["running"] == health["waiting"] == 0 and health["kv_free_pages"] == health["kv_total_pages"]


def test_profile_needs_phase_ranges(tmp_path, tiny_target):
    ad = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=64)
    try:
        with pytest.raises(ValueError, match="phase ranges"):
            run_profile(ad, tmp_path, steps=1, batch=1, warmup=0, max_tokens=4)
    finally:
        ad.close()


def test_profile_cli_bad_spec_exits_2():
    from specbench.cli import app as cli

    cli._register()
    r = CliRunner().invoke(cli.app, ["profile", "--spec", "maybe"])
    assert r.exit_code == 2 and "--spec" in r.output
