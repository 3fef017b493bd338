"""The engine under closed-loop load (issues 19, 28): where a step's time goes when requests keep arriving.

`speed.py` times decode steps of a batch that was prefilled all at once; a served engine instead admits a new
prompt whenever a request finishes, so at concurrency c most steps carry a prefill chunk beside c - 1 decodes.
This benchmark runs that load in process (the engine alone), or through the project's HTTP server beside it
(`"via": "http"`, issue 28: the serving overhead on identical workloads in one run), on the Qwen3-4B-shaped random
pair:

  per level c     c requests in flight, `--waves` x c requests in all, prompt lengths drawn uniformly from
                  [--prompt-min, --prompt-max] (one seeded draw per level, the same for every arm), --max-tokens
                  output tokens each (ignore_eos; `--max-tokens-spread S`: each prompt's own, uniform in
                  [M (1 - S), M (1 + S)], one seeded draw per level, the same for every arm: with one length for
                  all, requests that start together finish together and their successors' prefills share a
                  step); a finished request is replaced at once by the next one
  per arm         EngineConfig fields (`--arms` JSON: [{"name": ..., "kw": {...}}, ...]; default: the row
                  ladder vs the former bucket x span padding, docs/gpu.md), one engine per arm built once,
                  a warm-up wave per level excluded, then `engine.capture_graphs()`
  figures         output tok/s over the measured window, TTFT (arrival -> first token) and TPOT ((last - first)
                  / (n - 1)) medians (both by harness/latency.py), and per forward path (decode-graph / padded /
                  plain, from `ModelRunner.last_path`) the step count, mean ms, share of the wall and mean rows
  per arm, via    `"via": "process"` (the default): the loop above steps the engine itself. `"via": "http"`: the
                  arm's engine is served by the project's own server app (`make_app` + `ServerThread`: uvicorn in
                  a thread of this process, as the server tests run it; no warm-up plan, the benchmark's own
                  warm-up wave and `capture_graphs()` as for every arm) on a free loopback port, and the SAME
                  closed loop runs through `POST /v1/completions` (prompt = the same token-id lists, stream,
                  max_tokens, ignore_eos, temperature 0, return_token_ids; c connections, a finished stream
                  replaced at once) from an asyncio httpx client in a client process of its own (`"client":
                  "process"`, the default: it does not share the server's GIL, as a sweep client does not with
                  `specbench serve`; `"inline"`: on this process's main thread, a diagnostic). Arrival = just
                  before the request is sent (the window opens as the first c are sent), first / last token =
                  when the first / last SSE event carrying token ids arrived; the client parses only each event's `token_ids` list. tok/s, TTFT and TPOT
                  are computed as for the in-process arm; the steps and paths (and `--phases`) are the server's
                  engine's, timed around its `step()` on the engine-loop thread, so a path's share of the wall
                  is how much of it that engine was stepping. `"via": "http-proc"`: the same through the server with
                  the engine in a process of its own (`make_proc_app`, `specbench serve`'s default; built from the
                  arm's EngineConfig there, `capture_graphs()` as its warm-up); its steps run in that process, so
                  steps, paths and `--phases` are reported as not available. `--cprofile` profiles process arms only. With the
                  process arm first, the ratio column is http / process per level; `ids = first` says whether
                  an arm's output token ids equal the first arm's (greedy: an http arm's must).

Repeats are interleaved (every arm once per repeat, per level); each figure is the median over repeats with its
min and max, the ratio to the first arm is the median of the paired per-repeat ratios, and the noise floor of a
level is the spread of the first arm's tok/s over the repeats ((max - min) / median).

Usage: python -m specbench.benchmarks.load --workdir DIR [--levels 1,8,32,64] [--repeats 2] [--arms JSON]
       [--out-dir DIR] [--device cuda] [--model TARGET --draft DRAFT] [--tau T]
Prints a table, then one JSON document as the last line; with --out-dir writes load.json + load.md after every
level, so an interrupted run keeps what it measured. The in-process engine against the served one (one word for
the shell, as `LOAD_ARGS` of `scripts/gpu.sh load` splits on spaces):
       --arms '[{"name":"process","kw":{}},{"name":"http","kw":{},"via":"http"}]'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import hashlib
import io
import json
import pstats
import statistics
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specbench.harness import latency
from specbench.harness.benchdoc import emit_document, positive_ints

if TYPE_CHECKING:
    from specbench.harness.adapters.loop import EngineLoop
    from specbench.harness.server.engine_proc import ProcEngineLoop

NO_STEPS = "not available (the engine steps in its own process)"
VIAS = ("process", "http", "http-proc")
DEFAULT_ARMS = [{"name": "ladder", "kw": {"padded_rows": "ladder", "graph_logits": False}},
                {"name": "bucket", "kw": {"padded_rows": "bucket", "graph_logits": True}}]


def stat(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def workload(c: int, waves: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1000 + c)
    n = max(c, waves * c)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab - 10, (n_,), generator=g).tolist() for n_ in lens]


class PhaseClock:
    """Host milliseconds per step phase through the engine's phase-range hook (`LLMEngine.ranges`: schedule,
    draft, forward / verify, accept, commit), and on CUDA the forward's GPU milliseconds from a pair of CUDA
    events around it (read after the step, whose accept phase has synchronised). `take()` returns and clears
    the current step's figures. The accept phase waits for the GPU, so its host time includes the forward's
    GPU time that the host did not overlap; `gpu` is that GPU time alone."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.ms: dict[str, float] = {}
        self._events: list = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        e0 = None
        if self.cuda and name in ("forward", "verify"):
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t) * 1e3
            if e0 is not None:
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record()
                self._events.append((e0, e1))

    def take(self) -> dict[str, float]:
        out, self.ms = self.ms, {}
        if self._events:
            self._events[-1][1].synchronize()
            out["gpu_forward"] = sum(a.elapsed_time(b) for a, b in self._events)
            self._events = []
        return out


