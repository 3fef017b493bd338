"""`specbench bench-decode`: the decode benchmark (benchmarks/decode.py) from the CLI.

Contract: thin. The benchmark lives in the source tree's benchmarks/ folder (it is a script, not part of the
installed package); this command loads it from the checkout the package was installed from (an editable
install) and exits 2 with a clear message where that folder is absent. Exit 2 also on a bad option value.
`emit_document` is the benchmarks' shared output contract (their JSON document as the last stdout line).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import typer


def emit_document(res: dict, out: str | Path | None = None) -> str:
    """Print a benchmark's JSON document as the last stdout line; with `out`, also write it there."""
    doc = json.dumps(res, default=str)
    if out:
        Path(out).write_text(doc + "\n")
    print(doc)
    return doc


def load_benchmark(name: str = "decode") -> ModuleType:
    """benchmarks/<name>.py of the checkout this package runs from."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: benchmarks run from a source checkout (pip install -e .)")
    spec = importlib.util.spec_from_file_location(f"specbench_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_decode(
    model: str | None = typer.Option(None, "--model", help="Qwen3 checkpoint dir (default: build the Qwen3-4B-shaped random one)."),
    batches: str = typer.Option("1,8,16,32,64", "--batches", help="Comma-separated batch sizes."),
    contexts: str = typer.Option("512,2048", "--contexts", help="Comma-separated context lengths."),
    variants: str | None = typer.Option(None, "--variants", help="Comma-separated subset of the variants (default: all)."),
    workdir: str | None = typer.Option(None, "--workdir", help="Where to build the random checkpoint."),
    out: str | None = typer.Option(None, "--out", help="Also write the JSON document to this file."),
    no_hf: bool = typer.Option(False, "--no-hf", help="Skip the HF transformers peer."),
    quick: bool = typer.Option(False, "--quick", help="Batches 1,16 and context 512 only."),
) -> None:
    """Decode step time on the GPU vs the dense (cuBLAS graph) and bandwidth floors; table, then JSON.

    Variants: FlashInfer (tensor-core, CUDA-core) vs split-K Triton decode vs torch attention, CUDA graphs vs
    eager, the one-row GEMVs and the Triton kernels on/off (benchmarks/decode.py lists them).
    Needs a CUDA GPU with flashinfer-python and triton (see docs/gpu.md).
    """
    try:
        mod = load_benchmark("decode")
    except FileNotFoundError as e:
        typer.echo(f"specbench bench-decode: {e}", err=True)
        raise typer.Exit(2) from None
    argv = ["--batches", batches, "--contexts", contexts]
    for flag, val in (("--model", model), ("--variants", variants), ("--workdir", workdir), ("--out", out)):
        if val:
            argv += [flag, val]
    argv += ["--no-hf"] if no_hf else []
    argv += ["--quick"] if quick else []
    try:
        mod.main(argv)
    except ValueError as e:
        typer.echo(f"specbench bench-decode: {e}", err=True)
        raise typer.Exit(2) from None
