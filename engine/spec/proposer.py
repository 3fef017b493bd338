"""The proposer interface and the two weight-free proposers (n-gram / prompt lookup, and the oracle).

A proposer fills `span.drafts` for decode-phase requests before the target's verify forward and may
observe the committed rows afterwards. The draft/verify boundary is a token span: hidden states (if a
proposer uses any) stay inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..request import Request
from ..scheduler import Span


class Proposer:
    name = "base"
    tap_layers: tuple[int, ...] = ()
    # Positions one draft pass writes past the committed length (a block drafter's scratch); None: none
    # beyond the verify span. The run's headroom derives from it (spec/plan.py).
    block: int | None = None
    defers = False  # whether propose takes defer=True (greedy drafts left on the device: spec/pending.py)

    def __init__(self, k: int) -> None:
        self.k = k
        self.generators: dict[str, torch.Generator] = {}  # set by the engine: per-request RNGs

    def ready(self, req: Request) -> bool:
        return True

    def propose(self, spans: list[Span], ks: list[int], tile_starts: bool = False) -> Any:
        """Fill each span's drafts (at most ks[i]). `tile_starts`: a batched block draft lays out its
        positions from the request starts tiled instead of repeated per row (only the self-test sets it;
        proposers without block positions ignore it). Returns None, or (a proposer that `defers`, asked to) the
        spec/pending.PendingDrafts of drafts left on the device."""
        raise NotImplementedError

    def observe(self, spans: list[Span], committed: list[int], taps: torch.Tensor | None,
                eligible: list[bool], ctx_shift: int = 0) -> None:
        """Called after every target forward with the rows each span committed. `ctx_shift` > 0 writes a
        proposer's per-position context that many positions late (only the self-test sets it)."""

    def release(self, req: Request) -> None:
        """The request finished or was aborted."""

    def restore(self, req: Request, n: int, captured: bool) -> None:
        """A prefix hit gave the request the KV of positions [0, n) (engine/prefix_share.py). `captured`: the
        cached blocks also carry this proposer's context for them, so it has context up to n (the first
        draft round after the prefill drafts); otherwise the request never drafts (a capture miss). A proposer
        without per-position context has nothing to restore."""

    def context(self, rid: str) -> tuple[int, int] | None:
        """A proposer with per-position context (the DFlash drafter's K/V rows): (the context length it
        tracks, one past the last position its rows were written at), both 0 before any; None for a
        proposer that keeps none (n-gram, oracle). engine/invariants.py holds both to the request's
        committed length after every step."""
        return None


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix n-gram
    (ngram_max down to ngram_min) and propose the tokens that followed it.

    `mix` > 0 (sampled requests only): a soft q. Draft i is drawn, with the request's generator, from
    q_i = (1 - mix) one_hot(g_i) + mix * f_i, where g_i is the lookup's next token after the context and
    drafts 0..i-1, and f_i the token frequencies of that context; q_i goes to the accept as `draft_probs`.
    Its rows differ per position and are not one-hot, so the accept's q indexing and residuals are
    exercised, while the acceptance stays the lookup's (high on prompts that repeat the target's text)."""

    name = "ngram"

    def __init__(self, k: int, nmin: int = 1, nmax: int = 4, mix: float = 0.0, vocab_size: int | None = None) -> None:
        super().__init__(k)
        self.nmin, self.nmax, self.mix, self.vocab = nmin, nmax, float(mix), vocab_size

    def lookup(self, ids: list[int], k: int) -> list[int]:
        n_ids = len(ids)
        for n in range(min(self.nmax, n_ids - 1), self.nmin - 1, -1):
            suffix = ids[n_ids - n:]
            for start in range(n_ids - n - 1, -1, -1):
                if ids[start:start + n] == suffix:
                    follow = ids[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def propose(self, spans: list[Span], ks: list[int], tile_starts: bool = False) -> None:
        for s, k in zip(spans, ks, strict=True):
            if self.mix > 0 and not s.req.params.greedy:
                self._propose_soft(s, k)
            else:
                s.drafts = self.lookup(s.req.all_ids, k)

    def _propose_soft(self, s: Span, k: int) -> None:
        ids = list(s.req.all_ids)
        v = self.vocab or (max(ids) + 1)
        gen = self.generators.get(s.req.rid)
        u = torch.rand(k, generator=gen, device=gen.device if gen is not None else "cpu").cpu()
        freq = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=v)[:v].to(torch.float32)
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            g = self.lookup(ids, 1)
            if not g:
                break
            q = freq * (self.mix / freq.sum())
            q[g[0]] += 1.0 - self.mix
            d = int(torch.searchsorted(q.cumsum(0), u[i] * q.sum(), right=True).clamp(max=v - 1))
            while q[d] <= 0:  # fp rounding at a zero-mass token: the next token with mass
                d = (d + 1) % v
            drafts.append(d)
            rows.append(q)
            ids.append(d)
            freq[d] += 1
        s.drafts = drafts
        s.draft_probs = torch.stack(rows) if rows else None


class OracleProposer(Proposer):
    """Replays a known target continuation with a controlled corruption schedule (tests only).

    `continuations[tuple(prompt_ids)]` is the target's greedy output; `schedule(step, req)` returns the
    number of correct leading drafts for that verify step (the rest are corrupted), so every accept length
    is exact and known in advance.
    """

    name = "oracle"

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]],
                 schedule: Callable[[int, Request], int], vocab_size: int) -> None:
        super().__init__(k)
        self.cont = continuations
        self.schedule = schedule
        self.vocab = vocab_size
        self.steps: dict[str, int] = {}

    def propose(self, spans: list[Span], ks: list[int], tile_starts: bool = False) -> None:
        for s, k in zip(spans, ks, strict=True):
            req = s.req
            cont = self.cont[tuple(req.prompt_ids)]
            n_out = len(req.output_ids)
            truth = cont[n_out:n_out + k]
            step = self.steps.get(req.rid, 0)
            self.steps[req.rid] = step + 1
            good = max(0, min(self.schedule(step, req), len(truth)))
            drafts = list(truth[:good])
            if good < len(truth):
                drafts.append((truth[good] + 1) % self.vocab)
            while len(drafts) < k:  # past the known continuation: any token, it will be checked
                drafts.append(0)
            s.drafts = drafts[:k]

    def release(self, req: Request) -> None:
        self.steps.pop(req.rid, None)
