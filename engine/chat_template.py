"""Chat templates: rendered in jinja2's immutable sandbox, in this process or bounded in a process of their own.

A chat template comes with the model directory, i.e. from whoever published it. jinja2's sandbox stops it reaching
Python internals, but bounds neither its time nor its memory: `{{ 'x' * 10**9 }}` builds a gigabyte, two nested
`range(100000)` loops run for hours. So:

- `compile_template(src)` is the one place a template is compiled: `ImmutableSandboxedEnvironment(trim_blocks,
  lstrip_blocks)`, the HF convention `raise_exception(msg)` (raises `TemplateError(msg)`), and `*` intercepted (the
  sandbox's hook for exploding operators): with a bound set, a repetition longer than it raises
  `TemplateTooLarge` before anything is built (intercepting also keeps jinja2 from folding `'x' * 10**9` while
  compiling). `render(template, messages, add_generation_prompt, eos_token)` renders it (engine/tokenizer.py's
  `apply_chat_template`, unbounded: the local adapter's own prompts).
- `BoundedRenderer(timeout, max_workers, memory_mb)` renders in worker processes (this file run as a script:
  the standard library and jinja2 only, started on demand, kept for the next render, at most `max_workers`).
  `render(src, messages, add_generation_prompt, eos_token, max_chars)` returns the text or raises
  `TemplateRefused(kind, message)`: `unsafe` (the sandbox refused), `syntax`, `error` (the template raised, e.g.
  `raise_exception`), `too_large` (more than `max_chars` characters, counted as they are produced), `memory` (past
  `memory_mb` MiB: the worker's address space is capped with RLIMIT_AS, and it exits after a MemoryError),
  `timeout` (not done within `timeout` seconds: the worker is killed, SIGKILL, and replaced at the next render),
  `died` (the worker ended without an answer; a worker that had been idle and ends without answering is
  taken to have died before the render reached it, e.g. killed from outside between renders, whose exit the pool's
  liveness check can miss while the process's other thread is still exiting, so the render is retried once, on
  another worker), `closed` (`close()` was called: every worker is killed at once,
  and a render waiting on one returns). The caller's thread only waits on a pipe, so a template that never ends
  costs one process for `timeout` seconds, never the caller's GIL. A worker whose parent is gone exits within a
  second; workers still running when this interpreter exits are killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

MEMORY_MB = 512  # a worker's address space (RLIMIT_AS)
START_TIMEOUT_S = 60.0  # a worker's start-up (python and jinja2's import) is not counted in a render's timeout


class TemplateTooLarge(Exception):
    """A template's `*` would build more characters (or items) than the render's bound."""


class TemplateRefused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def compile_template(src: str, max_chars: list[int | None] | None = None) -> Any:
    """The template compiled in the sandbox. `max_chars` is a one-item list holding the current render's bound
    (None: no bound), read by the intercepted `*` at each render."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    bound = max_chars if max_chars is not None else [None]

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            limit = bound[0]
            if operator == "*" and limit is not None:
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > limit:
                    raise TemplateTooLarge(f"'*' would build {len(seq) * n:,} characters (or items)")
            return super().call_binop(context, operator, left, right)

    def raise_exception(msg: str) -> None:
        raise TemplateError(msg)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(src)


def _context(messages: list[dict], add_generation_prompt: bool, eos_token: str) -> dict:
    return {"messages": messages, "add_generation_prompt": add_generation_prompt, "eos_token": eos_token,
            "bos_token": ""}


def render(template: Any, messages: list[dict], add_generation_prompt: bool, eos_token: str) -> str:
    return template.render(**_context(messages, add_generation_prompt, eos_token))


# ---- the worker (this file run as a script) ---------------------------------------------------------------
def _worker(rfd: int, wfd: int, memory_mb: int) -> None:
    import resource
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the process group: the parent decides
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    parent = os.getppid()

    def orphaned() -> None:  # a parent killed outright never kills us: go when it is gone
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    inbox, outbox = Connection(rfd, writable=False), Connection(wfd, readable=False)
    compiled: dict[str, Any] = {}
    bound: list[int | None] = [None]
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            src, messages, agp, eos, max_chars = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            bound[0] = max_chars
            tpl = compiled.get(src)
            if tpl is None:
                if len(compiled) > 4:
                    compiled.clear()
                tpl = compiled[src] = compile_template(src, bound)
            parts, n = [], 0
            for piece in tpl.generate(**_context(messages, agp, eos)):
                n += len(piece)
                if n > max_chars:
                    raise TemplateTooLarge(f"its output passed {max_chars:,} characters")
                parts.append(piece)
            reply: tuple = ("ok", "".join(parts))
        except TemplateTooLarge as e:
            reply = ("too_large", str(e))
        except SecurityError as e:
            reply = ("unsafe", str(e))
        except TemplateSyntaxError as e:
            reply = ("syntax", f"line {e.lineno}: {e.message}")
        except MemoryError:
            parts = []  # frees what the render built, so the answer can be sent
            with contextlib.suppress(Exception):
                outbox.send(("memory", f"it needed more than {memory_mb} MiB"))
            os._exit(3)  # what ran out of memory may have left anything half-built: a fresh worker next time
        except RecursionError as e:
            reply = ("error", f"RecursionError: {e}")
        except Exception as e:  # noqa: BLE001 - whatever the template raised is the answer
            reply = ("error", f"{type(e).__name__}: {e}")
        parts = []
        outbox.send(reply)
        reply = ()


