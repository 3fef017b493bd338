"""Issue 19 on the device: teardown gives the GPU back (a second engine at the default memory share starts in
the same process, no gc.collect), and the fast paths of the engine-speed work equal their simple paths token
for token (incremental detokenization on vs off, bf16 with every graph on).
Run with `pytest -m gpu tests/gpu/test_engine_speed_gpu.py -s` (scripts/gpu.sh tests)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_del_llm_gives_the_gpu_back_and_a_second_engine_starts(tiny):
    from specbench.engine import LLM, SamplingParams

    # Process-level library state (cuBLAS/cuBLASLt workspaces: 64 MiB on the H200) stays with torch after the
    # first engine and is reused by the next: one throwaway engine sets it up before the baseline.
    warm = LLM(tiny[0], draft=tiny[1], device="cuda", dtype="bfloat16", attention_backend="torch")
    warm.generate(["warm-up"], SamplingParams(max_tokens=4, temperature=0.0))
    warm.close()
    del warm
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    gc.disable()  # reference counting alone must free it
    try:
        llm = LLM(tiny[0], draft=tiny[1], device="cuda", dtype="bfloat16", attention_backend="torch")  # head_dim 32
        held = torch.cuda.memory_allocated() - base
        assert held > (16 << 20), f"the engine should hold its weights and KV pool: {held / 2**20:.1f} MiB"
        first = llm.generate(["Question: what is 2 + 2?"], SamplingParams(max_tokens=16, temperature=0.0))
        del llm
        left = torch.cuda.memory_allocated() - base
        print(f"held {held / 2**20:.1f} MiB; after del llm {left / 2**20:.1f} MiB", flush=True)
        assert left < min(held // 8, 64 << 20), f"{left / 2**20:.1f} MiB of {held / 2**20:.1f} still allocated after del"
        again = LLM(tiny[0], draft=tiny[1], device="cuda", dtype="bfloat16", attention_backend="torch")
        second = again.generate(["Question: what is 2 + 2?"], SamplingParams(max_tokens=16, temperature=0.0))
        assert second[0].output_ids == first[0].output_ids
        again.close()
        assert torch.cuda.memory_allocated() - base < (64 << 20)
    finally:
        gc.enable()
        gc.collect()
        torch.cuda.empty_cache()


def test_incremental_detok_equals_full_decode_on_cuda(tiny):
    from specbench.engine import LLM, SamplingParams

    prompts = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?"]
    sp = SamplingParams(max_tokens=48, temperature=0.0, stop=[" the", "."])
    got = {}
    for on in (True, False):
        with LLM(tiny[0], draft=tiny[1], device="cuda", dtype="bfloat16", incremental_detok=on, attention_backend="torch",
                 gpu_memory_utilization=0.3) as llm:
            got[on] = [(o.output_ids, o.text, o.finish_reason) for o in llm.generate(prompts, sp)]
    assert got[True] == got[False]


def test_decode_ahead_equals_its_off_switch_on_cuda(tiny):
    """engine/ahead.py on the device (CUDA graphs, real events and asynchronous copies): every step() call's
    outputs equal the off switch's, greedy and seeded sampling, stops inside a chain, an abort mid-chain."""
    from specbench.engine import LLM, SamplingParams

    prompts = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?", "a b c d"]
    reqs = [SamplingParams(max_tokens=40, temperature=0.0, stop=[" the"], ignore_eos=True),
            SamplingParams(max_tokens=33, temperature=0.0),
            SamplingParams(max_tokens=29, temperature=0.9, top_k=40, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
    got = {}
    for on in (True, False):
        with LLM(tiny[0], device="cuda", dtype="bfloat16", attention_backend="torch", decode_ahead=on,
                 gpu_memory_utilization=0.3) as llm:
            eng = llm.engine
            for i, (p, sp) in enumerate(zip(prompts, reqs, strict=True)):
                eng.add_request(p, sp, rid=f"r{i}")
            calls = []
            while eng.has_unfinished():
                if len(calls) == 12:
                    eng.abort("r1")
                calls.append(sorted((o.rid, tuple(o.new_ids), o.text, o.finished, o.finish_reason)
                                    for o in eng.step()))
            got[on] = calls
            if on:
                assert eng.metrics.decode_ahead_steps > 10, "the chain did not run on CUDA"
    assert got[True] == got[False]


def test_gated_ahead_equals_its_off_switch_on_cuda(tiny):
    """Gated rounds chained ahead (engine/ahead.py, EngineConfig.gated_ahead) on the device: the tiny DFlash pair
    at gate 2 over a batch of 5 that shrinks (max_tokens only, so the schedule is the same either way), the
    decode graphs of the drafter's tap set writing its context inside the step. Every step() call's outputs,
    the accepted drafts and the policy trace equal the off switch's; the chain ran."""
    from specbench.engine import LLM, SamplingParams

    prompts = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?", "a b c d", "x y"]
    got = {}
    for on in (True, False):
        with LLM(tiny[0], draft=tiny[1], device="cuda", dtype="bfloat16", attention_backend="torch", gated_ahead=on,
                 spec_gate=2, gpu_memory_utilization=0.3) as llm:  # head_dim 32: no FlashInfer sm90
            eng = llm.engine
            for i, p in enumerate(prompts):
                eng.add_request(p, SamplingParams(max_tokens=8 + 7 * i, ignore_eos=True), rid=f"r{i}")
            calls = []
            while eng.has_unfinished():
                calls.append(sorted((o.rid, tuple(o.new_ids), o.finished) for o in eng.step()))
            m = eng.metrics
            trace = [(e["span"], e["reason"], e["running"]) for e in eng.policy.trace]
            got[on] = (calls, m.num_accepted_tokens, m.gated_rounds, trace)
            if on:
                assert m.decode_ahead_steps > 10 and m.gated_rounds > 10, "the gated chain did not run on CUDA"
    assert got[True] == got[False]


def test_defer_drafts_equals_its_off_switch_on_cuda(tiny):
    """Deferred drafts (engine/spec/pending.py: drafts left on the device, the verify rows filled there, the host
    read through a pinned copy + event) on vs off, on the tiny DFlash pair with every CUDA graph on (piecewise: the
    torch attention of its head_dim 32; the whole graphs are covered in test_spec_gpu.py): the same kernels either way, so greedy outputs equal token for token, and the
    deferred path is what ran (the verify runner's deferred_rows)."""
    from specbench.engine import LLM, SamplingParams

    prompts = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?", "a b c d"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = {}
    for defer in (True, False):
        with LLM(tiny[0], draft=tiny[1], device="cuda", dtype="bfloat16", defer_drafts=defer,
                 attention_backend="torch", gpu_memory_utilization=0.3) as llm:  # head_dim 32: no FlashInfer sm90
            got[defer] = [o.output_ids for o in llm.generate(prompts, sp)]
            vg = llm.engine.runner.verify_graphs
            assert vg is not None and (vg.stats["deferred_rows"] > 0) == defer, vg.stats
    assert got[True] == got[False]


def test_skinny_gemms_equal_cublas_on_cuda(tiny, monkeypatch):
    """The skinny tensor-core GEMMs (kernels/skinny.py: verify spans, prefill and batched decode of 2..64 rows) on
    vs off on the tiny DFlash pair with every graph on: in fp32 (IEEE dots) greedy outputs equal token for token
    and logprobs agree to 1e-4; in bf16 at least 3 of the 4 requests agree on their first 8 tokens (only the
    summation order differs: a near-tie may flip a later one). The kernel is what ran: its launches are counted."""
    from specbench.engine import LLM, SamplingParams
    from specbench.kernels import skinny

    launches = []
    real = skinny._launch
    monkeypatch.setattr(skinny, "_launch", lambda *a: (launches.append(a[6]), real(*a))[1])
    prompts = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?", "a b c d"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)  # 4 x 16 verify rows: <= 64
    for dtype in ("float32", "bfloat16"):
        got = {}
        for on in (True, False):
            launches.clear()
            with LLM(tiny[0], draft=tiny[1], device="cuda", dtype=dtype, skinny=on, attention_backend="torch",
                     gpu_memory_utilization=0.3) as llm:  # head_dim 32: no FlashInfer sm90
                got[on] = llm.generate(prompts, sp)
            assert bool(launches) == on, (dtype, on, len(launches))
        a, b = got[True], got[False]
        if dtype == "float32":
            assert [o.output_ids for o in a] == [o.output_ids for o in b]
            for oa, ob in zip(a, b, strict=True):
                for (la, _), (lb, _) in zip(oa.logprobs, ob.logprobs, strict=True):
                    assert abs(la - lb) < 1e-4, (la, lb)
        else:
            prefix = [next((i for i, (x, y) in enumerate(zip(oa.output_ids, ob.output_ids, strict=True)) if x != y),
                           len(oa.output_ids)) for oa, ob in zip(a, b, strict=True)]
            assert sum(p >= 8 for p in prefix) >= 3, prefix  # a broken kernel diverges at once
