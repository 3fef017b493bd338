"""The vLLM-style front door: `LLM(model, draft=None, device=..., dtype=...)` and `LLM.generate`.

`spec` picks speculation: "dflash" (default when a drafter is given), "ngram", or None/"off".
"""

from __future__ import annotations

from .config import EngineConfig, SamplingParams, SpecConfig
from .engine import LLMEngine, RequestOutput
from .spec.plan import spec_method
from .spec.proposer import Proposer


class LLM:
    def __init__(self, model: str, draft: str | None = None, device: str = "cpu", dtype: str = "float32",
                 spec: str | None = "auto", num_speculative_tokens: int | None = None,
                 batched_draft: bool = True, proposer: Proposer | None = None, synthetic_tau: float | None = None,
                 spec_sampling: bool = True, **engine_kw) -> None:
        spec_cfg = SpecConfig(method=spec_method(spec, draft), num_speculative_tokens=num_speculative_tokens,
                              batched_draft=batched_draft, synthetic_tau=synthetic_tau, sampling=spec_sampling)
        self.engine = LLMEngine(EngineConfig(model=str(model), draft=str(draft) if draft else None, device=device,
                                             dtype=dtype, spec=spec_cfg, **engine_kw), proposer=proposer)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.engine.generate(prompts, params)
