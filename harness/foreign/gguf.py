"""The GGUF fixtures: the tiny HF target and drafter converted (and quantized) with the vendored tools.

    <root>/<sha12>/gguf/<fixture12>/*.gguf, models.json   cached per fixture content + recipe (`ensure_models`)

`perturbed_target` (the draft-model drafter / a wrong model) and `retapped_drafter` (a DFlash drafter
llama.cpp can run) make the HF copies; `convert` runs the converter through `_convert`, `quantize`
runs llama-quantize; `Models` holds the paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .build import Build, _locked, _run_logged
from .source import _sha256

# Bump when the conversion recipe below changes: it is part of the GGUF cache key.
RECIPE = 1
PERTURB_SEED = 1234
PERTURB_SIGMA = 0.17  # noise std / tensor std: ~35% draft-model acceptance (0.1: 51%, 0.2: 29%, 0.3: 18%)
DFLASH_SAFE_TAPS = [1, 2]  # target layers the runnable DFlash copy taps (the bundled drafter taps [1, 3])

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "fixtures" / "tiny"


def dir_hash(*dirs: Path) -> str:
    """sha256 over (relative path, bytes) of every file under the given directories, in sorted order."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(q for q in Path(d).rglob("*") if q.is_file()):
            h.update(f"{d.name}/{p.relative_to(d)}\0".encode())
            h.update(_sha256(p).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Models:
    """Paths of the converted fixture GGUFs (all share the tiny target's tokenizer)."""

    dir: Path
    target_f32: Path
    target_q8_0: Path
    target_q4_0: Path
    perturbed: Path        # the target with seeded weight noise: the draft-model drafter / a wrong model
    dflash: Path           # the bundled DFlash drafter re-tapped to DFLASH_SAFE_TAPS: llama.cpp runs it
    dflash_lasttap: Path   # the bundled drafter as is (taps the last target layer): llama.cpp aborts
    info: dict = field(default_factory=dict, compare=False)


def perturbed_target(target_dir: Path, out_dir: Path, sigma: float = PERTURB_SIGMA,
                     seed: int = PERTURB_SEED) -> Path:
    """A copy of the HF target with w + sigma * std(w) * N(0, 1) on every tensor (seeded, in sorted name
    order), every other file copied: same tokenizer, a related but different model."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for p in target_dir.iterdir():
        if p.is_file() and p.name != "model.safetensors":
            shutil.copy2(p, out_dir / p.name)
    tensors = load_file(str(target_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    noisy = {}
    for name in sorted(tensors):
        w = tensors[name].float()
        scale = w.std() if w.numel() > 1 else w.abs()
        noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
        noisy[name] = (w + sigma * scale * noise).to(tensors[name].dtype).contiguous()
    save_file(noisy, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def retapped_drafter(draft_dir: Path, out_dir: Path, taps: list[int]) -> Path:
    """A copy of the DFlash drafter whose `dflash_config.target_layer_ids` is `taps` (weights unchanged:
    the context projection then sees other layers' features than it was trained on; lower acceptance)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in draft_dir.iterdir():
        if p.is_file() and p.name != "config.json":
            shutil.copy2(p, out_dir / p.name)
    cfg = json.loads((draft_dir / "config.json").read_text())
    if len(taps) != len(cfg["dflash_config"]["target_layer_ids"]):
        raise ValueError(f"taps {taps}: the drafter's fc expects {len(cfg['dflash_config']['target_layer_ids'])}")
    cfg["dflash_config"]["target_layer_ids"] = list(taps)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


def convert(build: Build, model_dir: Path, out: Path, log, target_model_dir: Path | None = None,
            outtype: str = "f32") -> Path:
    """HF dir -> GGUF with the vendored converter through the patching wrapper (`_convert`)."""
    cmd = [sys.executable, "-m", "specbench.harness.foreign._convert", "--llama-src", str(build.src),
           "--force-pre", "qwen2", "--", str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = dict(os.environ, NO_LOCAL_GGUF="1")  # gguf-py is put on sys.path by the wrapper itself
    # The wrapper module is imported from wherever specbench is; make that importable in the child.
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), pkg_parent) if p)
    _run_logged(cmd, out.parent, log, env=env)
    return out


def quantize(build: Build, src: Path, out: Path, qtype: str, log) -> Path:
    _run_logged([str(build.quantize), str(src), str(out), qtype, "1"], out.parent, log)
    return out


def ensure_models(build: Build, target_dir: Path | None = None, draft_dir: Path | None = None) -> Models:
    """Convert the fixtures once, cached under <build>/gguf/<hash12 of fixtures + recipe>/."""
    target_dir = Path(target_dir or BUNDLED / "target")
    draft_dir = Path(draft_dir or BUNDLED / "draft")
    key = hashlib.sha256(f"{dir_hash(target_dir, draft_dir)} recipe={RECIPE} sigma={PERTURB_SIGMA} "
                         f"seed={PERTURB_SEED} taps={DFLASH_SAFE_TAPS}".encode()).hexdigest()[:12]
    out = build.root / "gguf" / key
    names = {"target_f32": "target-f32.gguf", "target_q8_0": "target-q8_0.gguf",
             "target_q4_0": "target-q4_0.gguf", "perturbed": "perturbed-f32.gguf",
             "dflash": "dflash-taps12-f32.gguf", "dflash_lasttap": "dflash-lasttap-f32.gguf"}

    def models() -> Models:
        return Models(dir=out, info=json.loads((out / "models.json").read_text()),
                      **{k: out / v for k, v in names.items()})

    if (out / "models.json").is_file():
        return models()
    with _locked(build.root.parent):
        if (out / "models.json").is_file():
            return models()
        tmp = out.parent / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.monotonic()
        with open(tmp / "convert.log", "w") as log, tempfile.TemporaryDirectory() as hf_dir:
            hf = Path(hf_dir)
            convert(build, target_dir, tmp / names["target_f32"], log)
            quantize(build, tmp / names["target_f32"], tmp / names["target_q8_0"], "Q8_0", log)
            quantize(build, tmp / names["target_f32"], tmp / names["target_q4_0"], "Q4_0", log)
            convert(build, perturbed_target(target_dir, hf / "perturbed"), tmp / names["perturbed"], log)
            convert(build, retapped_drafter(draft_dir, hf / "dflash", DFLASH_SAFE_TAPS),
                    tmp / names["dflash"], log, target_model_dir=target_dir)
            convert(build, draft_dir, tmp / names["dflash_lasttap"], log, target_model_dir=target_dir)
        info = {"target_dir": str(target_dir), "draft_dir": str(draft_dir), "recipe": RECIPE,
                "perturb": {"sigma": PERTURB_SIGMA, "seed": PERTURB_SEED},
                "dflash_taps": {"dflash": DFLASH_SAFE_TAPS,
                                "dflash_lasttap": json.loads((draft_dir / "config.json").read_text())
                                ["dflash_config"]["target_layer_ids"]},
                "convert_s": round(time.monotonic() - t0, 1),
                "sha256": {k: _sha256(tmp / v) for k, v in names.items()}}
        (tmp / "models.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    return models()

