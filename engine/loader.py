"""Checkpoint weights: safetensors (single file or sharded index) by HF tensor names (config.json is
config.py's `ModelConfig.from_dir`).

The same code loads the tiny fixtures, the Qwen3-4B-shaped random pair and real checkpoints. Errors name
the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"dtype={name!r} is invalid: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def weight_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: malformed sharded index ({e})") from e
        files = sorted({d / f for f in wm.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(d.glob("*.safetensors"))
    if others:
        return others
    raise ConfigError(f"{d}: no weights found (expected model.safetensors or model.safetensors.index.json)")


class Checkpoint(dict[str, torch.Tensor]):
    """The tensors of a checkpoint by name, remembering which ones `take` handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: set[str] = set()


def unused(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names `take` never handed out (sorted); empty for a plain dict."""
    taken = getattr(tensors, "taken", None)
    return [] if taken is None else sorted(set(tensors) - taken)


def load_tensors(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                 strip_prefix: str = "") -> dict[str, torch.Tensor]:
    out = Checkpoint()
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                key = name[len(strip_prefix):] if strip_prefix and name.startswith(strip_prefix) else name
                out[key] = fh.get_tensor(name).to(device=device, dtype=dtype)
    return out


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(f"{source}: tensor {name!r} is missing from the checkpoint")
    t = tensors[name]
    if isinstance(tensors, Checkpoint):
        tensors.taken.add(name)
    if tuple(t.shape) != tuple(shape):
        raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t
