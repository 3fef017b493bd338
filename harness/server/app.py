"""The FastAPI application: OpenAI-compatible routes plus the vLLM-style extras lm-eval and dashboards use.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /health, GET /metrics, GET /version.
Contract: every error is an OpenAI-style JSON error (errors.py); a body larger than max_body_bytes is
refused with 413 before it is read; /health is 503 `{"status": "starting", "ready": false, "warmup"}`
(Retry-After) while the warm-up runs (completions meanwhile: 503 code "starting"), 200 `{"status": "ok",
"ready": true, "warmup"}` once it is done (or when there is none), and 503 once the loop has stopped;
/metrics is Prometheus text with vLLM's metric names (engine/metrics.py) plus
`specbench:requests_in_flight`; its gauges are refreshed at each scrape, so they read zero once every
request has finished or was aborted (a client that disconnected included).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from specbench import __version__

from .chat import create_chat
from .completions import create_completion
from .errors import STARTING_RETRY_S, APIError, install_error_handlers
from .protocol import _messages, get_bool, is_int, parse_json
from .serving import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specbench", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sb = state
    install_error_handlers(app)

    app.add_middleware(BodyLimit, state=state)

    @app.get("/health")
    async def health() -> Any:
        if not state.loop.alive:
            return APIError("the engine loop has stopped", 503, "service_unavailable_error").response()
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
        data = [{"id": n, "object": "model", "created": state.created, "owned_by": "specbench",
                 "root": state.engine.cfg.model, "max_model_len": state.engine.max_model_len}
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
        body = parse_json(await request.body())
        state.check_model(body.get("model"))
        if "messages" in body:
            text = state.tokenizer.apply_chat_template(_messages(body["messages"]),
                                                       add_generation_prompt=get_bool(body, "add_generation_prompt",
                                                                                      True))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise APIError(f"prompt={text!r:.80} is invalid: expected a string (or send messages=[...])",
                               param="prompt")
        ids = state.tokenizer.encode(text)
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        body = parse_json(await request.body())
        state.check_model(body.get("model"))
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(is_int(t) and t >= 0 for t in toks):
            raise APIError(f"tokens={toks!r:.80} is invalid: expected a list of non-negative token ids",
                           param="tokens")
        return {"prompt": state.tokenizer.decode(toks, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        tok = state.tokenizer
        cfg = tok.config
        return {"tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
                "eos_token": tok.eos_token, "bos_token": _special(cfg.get("bos_token")),
                "pad_token": _special(cfg.get("pad_token")), "unk_token": _special(cfg.get("unk_token")),
                "chat_template": tok.chat_template, "model_max_length": state.engine.max_model_len,
                "vocab_size": tok.vocab_size, "add_bos_token": bool(cfg.get("add_bos_token", False))}

    @app.get("/metrics")
    async def metrics() -> Any:
        state.loop.refresh_gauges()  # gauges as they are now, also after an abort on an idle engine
        text = state.engine.metrics.prometheus(state.model_name)
        text += ("# HELP specbench:requests_in_flight Requests admitted by the server and not finished.\n"
                 "# TYPE specbench:requests_in_flight gauge\n"
                 f'specbench:requests_in_flight{{model_name="{state.model_name}"}} {state.loop.num_pending}\n')
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


class BodyLimit:
    """Pure ASGI (BaseHTTPMiddleware would hide client disconnects from the handlers): a declared
    Content-Length over the limit is refused before reading; a chunked body is counted as it arrives."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    def _error(self, n: int) -> APIError:
        return APIError(f"the request body has {n} bytes or more: at most {self.state.max_body_bytes} are "
                        "accepted", 413, "invalid_request_error", None, "request_too_large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.max_body_bytes
        n = dict(scope.get("headers") or []).get(b"content-length", b"")
        if n.isdigit() and int(n) > limit:
            return await self._error(int(n)).response()(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg.get("type") == "http.request":
                seen += len(msg.get("body") or b"")
                if seen > limit:
                    raise self._error(seen)
            return msg

        await self.app(scope, counted, send)


def _special(v: object) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None
