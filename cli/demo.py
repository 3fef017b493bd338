"""`specbench demo`: the main job on the bundled default (the README's first command), in three exhibits.

Each exhibit says in one sentence what it shows, times its steady state with start-up reported apart, and ends
with where its full report is:
1. generate: the bundled tiny pair with spec off and on, in this process. Start-up (building the engine, then
   its first call: lazy initialisation, caches) is timed and printed apart; the figures are the median of
   STEADY_RUNS identical calls after it.
2. lossless: the gate's default set (greedy, concurrent, the engine gates) as a subprocess of the same CLI. A verdict, not a speed figure: its wall time
   splits into start-up (the process, both engines) and the gates' own time (run.json summary wall_s).
3. sweep: a short spec-off vs spec-on sweep as a subprocess. Its figures are steady state by construction
   (warm-up waves excluded, records from the measured cells only); its wall time splits into start-up,
   warm-up and the measured cells (the cells' recorded durations).
CPU threads: the demo runs torch with --threads (default 1) in its own process and its subprocesses
(OMP_NUM_THREADS; one already set wins): the tiny pair's matrices are too small to gain from several threads, and on a
shared machine a thread that waits for a busy core stalls the others at every op (measured on the 2-core CI
kind under load: 64 tokens in 0.18 s with one thread, 0.9-6.5 s with two).
Reports go under the results store (results/reports/demo-*.md, git-ignored; `specbench report <run>` renders
a run again), never the tracked reports/. Exit code: 1 if the gate or the sweep fails.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import typer

STEADY_RUNS = 3
LOSSLESS = ["lossless", "--margin-tol", "0.20", "--num-prompts", "8", "--max-tokens", "64"]
SWEEP = ["sweep", "--concurrency", "1,4", "--prompts-per-level", "4", "--max-tokens", "48", "--rounds", "2",
         "--warmup", "1", "--dataset", "gsm8k"]
SAYS = {
    "generate": "one greedy generation with speculation off and on (the DFlash drafter): whether the text is the "
                "same, and the speed once each engine is warm.",
    "lossless": "whether speculation changes any greedy token on 8 gsm8k prompts beyond a benign tie flip (each "
                "divergence judged by its regret under the spec-off distribution), alone, batched, and under "
                "stops, aborts, penalties, logit bias, min_tokens and long contexts (the engine gates).",
    "sweep": "throughput spec on vs spec off at 1 and 4 requests in flight, with a paired noise floor (the baseline "
             "run twice, interleaved).",
}


def _header(i: int, name: str) -> None:
    typer.echo(f"\n[{i}/3] {name}: {SAYS[name]}")


def _runs(store: Path) -> set[Path]:
    return {p for p in store.iterdir() if (p / "run.json").is_file()} if store.is_dir() else set()


def _run(args: list[str], store: Path, env: dict[str, str] | None = None) -> tuple[int, float, Path | None]:
    """Run `specbench ARGS` as a subprocess; (exit code, wall s, the run folder it added to the store)."""
    typer.echo(f"$ specbench {' '.join(args)}")
    before = _runs(store)
    t0 = time.perf_counter()
    rc = subprocess.call([sys.executable, "-m", "specbench", *args], env=env)
    wall = time.perf_counter() - t0
    new = sorted(_runs(store) - before)
    return rc, wall, new[-1] if new else None


def lossless_timing(run_dir: Path | None, wall: float) -> str:
    """'wall W s = start-up S s + gates G s' from the run's recorded gate time."""
    import json

    try:
        if run_dir is None:
            raise OSError("no run folder")
        gates = float(json.loads((run_dir / "run.json").read_text())["summary"]["wall_s"])
    except (OSError, TypeError, KeyError, ValueError):
        return f"wall {wall:.1f} s (no run record to split it)"
    return f"wall {wall:.1f} s = start-up {max(0.0, wall - gates):.1f} s (the process, both engines) + gates {gates:.1f} s"


def sweep_timing(run_dir: Path | None, wall: float) -> list[str]:
    """The wall time split into start-up, warm-up and measured cells, and the steady-state figures per level."""
    from specbench.harness.results import load_stored_run
    from specbench.suites.report import load_run_summary
    from specbench.suites.report.markdown import _lv, speedup_cell

    if run_dir is None:
        return [f"wall {wall:.1f} s (no run record to split it)"]
    cells = load_stored_run(run_dir).records("cells")
    warm = sum(float(c.get("duration") or 0.0) for c in cells if c.get("warmup"))
    measured = sum(float(c.get("duration") or 0.0) for c in cells if not c.get("warmup"))
    lines = [f"wall {wall:.1f} s = start-up {max(0.0, wall - warm - measured):.1f} s (the process, the engines) + "
             f"warm-up {warm:.1f} s (excluded) + measured cells {measured:.1f} s"]
    s = load_run_summary(run_dir)
    for lv in s.levels:
        parts = []
        for a in s.compared_arms:
            c = s.get(a, lv)
            if c is None or c.tok_s_median is None:
                continue
            vs = "" if a == s.baseline else f" ({speedup_cell(s.speedups.get((a, lv)), s.noise.get(lv))} of {s.baseline})"
            parts.append(f"{a} {c.tok_s_median:.1f} tok/s{vs}")
        lines.append(f"steady state {_lv(s, lv)}: " + ", ".join(parts))
    return lines


