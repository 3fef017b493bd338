"""The split-K paged decode attention (kernels/decode_attention.py) and its engine switch, on CPU.

- the torch reference against the engine's reference backend (TorchAttention) on the same paged step;
- the Triton kernels against the reference under the Triton interpreter (a subprocess: TRITON_INTERPRET must be
  set before triton is imported; fp32, the interpreter cannot run bf16 dots): ragged lengths 1..200, splits
  left empty, shuffled pages, length-0 and dummy-page padding rows, NaN in every slot no real row may read;
- the span attention of padded verify and draft steps (`row_segments`, `span_attention`, `plan_rows`: the whole
  graphs of engine/piecewise.py): the torch reference and the Triton kernel (direct and split, spans cut at the
  quantum, unused segments) and FlashInferAttention.plan_rows, against TorchAttention on causal verify spans and
  non-causal blocks with padding rows;
- FlashInferAttention's Triton decode path (a stub `flashinfer` module: its wrappers are never called on
  decode steps) against TorchAttention: an eager step, then a graph bucket planned twice with other lengths
  and pages (the replay reads the refreshed static buffer);
- EngineConfig.decode_attention and the engine-string switch: accepted values and errors.
The GPU twins (bf16 at the Qwen3-4B geometry, CUDA-graph replay) are in tests/gpu.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from decode_attention_cases import make_case
from interp import PRELUDE

from specbench.engine.attention.base import AttentionMetadata
from specbench.engine.attention.torch_ref import TorchAttention
from specbench.kernels import decode_attention as da
from specbench.kernels import triton_importable


def test_num_splits():
    assert da.num_splits(1, 8, 1 << 20, sm_count=132) == 50  # 3 waves of 132 SMs over 8 KV heads
    assert da.num_splits(64, 8, 1 << 20, sm_count=132) == 1
    assert da.num_splits(16, 8, 1 << 20, sm_count=132) == 4
    assert da.num_splits(1, 1, 1 << 20, sm_count=132) == da.MAX_SPLITS
    assert da.num_splits(1, 8, 40, sm_count=132) == 3  # no split narrower than the smallest tile
    assert da.num_splits(1, 8, 0, sm_count=132) == 1
    assert all(da.block_n(s) >= da.MIN_BLOCK for s in range(1, 70))


def test_num_splits_override(monkeypatch):
    monkeypatch.setenv("SPECBENCH_DECODE_SPLITS", "7")
    assert da.num_splits(64, 8, 100) == 7


def test_reference_matches_torch_backend():
    """decode_attention_ref == the engine's TorchAttention on a decode step over the same paged cache."""
    ps, hq, hkv, d = 4, 8, 2, 32
    rows = [9, 1, 30, 4]
    q, kc, vc, lens, ptr, idx = make_case(torch.device("cpu"), torch.float32, rows, hq, hkv, d, ps, seed=3,
                                          nan_unused=False)
    tables = [idx[ptr[i]: ptr[i + 1]].tolist() for i in range(len(rows))]
    slots = [t[(n - 1) // ps] * ps + (n - 1) % ps for t, n in zip(tables, rows, strict=True)]
    meta = AttentionMetadata(q_lens=[1] * len(rows), kv_lens=rows, slot_mapping=torch.tensor(slots),
                             page_tables=tables, page_size=ps)
    ta = TorchAttention("cpu")
    ta.plan(meta)
    ref = ta.forward(q, kc[slots], vc[slots], kc.clone(), vc.clone(), d ** -0.5)
    got = da.decode_attention_ref(q, kc, vc, lens, ptr, idx, ps, d ** -0.5)
    assert (got - ref).abs().max() < 1e-5


def test_row_segments():
    from specbench.engine.attention.flashinfer import row_segments

    # a 3-row causal span over 7 keys, a decode row, three padding rows on the dummy page (one shared segment)
    segs, pages = row_segments([3, 1, 1, 1, 1], [7, 5, 1, 1, 1], [[4, 2], [9, 1, 6], [0], [0], [0]], 4, True, 16)
    assert segs == [(0, 3, 5, 1, 0), (3, 1, 5, 1, 2), (4, 3, 1, 0, 4)] and pages == [4, 2, 9, 1, 0]
    segs, _ = row_segments([3, 1], [7, 5], [[4, 2], [9, 1]], 4, False, 16)
    assert segs == [(0, 3, 7, 0, 0), (3, 1, 5, 0, 2)]
    segs, _ = row_segments([5], [9], [[4, 2, 3]], 4, True, 2)  # a span longer than the quantum: cut
    assert segs == [(0, 2, 5, 1, 0), (2, 2, 7, 1, 0), (4, 1, 9, 1, 0)]
    segs, _ = row_segments([1] * 5, [1] * 5, [[0]] * 5, 4, True, 2)  # padding rows: segments of <= quantum
    assert [c for _, c, _, _, _ in segs] == [2, 2, 1]
    with pytest.raises(ValueError, match="not a valid span"):
        row_segments([4], [3], [[1]], 4, True, 16)  # more queries than keys
    with pytest.raises(ValueError, match="not a valid span"):
        row_segments([1], [9], [[1, 2]], 4, True, 16)  # 9 keys need 3 pages


@pytest.mark.parametrize("causal", [True, False])
def test_span_reference_matches_torch_backend(causal):
    """The span attention reference over row_segments' layout == TorchAttention on a padded step of verify spans
    (causal) or drafter blocks (not), padding rows on the dummy page included."""
    from rows_cases import rows_step

    from specbench.engine.attention.flashinfer import row_segments

    ps, hq, hkv, d, pages = 4, 8, 2, 32, 40
    g = torch.Generator().manual_seed(1)
    kc = torch.randn((pages + 1) * ps, hkv, d, generator=g)
    vc = torch.randn((pages + 1) * ps, hkv, d, generator=g)
    perm = torch.randperm(pages, generator=g).tolist()
    tables = [perm[0:12], perm[12:20], perm[20:40]]
    meta, q, k, v = rows_step([(5, 40), (1, 17), (16, 77)], tables, ps, pages, 4, hq, hkv, d, causal, g)
    ta = TorchAttention("cpu")
    ta.plan(meta)
    ref = ta.forward(q, k, v, kc, vc, d ** -0.5)  # stores k, v in the caches first
    segs, idx = row_segments(meta.q_lens, meta.kv_lens, meta.page_tables, ps, causal, 8)  # the 16-row span: cut
    i32 = torch.int32
    got = da.span_attention_ref(q, kc, vc, torch.tensor(segs, dtype=i32), torch.tensor(idx, dtype=i32), ps, d ** -0.5)
    assert (got - ref).abs().max() < 1e-5


def test_fixed_page_buffers_hold_shared_prefix_pages(monkeypatch):
    """Requests that share prefix pages (engine/prefix_share.py) each list them: a step's page lists can exceed
    the pool, so the fixed decode and row buffers are sized per request (`seq_pages`), not by the pool. Eight
    requests on one 30-page prefix of a 40-page pool: 8 x 31 page ids, planned without error (host side only)."""
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: None, BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: None))
    from specbench.engine.attention.flashinfer import FlashInferAttention

    ps, pool = 16, 40
    fa = FlashInferAttention("cpu", 8, 2, 32, torch.float32, pool + 1, workspace_bytes=16, decode_attention="triton",
                             seq_pages=33)
    prefix = list(range(30))
    tables = [prefix + [30 + i] for i in range(8)]
    lens = [30 * ps + 5] * 8
    meta = AttentionMetadata(q_lens=[1] * 8, kv_lens=lens, slot_mapping=torch.zeros(8, dtype=torch.long),
                             page_tables=tables, page_size=ps)
    fa.prepare_replay(meta)
    assert fa._tri is not None and fa._tri[2][:8 * 31].tolist() == [p for t in tables for p in t]
    meta = AttentionMetadata(q_lens=[16] * 8, kv_lens=lens, slot_mapping=torch.zeros(128, dtype=torch.long),
                             page_tables=tables, page_size=ps)
    fa.plan_rows(meta, 16)
    assert fa._span is not None and fa._span[1][:8 * 31].tolist() == [p for t in tables for p in t]
    assert fa.page_room(8) < 8 * (pool + 1)  # per request, not the pool per request


