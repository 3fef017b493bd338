"""`specbench tune` (suites/tune.py): the arms a grid makes, the analysis on a known summary (ratios, noise floor,
crossover, best arm, chosen spans, recommendation), rendering and merging, the ETA, bad options, and one tiny
end-to-end run on CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.suites.tune import PLAIN, analyze, merge, remote_arms, render, tune_arms

cli._register()
runner = CliRunner()


def test_tune_arms_grid_and_each(tiny_pair):
    t, d = tiny_pair
    base = f"local:{t},draft={d},spec=dflash,tau=6.5,device=cpu"
    engines, labels = tune_arms(base, [None], [0, 2], [0, 8], ["off", "auto"])
    assert labels[0] == PLAIN and "spec=off" in engines[0] and "tau" not in engines[0]
    assert len(labels) == 1 + 8 and "spec-trim2-gate8-auto" in labels and "spec" in labels
    assert all("tau=6.5" in e and f"name={lab}" in e for e, lab in zip(engines[1:], labels[1:], strict=True))
    _, each = tune_arms(base, [None, 3], [4, 2], [16], ["off", "auto"], each=True)
    assert each == [PLAIN, "spec", "spec-k3", "spec-trim4", "spec-trim2", "spec-gate16", "spec-auto"]
    _, dropped = tune_arms(base, [3], [0, 4], [0], ["off"])  # trim 4 >= K 3: no such arm
    assert dropped == [PLAIN, "spec-k3"]
    with pytest.raises(ValueError, match="bundled engine"):
        tune_arms("openai:http://127.0.0.1:1")
    e, lab = remote_arms("off=openai:http://a:1/v1;k4=openai:http://b:1/v1,model=m")
    assert lab == ["off", "k4"] and e[1] == "openai:http://b:1/v1,model=m"


def _summary(ratios: dict[str, list[float]], noise: list[float], levels=(1, 8, 32)):
    cells = {("plain", lv): SimpleNamespace(tok_s_median=100.0 * lv) for lv in levels}
    speedups = {}
    for a, rs in ratios.items():
        for lv, r in zip(levels, rs, strict=True):
            cells[(a, lv)] = SimpleNamespace(tok_s_median=100.0 * lv * r)
            speedups[(a, lv)] = {"median": r}
    return SimpleNamespace(baseline="plain", compared_arms=["plain", *ratios], levels=list(levels),
                           noise={lv: {"noise": n} for lv, n in zip(levels, noise, strict=True)},
                           speedups=speedups, get=lambda a, lv: cells.get((a, lv)))


def test_analyze_crossover_best_and_recommendation():
    s = _summary({"spec": [2.4, 1.3, 0.8], "spec-auto": [2.3, 1.35, 1.01], "spec-gate16": [2.4, 1.3, 0.99]},
                 [0.02, 0.02, 0.02])
    recs = [{"kind": "cell", "arm": "spec-auto", "level": 32, "counters": {"span_hist": {"1": 90, "16": 10}}},
            {"kind": "cell", "arm": "spec-auto", "level": 32, "warmup": True, "counters": {"span_hist": {"1": 5}}}]
    res = analyze(s, recs)
    assert res["crossover"] == {"spec": 32, "spec-auto": None, "spec-gate16": None}
    assert [r["best"] for r in res["per_level"]] == ["spec", "spec-auto", "plain"]  # 1.01 is inside the noise
    assert res["per_level"][2]["arms"]["spec-auto"] == {"tok_s": pytest.approx(3232.0), "ratio": 1.01,
                                                        "resolved": False, "spans": {"1": 90, "16": 10},
                                                        "finish_groups": None}
    assert res["recommendation"]["one_setting"] == "spec-auto"
    md = render(res)
    assert "| 32 | 3200.0 | 0.020 | 0.800 | 1.010* | 0.990* | plain |" in md
    assert "spec c32" in md and "| spec-auto | 32 | 1: 90, 16: 10 |" in md and "`spec-auto` never loses" in md
    assert "| 32 | 3200.0 | 2560.0 | 3232.0 | 3168.0 |" in md  # the tok/s table
    none = analyze(_summary({"spec": [2.0, 0.5, 0.5]}, [0.01] * 3), [])
    assert none["recommendation"]["one_setting"] is None and "no single setting" in render(none)


def test_merge_sections(tmp_path):
    res = analyze(_summary({"spec": [2.0, 1.1, 0.9]}, [0.01] * 3), [])
    j, md = merge(tmp_path / "lv" / "levers.json", "tau 6.5", res)
    merge(j, "tau 2.0", res)
    merge(j, "tau 6.5", res)  # replaced, not repeated
    doc = json.loads(j.read_text())
    assert list(doc["sections"]) == ["tau 6.5", "tau 2.0"]
    text = md.read_text()
    assert text.count("## tau 6.5") == 1 and "## tau 2.0" in text


@pytest.mark.parametrize("args,hint", [(["--trim", "x"], "--trim"), (["--gate", "-1"], "--gate"),
                                       (["--policy", "sometimes"], "--policy"), (["-c", "0"], "--concurrency"),
                                       (["--arms", "a=openai:http://x:1", "--k", "3"], "--arms")])
def test_bad_options_exit_2(args, hint):
    r = runner.invoke(cli.app, ["tune", *args])
    assert r.exit_code == 2 and hint in r.output, r.output


def test_tune_end_to_end_on_cpu(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_INVARIANTS", "0")
    t, d = tiny_pair
    r = runner.invoke(cli.app, ["tune", "--base", f"local:{t},draft={d},num_pages=128,max_num_seqs=4", "--gate", "1",
                                "--policy", "off", "--each", "-c", "1,2", "--max-tokens", "6", "--prompts-per-level",
                                "1", "--rounds", "1", "--warmup", "0", "--max-tokens-spread", "0.5", "--no-progress",
                                "--out", str(tmp_path / "res"),
                                "--json", str(tmp_path / "t.json"), "--merge-into", str(tmp_path / "levers.json"),
                                "--section", "cpu"])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "t.json").read_text())
    assert [a["label"] for a in res["arms"]] == [PLAIN, "spec", "spec-gate1"]
    gated = res["per_level"][1]["arms"]["spec-gate1"]["spans"]  # c2 > gate 1: one-token rounds were counted
    assert gated.get("1", 0) > 0
    assert "## cpu" in (tmp_path / "levers.md").read_text()
    assert res["settings"]["max_tokens_spread"] == 0.5 and res["settings"]["max_tokens_range"] == [3, 9]
    assert res["per_level"][1]["plain_finish_groups"] is not None  # measured from the run's request records


def _ends(arm: str, level: int, ends_ms: list[float], tpot_ms: float = 4.0, rnd: int = 0) -> list[dict]:
    return [{"kind": "request", "arm": arm, "round": rnd, "ok": True, "wall_send": 0.0, "e2el": e / 1e3,
             "tpot": tpot_ms / 1e3, "meta": {"level": level, "warmup": False}} for e in ends_ms]


def test_lockstep_waves_are_measured_and_flagged():
    """Plain decode's 32 requests at c16 end in two steps (two lockstep waves: 2 / 32 finish groups per
    request); the speculative arm's end apart. The tune says so, per level and arm, and warns that the ratio there
    measures the lockstep as much as the setting; with plain's ends spread there is no warning."""
    from specbench.suites.tune import finish_groups

    lock = [500.0] * 16 + [1000.5] * 16
    apart = [300.0 + 10.0 * i for i in range(32)]
    recs = _ends("plain", 16, lock) + _ends("spec", 16, apart)
    assert finish_groups(recs, "plain", 16) == pytest.approx(2 / 32)
    assert finish_groups(recs, "spec", 16) == pytest.approx(1.0)
    assert finish_groups(recs, "spec", 8) is None  # no requests at that level
    s = _summary({"spec": [2.0, 0.8]}, [0.01, 0.01], levels=(1, 16))
    md = render(analyze(s, recs))
    assert "| 16 | 0.06 | 1.00 |" in md and "Warning: plain decode ran in lockstep waves" in md and "c16" in md
    fair = _ends("plain", 16, [500.0 + 7.0 * i for i in range(32)]) + _ends("spec", 16, apart)
    assert "Warning" not in render(analyze(s, fair))


