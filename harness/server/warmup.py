"""The server's warm-up: every kernel variant and CUDA graph the serving path uses, run before ready.

Why (#28 item 5): FlashInfer JIT-compiles its prefill module at first use, Triton compiles each kernel
specialization at its first launch, and the verify / draft graphs are captured lazily, one row count at a
time. On the H200 a fresh `specbench serve` on the Qwen3-4B-shaped pair answered /health after 10 s and its
first completion 88 s later. The server now runs this warm-up on its engine-loop thread before it serves
(harness/adapters/loop.py `warmup=`), and /health answers 503 "starting" until it is done.

Contract:
- `run_warmup(engine, stop=None, progress=None, plan=None) -> dict` drives the engine through its public
  surface only (add_request / step / abort / describe / fast_path_stats / metrics), synchronously, on the
  caller's thread. It is the `warmup=` callable of `EngineLoop` (`make_warmup(plan)` binds a plan).
- Phases (`WarmupPlan`, `default_plan(engine)`):
  * one per batch size b: on CUDA every graph bucket (1, 2, 4, 8, 16, 24, ..., max_num_seqs: graphs.py
    `default_buckets`), on CPU (no graphs, nothing compiled) 1 and 2. b requests are added at once, with
    short repetitive prompts (so the n-gram proposer finds a match) no longer than the verify span: their
    joint prefill runs at the padded verify-graph key (b, span), the drafts at bucket b, the verify steps at
    (b, span), the decode steps at decode bucket b. Kinds cycle greedy / sampled (temperature 1) /
    filtered (temperature 0.7, top_p 0.9, top_k 40) over the requests, with more rounds where b < 3, so
    every kind runs at every batch size;
  * logprobs: generated logprobs (greedy and sampled; they speculate, so top-k logprobs over verify rows, or
    span-1 steps with SPECBENCH_SPEC_LOGPROBS=0) and prompt logprobs (every prefill row's logits);
  * long (CUDA by default): one prompt longer than the step's token budget and the largest graph row count
    (chunked prefill through the plain forward), beside two short requests whose decode / verify spans
    share those steps.
  A phase whose requests the engine refuses (a pool too small for the long prompt) is recorded as skipped.
- The engine's RNG is untouched (every warm-up request carries its own seed) and its counters are reset
  afterwards (`EngineMetrics.reset`): /metrics starts from zero at ready, and the server samples as a
  server without the warm-up would.
- `stop` (a threading.Event) is checked between steps: a server shut down during the warm-up ends it.
  Every warm-up request still in the engine is aborted on the way out, also on an error (which propagates:
  the loop records it as a failed warm-up and serves anyway).
- `progress(**fields)` is called before each phase (`phase`, `phases_done`, `phases`).
- Returns {"plan", "phases": [{"name", "requests", "steps", "seconds"} | {"name", "skipped"}], "requests",
  "steps", "tokens", "warmup_s", "counted" (what the warm-up added to the engine's counters before their reset: drafts, ...),
  "fast_path" (engine.fast_path_stats()), "verify_rows_missing" (graph row counts the
  plan meant to capture and the engine did not), "caches" (`kernel_caches()`)}; logs each phase at debug
  and one summary line at info ("specbench.server").
- `kernel_caches()`: where compiled kernels persist across runs: FlashInfer's JIT directory
  (FLASHINFER_WORKSPACE_BASE, default the home directory, + .cache/flashinfer), its AOT directory (the
  package's data/aot, where scripts/gpu.sh restores the carried modules) and Triton's cache
  (TRITON_CACHE_DIR, default ~/.triton/cache). Nothing in the server or the engine sets these variables.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specbench.engine import SamplingParams

log = logging.getLogger("specbench.server")

KINDS = ("greedy", "sampled", "filtered")


@dataclass(frozen=True)
class WarmupPlan:
    batch_sizes: tuple[int, ...]
    prompt_len: int = 8
    max_tokens: int = 4
    logprobs: bool = True
    long_prompt: int = 0  # tokens of the long-prompt phase; 0 = no such phase
    max_steps: int = 4000  # per phase: a guard against a phase that cannot finish
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "extra"} | self.extra


def verify_span(engine: Any) -> int:
    """The row quantum of the engine's padded verify graphs: its longest verify span when speculating (K + 1, or
    trim + 1 with a draft trim: engine/spec/plan.py `span_variants`), else NO_SPEC_SPAN."""
    from specbench.engine.graphs import NO_SPEC_SPAN

    if not getattr(engine, "spec_on", False):
        return NO_SPEC_SPAN
    variants = getattr(getattr(engine, "spec", None), "span_variants", ())
    return max(variants) if variants else engine.k + 1


def default_plan(engine: Any) -> WarmupPlan:
    from specbench.engine.graphs import default_buckets

    cfg = engine.cfg
    cuda = str(cfg.device).startswith("cuda")
    span = verify_span(engine)
    sizes = tuple(default_buckets(cfg.max_num_seqs)) if cuda else (1, 2)
    prompt_len = max(2, min(8, span))
    long_prompt = 0
    if cuda:
        # past the step's token budget and the largest padded graph, inside the context and the pool
        d = engine.describe()
        pool = d["num_pages"] * d["page_size"] - 2 * d["page_size"] - span - 64
        want = max(cfg.max_num_batched_tokens, sizes[-1] * span) + 37
        long_prompt = max(0, min(want, engine.max_model_len - 8, pool))
    return WarmupPlan(batch_sizes=sizes, prompt_len=prompt_len, long_prompt=long_prompt,
                      extra={"span": span, "device": str(cfg.device)})


def _params(kind: str, seed: int, max_tokens: int, **kw: Any) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=seed, ignore_eos=True, **kw)
    if kind == "sampled":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **kw)
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, top_k=40, seed=seed,
                          ignore_eos=True, **kw)


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    """A period-2 pattern [a, b, a, b, ...]: its suffix always occurs earlier (n-gram drafts)."""
    a, b = (7 + 13 * i) % vocab, (101 + 29 * i) % vocab
    return [a if j % 2 == 0 else b for j in range(n)]


class _Stopped(Exception):
    pass


class _Run:
    def __init__(self, engine: Any, stop: threading.Event | None) -> None:
        self.engine, self.stop = engine, stop
        self.live: set[str] = set()
        self.n = 0
        self.steps = self.tokens = self.requests = 0

    def add(self, prompt: list[int], params: SamplingParams) -> str:
        rid = f"warmup-{self.n}"
        self.n += 1
        self.engine.add_request(prompt, params, rid=rid)
        self.live.add(rid)
        self.requests += 1
        return rid

    def drain(self, max_steps: int) -> int:
        steps = 0
        while self.live:
            if self.stop is not None and self.stop.is_set():
                raise _Stopped
            if steps >= max_steps:
                raise RuntimeError(f"warm-up: {len(self.live)} requests unfinished after {steps} steps")
            for out in self.engine.step():
                if out.rid in self.live:
                    self.tokens += len(getattr(out, "new_ids", ()) or ())
                    if out.finished:
                        self.live.discard(out.rid)
            steps += 1
        self.steps += steps
        return steps

    def abort_all(self) -> None:
        for rid in list(self.live):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - cleaning up must not mask the error being raised
                pass
        self.live.clear()


def _phases(plan: WarmupPlan, vocab: int) -> list[tuple[str, list[tuple[list[int], SamplingParams]]]]:
    out = []
    seed = 1000
    for b in plan.batch_sizes:
        rounds = math.ceil(len(KINDS) / b)
        for r in range(rounds):
            reqs = []
            for j in range(b):
                kind = KINDS[(r * b + j) % len(KINDS)]
                seed += 1
                reqs.append((_prompt(seed, plan.prompt_len, vocab), _params(kind, seed, plan.max_tokens)))
            out.append((f"batch-{b}" + (f"-r{r}" if rounds > 1 else ""), reqs))
    if plan.logprobs:
        out.append(("logprobs", [
            (_prompt(1, plan.prompt_len, vocab), _params("greedy", 1, plan.max_tokens, logprobs=5)),
            (_prompt(2, plan.prompt_len, vocab), _params("filtered", 2, plan.max_tokens, logprobs=5)),
            (_prompt(3, plan.prompt_len, vocab), _params("greedy", 3, 2, prompt_logprobs=5))]))
    if plan.long_prompt > 0:
        out.append(("long", [
            (_prompt(4, plan.prompt_len, vocab), _params("greedy", 4, plan.max_tokens + 4)),
            (_prompt(5, plan.prompt_len, vocab), _params("filtered", 5, plan.max_tokens + 4)),
            (_prompt(6, plan.long_prompt, vocab), _params("greedy", 6, plan.max_tokens))]))
    return out


def run_warmup(engine: Any, stop: threading.Event | None = None, progress: Callable[..., None] | None = None,
               plan: WarmupPlan | None = None) -> dict:
    plan = plan or default_plan(engine)
    phases = _phases(plan, engine.mcfg.vocab_size)
    run = _Run(engine, stop)
    record: list[dict] = []
    caches = kernel_caches()
    log.info("warm-up: %d phases (batch sizes %s); compiled kernels persist in %s (FlashInfer JIT), %s (Triton)",
             len(phases), ",".join(map(str, plan.batch_sizes)), caches["flashinfer_jit"], caches["triton"])
    before = engine.metrics.snapshot() if hasattr(engine.metrics, "snapshot") else {}
    t0 = time.perf_counter()
    try:
        for i, (name, reqs) in enumerate(phases):
            if progress is not None:
                progress(phase=name, phases_done=i, phases=len(phases))
            t = time.perf_counter()
            try:
                for prompt, params in reqs:
                    run.add(prompt, params)
            except ValueError as e:  # ConfigError / AdmissionError: this engine cannot take the phase
                run.abort_all()
                record.append({"name": name, "skipped": str(e)})
                log.debug("warm-up %s: skipped (%s)", name, e)
                continue
            steps = run.drain(plan.max_steps)
            dt = time.perf_counter() - t
            record.append({"name": name, "requests": len(reqs), "steps": steps, "seconds": round(dt, 3)})
            log.debug("warm-up %s: %d requests, %d steps, %.2f s", name, len(reqs), steps, dt)
        capture = getattr(engine, "capture_graphs", None)  # the padded runner's remaining row counts (CUDA)
        if callable(capture) and not (stop is not None and stop.is_set()):
            t = time.perf_counter()
            got = capture()
            record.append({"name": "capture", "verify_rows": got.get("verify_rows", []),
                           "draft_rows": got.get("draft_rows", []), "decode_buckets": got.get("decode_buckets", []),
                           "seconds": round(time.perf_counter() - t, 3)})
    except _Stopped:
        record.append({"name": "stopped", "skipped": "the server is shutting down"})
    finally:
        run.abort_all()
        after = engine.metrics.snapshot() if hasattr(engine.metrics, "snapshot") else {}
        counted = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}
        reset = getattr(engine.metrics, "reset", None)
        if callable(reset):
            reset()
        flush = getattr(engine, "reset_prefix_cache", None)
        if callable(flush):  # warm-up prompts are not served traffic: the first real request finds no block of theirs
            flush()
    seconds = time.perf_counter() - t0
    fast = engine.fast_path_stats() if hasattr(engine, "fast_path_stats") else {}
    missing: list[int] = []
    verify = fast.get("verify")
    span = plan.extra.get("span")
    if verify is not None and span and str(engine.cfg.device).startswith("cuda") and verify.get("mode") != "eager":
        want = {b * span for b in plan.batch_sizes if b in verify.get("buckets", [])}
        missing = sorted(want - set(verify.get("captured_rows") or []))
    out = {"plan": plan.describe(), "phases": record, "requests": run.requests, "steps": run.steps,
           "tokens": run.tokens, "warmup_s": round(seconds, 2), "counted": counted, "fast_path": fast, "verify_rows_missing": missing,
           "caches": caches}
    log.info("warm-up done in %.1f s: %d phases, %d requests, %d steps (batch sizes %s, span %s)%s", seconds,
             len(record), run.requests, run.steps, ",".join(map(str, plan.batch_sizes)), span,
             f"; verify graphs NOT captured at rows {missing}" if missing else "")
    return out


def make_warmup(plan: WarmupPlan | None = None) -> Callable[[Any, threading.Event, Callable[..., None]], dict]:
    """The `EngineLoop(warmup=...)` callable for a plan (None: `default_plan` of the engine it gets)."""

    def warmup(engine: Any, stop: threading.Event, progress: Callable[..., None]) -> dict:
        return run_warmup(engine, stop, progress, plan)

    return warmup


def kernel_caches() -> dict:
    """Where compiled kernels persist (see the module contract); reads the environment only."""
    fi_base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    out: dict[str, Any] = {
        "flashinfer_jit": str(Path(fi_base) / ".cache" / "flashinfer"),
        "flashinfer_workspace_base": os.environ.get("FLASHINFER_WORKSPACE_BASE"),
        "triton": os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache"),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
    }
    try:
        import importlib.util

        spec = importlib.util.find_spec("flashinfer")
        if spec is not None and spec.origin:
            out["flashinfer_aot"] = str(Path(spec.origin).parent / "data" / "aot")
    except (ImportError, ValueError):
        pass
    return out
