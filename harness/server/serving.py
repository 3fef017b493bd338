"""Shared serving machinery: server state, admitting a batch of prompts, collecting or streaming deltas.

Contract:
- `ServerState` holds the engine loop, the tokenizer and the served model names. `check_model` answers
  404 for a name it does not serve (a missing model field means the default model).
- Nothing slow runs on the event loop: `off_loop(state, fn)` runs a request's preparation (JSON parsing,
  validation, chat template, tokenization, `admit`) and the building of large answers in the server's
  worker threads, so /health and every other connection keep answering under any single request. A
  preparation whose caller is cancelled (the client went away) still finishes, and `cleanup` aborts what
  it admitted. A text prompt so long that it cannot fit the context whatever it tokenizes to (more
  characters than `max_prompt_chars` = `MAX_CHARS_PER_TOKEN` x the usable context) is refused before it is
  tokenized; a chat template's output is bounded by the same count (`templates`: engine/chat_template.py's
  `BoundedRenderer`, whose workers `close()` kills). `check_ids` is the server's rule for token ids (prompts,
  /detokenize): 0 <= id < the model's vocabulary, else a 400 naming the field.
- `admit(jobs)` submits every prompt of a request to the engine on one shared queue (tag = choice
  index), from a worker thread (`loop=` the event loop the answers go to). If any prompt is refused, the
  ones already admitted are aborted and the refusal becomes an `APIError`; a request is admitted whole or
  not at all.
- `request_ids(request, prefix)`: the answer's id and the engine's request-id base, from the client's
  `x-request-id` when it sent one (middleware.py), unique per request either way. `prepared` is the front
  both generation routes share: refused while draining, the body read, the route's preparation off the loop.
- `gather` waits for every choice's final output, polling the client connection so that a client that
  goes away frees its requests' KV; `deltas` yields outputs as they arrive for streaming. Both abort
  whatever is unfinished when they exit early (disconnect, cancellation, engine failure).
- `ChoiceStream.advance(out)` turns cumulative outputs into deltas: new text, new token ids and their
  logprobs. An unfinished output's text already leaves out whatever may still become a stop string (the
  engine holds it back: engine/output.py), so no stop matching runs here, on the event loop.
- `stream_choices` is the streaming tail both generation routes share (their own part is the choice of
  each event): one SSE event per engine delta per choice, running usage with continuous_usage_stats, the
  usage + spec_decode event with include_usage, an engine error as an error event, then `data: [DONE]`;
  `event_stream` answers with it (and aborts whatever is unfinished when the response ends).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from specbench.engine import SamplingParams
from specbench.engine.chat_template import BoundedRenderer

from ..adapters.loop import EngineLoop
from .errors import APIError, from_engine
from .formatting import TokenText, merge_spec, usage
from .metrics import ServerMetrics
from .options import ServerOptions
from .protocol import CommonParams

if TYPE_CHECKING:
    from .engine_proc import ProcEngineLoop

DISCONNECT_POLL_S = 0.5
# No tokenizer we serve has a token longer than this many characters; a prompt with more characters than
# this times the usable context cannot fit, so it is refused without spending seconds tokenizing it.
MAX_CHARS_PER_TOKEN = 256


@dataclass
class ServerState:
    loop: EngineLoop | ProcEngineLoop  # the engine in this process, or in its own (engine_proc.py)
    served_names: list[str]
    options: ServerOptions = field(default_factory=ServerOptions)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.engine = self.loop.engine
        self.tokenizer = self.engine.tokenizer
        self.tt = TokenText(self.tokenizer)
        self.max_body_bytes = self.options.max_body_bytes
        self.executor = ThreadPoolExecutor(self.options.prep_threads, thread_name_prefix="specbench-prep")
        # every worker started now: the executor otherwise starts one inside submit(), on the event loop, and
        # Thread.start() waits there for the new thread, which can take seconds while a worker tokenizes
        # (measured: /health stalled 1.5-3 s behind the first 500k-character prompt)
        ready = threading.Barrier(self.options.prep_threads + 1)
        for _ in range(self.options.prep_threads):
            self.executor.submit(ready.wait)
        ready.wait()
        self.templates = BoundedRenderer(self.options.chat_template_timeout, self.options.prep_threads)
        self.draining = False  # set on SIGTERM / SIGINT: new generation requests get 503 shutting_down
        self.metrics = ServerMetrics(self.loop, self.model_name, k_max=int(self.engine.describe().get("k") or 16))

    def check_open(self) -> None:
        if self.draining:
            raise APIError("the server is shutting down: send new requests to another replica", 503,
                           "service_unavailable_error", None, "shutting_down", retry_after=1)

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

    @property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit the usable context, whatever they tokenize to."""
        return MAX_CHARS_PER_TOKEN * self.engine.max_model_len

    def to_ids(self, prompt: str | list[int], index: int = 0) -> list[int]:
        limit = self.engine.max_model_len
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise APIError(f"prompt[{index}] has {len(prompt)} characters: more than {MAX_CHARS_PER_TOKEN} per token "
                           f"of this model's usable context of {limit} tokens, so it cannot fit",
                           param="prompt", code="context_length_exceeded")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(f"prompt[{index}] tokenizes to nothing: at least one token is required",
                           param="prompt", code="empty_prompt")
        self.check_ids(f"prompt[{index}]", ids, "prompt")
        return ids

    def check_ids(self, name: str, ids: list[int], param: str | None = None) -> None:
        vocab = self.engine.mcfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{name} has token ids {bad[:5]} out of range: expected 0 <= id < {vocab}",
                           param=param or name, code="invalid_value")

    def close(self) -> None:
        """What the state holds beside the engine loop: the preparation threads and the template workers."""
        self.templates.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


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


