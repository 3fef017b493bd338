"""CPU proof of issue 8's fast paths (fp32, the tiny pair): the padded piecewise verify and draft runners
(the bodies the CUDA graphs capture, run eagerly here) against the simple paths, the capture-shape
discipline (the short-then-long gate, with the seed engine's bug emulated to show the gate has teeth),
the switches, the drafter's memory reservation and the batched host sync of greedy picks.

On CPU the graph runners only run when a test asks (`runner.use_graph_runner = True`): capture is always
off off CUDA, so the same segments run eagerly. The device half (captured replay, bf16, FlashInfer, the
regret gate, OOM at batch 64) is tests/gpu/test_spec_gpu.py.
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
from span_helpers import verify_spans

from specbench.engine import LLM, EngineConfig, SamplingParams
from specbench.engine.config import ConfigError, ModelConfig
from specbench.engine.graphs import VerifyGraphs, row_ladder
from specbench.engine.memory import draft_weight_bytes, plan_memory, tensor_bytes
from specbench.engine.scheduler import Span
from specbench.engine.spec.dflash_graphs import DraftGraphs
from specbench.kernels import triton_importable

N_NEW = 20
BUDGETS = [1, 2, 3, 6, 11, 20]  # staggered: truncated spans and decode spans ride with full verify spans


@pytest.fixture(scope="module")
def prompts(gsm8k_prompts):
    return gsm8k_prompts[: len(BUDGETS)]


@pytest.fixture(scope="module")
def params():
    return [SamplingParams(max_tokens=b, ignore_eos=True) for b in BUDGETS]


@pytest.fixture(scope="module")
def baseline(tiny_target, prompts, params):
    """Spec-off greedy, one request at a time (the oracle)."""
    llm = LLM(tiny_target, num_pages=256)
    return [llm.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params, strict=True)]


def spec_llm(tiny_target, tiny_draft, fast: bool = True, **kw) -> LLM:
    """A DFlash engine; fast=True routes it through the padded graph runners (eager on CPU)."""
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256, max_num_seqs=8, **kw)
    if fast:
        eng = llm.engine
        eng.runner.use_graph_runner = True
        eng.proposer.use_graphs = eng.cfg.draft_graph
    return llm


def ready_requests(llm: LLM, prompts: list[str], n: int) -> list:
    eng = llm.engine
    for i, p in enumerate(prompts[:n]):
        eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True), rid=f"ready-{i}")
    while eng.scheduler.waiting or any(r.in_prefill or not r.output_ids for r in eng.scheduler.running):
        eng.step()
    return list(eng.scheduler.running)


@pytest.fixture(scope="module")
def ready(tiny_target, tiny_draft, prompts):
    llm = spec_llm(tiny_target, tiny_draft, fast=False)
    return llm, ready_requests(llm, prompts, 5)


def blas_row_invariant(model, m: int, padded: int) -> bool:
    """Does this machine's GEMM give row i the same bits at m rows as at `padded` rows, for every weight
    of the step? (MKL takes a small-matrix path below 4 rows whose fp32 sums differ by ~1e-5.)"""
    g = torch.Generator().manual_seed(m)
    ws = [w for ly in model.layers for w in (ly.qkv_w, ly.o_w, ly.gate_up_w, ly.down_w)] + [model.lm_head_w]
    for w in ws:
        x = torch.randn(m, w.shape[1], generator=g)
        xp = torch.cat([x, torch.zeros(padded - m, w.shape[1])])
        if not torch.equal(torch.nn.functional.linear(x, w), torch.nn.functional.linear(xp, w)[:m]):
            return False
    return True


def assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("lens", [["S", "S", "S", "S"], ["S", 3, 1], ["S"], [2], ["S", 1, 1, "S", 5]])
def test_padded_verify_is_bit_identical_to_plain_forward(ready, lens):
    """Real rows of the padded piecewise body == the plain forward, logits and taps, bit for bit (fp32)
    wherever the BLAS itself is row-count invariant (probed); argmax-identical and within 1e-5 relative where
    it is not (fewer than 4 real rows with MKL)."""
    llm, reqs = ready
    eng = llm.engine
    s_full = eng.k + 1
    lens = [s_full if x == "S" else x for x in lens]
    spans = verify_spans(eng, reqs[: len(lens)], lens)
    tap = eng.proposer.tap_layers
    rows = list(range(sum(lens)))
    plain, plain_taps = eng.runner.forward(spans, rows, tap)
    plain, plain_taps = plain.clone(), plain_taps.clone()
    vg = VerifyGraphs(eng.runner, tap, (s_full,), capture=False)
    b, span = vg.key(spans)
    got, taps = vg.run(spans, rows)
    assert span == s_full and b >= len(spans) and vg.stats["padded_rows"] == b * span - sum(lens)
    exact = blas_row_invariant(eng.model, sum(lens), b * span)
    if sum(lens) >= 4:
        assert exact, "MKL was row-count invariant from 4 rows up when this test was written"
    assert_same(got, plain, exact)
    assert_same(taps, plain_taps, exact)
    assert got.argmax(-1).tolist() == plain.argmax(-1).tolist()
    sub = rows[1::2]  # a subset of rows: projected alone (graph_logits off), or gathered from the same buffer
    assert_same(vg.run(spans, sub)[0], got[sub], exact and blas_row_invariant(eng.model, len(sub), len(rows)))
    assert vg.stack.shapes == {b * span: b * span}


def test_verify_key_buckets_spans_and_rows(ready):
    llm, reqs = ready
    eng = llm.engine
    s_full = eng.k + 1
    vg = VerifyGraphs(eng.runner, (), (s_full,), capture=False, buckets=[1, 2, 4], padded_rows="bucket")
    spans = verify_spans(eng, reqs[:3], [2, 2, 2])
    assert vg.key(spans[:2]) == (2, s_full)
    assert vg.key(spans) == (4, s_full)
    assert vg.key(spans + spans[:2]) is None  # more spans than the largest bucket: plain forward
    chunk = Span(reqs[3], list(range(2 * s_full + 1)), 0, "prefill")  # a prefill chunk needs rows, not a slot
    assert vg.key([chunk]) == (4, s_full) and vg.key(spans[:1] + [chunk]) == (4, s_full)
    assert vg.key([Span(reqs[3], list(range(4 * s_full + 1)), 0, "prefill")]) is None  # too many rows
    assert VerifyGraphs(eng.runner, (), (3,), capture=False).key(verify_spans(eng, reqs[:1], [4])) is None


def test_row_ladder_bounds_the_padding():
    for top in (16, 100, 128, 600, 1024, 2048, 2100):
        lad = row_ladder(top)
        assert lad == sorted(set(lad)) and lad[-1] == top and lad[0] <= 16
        for real in range(1, top + 1):
            n = next(x for x in lad if x >= real)
            assert n - real < 16 or (n - real) <= n / 5, (top, real, n)  # under 16 rows, or a fifth of the step


def test_ladder_key_pads_prefill_steps_to_the_ladder(ready):
    """With the ladder, a step with a prefill chunk runs at the smallest ladder row count that holds it (up to
    max_num_batched_tokens), whatever its span count; verify/decode-only steps keep bucket x span."""
    llm, reqs = ready
    eng = llm.engine
    s_full = eng.k + 1
    vg = VerifyGraphs(eng.runner, (), (s_full,), capture=False, buckets=[1, 2, 4], padded_rows="ladder")
    top = max(4 * s_full, eng.cfg.max_num_batched_tokens)
    assert vg.stack.max_rows == top and vg.ladder == row_ladder(top)
    spans = verify_spans(eng, reqs[:3], [2, 2, 2])
    assert vg.key(spans) == (4, s_full)  # no prefill: as before
    chunk = Span(reqs[3], list(range(37)), 0, "prefill")
    assert vg.key([chunk]) == (48, 1)
    assert vg.key(spans + [chunk]) == (48, 1)  # 43 rows in 4 spans
    assert vg.key(spans + spans[:2] + [chunk]) == (48, 1)  # more spans than the largest bucket: still padded
    long = Span(reqs[3], list(range(4 * s_full + 1)), 0, "prefill")
    assert vg.key([long]) == (next(x for x in vg.ladder if x >= len(long.tokens)), 1)
    assert vg.key([Span(reqs[3], list(range(top + 1)), 0, "prefill")]) is None  # past the ladder: plain forward
    assert set(vg.row_counts()) == {b * s_full for b in (1, 2, 4)} | set(vg.ladder)


@pytest.mark.parametrize("graph_logits", [False, True])
def test_ladder_prefill_step_equals_plain_forward(ready, graph_logits):
    """A prefill-mixed step padded to the ladder gives the plain forward's logits for the rows it reads
    (the completing chunk's last row, the decode rows), whether the logits are projected after the replay
    (graph_logits=False) or inside the tail for every padded row."""
    llm, reqs = ready
    eng = llm.engine
    s_full = eng.k + 1
    spans = verify_spans(eng, reqs[:2], [s_full, 1])
    chunk = Span(reqs[3], reqs[3].all_ids[:reqs[3].num_computed], 0, "prefill")
    mixed = spans + [chunk]
    real = sum(len(s.tokens) for s in mixed)
    rows = list(range(s_full + 1)) + [real - 1]
    plain, _ = eng.runner.forward(mixed, rows, ())
    plain = plain.clone()
    vg = VerifyGraphs(eng.runner, (), (s_full,), capture=False, padded_rows="ladder", graph_logits=graph_logits)
    key = vg.key(mixed)
    assert key is not None and key[1] == 1 and key[0] >= real
    got, _ = vg.run(mixed, rows, key)
    # the body runs at key[0] rows; the vocabulary projection at len(rows) rows (plain, graph_logits off) or
    # at key[0] rows then gathered (graph_logits on)
    exact = blas_row_invariant(eng.model, real, key[0]) and \
        (not graph_logits or blas_row_invariant(eng.model, len(rows), key[0]))
    assert_same(got, plain, exact)
    assert (vg.stack.logits is None) != graph_logits and vg.stats["padded_rows"] == key[0] - real


@pytest.mark.parametrize("n", [1, 3, 5])
def test_padded_draft_is_bit_identical_to_plain_draft(ready, n):
    llm, reqs = ready
    eng = llm.engine
    spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in reqs[:n]]
    plain = eng.proposer.draft_logits_plain(spans).clone()
    dg = DraftGraphs(eng.proposer, capture=False)
    got = dg.run(spans)
    blk = eng.proposer.block
    assert got.shape == plain.shape
    assert_same(got, plain, blas_row_invariant(eng.model, n * blk, dg.bucket(n) * blk))
    assert got.argmax(-1).tolist() == plain.argmax(-1).tolist()
    assert dg.stats["padded_rows"] == (dg.bucket(n) - n) * blk


def test_fast_paths_are_lossless_and_draft_the_same(tiny_target, tiny_draft, prompts, params, baseline):
    """All fast paths on (padded verify + padded draft, batched) vs the simple spec path and spec off:
    the same tokens, the same accepted runs; truncated spans and decode spans were padded, not refused."""
    fast = spec_llm(tiny_target, tiny_draft)
    simple = spec_llm(tiny_target, tiny_draft, fast=False)
    mixed = [p.with_(logprobs=2) if i == 2 else p for i, p in enumerate(params)]  # one span-1 neighbour
    of, os_ = fast.generate(prompts, mixed), simple.generate(prompts, mixed)
    for f, s, want in zip(of, os_, baseline, strict=True):
        assert f.output_ids == s.output_ids == want
        assert f.spec["accepted_runs"] == s.spec["accepted_runs"]
    stats = fast.engine.fast_path_stats()
    v, d = stats["verify"], stats["draft"]
    assert v["mode"] == d["mode"] == "eager" and v["steps"] > 0 and d["steps"] > 0
    assert v["padded_rows"] > 0  # truncated and decode spans were padded
    vg = fast.engine.runner.verify_graphs
    assert set(vg.stack.shapes) <= set(vg.row_counts())  # bucket x span, or the ladder (prefill-mixed steps)
    assert v["captured_rows"] == d["captured_rows"] == []  # nothing is captured off CUDA
    assert sum(r for runs in (o.spec["accepted_runs"] for o in of) for r in runs) > 0


def test_prefill_joining_verify_steps_takes_the_padded_runner(tiny_target, tiny_draft, baseline, prompts, params):
    """Closed-loop arrivals: short prompts join while others verify, so steps mix prefill chunks with
    verify and decode spans; they run padded (rows bucketed), losslessly; spec off too (16-row quantum)."""
    g = torch.Generator().manual_seed(3)
    short = [torch.randint(10, 4000, (5 + 3 * i,), generator=g).tolist() for i in range(5)]
    sp = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
    plain = LLM(tiny_target, num_pages=256)
    want = [plain.generate([p], q)[0].output_ids for p, q in zip(short, sp, strict=True)]
    for llm in (spec_llm(tiny_target, tiny_draft), LLM(tiny_target, num_pages=256, max_num_seqs=8),
                spec_llm(tiny_target, tiny_draft, padded_rows="bucket", graph_logits=True),
                LLM(tiny_target, num_pages=256, max_num_seqs=8, padded_rows="bucket")):
        eng = llm.engine
        eng.runner.use_graph_runner = True
        got: dict[str, list[int]] = {}
        for i, (p, q) in enumerate(zip(short, sp, strict=True)):  # one arrival per step
            eng.add_request(p, q, rid=f"a{i}")
            for o in eng.step():
                got[o.rid] = o.output_ids
        while eng.has_unfinished():
            for o in eng.step():
                got[o.rid] = o.output_ids
        assert [got[f"a{i}"] for i in range(5)] == want
        st = eng.fast_path_stats()["verify"]
        assert st["prefill_steps"] >= 3 and st["padded_rows"] > 0


class FrozenFirstShape(VerifyGraphs):
    """The seed engine's bug, emulated on CPU: graphs keyed by batch bucket alone, captured at the first
    step's row count; a later replay with more rows leaves the rows past the capture holding the previous
    step's logits (a captured GEMM bakes its row count into the launch)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.frozen: dict[int, int] = {}

    def run(self, spans, logit_rows, key=None, pending=None):
        if any(s.kind == "prefill" for s in spans):  # the seed's graphs served verify steps only
            return super().run(spans, logit_rows, key, pending)
        b = (key or self.key(spans))[0]
        real = sum(len(s.tokens) for s in spans)
        captured = self.frozen.setdefault(b, real)
        stale = self.stack.logits[captured:real].clone()
        out, taps = super().run(spans, logit_rows, key, pending)
        if real > captured:
            out = out.clone()
            out[captured:real] = stale
        return out, taps


def _short_then_long(llm: LLM, prompts) -> tuple[list[int], list[int]]:
    short = llm.generate([prompts[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0].output_ids
    long = llm.generate([prompts[1]], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    assert max(long.spec["accepted_runs"]) >= 2, "the long request never accepted 2 drafts: gate untested"
    return short, long.output_ids


def test_short_then_long_gate(tiny_target, tiny_draft, prompts):
    """A max_tokens=3 request first meets bucket 1 with a truncated span (2 rows), then a long request
    verifies full spans in the same bucket. Keyed by row count and padded, the long one stays lossless;
    with the seed's keying (bucket alone, frozen at the first row count) it diverges."""
    plain = LLM(tiny_target, num_pages=256)
    want_short = plain.generate([prompts[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0].output_ids
    want_long = plain.generate([prompts[1]], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0].output_ids

    good = spec_llm(tiny_target, tiny_draft)
    assert _short_then_long(good, prompts) == (want_short, want_long)
    vg = good.engine.runner.verify_graphs
    span = good.engine.k + 1
    assert vg.stack.shapes[span] == span and vg.stats["padded_rows"] >= span - 2  # bucket 1: always S rows

    bad = spec_llm(tiny_target, tiny_draft)
    r = bad.engine.runner
    r.verify_graphs = FrozenFirstShape(r, bad.engine.proposer.tap_layers, (span,), capture=False,
                                       graph_logits=True)  # the emulation reads the static logits buffer
    short, long = _short_then_long(bad, prompts)
    assert short == want_short and r.verify_graphs.frozen == {1: 2}
    assert long != want_long, "the emulated stale replay did not change the output: the gate has no teeth"


def test_switches_take_the_simple_paths(tiny_target, tiny_draft, prompts, params, baseline):
    off = spec_llm(tiny_target, tiny_draft, verify_graph=False, draft_graph=False)
    outs = off.generate(prompts[:3], params[:3])
    assert [o.output_ids for o in outs] == baseline[:3]
    assert off.engine.runner.verify_graphs is None and off.engine.proposer.graphs is None
    assert off.engine.describe()["verify_graph"] is False
    serial = spec_llm(tiny_target, tiny_draft, batched_draft=False)
    outs = serial.generate(prompts[:3], params[:3])
    assert [o.output_ids for o in outs] == baseline[:3]
    blk = serial.engine.proposer.block
    assert serial.engine.proposer.graphs.stack.shapes == {blk: blk}  # one request per draft: bucket 1


def test_memory_plan_reserves_the_drafter(tiny_target, tiny_draft):
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=64)
    eng = llm.engine
    mem = eng.describe()["memory"]
    assert mem["source"] == "explicit" and mem["num_pages"] == 64
    assert mem["draft_bytes_per_token"] > 0 and mem["bytes_per_token"] > mem["draft_bytes_per_token"]
    # computed from the config before loading == counted from the loaded tensors
    assert mem["reserved"]["draft_weights"] == mem["measured"]["draft_weights"] == \
        tensor_bytes(eng.draft_model.parameters())
    assert mem["measured"]["kv_pool"] + mem["measured"]["draft_kv"] == mem["kv_bytes"]
    assert mem["reserved"]["draft_scratch"] > 0
    report = eng.memory_report()
    assert report["measured"]["draft_weights"] == mem["measured"]["draft_weights"]


def test_gpu_plan_shrinks_the_pool_for_the_drafter(tiny_target, tiny_draft, monkeypatch):
    """The GPU sizing formula, with the device's free/total memory faked: speculation (drafter K/V per
    token, drafter scratch, graph buffers) leaves fewer pages than spec off; eager drops the graph buffers."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 40 * gib))
    tcfg, dcfg = ModelConfig.from_dir(tiny_target), ModelConfig.from_dir(tiny_draft)
    cfg = EngineConfig(model=tiny_target, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
                       max_num_seqs=64)
    big = 10**6
    off = plan_memory(cfg, tcfg, None, torch.bfloat16, big)
    on = plan_memory(cfg, tcfg, dcfg, torch.bfloat16, big, k=7)
    eager = plan_memory(cfg.with_(eager=True), tcfg, dcfg, torch.bfloat16, big, k=7)
    assert off.source == on.source == "profile"
    assert on.num_pages < eager.num_pages < off.num_pages
    assert {"draft_weights", "draft_scratch", "verify_graph_static", "draft_graph_static", "verify_graph_pool",
            "draft_graph_pool", "activations"} <= set(on.reserved)
    assert "verify_graph_pool" not in eager.reserved and "verify_graph_static" in eager.reserved
    assert "draft_weights" not in off.reserved and "verify_graph_static" in off.reserved  # prefill-mixed steps
    fixed = sum(v for k, v in on.reserved.items() if k != "draft_weights")  # weights are resident already
    assert on.budget == int(40 * gib * 0.5) - 10 * gib - fixed
    assert on.num_pages == on.budget // (on.bytes_per_token * cfg.page_size)
    assert on.reserved["draft_weights"] == draft_weight_bytes(dcfg, tcfg, torch.bfloat16)


def test_gpu_plan_refuses_a_pool_too_small_for_one_request(tiny_target, monkeypatch):
    """A second engine started after a first one took the device (or too low a utilization) used to get a
    one-page pool and fail every request at admission; now the engine refuses to start and says why."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 40 * gib))  # 39 GiB in use
    tcfg = ModelConfig.from_dir(tiny_target)
    cfg = EngineConfig(model=tiny_target, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.85)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0\.85: the KV pool would get .* num_pages"):
        plan_memory(cfg, tcfg, None, torch.bfloat16, 4096)
    assert plan_memory(cfg.with_(num_pages=8), tcfg, None, torch.bfloat16, 4096).num_pages == 8  # explicit wins


def test_greedy_picks_use_one_batched_host_transfer(tiny_target, tiny_draft, prompts, params, baseline, monkeypatch):
    """Greedy decode, verify and prefill completion read the step's batched argmax: the per-request
    `select` (one device sync each) is never called for a greedy request (the accept phase has none to
    fall back to)."""
    import specbench.engine.accept_step as accept_mod
    import specbench.engine.sampler as sampler_mod

    assert not hasattr(accept_mod, "select")
    real = sampler_mod.select

    def guarded(logits, p, gen):
        assert not p.greedy, "a greedy pick took the per-request path"
        return real(logits, p, gen)

    monkeypatch.setattr(sampler_mod, "select", guarded)
    for llm in (LLM(tiny_target, num_pages=256), spec_llm(tiny_target, tiny_draft)):
        assert [o.output_ids for o in llm.generate(prompts[:4], params[:4])] == baseline[:4]


INTERPRETER_SPEC = PRELUDE + textwrap.dedent('''

    sys.path.insert(0, sys.argv[3])
    from interp import StoredKV
    from specbench.engine import LLM, SamplingParams
    from specbench.kernels.ops import TritonOps

    target, draft = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 4000, (6 + 4 * i,), generator=g).tolist() for i in range(2)]
    sp = [SamplingParams(max_tokens=9 + 4 * i, ignore_eos=True) for i in range(2)]
    plain = LLM(target, num_pages=128)
    want = [plain.generate([p], q)[0].output_ids for p, q in zip(prompts, sp)]
    simple = LLM(target, draft=draft, num_pages=128, max_num_seqs=4)
    runs = [o.spec["accepted_runs"] for o in simple.generate(prompts, sp)]
    fast = LLM(target, draft=draft, num_pages=128, max_num_seqs=4)
    eng = fast.engine
    eng.runner.model.ops = TritonOps()
    eng.runner.backend = StoredKV("cpu")
    eng.runner.use_graph_runner = True
    eng.proposer.use_graphs = True
    outs = fast.generate(prompts, sp)
    assert [o.output_ids for o in outs] == want, ([o.output_ids for o in outs], want)
    assert [o.spec["accepted_runs"] for o in outs] == runs, ([o.spec["accepted_runs"] for o in outs], runs)
    st = eng.fast_path_stats()
    assert st["verify"]["steps"] > 0 and st["draft"]["steps"] > 0, st
    print("SPEC ENGINE OK", runs)
''')


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed: the interpreter checks need it")
def test_fast_spec_engine_with_triton_ops_under_interpreter(tiny_target, tiny_draft):
    """The GPU op set on the padded runners: Triton q/k norm + RoPE storing K/V itself (target and drafter
    blocks), the K-only kernel for the drafter's context rows, add+RMSNorm and SwiGLU kernels; fp32 under
    the Triton interpreter: the same tokens as spec off, the same accepted runs as the simple spec path."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", INTERPRETER_SPEC, tiny_target, tiny_draft, str(Path(__file__).parent)],
                         env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "SPEC ENGINE OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_engine_string_switches(tiny_target):
    from specbench.harness.engines import EngineStringError, build_adapter, parse_engine

    ad = build_adapter(f"local:{tiny_target},spec=off,eager=1,verify_graph=0,draft_graph=off,attention=torch,"
                       "max_num_seqs=4,triton=0,num_pages=64,decode_tensor_cores=1")
    try:
        d, cfg = ad.engine.describe(), ad.engine.cfg
        assert (d["eager"], d["verify_graph"], d["draft_graph"], d["attention_backend"]) == (True, False, False, "torch")
        assert cfg.max_num_seqs == 4 and cfg.triton is False and cfg.decode_tensor_cores is True
    finally:
        ad.close()
    for bad, msg in (("local,eager=2", "eager='2'"), ("local,attention=xformers", "attention='xformers'"),
                     ("local,max_num_seqs=0", "max_num_seqs='0'")):
        with pytest.raises(EngineStringError, match=msg):
            parse_engine(bad)


def test_spec_step_benchmark_logic_on_cpu(tiny_target, tiny_draft, tmp_path):
    """benchmarks/spec_step.py end to end on CPU: step timings of every variant, the sweep driver (a real
    `specbench sweep` subprocess), the joined table, the targets and the JSON last line."""
    import json

    from specbench.cli.bench import load_benchmark

    mod = load_benchmark("spec_step")
    out = tmp_path / "spec.json"
    res = mod.main(["--device", "cpu", "--target", tiny_target, "--draft", tiny_draft, "--batches", "1,3",
                    "--reps", "1", "--taus", "2,6.5", "--levels", "1", "--rounds", "1", "--prompts-per-level", "1",
                    "--max-tokens", "8", "--dataset", "gsm8k", "--num-pages", "256", "--no-noise-floor",
                    "--sweep-out", str(tmp_path / "sw"), "--out", str(out)])
    rows = res["steps"]["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r[v] > 0 for r in rows for v in (*mod.VERIFY, *mod.DRAFT, "decode"))
    assert set(rows[0]["ideal"]) == {"2.0", "6.5"}
    lv = res["sweep"]["levels"][0]
    assert lv["level"] == 1 and lv["spec-off"] > 0 and set(lv["arms"]) == {"tau2", "tau6.5"}
    assert lv["arms"]["tau6.5"]["tau_measured"] > lv["arms"]["tau2"]["tau_measured"]
    assert all(t["value"] is not None for t in res["targets"].values())
    assert json.loads(out.read_text())["sweep"]["complete"] is True
    text = mod.render(res)
    assert "ideal x at tau 2 / 6.5" in text and "targets (batch 1)" in text


def test_auto_attention_needs_half_precision(monkeypatch):
    """FlashInfer takes bf16/fp16 only: 'auto' on CUDA in fp32 resolves to the torch backend (it raised a
    KeyError from FlashInfer's dtype map before), and an explicit 'flashinfer' falls back with a warning."""
    import specbench.engine.attention.flashinfer as fi
    from specbench.engine.runner import resolve_backend

    monkeypatch.setattr(fi, "flashinfer_available", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, torch.bfloat16) == "flashinfer"
    assert resolve_backend("auto", cuda, torch.float16) == "flashinfer"
    assert resolve_backend("auto", cuda, torch.float32) == "torch"
    assert resolve_backend("flashinfer", cuda, torch.float32) == "torch"
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"
