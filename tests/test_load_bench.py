"""benchmarks/load.py on CPU with the bundled tiny pair: an in-process arm beside an http arm (issue 28), the same
closed loop through `specbench serve`'s app, in one run on identical prompts."""

from __future__ import annotations

import json

import pytest

from specbench.benchmarks import load


def test_token_ids_reads_only_the_field():
    from specbench.harness.server.serving import sse

    ev = sse({"id": "x", "choices": [{"index": 0, "text": 'say "token_ids": [9, 9]', "logprobs": None,
                                      "finish_reason": None, "stop_reason": None, "token_ids": [3, 14, 15]}]})
    assert load._token_ids(ev.strip().encode()) == [3, 14, 15]
    assert load._token_ids(sse({"choices": [{"token_ids": []}]}).strip().encode()) == []
    assert load._token_ids(b"data: [DONE]") is None


def _run(target, arms, out) -> dict:
    """The closed loop at c1 and c4 on the tiny target (waves 1, 6 tokens each), one repeat."""
    return load.main(["--device", "cpu", "--model", target, "--levels", "1,4", "--prompt-min", "8",
                      "--prompt-max", "24", "--max-tokens", "6", "--waves", "1", "--repeats", "1",
                      "--num-pages", "256", "--arms", json.dumps(arms, separators=(",", ":")), "--out-dir", str(out)])


def test_process_and_http_arms_agree(tiny_target, tmp_path):
    arms = [{"name": "process", "kw": {}}, {"name": "http", "kw": {}, "via": "http"}]
    res = _run(tiny_target, arms, tmp_path)
    assert res["complete"]
    for c in ("1", "4"):
        lvl = res["levels"][c]
        p, h = lvl["process"], lvl["http"]
        assert (p["via"], h["via"]) == ("process", "http")
        assert p["tokens"]["median"] == h["tokens"]["median"] == int(c) * 6  # waves 1: c requests of 6 tokens
        for x in (p, h):
            assert x["tok_s"]["median"] > 0 and x["ttft_ms"]["median"] > 0 and x["tpot_ms"]["median"] > 0
            assert x["steps"]["median"] > 0 and x["paths"]  # the http arm's steps: its server's engine's
        assert h["ids_sha"] == p["ids_sha"] and h["same_ids_as_first"]  # greedy: the same output ids
        assert h["over_first"]["median"] == pytest.approx(h["tok_s"]["median"] / p["tok_s"]["median"])
    md = (tmp_path / "load.md").read_text()
    assert "| 4 | http | http |" in md and "| 4 | process | process |" in md
    assert json.loads((tmp_path / "load.json").read_text())["complete"]


def test_http_proc_arm_agrees_and_reports_the_engine_process_steps(tiny_target, tmp_path, capsys):
    """`"via": "http-proc"`: the same closed loop through the server with the engine in its own process."""
    arms = [{"name": "process", "kw": {}}, {"name": "proc", "kw": {}, "via": "http-proc"}]
    res = _run(tiny_target, arms, tmp_path)
    assert res["complete"]
    for c in ("1", "4"):
        p, h = res["levels"][c]["process"], res["levels"][c]["proc"]
        assert h["via"] == "http-proc" and h["steps_available"] is False and h["paths"] == {}
        assert h["steps"]["n"] == 0  # not zeros: no figure at all
        assert p["tokens"]["median"] == h["tokens"]["median"] == int(c) * 6
        assert h["tok_s"]["median"] > 0 and h["ids_sha"] == p["ids_sha"]
        ch = h["child"]  # what the engine process's loop reports instead: its steps, their time, the hand-over
        assert ch["steps"] > 0 and ch["step_ms"] > 0 and 0 < ch["share"] <= 1.0 and ch["emit_ms"] >= 0
    assert "engine process: " in capsys.readouterr().out
    assert "| 4 | proc | http-proc |" in (tmp_path / "load.md").read_text()


def test_steps_out_records_every_step_and_the_policy_choices(tiny_pair, tmp_path):
    """--steps-out: one record per step() call of each process arm's last repeat, with the span policy's committed
    choices; the time by choice covers every call once (its shares sum to 1), and the gate arm's every choice with
    more than one request running is a one-token round."""
    t, d = tiny_pair
    arms = [{"name": "gate1", "kw": {"spec_gate": 1}}, {"name": "fixed", "kw": {}}]
    res = load.main(["--device", "cpu", "--model", t, "--draft", d, "--tau", "3.5", "--levels", "4",
                     "--prompt-min", "8", "--prompt-max", "16", "--max-tokens", "10", "--waves", "2",
                     "--repeats", "1", "--num-pages", "256", "--arms", json.dumps(arms, separators=(",", ":")),
                     "--out-dir", str(tmp_path), "--steps-out"])
    for name in ("gate1", "fixed"):
        lines = [json.loads(x) for x in (tmp_path / f"steps-{name}-c4.jsonl").read_text().splitlines()]
        lvl = res["levels"]["4"][name]
        assert len(lines) == lvl["steps"]["median"] > 0
        choices = [c for x in lines for c in x["choices"]]
        assert choices and all({"span", "reason", "chained", "mixed", "running"} <= set(c) for c in choices)
        by = lvl["by_choice"]
        assert sum(g["calls"] for g in by) == len(lines)
        assert sum(g["share"] for g in by) == pytest.approx(1.0, abs=1e-3)
        if name == "gate1":
            assert all(c["span"] == 1 for c in choices if c["running"] > 1)
            assert any(c["reason"] == "gate" for c in choices)
        else:
            assert any(c["reason"] == "fixed" and c["span"] > 1 for c in choices)
    assert "Stepping time by the span policy's choice" in (tmp_path / "load.md").read_text()


def test_output_length_spread(tiny_target, tmp_path):
    """--max-tokens-spread: each prompt's max_tokens drawn once, the same for every arm; the tokens generated are
    their sum, and a process arm beside an http arm still gives the same output ids."""
    lens = load.output_lens(40, 10, 0.5, seed=4)
    assert lens == load.output_lens(40, 10, 0.5, seed=4) and min(lens) >= 5 and max(lens) <= 15
    assert len(set(lens)) > 3 and load.output_lens(3, 10, 0.0, seed=4) == [10, 10, 10]
    arms = [{"name": "process", "kw": {}}, {"name": "http", "kw": {}, "via": "http"}]
    res = load.main(["--device", "cpu", "--model", tiny_target, "--levels", "4", "--prompt-min", "8",
                     "--prompt-max", "16", "--max-tokens", "10", "--max-tokens-spread", "0.5", "--waves", "2",
                     "--repeats", "1", "--num-pages", "256", "--arms", json.dumps(arms, separators=(",", ":")),
                     "--out-dir", str(tmp_path)])
    want = sum(load.output_lens(8, 10, 0.5, seed=4))
    lvl = res["levels"]["4"]
    assert lvl["process"]["tokens"]["median"] == lvl["http"]["tokens"]["median"] == want
    assert lvl["http"]["same_ids_as_first"]
    with pytest.raises(SystemExit, match="--max-tokens-spread"):
        load.main(["--device", "cpu", "--model", tiny_target, "--max-tokens-spread", "1.0"])
