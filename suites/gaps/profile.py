"""`specbench profile`: run the reference engine's decode under the PyTorch profiler and attribute gaps.

Contract: builds a local engine with phase ranges on (`EngineConfig.trace_ranges`), starts `batch`
requests (gsm8k prompts, ignore_eos), runs until every request is past prefill plus `warmup` steps,
then records `steps` engine steps under torch.profiler (CPU + CUDA activities when CUDA is present) and
writes a Kineto chrome trace. The caller runs `gaps` on it (phases: schedule, draft, verify|forward,
accept, commit). On a CPU-only run the trace has no GPU activity, which the report says.
Local engines only: the profiler must run in the engine's process.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch


@dataclass
class ProfileResult:
    trace: Path
    steps: int
    seconds: float
    tokens: int
    describe: dict


def gsm8k_prompts(n: int) -> list[str]:
    path = resources.files("specbench.harness") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [f"Question: {r['question']}\nAnswer:" for r in rows]


def run_profile(engine_cfg, out_dir: Path, steps: int = 20, batch: int = 1, warmup: int = 3,
                max_tokens: int = 128) -> ProfileResult:
    from specbench.engine import LLMEngine, SamplingParams

    eng = LLMEngine(engine_cfg.with_(trace_ranges=True))
    prompts = gsm8k_prompts(batch)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, sp, rid=f"prof-{i}")
    while eng.scheduler.waiting or any(r.in_prefill for r in eng.scheduler.running):
        eng.step()
    for _ in range(warmup):
        eng.step()
    cuda = torch.cuda.is_available() and engine_cfg.device.startswith("cuda")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    tokens = 0
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            if not eng.has_unfinished():
                break
            tokens += sum(len(o.new_ids) for o in eng.step())
        if cuda:
            torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    for r in list(eng.scheduler.running):
        eng.abort(r.rid)
    return ProfileResult(trace, steps, secs, tokens, eng.describe())


PHASES = ("schedule", "draft", "verify", "forward", "accept", "commit")


def phase_host_times(trace: Path) -> dict[str, float]:
    """Host-side milliseconds per engine phase (record_function ranges) in a Kineto trace."""
    doc = json.loads(Path(trace).read_text())
    out: dict[str, float] = {}
    for e in doc.get("traceEvents", []):
        if e.get("cat") == "user_annotation" and e.get("name") in PHASES:
            out[e["name"]] = out.get(e["name"], 0.0) + float(e.get("dur", 0)) / 1000.0
    return out
