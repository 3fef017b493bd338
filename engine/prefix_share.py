"""The engine side of prefix caching: a request's hit at admission, and sealing its blocks after each commit.

Contract:
- `lookup(req)` (scheduler admission): the cached pages of the request's longest registered prompt prefix
  in full blocks, at most prompt_len - 1 tokens (the last prompt token is always forwarded: its logits
  pick the first token); none for a request that wants prompt logprobs (it needs every prompt row) or
  without a prefix cache. Keys derive from `SamplingParams.cache_salt` (vLLM's `cache_salt`): requests
  share blocks only under equal salts; `SamplingParams.prompt_cache=False` takes no hit and registers
  nothing (a gate's cold request).
- `admitted(req, pages)`: the request's committed length starts at the hit's end (`num_computed`,
  `cached_tokens`); the queries / hits counters take the prompt's tokens and the hit's (vLLM's
  `prefix_cache_queries` / `prefix_cache_hits`, in tokens), and the hit's tokens count as prompt tokens
  (`vllm:prompt_tokens_total` is every prompt token, cached or computed, as in vLLM). With a drafter, a hit whose every block keeps
  its capture restores the drafter's context to the hit length (`Proposer.restore`), so the first draft
  round after the prefill drafts (a capture hit); otherwise (a capture miss) the KV hit is kept and the
  request decodes without drafts for its lifetime (`Request.capture_fallback`; the DFlash drafter attends
  to its whole context, so it never has context again), counted in `capture_fallbacks`.
- `seal(req, ahead, publish)` (commit, after every span, finished requests included, before their pages
  are freed: publish on finish): registers the request's full blocks inside its committed length, each
  captured when the drafter's context rows cover it. `ahead` > 0 (the register_before_forward fault) also
  counts the request's last `ahead` tokens, whose KV the next forward has not written yet; `publish=False`
  (the no_publish_on_finish fault, for a request finishing this step) registers them without a capture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_cache import PagePool
    from .metrics import EngineMetrics
    from .request import Request
    from .spec.proposer import Proposer


class PrefixSharing:
    def __init__(self, pool: PagePool, metrics: EngineMetrics | None = None, drafter: bool = False) -> None:
        """drafter: the proposer keeps per-position context (DFlash), so blocks carry a capture."""
        self.pool, self.metrics, self.drafter = pool, metrics, drafter
        self.proposer: Proposer | None = None  # set by the engine once the proposer exists

    @property
    def enabled(self) -> bool:
        return self.pool.prefix is not None

    def lookup(self, req: Request) -> list[int]:
        if self.pool.prefix is None or req.params.prompt_logprobs is not None or not req.params.prompt_cache:
            return []
        return self.pool.lookup(req.prompt_ids, req.params.cache_salt)

    def admitted(self, req: Request, pages: list[int]) -> None:
        n = len(pages) * self.pool.page_size
        req.num_computed = req.cached_tokens = n
        m = self.metrics
        if m is not None and self.pool.prefix is not None and req.params.prompt_logprobs is None \
                and req.params.prompt_cache:
            m.prefix_queries += req.prompt_len
            m.prefix_hits += n
            m.prompt_tokens += n  # vLLM's prompt_tokens counts every prompt token, cached ones included
        if not pages or self.proposer is None:
            return
        prefix = self.pool.prefix
        assert prefix is not None
        captured = not self.drafter or prefix.captured_prefix(pages) == len(pages)
        if captured:
            prefix.touch(pages)
        self.proposer.restore(req, n, captured)
        if self.drafter:
            req.capture_fallback = not captured
            if m is not None:
                if captured:
                    m.capture_hits += 1
                else:
                    m.capture_fallbacks += 1

    def seal(self, req: Request, ahead: int = 0, publish: bool = True) -> None:
        if self.pool.prefix is None or req.rid not in self.pool or not req.params.prompt_cache:
            return
        ps = self.pool.page_size
        if min(req.num_computed + ahead, req.num_tokens) // ps <= len(self.pool.entry_keys(req.rid)):
            return  # no new full block (most steps): no token list built, nothing hashed
        captured: int | None = None
        if self.drafter:
            ctx = self.proposer.context(req.rid) if self.proposer is not None and publish else None
            captured = ctx[0] if ctx is not None and ctx[0] == ctx[1] else 0
        self.pool.seal(req.rid, req.all_ids, req.num_computed + ahead, captured)
