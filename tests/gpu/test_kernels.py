"""Every Triton kernel against its torch reference on the GPU: random inputs, several shapes, bf16 and fp32
(tests/kernel_cases.py), plus every config of the GEMVs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_kernels_match_references():
    from kernel_cases import run_all

    from specbench.kernels import activation, gemv, kv_store, norm, rope

    run_all(torch.device("cuda"), [torch.float32, torch.bfloat16], norm, activation, rope, kv_store, gemv)


@pytest.mark.parametrize("kind", ["plain", "norm", "swiglu"])
def test_every_gemv_config(kind):
    """Every config the GEMV benchmark may pick (kernels/gemv.py CONFIGS) against the torch reference, on
    ragged shapes (masks on every edge), plus the residual it writes."""
    from kernel_cases import rel

    from specbench.kernels import gemv

    g = torch.Generator(device="cuda").manual_seed(7)
    m, k, n = 5, 1000, 333
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    r = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    gw = (1 + 0.2 * torch.randn(k, generator=g, device="cuda")).bfloat16()
    w = (torch.randn(2 * n if kind == "swiglu" else n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    if kind == "plain":
        ref = gemv.linear_ref(x, w)
    else:
        ref, res_ref = gemv.add_norm_linear_ref(x, r, gw, w, 1e-6, kind == "swiglu")
    for cfg in gemv.CONFIGS:
        if kind == "plain":
            out = gemv.linear(x, w, cfg)
        else:
            out, res = gemv.add_norm_linear(x, r, gw, w, 1e-6, kind == "swiglu", cfg)
            assert torch.equal(res, res_ref), cfg
        assert rel(out, ref) < 1e-2, (cfg, rel(out, ref))


@pytest.mark.parametrize("kind", ["plain", "norm", "swiglu"])
@pytest.mark.parametrize("m", [5, 16, 33, 64])
def test_every_skinny_config(kind, m):
    """Every config the skinny benchmark may pick (kernels/skinny.py CONFIGS: tiles x splits) against the torch
    reference in bf16 on ragged shapes (masks on every edge) at the 16- and 64-row tiles, the default at the
    others, the residual it writes exact; a Qwen3-4B shape through `pick`; the same kernel in fp32 (IEEE dots).
    Run twice per config, the split-K results equal bit for bit (arrival order does not matter)."""
    from kernel_cases import rel

    from specbench.kernels import skinny

    g = torch.Generator(device="cuda").manual_seed(m)
    sweep = skinny.CONFIGS if m in (5, 33) else [skinny.DEFAULT]  # every config at two row tiles (compile time)
    for k, n, cfgs in ((1000, 333, sweep), (2560, 6144 if kind != "swiglu" else 9728, [None])):
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        r = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        gw = (1 + 0.2 * torch.randn(k, generator=g, device="cuda")).bfloat16()
        w = (torch.randn(2 * n if kind == "swiglu" else n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
        if kind == "plain":
            ref = skinny.linear_ref(x, w)
        else:
            ref, res_ref = skinny.add_norm_linear_ref(x, r, gw, w, 1e-6, kind == "swiglu")
        for cfg in cfgs:
            if kind == "plain":
                out = skinny.linear(x, w, cfg)
            else:
                out, res = skinny.add_norm_linear(x, r, gw, w, 1e-6, kind == "swiglu", cfg)
                assert torch.equal(res, res_ref), cfg
            assert rel(out, ref) < 1e-2, (cfg, rel(out, ref))
            again = skinny.linear(x, w, cfg) if kind == "plain" else skinny.add_norm_linear(
                x, r, gw, w, 1e-6, kind == "swiglu", cfg)[0]
            assert torch.equal(again, out), cfg
    assert not skinny._LOCKS[x.device].any(), "every launch leaves the arrival counters zero"
    x32, w32 = x.float(), w.float()
    out32 = skinny.linear(x32, w32) if kind == "plain" else skinny.add_norm_linear(x32, r.float(), gw.float(), w32,
                                                                                    1e-6, kind == "swiglu")[0]
    ref32 = skinny.linear_ref(x32, w32) if kind == "plain" else skinny.add_norm_linear_ref(
        x32, r.float(), gw.float(), w32, 1e-6, kind == "swiglu")[0]
    assert rel(out32, ref32) < 1e-5, rel(out32, ref32)  # TF32 would be ~1e-3


@pytest.mark.parametrize("batch", [1, 64])
def test_spec_accept_kernel_matches_torch_path(batch):
    """The fused speculative-sampling accept (kernels/spec_accept.py) against accept_sampled_batch's torch
    path at the Qwen3 vocabulary, K=15: drafted q, point masses, mixed, DFlash views, every accept rule variant; equal
    accepted counts, emitted tokens equal but for rare fp32 ties (tests/spec_accept_cases.py)."""
    from spec_accept_cases import run_cases

    stats = run_cases(torch.device("cuda"), vocabs=(151936,), trials=2, batches=(batch,), k_fixed=15)
    assert stats["requests"] == 32 * batch
    assert len(stats["m_hist"]) > 3, stats  # accepted runs of several lengths, the bonus among them


@pytest.mark.parametrize("ctx", [1, 511, 2048])
@pytest.mark.parametrize("batch", [1, 9, 64])
def test_decode_attention_qwen3_4b(batch, ctx):
    """The split-K paged decode attention (kernels/decode_attention.py) vs its torch reference in bf16 at the
    Qwen3-4B geometry (32 query heads, 8 KV heads, head_dim 128, page 16): ragged lengths up to ctx, shuffled
    pages, NaN in every slot no row may read; the engine's split count, one split, and the most splits."""
    import random

    from decode_attention_cases import check

    from specbench.kernels import decode_attention as da

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = random.Random(batch * 7919 + ctx)
    rows = [ctx] + [rng.randint(1, ctx) for _ in range(batch - 1)]
    for splits in sorted({da.num_splits(batch, 8, 1 << 20, sms), 1, da.MAX_SPLITS}):
        for fused in (True, False):  # merge in the split kernel (default) / the separate merge launch
            err = check(da, torch.device("cuda"), torch.bfloat16, rows, 32, 8, 128, 16, splits, tol=2e-2, seed=splits,
                        fused=fused)
            print(f"decode attention B={batch} ctx={ctx} splits={splits} fused={fused}: max abs err {err:.3g}")


