"""The vLLM-style front door: `LLM(model, draft=None, device=..., dtype=...)` and `LLM.generate`.

`spec` picks speculation by the one spec-method rule (config.py `spec_method`): "auto" or None (the default:
dflash when a drafter is given, else off), "on" (dflash with a drafter, else ngram), "off", "dflash" or "ngram";
`spec_gate`, `spec_trim`, `spec_policy` the load-aware levers (spec/policy.py).
"""

from __future__ import annotations

import sys

from .config import EngineConfig, SamplingParams, SpecConfig, engine_method, lever_kw, spec_method
from .engine import LLMEngine, RequestOutput
from .spec.proposer import Proposer


class LLM:
    def __init__(self, model: str, draft: str | None = None, device: str = "cpu", dtype: str = "float32",
                 spec: str | None = "auto", num_speculative_tokens: int | None = None,
                 batched_draft: bool = True, proposer: Proposer | None = None, synthetic_tau: float | None = None,
                 spec_sampling: bool = True, spec_gate: int | None = None, spec_trim: int | None = None,
                 spec_policy: str | None = None, spec_logprobs: bool | None = None, **engine_kw) -> None:
        """spec_gate / spec_trim / spec_policy: the load-aware levers (SpecConfig.gate / trim / policy; None =
        from SPECBENCH_SPEC_GATE / _TRIM / _POLICY, unset = off); spec_logprobs: logprobs requests speculate
        (SpecConfig.logprobs; None = SPECBENCH_SPEC_LOGPROBS, unset = on)."""
        self._engine = LLMEngine(self.config(model, draft, device, dtype, spec, num_speculative_tokens, batched_draft,
                                             synthetic_tau, spec_sampling, spec_gate, spec_trim, spec_policy,
                                             spec_logprobs, **engine_kw), proposer=proposer)
        self._exposed = False  # someone took `.engine` out: `del llm` must not close what they still hold
        self.tokenizer = self._engine.tokenizer

    @staticmethod
    def config(model: str, draft: str | None = None, device: str = "cpu", dtype: str = "float32",
               spec: str | None = "auto", num_speculative_tokens: int | None = None, batched_draft: bool = True,
               synthetic_tau: float | None = None, spec_sampling: bool = True, spec_gate: int | None = None,
               spec_trim: int | None = None, spec_policy: str | None = None, spec_logprobs: bool | None = None,
               **engine_kw) -> EngineConfig:
        """The `EngineConfig` an `LLM(...)` with these arguments builds its engine from (an engine process is
        built from a config, not from an engine)."""
        levers = lever_kw(spec_gate, spec_trim, spec_policy)
        if spec_logprobs is not None:
            levers["logprobs"] = spec_logprobs
        spec_cfg = SpecConfig(method=engine_method(spec_method(spec, draft)), num_speculative_tokens=num_speculative_tokens,
                              batched_draft=batched_draft, synthetic_tau=synthetic_tau, sampling=spec_sampling,
                              **levers)
        return EngineConfig(model=str(model), draft=str(draft) if draft else None, device=device, dtype=dtype,
                            spec=spec_cfg, **engine_kw)

    @property
    def engine(self) -> LLMEngine:
        """The LLMEngine underneath. Taking it out (`eng = LLM(...).engine`) keeps it alive past the LLM: `del
        llm` then leaves it open (close it with `eng.close()`), where an LLM never asked for it closes at del."""
        self._exposed = True
        return self._engine

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        return self._engine.generate(prompts, params)

    def close(self) -> None:
        """Give the engine's memory back now (weights, KV pool, graphs; engine/teardown.py). Also at `del llm`
        and at the end of a `with LLM(...) as llm:` block. The LLM is unusable after."""
        engine = self.__dict__.get("_engine")
        if engine is not None:
            engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing() or self.__dict__.get("_exposed", True):  # at interpreter exit CUDA may be torn
            return  # down already (closing then segfaulted); an engine taken out is its holder's to close
        try:
            self.close()
        except Exception:  # a half-built LLM (its constructor raised) has nothing to close
            pass
