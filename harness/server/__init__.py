"""The OpenAI-compatible HTTP server for the reference engine (FastAPI + uvicorn).

It lives in harness/ (not engine/, where DESIGN.md first placed it) so the engine package stays free of
web dependencies; it reaches the engine only through `EngineLoop`, i.e. the `LLMEngine` surface.

Contract:
- `make_app(engine, served_name=None, max_pending=256)` -> (FastAPI app, EngineLoop). The served model
  name defaults to the model directory as given (vLLM's default); its basename is accepted too.
- `ServerThread(app)` runs uvicorn on a loopback socket it binds itself (port 0 = a free port) in a
  background thread: `start()` returns once the server accepts connections; `stop()` shuts it down.
- `serve(engine, host, port, ...)` runs in the foreground until SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from ..adapters.loop import EngineLoop
from .app import create_app
from .serving import ServerState

__all__ = ["make_app", "ServerThread", "serve", "ServerState", "create_app"]


def served_names(model_dir: str, served_name: str | None) -> list[str]:
    if served_name:
        return [served_name]
    base = os.path.basename(os.path.normpath(model_dir))
    return [model_dir] + ([base] if base and base != model_dir else [])


def make_app(engine: Any, served_name: str | None = None, max_pending: int | None = 256) -> tuple[Any, EngineLoop]:
    loop = EngineLoop(engine, max_pending=max_pending)
    state = ServerState(loop, served_names(engine.cfg.model, served_name))
    return create_app(state), loop


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specbench-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(engine: Any, host: str = "127.0.0.1", port: int = 8000, served_name: str | None = None,
          max_pending: int | None = 256, log_level: str = "info") -> None:
    import uvicorn

    app, loop = make_app(engine, served_name, max_pending)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                    timeout_graceful_shutdown=5)
    finally:
        loop.close()
