"""Engine speed against the dense floor (issue 19): one run, one `speed.json` + `speed.md`.

Measured through the user's front door (`LLM.generate`) on the Qwen3-4B-shaped random pair, plus the step
benches, all in one process on one GPU:

  dense_floor_ms        all of a step's matmuls (distinct weights, cuBLAS) in ONE CUDA graph, by rows
                        (benchmarks/decode.py `dense_floor_ms`; on CPU the same matmuls timed eagerly)
  plain_ms_per_step     spec off, c prompts of --prompt-len random tokens: (wall of generate(max_tokens=N) -
                        wall of generate(max_tokens=1)) / (N - 1): one decode step of c rows, prefill removed
  plain_over_dense      plain_ms_per_step[c] / dense_floor_ms[c]
  verify_over_decode_b1 the captured verify (span K+1) over the captured decode step, batch 1, ctx 512
  draft_over_verify_b1  the draft graph over the verify graph, batch 1 (benchmarks/spec_step.py StepBench)
  spec_speedup          wall of plain generate / wall of spec generate with synthetic acceptance tau (default
                        6.5: the accept count is drawn, the rest of the step is real), same prompts, N tokens
  context_growth        plain_ms_per_step at contexts --contexts and concurrency 1 and --growth-c
  ahead_off_ms_per_step plain_ms_per_step with decode ahead off (engine/ahead.py: the simple path, each step
                        ending on its host read), the same engine and prompts, interleaved with the on arm per
                        repeat; ahead_gain = off / on per repeat (--no-ahead-ab skips it)

Every figure is the median over --repeats repeats (warm-up excluded) with its min and max; the plain/spec
generates are interleaved per repeat, and each speedup is the median of the paired per-repeat ratios. The
noise floor stated per concurrency is the spread of the plain wall times over the repeats ((max-min)/median).
The "must reach" targets of issue 19 are checked in `targets`.

Usage: python -m specbench.benchmarks.speed --workdir DIR --out-dir DIR [--levels 1,8,16,32,64]
       [--contexts 512,2048,8192] [--repeats 3] [--new-tokens 256] [--prompt-len 128] [--tau 6.5]
       [--device cuda] [--model TARGET --draft DRAFT]
Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from specbench.harness.benchdoc import emit_document, positive_ints
from specbench.harness.verdicts import INCOMPLETE

SECTIONS = ("steps", "levels", "growth")
# the ratio bars (at most) and the speculative speedup bars per concurrency (at least)
MUST = {"plain_c1_over_dense": 1.10, "plain_over_dense": 1.30, "verify_over_decode_b1": 1.20,
        "draft_over_verify_b1": 0.15}
GOAL = {"plain_c1_over_dense": 1.05, "plain_over_dense": 1.15, "verify_over_decode_b1": 1.10,
        "draft_over_verify_b1": 0.10}
MUST_SPEEDUP = {1: 4.0, 8: 2.5, 32: 1.5}
GOAL_SPEEDUP = {1: 5.0, 8: 3.0, 32: 2.0}


def stat(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def dense_floor(model, rows: int, device: str) -> float:
    if device.startswith("cuda"):
        from specbench.benchmarks.decode import dense_floor_ms

        return dense_floor_ms(model, rows)
    from specbench.benchmarks.decode import step_weights

    ws = step_weights(model)
    ins = {k: torch.randn(rows, k).to(model.embed.dtype) for k in {w.shape[1] for w in ws}}
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for w in ws:
            F.linear(ins[w.shape[1]], w)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts[1:])


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, min(vocab, 100_000), (length,), generator=g).tolist() for _ in range(n)]


def gen_wall(llm, ps: list[list[int]], max_tokens: int, device: str) -> float:
    from specbench.engine import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(ps, sp)
    sync(device)
    wall = time.perf_counter() - t
    assert all(len(o.output_ids) == max_tokens for o in outs), "a request stopped early under ignore_eos"
    return wall


def spec_wall(llm, ps: list[list[int]], max_tokens: int, device: str, seed: int) -> float:
    """gen_wall of the synthetic-acceptance engine with its accept draws made from `seed`: the arms of one
    repeat see the same acceptable positions (common random numbers, engine/spec/synthetic.py: a paired
    comparison; at c1 a run is a few dozen draws, whose spread otherwise exceeds the gap between arms), repeats
    draw different ones."""
    if llm.engine.synthetic is not None:
        llm.engine.synthetic.reseed(seed)
    return gen_wall(llm, ps, max_tokens, device)


def step_ms(llm, ps: list[list[int]], n_new: int, device: str) -> tuple[float, float]:
    """(ms per decode step, wall s of the full generate): prefill-only run subtracted."""
    full = gen_wall(llm, ps, n_new, device)
    one = gen_wall(llm, ps, 1, device)
    return (full - one) * 1e3 / (n_new - 1), full


@contextlib.contextmanager
def switched(objs: list, attr: str, on: bool) -> Iterator[None]:
    """`obj.attr = on` for each obj inside the block, each restored after it: decode ahead
    (`engine.ahead.enabled`), whole graphs (a piecewise stack's `whole`), deferred drafts (`engine.defer_drafts`)."""
    was = [getattr(o, attr) for o in objs]
    for o in objs:
        setattr(o, attr, on)
    try:
        yield
    finally:
        for o, w in zip(objs, was, strict=True):
            setattr(o, attr, w)


def engine_stacks(llm) -> list:
    """The verify and draft stacks an engine has built so far (after a warm-up spec run)."""
    eng = llm.engine
    return [g.stack for g in (eng.runner.verify_graphs, getattr(eng.proposer, "graphs", None)) if g is not None]


def ahead_outputs(llm, ps: list[list[int]], on: bool, max_tokens: int = 64) -> list[list[int]]:
    """Greedy output ids of `ps` with decode ahead on or off."""
    from specbench.engine import SamplingParams

    with switched([llm.engine.ahead], "enabled", on):
        return [o.output_ids for o in llm.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


def step_benches(target: str, draft: str, device: str, repeats: int, context: int) -> dict:
    from specbench.benchmarks.spec_step import StepBench

    bench = StepBench(target, draft, 1, device)
    reqs = bench.fill(1, context, seed=1)
    vspans, dspans, cspans = bench.spans(reqs, "verify"), bench.spans(reqs, "verify"), bench.spans(reqs, "decode")
    dec, ver, dra, pver, pdra = [], [], [], [], []
    stacks = [bench.verify["verify-graph"].stack, bench.draft["draft-graph"].stack]
    whole = all(s.whole_rows() for s in stacks)
    for _ in range(repeats):  # interleaved: each repeat times every figure (each a median of 10 calls)
        dec.append(bench.time_decode(cspans, 10))
        ver.append(bench.time_verify("verify-graph", vspans, 10))
        dra.append(bench.time_draft("draft-graph", dspans, 10))
        if whole:  # the piecewise graphs whole graphs replace (their off switch), same spans
            with switched(stacks, "whole", False):
                pver.append(bench.time_verify("verify-graph", vspans, 10))
                pdra.append(bench.time_draft("draft-graph", dspans, 10))
    out = {"context": context, "span": bench.k + 1, "whole": whole, "decode_ms": stat(dec), "verify_ms": stat(ver),
           "draft_ms": stat(dra),
           "verify_over_decode": stat([v / d for v, d in zip(ver, dec, strict=True)]),
           "draft_over_verify": stat([d / v for d, v in zip(dra, ver, strict=True)])}
    if whole:
        out.update({"piecewise_verify_ms": stat(pver), "piecewise_draft_ms": stat(pdra),
                    "piecewise_verify_over_decode": stat([v / d for v, d in zip(pver, dec, strict=True)])})
    bench.abort(reqs)
    del bench, reqs, vspans, dspans, cspans
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def commit() -> str | None:
    try:
        return subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                              timeout=10).stdout.strip()[:120] or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "device": device, "commit": commit(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def run(target: str, draft: str, device: str = "cuda", levels: tuple[int, ...] = (1, 8, 16, 32, 64),
        contexts: tuple[int, ...] = (512, 2048, 8192), growth_c: int = 32, repeats: int = 3,
        new_tokens: int = 256, prompt_len: int = 128, tau: float = 6.5, growth_tokens: int = 64,
        step_context: int = 512, dtype: str | None = None, save=None, engine_kw: dict | None = None,
        sections: tuple[str, ...] = SECTIONS, ahead_ab: bool = True, whole_ab: bool = True,
        defer_ab: bool = True) -> dict:
    """`save(res)` is called after every section, so an interrupted run keeps what it measured."""
    from specbench.engine import LLM

    cuda = device.startswith("cuda")
    dtype = dtype or ("bfloat16" if cuda else "float32")
    res: dict = {"environment": environment(device), "settings": {
        "levels": list(levels), "contexts": list(contexts), "growth_c": growth_c, "repeats": repeats,
        "new_tokens": new_tokens, "prompt_len": prompt_len, "tau": tau, "growth_tokens": growth_tokens,
        "dtype": dtype, "target": target, "draft": draft, "engine_kw": engine_kw or {}, "sections": list(sections)},
        "complete": False}
    t0 = time.time()
    keep = save or (lambda r: None)
    if "steps" in sections:
        res["steps_b1"] = step_benches(target, draft, device, repeats, step_context)
        print(f"step benches b1 ({time.time() - t0:.0f} s): " + json.dumps(res["steps_b1"]), flush=True)
        keep(res)

    max_len = max(contexts) + max(new_tokens, growth_tokens) + 64
    common = dict(device=device, dtype=dtype, max_num_seqs=max(max(levels), growth_c),
                  max_num_batched_tokens=16384, max_model_len=max_len, **(engine_kw or {}))
    plain = LLM(target, spec="off", gpu_memory_utilization=0.45, **common)
    spec = LLM(target, draft=draft, spec="dflash", synthetic_tau=tau, gpu_memory_utilization=0.9, **common)
    vocab = plain.engine.mcfg.vocab_size
    # every graph a step can take, captured before any timing (as `specbench serve` does at start): no repeat pays
    # a lazy capture; with the whole-graphs arm, the piecewise graphs it switches to as well
    plain.engine.capture_graphs()
    spec.engine.capture_graphs()
    whole_ab = whole_ab and spec.engine.cfg.whole_graphs and spec.engine.runner.backend.rows_ok
    if whole_ab:
        with switched(engine_stacks(spec), "whole", False):
            spec.engine.capture_graphs()
    rows = sorted(set(levels) | {1, spec.engine.k + 1})
    res["dense_floor_ms"] = {str(r): stat([dense_floor(plain.engine.model, r, device) for _ in range(repeats)])
                             for r in rows}
    print("dense floor: " + ", ".join(f"{r} rows {v['median']:.3f} ms" for r, v in res["dense_floor_ms"].items()),
          flush=True)

    res["plain_ms_per_step"], res["spec_speedup"], res["noise_floor"] = {}, {}, {}
    ahead_ab = ahead_ab and plain.engine.ahead.usable()
    if ahead_ab:
        res["ahead_off_ms_per_step"], res["ahead_gain"] = {}, {}
    if whole_ab:
        res["piecewise_spec_speedup"] = {}
    defer_ab = defer_ab and spec.engine.defer_drafts
    if defer_ab:
        res["undeferred_spec_speedup"] = {}
    for c in (levels if "levels" in sections else ()):
        ps = prompts(c, prompt_len, vocab, seed=c)
        gen_wall(plain, ps, 8, device)  # warm-up: this batch size's graphs and buffers, both engines
        gen_wall(spec, ps, 8, device)
        if ahead_ab:  # the fast path checked against the simple one on this backend: greedy tokens equal
            res.setdefault("ahead_equal", {})[str(c)] = ahead_outputs(plain, ps, True) == ahead_outputs(plain, ps, False)
        steps, walls, ratios, offs, pieces, undeferred = [], [], [], [], [], []
        stacks = engine_stacks(spec)  # built by capture_graphs above
        for rep in range(repeats):
            ms, wall_plain = step_ms(plain, ps, new_tokens, device)
            wall_spec = spec_wall(spec, ps, new_tokens, device, seed=1000 * c + rep)
            steps.append(ms)
            walls.append(wall_plain)
            ratios.append(wall_plain / wall_spec)
            if whole_ab:  # the same spec engine on piecewise verify / draft graphs (whole graphs' off switch)
                with switched(stacks, "whole", False):
                    pieces.append(wall_plain / spec_wall(spec, ps, new_tokens, device, seed=1000 * c + rep))
            if defer_ab:  # the same spec engine with its drafts read to the host before the verify (defer's off switch)
                with switched([spec.engine], "defer_drafts", False):
                    undeferred.append(wall_plain / spec_wall(spec, ps, new_tokens, device, seed=1000 * c + rep))
            if ahead_ab:  # the same engine with decode ahead off: the simple path it replaces
                with switched([plain.engine.ahead], "enabled", False):
                    offs.append(step_ms(plain, ps, new_tokens, device)[0])
        d = res["dense_floor_ms"][str(c)]["median"]
        if ahead_ab:
            res["ahead_off_ms_per_step"][str(c)] = {**stat(offs), "over_dense": statistics.median(offs) / d}
            res["ahead_gain"][str(c)] = stat([o / m for o, m in zip(offs, steps, strict=True)])
            print(f"c{c}: decode ahead off {statistics.median(offs):.3f} ms/step "
                  f"(off/on {res['ahead_gain'][str(c)]['median']:.2f}x)", flush=True)
        res["plain_ms_per_step"][str(c)] = {**stat(steps), "over_dense": statistics.median(steps) / d}
        res["spec_speedup"][str(c)] = stat(ratios)
        if whole_ab:
            res["piecewise_spec_speedup"][str(c)] = stat(pieces)
        if defer_ab:
            res["undeferred_spec_speedup"][str(c)] = stat(undeferred)
        res["noise_floor"][str(c)] = (max(walls) - min(walls)) / statistics.median(walls)
        print(f"c{c}: plain {statistics.median(steps):.3f} ms/step ({statistics.median(steps) / d:.2f}x dense), "
              f"spec/plain {statistics.median(ratios):.2f}x at tau {tau}", flush=True)
        keep(res)

    res["context_growth"] = {}
    for ctx in (contexts if "growth" in sections else ()):
        for c in sorted({1, growth_c}):
            ps = prompts(c, ctx, vocab, seed=ctx + c)
            gen_wall(plain, ps, 4, device)
            xs = [step_ms(plain, ps, growth_tokens, device)[0] for _ in range(repeats)]
            res["context_growth"].setdefault(str(ctx), {})[str(c)] = stat(xs)
            print(f"ctx {ctx} c{c}: {statistics.median(xs):.3f} ms/step", flush=True)
            keep(res)
    res["targets"] = targets(res)
    res["fast_paths"] = {"plain": plain.engine.fast_path_stats(), "spec": spec.engine.fast_path_stats()}
    res["seconds"] = time.time() - t0
    res["complete"] = True
    return res


def targets(res: dict) -> dict:
    """Each issue-19 figure beside its goal and must-reach bound; `ok` is the must-reach check."""
    out: dict = {}
    pm = res.get("plain_ms_per_step", {})
    if "1" in pm:
        v = pm["1"]["over_dense"]
        out["plain_c1_over_dense"] = {"value": v, "goal": GOAL["plain_c1_over_dense"],
                                      "must": MUST["plain_c1_over_dense"], "ok": v <= MUST["plain_c1_over_dense"]}
    for c, row in pm.items():
        if c != "1":
            v = row["over_dense"]
            out[f"plain_c{c}_over_dense"] = {"value": v, "goal": GOAL["plain_over_dense"],
                                             "must": MUST["plain_over_dense"], "ok": v <= MUST["plain_over_dense"]}
    st = res.get("steps_b1")
    if st:
        for k in ("verify_over_decode", "draft_over_verify"):
            v = st[k]["median"]
            out[f"{k}_b1"] = {"value": v, "goal": GOAL[f"{k}_b1"], "must": MUST[f"{k}_b1"],
                              "ok": v <= MUST[f"{k}_b1"]}
    for c, must in MUST_SPEEDUP.items():
        row = res.get("spec_speedup", {}).get(str(c))
        if row:
            v = row["median"]
            out[f"spec_speedup_c{c}"] = {"value": v, "goal": GOAL_SPEEDUP[c], "must": must, "ok": v >= must}
    return out


def _r(s: dict, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def render(res: dict) -> str:
    env, st = res["environment"], res.get("settings", {})
    lines = ["# Engine speed against the dense floor (issue 19)", "",
             f"Measured by `python -m specbench.benchmarks.speed` ({'complete' if res.get('complete') else INCOMPLETE}"
             f" run): {env.get('gpu', env['device'])}, torch {env['torch']}, commit `{env.get('commit')}`, "
             f"{env['date']}. Random Qwen3-4B-shaped pair, {st.get('dtype')}, prompts of {st.get('prompt_len')} "
             f"random tokens, {st.get('new_tokens')} new tokens, through `LLM.generate`. Figures: median "
             f"[min, max] over {st.get('repeats')} repeats, warm-up excluded.", ""]
    if res.get("dense_floor_ms"):
        lines += ["## Plain decode per step vs the dense floor", "",
                  "| concurrency | ms per step | dense floor ms | over dense | noise floor |", "|---|---|---|---|---|"]
        for c, row in res.get("plain_ms_per_step", {}).items():
            lines.append(f"| {c} | {_r(row)} | {res['dense_floor_ms'][c]['median']:.3f} | {row['over_dense']:.2f}x | "
                         f"{res['noise_floor'][c]:.1%} |")
        lines.append("")
    if res.get("ahead_off_ms_per_step"):
        lines += ["## Decode ahead on vs off (engine/ahead.py; the same engine, arms interleaved per repeat)", "",
                  "| concurrency | on ms per step | off ms per step | off / on | off over dense | greedy tokens equal |",
                  "|---|---|---|---|---|---|"]
        for c, row in res["ahead_off_ms_per_step"].items():
            on = res["plain_ms_per_step"].get(c)
            same = res.get("ahead_equal", {}).get(c)
            lines.append(f"| {c} | {_r(on) if on else '-'} | {_r(row)} | {_r(res['ahead_gain'][c], '{:.2f}')}x | "
                         f"{row['over_dense']:.2f}x | {'yes' if same else 'NO' if same is not None else '-'} |")
        lines.append("")
    s = res.get("steps_b1")
    if s:
        lines += [f"## Step benches, batch 1, context {s['context']}, span {s['span']}", "",
                  "| figure | value |", "|---|---|",
                  f"| decode step ms | {_r(s['decode_ms'])} |", f"| verify graph ms | {_r(s['verify_ms'])} |",
                  f"| draft graph ms | {_r(s['draft_ms'])} |",
                  f"| verify / decode | {_r(s['verify_over_decode'], '{:.2f}')} |",
                  f"| draft / verify | {_r(s['draft_over_verify'], '{:.2f}')} |"]
        if s.get("piecewise_verify_ms"):  # whole graphs' off switch, interleaved with the figures above
            lines += [f"| verify, piecewise graphs (whole off) ms | {_r(s['piecewise_verify_ms'])} |",
                      f"| draft, piecewise graphs (whole off) ms | {_r(s['piecewise_draft_ms'])} |",
                      f"| piecewise verify / decode | {_r(s['piecewise_verify_over_decode'], '{:.2f}')} |"]
        lines.append("")
    if res.get("spec_speedup"):
        # the same spec engine with one fast path off, interleaved per repeat
        arms = [(k, label) for k, label in (("piecewise_spec_speedup", "piecewise graphs (whole off)"),
                                            ("undeferred_spec_speedup", "drafts read before verify (defer off)"))
                if res.get(k)]
        lines += [f"## Spec vs plain at synthetic tau {st.get('tau')}", "",
                  "| " + " | ".join(["concurrency", "speedup"] + [label for _, label in arms]) + " |",
                  "|---" * (2 + len(arms)) + "|"]
        for c, v in res["spec_speedup"].items():
            cells = [c, _r(v, "{:.2f}") + "x"] + [_r(res[k][c], "{:.2f}") + "x" if c in res[k] else "-" for k, _ in arms]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if res.get("context_growth"):
        cs = sorted({c for row in res["context_growth"].values() for c in row}, key=int)
        lines += ["## Decode step vs context (ms per step)", "", "| context | " + " | ".join(f"c{c}" for c in cs) + " |",
                  "|---" * (len(cs) + 1) + "|"]
        for ctx, row in res["context_growth"].items():
            lines.append(f"| {ctx} | " + " | ".join(_r(row[c]) if c in row else "-" for c in cs) + " |")
        lines.append("")
    if res.get("targets"):
        lines += ["## Issue 19 targets", "", "| figure | value | goal | must reach | holds |", "|---|---|---|---|---|"]
        for k, t in res["targets"].items():
            lines.append(f"| {k} | {t['value']:.3f} | {t['goal']} | {t['must']} | {'yes' if t['ok'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specbench.benchmarks.speed", description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/q3-4b-pair", help="the Qwen3-4B-shaped pair (built when absent)")
    ap.add_argument("--model", help="target dir (instead of --workdir)")
    ap.add_argument("--draft", help="drafter dir (with --model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype")
    ap.add_argument("--levels", default="1,8,16,32,64")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--growth-c", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--growth-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--step-context", type=int, default=512)
    ap.add_argument("--tau", type=float, default=6.5)
    ap.add_argument("--engine-kw", default="{}", help="JSON object of EngineConfig fields for both engines (A/B)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--out-dir", help="write speed.json and speed.md there")
    ap.add_argument("--no-ahead-ab", action="store_true", help="skip the decode-ahead-off arm of the levels section")
    ap.add_argument("--no-defer-ab", action="store_true",
                    help="skip the deferred-drafts-off spec arm of the levels section")
    ap.add_argument("--no-whole-ab", action="store_true",
                    help="skip the whole-graphs-off (piecewise verify / draft) spec arm of the levels section")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.new_tokens < 2 or a.growth_tokens < 2:
        raise SystemExit("--repeats must be >= 1, --new-tokens and --growth-tokens >= 2")
    try:
        engine_kw = json.loads(a.engine_kw)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--engine-kw: not JSON ({e}); expected an object such as '{{\"decode_attention\": \"flashinfer\"}}'") from None
    if not isinstance(engine_kw, dict):
        raise SystemExit("--engine-kw: expected a JSON object of EngineConfig fields")
    sections = tuple(x for x in a.sections.split(",") if x)
    if not sections or set(sections) - set(SECTIONS):
        raise SystemExit(f"--sections: expected a comma list of {', '.join(SECTIONS)}, got {a.sections!r}")
    if a.model:
        if not a.draft:
            raise SystemExit("--model needs --draft (the drafter of the pair)")
        target, draft = a.model, a.draft
    else:
        from specbench.benchmarks.spec_step import ensure_pair

        target, draft = ensure_pair(Path(a.workdir), a.device)
    d = Path(a.out_dir) if a.out_dir else None

    def save(res: dict) -> None:
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            res["targets"] = targets(res)
            (d / "speed.json").write_text(json.dumps(res, default=str) + "\n")
            (d / "speed.md").write_text(render(res) + "\n")

    levels, contexts = positive_ints(a.levels, "--levels"), positive_ints(a.contexts, "--contexts")
    res = run(target, draft, a.device, levels, contexts, a.growth_c, a.repeats, a.new_tokens,
              a.prompt_len, a.tau, a.growth_tokens, a.step_context, a.dtype, save=save, engine_kw=engine_kw,
              sections=sections, ahead_ab=not a.no_ahead_ab, whole_ab=not a.no_whole_ab,
              defer_ab=not a.no_defer_ab)
    save(res)
    print(render(res), flush=True)
    emit_document(res)
    return res


if __name__ == "__main__":
    main()
