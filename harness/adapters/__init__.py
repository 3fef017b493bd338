"""Engine adapters: one contract (base.py) over the in-process engine, remote endpoints and transformers.

`EngineAdapter`, `GenRequest`, `GenResult`, `PosLogprobs`, `ScoreResult` are the types suites use.
Adapters: `LocalAdapter` (local.py), `OpenAIAdapter` (openai_api.py), `HFAdapter` (hf.py). Build one from
an engine string with `specbench.harness.engines.build_adapter`. Heavy modules import lazily.
"""

from .base import EngineAdapter, GenRequest, GenResult, PosLogprobs, ScoreResult, counters_delta

__all__ = ["EngineAdapter", "GenRequest", "GenResult", "PosLogprobs", "ScoreResult", "counters_delta"]
