"""Continuous batching: waiting/running queues, admission, and the step plan.

Admission promises a request its lifetime in pages (prompt + max_tokens + speculative headroom), so an
admitted request never runs out of KV mid-flight; a request whose lifetime can never fit the pool or
the context window is refused at `add` with a reason. Waiting requests are admitted FIFO while the page
budget and `max_num_seqs` allow.

A step plan is a flat list of spans: decode/verify spans for running requests first (each 1 + K tokens,
K >= 0), then prefill chunks under the remaining token budget (chunked prefill).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import EngineConfig
from .kv_cache import PagePool
from .prefix_share import PrefixSharing
from .request import Phase, Request

if TYPE_CHECKING:  # the plan is host bookkeeping: torch only names the draft probabilities' type
    import torch


class AdmissionError(ValueError):
    """A request that can never be served; the message says why and what limit applies."""


@dataclass
class Span:
    req: Request
    tokens: list[int]  # tokens fed this step: prompt chunk, [last], or [anchor, d1..dK]
    start: int  # position of tokens[0]
    kind: str  # "prefill" | "decode" | "verify"
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [K, V] draft distributions for speculative sampling (sampled drafts)
    # a decode-phase span's draft state (spec/policy.py DraftState): "spec", "gated" (draft-ready, held to one
    # token by the gate or the policy: its drafter context still advances), "not_ready" (no drafter context:
    # plain decode), "ineligible" (cannot speculate); "" for prefill chunks and runs without a proposer
    state: str = ""

    @property
    def completes_prefill(self) -> bool:
        return self.kind != "prefill" or self.start + len(self.tokens) == self.req.prompt_len

    def logit_rows(self) -> list[int]:
        """The span's token rows whose logits the step needs: a prefill chunk's last row when it completes the
        prompt, and with prompt_logprobs every row predicting a prompt token at or past prompt_logprobs_from; a
        decode span's one row; every row of a verify span."""
        n = len(self.tokens)
        if self.kind == "decode":
            return [0]
        if self.kind != "prefill":
            return list(range(n))
        p = self.req.params
        if p.prompt_logprobs is None:
            return [n - 1] if self.completes_prefill else []
        rows = list(range(max(0, p.prompt_logprobs_from - self.start - 1), n))  # row j predicts token start + j + 1
        return rows or ([n - 1] if self.completes_prefill else [])


@dataclass
class StepPlan:
    spans: list[Span]
    # greedy drafts still on the device (spec/pending.PendingDrafts; set by the propose phase, resolved before the
    # accept), or None
    pending: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.spans)

    @property
    def has_verify(self) -> bool:
        return any(s.kind == "verify" for s in self.spans)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: PagePool, max_model_len: int, spec_headroom: int) -> None:
        self.cfg = cfg
        self.pool = pool
        self.max_model_len = max_model_len
        self.headroom = spec_headroom
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix = PrefixSharing(pool)  # prefix hits at admission (the engine installs one with its counters)

    def lifetime(self, req: Request) -> int:
        return req.prompt_len + req.params.max_tokens + self.headroom

    def check(self, req: Request) -> None:
        """Refuse a request that can never be served (raises AdmissionError naming the limit)."""
        if req.prompt_len == 0:
            raise AdmissionError("prompt is empty: at least one token is required")
        total = req.prompt_len + req.params.max_tokens
        if total > self.max_model_len:
            raise AdmissionError(
                f"this model's usable context is {self.max_model_len} tokens"
                + (f" (max_position_embeddings minus the drafter's block of {self.headroom})" if self.headroom else "")
                + f"; the request needs {total} ({req.prompt_len} prompt + {req.params.max_tokens} max_tokens)")
        if not self.pool.fits_ever(self.lifetime(req)):
            raise AdmissionError(f"the request needs {self.lifetime(req)} KV slots but the whole pool has "
                                 f"{self.pool.num_pages * self.pool.page_size}")

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def abort(self, rid: str) -> Request | None:
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            hit = self.prefix.lookup(req)  # cached pages of its prompt prefix (engine/prefix_share.py)
            if not self.pool.can_admit(self.lifetime(req), hit):
                break
            self.waiting.popleft()
            self.pool.admit(req.rid, self.lifetime(req), hit, req.params.cache_salt)
            self.prefix.admitted(req, hit)
            req.phase = Phase.RUNNING
            self.running.append(req)

    def schedule(self, draft_len: dict[str, int], states: dict[str, str] | None = None) -> StepPlan:
        """`draft_len[rid]` is how many drafts a decode-phase request will carry (0 = plain decode);
        `states[rid]` its draft state (Span.state: gated is told apart from not ready)."""
        self._admit()
        budget = self.cfg.max_num_batched_tokens
        spans: list[Span] = []
        for req in self.running:
            if req.in_prefill:
                continue
            k = draft_len.get(req.rid, 0)
            n = 1 + k
            if n > budget and spans:
                continue  # next step; always make progress with at least one span
            last = req.token_at(req.num_computed)
            spans.append(Span(req, [last], req.num_computed, "verify" if k else "decode",
                              state=states.get(req.rid, "") if states else ""))
            budget -= n
        for req in self.running:
            if not req.in_prefill or budget <= 0:
                continue
            chunk = min(req.prompt_len - req.num_computed, budget)
            spans.append(Span(req, req.prompt_ids[req.num_computed:req.num_computed + chunk], req.num_computed,
                              "prefill"))
            budget -= chunk
        return StepPlan(spans)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.pool.free(req.rid)
