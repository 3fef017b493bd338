"""Every Triton kernel against its torch reference on the GPU: random inputs, several shapes, bf16 and fp32
(tests/kernel_cases.py), plus every autotune config of the fused add-norm GEMV."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_kernels_match_references(monkeypatch):
    monkeypatch.setenv("SPECBENCH_GEMV_TUNE", "0")  # fixed config here; every config is checked below
    from kernel_cases import run_all

    from specbench.kernels import activation, gemv, kv_store, norm, rope

    run_all(torch.device("cuda"), [torch.float32, torch.bfloat16], norm, activation, rope, kv_store, gemv)


@pytest.mark.parametrize("swiglu", [False, True])
def test_every_gemv_config(swiglu):
    import triton
    from kernel_cases import rel

    from specbench.kernels import gemv

    g = torch.Generator(device="cuda").manual_seed(7)
    m, k, n = 11, 1000, 333  # ragged on purpose: masks on every edge
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    r = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    gw = (1 + 0.2 * torch.randn(k, generator=g, device="cuda")).bfloat16()
    w = (torch.randn(2 * n if swiglu else n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    ref, res_ref = gemv.add_norm_linear_ref(x, r, gw, w, 1e-6, swiglu)
    for cfg in gemv._CONFIGS:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        res = torch.full_like(x, float("nan"))
        bn = cfg.kwargs["BLOCK_N"]
        gemv._add_norm_gemv_kernel[(triton.cdiv(n, bn),)](
            x, r, gw, w, out, res, m, n, k, x.stride(0), r.stride(0), w.stride(0), out.stride(0), res.stride(0),
            1e-6, HAS_RES=True, SWIGLU=swiglu, PREC="tf32", BLOCK_M=gemv.MAX_ROWS, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **cfg.kwargs)
        assert rel(out, ref) < 1e-2, (cfg, rel(out, ref))
        assert torch.equal(res, res_ref), cfg


@pytest.mark.parametrize("batch", [1, 64])
def test_spec_accept_kernel_matches_torch_path(batch):
    """The fused speculative-sampling accept (kernels/spec_accept.py) against accept_sampled_batch's torch
    path at the Qwen3 vocabulary, K=15: drafted q, point masses, mixed, DFlash views, every fault; equal
    accepted counts, emitted tokens equal but for rare fp32 ties (tests/spec_accept_cases.py)."""
    from spec_accept_cases import run_cases

    stats = run_cases(torch.device("cuda"), vocabs=(151936,), trials=2, batches=(batch,), k_fixed=15)
    assert stats["requests"] == 32 * batch
    assert len(stats["m_hist"]) > 3, stats  # accepted runs of several lengths, the bonus among them
