"""Cost of the engine's run-time invariants (engine/invariants.py, `EngineConfig.check_invariants`).

Two figures on the bundled tiny pair (DFlash, fp32, the device given; CPU by default), for each pool size
in --pages (the partition check is O(num_pages) per step):
  in-run:  `LLM.generate` over --requests prompts with the checks on, every `InvariantChecker.check` call
           timed: the checks' share of the generate's wall time, and the mean time per check (a ratio
           measured inside one run, so a loaded machine slows both sides alike);
  check:   one check with --requests requests running mid-decode, median over --reps calls, beside the
           median step time of the same engine;
  pool:    one check over a bare page pool of --pool-pages pages (a GPU-sized pool; no model) with
           --pool-requests requests of 1,024 committed tokens each: the check reads the owned pages, not
           the free ones, so its time follows the running requests, not the pool size.
Prints one line per pool size, then one JSON document as the last line.

Usage: python -m specbench.benchmarks.invariants_cost [--pages 256,2048] [--requests 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specbench.engine import LLM, SamplingParams
from specbench.harness.datasets import gsm8k_prompt
from specbench.harness.fixtures import bundled_pair


def _prompts(n: int) -> list[str]:
    from importlib import resources

    path = resources.files("specbench.harness") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [gsm8k_prompt(r["question"][:400]) for r in rows]


def measure(pages: int, n: int, max_tokens: int, reps: int, device: str) -> dict:
    target, draft = bundled_pair()
    prompts = _prompts(n)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(target), draft=str(draft), device=device, num_pages=pages, check_invariants=True)
    eng = llm.engine
    checker = eng.invariants
    assert checker is not None
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    spent: list[float] = []
    plain = checker.check

    def timed(step: int, ahead: dict[str, int] | None = None) -> None:  # InvariantChecker.check's signature
        t0 = time.perf_counter()
        plain(step, ahead)
        spent.append(time.perf_counter() - t0)

    checker.check = timed  # type: ignore[method-assign]  # the timing wrapper replaces the bound method
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    checker.check = plain  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        eng.add_request(p, sp, rid=f"bench-{i}")
    steps: list[float] = []
    for _ in range(8):  # past the prefill, into decode
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    running = len(eng.scheduler.running)
    calls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        checker.check(0)
        calls.append(time.perf_counter() - t0)
    for i in range(len(prompts)):
        eng.abort(f"bench-{i}")
    check_s, step_s = statistics.median(calls), statistics.median(steps[2:])
    return {"num_pages": pages, "in_run_share": round(sum(spent) / wall, 5), "in_run_checks": len(spent),
            "in_run_check_us": round(sum(spent) / len(spent) * 1e6, 1), "generate_s": round(wall, 3),
            "running": running, "check_us": round(check_s * 1e6, 1), "step_ms": round(step_s * 1e3, 2),
            "check_per_step": round(check_s / step_s, 5)}


def measure_pool(num_pages: int, requests: int, reps: int) -> dict:
    from specbench.engine.invariants import InvariantChecker
    from specbench.engine.kv_cache import PagePool
    from specbench.engine.request import Request
    from specbench.engine.spec.plan import SpecPlan

    class _Sched:
        running: list[Request] = []

    pool = PagePool(num_pages, 16)
    sched = _Sched()
    for i in range(requests):
        r = Request(f"p{i}", [1] * 1024, SamplingParams(max_tokens=16))
        r.num_computed = 1024
        pool.admit(r.rid, 1040)
        pool.ensure(r.rid, 1024)
        pool.commit(r.rid, 1024)
        sched.running.append(r)
    checker = InvariantChecker(pool, sched, None, SpecPlan(False, None, 4, 0, False, True))  # type: ignore[arg-type]
    calls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        checker.check(0)
        calls.append(time.perf_counter() - t0)
    return {"num_pages": num_pages, "requests": requests, "owned_pages": requests * 64,
            "check_us": round(statistics.median(calls) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="256,2048")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pool-pages", type=int, default=1_000_000)
    ap.add_argument("--pool-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [measure(int(p), a.requests, a.max_tokens, a.reps, a.device) for p in a.pages.split(",")]
    for r in rows:
        print(f"num_pages={r['num_pages']}: in-run {r['in_run_share']:.3%} of a {r['generate_s']} s generate "
              f"({r['in_run_checks']} checks, {r['in_run_check_us']} us each); one check {r['check_us']} us with "
              f"{r['running']} running vs a {r['step_ms']} ms step ({r['check_per_step']:.3%})")
    pool = measure_pool(a.pool_pages, a.pool_requests, min(a.reps, 500))
    print(f"bare pool of {pool['num_pages']} pages, {pool['requests']} requests owning {pool['owned_pages']} pages: "
          f"one check {pool['check_us']} us")
    print(json.dumps({"benchmark": "invariants_cost", "device": a.device, "threads": a.threads, "rows": rows,
                      "pool": pool}))


if __name__ == "__main__":
    main()
