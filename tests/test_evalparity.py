"""`specbench eval`: the offline task, the parity rule, the report, the CLI's arms and exits, and one
end-to-end run of lm-eval gsm8k (--limit 10) on the tiny pair through two `specbench serve` processes."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specbench import env
from specbench.harness.engines import parse_engine
from specbench.suites.evalparity import parity, report, tasks
from specbench.suites.evalparity.endpoint import EndpointError, normalize_root, serve_argv
from specbench.suites.evalparity.worker import summarize

HAVE_LM_EVAL = all(importlib.util.find_spec(m) for m in ("lm_eval", "datasets", "tenacity"))


# ---- the offline task -----------------------------------------------------------------------------
def test_render_gsm8k_absolute_and_offline(tmp_path: Path) -> None:
    out = tasks.render_tasks(["gsm8k"], tmp_path)
    cfg = yaml.safe_load((out / "gsm8k.yaml").read_text())
    files = cfg["dataset_kwargs"]["data_files"]
    assert set(files) == {"train", "test"}
    for p in files.values():
        assert Path(p).is_absolute() and Path(p).is_file()
    assert cfg["dataset_path"] == "json" and cfg["dataset_name"] is None
    assert [f["name"] for f in cfg["filter_list"]] == ["strict-match", "flexible-extract"]


@pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval not installed")
def test_task_copies_lm_evals_gsm8k() -> None:
    """Everything but the dataset source equals lm-eval's own gsm8k task."""
    import lm_eval

    theirs = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    ours = yaml.safe_load((tasks.TASK_DIR / "gsm8k.yaml").read_text())
    for key in ("dataset_path", "dataset_name", "dataset_kwargs"):
        theirs.pop(key, None)
        ours.pop(key, None)
    assert ours == theirs


def test_unknown_task_is_refused(tmp_path: Path) -> None:
    with pytest.raises(tasks.TaskError, match="gsm8k"):
        tasks.render_tasks(["mmlu"], tmp_path)


# ---- the parity rule ------------------------------------------------------------------------------
def _arm(answers: dict[int, str], target: str = "#### 7", value: float | None = None,
         stderr: float | None = None) -> dict:
    samples = []
    for filt in ("strict-match", "flexible-extract"):
        for i, a in answers.items():
            samples.append({"doc_id": i, "filter": filt, "target": f"work\n{target}", "raw": f"... #### {a}",
                            "extracted": a, "scores": {"exact_match": float(a == target[5:])}, "prompt_hash": str(i)})
    filters = {f: {"exact_match": {"value": value, "stderr": stderr}} for f in ("strict-match", "flexible-extract")}
    return {"version": 3.0, "n": len(answers), "filters": filters, "samples": samples}


def test_identical_arms_are_parity_with_no_differences() -> None:
    a = _arm({0: "7", 1: "3", 2: "7"})
    rows = parity.compare({"gsm8k": a}, {"gsm8k": a})
    assert [r.filter for r in rows] == ["strict-match", "flexible-extract"]
    for r in rows:
        assert r.verdict == parity.PARITY and r.differ == [] and r.raw_differ == 0 and r.n == 3
        assert r.baseline.value == pytest.approx(2 / 3)  # recomputed where lm-eval gave none
        assert r.baseline.stderr == pytest.approx(parity.mean_stderr([1.0, 0.0, 1.0]))


def test_difference_within_stderr_is_parity_but_listed() -> None:
    b = _arm({0: "7", 1: "3", 2: "7", 3: "1"}, value=0.5, stderr=0.29)
    c = _arm({0: "7", 1: "7", 2: "7", 3: "1"}, value=0.75, stderr=0.25)
    row = parity.compare({"gsm8k": b}, {"gsm8k": c})[0]
    assert row.delta == pytest.approx(0.25)
    assert row.combined_stderr == pytest.approx((0.29 ** 2 + 0.25 ** 2) ** 0.5)
    assert row.verdict == parity.PARITY and row.differ_ids == [1]
    d = row.differ[0]
    assert (d.baseline, d.candidate, d.target, d.baseline_score, d.candidate_score) == ("3", "7", "7", 0.0, 1.0)


