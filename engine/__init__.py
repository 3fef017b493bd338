"""The reference engine: a Qwen3 target (+ DFlash drafter) over a paged KV cache.

Public API: `LLM`, `LLMEngine`, `SamplingParams`, `EngineConfig`, `SpecConfig`, `RequestOutput`.
This package imports nothing from specbench.harness or specbench.suites. Importing it (or `engine.config`)
imports no torch: the configuration names are here at once, the names that need torch (`LLM`, `LLMEngine`,
`RequestOutput`, `AdmissionError`) are imported on first use (PEP 562 `__getattr__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpecConfig

if TYPE_CHECKING:
    from .engine import AdmissionError, LLMEngine, RequestOutput
    from .llm import LLM

# name -> the submodule that defines it (imported, with torch, when the name is first asked for)
_LAZY = {"LLM": ".llm", "LLMEngine": ".engine", "RequestOutput": ".engine", "AdmissionError": ".engine"}

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "SpecConfig", "ModelConfig", "RequestOutput",
           "ConfigError", "AdmissionError"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
