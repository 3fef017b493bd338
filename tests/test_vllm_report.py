"""reports/h200-vllm/<date>/h200-vllm.json is rebuilt from the raw files committed beside it
(scripts/vllm_report.py): no figure in it was typed in by hand."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("vllm_report", ROOT / "scripts" / "vllm_report.py")
vllm_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_report)  # type: ignore[union-attr]

RUN = ROOT / "reports" / "h200-vllm" / "2026-12-02"


def test_the_committed_report_is_rebuilt_from_its_raw_files(tmp_path: Path) -> None:
    run = tmp_path / "vllm"
    run.mkdir()
    for p in (RUN / "raw").glob("*.json"):
        shutil.copy(p, run / p.name)
    for name in ("summary-all.json", "client-compare.json"):
        shutil.copy(RUN / name, run / name)
    shutil.copy(RUN / "sweep" / "sweep-summary.json", run / "sweep-summary.json")
    built = json.loads(json.dumps(vllm_report.build(run, None), default=str))
    committed = json.loads((RUN / "h200-vllm.json").read_text())
    assert built == committed


def test_a_gate_verdict_and_a_ratio_come_through(tmp_path: Path) -> None:
    doc = json.loads((RUN / "h200-vllm.json").read_text())
    assert doc["verdicts"]["lossless-tiny-ngram"]["verdict"] == "PASS"
    assert doc["verdicts"]["lossless-tiny-ngram"]["mean_accept_len"] > 1.5  # speculation really happened
    c8 = next(L for L in doc["sweep"]["levels"] if L["concurrency"] == 8)
    r = c8["ratio sb-4b-off/vllm-4b-off"]
    assert r["min"] <= r["median"] <= r["max"] and len(r["per_round"]) == 3
