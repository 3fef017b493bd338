"""`specbench demo`: the main job on the bundled default (the README's first command).

Generates from the bundled tiny pair (spec off and on), then runs the lossless gate and a short sweep
as subprocesses of the same CLI, and prints where the reports are. Exit code: 1 if a gate fails.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import typer

LOSSLESS = ["lossless", "--margin-tol", "0.20", "--num-prompts", "8", "--max-tokens", "64",
            "--report", "reports/demo-lossless.md"]
SWEEP = ["sweep", "--concurrency", "1,4", "--prompts-per-level", "4", "--max-tokens", "48", "--rounds", "2",
         "--warmup", "1", "--dataset", "gsm8k", "--report", "reports/demo-sweep.md"]


def _run(args: list[str]) -> int:
    typer.echo(f"\n$ specbench {' '.join(args)}")
    return subprocess.call([sys.executable, "-m", "specbench", *args])


def demo(
    quick: bool = typer.Option(False, "--quick", help="Only generate; skip the lossless gate and the sweep."),
) -> None:
    """Run the main job on the bundled tiny pair: generate, the lossless gate, a short sweep."""
    from specbench.engine import LLM, SamplingParams
    from specbench.harness.datasets import gsm8k_prompt
    from specbench.harness.fixtures import bundled_pair

    target, draft = bundled_pair()
    typer.echo(f"bundled pair: target={target}\n              draft={draft}")
    prompt = gsm8k_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                          "clips in May. How many clips did Natalia sell altogether in April and May?")
    sp = SamplingParams(max_tokens=64)
    for spec in ("off", "auto"):
        llm = LLM(str(target), draft=str(draft), spec=spec)
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp)[0]
        dt = time.perf_counter() - t0
        label = "spec off" if spec == "off" else "spec on (DFlash)"
        typer.echo(f"\n[{label}] {len(out.output_ids)} tokens in {dt:.2f} s, "
                   f"mean accepted length {out.spec['mean_accept_len']:.2f}\n{out.text.strip()}")
    if quick:
        return
    Path("reports").mkdir(exist_ok=True)
    rc_gate = _run(LOSSLESS)
    rc_sweep = _run(SWEEP)
    typer.echo(f"\nreports: reports/demo-lossless.md (gate exit {rc_gate}), reports/demo-sweep.md (sweep exit {rc_sweep})")
    if rc_gate != 0 or rc_sweep != 0:
        raise typer.Exit(1)
