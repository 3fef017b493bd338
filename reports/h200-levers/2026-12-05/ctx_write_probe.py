"""What a one-token (gated) round's drafter capture costs on the device (issue 20, the tau 2.0 gap), without the
engine: the context write that the gated decode graphs add to a plain decode step (DFlashProposer.write_context at
the Qwen3-4B-shaped pair's geometry: fc over the 5 tapped layers + hidden_norm, then per drafter layer the K/V
projection, K norm, RoPE and the store into its paged cache), captured in a CUDA graph and replayed, beside the
target's dense decode matmuls at the same rows (the dense floor: 36 layers x qkv / o / gate-up / down + lm_head).
Also the variant with the 5 per-layer K/V projections as one GEMM. Pure torch, random weights: no fixtures, no
FlashInfer, no Triton, so it fits a short call on a bare machine.

Usage: python3 ctx_write_probe.py [--rows 1,8,16,32,64] [--repeats 50] [--out DIR]; on CPU it runs a 1/16 scale
eagerly (a smoke test of the code, no figures)."""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--rows", default="1,8,16,32,64")
ap.add_argument("--repeats", type=int, default=50)
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
a = ap.parse_args()
cuda = torch.cuda.is_available()
dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
s = 1 if cuda else 16  # scale-down on CPU
H, FF, L, V = 2560 // s, 9728 // s, 36 if cuda else 2, 151936 // s
HQ, HKV, D = 32, 8, 128 // s
TAPS, DL = 5, 5  # tapped target layers, drafter layers
KV = 2 * HKV * D
SLOTS = 65536 // s
eps = 1e-6


def w(*shape):
    return torch.randn(*shape, device=dev, dtype=dt) * 0.02


fc = w(H, TAPS * H)
hnorm = torch.ones(H, device=dev, dtype=dt)
kvw = [w(KV, H) for _ in range(DL)]
kvw_cat = torch.cat(kvw, 0)
knorm = torch.ones(D, device=dev, dtype=dt)
kc = [torch.zeros(SLOTS, HKV, D, device=dev, dtype=dt) for _ in range(DL)]
vc = [torch.zeros(SLOTS, HKV, D, device=dev, dtype=dt) for _ in range(DL)]
inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
ang = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] * inv[None]
cos, sin = ang.cos().to(dt), ang.sin().to(dt)
layers = [(w(HQ * D + KV, H), w(H, HQ * D), w(2 * FF, H), w(H, FF)) for _ in range(L)]
lm = w(V, H)


def rms(x, g):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g


def rope(k, pos):
    c, sn = cos[pos][:, None], sin[pos][:, None]
    k1, k2 = k[..., : D // 2], k[..., D // 2:]
    return torch.cat([k1 * c - k2 * sn, k2 * c + k1 * sn], -1)


def store(i, kv, pos, slots):
    k, v = kv.split([KV // 2, KV // 2], -1)
    t = kv.shape[0]
    kc[i][slots] = rope(rms(k.reshape(t, HKV, D), knorm), pos)
    vc[i][slots] = v.reshape(t, HKV, D)


def ctx_write(taps, pos, slots):  # the engine's write_context (torch path)
    feats = rms(F.linear(taps, fc), hnorm)
    for i in range(DL):
        store(i, F.linear(feats, kvw[i]), pos, slots)


def ctx_write_cat(taps, pos, slots):  # one GEMM for the 5 layers' K/V
    feats = rms(F.linear(taps, fc), hnorm)
    for i, kv in enumerate(F.linear(feats, kvw_cat).split(KV, -1)):
        store(i, kv, pos, slots)


def ctx_gemms(taps, pos, slots):  # the GEMMs alone: what the weight reads cost
    F.linear(F.linear(taps, fc), kvw_cat)


def dense(x):  # the target's decode matmuls at these rows
    for qkv, o, gu, dn in layers:
        x = F.linear(F.linear(x, qkv)[:, : HQ * D], o)
        x = F.linear(F.silu(F.linear(x, gu)[:, :FF]), dn)
    return F.linear(x, lm)


def timed(fn, args):
    if not cuda:
        fn(*args)
        return float("nan")
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    for _ in range(5):
        g.replay()
    ms = []
    for _ in range(a.repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1))
    return statistics.median(ms)


res = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke, 1/16 scale)", "torch": torch.__version__,
       "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "repeats": a.repeats, "rows": {}}
for b in (int(x) for x in a.rows.split(",")):
    taps = w(b, TAPS * H)
    pos = torch.arange(100, 100 + b, device=dev)
    slots = torch.arange(1000, 1000 + b, device=dev)
    r = {"ctx_write_ms": timed(ctx_write, (taps, pos, slots)),
         "ctx_write_one_kv_gemm_ms": timed(ctx_write_cat, (taps, pos, slots)),
         "ctx_gemms_only_ms": timed(ctx_gemms, (taps, pos, slots)),
         "dense_step_ms": timed(dense, (w(b, H),))}
    r["ctx_write_over_dense"] = r["ctx_write_ms"] / r["dense_step_ms"]
    res["rows"][b] = r
    print(b, json.dumps(r), flush=True)
out = Path(a.out) / "ctx-write-probe"
out.mkdir(parents=True, exist_ok=True)
(out / "ctx_write.json").write_text(json.dumps(res, indent=1))