def request_ids(request: Request, prefix: str) -> tuple[str, str]:
    """(the answer's id, the base of the engine's request ids): `<prefix>-<x-request-id>` when the client
    sent one, with a random suffix on the engine side so two requests with one id never collide."""
    st = request.scope.get("state") or {}
    if st.get("client_request_id"):
        xid = st["request_id"]
        return f"{prefix}-{xid}", f"{prefix}-{xid}-{uuid.uuid4().hex[:8]}"
    cid = new_id(prefix)
    return cid, cid


def received_at(request: Request) -> float | None:
    return (request.scope.get("state") or {}).get("received")


async def off_loop(state: ServerState, fn: Callable[..., Any], *args: Any,
                   cleanup: Callable[[Any], None] | None = None) -> Any:
    """`fn(*args)` on a worker thread; if the caller is cancelled, `cleanup(result)` once it is done."""
    fut = asyncio.get_running_loop().run_in_executor(state.executor, functools.partial(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if cleanup is not None:
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else cleanup(f.result()))
        raise



async def prepared(state: ServerState, request: Request, prefix: str, prepare: Callable[..., tuple]) -> tuple[str, tuple]:
    """A generation request up to its admission: refused while draining, then (the answer's id,
    `prepare(state, raw body, engine id base, event loop, received)` run off the loop). `prepare` returns
    a tuple whose last item is the admitted rids: aborted if the client goes away meanwhile."""
    state.check_open()
    raw = await request.body()
    cid, base = request_ids(request, prefix)
    return cid, await off_loop(state, prepare, state, raw, base, asyncio.get_running_loop(), received_at(request),
                               cleanup=lambda r: abort_all(state, r[-1]))


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
                              min_p=p.min_p, repetition_penalty=p.repetition_penalty,
                              presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                              logit_bias=p.logit_bias, min_tokens=p.min_tokens, seed=p.seed, stop=p.stop, stop_token_ids=p.stop_token_ids,
                              ignore_eos=p.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              include_stop_str_in_output=p.include_stop_str, cache_salt=p.cache_salt)
    except Exception as e:
        raise from_engine(e) from e


def admit(state: ServerState, jobs: list[Job], base: str, loop: asyncio.AbstractEventLoop | None = None,
          received: float | None = None) -> tuple[asyncio.Queue, dict[int, str]]:
    """On a worker thread (`loop` = the event loop the answers go to) or on the event loop itself."""
    q: asyncio.Queue = asyncio.Queue()
    rids: dict[int, str] = {}
    try:
        for j in jobs:
            rid, _ = state.loop.submit(j.prompt_ids, j.params, rid=f"{base}-{j.index}", queue=q, tag=j.index,
                                       loop=loop, received=received)
            rids[j.index] = rid
    except Exception as e:
        for rid in rids.values():
            state.loop.abort(rid)
        raise from_engine(e) from e
    return q, rids


