"""Speculative step costs and throughput of the reference engine on the Qwen3-4B-shaped pair (issue 8).

Part `steps`: for each batch (1, 8, 16, 32, 64) B requests are prefilled to `--context` tokens, then the
step's pieces are timed directly (wall clock around the call with a device sync, median of reps after
warm-up; every figure includes the step's one host transfer of picks):
  decode        a plain decode step of the B requests (the decode CUDA graphs, batched argmax)
  verify-graph  the verify forward over B spans of K + 1 = 16 tokens: padded piecewise CUDA graphs,
                attention eager between replays (the default)
  verify-eager  the same padded body, not captured (EngineConfig.eager)
  verify-plain  the plain forward (EngineConfig.verify_graph = False)
  draft-graph   the batched DFlash draft (one [bucket x 16]-row pass) through its piecewise graphs
  draft-eager   the same padded body, not captured
  draft-plain   the batched draft through the plain (unpadded, torch-op) path (draft_graph = False)
  draft-serial  the plain draft one request at a time (batched_draft = False); draft-serial-graph: the
                same through the bucket-1 draft graph
then the ideal speedup tau x t_decode / (t_draft + t_verify) (graph variants) for tau 2, 3.5, 5, 6.5,
and at batch 1 a device profile of one speculative step (draft + verify graphs): kernel time by kind
against the wall time, i.e. where the time goes.
Part `sweep`: `python -m specbench sweep --concurrency 1,8,16,32,64` with arms spec off and DFlash at
synthetic acceptance tau 2, 3.5, 5, 6.5 (labelled synthetic: the random drafter accepts nothing),
interleaved rounds with the paired noise floor; the measured speedup (median paired ratio of output
tok/s vs spec off) beside the ideal one from part `steps` at batch = concurrency and the measured tau.
Targets (issue 8, batch 1): verify at span 16 <= 1.25 x a decode step; draft <= 0.15 x verify;
tau 6.5 spec on >= 4 x spec off (sweep, concurrency 1).
The pair is built with `python -m specbench fixtures --shape qwen3-4b --out DIR --device cuda` unless
DIR/target and DIR/draft exist. Prints tables, then one JSON document as the last line.

Usage: python -m specbench.benchmarks.spec_step [--part steps|sweep|all] [--workdir DIR] [--batches 1,8,16,32,64]
       [--context 512] [--taus 2,3.5,5,6.5] [--steps-json FILE] [--levels 1,8,16,32,64] [--rounds 3]
       [--prompts-per-level 4] [--max-tokens 128] [--dataset random] [--num-pages 2048] [--budget-s S]
       [--sweep-timeout-s S] [--out FILE]     (scripts/gpu.sh spec-steps | spec-sweep)
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specbench.harness.benchdoc import emit_document

TAUS = (2.0, 3.5, 5.0, 6.5)
VERIFY = ("verify-graph", "verify-eager", "verify-plain")
DRAFT = ("draft-graph", "draft-eager", "draft-plain", "draft-serial", "draft-serial-graph")
TARGETS = {"verify_over_decode_b1": 1.25, "draft_over_verify_b1": 0.15, "speedup_tau6.5_c1": 4.0}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warm: int = 2, reps: int = 10) -> float:
    """Median wall ms of fn() with a device sync after each call."""
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def ensure_pair(workdir: Path, device: str) -> tuple[str, str]:
    target, draft = workdir / "target", workdir / "draft"
    if not ((target / "config.json").is_file() and (draft / "config.json").is_file()):
        cmd = [sys.executable, "-m", "specbench", "fixtures", "--shape", "qwen3-4b", "--out", str(workdir),
               "--device", device]
        print("building the pair: " + " ".join(cmd), flush=True)
        t0 = time.time()
        subprocess.run(cmd, check=True)
        print(f"built in {time.time() - t0:.0f} s", flush=True)
    return str(target), str(draft)


class StepBench:
    """One DFlash engine; the step's pieces called directly on spans built from its live requests."""

    def __init__(self, target: str, draft: str, max_batch: int, device: str = "cuda") -> None:
        from specbench.engine import EngineConfig, LLMEngine, SpecConfig
        from specbench.engine.graphs import VerifyGraphs
        from specbench.engine.spec.dflash import DFlashProposer
        from specbench.engine.spec.dflash_graphs import DraftGraphs

        cuda = device.startswith("cuda")
        self.engine = LLMEngine(EngineConfig(
            model=target, draft=draft, device=device, dtype="bfloat16" if cuda else "float32",
            max_num_seqs=max_batch, max_num_batched_tokens=16384, gpu_memory_utilization=0.6,
            spec=SpecConfig(method="dflash")))
        eng = self.engine
        r, p = eng.runner, eng.proposer
        if not isinstance(p, DFlashProposer):  # what SpecConfig(method="dflash") builds: its draft is timed here
            raise TypeError(f"expected the DFlash proposer, the engine built {type(p).__name__}")
        self.proposer = p
        self.k, self.tap = eng.k, p.tap_layers
        if not cuda:  # CPU (tests): drive the padded runners eagerly, as the GPU would with capture
            r.use_graph_runner = True
        self.verify = {"verify-graph": VerifyGraphs(r, self.tap, (self.k + 1,), capture=True),
                       "verify-eager": VerifyGraphs(r, self.tap, (self.k + 1,), capture=False)}
        self.draft = {"draft-graph": DraftGraphs(p, capture=True), "draft-eager": DraftGraphs(p, capture=False)}
        r.verify_graphs = self.verify["verify-graph"]  # the engine's own steps (fill) share these buffers
        p.graphs = self.draft["draft-graph"]
        print("memory: " + eng.memory.summary(), flush=True)

    def fill(self, batch: int, ctx: int, seed: int) -> list:
        from specbench.engine import SamplingParams

        g = torch.Generator().manual_seed(seed)
        vocab = min(self.engine.mcfg.vocab_size, 100_000)
        sp = SamplingParams(max_tokens=1000, ignore_eos=True)
        rids = [self.engine.add_request(torch.randint(2, vocab, (ctx,), generator=g).tolist(), sp)
                for _ in range(batch)]
        while any(self.engine.requests[rid].in_prefill for rid in rids):
            self.engine.step()
        reqs = [self.engine.requests[rid] for rid in rids]
        assert all(self.proposer.ready(r) for r in reqs), "requests not draft-ready after prefill"
        return reqs

    def spans(self, reqs: list, kind: str) -> list:
        from specbench.engine.scheduler import Span

        g = torch.Generator().manual_seed(len(reqs))
        out = []
        for r in reqs:
            n = self.k + 1 if kind == "verify" else 1
            toks = [r.all_ids[r.num_computed]] + torch.randint(2, 1000, (n - 1,), generator=g).tolist()
            out.append(Span(r, toks, r.num_computed, kind))
            self.engine.pool.ensure(r.rid, r.num_computed + max(n, self.proposer.block))
        return out

    def time_verify(self, variant: str, spans: list, reps: int) -> float:
        r = self.engine.runner
        rows = list(range(sum(len(s.tokens) for s in spans)))

        def fn() -> None:
            if variant == "verify-plain":
                r.use_graph_runner, keep = False, r.use_graph_runner
                try:
                    logits, _ = r.forward(spans, rows, self.tap)
                finally:
                    r.use_graph_runner = keep
            else:
                logits, _ = self.verify[variant].run(spans, rows)
            logits.argmax(-1).tolist()

        return timed(fn, reps=reps)

    def time_decode(self, spans: list, reps: int) -> float:
        r = self.engine.runner
        rows = list(range(len(spans)))
        use = r.use_graph_runner

        def fn() -> None:
            r.use_graph_runner = True
            try:
                logits, _ = r.forward(spans, rows, ())
            finally:
                r.use_graph_runner = use
            logits.argmax(-1).tolist()

        return timed(fn, reps=reps)

    def time_draft(self, variant: str, spans: list, reps: int) -> float:
        p = self.proposer
        ks = [self.k] * len(spans)
        graph = {"draft-graph": self.draft["draft-graph"], "draft-eager": self.draft["draft-eager"],
                 "draft-serial-graph": self.draft["draft-graph"]}.get(variant)
        batched = variant in ("draft-graph", "draft-eager", "draft-plain")

        def fn() -> None:
            p.graphs, p.use_graphs, p.batched = graph, graph is not None, batched
            p.propose(spans, ks)

        try:
            return timed(fn, reps=reps)
        finally:
            p.graphs, p.use_graphs, p.batched = self.draft["draft-graph"], True, True

    def profile_step(self, dspans: list, vspans: list) -> dict:
        """Device time by kernel kind over 5 speculative steps (draft graph + verify graph) vs their wall."""
        from torch.profiler import ProfilerActivity, profile

        p, vg = self.proposer, self.verify["verify-graph"]
        rows = list(range(sum(len(s.tokens) for s in vspans)))

        def step() -> None:
            p.propose(dspans, [self.k] * len(dspans))
            vg.run(vspans, rows)[0].argmax(-1).tolist()

        step()
        sync()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            sync()
        wall = (time.perf_counter() - t) * 1e3 / 5
        kinds: dict[str, float] = {}
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 5
            if us > 0:
                kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + us
        busy = sum(kinds.values()) / 1e3
        return {"wall_ms": wall, "device_busy_ms": busy, "idle_ms": max(0.0, wall - busy),
                "by_kind_ms": {k: v / 1e3 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}

    def abort(self, reqs: list) -> None:
        for r in reqs:
            self.engine.abort(r.rid)


def kernel_kind(name: str) -> str:
    n = name.lower()
    for kind, keys in (("attention", ("flashinfer", "prefill", "decode", "attention", "sdpa", "softmax")),
                       ("gemm", ("gemm", "cutlass", "sm90", "cublas", "matmul", "splitk", "nvjet")),
                       ("norm+rope+store", ("rms", "norm", "rope")), ("swiglu", ("swiglu", "silu")),
                       ("copy", ("copy", "memcpy", "memset", "fill", "cat"))):
        if any(k in n for k in keys):
            return kind
    return "other"


def run_steps(target: str, draft: str, batches: tuple[int, ...], context: int, taus: tuple[float, ...],
              device: str = "cuda", reps: int = 10, budget_s: float | None = None, profile: bool = True) -> dict:
    t_start = time.time()
    bench = StepBench(target, draft, max(batches), device)
    rows: list[dict] = []
    out: dict = {"batches": list(batches), "context": context, "k": bench.k, "rows": rows, "profile_b1": None,
                 "memory": bench.engine.memory_report()}
    for b in batches:
        if budget_s is not None and time.time() - t_start > budget_s:
            print(f"budget of {budget_s} s spent: skipping batch {b}", flush=True)
            continue
        t0 = time.time()
        reqs = bench.fill(b, context, seed=b)
        vspans, dspans, cspans = bench.spans(reqs, "verify"), bench.spans(reqs, "verify"), bench.spans(reqs, "decode")
        row: dict = {"batch": b, "decode": bench.time_decode(cspans, reps)}
        for v in VERIFY:
            row[v] = bench.time_verify(v, vspans, reps if v != "verify-plain" else max(3, reps // 3))
        for v in DRAFT:
            row[v] = bench.time_draft(v, dspans, reps if "serial" not in v else max(3, reps // 3))
        row["verify_over_decode"] = row["verify-graph"] / row["decode"]
        row["draft_over_verify"] = row["draft-graph"] / row["verify-graph"]
        row["ideal"] = {str(t): t * row["decode"] / (row["draft-graph"] + row["verify-graph"]) for t in taus}
        if b == 1 and profile and device.startswith("cuda"):
            out["profile_b1"] = bench.profile_step(dspans, vspans)
        bench.abort(reqs)
        rows.append(row)
        print(f"batch {b} ({time.time() - t0:.1f} s): " + ", ".join(
            f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    out["fast_paths"] = bench.engine.fast_path_stats()
    del bench
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out["seconds"] = time.time() - t_start
    return out


# ---- the sweep --------------------------------------------------------------------------------------------
def sweep_command(target: str, draft: str, levels: str, taus: tuple[float, ...], out_dir: str, rounds: int,
                  prompts_per_level: int, max_tokens: int, num_pages: int, dataset: str, noise: bool,
                  device: str = "cuda", dtype: str = "bfloat16", report: str | None = None,
                  input_words: int = 64) -> list[str]:
    common = f"device={device},dtype={dtype},num_pages={num_pages}"
    arms = [f"local:{target},spec=off,{common},name=spec-off"]
    arms += [f"local:{target},draft={draft},spec=dflash,{common},tau={t:g},name=tau{t:g}" for t in taus]
    cmd = [sys.executable, "-m", "specbench", "sweep", "--concurrency", levels, "--arms", ";".join(arms),
           "--dataset", dataset, "--max-tokens", str(max_tokens), "--ignore-eos", "--rounds", str(rounds),
           "--prompts-per-level", str(prompts_per_level), "--out", out_dir, "--no-progress"]
    if dataset == "random":
        cmd += ["--random-input-len", str(input_words)]
    if not noise:
        cmd.append("--no-noise-floor")
    if report:
        cmd += ["--report", report]
    return cmd


def run_sweep(cmd: list[str], timeout_s: float | None) -> tuple[str | None, str]:
    """Run the CLI; at the deadline interrupt it like Ctrl-C (its records are kept, marked incomplete)."""
    print("sweep: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=120)
    print(text, flush=True)
    m = re.search(r"^records: (\S+)", text, re.M)
    return (m.group(1) if m else None), text


def sweep_table(run_dir: str, taus: tuple[float, ...], steps: dict | None) -> dict:
    """Per level and arm: tok/s, measured speedup vs spec off (median paired ratio), measured tau and the
    ideal speedup from the step timings at batch = level."""
    from specbench.suites.report import load_run_summary

    s = load_run_summary(run_dir)
    by_batch = {r["batch"]: r for r in (steps or {}).get("rows", [])}
    levels = []
    for lv in s.levels:
        base = s.get("spec-off", lv)
        row: dict = {"level": lv, "spec-off": base.tok_s_median if base else None, "arms": {}}
        for t in taus:
            arm = f"tau{t:g}"
            c = s.get(arm, lv)
            if c is None:
                continue
            sp = s.speedups.get((arm, lv))
            tau_m = (c.acceptance or {}).get("length")
            st = by_batch.get(int(lv))
            ideal = (tau_m * st["decode"] / (st["draft-graph"] + st["verify-graph"])) if st and tau_m else None
            row["arms"][arm] = {"tau": t, "tau_measured": tau_m, "tok_s": c.tok_s_median,
                                "speedup": sp["median"] if sp else None, "ideal": ideal}
        row["noise"] = (s.noise.get(lv) or {}).get("noise")
        levels.append(row)
    return {"run_dir": run_dir, "complete": s.complete, "levels": levels}


# ---- output -----------------------------------------------------------------------------------------------
def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(res: dict) -> str:
    lines = []
    steps = res.get("steps")
    if steps:
        lines += [f"# speculative step on {res.get('gpu', '?')} (K = {steps['k']}, context {steps['context']}; ms)",
                  "B  | decode | verify graph / eager / plain | v/decode | draft graph / eager / plain | "
                  "serial plain / graph | d/verify | ideal x at tau " + " / ".join(f"{t:g}" for t in res["taus"]),
                  "-- | ------ | ---------------------------- | -------- | --------------------------- | "
                  "-------------------- | -------- | -----------"]
        for r in steps["rows"]:
            lines.append(
                f"{r['batch']:<2} | {r['decode']:6.2f} | {r['verify-graph']:6.2f} / {r['verify-eager']:6.2f} / "
                f"{r['verify-plain']:6.2f} | {r['verify_over_decode']:8.2f} | {r['draft-graph']:6.2f} / "
                f"{r['draft-eager']:6.2f} / {r['draft-plain']:6.2f} | {r['draft-serial']:7.2f} / "
                f"{r['draft-serial-graph']:7.2f} | {r['draft_over_verify']:8.2f} | "
                + " / ".join(f"{v:.2f}" for v in r["ideal"].values()))
        p = steps.get("profile_b1")
        if p:
            lines.append(f"batch-1 speculative step (draft + verify graphs): wall {p['wall_ms']:.2f} ms, device busy "
                         f"{p['device_busy_ms']:.2f} ms, idle {p['idle_ms']:.2f} ms; by kind: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_ms"].items()))
    sw = res.get("sweep")
    if sw and sw.get("levels"):
        arms = list(sw["levels"][0]["arms"])
        lines += ["", f"# sweep (output tok/s; measured speedup vs spec off / ideal; measured tau) {sw['run_dir']}"
                  + ("" if sw["complete"] else " INCOMPLETE"),
                  "c  | spec-off | " + " | ".join(arms) + " | noise", "-- | -------- | "
                  + " | ".join("-" * 24 for _ in arms) + " | -----"]
        for lv in sw["levels"]:
            cells = [f"{_f(a['tok_s'], '{:.0f}')} ({_f(a['speedup'])}x / {_f(a['ideal'])}x; tau {_f(a['tau_measured'])})"
                     for a in lv["arms"].values()]
            lines.append(f"{lv['level']:<2g} | {_f(lv['spec-off'], '{:.0f}'):>8} | " + " | ".join(cells)
                         + f" | {_f(lv['noise'], '{:.3f}')}")
    t = res.get("targets")
    if t:
        lines += ["", "targets (batch 1): " + "; ".join(
            f"{k} {_f(v['value'])} (want {'<=' if v['max'] else '>='} {v['want']}: {'met' if v['met'] else 'MISSED'})"
            if v["value"] is not None else f"{k}: not measured" for k, v in t.items())]
    return "\n".join(lines)


def targets(res: dict) -> dict:
    b1 = next((r for r in (res.get("steps") or {}).get("rows", []) if r["batch"] == 1), None)
    c1 = next((lv for lv in (res.get("sweep") or {}).get("levels", []) if lv["level"] == 1), None)
    sp = ((c1 or {}).get("arms", {}).get("tau6.5") or {}).get("speedup")
    vals = {"verify_over_decode_b1": (b1 or {}).get("verify_over_decode"),
            "draft_over_verify_b1": (b1 or {}).get("draft_over_verify"), "speedup_tau6.5_c1": sp}
    out = {}
    for k, v in vals.items():
        upper = k != "speedup_tau6.5_c1"
        want = TARGETS[k]
        out[k] = {"value": v, "want": want, "max": upper,
                  "met": None if v is None else (v <= want if upper else v >= want)}
    return out


def _nums(text: str, cast=int) -> tuple:
    return tuple(cast(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> dict:
    import specbench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("steps", "sweep", "all"), default="all")
    ap.add_argument("--workdir", default="/tmp/q3-4b-pair", help="the pair's folder (built there when absent)")
    ap.add_argument("--target", help="a target dir instead of the built pair (with --draft)")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--taus", default=",".join(f"{t:g}" for t in TAUS))
    ap.add_argument("--steps-json", help="step timings of an earlier run (its JSON) for the sweep's ideal column")
    ap.add_argument("--levels", default="1,8,16,32,64", help="sweep concurrency levels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-level", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages per sweep engine (they share the GPU)")
    ap.add_argument("--dataset", default="random", help="sweep prompts (random: --input-words words each)")
    ap.add_argument("--input-words", type=int, default=64)
    ap.add_argument("--no-noise-floor", action="store_true")
    ap.add_argument("--sweep-out", default="results", help="sweep records folder")
    ap.add_argument("--report", help="also render the sweep report (markdown + PNG) here")
    ap.add_argument("--budget-s", type=float, help="steps: start no new batch past this many seconds")
    ap.add_argument("--sweep-timeout-s", type=float, help="interrupt the sweep (records kept) past this")
    ap.add_argument("--out", help="also write the JSON document here")
    a = ap.parse_args(argv)
    taus = _nums(a.taus, float)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/spec_step.py needs a CUDA GPU (or --device cpu with --target/--draft)")
    target, draft = (a.target, a.draft) if a.target else ensure_pair(Path(a.workdir), a.device)
    res: dict = {"bench": "spec_step", "version": specbench.__version__, "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "target": target,
                 "draft": draft, "taus": list(taus), "steps": None, "sweep": None}
    if a.part in ("steps", "all"):
        res["steps"] = run_steps(target, draft, _nums(a.batches), a.context, taus, a.device, a.reps, a.budget_s)
    elif a.steps_json:
        res["steps"] = json.loads(Path(a.steps_json).read_text().strip().splitlines()[-1]).get("steps")
    if a.out:
        Path(a.out).write_text(json.dumps(res, default=str) + "\n")
    if a.part in ("sweep", "all"):
        cmd = sweep_command(target, draft, a.levels, taus, a.sweep_out, a.rounds, a.prompts_per_level, a.max_tokens,
                            a.num_pages, a.dataset, not a.no_noise_floor, a.device,
                            "bfloat16" if a.device.startswith("cuda") else "float32", a.report, a.input_words)
        res["sweep_command"] = " ".join(cmd)
        run_dir, _ = run_sweep(cmd, a.sweep_timeout_s)
        res["sweep"] = sweep_table(run_dir, taus, res["steps"]) if run_dir else {"error": "no run directory"}
    res["targets"] = targets(res)
    print(render(res))
    emit_document(res, a.out)
    return res


if __name__ == "__main__":
    main()
