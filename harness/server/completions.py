"""POST /v1/completions: text or token-id prompts (one or many), echo scoring, legacy logprobs, SSE.

Contract (beyond protocol.py's validation):
- One choice per prompt, `index` = the prompt's position. `text` never contains a stop string unless
  include_stop_str_in_output; with echo it starts with the prompt (decoded, special tokens kept).
- echo + logprobs returns prompt logprobs (first position None) followed by the generated tokens';
  echo with max_tokens=0 is scoring: the engine runs one step to get prompt logprobs, and the token it
  samples is dropped (completion_tokens 0, finish_reason "length").
- `spec_decode` beside `usage` sums the choices' speculative-decoding metrics; each choice carries its
  own. return_token_ids adds `token_ids` / `prompt_token_ids` to each choice (vLLM's field names).
- Streaming: one SSE event per engine delta per choice (a delta may carry several tokens under
  speculation); with stream_options.include_usage a final event with `choices: []`, usage and
  spec_decode; continuous_usage_stats adds running usage to every event; then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from .formatting import legacy_logprobs, merge_spec, request_spec, usage
from .protocol import CompletionRequest, parse_completion, parse_json
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


def build_jobs(state: ServerState, req: CompletionRequest) -> list[Job]:
    jobs = []
    for i, p in enumerate(req.prompts):
        ids = state.to_ids(p, i)
        text = p if isinstance(p, str) else state.tokenizer.decode(ids, skip_special_tokens=False)
        scoring = req.max_tokens == 0
        state.check_len(len(ids), max(1, req.max_tokens or 16), i)
        plp = req.logprobs if (req.echo and req.logprobs is not None) else None
        if scoring:
            params = sampling(req, 1, None, plp).with_(temperature=0.0, stop=(), stop_token_ids=())
        else:
            params = sampling(req, req.max_tokens or 16, req.logprobs, plp)
        jobs.append(Job(i, ids, text, params, scoring))
    return jobs


def _choice_logprobs(state: ServerState, req: CompletionRequest, job: Job, out: Any, gen_ids: list[int],
                     gen_lps: list, offset0: int) -> dict | None:
    if req.logprobs is None:
        return None
    ids, lps = [], []
    if req.echo:
        plp = out.prompt_logprobs or [None] * len(job.prompt_ids)
        ids += job.prompt_ids
        lps += list(plp) + [None] * (len(job.prompt_ids) - len(plp))
    ids += gen_ids
    lps += gen_lps
    return legacy_logprobs(state.tt, ids, lps, req.tokens_as_ids, offset0)


def final_choice(state: ServerState, req: CompletionRequest, job: Job, out: Any) -> tuple[dict, int]:
    gen_ids = [] if job.scoring_only else list(out.output_ids)
    gen_lps = [] if job.scoring_only else list(out.logprobs or [])
    text = "" if job.scoring_only else out.text
    if req.echo:
        text = job.prompt_text + text
    choice: dict = {"index": job.index, "text": text,
                    "logprobs": _choice_logprobs(state, req, job, out, gen_ids, gen_lps, 0),
                    "finish_reason": "length" if job.scoring_only else out.finish_reason,
                    "stop_reason": None if job.scoring_only else out.stop_reason,
                    "spec_decode": request_spec(out.spec)}
    if req.return_token_ids:
        choice["token_ids"] = gen_ids
        choice["prompt_token_ids"] = job.prompt_ids
    return choice, len(gen_ids)


def prepare(state: ServerState, raw: bytes, base: str, loop: asyncio.AbstractEventLoop, received: float | None
            ) -> tuple[CompletionRequest, str, list[Job], asyncio.Queue, dict[int, str]]:
    """Parse, validate, tokenize and admit: on a worker thread (serving.off_loop)."""
    req = parse_completion(parse_json(raw), state.options)
    model = state.check_model(req.model)
    jobs = build_jobs(state, req)
    q, rids = admit(state, jobs, base, loop, received)
    return req, model, jobs, q, rids


def answer(state: ServerState, req: CompletionRequest, jobs: list[Job], finals: dict[int, Any], cid: str,
           model: str) -> bytes:
    choices, n_gen = [], 0
    for job in jobs:
        c, n = final_choice(state, req, job, finals[job.index])
        choices.append(c)
        n_gen += n
    body = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(sum(len(j.prompt_ids) for j in jobs), n_gen),
            "spec_decode": merge_spec([finals[j.index].spec for j in jobs], state.spec_method)}
    return json.dumps(body, ensure_ascii=False).encode()


async def create_completion(state: ServerState, request: Request) -> Any:
    cid, (req, model, jobs, q, rids) = await prepared(state, request, "cmpl", prepare)
    if req.stream:
        return event_stream(state, rids, _stream(state, req, jobs, q, rids, cid, model))
    finals = await gather(state, q, rids, request)
    return Response(await off_loop(state, answer, state, req, jobs, finals, cid, model),
                    media_type="application/json")


def _stream(state: ServerState, req: CompletionRequest, jobs: list[Job], q: Any, rids: dict[int, str],
            cid: str, model: str) -> AsyncIterator[str]:
    streams = {j.index: ChoiceStream() for j in jobs}
    offsets = {j.index: 0 for j in jobs}
    started: set[int] = set()

    def choice(idx: int, out: Any) -> dict | None:
        job = jobs[idx]
        if job.scoring_only:
            if not out.finished:
                return None
            c, _ = final_choice(state, req, job, out)
            c.pop("spec_decode")
            return c
        text, new_ids, lps = streams[idx].advance(out)
        prompt_lp: list = []
        if req.echo and idx not in started:
            text = job.prompt_text + text
            plp = out.prompt_logprobs or [None] * len(job.prompt_ids)
            prompt_lp = list(zip(job.prompt_ids, plp, strict=False))
        started.add(idx)
        lp = None
        if req.logprobs is not None:
            ids = [t for t, _ in prompt_lp] + new_ids
            entries = [e for _, e in prompt_lp] + list(lps or [])
            lp = legacy_logprobs(state.tt, ids, entries, req.tokens_as_ids, offsets[idx])
            offsets[idx] += sum(len(state.tt(t)) for t in ids)
        if not text and not new_ids and not out.finished:
            return None
        c = {"index": idx, "text": text, "logprobs": lp,
             "finish_reason": out.finish_reason if out.finished else None,
             "stop_reason": out.stop_reason if out.finished else None}
        if req.return_token_ids:
            c["token_ids"] = new_ids
        return c

    return stream_choices(state, q, rids, req, jobs, cid, "text_completion", model, choice)
