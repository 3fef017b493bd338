"""Token selection and logprobs.

Greedy is an exact argmax over the raw logits (temperature 0 is not clamped), after the request's penalties
(`apply_penalties`: repetition, presence, frequency; off by default), logit bias (`apply_bias`) and min_tokens
mask (`mask_min_tokens`) when it set any. Sampling applies the
request's transform (temperature, top-k, top-p, min-p) and draws with the request's own
`torch.Generator` (seeded when the request gave a seed), so a seeded request is reproducible regardless
of its batch neighbours. Logprobs are log_softmax of the raw logits in fp32 (the model's distribution,
as vLLM reports by default).
"""

from __future__ import annotations

import torch

from .config import SamplingParams

TOP_P_CANDIDATES = 1024  # top-p: the candidate set tried before a full sort of the vocabulary


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after the request's sampling transform; logits [R, V] -> [R, V] fp32."""
    t = max(p.temperature, 1e-8)
    x = logits.float() if t == 1.0 else logits.to(torch.float32, copy=True).div_(t)
    v = x.shape[-1]
    masked = False
    if 0 < p.top_k < v:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # sums to one: renormalised below only after a mask drops mass
    if p.top_p < 1.0:
        top: tuple[torch.Tensor, torch.Tensor] | None = None
        if v > TOP_P_CANDIDATES:
            # The nucleus is a prefix of the descending order; when the top candidates of every row already
            # hold top_p of the mass, it lies inside them and a top-k replaces the full sort (same kept set,
            # up to the order of exact ties). One host read decides; otherwise the full sort runs.
            cv, ci = probs.topk(TOP_P_CANDIDATES, dim=-1)
            if bool((cv.sum(-1) >= p.top_p).all()):
                top = cv, ci
        sp, order = top if top is not None else probs.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= p.top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sp)
        masked = True
    if p.min_p > 0:
        thresh = probs.max(dim=-1, keepdim=True).values * p.min_p
        probs = probs.masked_fill(probs < thresh, 0.0)
        masked = True
    return probs / probs.sum(-1, keepdim=True) if masked else probs


def apply_penalties(rows: torch.Tensor, params: SamplingParams, prompt: list[int],
                    outputs: list[list[int]]) -> torch.Tensor:
    """vLLM's repetition / presence / frequency penalties on logits rows [R, V] (a new fp32 tensor): row r's
    history is the prompt and outputs[r], the output tokens before its position (under speculation the drafts
    before the row are in it). Repetition: every token of the prompt or the output so far has a positive logit
    divided by the penalty and a negative one multiplied by it; presence: the penalty once for every token in
    the output so far; frequency: the penalty times its count there."""
    x = rows.to(torch.float32, copy=True)
    v = x.shape[-1]
    dev = x.device
    for r, out in enumerate(outputs):
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(v, dtype=torch.bool, device=dev)
            ids = list(prompt) + list(out)
            if ids:
                seen[torch.tensor(ids, device=dev)] = True
            row = x[r]
            pen = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            x[r] = torch.where(seen, pen, row)
        if out and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(out, device=dev), minlength=v)[:v].to(torch.float32)
            x[r] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    return x


