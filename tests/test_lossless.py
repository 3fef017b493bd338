"""The lossless command on the bundled pair, its checks, records and report."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.suites.lossless.checks import (
    AcceptanceEvidence,
    acceptance_evidence,
    check_acceptance,
    check_after_stop,
    check_counters,
    check_kv_idle,
)
from specbench.suites.lossless.concurrent import staggered

cli._register()
runner = CliRunner()


def _engines(pair, faults: str | None = None) -> list[str]:
    t, d = pair
    cand = f"local:{t},draft={d},spec=dflash" + (f",faults={faults}" if faults else "")
    return ["--baseline", f"local:{t},spec=off", "--candidate", cand]


def _run(args: list[str]):
    res = runner.invoke(cli.app, ["lossless", *args])
    return res, (json.loads(res.stdout.strip().splitlines()[-1]) if "--json" in args and res.stdout.strip() else None)


def test_lossless_passes_on_the_bundled_pair(tiny_pair, tmp_path):
    report = tmp_path / "r.md"
    res, out = _run([*_engines(tiny_pair), "--num-prompts", "3", "--max-tokens", "24",
                     "--quick", "--concurrent", "--json", "--report", str(report), "--results", str(tmp_path / "res")])
    assert res.exit_code == 0, res.output
    assert out["verdict"] == "PASS" and out["summary"]["failed_prompts"] == 0
    assert {g["name"] for g in out["gates"]} == {"greedy", "concurrent"}
    g = out["gates"][0]
    assert g["stats"]["speculating"] and g["stats"]["mean_accept_len"] > 1.05
    assert all(c["ok"] for c in g["checks"]) and {c["name"] for c in g["checks"]} >= {"counters", "kv-leak"}
    md = report.read_text()
    assert md.startswith("# Lossless gate: PASS") and "| prompt | status | first divergence |" in md
    (run_dir,) = [p for p in (tmp_path / "res").iterdir() if p.name != "references"]
    (ref,) = (tmp_path / "res" / "references" / "lossless-acceptance").iterdir()  # the first PASS records one
    assert json.loads(ref.read_text())["mean_accept_len"] == pytest.approx(g["stats"]["mean_accept_len"])
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "complete" and meta["summary"]["verdict"] == "PASS"
    checks = [json.loads(line) for line in (run_dir / "checks.jsonl").read_text().splitlines()]
    assert len(checks) == 3 and all(c["ok"] for c in checks)
    assert (run_dir / "requests.jsonl").is_file() and (run_dir / "gates.jsonl").is_file()


def test_lossless_fails_on_a_faulty_candidate(tiny_pair):
    res, out = _run([*_engines(tiny_pair, "wrong_bonus"), "--num-prompts", "2",
                     "--max-tokens", "16", "--no-record", "--json"])
    assert res.exit_code == 1 and out["verdict"] == "FAIL"
    bad = [p for p in out["gates"][0]["prompts"] if not p["ok"]]
    assert bad and bad[0]["divergences"][-1]["judgement"]["kind"] in ("regret", "outside_topk")


def test_not_speculating_is_not_a_pass(tiny_pair):
    t, _ = tiny_pair
    res, out = _run(["--baseline", f"local:{t},spec=off", "--candidate", f"local:{t},spec=off",
                     "--num-prompts", "1", "--max-tokens", "8", "--no-record", "--json"])
    assert res.exit_code == 1 and out["verdict"] == "NOT SPECULATING"


@pytest.mark.parametrize("args, msg", [
    (["--dataset", "nope"], "--dataset"),
    (["--candidate", "local:/does/not/exist"], "does not exist"),
    (["--baseline", "local"], "--candidate"),
    (["--candidate", "openai:http://127.0.0.1:9"], "--baseline"),
    (["--max-tokens", "0"], "max-tokens"),
])
def test_bad_input_exits_2(args, msg):
    res = runner.invoke(cli.app, ["lossless", "--no-record", *args])
    assert res.exit_code == 2 and msg in res.output


# ---- checks -----------------------------------------------------------------------------------------


def test_counter_invariants():
    ok = AcceptanceEvidence("counters", num_drafts=10, num_draft_tokens=28, num_accepted_tokens=12, accepted_per_pos=[6, 4, 2])
    assert check_counters(ok, k=3).ok  # 28 <= 3 x 10: truncated spans near max_tokens draft fewer
    assert not check_counters(AcceptanceEvidence("counters", 10, 30, 12, [6, 4, 3]), k=3).ok  # sum != accepted
    assert not check_counters(AcceptanceEvidence("counters", 10, 30, 12, [4, 6, 2]), k=3).ok  # increasing
    assert not check_counters(AcceptanceEvidence("counters", 10, 31, 12, [6, 4, 2]), k=3).ok  # > K x drafts
    assert check_counters(AcceptanceEvidence("none"), 3).skipped


def test_speculation_alarm_and_acceptance():
    assert AcceptanceEvidence("counters", 0, 0, 0).describe().startswith("NOT SPECULATING: zero drafts")
    st = AcceptanceEvidence("counters", 100, 400, 2, [2])
    assert st.speculating is False and "NOT SPECULATING" in st.describe()
    assert AcceptanceEvidence("counters", 100, 400, 200, [100, 60, 40]).speculating
    assert AcceptanceEvidence("none").speculating is None
    good = AcceptanceEvidence("counters", 100, 400, 200, [100, 60, 40])  # 3.0
    assert check_acceptance(good, 3.1).ok and not check_acceptance(good, 3.5).ok


def test_after_eos_and_kv_leak():
    from specbench.harness.adapters.base import GenResult

    rs = [GenResult("a", True, output_ids=[1, 2, 0]), GenResult("b", True, output_ids=[1, 0, 5, 6])]
    c = check_after_stop(rs, {0})
    assert not c.ok and "2 token(s) after EOS" in c.detail
    assert check_after_stop(rs[:1], {0}).ok
    assert check_kv_idle({"kv_free_pages": 10, "kv_total_pages": 10, "running": 0, "waiting": 0}).ok
    leak = check_kv_idle({"kv_free_pages": 7, "kv_total_pages": 10, "running": 0, "waiting": 0})
    assert not leak.ok and "3 page(s) leaked" in leak.detail
    assert check_kv_idle(None).skipped


def test_spec_stats_prefers_per_request():
    from specbench.harness.adapters.base import GenResult

    rs = [GenResult("a", True, spec={"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
                                     "accepted_per_pos": [2, 1]})]
    st = acceptance_evidence(rs, {"num_drafts": 99, "num_draft_tokens": 99, "num_accepted_tokens": 0})
    assert st.source == "per-request" and st.mean_accept_len == 2.5


def test_staggered_lengths():
    mts = staggered(64, 6)
    assert mts[0] == 64 and min(mts) <= 4 and all(2 <= m <= 64 for m in mts) and len(set(mts)) == 6


# ---- the default gate set: every gate, --quick the greedy gate alone ----------------------------------------


def _gate(name: str, status: str = "identical", missing: str | None = None):
    from specbench.suites.lossless.outcomes import GateRun, PromptCheck
    pc = PromptCheck(f"{name}-0", 8, 8, status=status, tokens_compared=8, missing=missing)
    return GateRun(name, [pc], AcceptanceEvidence("counters", 10, 30, 20, [8, 6, 6]), require_spec=False)


def test_a_gate_on_by_default_that_cannot_test_is_reported_not_deciding():
    from specbench.suites.lossless.suite import LosslessOutcome
    gates = [_gate("greedy"), _gate("min-tokens", "untestable", "min_tokens (the endpoint ignores it)")]
    asked = LosslessOutcome(list(gates), {}, {})  # --engine-gates named: its CANNOT TEST decides
    assert asked.verdict == "CANNOT TEST" and asked.missing == ["min-tokens: min_tokens (the endpoint ignores it)"]
    default = LosslessOutcome(list(gates), {}, {}, advisory=("min-tokens",))
    assert default.verdict == "PASS" and default.exit_code == 0 and default.missing == []
    assert default.not_tested == ["min-tokens: min_tokens (the endpoint ignores it)"]
    assert default.summary()["not_tested"] == default.not_tested
    assert any("min-tokens" in x and "not deciding" in x for x in default.checks_not_run())
    # a FAIL decides whether the gate was asked for or not; the first gate is never advisory
    assert LosslessOutcome([_gate("greedy"), _gate("min-tokens", "fail")], {}, {},
                           advisory=("min-tokens",)).verdict == "FAIL"
    assert LosslessOutcome([_gate("concurrent", "untestable", "x")], {}, {},
                           advisory=("concurrent",)).verdict == "CANNOT TEST"


@pytest.mark.parametrize("fault, gates", [
    ("emit_past_stop", {"stop-in-run", "eos-in-run"}),  # tokens after a stop token inside an accepted run emitted
    ("stop_string_at_run_end", {"stop-in-run"}),  # a stop string looked for once the run is appended
    ("verify_penalty_history_stale", {"penalties"}),  # a verify row penalized without the drafts before it
    ("decode_row_shift", {"concurrent", "mixed", "abort-in-flight", "logit-bias", "penalties", "min-tokens",
                          "near-ties"}),  # near-ties: every prompt at once on the oracle engine (decode rows beside verify rows)
    ("long_context_pos_shift", {"long-context"}),
    ("ignore_eos_in_run", {"eos-in-run"}),  # ignore_eos honoured at a run's end only: EOS inside a run stops it  # verify positions one late past 512: no data set prompt is that long
])
def test_default_run_catches_bugs_that_the_greedy_gate_alone_misses(tiny_pair, fault, gates):
    """Each fault leaves every greedy output of the gsm8k prompts, sent one at a time with the default sampling
    parameters, right: the default run (every gate) fails it, --quick (the greedy gate alone) cannot see it."""
    args = [*_engines(tiny_pair, fault), "--num-prompts", "4", "--max-tokens", "48",
            "--no-record", "--json", "--no-check-draft"]
    res, out = _run(args)
    assert res.exit_code == 1 and out["verdict"] == "FAIL", res.output
    failed = {g["name"] for g in out["gates"] if g["verdict"] == "FAIL"}
    assert failed and failed <= gates, failed
    assert {g["name"] for g in out["gates"]} >= {"greedy", "concurrent", "mixed", "penalties", "headroom"}
    res, out = _run([*args, "--quick"])
    assert res.exit_code == 0 and [g["name"] for g in out["gates"]] == ["greedy"], res.output


def test_quick_with_a_named_gate(tiny_pair):
    res, out = _run([*_engines(tiny_pair), "--num-prompts", "2", "--max-tokens", "8",
                     "--no-record", "--json", "--no-check-draft", "--quick", "--concurrent"])
    assert res.exit_code == 0 and [g["name"] for g in out["gates"]] == ["greedy", "concurrent"], res.output
    assert out["config"]["advisory"] == []  # named: its CANNOT TEST would decide the verdict


def test_long_prompt_is_whole_pieces_then_the_tail():
    from specbench.suites.lossless.gates.long_context import long_prompt
    pieces, tail = [[1] * 100, [2] * 150], [9] * 40
    ids = long_prompt(pieces, tail, 700)
    assert ids[-40:] == tail and len(ids) <= 700 and len(ids) > 700 - 150 - 40
    assert ids[:250] == [1] * 100 + [2] * 150  # the pieces whole, cycled
    assert long_prompt(pieces, tail, 100) == tail  # no piece fits: the tail alone
    assert long_prompt([], tail, 100) == tail * 2  # one prompt: the echo itself is the filler
