"""An arm's OpenAI-compatible endpoint: `specbench serve` in a subprocess, or a remote base URL.

Contract:
- `open_endpoint(spec, name, log_path)` is a context manager yielding an `Endpoint` whose `root` answers
  /v1/completions. For a `local` engine it starts `specbench serve` on a free loopback port, waits for
  GET /health to answer 200, i.e. ready (503 "starting" while its warm-up runs; failing early, with the
  server log's tail, if the process exits), and on
  exit always stops it: SIGTERM, then SIGKILL after a grace period, on success, error or Ctrl-C. The
  child also gets SIGTERM if this process dies (Linux parent-death signal), so no server outlives a run.
- For an `openai` engine nothing is started; the base URL may end in /v1 or not. Its bearer key is the
  engine string's api_key=, else $OPENAI_API_KEY: the probe sends it, and lm-eval gets it as
  $OPENAI_API_KEY (`Endpoint.api_key`, never recorded; the recorded engine string has it masked). A 401 / 403
  (the probe also sends one 1-token completion, so a server that lists its models to anyone is caught too)
  raises harness/errors.py AuthRefused, and nothing answering at all EndpointUnreachable (exit 2).
- Either way the endpoint is probed once: the served model (`model=` option, else the first of
  /v1/models), its context length (max_model_len where the server reports it) and whether it answers
  /tokenizer_info and /tokenize (lm-eval's remote tokenizer). Probing never raises for a missing extra.
- `spec_counters(ep)` snapshots vLLM-style spec-decode counters from /metrics; `spec_delta` turns two
  snapshots into what one run accumulated (mean accepted length = 1 + accepted / drafts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specbench.harness.adapters.openai_api import auth_hooks, error_message
from specbench.harness.engines import EngineSpec
from specbench.harness.errors import EndpointUnreachable, check_auth
from specbench.harness.redact import redact_text, scrub

STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0


class EndpointError(RuntimeError):
    """The arm's endpoint could not be started or reached."""


@dataclass
class Endpoint:
    name: str
    engine: str  # the engine string as given
    root: str  # http://host:port (no /v1)
    model: str
    max_model_len: int | None = None
    remote_tokenizer: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # /version and /v1/models, for provenance
    log_path: str | None = None
    api_key: str | None = field(default=None, repr=False)  # the bearer key (never recorded)

    @property
    def completions_url(self) -> str:
        return f"{self.root}/v1/completions"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def normalize_root(url: str) -> str:
    root = url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if root.endswith(suffix):
            root = root[: -len(suffix)]
    return root


SERVE_FLAGS = {"draft": "--draft", "spec": "--spec", "k": "--k", "device": "--device", "dtype": "--dtype",
               "num_pages": "--num-pages", "max_model_len": "--max-model-len"}


def serve_argv(spec: EngineSpec, host: str, port: int) -> list[str]:
    """`specbench serve` flags for a local engine string (name= is our label, not the server's)."""
    unsupported = [k for k in spec.options if k not in SERVE_FLAGS and k != "name"]
    if unsupported:
        raise EndpointError(f"engine {spec.raw!r}: option {unsupported[0]}= is not available through "
                            f"`specbench serve` (accepted: {', '.join(SERVE_FLAGS)}, name)")
    argv = [sys.executable, "-m", "specbench", "serve", "--host", host, "--port", str(port), "--log-level", "warning"]
    if spec.target:
        argv += ["--model", spec.target]
    for key, flag in SERVE_FLAGS.items():
        if key in spec.options:
            argv += [flag, spec.options[key]]
    return argv


