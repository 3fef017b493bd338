"""EngineConfig.tp_emulate on the device (issue 50): the emulated TP-2 reduction order under CUDA graphs, bf16.

- every captured path runs the split: with tp_emulate=2 the engine with CUDA graphs (decode graphs, the padded
  verify and draft runners, Triton ops) gives the eager engine's tokens and logprobs exactly, spec off and DFlash;
- the split is real on the GPU: tp_emulate=2 moves bf16 logprobs against tp_emulate=1;
- `lossless --suite noise` at emulated TP 2 on the tiny pair passes with the clean engine.
Run with `TEST_PATHS=tests/gpu/test_tp_emulate_gpu.py bash scripts/gpu.sh tests` (docs/noise.md).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
PROMPTS = [f"Question: what is {3 + i} times {7 + 2 * i}?\nAnswer:" for i in range(6)]


def _run(target: str, **kw):
    from specbench.engine import LLM
    from specbench.engine.config import SamplingParams

    llm = LLM(target, device="cuda", dtype="bfloat16", attention_backend="torch", num_pages=1024, **kw)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, logprobs=5))
        return [(o.output_ids, [lp for lp, _ in o.logprobs]) for o in outs]
    finally:
        llm.close()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("spec", ["off", "dflash"])
def test_graphs_equal_eager_with_the_split(tiny, spec, tp):
    """eager=True launches the same padded bodies without capturing them: the same kernels on the same shapes, so
    the tokens and logprobs are equal bit for bit, with the split (tp 2) as without it (tp 1, the control)."""
    target, draft = tiny
    kw = {"spec": spec, "tp_emulate": tp, **({"draft": draft} if spec == "dflash" else {})}
    graphs = _run(target, **kw)
    eager = _run(target, eager=True, **kw)
    assert graphs == eager


def test_the_split_moves_bf16_logprobs(tiny):
    target, _ = tiny
    one, two = _run(target, spec="off"), _run(target, spec="off", tp_emulate=2)
    assert one != two


def test_noise_suite_passes_the_clean_engine(tiny):
    from typer.testing import CliRunner

    from specbench.cli import app as cli

    cli._register()
    res = CliRunner().invoke(cli.app, [
        "lossless", "--suite", "noise", "--json", "--no-record", "--num-prompts", "8", "--max-tokens", "64",
        "--candidate", "local,spec=dflash,device=cuda,dtype=bfloat16,attention=torch,tp_emulate=2"])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps({k: out[k] for k in ("verdict", "reasons", "noise_rate", "test_rate")}, default=str)[:2000])
    assert res.exit_code == 0 and out["verdict"] == "PASS", out["reasons"]
