"""`specbench selftest` on the bundled pair: every greedy fault caught, no false alarm in 5 clean runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.suites.lossless.selftest import greedy_faults

cli._register()
runner = CliRunner()

REQUIRED = {"kv_offset", "skip_rollback", "wrong_bonus", "accept_off_by_one", "draft_ctx_misaligned", "mask_leak",
            "stale_shape", "emit_past_stop", "spec_logprobs_late", "abort_keeps_pages", "verify_ignores_penalties"}


@pytest.fixture(scope="module")
def catalogue(tiny_target):
    """Every fault the local engine names, read through the adapter's "faults" capability, and its greedy ones."""
    from specbench.harness.adapters.local import LocalAdapter

    ad = LocalAdapter.from_dirs(tiny_target, spec="off", num_pages=16)
    try:
        return ad.fault_catalogue(), greedy_faults(ad)
    finally:
        ad.close()


@pytest.fixture(scope="module")
def faults(catalogue) -> dict[str, str]:
    return catalogue[1]


def test_fault_list_covers_the_issue(catalogue, faults):
    every, _ = catalogue
    assert REQUIRED <= set(faults)
    # a sampling, a prefix-cache and a drafter-variant fault the engine names, none of them the greedy gates'
    others = {"biased_accept": "sampling", "register_before_forward": "prefix", "selector_skipped": "draft_variant"}
    assert {f: every[f].family for f in others} == others and not set(others) & set(faults)


def test_selftest_catches_every_fault_and_never_false_alarms(tiny_pair, tmp_path, faults):
    t, d = tiny_pair
    report = tmp_path / "selftest.md"
    res = runner.invoke(cli.app, ["selftest", "--candidate", f"local:{t},draft={d},spec=dflash", "--repeat", "5",
                                  "--json", "--report", str(report)])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.exit_code == 0, (out["missed"], out["false_alarms"])
    assert out["ok"] and out["missed"] == [] and out["false_alarms"] == []
    assert {r["label"] for r in out["faults"]} == set(faults)
    assert all(r["caught_by"] for r in out["faults"])
    assert len(out["clean"]) == 5 and all(v == "PASS" for r in out["clean"] for v in r["verdicts"].values())
    assert all(r["accept_len"] and r["accept_len"] > 1.05 for r in out["clean"])
    md = report.read_text()
    assert md.startswith("# Self-test: PASS") and "| fault | what it breaks | caught by |" in md


def test_selftest_bad_input():
    res = runner.invoke(cli.app, ["selftest", "--faults", "nope", "--repeat", "1"])
    assert res.exit_code == 2 and "nope" in res.output
    res = runner.invoke(cli.app, ["selftest", "--candidate", "openai:http://127.0.0.1:9"])
    assert res.exit_code == 2 and "local" in res.output


def test_cannot_test_is_never_a_catch_nor_a_clean_pass() -> None:
    """A gate that could not collect evidence proves nothing: it neither catches a fault nor clears a clean run."""
    from specbench.suites.lossless.selftest import EngineRow, SelftestOutcome

    untested = EngineRow("kv_offset", ("kv_offset",), "d", verdicts={"greedy": "CANNOT TEST (output ids)"})
    failed = EngineRow("mask_leak", ("mask_leak",), "d", verdicts={"greedy": "FAIL", "headroom": "n/a"})
    crashed = EngineRow("stale_shape", ("stale_shape",), "d", verdicts={"concurrent": "ERROR"})
    assert untested.caught_by == [] and failed.caught_by == ["greedy"] and crashed.caught_by == ["concurrent"]
    clean_ok = EngineRow("clean", (), "d", verdicts={"greedy": "PASS", "fp32-strict": "n/a"})
    clean_untested = EngineRow("clean 2", (), "d", verdicts={"greedy": "PASS", "headroom": "CANNOT TEST (geometry)"})
    out = SelftestOutcome({}, [untested, failed, crashed], [clean_ok], 1, 1, 0.2, None)
    assert out.missed == ["kv_offset"] and not out.false_alarms and not out.ok
    out = SelftestOutcome({}, [failed], [clean_ok, clean_untested], 1, 1, 0.2, None)
    assert out.false_alarms == ["clean 2: headroom"] and not out.ok