SCRIPT = PRELUDE + textwrap.dedent('''

    sys.path.insert(0, sys.argv[1])
    import random, types
    from decode_attention_cases import check
    from specbench.kernels import decode_attention as da

    cpu, f32 = torch.device("cpu"), torch.float32
    worst = 0.0
    fixed = [  # (rows, hq, hkv, d, ps, splits, tile)
        ([1], 4, 2, 32, 4, 5, None),  # one key: 4 of 5 splits empty
        ([200], 8, 2, 64, 16, 3, None),
        ([200], 4, 2, 32, 4, 1, None),  # one split: the split kernel writes the output itself
        ([17, 0, 64], 4, 2, 32, 4, 8, 16),  # a length-0 row: zeros, no NaN
        ([5, 190, 33, "dummy", 0], 8, 2, 64, 16, 16, None),  # padding rows of a graph bucket
        ([31, 32, 33], 8, 2, 32, 16, 2, 32),  # tile and page boundaries
    ]
    for i, (rows, hq, hkv, d, ps, splits, tile) in enumerate(fixed):
        for fused in (True, False):  # the merge inside the split kernel, and the separate merge launch
            worst = max(worst, check(da, cpu, f32, rows, hq, hkv, d, ps, splits, 1e-4, seed=i, tile=tile, fused=fused))
    # NaN on the dummy page: the padding row's output is its own business, the real rows stay exact
    worst = max(worst, check(da, cpu, f32, [40, "dummy", 7], 4, 2, 32, 4, 4, 1e-4, seed=9, nan_dummy=True))
    rng = random.Random(5)
    for i in range(6):
        b = rng.randint(1, 5)
        rows = [rng.randint(1, 200) for _ in range(b)]
        hq, d, ps = rng.choice((4, 8)), rng.choice((32, 64)), rng.choice((4, 16))
        splits = rng.choice((1, 2, 4, da.num_splits(b, 2, 200)))
        worst = max(worst, check(da, cpu, f32, rows, hq, 2, d, ps, splits, 1e-4, seed=100 + i))
    print(f"KERNEL OK max abs err {worst:.3g}")

    # FlashInferAttention's Triton decode path; the stub wrappers are built but never run on decode steps
    sys.modules["flashinfer"] = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: None,
                                                      BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: None)
    os.environ["SPECBENCH_DECODE_SPLITS"] = "4"
    from specbench.engine.attention.base import AttentionMetadata
    from specbench.engine.attention.flashinfer import FlashInferAttention
    from specbench.engine.attention.torch_ref import TorchAttention

    ps, hq, hkv, d, pages = 4, 8, 2, 32, 40
    dummy = pages  # the runner's extra page
    g = torch.Generator().manual_seed(0)
    kc = torch.randn((pages + 1) * ps, hkv, d, generator=g)
    vc = torch.randn((pages + 1) * ps, hkv, d, generator=g)
    perm = torch.randperm(pages, generator=g).tolist()
    tables = [perm[0:12], perm[12:20], perm[20:40]]
    fa = FlashInferAttention("cpu", hq, hkv, d, f32, pages + 1, workspace_bytes=16, decode_attention="triton")

    def step(lens, b, graph):
        n = len(lens)
        pad = b - n
        slots = [t[(x - 1) // ps] * ps + (x - 1) % ps for t, x in zip(tables, lens)] + [dummy * ps] * pad
        meta = AttentionMetadata(q_lens=[1] * b, kv_lens=list(lens) + [1] * pad, slot_mapping=torch.tensor(slots),
                                 page_tables=[t[: -(-x // ps)] for t, x in zip(tables, lens)] + [[dummy]] * pad,
                                 page_size=ps)
        q, k, v = (torch.randn(b, h, d, generator=g) for h in (hq, hkv, hkv))
        ta = TorchAttention("cpu")
        ta.plan(meta)
        kr, vr = kc.clone(), vc.clone()
        ref = ta.forward(q, k, v, kr, vr, d ** -0.5)
        if graph == "capture":
            fa.prepare_capture(meta)
        elif graph == "replay":
            fa.prepare_replay(meta)
        else:
            fa.plan(meta)
        out = fa.forward(q, k, v, kc, vc, d ** -0.5)
        assert torch.equal(kc, kr) and torch.equal(vc, vr), "K/V store"
        err = (out[:n] - ref[:n]).abs().max().item()
        assert err < 1e-4 and bool(torch.isfinite(out).all()), (lens, b, graph, err)
        return fa._tri[0].data_ptr()

    step([5, 30, 77], 3, None)
    p0 = step([6, 31, 1], 4, "capture")
    p1 = step([7, 32, 80], 4, "replay")  # longer: a new page for the third request, read from the same buffer
    assert p0 == p1 == fa._tri_bufs[4].data_ptr(), "the bucket's metadata buffer moved"
    step([8], 1, None)
    assert len(fa._tri_bufs) == 1 and set(k[-1] for k in fa._tri_scratch) == {4}
    print("BACKEND OK")

    # span attention (kernels) and plan_rows (the backend): padded steps of spans of any length
    from rows_cases import rows_step

    from specbench.engine.attention.flashinfer import row_segments

    i32 = torch.int32
    for causal in (True, False):
        for spans, quantum, splits in (([(4, 12), (1, 31), (16, 80)], 16, 1), ([(16, 16), (3, 31), (2, 9)], 16, 4),
                                       ([(7, 40), (1, 5)], 4, 3), ([(2, 9), (1, 5), (16, 80)], 16, 16)):
            meta, q, k, v = rows_step(spans, tables, ps, dummy, 3, hq, hkv, d, causal, g)
            ta = TorchAttention("cpu")
            ta.plan(meta)
            kr, vr = kc.clone(), vc.clone()
            ref = ta.forward(q, k, v, kr, vr, d ** -0.5)
            segs, idx = row_segments(meta.q_lens, meta.kv_lens, meta.page_tables, ps, causal, quantum)
            st = torch.tensor(segs + [(0, 0, 0, 0, 0)] * 2, dtype=i32)  # two unused segments: skipped
            out = da.span_attention(q, kr, vr, st, torch.tensor(idx, dtype=i32), ps, d ** -0.5, splits, quantum)
            err = (out - ref).abs().max().item()
            assert err < 1e-4, ("kernel", spans, causal, quantum, splits, err)
            fa.plan_rows(meta, quantum)
            out = fa.forward(q, k, v, kc, vc, d ** -0.5)
            assert torch.equal(kc, kr) and torch.equal(vc, vr), "K/V store"
            err = (out - ref).abs().max().item()
            assert err < 1e-4, ("backend", spans, causal, quantum, err)
    buf = fa._row_bufs[(meta.num_tokens, 16, 2 * -(-meta.num_tokens // 16) + 1)]  # (rows, quantum, segment room)
    assert fa._span[0].data_ptr() == buf.data_ptr(), "the row count's buffer"
    # a prefill-mixed layout (EngineConfig.whole_prefill): a 24-token chunk (and a later 12-token chunk of a longer
    # prompt) beside decode and verify spans, in the room graphs.mixed_cap gives its row count, which the verify
    # layout's room (2 x rows / 16 + 1) cannot hold: every decode span is a segment of its own
    from specbench.engine.graphs import mixed_cap

    mixed = [(24, 24), (1, 9), (1, 5), (1, 7), (16, 40), (12, 30), (1, 13), (1, 11)]
    cut, mtables = 0, []
    for _, kl in mixed:  # each request its own pages (38 of the 40)
        n = -(-kl // ps)
        mtables.append(perm[cut: cut + n])
        cut += n
    meta, q, k, v = rows_step(mixed, mtables, ps, dummy, 5, hq, hkv, d, True, g)
    ta = TorchAttention("cpu")
    ta.plan(meta)
    kr, vr = kc.clone(), vc.clone()
    ref = ta.forward(q, k, v, kr, vr, d ** -0.5)
    cap = mixed_cap(meta.num_tokens, len(mixed))
    segs, _ = row_segments(meta.q_lens, meta.kv_lens, meta.page_tables, ps, True, 16)
    assert 2 * -(-meta.num_tokens // 16) + 1 < len(segs) <= cap, (len(segs), cap)
    fa.plan_rows(meta, 16, cap)
    out = fa.forward(q, k, v, kc, vc, d ** -0.5)
    err = (out - ref).abs().max().item()
    assert err < 1e-4, ("mixed", err)
    print("ROWS OK")
''')


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed: the interpreter checks need it")
def test_decode_attention_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("SPECBENCH_DECODE_SPLITS", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ROWS OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_decode_attention_switch(monkeypatch):
    from specbench.engine import ConfigError, EngineConfig
    from specbench.harness import engines
    from specbench.harness.adapters import local

    monkeypatch.delenv("SPECBENCH_DECODE_ATTENTION", raising=False)
    assert EngineConfig(model="m").decode_attention == "triton"  # the split-K kernel is the default
    assert EngineConfig(model="m", decode_attention="flashinfer").decode_attention == "flashinfer"
    monkeypatch.setenv("SPECBENCH_DECODE_ATTENTION", "flashinfer")  # the environment's default
    assert EngineConfig(model="m").decode_attention == "flashinfer"
    monkeypatch.setenv("SPECBENCH_GEMV", "0")
    assert EngineConfig(model="m").gemv is False and EngineConfig(model="m", gemv=True).gemv
    monkeypatch.delenv("SPECBENCH_GEMV")
    assert EngineConfig(model="m").gemv is True
    assert engines.parse_engine("local,gemv=0").options["gemv"] == "0"
    with pytest.raises(ConfigError, match=r"decode_attention='xformers' is invalid: expected flashinfer or triton"):
        EngineConfig(model="m", decode_attention="xformers")
    with pytest.raises(engines.EngineStringError, match=r"decode_attention='fa3' is invalid: expected one of "
                                                          r"flashinfer, triton"):
        engines.parse_engine("local,decode_attention=fa3")
    assert engines.parse_engine("local,decode_attention=triton").options["decode_attention"] == "triton"
    seen = {}
    monkeypatch.setattr(local.LocalAdapter, "from_dirs", classmethod(lambda cls, *a, **kw: seen.update(kw)))
    monkeypatch.setattr(engines, "bundled", lambda: ("target", None))
    engines.build_adapter("local,spec=off,decode_attention=triton")
    assert seen["decode_attention"] == "triton"


def test_flashinfer_prefill_takes_fa2_where_fa3_has_no_kernels():
    """FlashInfer's SM90 prefill instantiates head dims 64/128/256 only; the tiny pair's 32 on an H100 failed every
    request at JIT build time until the wrapper was told FA2 (tests/gpu/test_accept_trace_gpu.py's bf16 cases)."""
    from specbench.engine.attention.flashinfer import prefill_backend

    assert [prefill_backend(d) for d in (32, 64, 96, 128, 256)] == ["fa2", "auto", "fa2", "auto", "auto"]