class StepStats:
    """Per forward path (`ModelRunner.last_path`: decode-graph / padded / plain) the step count, host ms and
    rows of an engine's steps, and with `phases` each step phase's host ms (`PhaseClock`, installed as the
    engine's `ranges` while the block runs). `record(a, b)` right after each step, on the thread that stepped."""

    def __init__(self, eng, phases: bool = False) -> None:
        self.eng = eng
        self.paths: dict[str, dict] = {}
        self.steps = 0
        self.clock = PhaseClock(eng.device.type == "cuda") if phases else None
        self._saved = None

    def __enter__(self) -> StepStats:
        self._saved = self.eng.ranges
        if self.clock is not None:
            self.eng.ranges = self.clock
        return self

    def __exit__(self, *exc: object) -> None:
        from specbench.engine.ranges import NO_RANGES

        self.eng.ranges = self._saved if self._saved is not None else NO_RANGES

    def record(self, a: float, b: float) -> None:
        self.steps += 1
        kind, rows = self.eng.runner.last_path
        pth = self.paths.setdefault(kind or "none", {"steps": 0, "ms": 0.0, "rows": 0})
        pth["steps"] += 1
        pth["ms"] += (b - a) * 1e3
        pth["rows"] += rows
        if self.clock is not None:
            ph = pth.setdefault("phase_ms", {})
            step_ms = self.clock.take()
            step_ms["other"] = (b - a) * 1e3 - sum(v for k, v in step_ms.items() if k != "gpu_forward")
            for k, v in step_ms.items():
                ph[k] = ph.get(k, 0.0) + v

    def summary(self, wall: float) -> dict[str, dict]:
        for p in self.paths.values():
            p["mean_ms"] = p["ms"] / p["steps"]
            p["share"] = p["ms"] / (wall * 1e3)
            p["mean_rows"] = p["rows"] / p["steps"]
            if "phase_ms" in p:
                p["phase_mean_ms"] = {k: v / p["steps"] for k, v in p.pop("phase_ms").items()}
        return self.paths


def ids_digest(ids: dict[int, list[int]]) -> str:
    """The output token ids of every request, in prompt order, as one short hash (arms compare outputs)."""
    return hashlib.sha256(json.dumps([ids.get(i) for i in range(max(ids, default=-1) + 1)]).encode()).hexdigest()[:16]


def figures(wall: float, arrive: dict, first: dict, last: dict, ntok: dict) -> dict:
    """tok/s, TTFT (arrival -> first token) and TPOT ((E2EL - TTFT) / (n - 1), E2EL = arrival -> last token)
    medians in ms, by harness/latency.py's rules: both arms' way."""
    total = sum(ntok.values())
    ttfts = {r: latency.since(arrive[r], first[r]) for r in first}
    ttft = [t * 1e3 for t in ttfts.values() if t is not None]
    tpot = [t * 1e3 for r in first if (t := latency.tpot(ttfts[r], latency.since(arrive[r], last[r]), ntok[r]))
            is not None]
    return {"wall_s": wall, "tokens": total, "tok_s": total / wall,
            "ttft_ms": statistics.median(ttft) if ttft else float("nan"),
            "tpot_ms": statistics.median(tpot) if tpot else float("nan")}


