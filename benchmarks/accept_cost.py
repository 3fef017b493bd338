"""Cost of the sampling accept step against the greedy one, as the engine runs them.

For batch B, K drafts and vocabulary V, the verify step leaves logits [B, K + 1, V] (bf16 on CUDA, fp32
on CPU) and, for sampled requests, draft probabilities q [B, K, V]. The engine resolves a step's spans
together (engine/accept_step.py `AcceptStep.accept`):
  greedy:  one argmax over all B (K + 1) rows, one host read, then `accept_greedy` per request (host)
  sampled: `sampling_probs_rows` (the requests' transforms, fp32) + `accept_sampled_batch` (each
           request's uniforms from its own generator, ratio tests, residual or bonus rows, inverse-CDF
           draws, all on the device; one host read of the accepted counts and drawn tokens). On CUDA the
           resolve is the fused Triton kernel (kernels/spec_accept.py, one launch), as in the engine;
           SPECBENCH_TRITON=0 times its torch reference instead
  *_loop:  the same sampled rule one request at a time (`sampling_probs` + `accept_sampled`, three host
           reads each): the engine's path before the batched resolve, kept as the reference it replaced
All are timed per whole batch, median of --repeats after --warmup, with CUDA synchronisation around each
repeat. For scale, `lm_head` times the verify step's LM-head matmul
([B (K + 1), hidden] x [hidden, V], the dtype of the logits): a lower bound of the verify forward.
Prints a table, then one JSON document as the last line.

Usage: python -m specbench.benchmarks.accept_cost [--device cuda] [--k 15] [--vocab 151936] [--batches 1,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from specbench.engine.config import SamplingParams
from specbench.engine.sampler import sampling_probs, sampling_probs_rows
from specbench.engine.spec.accept import accept_greedy
from specbench.engine.spec.sampling import accept_sampled, accept_sampled_batch

CONFIGS = {"sampled_t1": SamplingParams(temperature=1.0), "sampled_t0.7_p0.9": SamplingParams(temperature=0.7, top_p=0.9)}


def _timeit(fn: Callable[[], None], dev: torch.device, warmup: int, repeats: int) -> float:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def bench(batch: int, k: int, vocab: int, hidden: int, dev: torch.device, warmup: int, repeats: int,
          profile: bool = False) -> dict:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(batch, k + 1, vocab, generator=g, device=dev) * 3).to(dtype)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g, device=dev) * 3, -1)
    # Drafts that often match the target's argmax, so both rules walk several positions.
    drafts = [logits[b, :k].float().argmax(-1).tolist() for b in range(batch)]
    gens = [torch.Generator(device=dev).manual_seed(b) for b in range(batch)]
    out: dict = {"batch": batch}

    def greedy() -> None:
        am = logits.argmax(-1).tolist()
        for b in range(batch):
            accept_greedy(drafts[b], am[b])

    out["greedy_ms"] = _timeit(greedy, dev, warmup, repeats)
    flat = logits.view(batch * (k + 1), vocab)
    qs = [q[b] for b in range(batch)]
    for name, params in CONFIGS.items():
        def sampled(params: SamplingParams = params) -> None:
            accept_sampled_batch(drafts, qs, sampling_probs_rows(flat, [params] * flat.shape[0]), gens)

        def loop(params: SamplingParams = params) -> None:
            for b in range(batch):
                accept_sampled(drafts[b], q[b], sampling_probs(logits[b], params), gens[b])

        out[f"{name}_ms"] = _timeit(sampled, dev, warmup, repeats)
        out[f"{name}_loop_ms"] = _timeit(loop, dev, warmup, repeats)
        if profile and name == "sampled_t1":
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as prof

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with prof(activities=acts) as pr:
                for _ in range(10):
                    sampled()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            print(f"profile: batched sampled_t1 at batch {batch}, 10 calls")
            print(pr.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=40))
    x = torch.randn(batch * (k + 1), hidden, generator=g, device=dev).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, device=dev) * 0.02).to(dtype)
    out["lm_head_ms"] = _timeit(lambda: torch.matmul(x, w.t()), dev, warmup, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2560, help="LM-head input width (Qwen3-4B: 2560)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also print a torch profile of the batched sampled path")
    a = ap.parse_args()
    dev = torch.device(a.device)
    rows = [bench(int(b), a.k, a.vocab, a.hidden, dev, a.warmup, a.repeats, a.profile) for b in a.batches.split(",")]
    cols = ["greedy_ms", *(f"{n}{x}_ms" for n in CONFIGS for x in ("", "_loop")), "lm_head_ms"]
    print(f"accept step cost, K={a.k}, vocab={a.vocab}, device={dev} "
          f"({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), median of {a.repeats}")
    print("| batch | " + " | ".join(cols) + " | sampled_t1 / greedy |")
    print("|---:|" + "---:|" * (len(cols) + 1))
    for r in rows:
        r["ratio_t1_vs_greedy"] = r["sampled_t1_ms"] / r["greedy_ms"]
        print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + f" | {r['ratio_t1_vs_greedy']:.2f} |")
    print(json.dumps({"bench": "accept_cost", "device": str(dev), "k": a.k, "vocab": a.vocab, "hidden": a.hidden,
                      "repeats": a.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
