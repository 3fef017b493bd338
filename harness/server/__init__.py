"""The OpenAI-compatible HTTP server for the reference engine (FastAPI + uvicorn).

It lives in harness/ (not engine/, where DESIGN.md first placed it) so the engine package stays free of
web dependencies; it reaches the engine only through `EngineLoop`, i.e. the `LLMEngine` surface.

Contract:
- `make_app(engine, served_name=None, max_pending=256, warmup=False)` -> (FastAPI app, EngineLoop). The
  served model name defaults to the model directory as given (vLLM's default); its basename is accepted
  too. `warmup`: False = ready at once; True = the default warm-up plan (warmup.py); a `WarmupPlan` = that
  plan; a callable = `EngineLoop`'s `warmup=` as is. With a warm-up the loop runs it before serving: /health answers 503 "starting" and completions 503
  code "starting" until it is done.
- `ServerThread(app)` runs uvicorn on a loopback socket it binds itself (port 0 = a free port) in a
  background thread: `start()` returns once the server accepts connections and, unless `ready=False`,
  its warm-up is done; `wait_ready()` waits for that; `stop()` shuts it down.
- `make_app(..., options=ServerOptions(...))`: API key, CORS origins, shutdown grace, body limit
  (options.py).
- `make_proc_app(cfg, ...)` -> (app, ProcEngineLoop): the same app over an engine built from the `EngineConfig`
  in a process of its own (engine_proc.py: the step loop no longer shares the GIL with the event loop);
  `specbench serve --engine-process` (the default) serves that way.
- `serve(engine, host, port, ..., warmup=True, options, sock=None, app=None)` runs in the foreground until SIGINT /
  SIGTERM, then drains (lifecycle.py) and returns the one-line shutdown summary; `sock` is a socket
  bound beforehand (`lifecycle.bind`, so a busy port fails before the engine loads). The warm-up
  (`specbench serve --no-warmup` turns it off) starts before the server accepts connections.
Importing this package is cheap (the app, and with it torch, load at the first `make_app` / attribute
use), so `specbench serve` checks its options and binds its port (lifecycle.py, options.py) in
milliseconds before the engine is imported.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .options import ServerOptions

if TYPE_CHECKING:
    from ..adapters.loop import EngineLoop
    from .engine_proc import ProcEngineLoop
    from .warmup import WarmupPlan

__all__ = ["make_app", "make_proc_app", "ServerThread", "serve", "ServerState", "create_app", "WarmupPlan", "ServerOptions"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "ServerState", "WarmupPlan"):
        from . import app, serving, warmup

        return {"create_app": app.create_app, "ServerState": serving.ServerState, "WarmupPlan": warmup.WarmupPlan}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def served_names(model_dir: str, served_name: str | None) -> list[str]:
    if served_name:
        return [served_name]
    base = os.path.basename(os.path.normpath(model_dir))
    return [model_dir] + ([base] if base and base != model_dir else [])


def make_app(engine: Any, served_name: str | None = None, max_pending: int | None = 256,
             warmup: bool | WarmupPlan | Callable = False, options: ServerOptions | None = None
             ) -> tuple[Any, EngineLoop]:
    from ..adapters.loop import EngineLoop
    from .app import create_app
    from .serving import ServerState
    from .warmup import WarmupPlan, make_warmup

    fn: Callable | None
    if callable(warmup) and not isinstance(warmup, WarmupPlan):
        fn = warmup
    else:
        fn = None if warmup is False else make_warmup(warmup if isinstance(warmup, WarmupPlan) else None)
    loop = EngineLoop(engine, max_pending=max_pending, warmup=fn)
    state = ServerState(loop, served_names(engine.cfg.model, served_name), options or ServerOptions())
    return create_app(state), loop


def make_proc_app(cfg: Any, served_name: str | None = None, max_pending: int | None = 256,
                  warmup: bool | WarmupPlan | Callable = False, options: ServerOptions | None = None,
                  log_level: str = "warning", factory: Callable | None = None) -> tuple[Any, ProcEngineLoop]:
    """`make_app` over an engine in a process of its own (engine_proc.py), built there from `cfg` (an
    `EngineConfig`, or by the picklable `factory(cfg)`); a callable `warmup` must be picklable. Returns once the engine is built (its refusal
    raised here); the warm-up then runs in the child while /health answers 503 "starting"."""
    from .app import create_app
    from .engine_proc import ProcEngineLoop
    from .serving import ServerState

    loop = ProcEngineLoop(cfg, max_pending=max_pending, warmup=warmup, log_level=log_level, factory=factory)
    try:
        state = ServerState(loop, served_names(cfg.model, served_name), options or ServerOptions())
    except BaseException:
        loop.close()
        raise
    return create_app(state), loop


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets; with proto 0 every answer whose
        # body is a second write waits ~40 ms for a delayed ACK (Nagle)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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

    def start(self, timeout: float = 30.0, ready: bool = True) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        if ready:
            self.wait_ready(max(1.0, timeout - (time.monotonic() - t0)))
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until the app's engine loop has finished its warm-up (at once without one)."""
        state = getattr(getattr(self.server.config.app, "state", None), "sb", None)
        if state is not None and not state.loop.wait_ready(timeout):
            raise RuntimeError(f"the server on {self.url} was not ready within {timeout:.0f} s "
                               f"(warm-up: {state.loop.warmup_status()})")

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        state = getattr(getattr(self.server.config.app, "state", None), "sb", None)
        if state is not None:
            state.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def setup_logging(log_level: str) -> None:
    """The warm-up's and the engine's lines ("specbench" loggers), beside uvicorn's."""
    import logging

    class _CurrentStderr(logging.StreamHandler):
        """Writes to whatever sys.stderr is at each record, not the stream of the moment it was made: a test
        runner (or anything) that swaps and closes sys.stderr leaves no handler on a closed file."""

        @property
        def stream(self) -> Any:
            return sys.stderr

        @stream.setter
        def stream(self, _value: Any) -> None:
            pass

    lg = logging.getLogger("specbench")
    if not lg.handlers:
        h = _CurrentStderr()
        h.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        lg.addHandler(h)
        level = getattr(logging, log_level.upper(), None)
        lg.setLevel(level if isinstance(level, int) else logging.INFO)


def serve(engine: Any, host: str = "127.0.0.1", port: int = 8000, served_name: str | None = None,
          max_pending: int | None = 256, log_level: str = "info", warmup: bool | WarmupPlan = True,
          options: ServerOptions | None = None, sock: socket.socket | None = None, app: Any = None) -> str | None:
    """`engine`: an engine object (served in this process), or None with `app` already made (`make_proc_app`)."""
    from .lifecycle import bind, run

    setup_logging(log_level)
    opts = options or ServerOptions()
    sock = sock if sock is not None else bind(host, port)
    if app is None:
        app, _ = make_app(engine, served_name, max_pending, warmup, opts)
    return run(app, sock, opts, log_level)
