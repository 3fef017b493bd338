"""`llama-server` processes: one per speculation kind (`KINDS`), on a free loopback port.

`start_server(kind, models, build)` / `LlamaServer(...)` run `llama-server` with `--metrics`, wait for
`/health`, keep stdout+stderr in a log file, are killed after a bounded lifetime (`timeout -k` around
the process plus a timer here, plus PR_SET_PDEATHSIG) and stop with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import NotRequired, TextIO, TypedDict

from .build import Build
from .gguf import Models
from .source import Unavailable

# The speculation arguments per kind, as the vendored llama-server spells them (its --help: the old
# `--draft-max/--draft-min` are removed and refuse to start; `--spec-draft-n-max/-n-min` replace them;
# n-gram sizes are per type). DFlash drafts at most block_size - 1 = 7 (it clamps larger values).
DRAFT_N = ["--spec-draft-n-max", "8", "--spec-draft-n-min", "0"]


class ServerKind(TypedDict):
    """One kind of server: its model and drafter (names of `Models` fields) and its speculation arguments."""

    model: str
    draft: NotRequired[str]
    spec: list[str]


KINDS: dict[str, ServerKind] = {
    "off": {"model": "target_f32", "spec": []},
    "draft": {"model": "target_f32", "draft": "perturbed", "spec": ["--spec-type", "draft-simple", *DRAFT_N]},
    "ngram": {"model": "target_f32",
              "spec": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                       "--spec-ngram-simple-size-m", "8"]},
    "dflash": {"model": "target_f32", "draft": "dflash",
               "spec": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]},
    "dflash-lasttap": {"model": "target_f32", "draft": "dflash_lasttap",
                       "spec": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]},
    # Deliberately broken pairing for the gates: a different model behind a "spec off" server.
    "wrong": {"model": "perturbed", "spec": []},
    "q8_0": {"model": "target_q8_0", "spec": []},
    "q4_0": {"model": "target_q4_0", "spec": []},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdeathsig() -> None:  # runs in the child before exec: die with the parent (Linux only)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def http_post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode("utf-8", "replace"), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class _PortTaken(Exception):
    pass


class LlamaServer:
    """One `llama-server` process on a free loopback port. Use as a context manager or call start()/stop().

    `.base_url` (http://127.0.0.1:PORT, no /v1), `.log_path` (stdout+stderr of the server), `.args`
    (the full command line), `.returncode` once stopped or dead, `.alive()`.
    """

    def __init__(self, build: Build, model: Path, draft: Path | None = None, spec: Sequence[str] = (),
                 *, ctx: int | None = None, parallel: int = 4, threads: int = 2, lifetime_s: float = 1800.0,
                 health_timeout_s: float = 120.0, log_dir: Path | None = None, name: str = "server",
                 alias: str | None = None, extra: Sequence[str] = ()):
        self.build, self.model, self.draft = build, Path(model), Path(draft) if draft else None
        self.name, self.lifetime_s, self.health_timeout_s = name, lifetime_s, health_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="specbench-llamacpp-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-{name}-{self.port}.log"
        ctx = ctx or 2048 * parallel  # split evenly over the slots: the tiny model's 2048 positions each
        self.args = [str(build.server), "-m", str(self.model), "--host", "127.0.0.1",
                     "--port", str(self.port), "-c", str(ctx), "-np", str(parallel), "-t", str(threads),
                     "-tb", str(threads), "--metrics", "--no-webui", "--poll", "0",
                     "--alias", alias or name]
        if self.draft is not None:
            self.args += ["-md", str(self.draft), "-td", str(threads), "-tbd", str(threads)]
        self.args += [*spec, *extra]
        self.proc: subprocess.Popen | None = None
        self._timer: threading.Timer | None = None
        self._log_fh: TextIO | None = None
        self.returncode: int | None = None
        self.started_s: float | None = None

    # lifecycle -------------------------------------------------------------------------------------
    def _set_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.args[self.args.index("--port") + 1] = str(port)

    def start(self, attempts: int = 3) -> LlamaServer:
        """Spawn and wait for /health; a port lost to another process between `free_port()` and the
        server's bind is retried on a fresh port. Starting twice is refused."""
        if self.proc is not None:
            raise RuntimeError(f"{self!r} was already started")
        for attempt in range(attempts):
            try:
                return self._spawn()
            except _PortTaken:
                if attempt == attempts - 1:
                    raise Unavailable(f"llama-server ({self.name}): no free port after {attempts} tries; "
                                      f"log {self.log_path}:\n{self.log_tail()}") from None
                self.proc = None
                self._set_port(free_port())
        raise AssertionError("unreachable")

    def _spawn(self) -> LlamaServer:
        cmd = list(self.args)
        timeout = shutil.which("timeout")
        if timeout:  # the hard bound survives this Python process dying
            cmd = [timeout, "-k", "10", f"{int(self.lifetime_s)}", *cmd]
        env = dict(os.environ, OMP_WAIT_POLICY="passive")  # no idle spinning on shared cores
        self.log_path = self.log_path.with_name(f"llama-server-{self.name}-{self.port}.log")
        self._log_fh = open(self.log_path, "w")
        self._log_fh.write(f"$ {' '.join(self.args)}\n")
        self._log_fh.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     preexec_fn=_pdeathsig)
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            if "couldn't bind HTTP server socket" in self.log_tail(200):
                raise _PortTaken() from None
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise Unavailable(f"llama-server ({self.name}) exited with {self.proc.returncode} before "
                                  f"becoming healthy; log {self.log_path}:\n{self.log_tail()}")
            try:
                status, body = http_get(self.base_url + "/health", timeout=2.0)
                if status == 200:
                    # Someone else may own the port (our bind then fails within milliseconds): it is ours
                    # only if our process is still running a moment later and says it listens there.
                    mine = f"listening on http://127.0.0.1:{self.port}" in self.log_tail(400)
                    if mine and self.proc is not None and self.proc.poll() is None:
                        return
                    last = "HTTP 200 from a process that has not logged `listening on` this port"
                last = f"HTTP {status} {body[:200]}"
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        raise Unavailable(f"llama-server ({self.name}) not healthy after {self.health_timeout_s} s "
                          f"(last: {last}); log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; idempotent; returns the exit code."""
        if self._timer is not None:
            self._timer.cancel()
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p is not None:
            self.returncode = p.poll()
        if self._log_fh is not None and not self._log_fh.closed:
            self._log_fh.close()
        return self.returncode

    def __enter__(self) -> LlamaServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # helpers ---------------------------------------------------------------------------------------
    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        return http_get(self.base_url + path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
        return http_post(self.base_url + path, body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Prometheus text from /metrics as {name{labels}: value} (comments dropped)."""
        status, text = self.get("/metrics")
        if status != 200:
            raise Unavailable(f"/metrics: HTTP {status} {text[:200]}")
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = float(v)
        return out

    def __repr__(self) -> str:
        return f"LlamaServer({self.name}, {self.base_url}, alive={self.alive()})"


def start_server(kind: str, models: Models, build: Build, **kw) -> LlamaServer:
    """Start the server of one of KINDS (see there) and wait until /health is ok."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    k = KINDS[kind]
    draft = getattr(models, k["draft"]) if "draft" in k else None
    kw.setdefault("name", kind)
    return LlamaServer(build, getattr(models, k["model"]), draft, k["spec"], **kw).start()

