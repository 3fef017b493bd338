"""CPU checks for the GPU fast path: torch references, FlashInfer page arrays, the decode-graph runner's
padding (eager, no capture), and the Triton kernels under the Triton interpreter when triton is installed.

The device checks (bf16 kernels, FlashInfer, CUDA-graph replay) live in tests/gpu and run with `-m gpu`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from interp import PRELUDE
from qwen3_random import write_random_qwen3

from specbench.engine import EngineConfig, LLMEngine, SamplingParams
from specbench.engine.attention.flashinfer import paged_arrays
from specbench.engine.config import ModelConfig
from specbench.engine.graphs import DecodeGraphs, default_buckets
from specbench.engine.models import layers
from specbench.engine.rope import RotaryCache
from specbench.kernels import activation, gemv, norm, rope, triton_importable


@pytest.fixture(scope="module")
def rand_model(tmp_path_factory) -> str:
    return str(write_random_qwen3(tmp_path_factory.mktemp("q3") / "m", layers=3))


def test_references_are_the_engine_ops():
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        x, r = torch.randn(5, 64, generator=g).to(dt), torch.randn(5, 64, generator=g).to(dt)
        w = (1 + 0.1 * torch.randn(64, generator=g)).to(dt)
        for a, b in zip(norm.add_rms_norm_ref(x, r, w, 1e-6), layers.add_rms_norm(x, r, w, 1e-6), strict=True):
            assert torch.equal(a, b)
        gu = torch.randn(5, 96, generator=g).to(dt)
        assert torch.equal(activation.swiglu_ref(gu), layers.swiglu(gu))
        y, res = gemv.add_norm_linear_ref(x, r, w, torch.randn(96, 64, generator=g).to(dt), 1e-6, swiglu=True)
        assert y.shape == (5, 48) and torch.equal(res, x + r)


def test_rope_reference_matches_rotary_cache(rand_model):
    cfg = ModelConfig.from_dir(rand_model)
    rc = RotaryCache(cfg, "cpu", torch.float32, max_pos=64)
    x = torch.randn(7, 4, cfg.head_dim)
    pos = torch.tensor([0, 1, 5, 9, 17, 33, 63])
    assert torch.equal(rope.rope_ref(x, rc.cos, rc.sin, pos), rc.apply(x, pos))


def test_paged_arrays():
    a = paged_arrays([1, 3, 1], [17, 3, 32], [[4, 7, 9], [2], [5, 6, 8]], 16)
    assert a.qo_indptr.tolist() == [0, 1, 4, 5]
    assert a.kv_indptr.tolist() == [0, 2, 3, 5]
    assert a.kv_indices.tolist() == [4, 7, 2, 5, 6]  # only the pages the lengths cover
    assert a.last_page_len.tolist() == [1, 3, 16]
    assert a.kv_indices.dtype == torch.int32
    with pytest.raises(ValueError, match="page table"):
        paged_arrays([1], [40], [[1, 2]], 16)


def test_default_buckets():
    assert default_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_buckets(9) == [1, 2, 4, 8, 9]
    assert default_buckets(1) == [1]


def _generate(model: str, force_runner: str | None, n: int = 5, setup=None) -> list:
    eng = LLMEngine(EngineConfig(model=model, device="cpu", max_num_seqs=8, eager=True))
    if setup is not None:
        setup(eng)
    if force_runner is not None:  # the CUDA decode path, run eagerly on CPU
        eng.runner.use_graph_runner = True
        eng.runner.graphs = DecodeGraphs(eng.runner, (), capture=False, piecewise=force_runner == "piecewise")
    prompts = [[(7 * i + 3 * j) % 500 + 2 for j in range(4 + 3 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True, logprobs=5) for i in range(n)]
    return eng.generate(prompts, params)


@pytest.mark.parametrize("mode", ["piecewise", "whole"])
def test_decode_graph_runner_padding_is_invisible(rand_model, mode):
    """5 requests ride in the 8 bucket (then fewer as they finish): same tokens, same logprobs."""
    plain = _generate(rand_model, None)
    padded = _generate(rand_model, mode)
    for a, b in zip(plain, padded, strict=True):
        assert a.output_ids == b.output_ids
        for (la, ta), (lb, tb) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(la - lb) < 1e-4 and ta.keys() == tb.keys()


INTERPRETER_SCRIPT = PRELUDE + textwrap.dedent('''

    from specbench.kernels import activation, gemv, kv_store, norm, rope, skinny
    sys.path.insert(0, sys.argv[1])
    from kernel_cases import run_all
    run_all(torch.device("cpu"), [torch.float32], norm, activation, rope, kv_store, gemv)
    run_all(torch.device("cpu"), [torch.float32], None, None, None, None, skinny)  # the skinny GEMMs, same cases
    # the interpreter rounds bf16 by truncation and cannot run bf16 dots: elementwise kernels only, loosely
    run_all(torch.device("cpu"), [torch.bfloat16], norm, activation, rope, kv_store, None, tol=3e-2)
    print("KERNELS OK")
    if len(sys.argv) > 2:  # the engine with the Triton ops and the fused rope + KV store, vs the plain engine
        from interp import StoredKV
        from specbench.kernels.ops import TritonOps
        from test_kernels_cpu import _generate

        def fast(eng):  # skinny on: the prompt's prefill and multi-row steps take the skinny GEMMs
            eng.runner.model.ops = TritonOps(gemv=True, skinny=True)
            eng.runner.backend = StoredKV("cpu")

        plain = _generate(sys.argv[2], None, n=3)
        for mode in (None, "whole"):
            got = _generate(sys.argv[2], mode, n=3, setup=fast)
            for a, b in zip(plain, got):
                assert a.output_ids == b.output_ids, (mode, a.output_ids, b.output_ids)
                for (la, _), (lb, _) in zip(a.logprobs, b.logprobs):
                    assert abs(la - lb) < 1e-3, (mode, la, lb)
        print("ENGINE OK")
''')


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed: the interpreter checks need it")
def test_triton_kernels_under_interpreter(rand_model):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT, str(here), rand_model], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ENGINE OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_decode_benchmark_logic_on_cpu(rand_model):
    """The benchmark's engine driving (fill, variant switch, timed steps, abort) and its table, on CPU."""
    from specbench.cli.bench import load_benchmark

    mod = load_benchmark("decode")
    bench = mod.Bench(rand_model, max_batch=4, device="cpu")
    rids = bench.fill(3, 20, seed=1)
    assert all(not bench.engine.requests[r].in_prefill for r in rids)
    for v in ("torch-eager", "torch-graph"):
        res = bench.steps(v, rids)
        assert res["wall_ms"] > 0 and res["ctx"] > 20 and "gpu_ms" not in res
    bench.abort(rids)
    assert not bench.engine.has_unfinished() and bench.engine.pool.num_free == bench.engine.pool.num_pages
    row = {"batch": 3, "context": 20, "dense_ms": 1.0,
           "variants": {"torch-eager": {"wall_ms": 2.0, "bw_floor_ms": 0.5, "wall_over_dense": 2.0, "ctx": 21}}}
    text = mod.render({"gpu": "cpu", "copy_bw_tb_s": 0.1, "weight_bytes": 10**9, "rows": [row], "hf_peer": None,
                       "profile_b1": None})
    assert "torch-eager" in text and "2.000" in text


