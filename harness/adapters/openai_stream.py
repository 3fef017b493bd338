"""Turning OpenAI-format responses (SSE chunks or one JSON body) into a `GenResult`.

Contract: `StreamAccumulator.feed(obj, t)` takes each decoded `data:` event with its arrival time;
`finish(res)` fills the result. Tokens per chunk are counted by the first method that the response
supports, recorded as `token_count_method`:
  "token_ids"    - the chunk's `token_ids` (vLLM's return_token_ids; specbench serve): exact;
  "logprobs"     - the number of logprob entries in the chunk: exact;
  "usage"        - differences of running usage.completion_tokens (continuous_usage_stats): exact;
  "proportional" - the final usage.completion_tokens spread over the chunks by their characters
                   (largest remainder, so the counts sum to the server's total): an estimate;
  "chunks"       - one token per chunk (no usage at all): a lower bound under speculation.
A chunk counts (gets a time) when it carries text or tokens; usage-only and role-only events do not.
"usage" is used only while every content chunk carries a running usage (continuous usage stats): a
server that sends usage on the final event alone (llama.cpp) must not have every token credited to that
event ([0, ..., 0, 55]); its chunks fall back to "proportional".
`prompt_token_ids` (vLLM's return_token_ids: top level on a chat answer or its first streamed chunk, per
choice on completions) becomes `GenResult.prompt_ids`: the prompt the server computed, e.g. a chat request
rendered through its chat template.
Logprob token strings of the form "token_id:<id>" (return_tokens_as_token_ids) become ids; chat-shaped
entries with an integer `id` (llama.cpp) give ids directly. A position reported with logprob 0.0 and an
empty top list while top-k was asked for (llama.cpp's placeholder for a token accepted from a draft) is
stored as missing (logprob None, no top-k); with `one_token_per_chunk` (llama.cpp streams one token per
event) a content chunk whose logprobs are null gets one missing position, so positions stay aligned.
`native=True` reads llama.cpp's own /completion events instead: `content`, `tokens` (ids),
`completion_probabilities`, and on the final event (`stop: true`) `stop_type`, `tokens_predicted`,
`tokens_evaluated` and `timings` (per-request draft counts, dialect.llamacpp_spec).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import GenResult, PosLogprobs
from .dialect import entry_position, llamacpp_spec


def token_id(s: str | None) -> int | None:
    if isinstance(s, str) and s.startswith("token_id:"):
        try:
            return int(s[9:])
        except ValueError:
            return None
    return None


def _top(d: dict, k: int | None) -> dict:
    """The k best entries (servers like vLLM add the chosen token, giving k + 1)."""
    if k is None or len(d) <= k:
        return d
    return dict(sorted(d.items(), key=lambda kv: -(kv[1] if kv[1] is not None else float("-inf")))[:k])


def legacy_positions(lp: dict | None, k: int | None = None) -> list[PosLogprobs]:
    """Legacy completions logprobs {tokens, token_logprobs, top_logprobs} -> positions (top trimmed to k)."""
    if not lp:
        return []
    toks = lp.get("tokens") or []
    vals = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, s in enumerate(toks):
        top = _top(tops[i], k) if i < len(tops) and tops[i] else {}
        ids = {token_id(k): v for k, v in top.items()}
        as_ids = all(k is not None for k in ids)
        out.append(PosLogprobs(token_id=token_id(s), logprob=vals[i] if i < len(vals) else None,
                               top={k: v for k, v in ids.items() if k is not None} if as_ids else {},
                               token=s, top_text=None if as_ids else dict(top)))
    return out


def chat_positions(lp: dict | None, k: int | None = None) -> list[PosLogprobs]:
    """Chat-shaped logprobs {content: [{id?, token, logprob, top_logprobs}]} -> positions (fake ones missing)."""
    return [entry_position(e, k, requested=k is not None) for e in (lp or {}).get("content") or []]


@dataclass
class StreamAccumulator:
    chat: bool
    top_k: int | None = None
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    have_ids: bool = False
    positions: list[PosLogprobs] = field(default_factory=list)
    have_lps: bool = False
    times: list[float] = field(default_factory=list)
    counts: list[int | None] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)
    methods: set[str] = field(default_factory=set)
    usage: dict | None = None
    running_tokens: int = 0
    finish_reason: str | None = None
    spec: dict | None = None
    error: str | None = None
    native: bool = False  # llama.cpp's /completion events
    one_token_per_chunk: bool = False  # the server streams exactly one token per event (llama.cpp)
    usage_continuous: bool = True  # every content chunk so far carried a running usage
    prompt_ids: list[int] | None = None  # the first `prompt_token_ids` reported (return_token_ids)

    def feed(self, obj: dict, t: float) -> None:
        if self.native:
            self._feed_native(obj, t)
            return
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        usage = obj.get("usage")
        if obj.get("spec_decode") is not None:
            self.spec = obj["spec_decode"]
        if self.prompt_ids is None and obj.get("prompt_token_ids") is not None:  # vLLM chat: top level
            self.prompt_ids = list(obj["prompt_token_ids"])
        for ch in obj.get("choices") or []:
            if ch.get("index", 0) != 0:
                continue
            if self.prompt_ids is None and ch.get("prompt_token_ids") is not None:  # completions: per choice
                self.prompt_ids = list(ch["prompt_token_ids"])
            msg = ch.get("delta") or ch.get("message") or {}  # streamed delta or a whole message
            text = msg.get("content") if self.chat else ch.get("text")
            text = text or ""
            n: int | None = None
            method = ""  # how n was counted (read only once n is set)
            if ch.get("token_ids") is not None:
                self.have_ids = True
                self.ids += list(ch["token_ids"])
                n, method = len(ch["token_ids"]), "token_ids"
            lp = ch.get("logprobs")
            if lp is not None:
                chat_shaped = isinstance(lp, dict) and isinstance(lp.get("content"), list)
                pos = chat_positions(lp, self.top_k) if (self.chat or chat_shaped) else legacy_positions(lp, self.top_k)
                self.have_lps = True
                self.positions += pos
                if n is None:
                    n, method = len(pos), "logprobs"
            elif self.top_k is not None and self.one_token_per_chunk and text:
                self.have_lps = True
                self.positions.append(PosLogprobs(token_id=None, logprob=None, top={}))  # missing, kept aligned
            if (text or n) and not (usage and usage.get("completion_tokens") is not None):
                self.usage_continuous = False
            if n is None and self.usage_continuous and usage and usage.get("completion_tokens") is not None:
                n, method = usage["completion_tokens"] - self.running_tokens, "usage"
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
            if ch.get("spec_decode") is not None:
                self.spec = ch["spec_decode"]
            self._record(text, t, n, method)
        if usage:
            self.usage = usage
            if usage.get("completion_tokens") is not None:
                self.running_tokens = usage["completion_tokens"]

    def _record(self, text: str, t: float, n: int | None, method: str) -> None:
        """One chunk that carried text or tokens: its text, arrival time, token count (None: unknown) and how
        the count was known."""
        if text or n:
            self.texts.append(text)
            self.times.append(t)
            self.counts.append(n)
            self.chars.append(len(text))
            if n is not None:
                self.methods.add(method)

    def _feed_native(self, obj: dict, t: float) -> None:
        """One llama.cpp /completion event (streamed partial, or the whole non-streamed answer)."""
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        text = obj.get("content") or ""
        toks = obj.get("tokens")
        n: int | None = None
        if isinstance(toks, list) and toks:
            self.have_ids = True
            self.ids += [int(x) for x in toks]
            n = len(toks)
        cp = obj.get("completion_probabilities")
        if self.top_k is not None:
            if isinstance(cp, list):
                self.have_lps = True
                self.positions += [entry_position(e, self.top_k) for e in cp]
            elif n:  # streamed token without probabilities: a token accepted from a draft
                self.have_lps = True
                self.positions += [PosLogprobs(token_id=i, logprob=None, top={}) for i in toks]  # type: ignore[union-attr]
        self._record(text, t, n, "token_ids")
        if obj.get("stop"):
            st = obj.get("stop_type")
            self.finish_reason = "stop" if st in ("eos", "word") else ("length" if st == "limit" else st)
            self.usage = {"prompt_tokens": obj.get("tokens_evaluated"), "completion_tokens": obj.get("tokens_predicted")}
            sp = llamacpp_spec(obj.get("timings"))
            if sp is not None:
                self.spec = sp

    def finish(self, res: GenResult) -> GenResult:
        res.text = "".join(self.texts)
        res.finish_reason = self.finish_reason
        res.spec = self.spec
        if self.prompt_ids is not None and all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt_ids):
            res.prompt_ids = list(self.prompt_ids)
        if self.usage:
            res.prompt_tokens = self.usage.get("prompt_tokens")
            res.completion_tokens = self.usage.get("completion_tokens")
        if self.have_ids:
            res.output_ids = list(self.ids)
        elif (self.positions and all(p.token_id is not None for p in self.positions)
              and res.completion_tokens in (None, len(self.positions))):
            # the ids the logprobs name, only where they cover every token: an engine that leaves some tokens
            # without logprobs (llama-server's verify steps) would otherwise hand back part of the output as all
            res.output_ids = [p.token_id for p in self.positions]  # type: ignore[misc]
        if res.completion_tokens is None and res.output_ids is not None:
            res.completion_tokens = len(res.output_ids)
        if self.have_lps:
            res.logprobs = self.positions
        res.chunk_times = list(self.times)
        res.chunk_tokens, res.token_count_method = self._counts(res.completion_tokens)
        if self.times:
            res.t_first = self.times[0]
        if self.error:
            res.ok, res.error = False, self.error
        return res

    def _counts(self, total: int | None) -> tuple[list[int], str]:
        if all(c is not None for c in self.counts):
            method = "+".join(sorted(self.methods)) or "token_ids"
            return [int(c) for c in self.counts], method  # type: ignore[arg-type]
        known = sum(c for c in self.counts if c is not None)
        unknown = [i for i, c in enumerate(self.counts) if c is None]
        if total is None:
            return [c if c is not None else 1 for c in self.counts], "chunks"
        left = max(0, total - known)
        chars = [max(1, self.chars[i]) for i in unknown]
        quota = [left * c / sum(chars) for c in chars]
        base = [int(q) for q in quota]
        order = sorted(range(len(unknown)), key=lambda j: -(quota[j] - base[j]))
        for j in order[: left - sum(base)]:
            base[j] += 1
        out = [c if c is not None else 0 for c in self.counts]
        for j, i in enumerate(unknown):
            out[i] = base[j]
        return out, "proportional"
