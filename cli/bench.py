"""`specbench bench-decode`: the decode benchmark (benchmarks/decode.py) from the CLI.

Contract: thin. The benchmark is the importable module `specbench.benchmarks.decode` (also runnable as
`python -m specbench.benchmarks.decode`); this command parses options and calls it. Exit 2 on a bad option
value. The JSON-last-line contract is harness/benchdoc.py.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import typer

from specbench.harness.errors import usage_exit


def load_benchmark(name: str = "decode") -> ModuleType:
    """The benchmark module `specbench.benchmarks.<name>` (benchmarks/<name>.py)."""
    return importlib.import_module(f"specbench.benchmarks.{name}")


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
    mod = load_benchmark("decode")
    argv = ["--batches", batches, "--contexts", contexts]
    for flag, val in (("--model", model), ("--variants", variants), ("--workdir", workdir), ("--out", out)):
        if val:
            argv += [flag, val]
    argv += ["--no-hf"] if no_hf else []
    argv += ["--quick"] if quick else []
    try:
        mod.main(argv)
    except ValueError as e:
        raise usage_exit("bench-decode", str(e)) from None
