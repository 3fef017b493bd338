"""`openai` adapter: a remote OpenAI-compatible endpoint (vLLM, SGLang, pegainfer, `specbench serve`).

Contract:
- base_url may be the server root, .../v1, or a full .../v1/completions URL; `root` serves /tokenize,
  /metrics, /version and `api` (= root + /v1) the OpenAI routes. Without model=, the first id of
  GET /v1/models is used.
- Text and token-id prompts go to /v1/completions, messages to /v1/chat/completions. Streaming (the
  default) asks for `stream_options: {include_usage, continuous_usage_stats}` and, with extras on (the
  default), vLLM's `return_token_ids` and `return_tokens_as_token_ids`, which make output ids and
  per-chunk token counts exact; servers that ignore them fall back as openai_stream.py documents.
  The request bodies (and the sampler settings pinned per dialect) are built in openai_request.py.
  t_send is taken just before the request is written, each SSE event is timed on arrival (the events of
  one network read share that read's time). Generation requests go through sse_http.py's minimal
  HTTP/1.1 client on plain http:// roots (httpx's per-chunk parsing was most of the client's CPU per
  chunk; `describe()["config"]["http"]` says which; SPECBENCH_RAW_HTTP=0 is the off switch), through
  httpx otherwise (https, proxies, an injected test transport) and for every other route.
- Connect errors, 429 and 5xx answers before any output are retried (at most `retries` times,
  exponential backoff from `backoff` s); anything else (4xx, a read timeout, a stream that breaks after
  output started) fails that request only: ok=False with the error text, `attempts` recorded. A
  retried request's clock starts at the first send of its first attempt (t_send, wall_send), so its
  TTFT and E2EL include every failed attempt and backoff; `meta["attempt_errors"]` keeps each failed
  attempt's error and its time after that first send.
- The API key: `api_key=`, else $OPENAI_API_KEY (`use_api_key` sets one later, e.g. the sweep's
  --api-key). It is sent as `Authorization: Bearer` and never appears in `describe()` (which says where
  it came from, `config.auth`), in an error text (the key is masked in everything the server answered)
  or in a log line.
- Refused, not failed (harness/errors.py, reported by the CLI in one line, exit 2): a 401 / 403 answer on
  any route but /metrics and /health (the probe, the model lookup, /tokenize, scoring, a generation) raises
  `AuthRefused` (the endpoint, the route, where the key came from; never the key): no request could succeed.
  On first contact (the probe's GET /v1/models, or the model lookup) a connection that cannot be made raises
  `EndpointUnreachable`, and a model lookup that finds no model raises `EndpointError` (give model=).
- One httpx.AsyncClient per event loop (an adapter may be driven by several asyncio.run calls).
- score() uses echo + logprobs + max_tokens=0 (retried with max_tokens=1 if refused) with token-id
  prompts; spec_counters() scrapes /metrics (prom.py); tokenize() uses vLLM's POST /tokenize.
- Dialects (dialect.py): with `probe=True` (engine strings: the default) the endpoint is probed once,
  on first use, and every route follows what it answered: the /tokenize body ({"prompt"} or llama.cpp's
  {"content"}; an empty list for a non-empty text is never a prompt), llama.cpp's native /completion for
  text and token-id prompts (ids from `tokens`, logprobs from `completion_probabilities`, per-request
  draft counts from `timings`), `llamacpp:` counters, explicit top_k / top_p / min_p in every request
  (llama.cpp would apply top_k 40, min_p 0.05), `cache_prompt` from `GenRequest.prompt_cache`, and
  scoring by one 1-token generation per position where echo is refused. On the vllm dialect
  `prompt_cache=False` becomes a fresh `cache_salt` per request (vLLM >= 0.9: a salted request shares no
  prefix-cache block with any other, so it is computed cold). `tokenizer=DIR` tokenizes locally
  (round-trip checked) where the endpoint cannot. The record is `describe()["capabilities"]`.
- Ready, not just up (`ready_timeout` s, engine strings: 600): before its first probe or request the
  adapter polls GET /health for as long as it answers 503 (a server still loading or warming up:
  `specbench serve` during its warm-up, llama.cpp's llama-server while it loads), up to
  ready_timeout; any other answer (200, or 404 where there is no /health) means go, and a connection
  error is left to the requests themselves. A server still 503 at the timeout fails every request with
  that reason. The wait is recorded in `describe()["ready"]` (seconds waited, the last /health status,
  the server's warm-up record). 0 = never ask.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from ..errors import AUTH_STATUSES, EndpointError, EndpointUnreachable, Refusal, check_auth
from ..redact import scrub
from .base import EngineAdapter, GenRequest, GenResult, PosLogprobs, ScoreResult, failed
from .dialect import Capabilities, LocalTokenizer, probe_endpoint
from .openai_request import completions_body, native_body, split_url
from .openai_stream import StreamAccumulator, chat_positions, legacy_positions
from .prom import spec_counters_from_metrics
from .sse_http import ConnectFailed, RawHTTP, ReadFailed, usable

log = logging.getLogger("specbench.adapters")
READY_POLL_S = 1.0
DRAIN_S = 1.0  # after [DONE], how long the raw client waits for the body's end before dropping the connection


class _Retry(Exception):
    """A failure before any output that is worth another attempt; `sent`: when that attempt was sent."""

    def __init__(self, msg: str, sent: tuple[float, float]) -> None:
        super().__init__(msg)
        self.sent = sent


async def _read_sse(pieces: AsyncIterator[bytes], acc: StreamAccumulator) -> bool:
    """Feed every `data:` event of an SSE body (its bytes, in network-sized pieces) to `acc` until [DONE];
    whether any event came. Bytes are split into lines here (no text decoding, no per-line regex: the
    client's per-chunk cost, benchmarks/client.py); every event of one network read is timed once, at that
    read's arrival. It returns at [DONE] without waiting for the body's end (the raw client then drains it
    with a deadline to keep the connection). A failure mid-stream raises with `started` set on the
    exception (not retried once output has arrived)."""
    pending, started = b"", False
    try:
        async for data in pieces:
            now = time.perf_counter()
            pending += data
            if b"\n" not in data:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line[:5] != b"data:":
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return True
                started = True
                acc.feed(json.loads(payload), now)
        line = pending.strip()
        if line[:5] == b"data:" and line[5:].strip() not in (b"", b"[DONE]"):
            started = True
            acc.feed(json.loads(line[5:].strip()), time.perf_counter())
    except BaseException as e:
        e.started = started  # type: ignore[attr-defined]
        raise
    return started


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _refused(status: int, body: bytes, req: GenRequest, rid: str, res: GenResult, attempt: int,
             sent: tuple[float, float]) -> GenResult:
    """A non-200 answer of either transport (401 / 403 were raised before: OpenAIAdapter._auth): 429 and 5xx are
    retried (raises _Retry), any other status fails the request with the server's message."""
    msg = _error_text(status, body)
    if status == 429 or status >= 500:
        raise _Retry(msg, sent)
    out = failed(req, rid, msg, res.t_send, attempt)
    out.wall_send = res.wall_send
    return out


def auth_hooks(auth: Any, asynchronous: bool) -> dict[str, list]:
    """httpx event hooks that hand every 401 / 403 answer of a client to `auth(status, "METHOD /path", body)`,
    which raises (harness/errors.py check_auth): the adapter's clients, and eval's endpoint probe."""
    def check(r: httpx.Response) -> None:
        if r.status_code in AUTH_STATUSES:
            r.read()
            auth(r.status_code, f"{r.request.method} {r.url.path}", r.content)

    async def acheck(r: httpx.Response) -> None:
        if r.status_code in AUTH_STATUSES:
            await r.aread()
            auth(r.status_code, f"{r.request.method} {r.url.path}", r.content)

    return {"response": [acheck if asynchronous else check]}


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}}), else its text."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = body.decode("utf-8", "replace")[:500]
    return str(msg)


