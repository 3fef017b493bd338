"""Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the handlers).

Contract, outermost first (`install`):
- `RequestId`: a client's `x-request-id` (1..128 printable ASCII characters, no spaces) is kept as the
  request's id: the response's `id` is built from it, the engine's request ids carry it, and the header
  is echoed on every answer (errors included). Without one the server makes one and echoes it. A bad
  header is a 400 naming `x-request-id`. The time the request arrived is kept for the latency metrics.
- CORS (starlette's `CORSMiddleware`) when `allowed_origins` is set, so a 401 still carries CORS headers
  and a preflight never needs the key.
- `ApiKey`: with a key set, every route except `/health` (and `/metrics` unless `metrics_need_key`)
  answers 401 `{"error": {"type": "authentication_error", "code": "invalid_api_key"}}` with
  `WWW-Authenticate: Bearer` unless `Authorization: Bearer <key>` matches (constant-time compare).
- `BodyLimit`: a declared Content-Length over the limit is refused with 413 before reading; a chunked
  body is counted as it arrives.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from .errors import APIError
from .options import ServerOptions

MAX_REQUEST_ID = 128
OPEN_PATHS = ("/health",)


def install(app: FastAPI, opts: ServerOptions, state: Any) -> None:
    """`state.max_body_bytes` is read per request (a test may lower it on a running server)."""
    # starlette wraps in reverse order of addition: the last added is the outermost
    app.add_middleware(BodyLimit, state=state)
    if opts.api_key is not None:
        open_paths = OPEN_PATHS + (() if opts.metrics_need_key else ("/metrics",))
        app.add_middleware(ApiKey, key=opts.api_key, open_paths=open_paths)
    if opts.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(opts.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"],
                           allow_credentials="*" not in opts.allowed_origins)
    app.add_middleware(RequestId)


def _valid_request_id(v: str) -> bool:
    return 0 < len(v) <= MAX_REQUEST_ID and all(33 <= ord(c) <= 126 for c in v)


class RequestId:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        raw = dict(scope.get("headers") or []).get(b"x-request-id")
        given = raw.decode("latin-1") if raw is not None else None
        rid = given if given is not None and _valid_request_id(given) else uuid.uuid4().hex
        echo = rid.encode("latin-1")

        async def send_with_id(msg: MutableMapping[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                headers = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"]
                msg = {**msg, "headers": [*headers, (b"x-request-id", echo)]}
            await send(msg)

        if given is not None and rid != given:
            err = APIError(f"x-request-id={given[:40]!r} is invalid: expected 1..{MAX_REQUEST_ID} printable ASCII "
                           "characters without spaces", param="x-request-id", code="invalid_value")
            return await err.response()(scope, receive, send_with_id)
        state = scope.setdefault("state", {})
        state["request_id"], state["received"], state["client_request_id"] = rid, t0, given is not None
        await self.app(scope, receive, send_with_id)


class ApiKey:
    def __init__(self, app: Any, key: str, open_paths: tuple[str, ...]) -> None:
        self.app, self.open_paths = app, open_paths
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"authorization")
        if got is not None and hmac.compare_digest(got.strip(), self.expected):
            return await self.app(scope, receive, send)
        what = ("no API key was sent" if got is None
                else "the API key is wrong" if got.lower().startswith(b"bearer ")
                else "the Authorization header is not 'Bearer <key>'")
        err = APIError(f"{what}: this server requires Authorization: Bearer <key> (--api-key or "
                       "$SPECBENCH_API_KEY)", 401, "authentication_error", None, "invalid_api_key")
        resp = err.response()
        resp.headers["WWW-Authenticate"] = "Bearer"
        await resp(scope, receive, send)


class BodyLimit:
    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    @property
    def limit(self) -> int:
        return int(self.state.max_body_bytes)

    def _error(self, n: int) -> APIError:
        return APIError(f"the request body has {n} bytes or more: at most {self.limit} are accepted", 413,
                        "invalid_request_error", None, "request_too_large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        n = dict(scope.get("headers") or []).get(b"content-length", b"")
        if n.isdigit() and int(n) > self.limit:
            return await self._error(int(n)).response()(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg.get("type") == "http.request":
                seen += len(msg.get("body") or b"")
                if seen > self.limit:
                    raise self._error(seen)
            return msg

        await self.app(scope, counted, send)
