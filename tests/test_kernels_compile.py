"""The attention kernels compile for the H200 (sm_90) on a machine without a GPU: `triton.compile` to
GPUTarget("cuda", 90, 32) runs Triton's whole lowering and ptxas, which the interpreter tests
(tests/test_decode_attention_cpu.py) never reach, so a kernel that only the interpreter accepts fails here,
in CI, instead of on the device. bf16 inputs at the Qwen3-4B geometry, each constexpr branch the engine takes.
"""

from __future__ import annotations

import inspect

import pytest

from specbench.kernels import triton_importable

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")

COMMON = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "pages_ptr": "*i32", "part_ptr": "*fp32",
          "out_ptr": "*bf16", "sq_b": "i32", "sq_h": "i32", "so_b": "i32", "so_h": "i32", "qk_scale": "fp32",
          "NSPLIT": "i32", "NROWS": "i32"}


def _compile(fn, types: dict[str, str], consts: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    except FileNotFoundError as e:  # no ptxas next to this triton build
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    return k.asm["ptx"]


@pytest.mark.parametrize("direct,fused", [(True, False), (False, False), (False, True)])
def test_decode_split_kernel_compiles(direct, fused):
    from specbench.kernels import decode_attention as da

    types = {**COMMON, "lens_ptr": "*i32", "indptr_ptr": "*i32", "cnt_ptr": "*i32"}
    ptx = _compile(da._split_kernel, types, dict(HKV=8, G=4, GP=16, D=128, DP=128, PS=16, BLOCK_N=16 if fused else 64,
                                                  DIRECT=direct, PREC="tf32", FUSED=fused, SP=64))
    assert "mma" in ptx  # the tile dots run on tensor cores


@pytest.mark.parametrize("direct", [True, False])
def test_span_kernel_compiles(direct):
    from specbench.kernels import decode_attention as da

    ptx = _compile(da._span_kernel, {**COMMON, "seg_ptr": "*i32"},
                   dict(HKV=8, G=4, QM=16, TQ=64, D=128, DP=128, PS=16, BLOCK_N=32, DIRECT=direct, PREC="tf32"))
    assert "mma" in ptx


def test_merge_kernel_compiles():
    from specbench.kernels import decode_attention as da

    _compile(da._merge_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "so_b": "i32", "so_h": "i32",
                                "NSPLIT": "i32", "NROWS": "i32"}, dict(HKV=8, G=4, D=128, DP=128, SP=64))