# ---- the parent side --------------------------------------------------------------------------------------
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _kill_workers() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.kill()
            p.wait(5)


class _Worker:
    def __init__(self, memory_mb: int, start_timeout: float) -> None:
        from multiprocessing.connection import Connection

        r_cmd, w_cmd = os.pipe()
        r_out, w_out = os.pipe()
        try:
            # -P: the script's own folder (engine/) is not put on sys.path; the worker imports only stdlib and jinja2
            self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), str(r_cmd), str(w_out),
                                          str(memory_mb)], pass_fds=(r_cmd, w_out), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL)
        finally:
            os.close(r_cmd)
            os.close(w_out)
        _LIVE.add(self.proc)
        self.cmd, self.out = Connection(w_cmd, readable=False), Connection(r_out, writable=False)
        try:
            if not self.out.poll(start_timeout):
                raise TemplateRefused("died", f"the chat template's renderer did not start within {start_timeout:g} s")
            self.out.recv()
        except (EOFError, OSError):
            self.kill()
            raise TemplateRefused("died", f"the chat template's renderer exited at start ({self._how()})") from None
        except TemplateRefused:
            self.kill()
            raise

    def _how(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)
        for c in (self.cmd, self.out):
            with contextlib.suppress(Exception):
                c.close()


class BoundedRenderer:
    def __init__(self, timeout: float = 5.0, max_workers: int = 8, memory_mb: int = MEMORY_MB,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.timeout, self.max_workers, self.memory_mb, self.start_timeout = timeout, max_workers, memory_mb, start_timeout
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._rendering = 0
        self._starting = 0
        self._cv = threading.Condition()
        self.closed = False

    @property
    def workers(self) -> int:
        """Worker processes alive now (idle and busy)."""
        with self._cv:
            return len(self._idle) + len(self._busy)

    @property
    def rendering(self) -> int:
        """Renders handed to a worker and not answered yet."""
        with self._cv:
            return self._rendering

    def pids(self) -> list[int]:
        with self._cv:
            return [w.proc.pid for w in [*self._idle, *self._busy]]

    def _take(self) -> tuple[_Worker, bool]:
        """A worker for one render, and whether it had served renders before (an idle one reused)."""
        with self._cv:
            while True:
                if self.closed:
                    raise TemplateRefused("closed", "the server is shutting down")
                while self._idle:
                    w = self._idle.pop()
                    if w.proc.poll() is not None:  # gone while idle (killed from outside): not handed a render
                        w.kill()
                        continue
                    self._busy.add(w)
                    return w, True
                if len(self._busy) + self._starting < self.max_workers:
                    self._starting += 1
                    break
                self._cv.wait()
        try:
            w = _Worker(self.memory_mb, self.start_timeout)
        finally:
            with self._cv:
                self._starting -= 1
                self._cv.notify()
        with self._cv:
            if self.closed:
                w.kill()
                raise TemplateRefused("closed", "the server is shutting down")
            self._busy.add(w)
        return w, False

    def _give_back(self, w: _Worker, reuse: bool) -> None:
        with self._cv:
            self._busy.discard(w)
            if reuse and not self.closed:
                self._idle.append(w)
                self._cv.notify()
                return
            self._cv.notify()
        w.kill()

    def render(self, src: str, messages: list[dict], add_generation_prompt: bool, eos_token: str,
               max_chars: int) -> str:
        retried = False
        while True:
            w, reused = self._take()
            reuse = False
            try:
                try:
                    w.cmd.send((src, messages, add_generation_prompt, eos_token, max_chars))
                    with self._cv:
                        self._rendering += 1
                    try:
                        done = w.out.poll(self.timeout)
                    finally:
                        with self._cv:
                            self._rendering -= 1
                    if not done:
                        raise TemplateRefused("timeout", f"it did not finish within {self.timeout:g} s "
                                                         "(--chat-template-timeout)")
                    reply = w.out.recv()
                except (EOFError, OSError):
                    if self.closed:
                        raise TemplateRefused("closed", "the server is shutting down") from None
                    w.proc.wait(5)
                    if reused and not retried:  # died between renders, before this render reached it: once more
                        retried = True
                        continue
                    raise TemplateRefused("died",
                                          f"its renderer process ended without an answer ({w._how()})") from None
                kind = reply[0]
                if kind == "ok":
                    reuse = True
                    return str(reply[1])
                reuse = kind != "memory"
                raise TemplateRefused(kind, reply[1])
            finally:
                self._give_back(w, reuse)

    def close(self) -> None:
        """Kill every worker now (a render waiting on one raises `TemplateRefused("closed")`)."""
        with self._cv:
            self.closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
            self._cv.notify_all()
        for w in busy:  # its render's thread sees the pipe end and closes the rest
            with contextlib.suppress(OSError):
                w.proc.kill()
        for w in idle:
            w.kill()
        for w in busy:
            with contextlib.suppress(Exception):
                w.proc.wait(5)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
