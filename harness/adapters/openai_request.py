"""What the `openai` adapter sends: the URL split and the request body of each generation route.

- `split_url`: base_url (the server root, .../v1, or a full .../v1/[chat/]completions URL) ->
  (root, api = root + /v1).
- `completions_body`: /v1/completions (text and token-id prompts) and /v1/chat/completions (messages);
  `stream_options` when streaming, vLLM's `return_token_ids` / `return_tokens_as_token_ids` with extras
  on (never to llama.cpp), then the sampler settings, then the caller's `extra_body` (which wins).
- `native_body`: llama.cpp's own /completion (`n_predict`, `return_tokens`, `n_probs`).
- `pin_samplers`: explicit top_k / top_p / min_p per dialect, so that no server default (llama.cpp:
  top_k 40, min_p 0.05) ever applies; llama.cpp's `cache_prompt` from `GenRequest.prompt_cache`, and on
  vLLM `prompt_cache=False` as a fresh `cache_salt` (unless extra_body sets one).

Pure functions of the request and the adapter's settings: openai_api.py owns the transport, retries and
the dialect probe, and passes the probed dialect in.
"""

from __future__ import annotations

import uuid
from typing import Any

from .base import GenRequest


def split_url(base_url: str) -> tuple[str, str]:
    url = base_url.strip().rstrip("/")
    for suffix in ("/v1/chat/completions", "/v1/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
            break
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url={base_url!r} is invalid: expected http(s)://host:port[/v1]")
    return url, url + "/v1"



def pin_samplers(body: dict, req: GenRequest, dialect: str, extras: bool, extra_body: dict) -> None:
    """Explicit sampler settings: a server default (llama.cpp: top_k 40, min_p 0.05) must never apply."""
    if dialect == "llamacpp":
        body["top_k"] = req.top_k if req.top_k and req.top_k > 0 else 0
        body["min_p"] = 0.0
        body["top_p"] = req.top_p
        if req.prompt_cache is not None:
            body["cache_prompt"] = bool(req.prompt_cache)
    elif dialect in ("vllm", "specbench", "sglang") and extras:
        body["top_k"] = req.top_k if req.top_k and req.top_k > 0 else -1
        body["min_p"] = 0.0
    if dialect in ("vllm", "specbench") and req.prompt_cache is False and "cache_salt" not in extra_body:
        body["cache_salt"] = f"specbench-cold-{uuid.uuid4().hex}"  # no block shared with any other request


def native_body(req: GenRequest, dialect: str, *, stream: bool, extras: bool, extra_body: dict) -> dict:
    """llama.cpp's own /completion request."""
    body: dict[str, Any] = {"prompt": req.prompt, "n_predict": req.max_tokens, "temperature": req.temperature,
                            "stream": stream, "return_tokens": True}
    pin_samplers(body, req, dialect, extras, extra_body)
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.logprobs is not None:
        body["n_probs"] = req.logprobs
    penalties(body, req, "repeat_penalty")
    if req.logit_bias:  # llama.cpp's own form: [[token id, bias], ...]
        body["logit_bias"] = [[int(t), float(b)] for t, b in req.logit_bias.items()]
    body.update(extra_body)
    return body


def penalties(body: dict, req: GenRequest, repetition: str = "repetition_penalty") -> None:
    """The request's penalties where set (vLLM's repetition_penalty; llama.cpp names it repeat_penalty), its logit
    bias (OpenAI's form: {"token id": bias}) and min_tokens (vLLM's; llama.cpp has none: a gate sees it ignored)."""
    if req.repetition_penalty != 1.0:
        body[repetition] = req.repetition_penalty
    if req.presence_penalty:
        body["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        body["frequency_penalty"] = req.frequency_penalty
    if req.logit_bias:
        body["logit_bias"] = {str(int(t)): float(b) for t, b in req.logit_bias.items()}
    if req.min_tokens:
        body["min_tokens"] = req.min_tokens


def completions_body(req: GenRequest, model: str, dialect: str, *, stream: bool, continuous_usage: bool,
                     extras: bool, extra_body: dict) -> dict:
    """The /v1/completions (prompt) or /v1/chat/completions (messages) request."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "stream": stream}
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    if req.top_k:
        body["top_k"] = req.top_k
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.stop_token_ids:  # vLLM / the bundled server; llama.cpp's native route has none (a gate sees it ignored)
        body["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        body["ignore_eos"] = True
    penalties(body, req, "repeat_penalty" if dialect == "llamacpp" else "repetition_penalty")
    if stream:
        body["stream_options"] = {"include_usage": True}
        if continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
    if req.logprobs is not None:
        if req.messages is not None:
            body["logprobs"], body["top_logprobs"] = True, req.logprobs
        else:
            body["logprobs"] = req.logprobs
    if extras and dialect != "llamacpp":
        body["return_token_ids"] = True
        if req.logprobs is not None:
            body["return_tokens_as_token_ids"] = True
    pin_samplers(body, req, dialect, extras, extra_body)
    body.update(extra_body)
    return body
