"""Teardown: an engine's memory given back at `close()` (or `del llm`) without waiting for the cycle collector.

The engine's parts refer to each other (the commit step holds the engine's release callback, the proposer the
engine's generators, graph runners their runner and its buffers), so dropping the last outside reference
leaves cycles that hold the weights, the KV pool and the captured graphs until `gc.collect()` happens to run:
on the H200 that kept ~126 GiB alive and refused a second engine in the same process (issue 19).

Contract: `dismantle(root, keep)` walks every object reachable from `root` through attributes, lists, tuples,
sets and dict values whose class is defined in this package (engine/, kernels/) or is a torch `nn.Module`,
and empties each one's `__dict__` after the walk (not those our modules hold at module level, such as
`NO_FAULTS`: every engine shares them) (containers are left alone: a user may share them), so no
cycle through them survives and plain reference counting frees every tensor they held. Objects of the
classes in `keep` (what a user may still hold and reuse: the tokenizer, configs, sampling params, outputs)
are neither walked nor emptied. A dismantled engine is unusable: `LLMEngine.step`
raises `EngineClosed`. tests/test_teardown.py checks, with the cycle collector off, that after `close()` /
`del llm` no weight, KV page or engine part is alive.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

OURS = ("specbench.engine", "specbench.kernels", "engine.", "kernels.")


class EngineClosed(RuntimeError):
    pass


def _keep_at_close() -> tuple[type, ...]:
    from .config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
    from .output import RequestOutput
    from .tokenizer import Tokenizer

    return (Tokenizer, EngineConfig, SpecConfig, SamplingParams, ModelConfig, RequestOutput)


def _ours(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith(OURS) or isinstance(obj, torch.nn.Module)


def _module_level() -> set[int]:
    """Objects our modules hold at module level (singletons such as faults.NO_FAULTS, registries): shared by
    every engine in the process, so never emptied."""
    out: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(OURS):
            continue
        for v in list(vars(mod).values()):
            out.add(id(v))
            if isinstance(v, (list, tuple, set, frozenset)):
                out.update(id(x) for x in v)
            elif isinstance(v, dict):
                out.update(id(x) for x in v.values())
    return out


def dismantle(root: Any, keep: tuple[type, ...] = ()) -> int:
    """Empty every package object reachable from root (root included); returns how many were emptied."""
    seen: set[int] = _module_level()
    order: list[Any] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, keep):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif _ours(obj) and hasattr(obj, "__dict__"):
            order.append(obj)
            stack.extend(vars(obj).values())
    for obj in order:
        vars(obj).clear()
    return len(order)


KEEP_AT_CLOSE = _keep_at_close()