def test_difference_beyond_stderr_is_different() -> None:
    b = _arm({i: "1" for i in range(20)}, value=0.0, stderr=0.0)
    c = _arm({i: "7" for i in range(20)}, value=1.0, stderr=0.0)
    rows = parity.compare({"gsm8k": b}, {"gsm8k": c})
    assert parity.overall(rows) == parity.DIFFERENT
    assert len(rows[0].differ) == 20 and rows[0].paired_stderr == 0.0


def test_missing_document_counts_as_differing() -> None:
    rows = parity.compare({"gsm8k": _arm({0: "7", 1: "7"})}, {"gsm8k": _arm({0: "7"})})
    assert rows[0].differ_ids == [1] and rows[0].differ[0].candidate is None


def test_prompt_truncated_to_different_budgets_is_flagged() -> None:
    from specbench.suites.evalparity.runner import prompt_mismatches

    def arm(lens: list[int]) -> dict:
        return {"tasks": {"gsm8k": {"samples": [{"doc_id": i, "prompt_hash": str(i), "prompt_tokens": n}
                                                for i, n in enumerate(lens)]}}}

    infos = [report.ArmInfo(role, role, "", "", "", "remote", ml, 1.0, "", "")
             for role, ml in (("baseline", 512), ("candidate", 506))]
    # budget = max_length - 1 - 256: 255 vs 249 tokens; only a prompt longer than 249 differs
    results = {"baseline": arm([100, 249, 250, 400]), "candidate": arm([100, 249, 250, 400])}
    assert prompt_mismatches(results, infos, {"gsm8k": 256}) == {"gsm8k": [2, 3]}
    infos[1].max_length = 512
    assert prompt_mismatches(results, infos, {"gsm8k": 256}) == {}


def test_summarize_lm_eval_results() -> None:
    res = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.1,
                                 "exact_match_stderr,strict-match": 0.05,
                                 "exact_match,flexible-extract": 0.2, "exact_match_stderr,flexible-extract": "N/A"}},
           "versions": {"gsm8k": 3.0}, "n-samples": {"gsm8k": {"original": 1319, "effective": 2}},
           "n-shot": {"gsm8k": 5},
           "samples": {"gsm8k": [{"doc_id": 0, "filter": "strict-match", "target": "#### 1", "resps": [["x #### 1"]],
                                  "filtered_resps": ["1"], "metrics": ["exact_match"], "exact_match": 1.0,
                                  "doc": {"question": "q"}, "prompt_hash": "h"}]}}
    out = summarize(res, ["gsm8k"])["gsm8k"]
    assert out["filters"]["strict-match"]["exact_match"] == {"value": 0.1, "stderr": 0.05}
    assert out["filters"]["flexible-extract"]["exact_match"]["stderr"] is None
    assert out["samples"][0]["raw"] == "x #### 1" and out["samples"][0]["extracted"] == "1"
    assert (out["n"], out["n_shot"], out["version"]) == (2, 5, 3.0)


def test_report_markdown_and_json() -> None:
    rows = parity.compare({"gsm8k": _arm({0: "7", 1: "3"})}, {"gsm8k": _arm({0: "7", 1: "5|x"})})
    arm = report.ArmInfo("baseline", "b", "local", "m", "http://127.0.0.1:1", "remote", 2048, 1.5, "0.4.13", "model=m")
    run = report.ParityRun(["gsm8k"], 5, 2, 4, rows, [arm], run_id="r1")
    md = report.render_markdown(run)
    assert "| gsm8k | strict-match | exact_match | 2 |" in md and "**PARITY**" in md
    assert "5\\|x" in md and "sqrt(se_baseline^2 + se_candidate^2)" in md
    doc = json.loads(json.dumps(report.to_json(run)))
    assert doc["verdict"] == "PARITY" and doc["rows"][0]["differ_ids"] == [1] and doc["rows"][0]["n_differ"] == 1


# ---- endpoints and arms ---------------------------------------------------------------------------
def test_serve_argv_and_roots(tmp_path: Path) -> None:
    spec = parse_engine(f"local:{tmp_path},spec=off,dtype=bfloat16,name=x")
    argv = serve_argv(spec, "127.0.0.1", 1234)
    assert argv[1:4] == ["-m", "specbench", "serve"]
    assert argv[argv.index("--model") + 1] == str(tmp_path) and argv[argv.index("--spec") + 1] == "off"
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "x" not in argv
    with pytest.raises(EndpointError, match="faults"):
        serve_argv(parse_engine(f"local:{tmp_path},faults=kv_offset"), "127.0.0.1", 1)
    assert normalize_root("http://h:1/v1/") == normalize_root("http://h:1/v1/completions") == "http://h:1"