def die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: Path | None, n: int = 30) -> str:
    if path is None or not path.is_file():
        return ""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _wait_healthy(proc: subprocess.Popen, root: str, timeout: float, log_path: Path | None) -> None:
    t0 = time.monotonic()
    while True:
        rc = proc.poll()
        if rc is not None:
            raise EndpointError(f"`specbench serve` exited with code {rc} before answering /health; "
                                f"its log ({log_path}):\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{root}/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() - t0 > timeout:
            raise EndpointError(f"`specbench serve` was not ready (GET {root}/health 200; 503 while it warms up) "
                                f"within {timeout:.0f} s; "
                                f"its log ({log_path}):\n{_tail(log_path)}")
        time.sleep(0.25)


def stop_process(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=grace)


def probe(root: str, model: str | None, timeout: float = 10.0, api_key: str | None = None,
          key_source: str | None = None) -> tuple[str, int | None, bool, dict]:
    """(model, max_model_len, remote_tokenizer, info) of a running endpoint (module contract: the key, refusals)."""
    info: dict[str, Any] = {}

    def auth(status: int, route: str, body: bytes) -> None:
        check_auth(root, status, route, key_source, scrub(error_message(body), [api_key] if api_key else []))

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, headers=headers, event_hooks=auth_hooks(auth, False)) as c:
        try:
            r = c.get(f"{root}/v1/models")
            r.raise_for_status()
            info["models"] = r.json().get("data", [])
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise EndpointUnreachable(root, f"GET {root}/v1/models: {type(e).__name__}: {e}") from None
        except (httpx.HTTPError, ValueError) as e:
            if model is None:
                raise EndpointError(f"{root}/v1/models failed ({e}); pass the model name as model=M") from e
            info["models"] = []
        entry = next((m for m in info["models"] if model is None or m.get("id") == model), None)
        if model is None:
            if entry is None:
                raise EndpointError(f"{root}/v1/models lists no model; pass the model name as model=M")
            model = str(entry["id"])
        mml = (entry or {}).get("max_model_len")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            v = c.get(f"{root}/version")
            if v.status_code == 200:
                info["version"] = v.json()
        with contextlib.suppress(httpx.HTTPError):  # only a refusal matters here (the hook raises it)
            c.post(f"{root}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
        remote = False
        with contextlib.suppress(httpx.HTTPError, ValueError):
            ti = c.get(f"{root}/tokenizer_info")
            tk = c.post(f"{root}/tokenize", json={"prompt": "Question:", "add_special_tokens": False})
            remote = ti.status_code == 200 and tk.status_code == 200 and isinstance(tk.json().get("tokens"), list)
            if ti.status_code == 200:
                info["tokenizer_info"] = {k: v for k, v in ti.json().items() if k != "chat_template"}
                mml = mml or info["tokenizer_info"].get("model_max_length")
    return model, (int(mml) if isinstance(mml, int) else None), remote, info


def spec_counters(ep: Endpoint) -> dict | None:
    """The endpoint's cumulative speculative-decoding counters from /metrics (None where it has none)."""
    from specbench.harness.adapters.prom import spec_counters_from_metrics

    try:
        r = httpx.get(f"{ep.root}/metrics", timeout=10.0,
                      headers={"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else None)
        return spec_counters_from_metrics(r.text, ep.model) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """Counters accumulated between two snapshots, with the mean accepted length per verify step."""
    if not after or after.get("num_drafts") is None:
        return None
    b = before or {}
    d = {k: (after.get(k) or 0) - (b.get(k) or 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["mean_accept_len"] = 1.0 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    return d


@contextlib.contextmanager
def open_endpoint(spec: EngineSpec, name: str, log_path: Path | None = None,
                  startup_timeout: float = STARTUP_TIMEOUT_S) -> Iterator[Endpoint]:
    if spec.kind == "openai":
        root = normalize_root(spec.target)
        key = spec.options.get("api_key") or os.environ.get("OPENAI_API_KEY") or None
        source = ("api_key=" if spec.options.get("api_key") else "$OPENAI_API_KEY") if key else None
        model, mml, remote, info = probe(root, spec.options.get("model"), api_key=key, key_source=source)
        yield Endpoint(name, redact_text(spec.raw), root, model, mml, remote, info, api_key=key)
        return
    if spec.kind != "local":
        raise EndpointError(f"engine {spec.raw!r}: eval needs an OpenAI-compatible endpoint "
                            "(local:... started as `specbench serve`, or openai:<url>), not {spec.kind}")
    host, port = "127.0.0.1", free_port()
    root = f"http://{host}:{port}"
    argv = serve_argv(spec, host, port)
    log = open(log_path, "w", encoding="utf-8") if log_path else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        _wait_healthy(proc, root, startup_timeout, log_path)
        model, mml, remote, info = probe(root, None)
        info["argv"] = argv
        yield Endpoint(name, spec.raw, root, model, mml, remote, info, str(log_path) if log_path else None)
    finally:
        stop_process(proc)
        if log_path:
            log.close()  # type: ignore[union-attr]
