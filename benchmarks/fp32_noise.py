"""fp32 noise between two correct code paths of one engine: the measurement behind the strict-mode tolerance.

A greedy pick can differ between two correct computations of the same model only where the top two tokens
are closer than the two paths' numerical disagreement. The regret of such a flip, scored under the other
path's distribution, is at most the change in the logprob gap between the two tokens:

    noise(d1, d2) = max over tokens t in both top-k of |(d1[top1] - d1[t]) - (d2[top1] - d2[t])|

(top1 = d1's argmax). So the largest regret a correct engine can show at a divergence is bounded by the
largest `noise` between its paths. This script measures it, through the adapter (what the gate sees), for
every position of N greedy outputs on several correct paths of one engine, speculation off:

  decode_c1      the reference: spec-off generation, one request at a time, top-20 logprobs per position
  decode_batch   the same requests all at once (a changed batch composition: batched decode rows)
  prefill        teacher-forced scoring of prompt + output in one prefill (multi-row forward)
  chunked        the same scored by an engine with max_num_batched_tokens=16: chunks of 16 query rows over
                 paged KV of earlier chunks, the shape of a verify span (1 + K rows over a cached prefix)

and, speculation on, the gate itself: every divergence of spec-on vs spec-off (c1 and all at once) with its
regret (margin 50 nat, so every flip is judged and re-anchored, none fails). Positions are compared only
while the two outputs agree (same prefix, same conditional distribution).

Usage: python -m specbench.benchmarks.fp32_noise [--engine local:DIR,draft=D] [--prompts 32] [--max-tokens 64]
       [--device cpu|cuda] [--num-pages N] [--json OUT]
Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace

from specbench.harness.adapters.base import EngineAdapter, GenRequest, PosLogprobs
from specbench.harness.benchdoc import emit_document
from specbench.harness.engines import build_adapter, parse_engine, spec_off_twin
from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt, run_greedy, tokenize_prompts
from specbench.suites.lossless.prompts import load_prompts
from specbench.suites.lossless.regret import merged_dist

TOP_K = 20


def noise(d1: dict[int, float], d2: dict[int, float]) -> tuple[float, float]:
    """(gap noise as in the module docstring, max |logprob difference|) over the tokens both report."""
    if not d1 or not d2:
        return 0.0, 0.0
    top1 = max(d1, key=lambda t: d1[t])
    common = [t for t in d1 if t in d2]
    if top1 not in d2:
        return float("inf"), float("inf")
    gap = max(abs((d1[top1] - d1[t]) - (d2[top1] - d2[t])) for t in common)
    lp = max(abs(d1[t] - d2[t]) for t in common)
    return gap, lp


def dists(lps: list[PosLogprobs] | None) -> list[dict[int, float]]:
    return [merged_dist(p.top, p.token_id, p.logprob) for p in (lps or [])]


def compare(ref_ids: list[int], ref: list[dict], ids: list[int], other: list[dict]) -> dict:
    """Noise over the positions where both outputs agree so far (inclusive of the first differing one)."""
    gaps, lps, n = [0.0], [0.0], 0
    for i in range(min(len(ref), len(other))):
        g, lp = noise(ref[i], other[i])
        gaps.append(g)
        lps.append(lp)
        n += 1
        if i >= len(ids) or i >= len(ref_ids) or ids[i] != ref_ids[i]:
            break
    return {"positions": n, "max_gap_noise": max(gaps), "max_logprob_diff": max(lps)}


async def scored(adapter: EngineAdapter, prompt: list[int], out: list[int]) -> list[dict]:
    if not out:
        return []
    sc = await adapter.score(prompt, out, top_k=TOP_K)
    return [merged_dist(p.top, p.token_id, p.logprob) for p in (sc.positions if sc else [])]


async def measure(args: argparse.Namespace) -> dict:
    cand_spec = parse_engine(args.engine)
    if args.device:
        cand_spec = replace(cand_spec, options={**cand_spec.options, "device": args.device})
    cand_spec = replace(cand_spec, options={**cand_spec.options, "dtype": "float32", "num_pages": str(args.num_pages)})
    base_spec = spec_off_twin(cand_spec)
    base = build_adapter(base_spec, name="baseline")
    cand = build_adapter(cand_spec, name="candidate")
    texts: list[tuple[str, str]] = []
    for ds in args.datasets.split(","):
        texts += load_prompts(ds, args.prompts // len(args.datasets.split(",")))
    prompts, _ = await tokenize_prompts(base, cand, texts)
    t0 = time.perf_counter()
    reqs = [GenRequest(prompt=p.ids, max_tokens=args.max_tokens, logprobs=TOP_K, rid=p.pid, prompt_cache=False)
            for p in prompts]
    c1 = await base.generate(reqs, concurrency=1)
    cb = await base.generate(reqs, concurrency=None)
    rows: dict[str, list[dict]] = {"decode_batch": [], "prefill": [], "chunked": []}
    for p, a, b in zip(prompts, c1, cb, strict=True):
        rows["decode_batch"].append(compare(a.output_ids or [], dists(a.logprobs), b.output_ids or [], dists(b.logprobs)))
        rows["prefill"].append(compare(a.output_ids or [], dists(a.logprobs), a.output_ids or [],
                                       await scored(base, p.ids, a.output_ids or [])))
    await base.aclose()
    # chunked prefill: query rows in chunks of 16 over paged KV of the earlier chunks (a verify span's shape)
    from specbench.harness.adapters.local import LocalAdapter

    if isinstance(base, LocalAdapter):
        from specbench.engine import LLMEngine

        ch = LocalAdapter(LLMEngine(base.engine.cfg.with_(max_num_batched_tokens=16)), name="chunked")
        for p, a in zip(prompts, c1, strict=True):
            rows["chunked"].append(compare(a.output_ids or [], dists(a.logprobs), a.output_ids or [],
                                           await scored(ch, p.ids, a.output_ids or [])))
        await ch.aclose()
    base = build_adapter(base_spec, name="baseline")
    opts = GreedyGateOptions(margin_tol=49.0, max_divergences=64, rescore=True)
    flips: dict[str, dict] = {}
    for label, conc in (("spec_on_c1", 1), ("spec_on_batch", None)):
        g = await run_greedy(base, cand, [Prompt(p.pid, p.ids) for p in prompts], args.max_tokens, opts,
                             concurrency=conc, name=label)
        regs = [d.judgement.regret_or_bound for pc in g.prompts for d in pc.divergences if d.judgement]
        own = [(d.rescore or {}).get("regret") for pc in g.prompts for d in pc.divergences]
        flips[label] = {"tokens": sum(pc.tokens_compared for pc in g.prompts),
                        "divergences": len(regs), "max_regret": max([r for r in regs if r is not None], default=0.0),
                        "regrets": sorted(r for r in regs if r is not None),
                        "max_own_prefill_regret": max([r for r in own if r is not None], default=0.0),
                        "mean_accept_len": g.stats.mean_accept_len}
    await base.aclose()
    await cand.aclose()
    summary = {k: {"positions": sum(r["positions"] for r in v),
                   "max_gap_noise": max((r["max_gap_noise"] for r in v), default=None),
                   "max_logprob_diff": max((r["max_logprob_diff"] for r in v), default=None)}
               for k, v in rows.items() if v}
    return {"engine": cand.describe().get("config", {}) | {"model": cand.describe().get("model")},
            "prompts": len(prompts), "max_tokens": args.max_tokens, "paths": summary, "spec_on": flips,
            "max_gap_noise": max(s["max_gap_noise"] for s in summary.values()),
            "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="local")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--datasets", default="gsm8k,spec_bench")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=512, help="KV pages per engine (three engines share a GPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = asyncio.run(measure(args))
    print(f"{'path':<14} {'positions':>9} {'max gap noise (nat)':>20} {'max |dlogp|':>12}")
    for k, v in out["paths"].items():
        print(f"{k:<14} {v['positions']:>9} {v['max_gap_noise']:>20.3e} {v['max_logprob_diff']:>12.3e}")
    for k, v in out["spec_on"].items():
        print(f"{k}: {v['divergences']} divergences in {v['tokens']} tokens, max regret {v['max_regret']:.3e}, "
              f"max own-prefill regret {v['max_own_prefill_regret']:.3e}, accept {v['mean_accept_len']}")
    emit_document(out, args.json)


if __name__ == "__main__":
    main()
