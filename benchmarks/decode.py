"""Decode step time of the reference engine on the Qwen3-4B shape, against the floors measured in the same run.

For each context (512, 2048) and batch (1, 8, 16, 32, 64): B requests are prefilled to the context, then
each variant runs steady-state `engine.step()` calls (warm-up excluded, median reported):
  fi-graph           the engine's defaults on CUDA: FlashInfer attention with the split-K Triton decode kernel,
                     decode CUDA graphs, Triton kernels (add+RMSNorm, SwiGLU, q/k norm + RoPE + KV store, the
                     GEMVs where they measured faster than cuBLAS at one row) around cuBLAS GEMMs
  fi-eager           the same kernels and padded shapes, launched without graphs (EngineConfig.eager)
  fi-graph-gemv      FlashInfer's tensor-core decode with the Triton GEMVs of kernels/gemv.py (EngineConfig.gemv)
                     for steps of at most gemv.MAX_ROWS rows, on the shapes gemv.TUNED gives a config for
  fi-graph-notriton  fi-graph with the torch reference dense ops (no Triton), B <= 16
  fi-tc-graph        FlashInfer's tensor-core (FA2) decode kernels (EngineConfig.decode_tensor_cores), no GEMV
                     (the engine's default before 2026-11-29 afternoon)
  fi-cc-graph        FlashInfer's CUDA-core decode kernel (decode_tensor_cores=False; fi-graph before 2026-11-29)
  fi-tritondecode-graph  decode attention by the Triton split-K kernel (kernels/decode_attention.py,
                     EngineConfig.decode_attention="triton"; prefill stays on FlashInfer), no GEMV
  fi-tritondecode-gemv-graph  split-K Triton decode and the GEMVs (what fi-graph runs with the defaults)
  torch-graph        torch reference attention, piecewise graphs (dense segments captured, attention eager)
  torch-eager        torch reference attention, no graphs
`wall` is the engine step (host scheduling, sampling and its sync included); `gpu` is the captured step
replayed back-to-back (the device time of the step alone). Floors:
  dense  all of the step's matmuls (merged qkv, o, merged gate/up, down for every layer, then the lm_head,
         the model's own distinct weights) captured in ONE CUDA graph with cuBLAS, replayed;
  bw     (weight bytes + KV bytes read at the measured mean context) / device-to-device copy bandwidth
         (bytes read + written) measured in this run.
Peer: HF transformers eager `generate` on the same checkpoint, batch 1, 128 new tokens.
Prints a table, then one JSON document as the last line.

Usage: python -m specbench.benchmarks.decode [--model DIR] [--batches 1,8,16,32,64] [--contexts 512,2048]
       [--out FILE] [--no-hf] [--quick]     (also `specbench bench-decode`)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specbench.engine.config import DeviceUnavailable, require_device
from specbench.harness.benchdoc import emit_document, positive_ints

if TYPE_CHECKING:
    from specbench.engine.graphs import DecodeGraphs
    from specbench.kernels.ops import TritonOps

VARIANTS = {  # name: (attention backend, capture graphs, ops: "engine" | "triton" | "gemv" | "torch", max batch)
    "fi-graph": ("flashinfer", True, "engine", None),
    "fi-eager": ("flashinfer", False, "engine", None),
    "fi-graph-gemv": ("flashinfer-tc", True, "gemv", None),
    "fi-graph-notriton": ("flashinfer", True, "torch", 16),
    "fi-tc-graph": ("flashinfer-tc", True, "triton", None),
    "fi-cc-graph": ("flashinfer-cc", True, "triton", None),
    "fi-tritondecode-graph": ("flashinfer-tritondecode", True, "triton", None),
    "fi-tritondecode-gemv-graph": ("flashinfer-tritondecode", True, "gemv", None),
    "torch-graph": ("torch", True, "triton", None),
    "torch-eager": ("torch", False, "triton", None),
}
STEPS = {"fi-graph": (5, 30), "fi-eager": (2, 10), "torch-graph": (2, 6), "torch-eager": (2, 6),
         "fi-graph-gemv": (3, 20), "fi-graph-notriton": (3, 20), "fi-tc-graph": (5, 30), "fi-cc-graph": (5, 30),
         "fi-tritondecode-graph": (5, 30), "fi-tritondecode-gemv-graph": (5, 30)}
PROFILED = ("fi-graph", "fi-tritondecode-graph", "fi-graph-gemv", "fi-tritondecode-gemv-graph")  # at batch 1  # (warm-up, timed)


def _events_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    ms = _events_ms(lambda: y.copy_(x), reps=10)
    return 2 * nbytes / (ms * 1e-3)


def step_weights(model) -> list[torch.Tensor]:
    ws = [w for ly in model.layers for w in (ly.qkv_w, ly.o_w, ly.gate_up_w, ly.down_w)]
    return ws + [model.lm_head_w]


def dense_floor_ms(model, batch: int) -> float:
    """All the step's matmuls, distinct weights, one CUDA graph of cuBLAS calls."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ins = {k: torch.randn(batch, k, generator=g, device="cuda").to(model.embed.dtype)
           for k in {w.shape[1] for w in step_weights(model)}}

    def body() -> None:
        for w in step_weights(model):
            F.linear(ins[w.shape[1]], w)

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    ms = _events_ms(graph.replay, reps=20)
    del graph
    return ms


