"""Engine adapters: one contract (base.py) over the in-process engine, remote endpoints and transformers.

`EngineAdapter`, `GenRequest`, `GenResult`, `PosLogprobs`, `ScoreResult` are the types suites use;
`UnsupportedCapability` and `DecodeWindow` belong to the adapter capabilities (base.py docstring).
Adapters: `LocalAdapter` (local.py), `OpenAIAdapter` (openai_api.py), `HFAdapter` (hf.py). Build one from
an engine string with `specbench.harness.engines.build_adapter`. Heavy modules import lazily.
"""

from .base import (
    DecodeWindow,
    EngineAdapter,
    GenRequest,
    GenResult,
    PosLogprobs,
    ScoreResult,
    UnsupportedCapability,
    counters_delta,
)

__all__ = ["DecodeWindow", "EngineAdapter", "GenRequest", "GenResult", "PosLogprobs", "ScoreResult",
           "UnsupportedCapability", "counters_delta"]