def choice_record(c) -> dict:
    """One span policy decision (spec/policy.py StepChoice) as a step record carries it."""
    out = {"step": c.step, "running": c.running, "ready": c.ready, "span": c.span, "reason": c.reason,
           "chained": c.chained, "mixed": c.mixed}
    if c.expected:
        out["expected_tps"] = {str(k): round(v, 1) for k, v in c.expected.items()}
    return out


def steps_summary(steps: list[dict]) -> list[dict]:
    """Per (reason, span, chained, mixed) of the choices committed in a step call: the calls, their summed and
    mean wall ms and share of the stepping time (a call that commits no choice is `none`)."""
    total = sum(s["ms"] for s in steps) or 1.0
    groups: dict[tuple, list[float]] = {}
    for s in steps:
        ch = s["choices"][-1] if s["choices"] else None
        key = (ch["reason"], ch["span"], ch["chained"], ch["mixed"]) if ch else ("none", 0, False, False)
        groups.setdefault(key, []).append(s["ms"])
    return [{"reason": k[0], "span": k[1], "chained": k[2], "mixed": k[3], "calls": len(v), "ms": round(sum(v), 2),
             "mean_ms": round(sum(v) / len(v), 3), "max_ms": round(max(v), 2), "share": round(sum(v) / total, 4)}
            for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))]


def output_lens(n: int, max_tokens: int, spread: float, seed: int) -> list[int]:
    """Per prompt index its max_tokens: uniform in [M (1 - S), M (1 + S)] by a seeded draw (S = 0: all M), the
    same for every arm, as `specbench sweep --max-tokens-spread`: with one length for all, requests that start
    together finish together and their successors' prefills share a step, a lockstep no traffic has."""
    if not spread:
        return [max_tokens] * n
    from specbench.suites.sweep.workload import output_len_range  # noqa: PLC0415

    lo, hi = (max(2, x) for x in output_len_range(max_tokens, spread))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def _mt(max_tokens: int | list[int], i: int) -> int:
    return max_tokens if isinstance(max_tokens, int) else max_tokens[i]


def closed_loop(eng, prompts: list[list[int]], c: int, max_tokens: int | list[int], tag: str, phases: bool = False,
                steps: list[dict] | None = None) -> dict:
    """Run `prompts` with c in flight; per-request and per-step timings (`phases`: per path, the mean host ms
    of each step phase and the forward's GPU ms, `PhaseClock`). `steps`: a list that gets one record per
    `step()` call (start and wall ms, forward path and rows, the span policy's choices committed in it)."""
    from specbench.engine import SamplingParams

    todo = deque(enumerate(prompts))
    index: dict[str, int] = {}
    arrive: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ntok: dict[str, int] = {}
    ids: dict[int, list[int]] = {}

    def admit() -> None:
        i, p = todo.popleft()
        rid = f"{tag}-{i}"
        index[rid] = i
        arrive[rid] = time.perf_counter()
        eng.add_request(p, SamplingParams(max_tokens=_mt(max_tokens, i), ignore_eos=True, temperature=0.0), rid=rid)

    committed: list = []
    policy = getattr(eng, "policy", None)
    if steps is not None and policy is not None:
        policy.on_record = committed.append
    with StepStats(eng, phases) as stats:
        for _ in range(min(c, len(todo))):
            admit()
        t0 = time.perf_counter()
        while eng.has_unfinished():
            a = time.perf_counter()
            outs = eng.step()
            b = time.perf_counter()
            stats.record(a, b)
            if steps is not None:
                kind, rows = eng.runner.last_path
                steps.append({"t_ms": round((a - t0) * 1e3, 3), "ms": round((b - a) * 1e3, 3), "path": kind,
                              "rows": rows, "outs": len(outs), "choices": [choice_record(x) for x in committed]})
                committed.clear()
            for o in outs:
                n = len(o.output_ids)
                if n and o.rid not in first:
                    first[o.rid] = b
                if n:
                    last[o.rid], ntok[o.rid] = b, n
                if o.finished:
                    ids[index[o.rid]] = list(o.output_ids)
                    if todo:
                        admit()
        wall = time.perf_counter() - t0
    if steps is not None and policy is not None:
        policy.on_record = None
    out = {**figures(wall, arrive, first, last, ntok), "steps": stats.steps, "paths": stats.summary(wall),
           "ids_sha": ids_digest(ids)}
    if steps is not None:
        out["by_choice"] = steps_summary(steps)
    return out


# ---- the http arm: the same closed loop through the project's server ----------------------------------------

