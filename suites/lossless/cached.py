"""A deterministic baseline's generations memoised by request: the self-test (one baseline for every fault) and the
levers gate (one baseline for every lever variant) ask it the same requests again."""

from __future__ import annotations

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, ScoreResult


class CachedAdapter(EngineAdapter):
    """A deterministic baseline's generations, memoised by request (scores and the rest pass through)."""

    kind = "cached"

    def __init__(self, inner: EngineAdapter) -> None:
        super().__init__(inner.name)
        self.inner = inner
        self.cache: dict[tuple, GenResult] = {}
        self.hits = 0

    async def generate_one(self, req: GenRequest) -> GenResult:
        key = (tuple(req.prompt) if isinstance(req.prompt, list) else req.prompt, req.max_tokens, req.logprobs,
               tuple(req.stop), tuple(req.stop_token_ids), req.temperature, req.ignore_eos, req.repetition_penalty,
               req.presence_penalty, req.frequency_penalty, tuple(sorted((req.logit_bias or {}).items())),
               req.min_tokens)
        hit = self.cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        res = (await self.inner.generate([req], concurrency=1))[0]
        if res.ok:
            self.cache[key] = res
        return res

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        return await self.inner.score(prompt_ids, continuation_ids, top_k)

    async def tokenize(self, text: str) -> list[int] | None:
        return await self.inner.tokenize(text)

    async def spec_counters(self) -> dict | None:
        return await self.inner.spec_counters()

    def describe(self) -> dict:
        return self.inner.describe()

    async def aclose(self) -> None:
        await self.inner.aclose()
