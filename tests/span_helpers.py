"""Verify spans built by hand over running requests, and staggered arrivals (CPU and GPU verify-runner tests
share them)."""

import torch

from specbench.engine.scheduler import Span


def verify_spans(eng, reqs, lens: list[int]) -> list[Span]:
    """One span per request at its committed length: the anchor then n - 1 seeded random drafts (n = 1 is a
    decode span); the pages it needs reserved."""
    g = torch.Generator().manual_seed(sum(lens))
    spans = []
    for r, n in zip(reqs, lens, strict=True):
        toks = [r.all_ids[r.num_computed]] + torch.randint(0, eng.mcfg.vocab_size, (n - 1,), generator=g).tolist()
        spans.append(Span(r, toks, r.num_computed, "verify" if n > 1 else "decode"))
        eng.pool.ensure(r.rid, r.num_computed + n)
    return spans


def staggered(eng, prompts: list, params, every: int = 3) -> list[list[int]]:
    """Requests arriving one every `every` steps of `eng`, so new prompts' chunks ride beside decoding (and
    verifying) requests; returns each request's output ids, in prompt order."""
    todo, out, step = list(enumerate(prompts)), {}, 0
    while todo or eng.has_unfinished():
        if todo and step % every == 0:
            i, p = todo.pop(0)
            eng.add_request(p, params, rid=f"r{i}")
        for o in eng.step():
            if o.finished:
                out[o.rid] = list(o.output_ids)
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]
