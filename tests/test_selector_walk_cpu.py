"""DFlash2's one-launch selector walk (kernels/selector_walk.py) under the Triton interpreter (a subprocess:
TRITON_INTERPRET must be set before triton is imported): the kernel against the torch walk on random inputs and
ties (tests/selector_walk_cases.py), then the engine with the bundled tiny DFlash2 fixture drafting through it
(under the interpreter `sel.kernel_on` is true on CPU, so the engine takes the kernel by itself): the same drafts
as the torch walk at every draft of greedy and seeded T > 0 runs (q to fp32 rounding), the padded graph body's
captured walk too, spec on == spec off, and `selector_kernel=0` keeping the torch walk. The GPU twin is
tests/gpu/test_dflash2_gpu.py.
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

from specbench.kernels import triton_importable

FIXTURE = Path(__file__).resolve().parent.parent / "harness" / "data" / "fixtures" / "tiny-dflash2" / "draft"

SCRIPT = PRELUDE + textwrap.dedent('''

    sys.path.insert(0, sys.argv[1])
    from selector_walk_cases import run_cases
    print("CASES", run_cases(torch.device("cpu")))

    import specbench.kernels.selector_walk as sw
    from specbench.engine import LLM, SamplingParams
    from specbench.engine.scheduler import Span
    from specbench.engine.spec import selector as sel
    from specbench.engine.spec.dflash2_graphs import DraftGraphs2
    from specbench.harness.engines import build_adapter
    from specbench.harness.fixtures import bundled_pair

    target, draft = str(bundled_pair()[0]), sys.argv[2]
    launches = [0]
    real_walk = sw.selector_walk

    def counted(*a, **kw):
        launches[0] += 1
        return real_walk(*a, **kw)

    sw.selector_walk = counted

    def run(kernel, params, prompts, graphs=False):
        """(outputs, every draft's (drafts, draft_probs) in order, walk launches) of one spec engine."""
        llm = LLM(target, draft=draft, num_pages=256, selector_kernel=kernel)
        p = llm.engine.proposer
        assert p.walk_kernel is kernel, (kernel, p.walk_kernel)
        if graphs:
            p.graphs2 = DraftGraphs2(p, capture=False, buckets=[1, 4])
        seen, orig = [], p._propose_group

        def spy(grp, kmap, tile_starts, selector, causal):
            orig(grp, kmap, tile_starts, selector, causal)
            seen.extend((list(s.drafts), s.draft_probs) for s in grp)

        p._propose_group = spy
        before = launches[0]
        outs = [o.output_ids for o in llm.generate(prompts, params)]
        if graphs:
            assert p.graphs2.stats["steps"] > 0
        return outs, seen, launches[0] - before

    import json
    from importlib import resources
    from specbench.harness.datasets import gsm8k_prompt
    rows = resources.files("specbench.harness").joinpath("data/gsm8k/test.jsonl").read_text().splitlines()[:3]
    prompts = [gsm8k_prompt(json.loads(r)["question"][:400]) for r in rows]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = [o.output_ids for o in LLM(target, num_pages=256).generate(prompts, greedy)]
    ref, ref_seen, n0 = run(False, greedy, prompts)
    assert n0 == 0 and ref == plain
    for graphs in (False, True):
        got, got_seen, n1 = run(True, greedy, prompts, graphs)
        assert n1 > 0 and got == plain, (graphs, n1)
        assert [d for d, _ in got_seen] == [d for d, _ in ref_seen], graphs
        print("GREEDY", "graph" if graphs else "plain", "drafts", len(got_seen), "launches", n1)
    # seeded T > 0 (one greedy request in the batch too): same draws, q to fp32 rounding, same outputs
    mixed = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=t, seed=11 + i)
             for i, t in enumerate((0.7, 1.3))] + [greedy]
    ref, ref_seen, _ = run(False, mixed, prompts)
    got, got_seen, n2 = run(True, mixed, prompts)
    assert n2 > 0 and got == ref
    assert [d for d, _ in got_seen] == [d for d, _ in ref_seen]
    qs = [(a, b) for (_, a), (_, b) in zip(got_seen, ref_seen) if b is not None]
    assert qs and all(a is not None for a, _ in qs)
    for a, b in qs:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    print("SAMPLED drafts", len(qs), "launches", n2)
    # the engine-string switch keeps the torch walk even where the kernel would run
    ad = build_adapter(f"local:{target},draft={draft},spec=dflash,selector_kernel=0")
    assert ad.engine.cfg.selector_kernel is False and ad.engine.proposer.walk_kernel is False
    assert build_adapter(f"local:{target},draft={draft},spec=dflash").engine.proposer.walk_kernel is True
    print("SELECTOR WALK OK")
''')


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed: the interpreter checks need it")
def test_selector_walk_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parent), str(FIXTURE)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "SELECTOR WALK OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "'near': 0" in out.stdout, out.stdout  # every random case chose exactly the torch walk's candidates


def test_switch_without_the_interpreter(monkeypatch):
    """Off CUDA and without the interpreter the walk is torch's whatever the switch; the switch and Triton's own
    switch each turn the kernel off; SPECBENCH_SELECTOR_KERNEL is EngineConfig's default."""
    from specbench.engine import EngineConfig
    from specbench.engine.spec import selector as sel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not sel.kernel_on("cpu", True, True)
    assert not sel.kernel_on(torch.device("cuda"), False, True)
    assert not sel.kernel_on(torch.device("cuda"), True, False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sel.kernel_on("cpu", True, True) is triton_importable()
    assert not sel.kernel_on("cpu", False, True)
    monkeypatch.setenv("SPECBENCH_SELECTOR_KERNEL", "0")
    assert EngineConfig(model="m").selector_kernel is False
    monkeypatch.delenv("SPECBENCH_SELECTOR_KERNEL")
    assert EngineConfig(model="m").selector_kernel is True


def test_dflash2_step_benchmark_rows_on_cpu(tiny_target, tiny_draft, capsys):
    """benchmarks/dflash2_step.py's variant rows (walk kernel on / off, eager, argmax; FlashInfer's top-k row
    skipped where flashinfer.top_k is absent) and --variants, on the tiny pair (CPU: timing meaningless)."""
    from specbench.benchmarks import dflash2_step

    res = dflash2_step.main(["--target", tiny_target, "--draft", tiny_draft, "--draft2", str(FIXTURE), "--device",
                             "cpu", "--context", "24", "--reps", "2"])
    rows = set(res["ms"])
    assert rows >= {"dflash1-graph", "dflash1-eager", "dflash2-graph", "dflash2-graph-torchwalk", "dflash2-eager",
                    "dflash2-eager-torchwalk", "dflash2-eager-argmax"}
    assert all(v > 0 for v in res["ms"].values())
    assert res["ratio"] > 0 and res["walk_saved_ms"] is not None
    out = capsys.readouterr().out
    assert "| dflash2-graph-torchwalk |" in out and "walk kernel saves" in out
    assert ("dflash2-graph-fitopk: skipped" in out) != ("dflash2-graph-fitopk" in rows)
    sub = dflash2_step.main(["--target", tiny_target, "--draft", tiny_draft, "--draft2", str(FIXTURE), "--device",
                             "cpu", "--context", "24", "--reps", "1", "--variants", "dflash2-graph,dflash2-eager"])
    assert set(sub["ms"]) == {"dflash2-graph", "dflash2-eager"} and sub["ratio"] is None
    with pytest.raises(SystemExit):
        dflash2_step.main(["--target", tiny_target, "--draft", tiny_draft, "--variants", "dflash3-graph"])