def test_cli_arms(tmp_path: Path) -> None:
    from specbench.harness.engines import EngineStringError, baseline_and_candidate

    base, cand = baseline_and_candidate(None, f"local:{tmp_path},draft={tmp_path},spec=dflash")
    assert base.options == {"spec": "off", "name": "baseline"} and base.target == str(tmp_path)
    assert parse_engine(base.raw).options == {"spec": "off"}
    with pytest.raises(EngineStringError, match="--baseline"):
        baseline_and_candidate(None, "openai:http://127.0.0.1:9/v1")
    with pytest.raises(EngineStringError, match="--candidate"):
        baseline_and_candidate("openai:http://127.0.0.1:9/v1", None)


def _cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specbench", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_missing_lm_eval_exits_2() -> None:
    """With lm-eval not found the command says how to install it and exits 2."""
    code = ("import importlib.util, sys; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'lm_eval' else real(n, *a)\n"
            "from specbench.cli.app import main; sys.argv = ['specbench', 'eval', '--limit', '1']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'specbench[eval]'" in r.stderr


def test_bad_task_exits_2() -> None:
    if not HAVE_LM_EVAL:
        pytest.skip("lm-eval not installed")
    r = _cli("eval", "--task", "nope", "--limit", "1", timeout=120)
    assert r.returncode == 2 and "nope" in r.stderr


# ---- end to end -----------------------------------------------------------------------------------
def _closed(root: str) -> bool:
    host, port = root.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) != 0


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval not installed")
def test_eval_gsm8k_limit10_end_to_end(tmp_path: Path, tiny_target: str, tiny_draft: str) -> None:
    shots = str(env.get("SPECBENCH_TEST_EVAL_SHOTS"))  # 0 for a 512-context dev pair
    r = _cli("eval", "--task", "gsm8k", "--limit", "10", "--num-fewshot", shots, "--concurrency", "4",
             "--baseline", f"local:{tiny_target},spec=off",
             "--candidate", f"local:{tiny_target},draft={tiny_draft},spec=dflash",
             "--results", str(tmp_path), "--report", str(tmp_path / "eval.md"), "--json",
             env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert r.returncode in (0, 1), r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert (r.returncode == 0) == (doc["verdict"] == "PARITY")
    rows = {(x["task"], x["filter"]): x for x in doc["rows"]}
    assert set(rows) == {("gsm8k", "strict-match"), ("gsm8k", "flexible-extract")}
    for x in rows.values():
        assert x["n"] == 10 and x["metric"] == "exact_match"
        assert 0.0 <= x["baseline"]["value"] <= 1.0 and 0.0 <= x["candidate"]["value"] <= 1.0
        assert x["n_differ"] == len(x["differ_ids"]) <= 10
    # greedy fp32 spec decoding is lossless on the tiny pair: the same prompts, answers and generations
    assert doc["prompt_mismatch"] == {}
    assert doc["verdict"] == "PARITY" and all(x["n_differ"] == 0 and x["raw_differ"] == 0 for x in rows.values())
    assert [a["role"] for a in doc["arms"]] == ["baseline", "candidate"]
    for a in doc["arms"]:
        assert a["wall_s"] > 0 and _closed(a["endpoint"])  # the servers were stopped
    assert doc["arms"][1]["extra"]["spec"]["num_drafts"] > 0  # the candidate really speculated
    run_dir = Path(doc["samples_path"]).parent
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["suite"] == "evalparity" and meta["status"] == "complete"
    samples = [json.loads(line) for line in Path(doc["samples_path"]).read_text().splitlines()]
    assert len(samples) == 2 * 10 * 2  # arms x docs x filters
    assert {s["arm"] for s in samples} == {"baseline", "candidate"} and all("raw" in s for s in samples)
    assert "| gsm8k | strict-match | exact_match | 10 |" in (tmp_path / "eval.md").read_text()
