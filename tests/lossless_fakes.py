"""A fake engine for the lossless tests: a tiny deterministic 'language model' behind the adapter contract.

The model: after context `ids`, the greedy token is nxt = (3 * ids[-1] + 1) % V with logprob -0.05; the
runner-up alt = (nxt + 1) % V sits `gap(len(ids))` nat lower (default 3.0: a clear choice; the tests set
small gaps at chosen lengths to make near-ties); a third token sits at -4.0 and every other at -9.0.
A candidate `FakeAdapter` may be given `picks={len(ids): token}`: at those context lengths it emits that
token instead of the greedy one, and then continues greedily from its own context, the way a real
engine continues after a flip. `swap={len(ids), ...}`: at those context lengths the engine's own greedy
token and runner-up trade logprobs (its logits perturbed, as another reduction order perturbs them): it
picks the runner-up and reports it as its top-1, a self-consistent engine that flips at a near-tie.
"""

from __future__ import annotations

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, PosLogprobs, ScoreResult

V = 32


def dist(ids: list[int], gaps: dict[int, float]) -> dict[int, float]:
    nxt = (3 * ids[-1] + 1) % V
    alt = (nxt + 1) % V
    third = (nxt + 2) % V
    out = {t: -9.0 for t in range(V)}
    out[nxt], out[alt], out[third] = -0.05, -0.05 - gaps.get(len(ids), 3.0), -4.0
    return out


def top(d: dict[int, float], k: int) -> dict[int, float]:
    return dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:k])


class FakeAdapter(EngineAdapter):
    kind = "fake"

    def __init__(self, gaps: dict[int, float] | None = None, picks: dict[int, int] | None = None,
                 eos: int | None = None, stop_at: dict[int, int] | None = None, name: str = "fake",
                 can_score: bool = True, swap: set[int] | frozenset[int] = frozenset()) -> None:
        super().__init__(name)
        self.gaps = gaps or {}
        self.swap = frozenset(swap)
        self.picks = picks or {}
        self.eos = eos
        self.stop_at = stop_at or {}  # prompt length -> number of tokens after which to stop (finish "stop")
        self.can_score = can_score
        self.requests: list[GenRequest] = []
        self.scored: list[list[int]] = []

    async def generate_one(self, req: GenRequest) -> GenResult:
        self.requests.append(req)
        ids = list(req.prompt)  # type: ignore[arg-type]
        n0 = len(ids)
        out: list[int] = []
        lps: list[PosLogprobs] = []
        finish = "length"
        while len(out) < req.max_tokens:
            total = n0 + len(out)
            if total in self.stop_at:
                finish = "stop"
                break
            d = self.dist(ids)
            t = self.picks.get(total, max(d, key=lambda x: (d[x], -x)))
            out.append(t)
            ids.append(t)
            if req.logprobs is not None:
                lps.append(PosLogprobs(t, d[t], top(d, req.logprobs)))
        return GenResult(rid=self._rid(req), ok=True, output_ids=out, finish_reason=finish,
                         prompt_tokens=n0, completion_tokens=len(out),
                         logprobs=lps if req.logprobs is not None else None,
                         spec={"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                               "accepted_per_pos": [3, 2, 1]})

    def dist(self, ids: list[int]) -> dict[int, float]:
        """This engine's distribution after `ids`: the model's, with top-1 and runner-up traded where `swap` says."""
        d = dist(ids, self.gaps)
        if len(ids) in self.swap:
            nxt = (3 * ids[-1] + 1) % V
            alt = (nxt + 1) % V
            d[nxt], d[alt] = d[alt], d[nxt]
        return d

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        if not self.can_score:
            return None
        self.scored.append(list(prompt_ids) + list(continuation_ids))
        ids = list(prompt_ids)
        pos = []
        for t in continuation_ids:
            d = self.dist(ids)
            pos.append(PosLogprobs(t, d[t], top(d, top_k)))
            ids.append(t)
        return ScoreResult(pos)

    async def tokenize(self, text: str) -> list[int] | None:
        return [ord(c) % V for c in text]

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "version": "0", "model": None, "config": {"k": 3}}