def test_aa_engine_noise_widens_the_floor():
    """--aa: a second plain engine built apart; its paired ratio to plain is the noise between two engines of one
    setting. An arm within it is not resolved even when it is outside the one-engine noise floor, and the A/A arm
    itself is never a candidate (best, crossover, recommendation)."""
    from specbench.suites.tune import AA

    eng, lab = tune_arms("local", each=True, gates=(1,), aa=True)
    assert lab[:2] == [PLAIN, AA] and "spec=off" in eng[1] and f"name={AA}" in eng[1]
    assert tune_arms("local", each=True)[1][1] != AA
    s = _summary({AA: [1.0, 1.05], "spec": [1.9, 1.04], "spec-auto": [2.0, 0.93]}, [0.001, 0.01], levels=(1, 64))
    res = analyze(s, [])
    c64 = res["per_level"][1]
    assert c64["engine_noise"] == pytest.approx(0.05) and AA not in c64["arms"]
    assert c64["arms"]["spec"]["resolved"] is False  # 1.04: outside 0.01, inside the A/A 0.05
    assert c64["arms"]["spec-auto"]["resolved"] is True and res["crossover"]["spec-auto"] == 64
    assert c64["best"] == PLAIN and res["recommendation"]["one_setting"] == "spec"
    md = render(res)
    assert "| 64 | 6400.0 | 0.010 | 0.050 | 1.040* | 0.930 | plain |" in md and "A/A noise" in md
    r = runner.invoke(cli.app, ["tune", "--aa", "--arms", "off=openai:http://a:1/v1;on=openai:http://b:1/v1"])
    assert r.exit_code == 2 and "--aa" in r.output
    # servers: a second one of the baseline's setting labelled plain-aa is read as the A/A arm whatever the baseline
    s2 = _summary({AA: [1.0, 0.9], "k4": [1.5, 1.05]}, [0.001, 0.01], levels=(1, 64))
    s2.baseline = "off"
    c64 = analyze(s2, [])["per_level"][1]
    assert c64["engine_noise"] == pytest.approx(0.1) and c64["arms"]["k4"]["resolved"] is False
