"""Greedy drafts kept on the device from the draft pass to the verify forward (EngineConfig.defer_drafts).

Without it the draft's argmax is read to the host before the verify step is built, so the GPU idles while the host
lays out the verify step (tokens, positions, slots, the attention plan). With it the DFlash proposer leaves its
greedy drafts in a device tensor and puts placeholders (0) in the spans: the verify layout depends only on the
draft counts, never on their values, so the host builds it while the draft still runs, and the padded verify
runner copies the draft tokens into its input rows on the device (`flat_rows`; graphs.VerifyGraphs.run). The
drafts reach the host through a pinned copy queued right after the draft and an event, read by `resolve` before
the accept (which needs them), or before a forward path that builds its inputs on the host (the plain forward).

Contract: between propose and `resolve`, a deferred span's tokens are [anchor, 0 x k] and its drafts [0 x k];
after it, exactly what the host path would have put there (the same argmax). Only greedy drafts of one batched
pass are deferred (a sampled draft's distribution and draw stay on the host path); never with a fault armed.
"""

from __future__ import annotations

import torch

from ..scheduler import Span


class PendingDrafts:
    def __init__(self, tokens: torch.Tensor, spans: list[Span], ks: list[int]) -> None:
        """tokens: [N, slots] int64 draft argmax on the device (row i: spans[i]); ks: drafts kept per span."""
        self.tokens, self.spans, self.ks = tokens, list(spans), list(ks)
        self.resolved = False
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda:  # queued behind the draft: done long before the verify that follows it
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def flat_rows(self, spans: list[Span]) -> tuple[list[int], list[int]]:
        """(rows of the step's flat token layout of `spans` that hold a deferred draft, the index of each one's
        token in tokens.view(-1)), for a forward that fills its input rows on the device."""
        where = {id(s): i for i, s in enumerate(self.spans)}
        slots = self.tokens.shape[1]
        dst: list[int] = []
        src: list[int] = []
        off = 0
        for s in spans:
            i = where.get(id(s))
            if i is not None and not self.resolved:
                k = self.ks[i]
                dst += range(off + 1, off + 1 + k)
                src += range(i * slots, i * slots + k)
            off += len(s.tokens)
        return dst, src

    def resolve(self) -> None:
        """The drafts on the host: every deferred span's drafts and tokens [anchor, d1..dk] (once)."""
        if self.resolved:
            return
        if self._event is not None and self._host is not None:
            self._event.synchronize()
            host = self._host.tolist()
        else:
            host = self.tokens.tolist()
        for s, k, row in zip(self.spans, self.ks, host, strict=True):
            s.drafts = row[:k]
            s.tokens = s.tokens[:1] + row[:k]
        self.resolved = True
