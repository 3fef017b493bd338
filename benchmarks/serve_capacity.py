"""What the project's server can stream when the engine is not the limit (issue 28): tokens/s through
`specbench serve`'s app, in process and with the engine in a process of its own, against a paced engine.

benchmarks/load.py measured the served bundled engine at 0.65-0.68x its in-process tok/s at c64 on the H200
(7081 tok/s in process; 4571 served in process, 4832 with the engine process), so the engine process alone did
not close the gap. This benchmark takes the GPU out: a *paced engine* (the real `LLMEngine` surface and output
path on the bundled tiny target, its model replaced by a clock) gives every running request one token per step,
each step taking `--step-ms` with the GIL released (time.sleep: what a GPU-bound step looks like to the host),
so the ideal rate is c x 1000 / step_ms tokens/s, and whatever falls short of it is the serving stack's: the
engine loop's delivery, the pipe to the parent, the event loop and SSE, or the client.

Arms (interleaved per repeat, per level):
  direct     the paced engine stepped by this process, no server: what the engine side alone reaches
  http       `make_app` + `ServerThread` (uvicorn in a thread of this process, the engine loop a thread beside it)
  http-proc  `make_proc_app` with the paced engine built in the child (`factory`), as `specbench serve` runs
  http-lock, http-proc-lock  the same with EngineConfig.admit_inbox=False: add_request waits for the step lock,
             which the paced step holds while it sleeps, as a GPU step holds it (the path the inbox replaces)
The client is benchmarks/load.py's streamed closed loop (httpx), `--client-procs` processes of c / N requests
in flight each. Per cell: tok/s, its ratio to the ideal, TTFT / TPOT medians, and CPU busy (CPU seconds / wall)
of the client processes, of this process (the server's parent) and of the engine child.

Usage: python -m specbench.benchmarks.serve_capacity [--levels 16,64] [--step-ms 5] [--max-tokens 128]
       [--waves 3] [--repeats 2] [--arms direct,http,http-proc[,http-lock,http-proc-lock]] [--client-procs 1] [--out-dir DIR]
Prints a table, then one JSON document as the last line (with --out-dir: serve_capacity.{json,md}).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbench.harness.benchdoc import emit_document, positive_ints

ARMS = ("direct", "http", "http-proc")
# the same with the engine's admission inbox off (EngineConfig.admit_inbox=False: add_request waits for the step
# lock, the simple path the inbox replaces)
LOCK_ARMS = ("http-lock", "http-proc-lock")


class PacedEngine:
    """`LLMEngine`'s surface over a clock: the real admission (add_request's checks and inbox, the step lock held
    for the whole step, abort), the real `OutputWriter` (stop handling, incremental detokenization,
    `RequestOutput` snapshots); each `step()` sleeps `step_s` holding the engine's step lock, as a GPU step holds
    it, and gives every running request (at most `max_num_seqs`, the rest wait) one token. Everything else is
    read from the real engine."""

    def __init__(self, engine: Any, step_s: float) -> None:
        self._engine, self.step_s = engine, step_s
        self._running: dict[str, Any] = {}
        self._limit = engine.cfg.max_num_seqs
        self._vocab = engine.mcfg.vocab_size

    def __getattr__(self, name: str) -> Any:  # cfg, tokenizer, mcfg, metrics, describe, ... of the real engine
        return getattr(self._engine, name)

    def add_request(self, prompt: Any, params: Any = None, rid: str | None = None) -> str:
        return self._engine.add_request(prompt, params, rid=rid)

    def abort(self, rid: str) -> bool:
        e = self._engine
        with e._lock:
            if self._running.pop(rid, None) is None:
                return e.abort(rid)
            self._forget(rid)
            return True

    def _forget(self, rid: str) -> None:
        """A request this engine ran, out of the real engine's tables (it never held KV pages)."""
        self._engine.requests.pop(rid, None)
        self._engine._gens.pop(rid, None)

    def has_unfinished(self) -> bool:
        return bool(self._running) or self._engine.has_unfinished()

    def step(self, finished_only: bool = False) -> list:
        e = self._engine
        with e._lock:
            e._take_inbox()
            waiting = e.scheduler.waiting
            while waiting and len(self._running) < self._limit:
                r = waiting.popleft()
                self._running[r.rid] = r
            time.sleep(self.step_s)
            out, outs = e.output, []
            e.metrics.steps += 1
            for rid, req in list(self._running.items()):
                n0 = len(req.output_ids)
                out.append(req, [(len(req.prompt_ids) * 7 + n0 * 13) % self._vocab], None)
                if req.finished or not finished_only:
                    outs.append(out.build(req, req.output_ids[n0:]))
                if req.finished:
                    del self._running[rid]
                    self._forget(rid)
            return outs


