"""The results store: records flushed as they are written, run status on success / error / interrupt
(in process and by a real SIGINT / SIGTERM to a subprocess), torn lines, stale runs, pandas readers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specbench.harness.adapters import GenResult
from specbench.harness.results import RequestRecord, list_runs, load_stored_run, open_run, read_jsonl


def _result(i: int) -> GenResult:
    return GenResult(rid=f"r{i}", ok=True, text=f"text {i}", output_ids=[1, 2, 3], finish_reason="length",
                     prompt_tokens=5, completion_tokens=3, t_send=10.0, t_first=10.1, t_end=10.3,
                     chunk_times=[10.1, 10.2, 10.3], chunk_tokens=[1, 1, 1],
                     spec={"num_drafts": 2, "num_accepted_tokens": 1, "mean_accept_len": 1.5})


def test_complete_run_and_readers(tmp_path):
    with open_run("unit", "2", engines={"baseline": {"name": "x"}}, sampling={"temperature": 0},
                  dataset={"name": "gsm8k", "n": 3}, seeds=[0], results=tmp_path) as run:
        for i in range(3):
            run.add_result(_result(i), arm="baseline", idx=i, item_id=f"q{i}")
            # Flushed per record: a reader sees it before the run ends.
            assert len(read_jsonl(run.path / "requests.jsonl")) == i + 1
        run.write("samples", {"id": "q0", "answer": "42"})
        run.update(summary={"ok": 3})
    lr = load_stored_run(run.run_id, results=tmp_path)
    assert lr.status == "complete" and lr.meta["suite_version"] == "2" and lr.meta["summary"] == {"ok": 3}
    prov = lr.meta["provenance"]
    assert prov["git"]["sha"] and "torch" in prov["packages"] and prov["device"]["cpu_count"] >= 1
    df = lr.requests
    assert list(df["item_id"]) == ["q0", "q1", "q2"] and list(df["ttft"]) == pytest.approx([0.1] * 3)
    assert "spec.mean_accept_len" in df.columns and lr.kinds() == ["requests", "samples"]
    assert df["chunk_offsets"][0] == pytest.approx([0.1, 0.2, 0.3])
    runs = list_runs(tmp_path)
    assert list(runs["run_id"]) == [run.run_id] and runs["requests"][0] == 3


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_run_keeps_records(tmp_path, exc):
    with pytest.raises(exc), open_run("unit", results=tmp_path) as run:
        run.add_request(RequestRecord(run_id=run.run_id, arm="a", idx=0, rid="r0", ok=True))
        raise exc("stop here")
    lr = load_stored_run(run.path)
    assert lr.status == "incomplete" and "stop here" in lr.meta["error"] and lr.meta["ended"]
    assert len(lr.requests) == 1 and lr.meta["provenance"]["counts"] == {"requests": 1}


def test_env_override_torn_line_and_stale_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_RESULTS", str(tmp_path))
    with open_run("unit") as run:
        run.write("requests", {"idx": 0})
    with open(run.path / "requests.jsonl", "a") as fh:
        fh.write('{"idx": 1, "trunc')  # a writer killed mid-line
    assert [r["idx"] for r in load_stored_run(run.run_id).records()] == [0]
    dead = tmp_path / "dead-run"
    dead.mkdir()
    meta = json.loads((run.path / "run.json").read_text())
    meta.update(run_id="dead-run", status="running", ended=None)
    meta["provenance"]["pid"] = 2**22 + 12345  # no such process
    (dead / "run.json").write_text(json.dumps(meta))
    st = dict(zip(list_runs()["run_id"], list_runs()["status"], strict=True))
    assert st == {run.run_id: "complete", "dead-run": "incomplete"}


WRITER = """
import sys, time
from specbench.harness.results import open_run
with open_run("sigtest", results=sys.argv[1], run_id="sig") as run:
    i = 0
    while True:
        run.write("requests", {"idx": i})
        if i == 2:
            print("ready", flush=True)
        i += 1
        time.sleep(0.01)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_marks_run_incomplete(tmp_path, sig):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.05)
        p.send_signal(sig)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    lr = load_stored_run(tmp_path / "sig")
    assert lr.status == "incomplete" and "interrupted" in lr.meta["error"]
    idx = [r["idx"] for r in lr.records()]
    assert idx[:3] == [0, 1, 2] and idx == list(range(len(idx)))