@pytest.mark.parametrize("ctx", [17, 600, 3000])
@pytest.mark.parametrize("causal", [True, False])
def test_span_attention_qwen3_4b(causal, ctx):
    """The span attention of whole verify / draft graphs (kernels/decode_attention.span_attention) vs its torch
    reference in bf16 at the Qwen3-4B geometry (32 query heads, 8 KV heads, head_dim 128, page 16): verify spans
    of 16 and shorter, a decode row, padding rows on a dummy page shared in one segment, unused segments; one
    split and several."""
    from specbench.engine.attention.flashinfer import row_segments
    from specbench.kernels import decode_attention as da

    dev, ps, hq, hkv, d = torch.device("cuda"), 16, 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(ctx + causal)
    spans = [(16, ctx + 16), (5, ctx // 2 + 5), (1, ctx), (16, 16)]  # (q_len, kv_len)
    need = [-(-kl // ps) for _, kl in spans]
    npages = sum(need) + 1
    perm = torch.randperm(npages - 1, device=dev, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    q_lens, kv_lens = [ql for ql, _ in spans] + [1] * 6, [kl for _, kl in spans] + [1] * 6
    tables += [[npages - 1]] * 6
    kc = torch.randn(npages * ps, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    vc = torch.randn(npages * ps, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    rows = sum(q_lens)
    q = torch.randn(rows, hq, d, device=dev, generator=g).to(torch.bfloat16)
    segs, pages = row_segments(q_lens, kv_lens, tables, ps, causal, 16)
    st = torch.tensor(segs + [(0, 0, 0, 0, 0)] * 3, dtype=torch.int32, device=dev)
    pg = torch.tensor(pages, dtype=torch.int32, device=dev)
    ref = da.span_attention_ref(q, kc, vc, st, pg, ps, d ** -0.5).float()
    for splits in (1, 4, 17):
        out = da.span_attention(q, kc, vc, st, pg, ps, d ** -0.5, splits, 16).float()
        err = (out - ref).abs().max().item()
        print(f"span attention causal={causal} ctx={ctx} splits={splits}: max abs err {err:.3g}")
        assert err < 2e-2 and bool(torch.isfinite(out).all())


def test_decode_attention_cuda_graph_replay():
    """Captured once with static metadata buffers (the engine's graph bucket), replayed after lengths and pages
    change, padding rows included (length 0, one key on a dummy page): each replay matches the reference and is
    bit-identical to an eager launch."""
    from specbench.kernels import decode_attention as da

    b, hq, hkv, d, ps, pages = 9, 32, 8, 128, 16, 400
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    kc = torch.randn(pages * ps, hkv, d, generator=g, device=dev).bfloat16()
    vc = torch.randn(pages * ps, hkv, d, generator=g, device=dev).bfloat16()
    perm = torch.randperm(pages - 1, generator=g, device=dev).tolist()
    tables = [perm[i * 40:(i + 1) * 40] for i in range(b - 1)] + [[pages - 1]]  # last row: the dummy page
    buf = torch.zeros(2 * b + 1 + pages + b, dtype=torch.int32, device=dev)
    lens, ptr, idx = buf[:b], buf[b:2 * b + 1], buf[2 * b + 1:]
    q = torch.zeros(b, hq, d, dtype=torch.bfloat16, device=dev)
    splits = da.num_splits(b, hkv, pages * ps, torch.cuda.get_device_properties(0).multi_processor_count)
    part = da.alloc_partials(b, hkv, hq // hkv, d, splits, dev)
    scale = d ** -0.5

    def fill(step_lens):
        host = [list(step_lens), [0], []]
        for t, n in zip(tables, step_lens, strict=True):
            host[2] += t[:-(-n // ps)]
            host[1].append(len(host[2]))
        flat = torch.tensor(host[0] + host[1] + host[2], dtype=torch.int32)
        buf[:len(flat)].copy_(flat)
        q.copy_(torch.randn(b, hq, d, generator=g, device=dev).bfloat16())

    fill([1] * b)
    da.decode_attention(q, kc, vc, lens, ptr, idx, ps, scale, splits, part)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, kc, vc, lens, ptr, idx, ps, scale, splits, part)
    for step_lens in ([1] * b, [5, 600, 17, 0, 640, 33, 100, 2, 1], [640, 1, 333, 16, 17, 0, 512, 640, 1]):
        fill(step_lens)
        graph.replay()
        ref = da.decode_attention_ref(q, kc, vc, lens, ptr, idx, ps, scale)
        err = float((out.float() - ref.float()).abs().max())
        assert err <= 2e-2 and bool(torch.isfinite(out).all()), (step_lens, err)
        eager = da.decode_attention(q, kc, vc, lens, ptr, idx, ps, scale, splits, part)
        assert torch.equal(out, eager), step_lens
