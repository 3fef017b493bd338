"""The decode GEMMs of the Qwen3-4B shape: cuBLAS (with the separate add+RMSNorm and SwiGLU kernels the engine
runs around it) against the Triton GEMV kernels of kernels/gemv.py, every config, at 1-8 rows.

Each measurement is one CUDA graph of L calls over L DISTINCT weight tensors (36, the layer count; 4 for the
lm_head), so every call streams its weights from HBM as in a real step (one layer's qkv weights would fit in
the 50 MB L2 and flatter a kernel replayed on them alone). The graph is replayed `--reps` times after warm-up;
the median over replays / L is the per-call time. `TB/s` = weight bytes / per-call time.

Shapes: qkv (add-norm prologue, N 6144, K 2560), o (plain, 2560 x 4096), gate_up (add-norm + SwiGLU, I 9728,
K 2560), down (plain, 2560 x 9728), lm_head (plain, 151936 x 2560, information only: the engine keeps cuBLAS).
Prints a table, the TUNED dict for kernels/gemv.py (best config per shape at 1 row), then one JSON document
as the last line.

`--kernel skinny` times kernels/skinny.py (tensor-core skinny GEMMs, default rows 16,32,64: one per row tile) instead, searches
`skinny.CONFIGS` at EVERY row count (each is its own row tile, skinny.block_m) and prints its TUNED dict keyed
(N, K, kind, BLOCK_M), None where the cuBLAS chain was faster (for a bucket holding two row counts, the larger).

Usage: python -m specbench.benchmarks.gemv [--kernel gemv|skinny] [--rows 1,2,4,8] [--reps 15]
       [--configs all|tuned] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from specbench.harness.benchdoc import emit_document

SHAPES = {  # name: (kind, N, K, distinct copies)
    "qkv": ("norm", 6144, 2560, 36),
    "o": ("plain", 2560, 4096, 36),
    "gate_up": ("swiglu", 9728, 2560, 36),
    "down": ("plain", 2560, 9728, 36),
    "lm_head": ("plain", 151936, 2560, 4),
}


def graph_ms(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del g
    return statistics.median(ts)


def bench_shape(name: str, rows: list[int], reps: int, search: bool, gen: torch.Generator,
                kernel: str = "gemv") -> dict:
    from specbench.kernels import activation, gemv, norm, skinny

    mod = skinny if kernel == "skinny" else gemv

    def pick(n: int, k: int, kind: str, m: int):
        return skinny.pick(n, k, kind, m) or skinny.DEFAULT if kernel == "skinny" else gemv.pick(n, k, kind)

    dt, dev = torch.bfloat16, "cuda"
    kind, n, k, copies = SHAPES[name]
    wrows = 2 * n if kind == "swiglu" else n
    ws = [(torch.randn(wrows, k, device=dev, generator=gen, dtype=torch.float32) * k ** -0.5).to(dt)
          for _ in range(copies)]
    gw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(dt)
    wbytes = wrows * k * 2
    out: dict = {"kind": kind, "N": n, "K": k, "weight_MB": wbytes / 1e6, "cublas_us": {}, "gemv_us": {}}
    for m in rows:
        x = torch.randn(m, k, device=dev, generator=gen).to(dt)
        r = torch.randn(m, k, device=dev, generator=gen).to(dt)
        sw = kind == "swiglu"

        def ref(w, x=x, r=r, sw=sw):
            if kind == "plain":
                return torch.nn.functional.linear(x, w)
            h, _ = norm.add_rms_norm(x, r, gw, 1e-6)
            y = torch.nn.functional.linear(h, w)
            return activation.swiglu(y) if sw else y

        def fast(w, cfg, x=x, r=r, sw=sw):
            if kind == "plain":
                return mod.linear(x, w, cfg)
            return mod.add_norm_linear(x, r, gw, w, 1e-6, sw, cfg)[0]
        # correctness against the cuBLAS chain before timing (relative error of the outputs)
        y0, y1 = ref(ws[0]).float(), fast(ws[0], pick(n, k, kind, m)).float()
        err = ((y0 - y1).norm() / y0.norm()).item()
        assert err < 2e-2, (name, m, err)
        out["cublas_us"][m] = 1e3 * graph_ms(lambda: [ref(w) for w in ws], reps) / copies
        cands: Sequence[tuple[int, ...] | None]
        if kernel == "skinny":  # every row count is its own search (its own row tile)
            cands = skinny.CONFIGS if search else [pick(n, k, kind, m)]
            out.pop("best", None)
        else:
            cands = gemv.CONFIGS if (search and m == rows[0]) else [out.get("best") or pick(n, k, kind, m)]
        times: dict[tuple[int, ...] | None, float] = {}
        for cfg in cands:
            try:
                times[cfg] = 1e3 * graph_ms(lambda cfg=cfg: [fast(w, cfg) for w in ws], reps) / copies
            except Exception as e:  # a config the compiler refuses (registers, shared memory)
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
        best = min(times, key=times.__getitem__)
        out.setdefault("best", best)
        out["gemv_us"][m] = times[out["best"]]
        if kernel == "skinny":
            out.setdefault("best_by_rows", {})[m] = list(out["best"])
        if len(times) > 1:
            key = f"search_us_m{m}" if kernel == "skinny" else "search_us"
            out[key] = {str(c): round(v, 2) for c, v in sorted(times.items(), key=lambda kv: kv[1])}
        print(f"{name:8s} M={m}: cuBLAS chain {out['cublas_us'][m]:8.2f} us ({wbytes / out['cublas_us'][m] / 1e6:5.2f}"
              f" TB/s)  GEMV {out['best']} {out['gemv_us'][m]:8.2f} us ({wbytes / out['gemv_us'][m] / 1e6:5.2f}"
              f" TB/s)  rel err {err:.1e}", flush=True)
    out["best"] = list(out["best"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="gemv", choices=("gemv", "skinny"))
    ap.add_argument("--rows", help="row counts (default 1,2,4,8; skinny 16,32,64)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--configs", default="all", help="all: search kernels/gemv.py CONFIGS at 1 row; tuned: pick()")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = [int(r) for r in (a.rows or ("16,32,64" if a.kernel == "skinny" else "1,2,4,8")).split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "kernel": a.kernel, "rows": rows, "shapes": {}}
    t0 = time.time()
    for name in a.shapes.split(","):
        res["shapes"][name] = bench_shape(name, rows, a.reps, a.configs == "all", gen, a.kernel)
        torch.cuda.empty_cache()
    layer = ("qkv", "o", "gate_up", "down")
    if all(s in res["shapes"] for s in layer):
        for m in rows:
            c = sum(res["shapes"][s]["cublas_us"][m] for s in layer) * 36 / 1e3
            g = sum(res["shapes"][s]["gemv_us"][m] for s in layer) * 36 / 1e3
            res.setdefault("per_step_ms", {})[m] = {"cublas_chain": round(c, 3), "gemv": round(g, 3)}
            print(f"36 layers, M={m}: cuBLAS chain {c:.3f} ms, GEMV {g:.3f} ms ({c / g:.2f}x)")
    if a.kernel == "skinny":
        from specbench.kernels import skinny

        tuned = {}
        for v in res["shapes"].values():
            for m in rows:  # ascending: the larger row count of a bucket decides
                won = v["gemv_us"][m] < v["cublas_us"][m]
                tuned[(v["N"], v["K"], v["kind"], skinny.block_m(m))] = tuple(v["best_by_rows"][m]) if won else None
        print("TUNED = {" + ", ".join(f"{key}: {cfg}" for key, cfg in tuned.items()) + "}")
    else:
        print("TUNED = {" + ", ".join(f"({v['N']}, {v['K']}, {v['kind']!r}): {tuple(v['best'])}"
                                      for v in res["shapes"].values()) + "}")
    res["seconds"] = round(time.time() - t0, 1)
    emit_document(res, a.out)


if __name__ == "__main__":
    main()
