"""The engine under closed-loop load (issues 19, 28): where a step's time goes when requests keep arriving.

`speed.py` times decode steps of a batch that was prefilled all at once; a served engine instead admits a new
prompt whenever a request finishes, so at concurrency c most steps carry a prefill chunk beside c - 1 decodes.
This benchmark runs that load in process (no HTTP: the engine alone) on the Qwen3-4B-shaped random pair:

  per level c     c requests in flight, `--waves` x c requests in all, prompt lengths drawn uniformly from
                  [--prompt-min, --prompt-max] (one seeded draw per level, the same for every arm), --max-tokens
                  output tokens each (ignore_eos); a finished request is replaced at once by the next one
  per arm         EngineConfig fields (`--arms` JSON: [{"name": ..., "kw": {...}}, ...]; default: the row
                  ladder vs the former bucket x span padding, docs/gpu.md), one engine per arm built once,
                  a warm-up wave per level excluded, then `engine.capture_graphs()`
  figures         output tok/s over the measured window, TTFT (arrival -> first token) and TPOT ((last - first)
                  / (n - 1)) medians, and per forward path (decode-graph / padded / plain, from
                  `ModelRunner.last_path`) the step count, mean ms, share of the wall and mean rows

Repeats are interleaved (every arm once per repeat, per level); each figure is the median over repeats with its
min and max, the ratio to the first arm is the median of the paired per-repeat ratios, and the noise floor of a
level is the spread of the first arm's tok/s over the repeats ((max - min) / median).

Usage: python -m specbench.benchmarks.load --workdir DIR [--levels 1,8,32,64] [--repeats 2] [--arms JSON]
       [--out-dir DIR] [--device cuda] [--model TARGET --draft DRAFT] [--tau T]
Prints a table, then one JSON document as the last line; with --out-dir writes load.json + load.md after every
level, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from specbench.harness.benchdoc import emit_document, positive_ints

DEFAULT_ARMS = [{"name": "ladder", "kw": {"padded_rows": "ladder", "graph_logits": False}},
                {"name": "bucket", "kw": {"padded_rows": "bucket", "graph_logits": True}}]


def stat(xs: list[float]) -> dict:
    xs = [x for x in xs if x == x]
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


def closed_loop(eng, prompts: list[list[int]], c: int, max_tokens: int, tag: str, phases: bool = False) -> dict:
    """Run `prompts` with c in flight; per-request and per-step timings (`phases`: per path, the mean host ms
    of each step phase and the forward's GPU ms, `PhaseClock`)."""
    from specbench.engine import SamplingParams
    from specbench.engine.ranges import NO_RANGES

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    todo = deque(enumerate(prompts))
    arrive: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ntok: dict[str, int] = {}
    paths: dict[str, dict] = {}

    def admit() -> None:
        i, p = todo.popleft()
        rid = f"{tag}-{i}"
        arrive[rid] = time.perf_counter()
        eng.add_request(p, params, rid=rid)

    clock = PhaseClock(eng.device.type == "cuda") if phases else None
    saved_ranges = eng.ranges
    if clock is not None:
        eng.ranges = clock
    for _ in range(min(c, len(todo))):
        admit()
    t0 = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        a = time.perf_counter()
        outs = eng.step()
        b = time.perf_counter()
        steps += 1
        kind, rows = eng.runner.last_path
        pth = paths.setdefault(kind or "none", {"steps": 0, "ms": 0.0, "rows": 0})
        pth["steps"] += 1
        pth["ms"] += (b - a) * 1e3
        pth["rows"] += rows
        if clock is not None:
            ph = pth.setdefault("phase_ms", {})
            step_ms = clock.take()
            step_ms["other"] = (b - a) * 1e3 - sum(v for k, v in step_ms.items() if k != "gpu_forward")
            for k, v in step_ms.items():
                ph[k] = ph.get(k, 0.0) + v
        for o in outs:
            n = len(o.output_ids)
            if n and o.rid not in first:
                first[o.rid] = b
            if n:
                last[o.rid], ntok[o.rid] = b, n
            if o.finished and todo:
                admit()
    wall = time.perf_counter() - t0
    eng.ranges = saved_ranges if saved_ranges is not None else NO_RANGES
    total = sum(ntok.values())
    ttft = [(first[r] - arrive[r]) * 1e3 for r in first]
    tpot = [(last[r] - first[r]) * 1e3 / (ntok[r] - 1) for r in first if ntok[r] > 1]
    for p in paths.values():
        p["mean_ms"] = p["ms"] / p["steps"]
        p["share"] = p["ms"] / (wall * 1e3)
        p["mean_rows"] = p["rows"] / p["steps"]
        if "phase_ms" in p:
            p["phase_mean_ms"] = {k: v / p["steps"] for k, v in p.pop("phase_ms").items()}
    return {"wall_s": wall, "tokens": total, "tok_s": total / wall, "steps": steps,
            "ttft_ms": statistics.median(ttft) if ttft else float("nan"),
            "tpot_ms": statistics.median(tpot) if tpot else float("nan"), "paths": paths}


def build(target: str, draft: str | None, device: str, dtype: str, tau: float | None, kw: dict, pages: int):
    from specbench.engine import LLM

    spec = {"draft": draft, "synthetic_tau": tau} if tau else {}
    return LLM(target, device=device, dtype=dtype, num_pages=pages, max_num_seqs=64, **spec, **kw)


def run(target: str, draft: str | None, device: str, levels: tuple[int, ...], arms: list[dict], repeats: int,
        waves: int, prompt_min: int, prompt_max: int, max_tokens: int, tau: float | None, pages: int,
        dtype: str, save=None, phases: bool = False, cprofile: Path | None = None) -> dict:
    from specbench.benchmarks.speed import environment

    res: dict = {"environment": environment(device), "settings": {
        "levels": list(levels), "arms": arms, "repeats": repeats, "waves": waves, "prompt_len": [prompt_min, prompt_max],
        "max_tokens": max_tokens, "tau": tau, "dtype": dtype, "target": target, "num_pages": pages,
        "phases": phases},
        "levels": {}, "complete": False}
    keep = save or (lambda r: None)
    llms = {}
    for arm in arms:
        t = time.perf_counter()
        llm = build(target, draft, device, dtype, tau, arm.get("kw", {}), pages)
        cap = llm.engine.capture_graphs()
        arm["build_s"] = round(time.perf_counter() - t, 2)
        arm["captured_rows"] = cap["verify_rows"]
        arm["captured_draft_rows"] = cap.get("draft_rows", [])
        llms[arm["name"]] = llm
        print(f"arm {arm['name']}: built + captured {len(cap['verify_rows'])} verify and "
              f"{len(arm['captured_draft_rows'])} draft row counts in {arm['build_s']} s",
              flush=True)
    vocab = next(iter(llms.values())).engine.mcfg.vocab_size
    for c in levels:
        prompts = workload(c, waves, prompt_min, prompt_max, vocab, seed=1)
        per: dict[str, list[dict]] = {a["name"]: [] for a in arms}
        for arm in arms:  # warm-up wave (excluded): every shape of this level once
            closed_loop(llms[arm["name"]].engine, workload(c, 1, prompt_min, prompt_max, vocab, seed=2),
                        c, 16, f"w{c}")
        for r in range(repeats):
            for arm in arms:
                prof = cProfile.Profile() if cprofile is not None and r == repeats - 1 else None
                if prof is not None:
                    prof.enable()
                per[arm["name"]].append(closed_loop(llms[arm["name"]].engine, prompts, c, max_tokens, f"r{r}c{c}",
                                                    phases))
                if prof is not None:
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
                "over_first": stat([x["tok_s"] / y["tok_s"] for x, y in zip(runs, per[base], strict=True)]),
                "paths": runs[-1]["paths"]}
        b = lvl[base]["tok_s"]
        lvl["noise_floor"] = (b["max"] - b["min"]) / b["median"] if b["median"] else None
        res["levels"][str(c)] = lvl
        print(render_level(c, lvl, arms), flush=True)
        keep(res)
    res["complete"] = True
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
        out.append(f"c{c} {arm['name']}: {x['tok_s']['median']:.1f} tok/s ({x['over_first']['median']:.2f}x), "
                   f"TTFT {x['ttft_ms']['median']:.1f} ms, TPOT {x['tpot_ms']['median']:.2f} ms; {paths}")
    return "\n".join(out)