def coalesced(items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """A backlog of one request's queued outputs, each choice's outputs but its latest dropped: an output is
    cumulative (all ids, text, logprobs so far), so the latest carries every token the dropped ones did, and the
    stream's deltas (`ChoiceStream`) come out the same, in fewer events. An exception keeps its place and ends
    the batch (what follows it is never reached)."""
    for n, (_, out) in enumerate(items):
        if isinstance(out, Exception):
            items = items[: n + 1]
            break
    last = {idx: n for n, (idx, out) in enumerate(items) if not isinstance(out, Exception)}
    return [it for n, it in enumerate(items) if isinstance(it[1], Exception) or last[it[0]] == n]


async def deltas(state: ServerState, q: asyncio.Queue, rids: dict[int, str]) -> AsyncIterator[tuple[int, Any]]:
    """Yield (index, output) until every choice is finished; abort the rest on early exit. With
    `ServerOptions.coalesce` (SPECBENCH_COALESCE=1; off by default) the outputs queued while the consumer was busy are merged
    (`coalesced`): a stream that falls behind the engine catches up in fewer, larger events instead of
    falling further behind (vLLM's API server does the same)."""
    open_ = set(rids)
    merge = state.options.coalesce
    try:
        while open_:
            batch = [await q.get()]
            if merge and not q.empty():
                while not q.empty():
                    batch.append(q.get_nowait())
                batch = coalesced(batch)
            for idx, out in batch:
                if isinstance(out, Exception):
                    raise from_engine(out)
                if out.finished:
                    open_.discard(idx)
                yield idx, out
    finally:
        for i in open_:
            state.loop.abort(rids[i])


def abort_all(state: ServerState, rids: dict[int, str]) -> None:
    for rid in rids.values():
        state.loop.abort(rid)


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
    sent_chars: int = 0
    sent_tokens: int = 0

    def advance(self, out: Any) -> tuple[str, list[int], list | None]:
        text = out.text
        delta = text[self.sent_chars:] if len(text) > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, len(text))
        new_ids = list(out.output_ids[self.sent_tokens:])
        lps = list(out.logprobs[self.sent_tokens:]) if out.logprobs is not None else None
        self.sent_tokens = len(out.output_ids)
        return delta, new_ids, lps


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(state: ServerState, rids: dict[int, str], events: AsyncIterator[str]) -> StreamingResponse:
    """A streamed answer (server-sent events, not cached); whatever is unfinished when it ends, also on a
    client disconnect, is aborted (`abort_task`)."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=abort_task(state, rids))


async def stream_choices(state: ServerState, q: asyncio.Queue, rids: dict[int, str], req: CommonParams,
                         jobs: list[Job], cid: str, obj: str, model: str,
                         choice: Callable[[int, Any], dict | None], first: dict | None = None
                         ) -> AsyncIterator[str]:
    """The SSE events of a streamed request: `first` (fields beside the head, before any delta), then for
    each engine delta `choice(index, out)`'s event (None: nothing to send for this delta), each with
    running usage when req.continuous_usage; the usage + spec_decode event (`choices: []`) when
    req.include_usage; an APIError (the engine failed, the server drains) as its error body; `[DONE]`.
    Every event starts with {id, object, created, model}. A choice's completion tokens are its output ids
    (none for a scoring-only job)."""
    head = {"id": cid, "object": obj, "created": int(time.time()), "model": model}
    n_prompt = sum(len(j.prompt_ids) for j in jobs)
    n_gen = {j.index: 0 for j in jobs}
    scoring = {j.index: j.scoring_only for j in jobs}
    specs: dict[int, dict | None] = {}
    if first is not None:
        yield sse({**head, **first})
    try:
        async for idx, out in deltas(state, q, rids):
            if not scoring[idx]:
                n_gen[idx] = len(out.output_ids)
            c = choice(idx, out)
            if c is None:
                continue
            if out.finished:
                specs[idx] = out.spec
            chunk: dict = {**head, "choices": [c]}
            if req.continuous_usage:
                chunk["usage"] = usage(n_prompt, sum(n_gen.values()))
            yield sse(chunk)
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage(n_prompt, sum(n_gen.values())),
                       "spec_decode": merge_spec([specs.get(j.index) for j in jobs], state.spec_method)})
    except APIError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"
