"""`specbench profile`: an engine's decode steps under the PyTorch profiler, for `gaps` to attribute.

Contract: `run_profile(adapter, ...)` needs the adapter's "decode_window" capability (the engine in this
process, stepped by the caller; harness/adapters/base.py): `batch` requests (gsm8k prompts, greedy,
ignore_eos) are stepped past prefill plus `warmup` steps, then `steps` engine steps are recorded under
torch.profiler (CPU + CUDA activities when the engine is on CUDA) and written as a Kineto chrome trace.
The engine must open its phase ranges (schedule, draft, verify|forward, accept, commit); the caller runs
`gaps` on the trace. On a CPU-only run the trace has no GPU activity, which the report says. An adapter
without the capability (a remote endpoint, transformers) raises `UnsupportedCapability`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specbench.harness.adapters.base import EngineAdapter
from specbench.harness.datasets import bundled_prompts


@dataclass
class ProfileResult:
    trace: Path
    steps: int
    seconds: float
    tokens: int
    describe: dict


def gsm8k_prompts(n: int) -> list[str]:
    return [text for _, text in bundled_prompts("gsm8k")[:n]]


def run_profile(adapter: EngineAdapter, out_dir: Path, steps: int = 20, batch: int = 1, warmup: int = 3,
                max_tokens: int = 128) -> ProfileResult:
    with adapter.decode_window(gsm8k_prompts(batch), max_tokens, warmup=warmup) as window:
        if not window.phase_ranges:
            raise ValueError(f"{adapter.name}: the engine opens no phase ranges, so the trace would carry no "
                             "phases: build it with them on (local engine: trace_ranges=True)")
        cuda = torch.cuda.is_available() and window.device.startswith("cuda")
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        tokens = 0
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                if not window.busy:
                    break
                tokens += window.step()
            if cuda:
                torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    return ProfileResult(trace, steps, secs, tokens, adapter.describe())


PHASES = ("schedule", "draft", "verify", "forward", "accept", "commit")


def phase_host_times(trace: Path) -> dict[str, float]:
    """Host-side milliseconds per engine phase (record_function ranges) in a Kineto trace."""
    doc = json.loads(Path(trace).read_text())
    out: dict[str, float] = {}
    for e in doc.get("traceEvents", []):
        if e.get("cat") == "user_annotation" and e.get("name") in PHASES:
            out[e["name"]] = out.get(e["name"], 0.0) + float(e.get("dur", 0)) / 1000.0
    return out
