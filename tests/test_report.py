"""Report rendering from synthetic sweep records with known answers: tables, speedups, the noise floor,
per-position acceptance, PNGs, several runs compared, and the `report` command."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.suites.report import render_markdown, summarize, write_report

# output tok/s per (arm, level, round): B is 1.5x A in every round; A#2 is A within +-2%
TOK_S = {
    ("A", 1): [100.0, 100.0, 100.0], ("B", 1): [150.0, 140.0, 160.0], ("A#2", 1): [101.0, 98.0, 102.0],
    ("A", 8): [400.0, 400.0, 400.0], ("B", 8): [404.0, 404.0, 404.0], ("A#2", 8): [396.0, 404.0, 410.0],
}
TOKENS = 20  # per request; 2 requests per cell


def cell_records(arm: str, level: int, rnd: int, tok_s: float, spec: bool) -> list[dict]:
    duration = 2 * TOKENS / tok_s
    out = [{"kind": "cell", "arm": arm, "level": level, "level_kind": "concurrency", "round": rnd, "warmup": False,
            "copy_of": "A" if arm == "A#2" else None, "duration": duration, "requests": 2, "completed": 2,
            "counters": None}]
    for i in range(2):
        chunks = [0.01 * (j + 1) for j in range(5)]
        sp = {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 15 if i == 0 else 5,
              "accepted_per_pos": [5, 5, 5, 0] if i == 0 else [3, 1, 1, 0]} if spec else None
        out.append({"kind": "request", "arm": arm, "round": rnd, "ok": True, "prompt_tokens": 7,
                    "completion_tokens": TOKENS, "wall_send": 0.0, "ttft": 0.01, "e2el": 0.05,
                    "chunk_offsets": chunks, "chunk_tokens": [4] * 5, "spec": sp,
                    "meta": {"level": level, "level_kind": "concurrency", "warmup": False}})
    return out


def records(levels: tuple[int, ...] = (1, 8), arms: tuple[str, ...] = ("A", "B", "A#2")) -> list[dict]:
    meta = {"kind": "sweep", "config": {"levels": list(levels), "rounds": 3, "dataset": "gsm8k", "max_tokens": 20,
                                        "warmup": 1, "seed": 0, "temperature": 0.0},
            "baseline": "A", "workload": {"dataset": "gsm8k", "kept": 2},
            "arms": [{"label": a, "engine": f"local:{a}", "copy_of": "A" if a == "A#2" else None,
                      "description": {"model": "m", "config": {"spec": "dflash" if a == "B" else None}}} for a in arms]}
    out = [meta]
    for lv in levels:
        for r in range(3):
            for a in arms:
                out += cell_records(a, lv, r, TOK_S[(a, lv)][r], spec=a == "B")
    return out


def test_summary_numbers() -> None:
    s = summarize(records(), run_id="r1")
    assert s.complete and s.baseline == "A" and s.noise_arm == "A#2" and s.compared_arms == ["A", "B"]
    assert s.get("B", 1).tok_s_median == pytest.approx(150.0)
    assert s.speedups[("B", 1)]["median"] == pytest.approx(1.5)
    assert s.speedups[("B", 1)]["min"] == pytest.approx(1.4)
    assert s.noise[1]["noise"] == pytest.approx(0.02) and s.noise[1]["median_ratio"] == pytest.approx(1.01)
    assert s.speedups[("B", 8)]["median"] == pytest.approx(1.01)
    acc = s.get("B", 1).acceptance
    assert acc["source"] == "request" and acc["length"] == pytest.approx(1 + 60 / 30)
    assert acc["length_request_mean"] == pytest.approx((4.0 + 2.0) / 2)
    assert acc["per_pos"] == pytest.approx([24 / 30, 18 / 30, 18 / 30, 0.0])
    assert s.spec_arms == ["B"]


def test_markdown_tables() -> None:
    md = render_markdown([summarize(records(), run_id="r1")])
    lines = md.splitlines()
    assert lines[0] == "# specbench sweep report"
    head = next(ln for ln in lines if ln.startswith("| concurrency | A tok/s"))
    assert head == ("| concurrency | A tok/s | B tok/s | B vs A | noise floor | A req/s | B req/s |")
    c1 = next(ln for ln in lines if ln.startswith("| c1 | 100.0 | 150.0"))
    assert "| 1.50× [1.40–1.60] |" in c1 and "±2.0% (A'/A 1.010)" in c1
    c8 = next(ln for ln in lines if ln.startswith("| c8 | 400.0 | 404.0"))
    assert "~1.01×" in c8  # within the noise floor: marked unresolved
    assert "#### TPOT (ms: mean / median / p90 / p99)" in md
    tpot = lines[lines.index("#### TPOT (ms: mean / median / p90 / p99)") + 4]
    assert tpot.startswith("| c1 | 2.1 / 2.1 / 2.1 / 2.1 |")  # (0.05 - 0.01) / 19 s
    assert "| c1 | 50.0% | 3.000 | 3.000 | per-request |" in md
    assert "#### Per-position acceptance: `B`" in md and "| c1 | 80.0% | 60.0% | 60.0% | 0.0% |" in md
    assert "| c1 | `A#2` | 3 | 6 | 0 | 42 | 120 | 101.0 98.0 102.0 |" in md
    assert "INCOMPLETE" not in md
    assert md == render_markdown([summarize(records(), run_id="r1")])  # a pure function of the records


def test_incomplete_run_is_flagged_and_still_renders() -> None:
    recs = records()
    cut = [r for r in recs if not (r.get("kind") == "cell" and r["level"] == 8 and r["round"] == 2)]
    s = summarize(cut, run_id="r1", run_meta={"incomplete": True})
    assert not s.complete and s.noise[8]["rounds"] == 2
    assert "INCOMPLETE" in render_markdown([s])


def test_pngs_and_several_runs(tmp_path: Path) -> None:
    r1 = summarize(records(), run_id="r1")
    r2 = summarize(records(levels=(1,)), run_id="r2")
    paths = write_report([r1, r2], tmp_path / "cmp.md")
    assert paths[0] == tmp_path / "cmp.md"
    names = sorted(p.name for p in paths[1:])
    assert names == ["cmp-acceptance.png", "cmp-speedup.png", "cmp-tok_s.png", "cmp-tpot.png"]
    for p in paths[1:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    md = paths[0].read_text()
    assert md.startswith("# specbench sweep report: 2 runs")
    assert "## Runs compared" in md and "| concurrency | r1/A tok/s | r1/B tok/s | r2/A tok/s | r2/B tok/s |" in md
    assert "| c8 | 400.0 | 404.0 | — | — | — | — |" in md
    assert "![tok/s vs load](cmp-tok_s.png)" in md and md.count("## Run `") == 2


def test_report_command(tmp_path: Path) -> None:
    from specbench.harness.results import open_run

    recs = records()
    with open_run("sweep", results=tmp_path, run_id="run1") as run:
        for r in recs:
            kind = {"sweep": "sweep", "request": "requests", "cell": "cells"}[r["kind"]]
            run.write(kind, {k: v for k, v in r.items() if k != "kind"})
    _register()
    cli = CliRunner()
    res = cli.invoke(app, ["report", str(tmp_path / "run1"), "--out", str(tmp_path / "rep" / "x.md")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "x.md").is_file() and (tmp_path / "rep" / "x-speedup.png").is_file()
    res = cli.invoke(app, ["report", str(tmp_path / "run1"), "--out", "-"])
    assert res.exit_code == 0 and "| c1 | 100.0 | 150.0 | 1.50× [1.40–1.60] |" in res.output
    bad = cli.invoke(app, ["report", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "nope" in bad.output
    with open_run("mystery", results=tmp_path, run_id="other"):  # every suite's runs render (test_report_kinds.py)
        pass
    bad = cli.invoke(app, ["report", str(tmp_path / "other")])
    assert bad.exit_code == 2 and "sweep" in bad.output


def test_lockstep_baseline_is_flagged() -> None:
    """At c8 the baseline's 16 requests end in two engine steps (lockstep waves), B's end apart: the report says
    the speedup there measures the lockstep as much as B. With the baseline's ends spread, no note."""

    def lvl_records(ends_a: list[float], ends_b: list[float]) -> list[dict]:
        meta = {"kind": "sweep", "config": {"levels": [8], "rounds": 1, "dataset": "gsm8k", "max_tokens": 20},
                "baseline": "A", "workload": {"dataset": "gsm8k", "kept": 16},
                "arms": [{"label": a, "engine": f"local:{a}", "copy_of": None} for a in ("A", "B")]}
        out: list[dict] = [meta]
        for arm, ends in (("A", ends_a), ("B", ends_b)):
            out.append({"kind": "cell", "arm": arm, "level": 8, "level_kind": "concurrency", "round": 0,
                        "warmup": False, "copy_of": None, "duration": 1.0, "requests": 16, "completed": 16,
                        "counters": None})
            out += [{"kind": "request", "arm": arm, "round": 0, "ok": True, "prompt_tokens": 7,
                     "completion_tokens": TOKENS, "wall_send": 0.0, "ttft": 0.01, "e2el": e, "tpot": 0.004,
                     "chunk_offsets": [0.01], "chunk_tokens": [TOKENS], "spec": None,
                     "meta": {"level": 8, "level_kind": "concurrency", "warmup": False}} for e in ends]
        return out

    lock = [0.5] * 8 + [1.0] * 8
    apart = [0.3 + 0.01 * i for i in range(16)]
    s = summarize(lvl_records(lock, apart), run_id="r")
    assert s.get("A", 8).finish_groups == pytest.approx(2 / 16) and s.get("B", 8).finish_groups == pytest.approx(1.0)
    md = render_markdown([s])
    assert "**Lockstep:**" in md and "c8 `B` 1.00 vs `A` 0.12" in md
    assert "**Lockstep:**" not in render_markdown([summarize(lvl_records(apart, apart), run_id="r")])