def apply_bias(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI's logit_bias on logits rows [R, V] in place: each listed token's bias added to every row (ids past
    the vocabulary were refused at admission)."""
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=rows.device)
        rows[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=rows.device, dtype=rows.dtype)
    return rows


def mask_min_tokens(rows: torch.Tensor, params: SamplingParams, lengths: list[int], eos: set[int]) -> torch.Tensor:
    """vLLM's min_tokens on logits rows [R, V] in place: row r, whose pick becomes output token lengths[r] (0-based),
    has the stop tokens (stop_token_ids, and EOS unless ignore_eos) at -inf while lengths[r] < min_tokens."""
    stops = {t for t in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)) if t < rows.shape[-1]}
    early = [r for r, n in enumerate(lengths) if n < params.min_tokens]
    if early and stops:  # (a stop id past the vocabulary can never be drawn: nothing to mask)
        ids = torch.tensor(sorted(stops), device=rows.device, dtype=torch.long)
        r = torch.tensor(early, device=rows.device)
        rows[r.unsqueeze(-1), ids.unsqueeze(0)] = float("-inf")
    return rows


def _transform_key(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_k, p.top_p, p.min_p)


def sampling_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`sampling_probs` for a batch whose rows carry their own params (logits [R, V], one params per row).

    Rows that share a transform go through one `sampling_probs` call (the usual case: one call for the
    whole batch), so each row's probabilities are exactly what the per-request call would give.
    """
    if len(params) != logits.shape[0]:
        raise ValueError(f"sampling_probs_rows: {len(params)} params for {logits.shape[0]} rows")
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(_transform_key(p), []).append(i)
    if len(groups) == 1:
        return sampling_probs(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out[idx] = sampling_probs(logits[idx], params[rows[0]])
    return out


DRAW_CHUNK = 1024  # draw_rows: the inverse CDF runs over chunk sums, then inside one chunk


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V] by inverse CDF with the row's uniform u [R] in [0, 1): the first
    index whose cumulative probability exceeds u times the row's total; zero-probability tokens are never
    drawn. Two levels, so no scan runs along a whole vocabulary row (a single-row scan of 150k entries is
    latency-bound on a GPU): pick the chunk of DRAW_CHUNK tokens from the chunk sums' CDF, then the token
    from that chunk's CDF at the remaining mass. On the device, no host read; exact up to fp32 rounding."""
    r, v = probs.shape
    c = min(DRAW_CHUNK, v)
    x = probs.float()
    if v % c:
        x = torch.nn.functional.pad(x, (0, c - v % c))
    x = x.view(r, -1, c)
    sums = x.sum(-1)  # [R, chunks]
    ccdf = sums.cumsum(-1)
    target = (u.float() * ccdf[:, -1]).unsqueeze(-1)
    chunk = torch.searchsorted(ccdf, target, right=True).clamp_(max=ccdf.shape[1] - 1)  # [R, 1]
    inner = x[torch.arange(r, device=x.device), chunk.squeeze(-1)]  # [R, c]
    icdf = inner.cumsum(-1)
    # Mass still to cover inside the chunk, kept strictly below the chunk's own total (fp rounding).
    rest = (target - (ccdf.gather(1, chunk) - sums.gather(1, chunk))).clamp_(min=0.0)
    rest = torch.minimum(rest, icdf[:, -1:] * (1.0 - 1e-6))
    j = torch.searchsorted(icdf, rest, right=True).clamp_(max=c - 1)
    return (chunk * c + j).squeeze(-1).clamp_(max=v - 1)


def uniforms(counts: list[int], gens: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """counts[b] uniforms from request b's own generator, concatenated (one small draw per request)."""
    parts = [torch.rand(n, generator=g, device=device, dtype=torch.float32) for n, g in zip(counts, gens, strict=True)]
    return torch.cat(parts) if parts else torch.empty(0, device=device)


def make_generator(seed: int | None, device: torch.device | str, fallback: torch.Generator) -> torch.Generator:
    if seed is None:
        # Derive from the engine generator so unseeded runs are still reproducible for one engine seed.
        seed = int(torch.randint(0, 2**62, (1,), generator=fallback).item())
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def select(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick one token from logits [V] for a request."""
    if p.greedy:
        return int(torch.argmax(logits).item())
    probs = sampling_probs(logits.unsqueeze(0), p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def topk_logprobs(logits: torch.Tensor, chosen: list[int], k: int) -> list[tuple[float, dict[int, float]]]:
    """logits [R, V]; chosen [R] -> per row (chosen logprob, {token: logprob} for the top-k)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    if k > 0:
        vals, idx = torch.topk(lp, k, dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
    chosen_lp = lp.gather(-1, torch.tensor(chosen, device=lp.device).unsqueeze(-1)).squeeze(-1).tolist()
    for r in range(lp.shape[0]):
        top = dict(zip(idx_l[r], vals_l[r], strict=True)) if k > 0 else {}
        out.append((chosen_lp[r], top))
    return out


def draw_one_each(rows: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> torch.Tensor:
    """One sampled token per logits row on the device: row i's request transform (`sampling_probs_rows`) and an
    inverse-CDF draw with one uniform from gens[i] (the decode pick of the accept phase and of decode ahead)."""
    return draw_rows(sampling_probs_rows(rows, params), uniforms([1] * len(params), gens, rows.device))
