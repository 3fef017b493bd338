"""Start-up and shutdown of a foreground server: binding first, draining on SIGTERM / SIGINT.

Contract:
- `bind(host, port)` binds the listening socket before anything slow is loaded, so a busy port fails in
  milliseconds with `BindError` (one line naming the address and what to do); `specbench serve` exits 3.
- `run(app, sock, options, log_level)` serves on that socket until SIGTERM or SIGINT. Then: /health
  answers 503 "draining", new generation requests 503 `shutting_down`, the listening socket closes,
  requests in flight run to their end for up to `options.shutdown_timeout` seconds, whatever is left is
  cancelled (its engine requests aborted, their KV freed; a stream gets an error event with code
  `shutting_down` and `[DONE]`, a waiting client a 503; a chat template still rendering has its worker
  process killed, and its client gets the 503), and `run` returns the summary line (the caller
  writes it):
  `shut down on SIGTERM in 1.2 s: 3 in-flight requests finished, 1 aborted (--shutdown-timeout 30 s)`.
  Nothing is re-raised (uvicorn re-raises the captured signal by default: a KeyboardInterrupt traceback
  on SIGINT, death by SIGTERM), so the process exits 0. A second SIGINT skips the grace period.
  uvicorn's own shutdown lines are silenced so that the summary is the one line a shutdown writes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from .options import ServerOptions

HANDLED = (signal.SIGINT, signal.SIGTERM)


class BindError(OSError):
    """The listening socket could not be bound (port in use, no permission, unknown host)."""


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY (see ServerThread)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        addr = f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise BindError(e.errno, f"--port={port} is busy: another process listens on {addr} (stop it, or "
                                     "pick another --port; --port 0 takes a free one)") from None
        if e.errno == errno.EACCES:
            raise BindError(e.errno, f"--port={port}: no permission to listen on {addr} (ports below 1024 "
                                     "need privileges; pick a higher --port)") from None
        raise BindError(e.errno or 0, f"--host={host!r} --port={port}: cannot listen there ({e.strerror or e}); "
                                      "expected an address of this machine such as 127.0.0.1 or 0.0.0.0") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self.state = state
        self.signal_name: str | None = None
        self.t_signal = 0.0
        self.in_flight_at_signal = 0
        self.aborted_before = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name
            self.t_signal = time.monotonic()
            self.in_flight_at_signal = self.state.loop.num_pending
            self.aborted_before = _aborted(self.state)
            self.state.draining = True
            timer = threading.Timer(self.state.options.shutdown_timeout, self._grace_over)
            timer.daemon = True
            timer.start()
            for name in ("uvicorn.error", "uvicorn"):  # the summary line is the shutdown's one line
                logging.getLogger(name).setLevel(logging.CRITICAL)
        super().handle_exit(sig, frame)


    def _grace_over(self) -> None:
        """What still runs is cancelled: engine requests, and chat templates still rendering (their workers killed)."""
        self.state.loop.cancel_all("the server is shutting down: the grace period (--shutdown-timeout) ran out")
        self.state.templates.close()


def _aborted(state: Any) -> int:
    return int(state.metrics.aborts)


def run(app: Any, sock: socket.socket, options: ServerOptions, log_level: str = "info") -> str | None:
    state = app.state.sb
    cfg = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug", lifespan="off",
                         # our timer cancels the requests at the deadline; uvicorn's cut comes 2 s after that
                         timeout_graceful_shutdown=math.ceil(options.shutdown_timeout) + 2)
    server = DrainingServer(cfg, state)
    try:
        server.run(sockets=[sock])
    finally:
        state.loop.close()
        state.close()  # the template workers killed: a render waiting on one returns, nothing outlives the server
    if server.signal_name is None:
        return None
    aborted = _aborted(state) - server.aborted_before
    line = (f"shut down on {server.signal_name} in {time.monotonic() - server.t_signal:.1f} s: "
            f"{max(0, server.in_flight_at_signal - aborted)} in-flight requests finished, {aborted} aborted "
            f"(--shutdown-timeout {options.shutdown_timeout:g} s)")
    return line
