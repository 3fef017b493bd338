"""POST /v1/chat/completions: the tokenizer's chat template, chat-format logprobs, SSE streaming.

Contract: messages are rendered with the model's chat template (add_generation_prompt by default) in
jinja2's immutable sandbox, in a worker process bounded in time (--chat-template-timeout), memory and output
(`render_chat`: engine/chat_template.py's `BoundedRenderer`), and tokenized by the server, on a worker thread;
max_tokens / max_completion_tokens default to the rest of the context.
`logprobs: true` + `top_logprobs: k` returns chat-format logprobs. Streaming sends a role delta first,
then content deltas (one per engine delta), a finish event, the usage event when asked, `[DONE]`.
`return_token_ids: true` (vLLM's name) adds `token_ids` to each choice / event and the rendered prompt's
`prompt_token_ids` at the top level of the answer (streamed: of the first chunk), where vLLM puts them
(and, for older clients, in the non-streamed choice too).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from specbench.engine.chat_template import BoundedRenderer, TemplateRefused

from .errors import APIError
from .formatting import chat_logprobs, merge_spec, request_spec, usage
from .protocol import ChatRequest, parse_chat, parse_json
from .serving import (
    ChoiceStream,
    Job,
    ServerState,
    admit,
    event_stream,
    gather,
    off_loop,
    prepared,
    sampling,
    stream_choices,
)


def render_chat(state: ServerState, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template rendered by the server's bounded renderer. A template that reaches for Python internals
    is the model directory's fault, not the request's: 500 chat_template_unsafe, naming what it tried; one that
    refuses these messages (raise_exception, a bad field), runs past its time, memory or output bound on them is
    a 400 naming messages; the server stays up and the worker that ran it is replaced."""
    tok = state.tokenizer
    if not tok.chat_template:  # the plain fallback (engine/tokenizer.py): linear in the messages
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    try:
        return state.templates.render(tok.chat_template, messages, add_generation_prompt, tok.eos_token or "",
                                      max_chars=state.max_prompt_chars)
    except TemplateRefused as e:
        if e.kind == "unsafe":
            raise APIError(f"the model's chat template tried something the sandbox refuses ({e.message}): it is "
                           "not rendered; fix tokenizer_config.json's chat_template", 500, "internal_error", None,
                           "chat_template_unsafe") from e
        if e.kind == "closed":
            raise APIError("the server is shutting down: send new requests to another replica", 503,
                           "service_unavailable_error", None, "shutting_down") from e
        if e.kind == "too_large":
            detail = (f"its output would pass {state.max_prompt_chars:,} characters, more than this model's usable "
                      f"context of {state.engine.max_model_len} tokens can hold ({e.message})")
        else:
            detail = e.message if e.kind in ("timeout", "memory", "died") else f"{e.kind}: {e.message}"
        code = {"timeout": "chat_template_timeout", "too_large": "chat_template_too_large",
                "memory": "chat_template_memory"}.get(e.kind, "invalid_value")
        raise APIError(f"messages cannot be rendered with the chat template: {detail}", param="messages",
                       code=code) from e


PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
         {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
PROBE_MAX_CHARS = 1 << 20  # a plain four-message conversation rendered into more than this is no chat template


def probe_template(tokenizer: Any, timeout: float = 5.0) -> str | None:
    """At start-up: the chat template rendered once on a plain conversation, bounded as every request's render
    is. Returns the problem as one line when it reaches for Python internals, does not compile, or runs past
    `timeout` seconds, its memory bound or PROBE_MAX_CHARS characters, else None (a template that merely refuses
    this conversation is left to answer requests with its 400)."""
    if not tokenizer.chat_template:
        return None
    fix = "fix tokenizer_config.json's chat_template"
    renderer = BoundedRenderer(timeout, max_workers=1)
    try:
        renderer.render(tokenizer.chat_template, PROBE, True, tokenizer.eos_token or "", PROBE_MAX_CHARS)
    except TemplateRefused as e:
        return {"unsafe": f"the chat template tried something jinja2's sandbox refuses ({e.message}); it would run "
                          f"code in the server: {fix}",
                "syntax": f"the chat template does not compile ({e.message}): fix tokenizer_config.json",
                "timeout": f"the chat template did not finish rendering a plain four-message conversation within "
                           f"{timeout:g} s (--chat-template-timeout): {fix}",
                "too_large": f"the chat template renders a plain four-message conversation into more than "
                             f"{PROBE_MAX_CHARS:,} characters ({e.message}): {fix}",
                "memory": f"the chat template ran out of memory rendering a plain four-message conversation "
                          f"({e.message}): {fix}",
                "died": f"the chat template could not be rendered ({e.message})"}.get(e.kind)
    finally:
        renderer.close()
    return None


def build_job(state: ServerState, req: ChatRequest) -> Job:
    text = render_chat(state, req.messages, req.add_generation_prompt)
    ids = state.to_ids(text)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = state.engine.max_model_len - len(ids)
        if max_tokens < 1:
            raise APIError(f"the rendered chat prompt has {len(ids)} tokens, leaving no room in this model's "
                           f"usable context of {state.engine.max_model_len}", param="messages",
                           code="context_length_exceeded")
    state.check_len(len(ids), max_tokens)
    return Job(0, ids, text, sampling(req, max_tokens, req.logprobs))


def prepare(state: ServerState, raw: bytes, base: str, loop: asyncio.AbstractEventLoop, received: float | None
            ) -> tuple[ChatRequest, str, Job, asyncio.Queue, dict[int, str]]:
    """Parse, validate, render the template, tokenize and admit: on a worker thread (serving.off_loop)."""
    req = parse_chat(parse_json(raw), state.options)
    model = state.check_model(req.model)
    job = build_job(state, req)
    q, rids = admit(state, [job], base, loop, received)
    return req, model, job, q, rids


async def create_chat(state: ServerState, request: Request) -> Any:
    cid, (req, model, job, q, rids) = await prepared(state, request, "chatcmpl", prepare)
    if req.stream:
        return event_stream(state, rids, _stream(state, req, job, q, rids, cid, model))
    out = (await gather(state, q, rids, request))[0]
    return Response(await off_loop(state, answer, state, req, job, out, cid, model), media_type="application/json")


def answer(state: ServerState, req: ChatRequest, job: Job, out: Any, cid: str, model: str) -> bytes:
    lp = None
    if req.logprobs is not None:
        lp = {"content": chat_logprobs(state.tt, list(out.output_ids), list(out.logprobs or []), req.tokens_as_ids)}
    choice: dict = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                    "spec_decode": request_spec(out.spec)}
    if req.return_token_ids:
        choice["token_ids"] = list(out.output_ids)
        choice["prompt_token_ids"] = job.prompt_ids
    body: dict = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                  "choices": [choice], "usage": usage(len(job.prompt_ids), len(out.output_ids)),
                  "spec_decode": merge_spec([out.spec], state.spec_method)}
    if req.return_token_ids:  # vLLM's chat answer: the rendered prompt's ids at the top level
        body["prompt_token_ids"] = job.prompt_ids
    return json.dumps(body, ensure_ascii=False).encode()


def _stream(state: ServerState, req: ChatRequest, job: Job, q: Any, rids: dict[int, str], cid: str,
            model: str) -> AsyncIterator[str]:
    cs = ChoiceStream()
    first: dict = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]}
    if req.return_token_ids:  # vLLM: the rendered prompt's ids on the first chunk, top level
        first["prompt_token_ids"] = job.prompt_ids

    def choice(_: int, out: Any) -> dict | None:
        text, new_ids, lps = cs.advance(out)
        if not text and not new_ids and not out.finished:
            return None
        lp = None
        if req.logprobs is not None:
            lp = {"content": chat_logprobs(state.tt, new_ids, list(lps or []), req.tokens_as_ids)}
        c: dict = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": lp,
                   "finish_reason": out.finish_reason if out.finished else None}
        if req.return_token_ids:
            c["token_ids"] = new_ids
        return c

    return stream_choices(state, q, rids, req, [job], cid, "chat.completion.chunk", model, choice, first)
