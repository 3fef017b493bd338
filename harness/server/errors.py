"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Contract: every refusal the server makes goes through `APIError`; handlers installed by
`install_error_handlers` turn framework errors (unknown route, wrong method) and any unexpected
exception into the same JSON shape, so a client never sees a stack trace or a non-JSON error and the
server never goes down for one bad request. Engine errors map as: ConfigError -> 400
invalid_request_error, AdmissionError -> 400 context_length_exceeded (the request can never fit),
Overloaded -> 503 with Retry-After, NotReady (the warm-up is still running) -> 503 code "starting" with
Retry-After: 5, Cancelled (a shutdown's grace period ran out) -> 503 code "shutting_down", an engine
step failure -> 500.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbench.engine import AdmissionError, ConfigError

from ..adapters.loop import Cancelled, EngineFailure, NotReady, Overloaded

log = logging.getLogger("specbench.server")
STARTING_RETRY_S = 5  # Retry-After while the warm-up runs


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.retry_after = retry_after if retry_after is not None else (1 if status == 503 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_PARAM = re.compile(r"^([a-z_][a-z_0-9.]*)=")


def from_engine(e: Exception) -> APIError:
    """Translate an engine exception raised while admitting a request."""
    msg = str(e)
    if isinstance(e, Overloaded):
        return APIError(msg, 503, "service_unavailable_error", None, "overloaded")
    if isinstance(e, Cancelled):
        return APIError(msg, 503, "service_unavailable_error", None, "shutting_down")
    if isinstance(e, NotReady):
        return APIError(msg, 503, "service_unavailable_error", None, "starting", retry_after=STARTING_RETRY_S)
    if isinstance(e, AdmissionError):
        code = "context_length_exceeded" if "context" in msg else "request_too_large"
        return APIError(msg, 400, "invalid_request_error", "prompt" if "prompt" in msg else "max_tokens", code)
    if isinstance(e, ConfigError):
        m = _PARAM.match(msg)
        return APIError(msg, 400, "invalid_request_error", m.group(1) if m else None, "invalid_value")
    if isinstance(e, EngineFailure):
        return APIError(msg, 500, "internal_error", None, "engine_failure")
    return APIError(f"{type(e).__name__}: {msg}", 500, "internal_error", None, "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return APIError(str(exc.detail), exc.status_code, kind, None, None).response()

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return from_engine(exc).response()