def render(res: dict) -> str:
    arms = res["settings"]["arms"]
    env = res["environment"]
    lines = [f"# The engine under closed-loop load ({env.get('gpu', env['device'])}, {env['date']})", "",
             f"commit {env.get('commit')}; torch {env['torch']}; settings: `{json.dumps(res['settings'], default=str)}`",
             "", "Output tok/s, median over repeats [min-max]; ratio = arm / first arm (median of paired ratios); "
             "noise floor = spread of the first arm's tok/s; TTFT / TPOT medians in ms.", "",
             "| c | arm | tok/s | ratio | noise floor | TTFT ms | TPOT ms | steps: path x mean ms (share of wall, mean rows) |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for c, lvl in res["levels"].items():
        for arm in arms:
            x = lvl[arm["name"]]
            t = x["tok_s"]
            paths = "; ".join(f"{k} {v['steps']} x {v['mean_ms']:.2f} ({v['share']:.0%}, {v['mean_rows']:.0f})"
                              for k, v in sorted(x["paths"].items()))
            nf = lvl.get("noise_floor")
            lines.append(f"| {c} | {arm['name']} | {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | "
                         f"{x['over_first']['median']:.3f} | {'' if nf is None else f'{nf:.1%}'} | "
                         f"{x['ttft_ms']['median']:.1f} | {x['tpot_ms']['median']:.2f} | {paths} |")
    names = ["schedule", "draft", "forward", "verify", "accept", "commit", "other", "gpu_forward"]
    rows = [(c, arm["name"], k, v["phase_mean_ms"]) for c, lvl in res["levels"].items() for arm in arms
            for k, v in sorted(lvl[arm["name"]]["paths"].items()) if "phase_mean_ms" in v]
    if rows:
        lines += ["", "Mean ms per step by phase (the last repeat; host time, except `gpu_forward`: the forward's GPU "
                  "time from CUDA events; `accept` waits for the GPU; `other` = the step's wall minus its phases):", "",
                  "| c | arm | path | " + " | ".join(names) + " |", "|---:|---|---|" + "---:|" * len(names)]
        for c, name, k, ph in rows:
            lines.append(f"| {c} | {name} | {k} | " + " | ".join(f"{ph[n]:.3f}" if n in ph else "" for n in names) + " |")
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
    ap.add_argument("--tau", type=float, help="speculate with the drafter at this synthetic acceptance length")
    ap.add_argument("--num-pages", type=int, default=4000, help="KV pages per arm's engine (all arms live at once)")
    ap.add_argument("--arms", default=json.dumps(DEFAULT_ARMS), help="JSON list of {name, kw: EngineConfig fields}")
    ap.add_argument("--out-dir", help="write load.json and load.md there")
    ap.add_argument("--cprofile", action="store_true",
                    help="with --out-dir: cProfile each arm's last repeat per level (cprofile-ARM-cC.txt: top 45 by own time, 35 by cumulative)")
    ap.add_argument("--phases", action="store_true",
                    help="time each step phase per forward path (host ms, and the forward's GPU ms on CUDA)")
    a = ap.parse_args(argv)
    try:
        arms = json.loads(a.arms)
        assert isinstance(arms, list) and arms and all(isinstance(x, dict) and "name" in x for x in arms)
    except (ValueError, AssertionError):
        raise SystemExit(f"--arms: expected a JSON list of objects with a name (and kw), got {a.arms!r}") from None
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
              phases=a.phases, cprofile=d if a.cprofile and d is not None else None)
    save(res)
    print(render(res), flush=True)
    emit_document(res)
    return res


if __name__ == "__main__":
    main()