@dataclass(frozen=True)
class PacedFactory:
    """Picklable: builds the real engine from the config in the engine process, then paces it."""
    step_s: float

    def __call__(self, cfg: Any) -> PacedEngine:
        from specbench.engine import LLMEngine

        return PacedEngine(LLMEngine(cfg), self.step_s)


def _cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (or of `pid`, from /proc)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(url: str, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    from specbench.benchmarks.load import client_run

    t0 = _cpu_s()
    res = client_run(url, prompts, c, max_tokens)
    return {**res, "cpu_s": _cpu_s() - t0}


def _ready() -> bool:
    import httpx  # noqa: F401

    return True


def direct_loop(eng: PacedEngine, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    from specbench.benchmarks.load import closed_loop

    return closed_loop(eng, prompts, c, max_tokens, f"d{time.monotonic_ns()}")


def served(clients: ProcessPoolExecutor, n: int, url: str, prompts: list[list[int]], c: int,
           max_tokens: int) -> dict:
    """The closed loop from n client processes, c / n in flight each; tok/s over the slowest one's wall."""
    share = [prompts[i::n] for i in range(n)]
    futs = [clients.submit(_client, url, p, max(1, c // n), max_tokens) for p in share]
    parts = [f.result() for f in futs]
    wall = max(p["wall_s"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_ms": statistics.median(p["ttft_ms"] for p in parts),
            "tpot_ms": statistics.median(p["tpot_ms"] for p in parts),
            "client_busy": sum(p["cpu_s"] for p in parts) / wall}


def build_cfg(max_num_seqs: int, admit_inbox: bool = True):
    from specbench.engine import EngineConfig
    from specbench.harness.engines import bundled

    target, _ = bundled()
    return EngineConfig(model=target, device="cpu", dtype="float32", max_num_seqs=max_num_seqs, num_pages=64,
                        admit_inbox=admit_inbox)


def run(levels: tuple[int, ...], step_ms: float, max_tokens: int, waves: int, repeats: int, arms: list[str],
        client_procs: int, out_dir: Path | None = None) -> dict:
    from specbench.engine import LLMEngine
    from specbench.harness.server import ServerThread, make_app, make_proc_app

    step_s = step_ms / 1e3
    res: dict = {"settings": {"levels": list(levels), "step_ms": step_ms, "max_tokens": max_tokens, "waves": waves,
                              "repeats": repeats, "arms": arms, "client_procs": client_procs,
                              "cpus": os.cpu_count()}, "levels": {}}
    ctx = multiprocessing.get_context("spawn")
    clients = ProcessPoolExecutor(client_procs, mp_context=ctx)
    for f in [clients.submit(_ready) for _ in range(client_procs)]:
        f.result()
    made: dict[str, Any] = {}
    try:
        for a in arms:
            cfg = build_cfg(max(levels), admit_inbox=a not in LOCK_ARMS)
            if a == "direct":
                made[a] = PacedEngine(LLMEngine(cfg), step_s)
            elif a.startswith("http-proc"):
                proc_app, proc_loop = make_proc_app(cfg, served_name="paced", max_pending=None,
                                                    factory=PacedFactory(step_s))
                made[a] = (ServerThread(proc_app).start(timeout=600), proc_loop, proc_loop.pid)
            else:
                app, loop = make_app(PacedEngine(LLMEngine(cfg), step_s), served_name="paced", max_pending=None,
                                     warmup=False)
                made[a] = (ServerThread(app).start(), loop, None)
        for c in levels:
            prompts = [[1 + (i * 31 + j) % 400 for j in range(16 + i % 48)] for i in range(waves * c)]
            warm = prompts[:c]
            cells: dict[str, list[dict]] = {a: [] for a in arms}
            for a in arms:  # warm-up, not measured
                _cell(a, made[a], clients, client_procs, warm, c, max_tokens)
            for _ in range(repeats):
                for a in arms:
                    cells[a].append(_cell(a, made[a], clients, client_procs, prompts, c, max_tokens))
            ideal = c * 1e3 / step_ms
            res["levels"][str(c)] = {a: _summary(runs, ideal) for a, runs in cells.items()} | {"ideal_tok_s": ideal}
            print(render_level(c, res["levels"][str(c)], arms), flush=True)
            if out_dir is not None:
                write(res, out_dir)
    finally:
        for a, m in made.items():
            if a != "direct":
                m[0].stop()
                m[1].close()
        clients.shutdown()
    res["complete"] = True
    if out_dir is not None:
        write(res, out_dir)
    return res


def _cell(arm: str, made: Any, clients: ProcessPoolExecutor, n: int, prompts: list[list[int]], c: int,
          max_tokens: int) -> dict:
    if arm == "direct":
        t0 = _cpu_s()
        r = direct_loop(made, prompts, c, max_tokens)
        return {"tok_s": r["tok_s"], "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"],
                "server_busy": (_cpu_s() - t0) / r["wall_s"]}
    from specbench.benchmarks.load import child_stepping

    srv, loop, child = made
    p0, c0, s0 = _cpu_s(), (_cpu_s(child) if child else 0.0), dict(loop.stepping)
    r = served(clients, n, srv.url, prompts, c, max_tokens)
    r["server_busy"] = (_cpu_s() - p0) / r["wall_s"]
    if child:
        r["child_busy"] = (_cpu_s(child) - c0) / r["wall_s"]
    st = child_stepping(s0, loop.stepping, r["wall_s"]) or {}
    r |= {k: st[k] for k in ("step_ms", "emit_ms", "relay_ms") if k in st}
    return r


def _summary(runs: list[dict], ideal: float) -> dict:
    keys = ("tok_s", "ttft_ms", "tpot_ms", "client_busy", "server_busy", "child_busy", "step_ms", "emit_ms",
            "relay_ms")
    out = {k: statistics.median(r[k] for r in runs) for k in keys if all(k in r for r in runs)}
    out["tok_s_min"], out["tok_s_max"] = min(r["tok_s"] for r in runs), max(r["tok_s"] for r in runs)
    out["of_ideal"] = out["tok_s"] / ideal
    return out


HEADER = ("| c | arm | tok/s [min-max] | of ideal | TTFT ms | TPOT ms | client CPU | server CPU | child CPU | "
          "loop step ms | emit ms | relay ms |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def render_level(c: int, lvl: dict, arms: list[str]) -> str:
    def pct(x: float | None) -> str:
        return f"{x * 100:.0f}%" if x is not None else "—"

    def ms(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "—"

    rows = []
    for a in arms:
        x = lvl[a]
        rows.append(f"| {c} | {a} | {x['tok_s']:.0f} [{x['tok_s_min']:.0f}-{x['tok_s_max']:.0f}] | "
                    f"{x['of_ideal']:.2f} | {x['ttft_ms']:.1f} | {x['tpot_ms']:.2f} | {pct(x.get('client_busy'))} | "
                    f"{pct(x.get('server_busy'))} | {pct(x.get('child_busy'))} | {ms(x.get('step_ms'))} | "
                    f"{ms(x.get('emit_ms'))} | {ms(x.get('relay_ms'))} |")
    return "\n".join(rows)


def render(res: dict) -> str:
    s = res["settings"]
    lines = [f"# The server's streaming capacity against a paced engine ({s['step_ms']} ms per step)", "",
             f"settings: `{s}`; ideal = c x 1000 / step_ms tok/s; CPU = CPU seconds / wall (100% = one core). "
             "`server CPU` is this process (the server's parent, and the engine thread for `http`; the engine "
             "loop for `direct`); `child CPU` the engine process of `http-proc`.", "", HEADER]
    for c, lvl in res["levels"].items():
        lines.append(render_level(int(c), lvl, s["arms"]))
    return "\n".join(lines) + "\n"


def write(res: dict, out_dir: Path) -> None:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve_capacity.json").write_text(json.dumps(res, indent=1))
    (out_dir / "serve_capacity.md").write_text(render(res))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=positive_ints, default=(16, 64))
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--out-dir", type=Path)
    a = ap.parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS + LOCK_ARMS]
    if bad or not arms:
        raise SystemExit(f"--arms={a.arms!r} is invalid: expected a comma-separated subset of "
                         f"{', '.join(ARMS + LOCK_ARMS)}")
    if a.step_ms <= 0 or a.max_tokens < 2 or a.waves < 1 or a.repeats < 1 or a.client_procs < 1:
        raise SystemExit("--step-ms must be > 0, --max-tokens >= 2, --waves, --repeats and --client-procs >= 1")
    res = run(tuple(a.levels), a.step_ms, a.max_tokens, a.waves, a.repeats, arms, a.client_procs, a.out_dir)
    print(render(res))
    emit_document(res)
    return res


if __name__ == "__main__":
    main()