def kv_bytes(mcfg, batch: int, ctx: float, elem: int = 2) -> float:
    return batch * ctx * mcfg.num_hidden_layers * 2 * mcfg.num_key_value_heads * mcfg.head_dim * elem


def _tokenizer_dir() -> Path:
    """A minimal word-level tokenizer: the benchmark feeds and reads token ids only."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    d = Path(tempfile.mkdtemp(prefix="tok-"))
    Tokenizer(WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (d / "special_tokens_map.json").write_text("{}")
    return d


def build_target(out: Path) -> Path:
    from specbench.harness.fixtures import build_qwen3_4b_shape

    t0 = time.time()
    target, _ = build_qwen3_4b_shape(out, seed=0, device="cuda", tokenizer_dir=_tokenizer_dir())
    print(f"built the Qwen3-4B-shaped random checkpoint in {time.time() - t0:.0f} s: {target}", flush=True)
    return target


class Bench:
    """One engine; variants swap its attention backend, dense ops and decode runner (CPU: torch ones only)."""

    def __init__(self, model_dir: str, max_batch: int, device: str = "cuda", batches: tuple[int, ...] = ()) -> None:
        from specbench.engine import EngineConfig, LLMEngine
        from specbench.engine.runner import make_backend

        cuda = device == "cuda"
        self.engine = LLMEngine(EngineConfig(model=model_dir, device=device, dtype="bfloat16" if cuda else "float32",
                                             max_num_seqs=max_batch, max_num_batched_tokens=16384,
                                             gpu_memory_utilization=0.5, attention_backend="auto", eager=False))
        r = self.engine.runner
        self.backends = {r.backend.name: r.backend}
        self.backends.setdefault("torch", make_backend("torch", r.device))
        self.ops: dict[str, TritonOps | None] = {"torch": None}
        if cuda:
            from specbench.engine.attention.flashinfer import FlashInferAttention
            from specbench.kernels.ops import TritonOps

            fb = r.backend
            assert isinstance(fb, FlashInferAttention), "flashinfer did not load"
            self.backends["flashinfer-cc"] = make_backend("flashinfer", r.device, self.engine.mcfg, fb.dtype, fb.max_pages,
                                                          r.model.ops, decode_tensor_cores=False,
                                                          decode_attention="flashinfer")
            self.backends["flashinfer-tc"] = make_backend("flashinfer", r.device, self.engine.mcfg, fb.dtype, fb.max_pages,
                                                          r.model.ops, decode_tensor_cores=True,
                                                          decode_attention="flashinfer")
            self.backends["flashinfer-tritondecode"] = make_backend(
                "flashinfer", r.device, self.engine.mcfg, fb.dtype, fb.max_pages, r.model.ops,
                decode_tensor_cores=fb.decode_tensor_cores, decode_attention="triton")
            self.ops.update(triton=TritonOps(gemv=False), gemv=TritonOps(gemv=True))  # gemv up to gemv.MAX_ROWS
        else:
            self.ops.update(triton=None, gemv=None)
        self.ops["engine"] = r.model.ops  # the engine's own choice (EngineConfig defaults)
        self.fill_variant = "fi-graph" if cuda else "torch-eager"
        self.batches = batches
        self.graphs: dict[str, DecodeGraphs] = {}
        self.max_batch = max_batch

    def use(self, variant: str) -> None:
        from specbench.engine.graphs import DecodeGraphs, default_buckets

        backend, capture, ops, cap = VARIANTS[variant]
        r = self.engine.runner
        r.backend = self.backends[backend]
        r.model.ops = self.ops[ops]
        if variant not in self.graphs:
            t0 = time.time()
            buckets = default_buckets(min(cap or self.max_batch, self.max_batch))
            if backend == "torch" and capture and self.batches:  # piecewise: 37 captures a bucket, keep it to those used
                buckets = sorted({b for b in self.batches if b <= (cap or self.max_batch)})
            self.graphs[variant] = DecodeGraphs(r, (), capture=capture, buckets=buckets)
            print(f"  {variant}: decode runner ready ({self.graphs[variant].mode}, buckets {buckets}) "
                  f"in {time.time() - t0:.1f} s", flush=True)
        r.graphs = self.graphs[variant]

    def fill(self, batch: int, ctx: int, seed: int) -> list[str]:
        from specbench.engine import SamplingParams

        self.use(self.fill_variant)
        g = torch.Generator().manual_seed(seed)
        vocab = self.engine.mcfg.vocab_size
        sp = SamplingParams(max_tokens=400, ignore_eos=True)
        rids = [self.engine.add_request(torch.randint(0, vocab, (ctx,), generator=g).tolist(), sp)
                for _ in range(batch)]
        while any(self.engine.requests[rid].in_prefill for rid in rids):
            self.engine.step()
        return rids

    def context(self, rids: list[str]) -> float:
        return statistics.mean(self.engine.requests[rid].num_computed for rid in rids)

    def steps(self, variant: str, rids: list[str]) -> dict:
        self.use(variant)
        warm, n = STEPS[variant]
        for _ in range(warm):
            self.engine.step()
        ctx0 = self.context(rids)
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            self.engine.step()
            ts.append((time.perf_counter() - t) * 1e3)
        out = {"wall_ms": statistics.median(ts), "ctx": (ctx0 + self.context(rids)) / 2}
        graphs = self.engine.runner.graphs
        assert graphs is not None, "the steps ran without a decode runner"  # use() installed one
        n = len(rids)
        if graphs.capture and graphs.full and graphs.bucket(n) == n:
            out["gpu_ms"] = _events_ms(graphs._graphs[n][0].replay, reps=20)
        return out

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    def profile(self, rids: list[str], top: int = 16, variant: str = "fi-graph") -> list[dict]:
        """Device time by kernel over 10 replays of the captured step (fi-graph, or another whole-graph variant)."""
        from torch.profiler import ProfilerActivity, profile

        self.use(variant)
        self.engine.step()
        graphs = self.engine.runner.graphs
        b = graphs.bucket(len(rids)) if graphs is not None else None
        assert graphs is not None and b is not None, f"no decode graph for {len(rids)} rows"
        g = graphs._graphs[b][0]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
        rows = [{"name": e.key[:90], "calls": e.count // 10,
                 "us_per_step": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 10}
                for e in prof.key_averages()]
        rows = [r for r in rows if r["us_per_step"] > 0]
        return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def hf_peer(model_dir: str, new_tokens: int = 128) -> dict:
    from specbench.extras import need

    AutoModelForCausalLM = need("transformers", "hf", "the hf peer of benchmarks/decode.py").AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(2, 4000, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    n = out.shape[1] - ids.shape[1]
    del m
    gc.collect()
    torch.cuda.empty_cache()
    import transformers

    return {"tokens": n, "seconds": dt, "tok_s": n / dt, "ms_per_token": dt / n * 1e3,
            "transformers": transformers.__version__}


def run(model: str | None = None, batches: tuple[int, ...] = (1, 8, 16, 32, 64),
        contexts: tuple[int, ...] = (512, 2048), hf: bool = True, variants: tuple[str, ...] = tuple(VARIANTS),
        workdir: str | None = None, budget_s: float | None = None, out: str | None = None) -> dict:
    """Rows run batch-major (both contexts of batch 1 first); past `budget_s` no new row starts and the
    HF peer is skipped. With `out`, the JSON so far is rewritten after every row."""
    import specbench
    from specbench.kernels import gemv

    require_device("cuda", "benchmarks/decode.py")  # DeviceUnavailable: CANNOT TEST (exit 3), not a crash
    t_start = time.time()
    model_dir = Path(model) if model else build_target(Path(workdir or tempfile.mkdtemp(prefix="q3-4b-")))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    bench = Bench(str(model_dir), max(batches), batches=batches)
    m, mcfg = bench.engine.model, bench.engine.mcfg
    wbytes = sum(w.numel() * w.element_size() for w in step_weights(m))
    dense = {b: dense_floor_ms(m, b) for b in batches}
    print("dense floor (ms): " + ", ".join(f"B={b} {v:.3f}" for b, v in dense.items()), flush=True)
    rows: list[dict] = []
    prof: dict | None = None
    res: dict = {"bench": "decode", "version": specbench.__version__, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "model": str(model_dir), "copy_bw_tb_s": bw / 1e12, "weight_bytes": wbytes,
           "dense_floor_ms": dense, "rows": rows, "hf_peer": None, "profile_b1": {}, "complete": False}
    over = lambda: budget_s is not None and time.time() - t_start > budget_s  # noqa: E731
    for b in batches:
        for ctx in contexts:
            if over():
                print(f"budget of {budget_s} s spent: skipping batch {b} context {ctx}", flush=True)
                continue
            t0 = time.time()
            rids = bench.fill(b, ctx, seed=b * 7919 + ctx)
            row: dict = {"batch": b, "context": ctx, "dense_ms": dense[b], "variants": {}}
            for v in variants:
                cap = VARIANTS[v][3]
                if cap is not None and b > cap:
                    continue
                vr = bench.steps(v, rids)
                vr["bw_floor_ms"] = (wbytes + kv_bytes(mcfg, b, vr["ctx"])) / bw * 1e3
                for k in ("wall_ms", "gpu_ms"):
                    if k in vr:
                        vr[k.replace("_ms", "_over_dense")] = vr[k] / dense[b]
                        vr[k.replace("_ms", "_bw_ratio")] = vr["bw_floor_ms"] / vr[k]
                row["variants"][v] = vr
                print(f"  ctx {ctx} B {b} {v}: " + ", ".join(f"{k} {x:.3f}" for k, x in vr.items()), flush=True)
            if prof is None and b == 1:  # device time by kernel of the whole-graph variants, once
                prof = res["profile_b1"] = {v: bench.profile(rids, variant=v) for v in PROFILED if v in variants}
            bench.abort(rids)
            rows.append(row)
            res["gemv_tuned"] = {str(k): v for k, v in gemv.TUNED.items()}
            if out:
                Path(out).write_text(json.dumps(res, default=str) + "\n")
            print(f"ctx {ctx} batch {b} done in {time.time() - t0:.1f} s", flush=True)
    del bench
    gc.collect()
    torch.cuda.empty_cache()
    if hf and not over():
        res["hf_peer"] = hf_peer(str(model_dir))
    res["complete"] = len(rows) == len(batches) * len(contexts) and (res["hf_peer"] is not None or not hf)
    res["seconds"] = time.time() - t_start
    return res


def render(res: dict) -> str:
    lines = [f"# decode on {res['gpu']}: copy {res['copy_bw_tb_s']:.2f} TB/s, weights {res['weight_bytes'] / 1e9:.2f} GB",
             "ctx  | B  | variant               | wall ms | gpu ms | dense ms | bw ms  | gpu/dense | wall/dense | bw/gpu | tok/s",
             "---- | -- | --------------------- | ------- | ------ | -------- | ------ | --------- | ---------- | ------ | -----"]
    for row in res["rows"]:
        for v, r in row["variants"].items():
            gpu = r.get("gpu_ms")
            lines.append(
                f"{row['context']:<4} | {row['batch']:<2} | {v:<21} | {r['wall_ms']:7.3f} | "
                f"{gpu if gpu is not None else float('nan'):6.3f} | {row['dense_ms']:8.3f} | {r['bw_floor_ms']:6.3f} | "
                f"{r.get('gpu_over_dense', float('nan')):9.3f} | {r['wall_over_dense']:10.3f} | "
                f"{r.get('gpu_bw_ratio', float('nan')):6.3f} | {row['batch'] * 1e3 / r['wall_ms']:.0f}")
    if res.get("hf_peer"):
        p = res["hf_peer"]
        lines.append(f"HF transformers {p['transformers']} eager generate, batch 1: {p['tok_s']:.1f} tok/s "
                     f"({p['ms_per_token']:.1f} ms/token over {p['tokens']} tokens)")
    for v, prof in (res.get("profile_b1") or {}).items():
        lines.append(f"device time per step at batch 1 ({v}), top kernels:")
        lines += [f"  {r['us_per_step']:8.1f} us  x{r['calls']:<3} {r['name']}" for r in prof]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen3 checkpoint dir (default: build the Qwen3-4B-shaped random one)")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workdir", help="where to build the random checkpoint (default: a temp dir)")
    ap.add_argument("--out", help="also write the JSON document here")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--quick", action="store_true", help="batches 1,16 and context 512 only")
    ap.add_argument("--budget-s", type=float, help="start no new row (and skip the HF peer) past this many seconds")
    a = ap.parse_args(argv)
    batches, contexts = ((1, 16), (512,)) if a.quick else (
        positive_ints(a.batches, "--batches"), positive_ints(a.contexts, "--contexts"))
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: {bad} invalid: expected some of {', '.join(VARIANTS)}")
    res = run(a.model, batches, contexts, hf=not a.no_hf, variants=tuple(a.variants.split(",")), workdir=a.workdir,
              budget_s=a.budget_s, out=a.out)
    print(render(res))
    emit_document(res, a.out)
    return res


if __name__ == "__main__":
    try:
        main()
    except DeviceUnavailable as e:  # as `specbench bench-decode` reports it: one line, CANNOT TEST
        print(f"benchmarks/decode.py: {e}", file=sys.stderr)
        sys.exit(3)
