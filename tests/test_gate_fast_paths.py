"""The gates judge the code a GPU run takes, on the CPU too: `specbench lossless` and `specbench sampled` put a
local CPU candidate on its graph runners (harness/engines.py `fast_paths_on_cpu`: graph_runner=1, the padded
bodies the CUDA graphs capture, run eagerly), the baseline staying on the plain forward.

The proof is a bug that lives only in a fast path: the padded verify runner returning the logits of two verify
rows swapped. The default gate on CPU fails it; the same gate with the candidate forced back to the plain
forward (graph_runner=0) cannot see it and passes, which is what every CPU gate run did before."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specbench.cli import app as cli
from specbench.engine.graphs import VerifyGraphs
from specbench.harness.engines import fast_paths_on_cpu, parse_engine

cli._register()


@pytest.fixture
def swapped_rows(monkeypatch):
    real = VerifyGraphs.run

    def run(self, spans, logit_rows, *a, **kw):
        logits, taps = real(self, spans, logit_rows, *a, **kw)
        if logits.shape[0] > 2:
            logits = logits.clone()
            logits[[1, 2]] = logits[[2, 1]]
        return logits, taps

    monkeypatch.setattr(VerifyGraphs, "run", run)


def _lossless(tiny_pair, extra: str = "") -> dict:
    t, d = tiny_pair
    res = CliRunner().invoke(cli.app, ["lossless", "--baseline", f"local:{t},spec=off",
                                       "--candidate", f"local:{t},draft={d},spec=dflash{extra}", "--num-prompts", "3",
                                       "--max-tokens", "16", "--no-record", "--json"])
    return {"code": res.exit_code, **json.loads(res.stdout.strip().splitlines()[-1])}


def test_a_bug_in_the_padded_verify_runner_fails_the_default_gate(tiny_pair, swapped_rows) -> None:
    out = _lossless(tiny_pair)
    assert out["code"] == 1 and out["verdict"] == "FAIL", out["verdict"]
    assert out["engines"]["candidate"]["config"]["graph_runner"] is True
    assert out["engines"]["baseline"]["config"]["graph_runner"] is False  # the reference: the plain forward


def test_the_plain_forward_does_not_see_it(tiny_pair, swapped_rows) -> None:
    out = _lossless(tiny_pair, ",graph_runner=0")
    assert out["code"] == 0 and out["verdict"] == "PASS", out["verdict"]


def test_the_default_gate_passes_the_fast_paths(tiny_pair) -> None:
    out = _lossless(tiny_pair)
    assert out["code"] == 0 and out["verdict"] == "PASS"


def test_only_local_cpu_candidates_are_switched() -> None:
    assert fast_paths_on_cpu(parse_engine("local")).options["graph_runner"] == "1"
    assert fast_paths_on_cpu(parse_engine("local,graph_runner=0")).options["graph_runner"] == "0"
    assert "graph_runner" not in fast_paths_on_cpu(parse_engine("local,device=cuda")).options
    assert "graph_runner" not in fast_paths_on_cpu(parse_engine("openai:http://127.0.0.1:1")).options
