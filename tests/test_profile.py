"""`specbench profile` on CPU: the phase ranges reach the trace; the CLI degrades clearly without a GPU."""

import json

from typer.testing import CliRunner

from specbench.engine import EngineConfig, SpecConfig
from specbench.suites.gaps.profile import phase_host_times, run_profile


def test_profile_writes_trace_with_phase_ranges(tmp_path, tiny_target, tiny_draft):
    cfg = EngineConfig(model=tiny_target, draft=tiny_draft, spec=SpecConfig(method="dflash"), num_pages=64)
    res = run_profile(cfg, tmp_path, steps=3, batch=2, warmup=1, max_tokens=16)
    doc = json.loads(res.trace.read_text())
    assert doc["traceEvents"]
    host = phase_host_times(res.trace)
    assert {"schedule", "draft", "verify", "accept", "commit"} <= set(host)
    assert res.tokens >= 3


def test_profile_cli_bad_spec_exits_2():
    from specbench.cli import app as cli

    cli._register()
    r = CliRunner().invoke(cli.app, ["profile", "--spec", "maybe"])
    assert r.exit_code == 2 and "--spec" in r.output
