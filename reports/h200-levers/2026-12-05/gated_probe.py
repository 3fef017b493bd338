"""Why a one-token round with the drafter's capture (gate 1) costs more than plain decode (issue 20, tau 2.0 gap):
per-step wall of plain vs gate-1 engines at c16 / c32 (interleaved repeats), then a torch profiler table of the
CUDA kernels of each over the same generate call."""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specbench.engine import LLM, SamplingParams

pair = Path("/tmp/q3-4b-pair")
if not (pair / "target" / "config.json").exists():
    subprocess.run([sys.executable, "-m", "specbench", "fixtures", "--shape", "qwen3-4b", "--out", str(pair),
                    "--device", "cuda"], check=True)
out = Path(os.environ.get("OUT", "/tmp")) / "gated-probe"
out.mkdir(parents=True, exist_ok=True)
common = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=1024)
plain = LLM(str(pair / "target"), spec="off", gpu_memory_utilization=0.4, **common)
gated = LLM(str(pair / "target"), draft=str(pair / "draft"), spec="dflash", synthetic_tau=2.0, spec_gate=1,
            gpu_memory_utilization=0.85, **common)
for e in (plain, gated):
    e.engine.capture_graphs()
g = torch.Generator().manual_seed(0)
res = {}


def run(llm, c, n=128):
    ps = [torch.randint(100, 100000, (128,), generator=g).tolist() for _ in range(c)]
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    s0 = llm.engine.step_count
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(ps, sp)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, llm.engine.step_count - s0


for c in (16, 32):
    run(plain, c, 16)
    run(gated, c, 16)
    per = {"plain": [], "gated": []}
    for _ in range(3):
        for name, llm in (("plain", plain), ("gated", gated)):
            ms, steps = run(llm, c)
            per[name].append(ms / steps)
    res[c] = {k: {"median_ms_per_step": statistics.median(v), "all": v} for k, v in per.items()}
    print(c, json.dumps(res[c]), flush=True)
(out / "steps.json").write_text(json.dumps(res, indent=1))
for name, llm in (("plain", plain), ("gated", gated)):
    run(llm, 32, 8)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        ms, steps = run(llm, 32, 48)
    tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
    (out / f"kernels-{name}-c32.txt").write_text(f"{steps} steps, {ms:.1f} ms\n" + tab)
    print(name, steps, "steps", f"{ms:.1f} ms", flush=True)
    print(tab[:4000], flush=True)
