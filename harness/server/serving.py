"""Shared serving machinery: server state, admitting a batch of prompts, collecting or streaming deltas.

Contract:
- `ServerState` holds the engine loop, the tokenizer and the served model names. `check_model` answers
  404 for a name it does not serve (a missing model field means the default model).
- `admit(jobs)` submits every prompt of a request to the engine on one shared queue (tag = choice
  index). If any prompt is refused, the ones already admitted are aborted and the refusal becomes an
  `APIError`; a request is admitted whole or not at all.
- `gather` waits for every choice's final output, polling the client connection so that a client that
  goes away frees its requests' KV; `deltas` yields outputs as they arrive for streaming. Both abort
  whatever is unfinished when they exit early (disconnect, cancellation, engine failure).
- `ChoiceStream.advance(out)` turns cumulative outputs into deltas: new text (stop-string prefixes held
  back until resolved), new token ids and their logprobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.background import BackgroundTask

from specbench.engine import SamplingParams

from ..adapters.loop import EngineLoop
from .errors import APIError, from_engine
from .formatting import TokenText, holdback
from .protocol import CommonParams

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    loop: EngineLoop
    served_names: list[str]
    max_body_bytes: int = 32 * 1024 * 1024
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.engine = self.loop.engine
        self.tokenizer = self.engine.tokenizer
        self.tt = TokenText(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def spec_method(self) -> str | None:
        return self.engine.describe().get("spec")

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_names:
            return self.model_name
        raise APIError(f"model {name!r} does not exist: this server serves {self.served_names[0]!r}",
                       404, "not_found_error", "model", "model_not_found")

    def to_ids(self, prompt: str | list[int], index: int = 0) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(f"prompt[{index}] tokenizes to nothing: at least one token is required",
                           param="prompt", code="empty_prompt")
        vocab = self.engine.mcfg.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(f"prompt[{index}] has token ids {bad[:5]} out of range: expected 0 <= id < {vocab}",
                           param="prompt", code="invalid_value")
        return ids


    def check_len(self, n_prompt: int, max_tokens: int, index: int = 0) -> None:
        """Context overflow, blamed on the prompt when it alone does not fit, else on max_tokens."""
        limit = self.engine.max_model_len
        if n_prompt >= limit:
            raise APIError(f"prompt[{index}] has {n_prompt} tokens: this model's usable context is {limit} tokens "
                           "and at least one must be left to generate", param="prompt", code="context_length_exceeded")
        if n_prompt + max_tokens > limit:
            raise APIError(f"prompt[{index}] has {n_prompt} tokens and max_tokens={max_tokens}: together "
                           f"{n_prompt + max_tokens}, more than this model's usable context of {limit} tokens",
                           param="max_tokens", code="context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class Job:
    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    scoring_only: bool = False  # echo with max_tokens=0: the generated token is dropped


def sampling(p: CommonParams, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
             ) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                              min_p=p.min_p, seed=p.seed, stop=p.stop, stop_token_ids=p.stop_token_ids,
                              ignore_eos=p.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              include_stop_str_in_output=p.include_stop_str)
    except Exception as e:
        raise from_engine(e) from e


def admit(state: ServerState, jobs: list[Job], prefix: str) -> tuple[asyncio.Queue, dict[int, str]]:
    q: asyncio.Queue = asyncio.Queue()
    rids: dict[int, str] = {}
    base = new_id(prefix)
    try:
        for j in jobs:
            rid, _ = state.loop.submit(j.prompt_ids, j.params, rid=f"{base}-{j.index}", queue=q, tag=j.index)
            rids[j.index] = rid
    except Exception as e:
        for rid in rids.values():
            state.loop.abort(rid)
        raise from_engine(e) from e
    return q, rids


async def deltas(state: ServerState, q: asyncio.Queue, rids: dict[int, str]) -> AsyncIterator[tuple[int, Any]]:
    """Yield (index, output) until every choice is finished; abort the rest on early exit."""
    open_ = set(rids)
    try:
        while open_:
            idx, out = await q.get()
            if isinstance(out, Exception):
                raise from_engine(out)
            if out.finished:
                open_.discard(idx)
            yield idx, out
    finally:
        for i in open_:
            state.loop.abort(rids[i])


def abort_task(state: ServerState, rids: dict[int, str]) -> BackgroundTask:
    """Runs after a streamed response ends, also on a client disconnect: aborts whatever is unfinished
    (a no-op for finished requests), even when the disconnect came before the stream started."""

    def run() -> None:
        for rid in rids.values():
            state.loop.abort(rid)

    return BackgroundTask(run)


class _Disconnected(Exception):
    pass


async def _watch(request: Request, q: asyncio.Queue) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    q.put_nowait((None, _Disconnected()))


async def gather(state: ServerState, q: asyncio.Queue, rids: dict[int, str], request: Request) -> dict[int, Any]:
    """Every choice's final output; a client disconnect aborts all of them (frees their KV)."""
    finals: dict[int, Any] = {}
    watcher = asyncio.ensure_future(_watch(request, q))
    try:
        while len(finals) < len(rids):
            idx, out = await q.get()
            if isinstance(out, _Disconnected):
                raise APIError("client disconnected", 499, "client_closed_request")
            if isinstance(out, Exception):
                raise from_engine(out)
            if out.finished:
                finals[idx] = out
    finally:
        watcher.cancel()
        for i, rid in rids.items():
            if i not in finals:
                state.loop.abort(rid)
    return finals


@dataclass
class ChoiceStream:
    stops: tuple[str, ...]
    sent_chars: int = 0
    sent_tokens: int = 0

    def advance(self, out: Any) -> tuple[str, list[int], list | None]:
        text = out.text
        if not out.finished:
            text = text[: len(text) - holdback(text, self.stops)]
        delta = text[self.sent_chars:] if len(text) > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, len(text))
        new_ids = list(out.output_ids[self.sent_tokens:])
        lps = list(out.logprobs[self.sent_tokens:]) if out.logprobs is not None else None
        self.sent_tokens = len(out.output_ids)
        return delta, new_ids, lps
