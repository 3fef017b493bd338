"""`specbench fixtures`: build the tiny Qwen3 + DFlash pair, or the random Qwen3-4B-shaped pair.

Contract: writes OUT/target and OUT/draft (and OUT/BUILD.json for the tiny pair) and prints their
paths; exit code 0 on success, 2 on bad usage (an unknown --shape or --device), 3 where --device names a CUDA GPU this
machine lacks (CANNOT TEST).
"""

from __future__ import annotations

from pathlib import Path

import typer

SHAPES = ("tiny", "qwen3-4b")


def fixtures(
    out: Path = typer.Option(..., "--out", help="Output directory; DIR/target and DIR/draft are (re)written."),
    seed: int = typer.Option(0, "--seed", help="Seed for every random draw (same seed, same bytes)."),
    shape: str = typer.Option("tiny", "--shape", help="tiny or qwen3-4b"),
    device: str = typer.Option("cpu", "--device", help="Where qwen3-4b weights are drawn (cpu or cuda); "
                                                       "the tiny pair always trains on CPU."),
    dflash2: bool = typer.Option(False, "--dflash2", help="qwen3-4b only: also write DIR/draft-dflash2, a random "
                                                          "DFlash2 drafter at the same geometry (for timing)."),
) -> None:
    """Build model fixtures into DIR/target and DIR/draft.

    tiny (default): a 4-layer Qwen3 target trained briefly on bundled gsm8k text,
    plus a DFlash drafter (block 8) distilled on the target's own greedy output.
    A few minutes on 2 CPU cores; DIR/BUILD.json records the measured acceptance.

    qwen3-4b: random bf16 weights with exactly the configs and tensor shapes of
    Qwen3-4B and Qwen3-4B-DFlash-b16 (about 9 GB), for speed work on a GPU.
    With --dflash2, also DIR/draft-dflash2: a random DFlash2 drafter of that shape.
    """
    from specbench.engine.config import require_device
    from specbench.harness.errors import usage_exit

    if shape not in SHAPES:
        raise usage_exit("fixtures", f"--shape={shape!r} is invalid: expected one of {', '.join(SHAPES)}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise usage_exit("fixtures", f"--device={device!r} is invalid: expected cpu or cuda[:N]")
    require_device(device, f"--device={device!r}")  # no CUDA here: CANNOT TEST, exit 3 (cli/app.py)
    from specbench.harness.fixtures import build_qwen3_4b_shape, build_tiny_pair

    if shape == "tiny":
        tdir, ddir = build_tiny_pair(out, seed=seed, log=typer.echo)
    else:
        tdir, ddir = build_qwen3_4b_shape(out, seed=seed, device=device)
    typer.echo(f"target: {tdir}")
    typer.echo(f"draft:  {ddir}")
    if dflash2 and shape == "qwen3-4b":
        from specbench.harness.fixtures.shape4b_dflash2 import build_qwen3_4b_dflash2

        typer.echo(f"draft-dflash2: {build_qwen3_4b_dflash2(out / 'draft-dflash2', seed=seed, device=device)}")