def _generate() -> None:
    from specbench.engine import LLM, SamplingParams
    from specbench.harness.datasets import gsm8k_prompt
    from specbench.harness.fixtures import bundled_pair

    target, draft = bundled_pair()
    typer.echo(f"bundled pair: target={target}\n              draft={draft}")
    prompt = gsm8k_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                          "clips in May. How many clips did Natalia sell altogether in April and May?")
    sp = SamplingParams(max_tokens=64)
    steady: dict[str, float] = {}
    texts: dict[str, str] = {}
    for spec in ("off", "auto"):
        label = "spec off" if spec == "off" else "spec on (DFlash)"
        t0 = time.perf_counter()
        llm = LLM(str(target), draft=str(draft), spec=spec)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate([prompt], sp)
        first = time.perf_counter() - t0
        times, out = [], None
        for _ in range(STEADY_RUNS):
            t0 = time.perf_counter()
            out = llm.generate([prompt], sp)[0]
            times.append(time.perf_counter() - t0)
        assert out is not None
        dt = statistics.median(times)
        n = len(out.output_ids)
        steady[label] = n / dt
        texts[label] = out.text.strip()
        accept = out.spec.get("mean_accept_len") if isinstance(out.spec, dict) else None
        typer.echo(f"\n[{label}] start-up {built + first:.2f} s (engine build {built:.2f} s + first call {first:.2f} s)\n"
                   f"[{label}] steady state: {n} tokens in {dt:.3f} s = {n / dt:.0f} tok/s (median of {STEADY_RUNS} "
                   f"calls)" + (f", mean accepted length {accept:.2f}" if accept is not None else "")
                   + f"\n{out.text.strip()}")
    off, on = steady["spec off"], steady["spec on (DFlash)"]
    same = "the same text" if texts["spec off"] == texts["spec on (DFlash)"] else "DIFFERENT text (see exhibit 2)"
    typer.echo(f"\nspec on vs off: {on / off:.2f}x tok/s in steady state, {same}; one prompt on one CPU engine, so "
               "this is a single-request figure (exhibit 3, the sweep, measures it under load)")


def demo(
    quick: bool = typer.Option(False, "--quick", help="Only exhibit 1 (generate); skip the lossless gate and the sweep."),
    threads: int = typer.Option(1, "--threads", min=0, help="torch CPU threads in the demo and its subprocesses "
                                "(as OMP_NUM_THREADS; an OMP_NUM_THREADS already set wins; 0: torch's default, one "
                                "per core)."),
) -> None:
    """Run the main job on the bundled tiny pair: generate, the lossless gate, a short sweep (steady-state timings)."""
    import os

    import torch

    from specbench.harness.results import results_dir

    env = dict(os.environ)
    if threads and "OMP_NUM_THREADS" not in env:  # a user's OMP_NUM_THREADS wins, here (torch read it) and below
        torch.set_num_threads(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    typer.echo(f"torch CPU threads: {torch.get_num_threads()} (--threads; OMP_NUM_THREADS="
               f"{env.get('OMP_NUM_THREADS', 'unset')} in the subprocesses)")
    _header(1, "generate")
    _generate()
    if quick:
        typer.echo("\nfull report: none for --quick (exhibit 1 prints everything it measured); `specbench demo` "
                   "runs the gate and the sweep and writes their reports")
        return
    store = results_dir()
    reports = store / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    rep_gate, rep_sweep = reports / "demo-lossless.md", reports / "demo-sweep.md"
    done: list[tuple[str, int, Path, Path | None]] = []

    _header(2, "lossless")
    rc_gate, wall, run_gate = _run([*LOSSLESS, "--report", str(rep_gate)], store, env)
    typer.echo(f"[lossless] exit {rc_gate}; {lossless_timing(run_gate, wall)}; a verdict, not a speed figure")
    typer.echo(f"[lossless] full report: {rep_gate}")
    done.append(("lossless", rc_gate, rep_gate, run_gate))

    _header(3, "sweep")
    rc_sweep, wall, run_sweep = _run([*SWEEP, "--report", str(rep_sweep)], store, env)
    for line in sweep_timing(run_sweep, wall):
        typer.echo(f"[sweep] {line}")
    typer.echo(f"[sweep] full report: {rep_sweep}")
    done.append(("sweep", rc_sweep, rep_sweep, run_sweep))

    typer.echo("\nfull reports:")
    for name, rc, rep, run in done:
        typer.echo(f"  {name}: {rep} (exit {rc})" + (f"; records {run} (specbench report {run})" if run else ""))
    if rc_gate != 0 or rc_sweep != 0:
        raise typer.Exit(1)

