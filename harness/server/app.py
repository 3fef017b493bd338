"""The FastAPI application: OpenAI-compatible routes plus the vLLM-style extras lm-eval and dashboards use.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /health, GET /metrics, GET /version.
Contract: every error is an OpenAI-style JSON error (errors.py); auth, CORS, request ids and the body
limit are middleware.py's; /health is 503 `{"status": "starting", "ready": false, "warmup"}`
(Retry-After) while the warm-up runs (completions meanwhile: 503 code "starting"), 200 `{"status": "ok",
"ready": true, "warmup"}` once it is done (or when there is none), 503 `{"status": "draining"}` once a
shutdown began, and 503 once the loop has stopped; /metrics is metrics.py's (prometheus_client, vLLM's
names). No route does slow work on the event loop: /tokenize and /detokenize run on the worker threads
like the generation routes' preparation (serving.off_loop), so /health answers while any one request
tokenizes, renders a template or waits for the engine's lock.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specbench import __version__

from .chat import create_chat
from .completions import create_completion
from .errors import STARTING_RETRY_S, APIError, install_error_handlers
from .middleware import install as install_middleware
from .protocol import _messages, get_bool, is_int, parse_json
from .serving import ServerState, off_loop


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specbench", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sb = state
    install_error_handlers(app)
    install_middleware(app, state.options, state)

    @app.get("/health")
    async def health() -> Any:
        if not state.loop.alive:
            return APIError("the engine loop has stopped", 503, "service_unavailable_error").response()
        if state.draining:
            return JSONResponse({"status": "draining", "ready": False, "in_flight": state.loop.num_pending},
                                status_code=503)
        warm = state.loop.warmup_status()
        if not state.loop.ready:
            return JSONResponse({"status": "starting", "ready": False, "warmup": warm}, status_code=503,
                                headers={"Retry-After": str(STARTING_RETRY_S)})
        return JSONResponse({"status": "ok", "ready": True, "warmup": warm, "last_error": state.loop.last_error})

    @app.get("/version")
    async def version() -> Any:
        return {"version": __version__, "engine": "specbench"}

    @app.get("/v1/models")
    async def models() -> Any:
        tau = state.engine.describe().get("synthetic_tau")  # drawn acceptance: the gates refuse such a server
        data = [{"id": n, "object": "model", "created": state.created, "owned_by": "specbench",
                 "root": state.engine.cfg.model, "max_model_len": state.engine.max_model_len,
                 **({"synthetic_tau": tau} if tau is not None else {})}
                for n in state.served_names[:1]]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await create_chat(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return await off_loop(state, _tokenize, state, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return await off_loop(state, _detokenize, state, await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        tok = state.tokenizer
        cfg = tok.config
        return {"tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
                "eos_token": tok.eos_token, "bos_token": _special(cfg.get("bos_token")),
                "pad_token": _special(cfg.get("pad_token")), "unk_token": _special(cfg.get("unk_token")),
                "chat_template": tok.chat_template, "model_max_length": state.engine.max_model_len,
                "vocab_size": tok.vocab_size, "add_bos_token": bool(cfg.get("add_bos_token", False))}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Any:
        """vLLM's route: forget every cached block; 409 while a running request holds one."""
        if not await off_loop(state, state.engine.reset_prefix_cache):
            return APIError("running requests hold cached blocks; retry when idle", 409, "conflict_error").response()
        return JSONResponse({"reset": True})

    @app.get("/metrics")
    async def metrics() -> Any:
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    return app


def _tokenize(state: ServerState, raw: bytes) -> dict:
    body = parse_json(raw)
    state.check_model(body.get("model"))
    if "messages" in body:
        from .chat import render_chat

        text = render_chat(state, _messages(body["messages"]), get_bool(body, "add_generation_prompt", True))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(f"prompt={prompt!r:.80} is invalid: expected a string (or send messages=[...])",
                           param="prompt")
        text = prompt
    ids = state.to_ids(text) if text else []
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": None}


def _detokenize(state: ServerState, raw: bytes) -> dict:
    body = parse_json(raw)
    state.check_model(body.get("model"))
    toks = body.get("tokens")
    if not isinstance(toks, list) or not all(is_int(t) and t >= 0 for t in toks):
        raise APIError(f"tokens={toks!r:.80} is invalid: expected a list of non-negative token ids",
                       param="tokens")
    state.check_ids("tokens", toks)
    return {"prompt": state.tokenizer.decode(toks, skip_special_tokens=False)}


def _special(v: object) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None
