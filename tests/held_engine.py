"""An engine held on a gate the test opens, for tests that must not race a clock (`HeldEngine`), and
`specbench serve` running one.

`python -c LAUNCH GATE_DIR MODE serve-args...` (see `launch_cmd`) runs the real `specbench serve` (engine process
on) with two changes: the engine process builds `HeldEngine` (the real `LLMEngine`, whose `step()` waits while the
gate is shut and every request it holds already has a token), and with MODE "signal" the server opens the gate
right after its own SIGTERM / SIGINT handler ran (so the in-flight count it takes at the signal sees the
request). MODE "never": the gate stays shut, so a request runs until the server cancels it (the grace period's end).
The gate is a file (GATE_DIR/open): it crosses from the server process to the engine process it spawned.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOLD_LIMIT_S = 300.0  # a gate nobody opens fails the step (the request's error names it) instead of hanging the test
POLL_S = 0.005

LAUNCH = ("import sys; sys.path.insert(0, {tests!r}); import held_engine; "
          "held_engine.main(sys.argv[1], sys.argv[2], sys.argv[3:])")


def launch_cmd(gate_dir: str | Path, mode: str, *serve_args: str) -> list[str]:
    return [sys.executable, "-c", LAUNCH.format(tests=str(Path(__file__).resolve().parent)), str(gate_dir), mode,
            *serve_args]


class HeldEngine:
    """`LLMEngine` whose `step()` waits, before it runs, while the gate file is missing and every request the
    engine holds already has an output token (none waits for its first one): each request's first token goes
    out (its client sees the stream start), the rest only once the gate opens. An abort the engine applies
    (the grace period's cancel) finishes the request and so ends the wait; a new arrival gets its first token.
    In process too: `EngineLoop(HeldEngine(engine, path))`, or put on a running loop's `engine`."""

    def __init__(self, engine: Any, gate: Path) -> None:
        self._engine, self._gate = engine, Path(gate)
        self.holding = threading.Event()  # set once a step waits on the gate (in process: the test can wait for it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _held(self) -> bool:
        if self._gate.exists() or self._engine.num_waiting():
            return False
        live = [r for r in list(self._engine.requests.values()) if not r.finished]
        return bool(live) and all(r.output_ids for r in live)

    def step(self, finished_only: bool = False) -> list:
        t0 = time.monotonic()
        while self._held():
            self.holding.set()
            if time.monotonic() - t0 > HOLD_LIMIT_S:
                raise RuntimeError(f"held_engine: the gate {self._gate} never opened")
            time.sleep(POLL_S)
        return self._engine.step(finished_only)


@dataclass(frozen=True)
class HeldFactory:
    """Picklable: builds the real engine in the engine process and holds it on the gate."""
    gate: str

    def __call__(self, cfg: Any) -> HeldEngine:
        from specbench.engine import LLMEngine

        return HeldEngine(LLMEngine(cfg), Path(self.gate))


def main(gate_dir: str, mode: str, serve_args: list[str]) -> None:
    import functools

    import specbench.harness.server as server_pkg
    from specbench.cli import main as cli_main
    from specbench.harness.server.lifecycle import DrainingServer

    if mode not in ("signal", "never"):
        raise SystemExit(f"held_engine: MODE={mode!r}: expected signal or never")
    gate = Path(gate_dir) / "open"
    server_pkg.make_proc_app = functools.partial(server_pkg.make_proc_app, factory=HeldFactory(str(gate)))
    if mode == "signal":
        handle_exit = DrainingServer.handle_exit

        def open_after(self: Any, sig: int, frame: Any) -> None:
            handle_exit(self, sig, frame)
            gate.touch()

        DrainingServer.handle_exit = open_after  # type: ignore[method-assign]
    sys.argv = ["specbench", "serve", "--engine-process", *serve_args]
    cli_main()
