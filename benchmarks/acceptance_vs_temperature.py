"""Acceptance of a drafter at T = 0 (greedy accept) against T > 0 (rejection sampling), local engine.

For each temperature, every prompt (the first --prompts gsm8k test questions, "Question: ...\\nAnswer:")
is generated --max-tokens tokens (ignore_eos) --seeds times (once at T = 0, which is deterministic)
through the local adapter with speculation on; the engine's counters (vLLM's names, REFERENCE.md section
3) are read before and after each temperature. Reported: drafts, acceptance rate (accepted / draft
tokens), mean accepted length token-weighted (1 + accepted / drafts) and request-mean (the mean of each
request's own), per-position rate (position i accepted / drafts) and generation wall time.
Prints a table, then one JSON document as the last line.

Usage: python -m specbench.benchmarks.acceptance_vs_temperature [--target DIR --draft DIR] [--temps 0,0.5,1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specbench.harness.adapters.base import GenRequest, counters_delta
from specbench.harness.adapters.local import LocalAdapter
from specbench.suites.sampled.gate import load_prompts


def measure(adapter: LocalAdapter, prompts: list[str], temp: float, max_tokens: int, seeds: int) -> dict:
    n_seeds = 1 if temp == 0 else seeds
    reqs = [GenRequest(prompt=p, max_tokens=max_tokens, temperature=temp, seed=1000 * i + s, ignore_eos=True)
            for i, p in enumerate(prompts) for s in range(n_seeds)]
    before = adapter.spec_counters_sync()
    t = time.perf_counter()
    res = adapter.generate_sync(reqs, concurrency=64)
    wall = time.perf_counter() - t
    d = counters_delta(before, adapter.spec_counters_sync()) or {}
    drafts, acc, dtok = d.get("num_drafts", 0), d.get("num_accepted_tokens", 0), d.get("num_draft_tokens", 0)
    per_req = [r.spec["mean_accept_len"] for r in res if r.ok and r.spec and r.spec.get("mean_accept_len")]
    return {"temperature": temp, "requests": len(reqs), "failed": sum(not r.ok for r in res), "drafts": drafts,
            "draft_tokens": dtok, "accepted": acc, "acceptance_rate": acc / dtok if dtok else 0.0,
            "mean_accept_len": 1 + acc / drafts if drafts else 0.0,
            "request_mean_accept_len": statistics.fmean(per_req) if per_req else 0.0,
            "per_position_rate": [x / drafts for x in d.get("accepted_per_pos", [])] if drafts else [],
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--temps", default="0,0.5,1.0")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=4, help="samples per prompt at T > 0")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if not a.target:
        from specbench.harness.fixtures import ensure_bundled

        t, d = ensure_bundled()
        a.target, a.draft = str(t), str(d)
    adapter = LocalAdapter.from_dirs(a.target, draft=a.draft, spec="dflash", device=a.device)
    prompts = [text for _, text in load_prompts(a.prompts)]
    try:
        rows = [measure(adapter, prompts, float(t), a.max_tokens, a.seeds) for t in a.temps.split(",")]
    finally:
        adapter.close()
    print(f"acceptance vs temperature: {a.prompts} gsm8k prompts x {a.max_tokens} tokens, k={adapter.engine.k}, "
          f"{a.device}")
    print("| T | requests | drafts | acceptance rate | mean accepted length (token / request mean) | "
          "per-position rate | wall s |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        per = ", ".join(f"{x:.2f}" for x in r["per_position_rate"])
        print(f"| {r['temperature']:g} | {r['requests']} | {r['drafts']} | {r['acceptance_rate']:.3f} | "
              f"{r['mean_accept_len']:.2f} / {r['request_mean_accept_len']:.2f} | {per} | {r['wall_s']:.1f} |")
    print(json.dumps({"bench": "acceptance_vs_temperature", "target": a.target, "draft": a.draft, "k": adapter.engine.k,
                      "prompts": a.prompts, "max_tokens": a.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
