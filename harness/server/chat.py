"""POST /v1/chat/completions: the tokenizer's chat template, chat-format logprobs, SSE streaming.

Contract: messages are rendered with the model's chat template (add_generation_prompt by default) and
tokenized by the server; max_tokens / max_completion_tokens default to the rest of the context.
`logprobs: true` + `top_logprobs: k` returns chat-format logprobs. Streaming sends a role delta first,
then content deltas (one per engine delta), a finish event, the usage event when asked, `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .completions import sse
from .errors import APIError
from .formatting import chat_logprobs, merge_spec, request_spec, usage
from .protocol import ChatRequest, parse_chat, parse_json
from .serving import ChoiceStream, Job, ServerState, abort_task, admit, deltas, gather, new_id, sampling


def build_job(state: ServerState, req: ChatRequest) -> Job:
    try:
        text = state.tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt)
    except Exception as e:  # a template that cannot render these messages is the request's problem
        raise APIError(f"messages cannot be rendered with the chat template: {e}", param="messages") from e
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


async def create_chat(state: ServerState, request: Request) -> Any:
    req = parse_chat(parse_json(await request.body()))
    model = state.check_model(req.model)
    job = build_job(state, req)
    q, rids = admit(state, [job], "chatcmpl")
    cid = new_id("chatcmpl")
    if req.stream:
        return StreamingResponse(_stream(state, req, job, q, rids, cid, model), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=abort_task(state, rids))
    out = (await gather(state, q, rids, request))[0]
    lp = None
    if req.logprobs is not None:
        lp = {"content": chat_logprobs(state.tt, list(out.output_ids), list(out.logprobs or []), req.tokens_as_ids)}
    choice: dict = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                    "spec_decode": request_spec(out.spec)}
    if req.return_token_ids:
        choice["token_ids"] = list(out.output_ids)
        choice["prompt_token_ids"] = job.prompt_ids
    return JSONResponse({"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                         "choices": [choice], "usage": usage(len(job.prompt_ids), len(out.output_ids)),
                         "spec_decode": merge_spec([out.spec], state.spec_method)})


async def _stream(state: ServerState, req: ChatRequest, job: Job, q: Any, rids: dict[int, str], cid: str,
                  model: str) -> AsyncIterator[str]:
    created = int(time.time())
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    cs = ChoiceStream(job.params.stop)
    n_prompt, n_gen, spec = len(job.prompt_ids), 0, None
    yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]})
    try:
        async for _, out in deltas(state, q, rids):
            text, new_ids, lps = cs.advance(out)
            n_gen = len(out.output_ids)
            if not text and not new_ids and not out.finished:
                continue
            lp = None
            if req.logprobs is not None:
                lp = {"content": chat_logprobs(state.tt, new_ids, list(lps or []), req.tokens_as_ids)}
            choice: dict = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": lp,
                            "finish_reason": out.finish_reason if out.finished else None}
            if req.return_token_ids:
                choice["token_ids"] = new_ids
            chunk: dict = {**head, "choices": [choice]}
            if req.continuous_usage:
                chunk["usage"] = usage(n_prompt, n_gen)
            if out.finished:
                spec = out.spec
            yield sse(chunk)
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage(n_prompt, n_gen),
                       "spec_decode": merge_spec([spec], state.spec_method)})
    except APIError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"
