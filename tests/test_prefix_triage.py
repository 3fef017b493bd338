"""benchmarks/prefix_triage.py: the four-arm prefix-cache triage that scripts/vllm_suite.py runs against each server
(it was a program inside a string there; issue 46, point 9)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specbench.benchmarks.prefix_triage import ARMS, triage
from specbench.harness.adapters.base import GenResult, PosLogprobs

ROOT = Path(__file__).resolve().parent.parent


def _res(ids: list[int], top: dict[int, float] | None = None, ok: bool = True) -> GenResult:
    lps = [PosLogprobs(t, 0.0, dict(top or {t: 0.0})) for t in ids]
    return GenResult("r", ok, None if ok else "boom", output_ids=list(ids), logprobs=lps)


def test_a_clean_cache_shows_no_divergence():
    arms = {k: [_res([1, 2, 3]), _res([4, 5])] for k in ARMS}
    doc = triage(arms)
    assert doc["prompts"] == 2 and doc["diverging"] == {"cold_a_vs_cold_b": 0, "fill_vs_hit": 0, "cold_a_vs_fill": 0}
    assert doc["max_regret"] is None and doc["errors"] == []


def test_a_hit_that_diverges_is_the_cache_and_its_regret_is_scored():
    fill = _res([1, 2, 3])
    fill.logprobs[1] = PosLogprobs(2, -0.1, {2: -0.1, 7: -0.4, 9: -3.0})  # at the divergence: 2 best, 7 close
    arms = {"cold_a": [_res([1, 2, 3])], "cold_b": [_res([1, 2, 3])], "fill": [fill], "hit": [_res([1, 7, 8])]}
    doc = triage(arms)
    row = doc["rows"][0]
    assert row["fill_vs_hit"] == 1 and row["cold_a_vs_cold_b"] is None and row["cold_a_vs_fill"] is None
    assert row["regret_hit_pick_under_fill"] == 0.3 and row["fill_top2_margin"] == 0.3
    assert doc["diverging"]["fill_vs_hit"] == 1 and doc["max_regret"] == 0.3
    # a pick outside the reported top-k has no regret to give (unknown, not zero)
    arms["hit"] = [_res([1, 5, 8])]
    assert triage(arms)["rows"][0]["regret_hit_pick_under_fill"] is None


def test_failed_requests_are_named_and_lengths_alone_are_no_divergence():
    arms = {k: [_res([1, 2])] for k in ARMS}
    arms["hit"] = [_res([1, 2, 3])]  # longer, same common prefix
    arms["cold_b"] = [_res([], ok=False)]
    doc = triage(arms)
    assert doc["rows"][0]["fill_vs_hit"] is None and doc["rows"][0]["ok"] is False and doc["errors"] == ["boom"]


def test_stack_versions_runs_as_a_file_without_specbench():
    """scripts/vllm_suite.py runs it by path under vLLM's PYTHONPATH, where specbench may not import."""
    code = (f"import runpy, sys; sys.modules['specbench'] = None; "
            f"runpy.run_path({str(ROOT / 'benchmarks' / 'stack_versions.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["torch"] and "vllm" in d and "flashinfer" in d


def test_vllm_suite_imports_and_holds_no_program_in_a_string():
    """scripts/vllm_suite.py is an importable module whose subprocesses run modules and files, not `python -c` code
    that no linter or type checker reads."""
    import ast
    import importlib.util

    path = ROOT / "scripts" / "vllm_suite.py"
    spec = importlib.util.spec_from_file_location("vllm_suite_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert callable(mod.triage_prefix_cache) and callable(mod.versions)
    inline = [n.lineno for n in ast.walk(ast.parse(path.read_text()))
              if isinstance(n, ast.List) and any(isinstance(e, ast.Constant) and e.value == "-c" for e in n.elts)]
    assert inline == [], f"python -c programs at lines {inline}"
