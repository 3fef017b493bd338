"""The DFlash2 draft step against the DFlash1 draft step at batch 1 (issue 25 item 3's measurement).

`python -m specbench.benchmarks.dflash2_step [--workdir DIR] [--batch 1] [--context 512] [--reps 30]` on the
Qwen3-4B-shaped pair (DIR/target + DIR/draft, built by `specbench fixtures --shape qwen3-4b`) and the random
DFlash2 drafter of the same shape (DIR/draft-dflash2, built here when missing: harness/fixtures/
shape4b_dflash2.py). One engine per drafter; after prefill the benchmark calls the proposer's `propose` on
verify spans of the live requests (drafts read back to the host, as the engine's step does), median ms of
`--reps` calls after warm-up, with a device sync after each:

    dflash1-graph             DFlash1, draft graphs (the engine's default on CUDA)
    dflash1-eager             DFlash1, the plain eager pass
    dflash2-graph             DFlash2 through its padded graph body (engine/spec/dflash2_graphs.py: convolutions
                              and the greedy walk inside the captured segments), the walk as one Triton launch
                              (kernels/selector_walk.py): the engine's default on CUDA
    dflash2-graph-torchwalk   the same with the walk as torch ops per slot (selector_kernel=0; what
                              dflash2-graph was before the kernel)
    dflash2-graph-fitopk      dflash2-graph with FlashInfer's radix top-k (SPECBENCH_FLASHINFER_TOPK=1; only
                              where flashinfer.top_k exists, last, and a failure is reported, not raised)
    dflash2-eager             DFlash2's plain eager pass + the walk kernel
    dflash2-eager-torchwalk   the same with the torch walk
    dflash2-eager-argmax      the same with the selector skipped (the convolutions' share)

Each DFlash2 graph variant captures its own graphs (in the warm-up calls). `--variants a,b` runs a subset. The
table gives each against dflash1-graph; the issue's target is dflash2-graph within 1.3x. Last stdout line: one
JSON document (harness/benchdoc.py). Random weights: acceptance is meaningless, only time counts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from unittest import mock

import torch

from specbench.harness.benchdoc import emit_document

from .spec_step import ensure_pair, timed

TARGET_RATIO = 1.3
DFLASH1 = {"dflash1-graph": {}, "dflash1-eager": {"graphs": False}}
DFLASH2 = {"dflash2-graph": {}, "dflash2-graph-torchwalk": {"walk": False},
           "dflash2-eager": {"graphs": False}, "dflash2-eager-torchwalk": {"graphs": False, "walk": False},
           "dflash2-eager-argmax": {"graphs": False, "selector": False},
           "dflash2-graph-fitopk": {"fi_topk": True, "optional": True}}


def ensure_dflash2(workdir: Path, device: str) -> str:
    d2 = workdir / "draft-dflash2"
    if not (d2 / "config.json").is_file():
        from specbench.harness.fixtures.shape4b_dflash2 import build_qwen3_4b_dflash2

        print(f"building the DFlash2 drafter in {d2}", flush=True)
        build_qwen3_4b_dflash2(d2, device=device)
    return str(d2)


def draft_times(target: str, draft: str, variants: dict[str, dict], batch: int, context: int, reps: int,
                device: str) -> dict[str, float]:
    """Median ms of one propose() over `batch` live requests at `context` tokens, per variant (a dict of
    knobs: graphs True/False, selector True/False; DFlash2: walk (the selector-walk kernel) True/False,
    fi_topk (FlashInfer's top-k) True/False, optional: a failure is printed and the row left out)."""
    from specbench.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from specbench.engine.scheduler import Span
    from specbench.engine.spec import selector as sel

    cuda = device.startswith("cuda")
    eng = LLMEngine(EngineConfig(model=target, draft=draft, device=device, dtype="bfloat16" if cuda else "float32",
                                 max_num_seqs=batch, gpu_memory_utilization=0.6, spec=SpecConfig(method="dflash")))
    p = eng.proposer
    assert p is not None
    g = torch.Generator().manual_seed(0)
    vocab = min(eng.mcfg.vocab_size, 100_000)
    rids = [eng.add_request(torch.randint(2, vocab, (context,), generator=g).tolist(),
                            SamplingParams(max_tokens=1000, ignore_eos=True)) for _ in range(batch)]
    while any(eng.requests[r].in_prefill for r in rids):
        eng.step()
    reqs = [eng.requests[r] for r in rids]
    spans = [Span(r, [r.all_ids[r.num_computed]], r.num_computed, "verify") for r in reqs]
    ks = [eng.k] * batch
    out: dict[str, float] = {}
    walk0 = getattr(p, "walk_kernel", None)
    for name, knobs in variants.items():
        keep = (p.graphs, p.use_graphs)
        if not knobs.get("graphs", True):
            p.graphs, p.use_graphs = None, False
        if walk0 is not None:  # DFlash2: its graphs captured afresh for this variant's walk and top-k
            p.walk_kernel = bool(knobs.get("walk", walk0))
            p.graphs2 = None
        topk = mock.patch.dict(os.environ, {sel.TOPK_ENV: "1"})  # stop() puts the environment back as it was
        if knobs.get("fi_topk"):
            topk.start()
            sel._flashinfer_topk.cache_clear()
            if sel._flashinfer_topk() is None:
                print(f"{name}: skipped (no flashinfer.top_k here)", flush=True)
                _end_topk(sel, topk)
                continue
        kw = {} if knobs.get("selector", True) else {"selector": False}

        def fn(kw: dict = kw) -> None:
            p.propose(spans, ks, **kw)  # the drafts come back to the host inside (lists on the spans)

        try:
            out[name] = timed(fn, warm=3, reps=reps)
        except Exception as e:  # an optional variant (FlashInfer's top-k under capture) must not lose the rest
            if not knobs.get("optional"):
                raise
            print(f"{name}: failed ({type(e).__name__}: {e})", flush=True)
        finally:
            p.graphs, p.use_graphs = keep
            if walk0 is not None:
                p.walk_kernel, p.graphs2 = walk0, None
            if knobs.get("fi_topk"):
                _end_topk(sel, topk)
    for r in rids:
        eng.abort(r)
    return out


def _end_topk(sel, topk) -> None:
    topk.stop()
    sel._flashinfer_topk.cache_clear()


def render(res: dict) -> str:
    base = res["ms"].get("dflash1-graph") or res["ms"].get("dflash1-eager")
    lines = [f"DFlash2 vs DFlash1 draft step, batch {res['batch']}, context {res['context']}, {res['device']}",
             "| variant | ms | vs dflash1-graph |", "|---|---:|---:|"]
    for k, v in res["ms"].items():
        lines.append(f"| {k} | {v:.3f} | " + (f"{v / base:.2f}x |" if base else "- |"))
    if res.get("ratio") is not None:
        lines.append(f"dflash2-graph / dflash1-graph = {res['ratio']:.2f} (target <= {TARGET_RATIO})")
    if res.get("walk_saved_ms") is not None:
        lines.append(f"walk kernel saves {res['walk_saved_ms']:.3f} ms in the graph "
                     f"(dflash2-graph-torchwalk - dflash2-graph)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/q3-4b-pair")
    ap.add_argument("--target", help="target dir (default: WORKDIR/target)")
    ap.add_argument("--draft", help="DFlash1 drafter dir (default: WORKDIR/draft)")
    ap.add_argument("--draft2", help="DFlash2 drafter dir (default: WORKDIR/draft-dflash2, built when missing)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", help="comma-separated subset of the rows (default: all)")
    ap.add_argument("--out", help="also write the JSON document here")
    a = ap.parse_args(argv)
    known = [*DFLASH1, *DFLASH2]
    pick = [v.strip() for v in a.variants.split(",") if v.strip()] if a.variants else known
    bad = [v for v in pick if v not in known]
    if bad:
        ap.error(f"--variants: unknown {', '.join(bad)} (known: {', '.join(known)})")
    wd = Path(a.workdir)
    if a.target and a.draft:
        target, draft = a.target, a.draft
    else:
        target, draft = ensure_pair(wd, a.device)
    draft2 = a.draft2 or ensure_dflash2(wd, a.device)
    v1 = {k: v for k, v in DFLASH1.items() if k in pick}
    v2 = {k: v for k, v in DFLASH2.items() if k in pick}
    ms = draft_times(target, draft, v1, a.batch, a.context, a.reps, a.device) if v1 else {}
    if v2:
        ms.update(draft_times(target, draft2, v2, a.batch, a.context, a.reps, a.device))
    both = lambda x, y: x / y if x is not None and y else None  # noqa: E731
    res = {"batch": a.batch, "context": a.context, "device": a.device, "reps": a.reps, "ms": ms,
           "ratio": both(ms.get("dflash2-graph"), ms.get("dflash1-graph")),
           "ratio_torch_walk": both(ms.get("dflash2-graph-torchwalk"), ms.get("dflash1-graph")),
           "walk_saved_ms": (ms["dflash2-graph-torchwalk"] - ms["dflash2-graph"]
                             if "dflash2-graph" in ms and "dflash2-graph-torchwalk" in ms else None),
           "target_ratio": TARGET_RATIO}
    print(render(res), flush=True)
    emit_document(res, a.out)
    return res


if __name__ == "__main__":
    main()
