"""`specbench profile`: the reference engine's decode under the PyTorch profiler, then `gaps` on it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import typer


def profile(
    engine: str | None = typer.Option(None, "--engine", help="local:<model_dir>[,draft=<dir>] (default: the bundled pair)."),
    spec: str = typer.Option("on", "--spec", help="on or off."),
    steps: int = typer.Option(20, "--steps", min=1, help="Engine steps recorded."),
    batch: int = typer.Option(1, "--batch", min=1, help="Concurrent requests."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Output budget per request."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str | None = typer.Option(None, "--dtype", help="Default: bfloat16 on cuda, float32 on cpu."),
    eager: bool = typer.Option(True, "--eager/--graphs", help="Eager or CUDA graphs (GPU)."),
    attention: str = typer.Option("torch", "--attention", help="torch or flashinfer."),
    synthetic_tau: float | None = typer.Option(None, "--synthetic-tau", help="Synthetic acceptance (random weights)."),
    out: Path = typer.Option(Path("results/profile"), "--out", help="Directory for trace.json and the report."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document: the profile (steps, tokens, "
                                  "host ms per phase, the trace) and the gaps report (null where there is no GPU "
                                  "timeline, with the reason); the progress lines go to stderr."),
    nsys: bool = typer.Option(False, "--nsys", help="Also re-run under nsys (--cuda-graph-trace=node) when on PATH."),
) -> None:
    """Profile the reference engine's decode steps and attribute GPU idle by kernel class and phase.

    Writes OUT/trace.json (Kineto) and OUT/gaps.md + OUT/gaps.png, and prints the gaps table with phases
    (schedule, draft, verify|forward, accept, commit). Local engines only. On the CPU (--device cpu) there is no GPU
    timeline: the host time per phase is the result and the gaps part says why it is absent (exit 0); --device cuda
    where there is no CUDA GPU is CANNOT TEST (exit 3).
    """
    from specbench.engine import ConfigError
    from specbench.harness.adapters.base import UnsupportedCapability
    from specbench.harness.adapters.local import LocalAdapter
    from specbench.harness.engines import EngineStringError, bundled, parse_engine
    from specbench.harness.errors import usage_exit
    from specbench.suites import gaps as g
    from specbench.suites.gaps.profile import phase_host_times, run_profile

    if spec not in ("on", "off"):
        raise usage_exit("profile", f"--spec={spec!r} is invalid: expected on or off")
    try:
        if engine:
            es = parse_engine(engine)
            if es.kind != "local":
                raise EngineStringError(f"--engine {engine!r}: profile needs a local engine (local:<dir>)")
            target, draft = es.target or bundled()[0], es.options.get("draft")
        else:
            target, draft = bundled()
        adapter = LocalAdapter.from_dirs(target, draft=draft, spec=spec, device=device,
                                         dtype=dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
                                         synthetic_tau=synthetic_tau, eager=eager, attention_backend=attention,
                                         trace_ranges=True)
        try:
            res = run_profile(adapter, out, steps=steps, batch=batch, max_tokens=max_tokens)
        finally:
            adapter.close()
    except (EngineStringError, ConfigError, UnsupportedCapability, ValueError) as e:
        raise usage_exit("profile", str(e)) from None
    say = (lambda m: typer.echo(m, err=True)) if json_out else typer.echo  # --json: stdout is the one document
    say(f"profiled {res.steps} steps, {res.tokens} tokens in {res.seconds:.3f} s; trace {res.trace}")
    host = phase_host_times(res.trace)
    say("host time per phase (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    doc: dict = {"profile": {"steps": res.steps, "tokens": res.tokens, "seconds": res.seconds, "trace": str(res.trace),
                             "device": device, "spec": spec, "host_ms": host}, "gaps": None}
    try:
        report = g.analyze(g.read_trace(res.trace, phases=True), g.Classifier.build([]), phases=True)
    except g.GapsError as e:
        doc["gaps_missing"] = f"no GPU timeline to attribute: {e}"
        say(doc["gaps_missing"])
        if json_out:
            typer.echo(json.dumps(doc, default=str))
        return
    g.check_invariants(report)
    g.plot_idle_by_class(report, out / "gaps.png")
    (out / "gaps.md").write_text(g.render_markdown(report, plot="gaps.png"), encoding="utf-8")
    if json_out:
        doc["gaps"] = g.to_json(report)
        typer.echo(json.dumps(doc, default=str))
    else:
        typer.echo(g.render_text(report), nl=False)
    if nsys and shutil.which("nsys"):
        import subprocess

        cmd = ["nsys", "profile", "--cuda-graph-trace=node", "--trace=cuda,nvtx", "--export=sqlite", "-f", "true",
               "-o", str(out / "nsys"), sys.executable, "-m", "specbench", "profile", "--steps", str(steps),
               "--batch", str(batch), "--device", device, "--spec", spec, "--out", str(out / "under-nsys")]
        subprocess.call(cmd)
        say(f"nsys export: {out / 'nsys.sqlite'} (run `specbench gaps {out / 'nsys.sqlite'} --phases`)")