def _error_text(status: int, body: bytes) -> str:
    return f"HTTP {status}: {error_message(body)}"


class OpenAIAdapter(EngineAdapter):
    kind = "openai"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, name: str | None = None,
                 stream: bool = True, extras: bool = True, continuous_usage: bool = True, timeout: float = 600.0,
                 connect_timeout: float = 10.0, retries: int = 3, backoff: float = 0.5,
                 max_connections: int = 1024, extra_body: dict | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, probe: bool = False,
                 dialect: str | None = None, tokenizer: str | Path | LocalTokenizer | None = None,
                 ready_timeout: float = 0.0, dtype: str | None = None) -> None:
        super().__init__(name or "openai")
        self.dtype = dtype  # declared by the engine string (dtype=float32 turns the lossless gates' strict mode on)
        self.root, self.api = split_url(base_url)
        self.model = model
        self.stream, self.extras, self.continuous_usage = stream, extras, continuous_usage
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self.retries, self.backoff = retries, backoff
        self.headers: dict[str, str] = {}
        self._key: str | None = None
        self.auth: str | None = None  # where the key came from (never the key itself)
        if api_key:
            self.use_api_key(api_key, "api_key=")
        elif os.environ.get("OPENAI_API_KEY"):
            self.use_api_key(os.environ["OPENAI_API_KEY"], "$OPENAI_API_KEY")
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.extra_body = dict(extra_body or {})
        self.transport = transport  # tests inject httpx.MockTransport here
        self._cli: httpx.AsyncClient | None = None
        self._cli_loop: asyncio.AbstractEventLoop | None = None
        self._raw: RawHTTP | None = None
        self._raw_loop: asyncio.AbstractEventLoop | None = None
        self._tokenize_ok: bool | None = None
        self._tokenize_body: str | None = None  # "prompt" | "content": the /tokenize body that answered
        self._info: dict | None = None
        self.probe_enabled = probe or dialect is not None
        self.forced_dialect = dialect
        self.local_tokenizer = tokenizer if isinstance(tokenizer, LocalTokenizer) or tokenizer is None \
            else LocalTokenizer(tokenizer)
        self.caps: Capabilities | None = None
        self._probe_lock = threading.Lock()
        self.counter_errors: list[str] = []  # failed /metrics scrapes (kept for the records)
        self.ready_timeout = ready_timeout
        self.ready: dict | None = None  # the ready wait's record, once made
        self._ready_lock = threading.Lock()

    # ---- plumbing --------------------------------------------------------------------------------
    def use_api_key(self, key: str, source: str) -> None:
        """Send `key` as the bearer token from now on; `source` (a flag or variable name) is recorded."""
        self._key, self.auth = key, source
        self.headers = {"Authorization": f"Bearer {key}"}
        self._cli, self._cli_loop = None, None  # the next request builds a client with the header
        self._raw, self._raw_loop = None, None

    @property
    def has_api_key(self) -> bool:
        return self._key is not None

    def _mask(self, text: str) -> str:
        return scrub(text, [self._key] if self._key else [])

    def _auth(self, status: int, route: str, body: bytes) -> None:
        """Raise AuthRefused for a 401 / 403 on a guarded route (module contract; harness/errors.py check_auth)."""
        if status in AUTH_STATUSES:
            check_auth(self.root, status, route, self.auth, self._mask(error_message(body)))

    def _hooks(self, asynchronous: bool) -> dict[str, list]:
        return auth_hooks(self._auth, asynchronous)

    def _raw_client(self) -> RawHTTP | None:
        """The minimal HTTP/1.1 client for generation requests (sse_http.py), or None where httpx serves
        (an injected test transport, https, a proxy, SPECBENCH_RAW_HTTP=0)."""
        if self.transport is not None or not usable(self.root):
            return None
        loop = asyncio.get_running_loop()
        if self._raw is None or self._raw_loop is not loop:
            self._raw = RawHTTP(self.root, self.headers, self.timeout.connect or 10.0, self.timeout.read or 600.0)
            self._raw_loop = loop
        return self._raw

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._cli is None or self._cli_loop is not loop:
            self._cli = httpx.AsyncClient(timeout=self.timeout, limits=self.limits, headers=self.headers,
                                          transport=self.transport, event_hooks=self._hooks(True))
            self._cli_loop = loop
        return self._cli

    async def _model(self) -> str:
        """The model= of the engine string, else the first id GET /v1/models lists (module contract: a refusal
        when there is none to be had)."""
        if self.model is None:
            url = self.api + "/models"
            try:
                r = await self._client().get(url)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                raise EndpointUnreachable(self.root, f"GET {url}: {type(e).__name__}: {e}") from None
            data = (_json_or_none(r) or {}).get("data") if r.status_code == 200 else None
            if not (isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id")):
                raise EndpointError(f"the endpoint {self.root} names no model (GET {url}: HTTP {r.status_code}, "
                                    f"{self._mask(r.text[:200])!r}): give it with model=<name> in the engine string")
            self.model = str(data[0]["id"])
        return self.model

    # ---- ready -----------------------------------------------------------------------------------
    def wait_ready(self) -> dict | None:
        """Poll /health while it answers 503, at most ready_timeout s (thread-safe, synchronous, once);
        the record, or None when ready_timeout is 0. See the module contract."""
        if self.ready_timeout <= 0:
            return None
        with self._ready_lock:
            if self.ready is not None:
                return self.ready
            if self.transport is not None and not isinstance(self.transport, httpx.BaseTransport):
                self.ready = {"skipped": "an asynchronous test transport"}
                return self.ready
            t0 = time.monotonic()
            deadline, next_log = t0 + self.ready_timeout, t0 + 10.0
            rec: dict[str, Any] = {}
            with httpx.Client(timeout=httpx.Timeout(10.0, connect=self.timeout.connect), headers=self.headers,
                              transport=self.transport) as c:
                while True:
                    try:
                        r = c.get(self.root + "/health")
                    except httpx.HTTPError as e:
                        rec = {"health": None, "error": f"{type(e).__name__}: {e}"}
                        break
                    body = _json_or_none(r)
                    warm = body.get("warmup") if isinstance(body, dict) else None
                    rec = {"health": r.status_code, **({"warmup": warm} if warm is not None else {})}
                    now = time.monotonic()
                    if r.status_code != 503:
                        break
                    if now >= deadline:
                        rec["timed_out"] = True
                        rec["body"] = self._mask(r.text[:300])
                        log.warning("%s: /health still 503 after %.0f s: %s", self.root, now - t0,
                                    self._mask(r.text[:200]))
                        break
                    if now >= next_log:
                        log.info("%s: waiting for ready (%.0f s): %s", self.root, now - t0, self._mask(r.text[:200]))
                        next_log = now + 10.0
                    time.sleep(min(READY_POLL_S, max(0.0, deadline - now)))
            rec["waited_s"] = round(time.monotonic() - t0, 2)
            self.ready = rec
            return rec

    def _not_ready(self) -> str | None:
        rec = self.ready
        if rec and rec.get("timed_out"):
            return (f"the endpoint was not ready within {self.ready_timeout:.0f} s: GET {self.root}/health still "
                    f"answers 503 ({rec.get('body', '')[:200]})")
        return None

    # ---- dialect ---------------------------------------------------------------------------------
    def probe(self) -> Capabilities | None:
        """Probe the endpoint once (thread-safe, synchronous); None when probing is off."""
        if not self.probe_enabled:
            return None
        self.wait_ready()
        with self._probe_lock:
            if self.caps is None:
                tr = self.transport if isinstance(self.transport, httpx.BaseTransport) else None
                with httpx.Client(timeout=httpx.Timeout(60.0, connect=self.timeout.connect), headers=self.headers,
                                  transport=tr, event_hooks=self._hooks(False)) as c:
                    caps = probe_endpoint(c, self.root, self.api, self.model, extras=self.extras,
                                          tokenizer=self.local_tokenizer, dialect=self.forced_dialect)
                if caps.unreachable:
                    raise EndpointUnreachable(self.root, caps.unreachable)
                self.caps = caps
                if self.model is None:
                    self.model = self.caps.server.get("model")
                if self.caps.tokenize in ("prompt", "content"):
                    self._tokenize_body, self._tokenize_ok = self.caps.tokenize, True
        return self.caps

    async def _caps(self) -> Capabilities | None:
        if not self.probe_enabled:
            return None
        if self.caps is None:
            await asyncio.to_thread(self.probe)
        return self.caps

    async def endpoint_capabilities(self) -> dict | None:
        caps = await self._caps()
        return caps.to_dict() if caps is not None else None

    @property
    def dialect(self) -> str:
        return self.caps.dialect if self.caps is not None else (self.forced_dialect or "openai")

    def _native(self, req: GenRequest) -> bool:
        return self.caps is not None and self.caps.generate_route == "/completion" and req.messages is None

    # ---- generation ------------------------------------------------------------------------------
    async def generate_one(self, req: GenRequest) -> GenResult:
        rid = self._rid(req)
        t0 = time.perf_counter()
        if self.ready_timeout > 0 and self.ready is None:
            await asyncio.to_thread(self.wait_ready)
        why = self._not_ready()
        if why:
            return failed(req, rid, why, t0)
        try:
            model = await self._model()
        except Refusal:
            raise
        except Exception as e:
            return failed(req, rid, f"cannot resolve the model from {self.api}/models: {type(e).__name__}: {e}", t0)
        await self._caps()
        if self._native(req):
            url = self.root + "/completion"
            body = native_body(req, self.dialect, stream=self.stream, extras=self.extras, extra_body=self.extra_body)
        else:
            url = self.api + ("/chat/completions" if req.messages is not None else "/completions")
            body = completions_body(req, model, self.dialect, stream=self.stream,
                                    continuous_usage=self.continuous_usage, extras=self.extras,
                                    extra_body=self.extra_body)
        last = ""
        first: tuple[float, float] | None = None  # (perf_counter, time.time) of the first attempt's send
        errors: list[dict] = []
        for attempt in range(1, self.retries + 2):
            try:
                res = await self._attempt(req, rid, url, body, attempt, first)
            except _Retry as e:
                last = self._mask(str(e))
                first = first or e.sent
                errors.append({"attempt": attempt, "error": last, "after_s": round(time.perf_counter() - first[0], 6)})
                if attempt <= self.retries:
                    await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
                continue
            if errors:
                res.meta["attempt_errors"] = errors
            if res.error:
                res.error = self._mask(res.error)
            return res
        t_send, wall = first if first is not None else (t0, time.time())
        res = failed(req, rid, f"gave up after {self.retries + 1} attempts: {last}", t_send, self.retries + 1)
        res.wall_send = wall
        res.meta["attempt_errors"] = errors
        return res

    async def _attempt(self, req: GenRequest, rid: str, url: str, body: dict, attempt: int,
                       first: tuple[float, float] | None = None) -> GenResult:
        acc = StreamAccumulator(chat=req.messages is not None, top_k=req.logprobs, native=url.endswith("/completion"),
                                one_token_per_chunk=self.dialect == "llamacpp")
        raw = self._raw_client()
        data = json.dumps(body).encode() if raw is not None else b""
        sent = (time.perf_counter(), time.time())
        t_send, wall = first or sent  # the clock starts at the first send of the first attempt
        res = GenResult(rid=rid, ok=True, t_send=t_send, wall_send=wall, attempts=attempt, meta=dict(req.meta))
        if raw is not None:
            return await self._attempt_raw(raw, req, rid, url[len(self.root):], data, attempt, sent, acc, res)
        started = False
        try:
            async with self._client().stream("POST", url, json=body) as resp:
                if resp.status_code != 200:  # (a 401 / 403 was raised by the client's hook)
                    return _refused(resp.status_code, await resp.aread(), req, rid, res, attempt, sent)
                if not self.stream:
                    obj = json.loads(await resp.aread())
                    acc.feed(obj, time.perf_counter())
                else:
                    started = await _read_sse(resp.aiter_bytes(), acc)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as e:
            if not (started or getattr(e, "started", False)):
                raise _Retry(f"{type(e).__name__}: {e}", sent) from e
            return self._broken(req, rid, res, acc, f"{type(e).__name__} after output started: {e}")
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return self._broken(req, rid, res, acc, f"{type(e).__name__}: {e}")
        return self._finished(res, acc, time.perf_counter())

    async def _attempt_raw(self, raw: RawHTTP, req: GenRequest, rid: str, path: str, data: bytes, attempt: int,
                           sent: tuple[float, float], acc: StreamAccumulator, res: GenResult) -> GenResult:
        """`_attempt` over sse_http.py: the same outcomes (retry before output, broken after, 4xx fails)."""
        try:
            resp = await raw.post(path, data)
        except ConnectFailed as e:
            raise _Retry(str(e), sent) from e
        except (TimeoutError, ReadFailed) as e:
            return self._broken(req, rid, res, acc, f"{type(e).__name__}: {e or 'read timeout'}")
        started = False
        try:
            if resp.status != 200:
                body = await resp.body()
                self._auth(resp.status, f"POST {path}", body)
                return _refused(resp.status, body, req, rid, res, attempt, sent)
            if not self.stream:
                acc.feed(json.loads(await resp.body()), time.perf_counter())
            else:
                started = await _read_sse(resp.iter_bytes(), acc)
                t_end = time.perf_counter()
                await resp.finish(DRAIN_S)  # the body's end after [DONE]: keep the connection if it comes
                res.t_end = t_end
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if not (started or getattr(e, "started", False)):
                raise _Retry(f"{type(e).__name__}: {e}", sent) from e
            return self._broken(req, rid, res, acc, f"{type(e).__name__} after output started: {e}")
        except (TimeoutError, json.JSONDecodeError) as e:
            return self._broken(req, rid, res, acc, f"{type(e).__name__}: {e or 'read timeout'}")
        finally:
            resp.release()
        return self._finished(res, acc, res.t_end or time.perf_counter())

    def _finished(self, res: GenResult, acc: StreamAccumulator, t_end: float) -> GenResult:
        """A complete answer of either transport: its end time and what the accumulator gathered."""
        res.t_end = t_end
        acc.finish(res)
        if not self.stream:  # one body: everything arrived at once
            res.t_first = res.t_end
        return res

    def _broken(self, req: GenRequest, rid: str, res: GenResult, acc: StreamAccumulator, msg: str) -> GenResult:
        res.t_end = time.perf_counter()
        acc.finish(res)
        res.ok, res.error = False, msg
        return res

    # ---- the rest of the contract ----------------------------------------------------------------
    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        caps = await self._caps()
        if caps is not None and not caps.prompt_logprobs:
            if caps.scoring == "generation":
                return await self._score_by_generation(prompt_ids, continuation_ids, top_k)
            return None
        ids = list(prompt_ids) + list(continuation_ids)
        n, m = len(prompt_ids), len(continuation_ids)
        body: dict[str, Any] = {"model": await self._model(), "prompt": ids, "max_tokens": 0, "echo": True,
                                "logprobs": top_k, "temperature": 0.0}
        if self.extras:
            body["return_tokens_as_token_ids"] = True
        r = await self._request("POST", self.api + "/completions", json=body)
        if r.status_code == 400 and "max_tokens" in r.text:
            r = await self._request("POST", self.api + "/completions", json={**body, "max_tokens": 1})
        if r.status_code != 200:
            return None
        lp = r.json()["choices"][0].get("logprobs")
        chat = isinstance(lp, dict) and isinstance(lp.get("content"), list)
        pos = chat_positions(lp, top_k) if chat else legacy_positions(lp, top_k)
        if len(pos) < n + m:
            return None
        out = pos[n:n + m]
        for p, t in zip(out, continuation_ids, strict=True):
            p.token_id = t if p.token_id is None else p.token_id
        return ScoreResult(out)

    async def _score_by_generation(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int,
                                   max_positions: int = 16) -> ScoreResult | None:
        """Teacher-forced logprobs without echo: one 1-token greedy generation per position, whose first
        token always comes from a plain forward pass (never a draft), so its top-k is real. The pick's
        logprob is known when it is inside that top-k, else None."""
        if len(continuation_ids) > max_positions:
            return None
        out: list[PosLogprobs] = []
        for j, t in enumerate(continuation_ids):
            req = GenRequest(prompt=list(prompt_ids) + list(continuation_ids[:j]), max_tokens=1, temperature=0.0,
                             logprobs=max(top_k, 1), prompt_cache=False)
            res = await self.generate_one(req)
            lps = res.logprobs or []
            if not res.ok or not lps or (lps[0].logprob is None and not lps[0].top):
                return None
            top = dict(lps[0].top)
            if lps[0].token_id is not None and lps[0].logprob is not None:
                top.setdefault(lps[0].token_id, lps[0].logprob)
            out.append(PosLogprobs(token_id=t, logprob=top.get(t), top=top))
        return ScoreResult(out)

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        """One request, retried once on a transport error before any answer: a server may close an idle
        keep-alive connection (llama.cpp's after 5 s), and the pooled connection then fails on reuse."""
        try:
            return await self._client().request(method, url, **kw)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError):
            await asyncio.sleep(self.backoff / 10)
            return await self._client().request(method, url, **kw)

    async def spec_counters(self) -> dict | None:
        """The /metrics snapshot; a failed scrape is retried (a lost snapshot would silently turn a gate's
        speculation evidence into "unverified") and the reasons are kept in `counter_errors`."""
        for attempt in range(3):
            try:
                r = await self._request("GET", self.root + "/metrics")
            except httpx.HTTPError as e:
                self.counter_errors.append(f"/metrics: {type(e).__name__}: {e}")
                if isinstance(e, httpx.ConnectError):  # nothing listens: no counters, at once
                    return None
                await asyncio.sleep(self.backoff * (attempt + 1) / 5)
                continue
            if r.status_code == 404:
                return None
            if r.status_code != 200:
                self.counter_errors.append(f"/metrics: HTTP {r.status_code}")
                await asyncio.sleep(self.backoff * (attempt + 1) / 5)
                continue
            return spec_counters_from_metrics(r.text, self.model)
        return None

    async def reset_prefix_cache(self) -> bool | None:
        """POST /reset_prefix_cache (vLLM with VLLM_SERVER_DEV_MODE=1, `specbench serve`), or SGLang's
        /flush_cache: True when flushed, False when the endpoint refused, None when it has neither route."""
        await self._caps()
        routes = ("/flush_cache",) if self.dialect == "sglang" else ("/reset_prefix_cache",)
        for route in routes:
            try:
                r = await self._request("POST", self.root + route)
            except httpx.HTTPError:
                return None
            if r.status_code in (404, 405):
                continue
            return r.status_code == 200
        return None

    def cold_requests(self) -> bool:
        """vLLM's cache_salt and llama.cpp's cache_prompt keep a prompt_cache=False request off the cache."""
        return self.caps is not None and self.caps.prompt_cache is not None

    async def metrics_text(self) -> str | None:
        """GET /metrics as text (one retry on a failed scrape); None when the endpoint has none."""
        for attempt in range(2):
            try:
                r = await self._request("GET", self.root + "/metrics")
            except httpx.HTTPError as e:
                self.counter_errors.append(f"/metrics: {type(e).__name__}: {e}")
                if isinstance(e, httpx.ConnectError):
                    return None
                await asyncio.sleep(self.backoff * (attempt + 1) / 5)
                continue
            if r.status_code == 200:
                return r.text
            if r.status_code == 404:
                return None
            self.counter_errors.append(f"/metrics: HTTP {r.status_code}")
        return None

    async def tokenize(self, text: str) -> list[int] | None:
        """Token ids of `text` by the endpoint's /tokenize (the body that answers with tokens), else the local
        tokenizer; None when neither can. An empty list for a non-empty text is never returned."""
        await self._caps()
        if self.caps is not None and self.caps.tokenize == "local":
            return self.local_tokenizer.tokenize(text) if self.local_tokenizer is not None else None
        if self._tokenize_ok is not False:
            for name in [self._tokenize_body] if self._tokenize_body else ["prompt", "content"]:
                toks = await self._tokenize_with(name, text)
                if toks is None:
                    continue
                if toks or not text:
                    self._tokenize_body, self._tokenize_ok = name, True
                    return toks
                if self._tokenize_body == name:  # the working body gave nothing for this text
                    break
            if self._tokenize_body is None:
                self._tokenize_ok = False
        if self.local_tokenizer is not None:
            return self.local_tokenizer.tokenize(text)
        return None

    async def _tokenize_with(self, name: str, text: str) -> list[int] | None:
        body = {"model": await self._model(), "prompt": text, "add_special_tokens": False} if name == "prompt" \
            else {"content": text, "add_special": False}
        try:
            r = await self._request("POST", self.root + "/tokenize", json=body)
            toks = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if isinstance(toks, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            return list(toks)
        return None

    def describe(self) -> dict:
        caps = self.probe()
        if self._info is None:
            info: dict[str, Any] = {}
            try:
                with httpx.Client(timeout=5.0, headers=self.headers) as c:
                    models = c.get(self.api + "/models").json().get("data") or []
                    info["models"] = models
                    if self.model is None and models:
                        self.model = models[0].get("id")
                    v = c.get(self.root + "/version")
                    info["version"] = v.json().get("version") if v.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as e:
                info["error"] = f"{type(e).__name__}: {e}"
            if caps is not None and info.get("version") is None:
                info["version"] = caps.server.get("version")
            self._info = info
        d = {"name": self.name, "kind": self.kind, "version": self._info.get("version"), "model": self.model,
             "config": {"base_url": self.root, "stream": self.stream, "extras": self.extras,
                        "timeout": self.timeout.read, "retries": self.retries, "auth": self.auth,
                        "http": "raw" if self.transport is None and usable(self.root) else "httpx",
                        "tokenizer": self.local_tokenizer.path if self.local_tokenizer is not None else None,
                        "dtype": self.dtype},
             "server": self._info}
        if caps is not None:
            d["dialect"] = caps.dialect
            d["capabilities"] = caps.to_dict()
        if self.counter_errors:
            d["counter_errors"] = self.counter_errors[-5:]
        if self.ready is not None:
            d["ready"] = self.ready
        return d

    async def aclose(self) -> None:
        if self._cli is not None and self._cli_loop is asyncio.get_running_loop():
            await self._cli.aclose()
        if self._raw is not None and self._raw_loop is asyncio.get_running_loop():
            await self._raw.aclose()
        self._cli, self._cli_loop = None, None
        self._raw, self._raw_loop = None, None