def test_gemv_routing(monkeypatch):
    """The op bundle takes the GEMVs only with the switch on, at most max_rows rows, for kinds
    SPECBENCH_GEMV_KINDS allows and shapes whose TUNED entry is not None (cuBLAS measured faster there)."""
    from specbench.kernels import gemv
    from specbench.kernels.ops import TritonOps

    monkeypatch.setitem(gemv.TUNED, (96, 64, "plain"), None)
    monkeypatch.setitem(gemv.TUNED, (48, 64, "plain"), (2, 256, 2))
    monkeypatch.delenv("SPECBENCH_GEMV_KINDS", raising=False)
    on = TritonOps(gemv=True, max_rows=1)
    assert on.kinds == gemv.KINDS
    assert on.gemv_config(1, 48, 64, "plain") == (2, 256, 2)  # the tuned config
    assert on.gemv_config(1, 7, 64, "norm") == gemv.DEFAULT  # an untuned shape
    assert on.gemv_config(1, 96, 64, "plain") is None, "TUNED None keeps cuBLAS"
    assert on.gemv_config(2, 48, 64, "plain") is None, "more rows than max_rows"
    assert TritonOps(gemv=False).gemv_config(1, 48, 64, "plain") is None
    monkeypatch.setenv("SPECBENCH_GEMV_KINDS", "norm, swiglu,bogus")
    some = TritonOps(gemv=True)
    assert some.kinds == ("norm", "swiglu") and some.gemv_config(1, 48, 64, "plain") is None
    assert some.gemv_config(1, 7, 64, "norm") == gemv.DEFAULT
    x, w = torch.randn(2, 64), torch.randn(96, 64)
    assert torch.equal(some.linear(x, w), torch.nn.functional.linear(x, w))  # routed to cuBLAS / torch


def test_skinny_routing(monkeypatch):
    """The skinny GEMMs take what the GEMV does not: only with both switches on, from max_rows + 1 to
    skinny.MAX_ROWS rows, keyed by the row tile, TUNED None keeping cuBLAS."""
    from specbench.kernels import skinny
    from specbench.kernels.ops import TritonOps

    monkeypatch.delenv("SPECBENCH_GEMV_KINDS", raising=False)
    monkeypatch.setitem(skinny.TUNED, (48, 64, "plain", 16), (16, 128, 4, 3, 2))
    monkeypatch.setitem(skinny.TUNED, (48, 64, "plain", 32), None)
    on = TritonOps(gemv=True, max_rows=1, skinny=True)
    assert on.skinny_config(1, 48, 64, "plain") is None, "one row is the GEMV's"
    assert on.skinny_config(16, 48, 64, "plain") == (16, 128, 4, 3, 2) == on.skinny_config(9, 48, 64, "plain")
    assert on.skinny_config(17, 48, 64, "plain") is None, "TUNED None for the 32-row tile keeps cuBLAS"
    assert on.skinny_config(40, 7, 64, "swiglu") == skinny.DEFAULT, "an untuned shape"
    monkeypatch.delitem(skinny.TUNED, (48, 64, "plain", 32))
    assert on.skinny_config(40, 48, 64, "plain") is None, "a tuned shape at an unmeasured row tile keeps cuBLAS"
    assert skinny.pick(2560, 9728, "plain", 16) is not None and skinny.pick(2560, 9728, "plain", 30) is None
    assert on.skinny_config(skinny.MAX_ROWS + 1, 7, 64, "norm") is None, "past MAX_ROWS: cuBLAS"
    assert TritonOps(gemv=True, skinny=False).skinny_config(16, 7, 64, "norm") is None
    assert TritonOps(gemv=False, skinny=True).skinny_config(16, 7, 64, "norm") is None, "skinny needs gemv"
    assert [skinny.block_m(r) for r in (1, 2, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
    monkeypatch.setenv("SPECBENCH_GEMV_KINDS", "norm")
    assert TritonOps(gemv=True, skinny=True).skinny_config(16, 7, 64, "plain") is None