def _token_ids(event: bytes) -> list[int] | None:
    """The `token_ids` of one SSE event of /v1/completions (None: an event without them). The key is the
    choice's last and a JSON string cannot hold it unescaped, so its last occurrence is the field itself; only
    that list is parsed, never the whole event."""
    k = event.rfind(b'"token_ids":')
    if k < 0:
        return None
    s = event.index(b"[", k)
    e = event.index(b"]", s)
    seg = event[s + 1:e].strip()
    return [int(x) for x in seg.split(b",")] if seg else []


async def http_closed_loop(url: str, prompts: list[list[int]], c: int, max_tokens: int | list[int]) -> dict:
    """`closed_loop` through `POST /v1/completions` (token-id prompt, stream, return_token_ids): c requests
    in flight on c connections, each one's successor sent as soon as its stream ends. Arrival = just before
    the request is sent, first / last token = when the first / last SSE event carrying token ids arrived."""
    import httpx

    todo = deque(enumerate(prompts))
    arrive: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    ntok: dict[int, int] = {}
    ids: dict[int, list[int]] = {}
    head = {"temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    hdrs = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        async def one(i: int, p: list[int]) -> None:
            body = json.dumps({**head, "max_tokens": _mt(max_tokens, i), "prompt": p}).encode()
            got: list[int] = []
            buf = b""
            arrive[i] = time.perf_counter()
            async with client.stream("POST", "/v1/completions", content=body, headers=hdrs) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"POST /v1/completions: {r.status_code} {(await r.aread())[:300]!r}")
                async for chunk in r.aiter_raw():
                    now = time.perf_counter()
                    buf += chunk
                    while (e := buf.find(b"\n\n")) >= 0:
                        ev, buf = buf[:e], buf[e + 2:]
                        new = _token_ids(ev)
                        if new is None:
                            if b'"error"' in ev:
                                raise RuntimeError(f"the stream failed: {ev[:300]!r}")
                            continue
                        if new:
                            if not got:
                                first[i] = now
                            last[i] = now
                            got += new
            ntok[i] = len(got)
            ids[i] = got

        async def worker() -> None:
            while todo:
                i, p = todo.popleft()
                await one(i, p)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(c, len(todo)))))
        wall = time.perf_counter() - t0
    return {**figures(wall, arrive, first, last, ntok), "ids_sha": ids_digest(ids)}


def client_run(url: str, prompts: list[list[int]], c: int, max_tokens: int | list[int]) -> dict:
    """`http_closed_loop` on its own event loop (the client process's entry point)."""
    return asyncio.run(http_closed_loop(url, prompts, c, max_tokens))


def _client_ready() -> bool:
    import httpx  # noqa: F401  (imported before the first timed run)

    return True


@contextlib.contextmanager
def stepping_recorded(eng, stats: StepStats) -> Iterator[None]:
    """Every `eng.step()` (the server's engine-loop thread calls it) timed into `stats` while the block runs."""
    inner = eng.step
    had = "step" in vars(eng)

    def step(*args, **kw):
        a = time.perf_counter()
        outs = inner(*args, **kw)
        stats.record(a, time.perf_counter())
        return outs

    eng.step = step
    try:
        yield
    finally:
        if had:
            eng.step = inner
        else:
            del eng.step


class HttpArm:
    """An arm's engine behind the project's own server (`make_app` + `ServerThread`: uvicorn in a thread of
    this process, as the server tests run it, no warm-up plan: the benchmark warms up itself), driven by
    `http_closed_loop` in a client process of its own (`client="process"`, the default: the client's Python
    does not share the server's GIL, as the sweep client's does not with `specbench serve`) or on this
    process's main thread (`client="inline"`: a diagnostic, the client then competes for the GIL)."""

    def __init__(self, llm, name: str, client: str = "process", max_pending: int | None = None) -> None:
        from specbench.harness.server import ServerThread, make_app

        if client not in ("process", "inline"):
            raise SystemExit(f"arm {name}: client must be 'process' or 'inline', got {client!r}")
        self.engine = llm.engine
        self.loop: EngineLoop | ProcEngineLoop  # the engine in this process, or in its own (ProcHttpArm)
        self.app, self.loop = make_app(llm.engine, served_name=name, max_pending=max_pending, warmup=False)
        self.srv = ServerThread(self.app).start()
        self.url = self.srv.url
        self.pool = None
        if client == "process":
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self.pool.submit(_client_ready).result()  # the child started and imported before any timing

    def closed_loop(self, prompts: list[list[int]], c: int, max_tokens: int | list[int], phases: bool = False) -> dict:
        # by its module name (not __main__), so that the client process finds it
        from specbench.benchmarks import load as mod

        with StepStats(self.engine, phases) as stats, stepping_recorded(self.engine, stats):
            if self.pool is not None:
                res = self.pool.submit(mod.client_run, self.url, prompts, c, max_tokens).result()
            else:
                res = client_run(self.url, prompts, c, max_tokens)
        return {**res, "steps": stats.steps, "paths": stats.summary(res["wall_s"])}

    def close(self) -> None:
        self.srv.stop()
        self.loop.close()
        if self.pool is not None:
            self.pool.shutdown()


