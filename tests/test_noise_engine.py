"""`specbench lossless --suite noise` on the bundled tiny pair with the emulated TP-2 engine (tp_emulate=2).

- fp32, no engine given: the bundled pair at emulated TP 2 against TP 1, a clean candidate PASSes; the records
  (noise, checks, gates, the summary in run.json) and the markdown report are written; `specbench report RUN`
  renders the run;
- bf16 (real reduction-order noise on the CPU): a clean candidate PASSes; a self-test fault under the emulated TP
  noise still FAILs (verify_pos_shift, by the regret rule);
- batch noise through --noise-concurrency;
- bad input is one line, exit 2.
tests/test_noise.py has the statistics and the crafted-noise cases on fake engines.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from specbench.cli import app as cli

cli._register()
runner = CliRunner()
BF16 = "local,spec=dflash,dtype=bfloat16,tp_emulate=2"


def _noise(*args: str) -> tuple[int, dict]:
    res = runner.invoke(cli.app, ["lossless", "--suite", "noise", "--json", *args])
    lines = res.stdout.strip().splitlines()
    assert lines, res.output
    return res.exit_code, json.loads(lines[-1])


def test_clean_emulated_tp2_passes_with_records_and_report(tmp_path):
    code, out = _noise("--num-prompts", "3", "--max-tokens", "24", "--results", str(tmp_path / "res"),
                       "--report", str(tmp_path / "noise.md"))
    assert code == 0 and out["verdict"] == "PASS", out["reasons"]
    cfg = {arm: out["engines"][arm]["config"] for arm in ("reference", "baseline", "candidate")}
    assert [cfg[a]["tp_emulate"] for a in ("reference", "baseline", "candidate")] == [1, 2, 2]
    assert cfg["reference"]["spec"] is None and cfg["baseline"]["spec"] is None and cfg["candidate"]["spec"] == "dflash"
    assert out["rule"]["mode"] == "strict" and out["noise_rate"]["exposure"] > 0 and out["test_rate"]["exposure"] > 0
    (run_dir,) = [p for p in (tmp_path / "res").iterdir() if p.name.startswith("lossless-noise-")]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["suite"] == "lossless-noise" and run["status"] == "complete" and run["summary"]["verdict"] == "PASS"
    counts = {k: len((run_dir / f"{k}.jsonl").read_text().splitlines()) for k in ("noise", "checks", "gates")}
    assert counts == {"noise": 3, "checks": 3, "gates": 2}
    md = (tmp_path / "noise.md").read_text()
    assert md.startswith("# Noise baseline: PASS") and "tp_emulate=2" in md and "## At which margins" in md
    rep = runner.invoke(cli.app, ["report", str(run_dir), "--out", str(tmp_path / "again.md")])
    assert rep.exit_code == 0, rep.output
    assert "Noise baseline: PASS" in (tmp_path / "again.md").read_text()


def test_bf16_clean_passes_and_a_fault_under_tp_noise_fails():
    code, out = _noise("--candidate", BF16, "--num-prompts", "4", "--max-tokens", "32", "--no-record")
    assert code == 0 and out["verdict"] == "PASS", out["reasons"]
    assert out["rule"]["mode"] == "margin" and out["engines"]["baseline"]["config"]["dtype"] == "bfloat16"
    code, out = _noise("--candidate", BF16 + ",faults=verify_pos_shift", "--num-prompts", "4", "--max-tokens", "32",
                       "--no-record")
    assert code == 1 and out["verdict"] == "FAIL" and out["test"]["verdict"] == "FAIL", out["reasons"]
    assert out["engines"]["candidate"]["config"]["faults"] == ["verify_pos_shift"]
    assert out["engines"]["baseline"]["config"]["faults"] == []


def test_batch_noise_through_noise_concurrency():
    code, out = _noise("--candidate", "local,spec=dflash", "--noise-baseline", "local", "--noise-concurrency", "3",
                       "--num-prompts", "3", "--max-tokens", "16", "--no-record")
    assert code == 0 and out["verdict"] == "PASS", out["reasons"]
    assert out["config"]["noise_concurrency"] == 3
    assert out["engines"]["reference"]["config"]["spec"] is None  # `local` is the bundled pair: made spec-off


def test_bad_input_is_one_line_exit_2():
    for args, needle in ((["--noise-baseline", "local"], "--suite noise"),
                         (["--suite", "noise", "--candidate", "local,spec=dflash"], "--noise-baseline"),
                         (["--suite", "noise", "--endpoint-type", "chat"], "chat"),
                         (["--suite", "noise", "--noise-max-regret", "0"], "--noise-max-regret"),
                         (["--suite", "noise", "--candidate", "local,spec=dflash,tp_emulate=3"], "num_attention_heads")):
        res = runner.invoke(cli.app, ["lossless", *args])
        assert res.exit_code == 2 and needle in res.output, (args, res.output)
        assert len(res.output.strip().splitlines()) == 1, res.output
