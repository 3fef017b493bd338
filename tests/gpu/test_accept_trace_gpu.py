"""The acceptance-trace gate on the device (issue 47 item 1): the bundled engine against its drafter's replay.

- fp32 on CUDA, every path the engine serves with (CUDA graphs and eager; every prompt at once, c8, and one at a
  time, c1; DFlash and DFlash2): exact mode, every aligned step equal or a near-tie, PASS;
- bf16 (the serving dtype): the statistical mode's sign test, PASS on the clean engine;
- the DFlash2 convolution that wraps the block: FAIL in both modes.
Each case's evidence (aligned steps, equal, near-ties, smallest margin, accepted vs replay) goes to
$ACCEPT_TRACE_OUT (a JSON lines file) when set. Run with `TEST_PATHS=tests/gpu/test_accept_trace_gpu.py bash
scripts/gpu.sh tests` (the device notes in ../shared/device/).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
DFLASH2 = str(Path(__file__).resolve().parents[2] / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft")


def _gate(candidate, n: int, max_tokens: int = 64):
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.suites.lossless.gates.accept_trace import accept_trace
    from specbench.suites.lossless.greedy import GreedyGateOptions, tokenize_prompts
    from specbench.suites.lossless.prompts import load_prompts

    base = LocalAdapter.from_dirs(candidate.describe()["model"], spec="off")

    async def go():
        try:
            prompts, _ = await tokenize_prompts(base, candidate, load_prompts("gsm8k", 8))
            out = []
            for i in range(0, len(prompts), n):  # n at once: c8 sends all 8, c1 one at a time
                out.append(await accept_trace(base, candidate, prompts[i:i + n], max_tokens, GreedyGateOptions()))
            return out
        finally:
            await candidate.aclose()
            await base.aclose()
            gc.collect()
            torch.cuda.empty_cache()
    return asyncio.run(go())


def _record(case: dict, runs) -> None:
    ev = [r.evidence for r in runs]
    row = {**case, "verdicts": [r.verdict for r in runs], "aligned": sum(e.get("aligned_steps", 0) for e in ev),
           "near_ties": sum(e.get("near_ties", 0) for e in ev), "accepted": sum(e.get("accepted", 0) for e in ev),
           "replay_accepted": sum(e.get("replay_accepted", 0) for e in ev),
           "min_margin": min((e["min_margin"] for e in ev if e.get("min_margin") is not None), default=None),
           "checks": [c.detail for r in runs for c in r.checks]}
    print(json.dumps(row))
    if os.environ.get("ACCEPT_TRACE_OUT"):
        with open(os.environ["ACCEPT_TRACE_OUT"], "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("c", [8, 1])
@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_the_clean_engine_passes_on_every_path(tiny, dtype, eager, c, drafter):
    from specbench.harness.adapters.local import LocalAdapter

    t, d = tiny
    ad = LocalAdapter.from_dirs(t, DFLASH2 if drafter == "dflash2" else d, spec="dflash", device="cuda", dtype=dtype,
                                eager=eager)
    runs = _gate(ad, c)
    _record({"drafter": drafter, "dtype": dtype, "eager": eager, "c": c, "plant": None}, runs)
    assert all(r.verdict == "PASS" for r in runs), [(r.missing, [x.detail for x in r.checks]) for r in runs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_wrapping_convolution_fails(tiny, monkeypatch, dtype):
    from test_accept_trace import _conv_wraps_the_block  # the CPU test's plant (tests/ is on the path)

    from specbench.harness.adapters.local import LocalAdapter

    _conv_wraps_the_block(monkeypatch)
    t, _ = tiny
    runs = _gate(LocalAdapter.from_dirs(t, DFLASH2, spec="dflash", device="cuda", dtype=dtype), 8)
    _record({"drafter": "dflash2", "dtype": dtype, "eager": False, "c": 8, "plant": "conv_wraps_the_block"}, runs)
    assert runs[0].verdict == "FAIL", [x.detail for x in runs[0].checks]
