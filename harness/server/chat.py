"""POST /v1/chat/completions: the tokenizer's chat template, chat-format logprobs, SSE streaming.

Contract: messages are rendered with the model's chat template (add_generation_prompt by default) in
jinja2's immutable sandbox (`render_chat`) and tokenized by the server, on a worker thread; max_tokens / max_completion_tokens default to the rest of the context.
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
    """The chat template in jinja2's immutable sandbox (engine/tokenizer.py). A template that reaches for
    Python internals is the model directory's fault, not the request's: 500 chat_template_unsafe, naming
    what it tried; a template that refuses these messages (raise_exception, a bad field) is a 400."""
    from jinja2.exceptions import SecurityError

    try:
        return state.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except SecurityError as e:
        raise APIError(f"the model's chat template tried something the sandbox refuses ({e}): it is not "
                       "rendered; fix tokenizer_config.json's chat_template", 500, "internal_error", None,
                       "chat_template_unsafe") from e
    except Exception as e:  # a template that cannot render these messages is the request's problem
        raise APIError(f"messages cannot be rendered with the chat template: {type(e).__name__}: {e}",
                       param="messages") from e


PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
         {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]


def probe_template(tokenizer: Any) -> str | None:
    """At start-up: the chat template rendered once on a plain conversation in the sandbox. Returns the
    problem as one line when it reaches for Python internals or does not compile, else None (a template
    that merely refuses this conversation is left to answer requests with its 400)."""
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    try:
        tokenizer.apply_chat_template(PROBE, add_generation_prompt=True)
    except SecurityError as e:
        return (f"the chat template tried something jinja2's sandbox refuses ({e}); it would run code in the "
                "server: fix tokenizer_config.json's chat_template")
    except TemplateSyntaxError as e:
        return f"the chat template does not compile (line {e.lineno}: {e.message}): fix tokenizer_config.json"
    except Exception:
        return None
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
    req = parse_chat(parse_json(raw))
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
    cs = ChoiceStream(job.params.stop)
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
