"""Response pieces shared by the endpoints: token strings, logprobs in both OpenAI formats, usage, spec.

Contract:
- A token's string is its own decoded text with special tokens kept (`<|im_end|>` shows as itself);
  with return_tokens_as_token_ids it is "token_id:<id>" (vLLM's spelling), which makes top-k keys
  unambiguous. When two ids of a top-k set decode to the same string the higher logprob wins the key.
- Legacy completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}; the chosen token is
  added to its position's top_logprobs (as vLLM does), so the dict holds k or k+1 entries; an echoed
  prompt's first position is None/None.
- Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", "mean_accept_len")


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._one = lru_cache(maxsize=65536)(self._decode_one)

    def _decode_one(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def __call__(self, i: int, as_id: bool = False) -> str:
        return f"token_id:{i}" if as_id else self._one(i)


def legacy_logprobs(tt: TokenText, ids: list[int], lps: list, as_id: bool, offset0: int = 0) -> dict:
    """ids[i] with lps[i] = (chosen_lp, {tok: lp}) or None (first prompt position)."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    off = offset0
    for t, entry in zip(ids, lps, strict=False):
        s = tt(t, as_id)
        tokens.append(s)
        offsets.append(off)
        off += len(tt(t))
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp, top = entry
        token_lps.append(lp)
        d: dict[str, float] = {}
        for tid, v in sorted(top.items(), key=lambda kv: -kv[1]):
            d.setdefault(tt(tid, as_id), v)
        d.setdefault(s, lp)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tt: TokenText, ids: list[int], lps: list, as_id: bool) -> list[dict]:
    out = []
    for t, (lp, top) in zip(ids, lps, strict=False):
        s = tt(t, as_id)
        alts = [{"token": tt(tid, as_id), "logprob": v, "bytes": list(tt(tid).encode())}
                for tid, v in sorted(top.items(), key=lambda kv: -kv[1])]
        out.append({"token": s, "logprob": lp, "bytes": list(tt(t).encode()), "top_logprobs": alts})
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def request_spec(spec: dict | None) -> dict | None:
    """One request's spec metrics for a response (the per-step run list is left out)."""
    if not spec:
        return None
    return {k: spec[k] for k in SPEC_KEYS if k in spec}


def merge_spec(specs: list[dict | None], method: str | None) -> dict:
    """Sum per-request spec metrics; mean_accept_len is token-weighted (1 + accepted / drafts)."""
    out: dict = {"method": method, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                 "accepted_per_pos": []}
    for s in specs:
        if not s:
            continue
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[k] += int(s.get(k, 0))
        pp = list(s.get("accepted_per_pos") or [])
        acc = out["accepted_per_pos"]
        acc.extend([0] * (len(pp) - len(acc)))
        for i, v in enumerate(pp):
            acc[i] += v
    out["mean_accept_len"] = 1.0 + out["num_accepted_tokens"] / out["num_drafts"] if out["num_drafts"] else None
    return out