def capture_warmup(engine, stop, progress) -> dict:
    """The engine process's warm-up for an http-proc arm: `capture_graphs()`, as every other arm gets."""
    return engine.capture_graphs()


class ProcHttpArm(HttpArm):
    """An arm's engine in a process of its own behind the project's server (`make_proc_app`, as `specbench serve`
    runs by default): the same closed loop as `HttpArm`. Its steps are taken in the child, so the step counts,
    forward paths and `--phases` are not available for it (reported as such, not as zeros)."""

    loop: ProcEngineLoop

    def __init__(self, cfg, name: str, client: str = "process", max_pending: int | None = None) -> None:
        from specbench.harness.server import ServerThread, make_proc_app

        if client not in ("process", "inline"):
            raise SystemExit(f"arm {name}: client must be 'process' or 'inline', got {client!r}")
        from specbench.benchmarks import load as mod  # by module name: the child unpickles the warm-up by it

        self.app, self.loop = make_proc_app(cfg, served_name=name, max_pending=max_pending, warmup=mod.capture_warmup)
        self.engine = self.loop.engine
        self.srv = ServerThread(self.app).start(timeout=1800)
        self.url = self.srv.url
        self.capture = self.loop.warmup_status()
        self.pool = None
        if client == "process":
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self.pool.submit(_client_ready).result()

    def closed_loop(self, prompts: list[list[int]], c: int, max_tokens: int | list[int], phases: bool = False) -> dict:
        from specbench.benchmarks import load as mod

        before = dict(self.loop.stepping)
        if self.pool is not None:
            res = self.pool.submit(mod.client_run, self.url, prompts, c, max_tokens).result()
        else:
            res = client_run(self.url, prompts, c, max_tokens)
        return {**res, "steps": None, "paths": {}, "steps_available": False,
                "child": child_stepping(before, self.loop.stepping, res["wall_s"])}


def child_stepping(before: dict, after: dict, wall: float) -> dict | None:
    """The engine process's loop over one run (`ProcEngineLoop.stepping` before and after): steps, mean ms
    inside engine.step(), its share of the run's wall, mean ms handing a step's outputs to the pipe, and
    the parent's mean ms relaying them to the consumers."""
    n = after.get("steps", 0) - before.get("steps", 0)
    if not n:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("step_s", "emit_s", "relay_s")}
    return {"steps": n, "step_ms": d["step_s"] * 1e3 / n, "share": d["step_s"] / wall,
            "emit_ms": d["emit_s"] * 1e3 / n, "relay_ms": d["relay_s"] * 1e3 / n}


def child_text(x: dict) -> str:
    ch = x.get("child")
    if not ch:
        return NO_STEPS
    return (f"engine process: {ch['steps']} steps x {ch['step_ms']:.2f} ms ({ch['share']:.0%}); emit "
            f"{ch['emit_ms']:.2f} ms, parent relay {ch['relay_ms']:.2f} ms per step")


def build_kw(target: str, draft: str | None, device: str, dtype: str, tau: float | None, kw: dict, pages: int) -> dict:
    spec: dict = {"draft": draft, "synthetic_tau": tau} if tau else {}
    return {"model": target, "device": device, "dtype": dtype, "num_pages": pages, "max_num_seqs": 64, **spec, **kw}


def build(target: str, draft: str | None, device: str, dtype: str, tau: float | None, kw: dict, pages: int):
    from specbench.engine import LLM

    return LLM(**build_kw(target, draft, device, dtype, tau, kw, pages))


