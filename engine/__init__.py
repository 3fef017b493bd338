"""The reference engine: a Qwen3 target (+ DFlash drafter) over a paged KV cache.

Public API: `LLM`, `LLMEngine`, `SamplingParams`, `EngineConfig`, `SpecConfig`, `RequestOutput`.
This package imports nothing from specbench.harness or specbench.suites.
"""

from .config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from .engine import AdmissionError, LLMEngine, RequestOutput
from .llm import LLM

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "SpecConfig", "ModelConfig", "RequestOutput",
           "ConfigError", "AdmissionError"]