def run(target: str, draft: str | None, device: str, levels: tuple[int, ...], arms: list[dict], repeats: int,
        waves: int, prompt_min: int, prompt_max: int, max_tokens: int, tau: float | None, pages: int,
        dtype: str, save=None, phases: bool = False, cprofile: Path | None = None,
        steps_dir: Path | None = None, spread: float = 0.0) -> dict:
    from specbench.benchmarks.speed import environment

    res: dict = {"environment": environment(device), "settings": {
        "levels": list(levels), "arms": arms, "repeats": repeats, "waves": waves, "prompt_len": [prompt_min, prompt_max],
        "max_tokens": max_tokens, "max_tokens_spread": spread, "tau": tau, "dtype": dtype, "target": target,
        "num_pages": pages, "phases": phases},
        "levels": {}, "complete": False}
    keep = save or (lambda r: None)
    llms = {}
    servers: dict[str, HttpArm] = {}
    for arm in arms:
        t = time.perf_counter()
        via = arm.get("via", "process")
        where = ""
        if via == "http-proc":  # built and captured in the engine process, from the config alone
            from specbench.engine import LLM

            cfg = LLM.config(**build_kw(target, draft, device, dtype, tau, arm.get("kw", {}), pages))
            srv = servers[arm["name"]] = ProcHttpArm(cfg, arm["name"], arm.get("client", "process"),
                                                    max(256, max(levels)))
            cap = srv.capture
            where = f"; served by an engine process on {srv.url} (client: {arm.get('client', 'process')})"
        else:
            llm = build(target, draft, device, dtype, tau, arm.get("kw", {}), pages)
            cap = llm.engine.capture_graphs()
            llms[arm["name"]] = llm
        arm["build_s"] = round(time.perf_counter() - t, 2)
        arm["captured_rows"] = cap.get("verify_rows", [])
        arm["captured_draft_rows"] = cap.get("draft_rows", [])
        if via == "http":
            servers[arm["name"]] = HttpArm(llm, arm["name"], arm.get("client", "process"), max(256, max(levels)))
            where = f"; served on {servers[arm['name']].url} (client: {arm.get('client', 'process')})"
        print(f"arm {arm['name']}: built + captured {len(cap['verify_rows'])} verify and "
              f"{len(arm['captured_draft_rows'])} draft row counts in {arm['build_s']} s{where}",
              flush=True)

    def loop(arm: dict, ps: list[list[int]], c: int, n: int | list[int], tag: str, ph: bool = False,
             last: bool = False) -> dict:
        if arm["name"] in servers:
            return servers[arm["name"]].closed_loop(ps, c, n, ph)
        steps: list[dict] | None = [] if last and steps_dir is not None else None
        out = closed_loop(llms[arm["name"]].engine, ps, c, n, tag, ph, steps)
        if steps is not None and steps_dir is not None:  # the last repeat's step records, one JSON line a call
            steps_dir.mkdir(parents=True, exist_ok=True)
            (steps_dir / f"steps-{arm['name']}-c{c}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
        return out
    vocab = (next(iter(llms.values())).engine if llms else next(iter(servers.values())).engine).mcfg.vocab_size
    for c in levels:
        prompts = workload(c, waves, prompt_min, prompt_max, vocab, seed=1)
        lens = output_lens(len(prompts), max_tokens, spread, seed=c)
        per: dict[str, list[dict]] = {a["name"]: [] for a in arms}
        for arm in arms:  # warm-up wave (excluded): every shape of this level once (an http arm: through it)
            loop(arm, workload(c, 1, prompt_min, prompt_max, vocab, seed=2), c, 16, f"w{c}")
        for r in range(repeats):
            for arm in arms:
                # cProfile sees only this thread: an http arm's server and engine run on others
                prof = (cProfile.Profile() if cprofile is not None and r == repeats - 1 and arm["name"] not in servers
                        else None)
                if prof is not None:
                    prof.enable()
                per[arm["name"]].append(loop(arm, prompts, c, lens, f"r{r}c{c}", phases, r == repeats - 1))
                if prof is not None and cprofile is not None:
                    prof.disable()
                    cprofile.mkdir(parents=True, exist_ok=True)
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
                    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(35)
                    (cprofile / f"cprofile-{arm['name']}-c{c}.txt").write_text(buf.getvalue())
        base = arms[0]["name"]
        lvl: dict = {}
        for arm in arms:
            runs = per[arm["name"]]
            lvl[arm["name"]] = {
                "tok_s": stat([x["tok_s"] for x in runs]), "ttft_ms": stat([x["ttft_ms"] for x in runs]),
                "tpot_ms": stat([x["tpot_ms"] for x in runs]), "steps": stat([x["steps"] for x in runs]),
                "tokens": stat([x["tokens"] for x in runs]),
                "over_first": stat([x["tok_s"] / y["tok_s"] for x, y in zip(runs, per[base], strict=True)]),
                "paths": runs[-1]["paths"], "via": arm.get("via", "process"), "child": runs[-1].get("child"),
                "by_choice": runs[-1].get("by_choice"),
                "steps_available": runs[-1].get("steps_available", True),
                # greedy: the same prompts give the same ids on every repeat, and across arms unless their
                # kw change the arithmetic (bf16 at other batch shapes may differ in a late token)
                "ids_sha": runs[-1]["ids_sha"], "ids_stable": len({x["ids_sha"] for x in runs}) == 1,
                "same_ids_as_first": runs[-1]["ids_sha"] == per[base][-1]["ids_sha"]}
        b = lvl[base]["tok_s"]
        lvl["noise_floor"] = (b["max"] - b["min"]) / b["median"] if b["median"] else None
        res["levels"][str(c)] = lvl
        print(render_level(c, lvl, arms), flush=True)
        keep(res)
    res["complete"] = True
    for served in servers.values():
        served.close()
    for llm in llms.values():
        llm.close()
    gc.collect()
    return res


def render_level(c: int, lvl: dict, arms: list[dict]) -> str:
    out = []
    for arm in arms:
        x = lvl[arm["name"]]
        paths = ", ".join(f"{k} {v['steps']}x{v['mean_ms']:.2f} ms ({v['share']:.0%}, {v['mean_rows']:.0f} rows)"
                          for k, v in sorted(x["paths"].items()))
        if not x.get("steps_available", True):
            paths = child_text(x)
        via = x.get("via", "process")
        out.append(f"c{c} {arm['name']}{f' ({via})' if via != 'process' else ''}: "
                   f"{x['tok_s']['median']:.1f} tok/s ({x['over_first']['median']:.2f}x), "
                   f"TTFT {x['ttft_ms']['median']:.1f} ms, TPOT {x['tpot_ms']['median']:.2f} ms, "
                   f"ids {'=' if x.get('same_ids_as_first') else '!='} first; {paths}")
    return "\n".join(out)


def render(res: dict) -> str:
    arms = res["settings"]["arms"]
    env = res["environment"]
    lines = [f"# The engine under closed-loop load ({env.get('gpu', env['device'])}, {env['date']})", "",
             f"commit {env.get('commit')}; torch {env['torch']}; settings: `{json.dumps(res['settings'], default=str)}`",
             "", "Output tok/s, median over repeats [min-max]; ratio = arm / first arm (median of paired ratios); "
             "noise floor = spread of the first arm's tok/s; TTFT / TPOT medians in ms; via = the engine in process "
             "or behind the server (http: `/v1/completions` streamed, times taken at the client; the steps are the "
             "server's engine's, so their share of the wall shows how much of it the engine was stepping); "
             "ids = first: the output token ids equal the first arm's.", "",
             "| c | arm | via | tok/s | ratio | noise floor | TTFT ms | TPOT ms | ids = first | "
             "steps: path x mean ms (share of wall, mean rows) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|---|"]
    for c, lvl in res["levels"].items():
        for arm in arms:
            x = lvl[arm["name"]]
            t = x["tok_s"]
            paths = "; ".join(f"{k} {v['steps']} x {v['mean_ms']:.2f} ({v['share']:.0%}, {v['mean_rows']:.0f})"
                              for k, v in sorted(x["paths"].items()))
            if not x.get("steps_available", True):
                paths = child_text(x)
            nf = lvl.get("noise_floor")
            same = {True: "yes", False: "no", None: ""}[x.get("same_ids_as_first")]
            lines.append(f"| {c} | {arm['name']} | {x.get('via', 'process')} | "
                         f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | "
                         f"{x['over_first']['median']:.3f} | {'' if nf is None else f'{nf:.1%}'} | "
                         f"{x['ttft_ms']['median']:.1f} | {x['tpot_ms']['median']:.2f} | {same} | {paths} |")
    names = ["schedule", "draft", "forward", "verify", "accept", "commit", "other", "gpu_forward"]
    rows = [(c, arm["name"], k, v["phase_mean_ms"]) for c, lvl in res["levels"].items() for arm in arms
            for k, v in sorted(lvl[arm["name"]]["paths"].items()) if "phase_mean_ms" in v]
    if rows:
        lines += ["", "Mean ms per step by phase (the last repeat; host time, except `gpu_forward`: the forward's GPU "
                  "time from CUDA events; `accept` waits for the GPU; `other` = the step's wall minus its phases):", "",
                  "| c | arm | path | " + " | ".join(names) + " |", "|---:|---|---|" + "---:|" * len(names)]
        for c, name, k, ph in rows:
            lines.append(f"| {c} | {name} | {k} | " + " | ".join(f"{ph[n]:.3f}" if n in ph else "" for n in names) + " |")
    sums = [(c, arm["name"], lvl[arm["name"]]["by_choice"]) for c, lvl in res["levels"].items() for arm in arms
            if lvl[arm["name"]].get("by_choice")]
    if sums:
        lines += ["", "Stepping time by the span policy's choice committed in a `step()` call (the last repeat; "
                  "`--steps-out`):", "", "| c | arm | reason | span | chained | mixed | calls | ms | mean ms | max ms | share |",
                  "|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
        for c, name, rows_ in sums:
            for x in rows_:
                lines.append(f"| {c} | {name} | {x['reason']} | {x['span']} | {x['chained']} | {x['mixed']} | "
                             f"{x['calls']} | {x['ms']:.1f} | {x['mean_ms']:.2f} | {x['max_ms']:.1f} | {x['share']:.1%} |")
    if not res.get("complete"):
        lines += ["", "Incomplete run: the levels above are all that finished."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/q3-4b-pair", help="the Qwen3-4B-shaped pair (built when absent)")
    ap.add_argument("--model", help="target dir (instead of --workdir)")
    ap.add_argument("--draft", help="drafter dir (with --model; used with --tau)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype")
    ap.add_argument("--levels", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--waves", type=int, default=3, help="requests per level = waves x c")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=640)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-tokens-spread", type=float, default=0.0,
                    help="each request's max_tokens uniform in [M (1 - S), M (1 + S)], the same per prompt for every "
                         "arm (0 <= S < 1; 0: all M, and requests that start together finish together)")
    ap.add_argument("--tau", type=float, help="speculate with the drafter at this synthetic acceptance length")
    ap.add_argument("--num-pages", type=int, default=4000, help="KV pages per arm's engine (all arms live at once)")
    ap.add_argument("--arms", default=json.dumps(DEFAULT_ARMS),
                    help='JSON list of {name, kw: EngineConfig fields[, via: "process" | "http" | "http-proc"[, client: "process" | '
                         '"inline"]]}')
    ap.add_argument("--out-dir", help="write load.json and load.md there")
    ap.add_argument("--cprofile", action="store_true",
                    help="with --out-dir: cProfile each arm's last repeat per level (cprofile-ARM-cC.txt: top 45 by own time, 35 by cumulative)")
    ap.add_argument("--steps-out", action="store_true",
                    help="with --out-dir: each process arm's last repeat per level, one JSON line per step() call "
                         "(steps-ARM-cC.jsonl: wall ms, path, rows, the span policy's committed choices), and its "
                         "time by choice (reason, span, chained, mixed) in load.json / load.md")
    ap.add_argument("--phases", action="store_true",
                    help="time each step phase per forward path (host ms, and the forward's GPU ms on CUDA)")
    a = ap.parse_args(argv)
    try:
        arms = json.loads(a.arms)
        assert isinstance(arms, list) and arms and all(isinstance(x, dict) and "name" in x for x in arms)
        assert all(x.get("via", "process") in VIAS for x in arms)
        assert len({x["name"] for x in arms}) == len(arms)
    except (ValueError, AssertionError):
        raise SystemExit(f"--arms: expected a JSON list of objects with distinct names (and kw, via: process | "
                         f"http | http-proc), got {a.arms!r}") from None
    if not 0.0 <= a.max_tokens_spread < 1.0:
        raise SystemExit(f"--max-tokens-spread {a.max_tokens_spread} is invalid: expected a number in [0, 1)")
    if a.repeats < 1 or a.waves < 1 or not 1 <= a.prompt_min <= a.prompt_max or a.max_tokens < 2:
        raise SystemExit("--repeats and --waves must be >= 1, 1 <= --prompt-min <= --prompt-max, --max-tokens >= 2")
    if a.model:
        target, draft = a.model, a.draft
    else:
        from specbench.benchmarks.spec_step import ensure_pair

        target, draft = ensure_pair(Path(a.workdir), a.device)
    if a.tau and not draft:
        raise SystemExit("--tau needs a drafter (--draft, or the pair of --workdir)")
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    d = Path(a.out_dir) if a.out_dir else None

    def save(res: dict) -> None:
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            (d / "load.json").write_text(json.dumps(res, default=str) + "\n")
            (d / "load.md").write_text(render(res) + "\n")

    levels = positive_ints(a.levels, "--levels")
    res = run(target, draft if a.tau else None, a.device, levels, arms, a.repeats, a.waves, a.prompt_min,
              a.prompt_max, a.max_tokens, a.tau, a.num_pages, dtype, save=save,
              phases=a.phases, cprofile=d if a.cprofile and d is not None else None,
              steps_dir=d if a.steps_out and d is not None else None, spread=a.max_tokens_spread)
    save(res)
    print(render(res), flush=True)
    emit_document(res)
    return res


if __name__ == "__main__":
    main()
