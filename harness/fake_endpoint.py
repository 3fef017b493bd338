"""A fast, fault-injecting fake OpenAI-compatible endpoint over real HTTP (asyncio streams, HTTP/1.1).

For tests and benchmarks of the client side (the `openai` adapter, the sweep, benchmarks/client.py): it
serves GET /v1/models, POST /v1/completions and /v1/chat/completions (SSE with `stream: true`, else one
JSON body), and answers 404 to everything else (no /tokenize, /metrics, /version: a plain "openai"
dialect). Generation is fake: `tokens_per_chunk` tokens ("t ") per SSE event, `chunk_interval` s apart
(0: as fast as the socket takes them), up to the request's max_tokens (or `max_tokens` when the
request has none); usage is exact and, with `stream_options.continuous_usage_stats`, on every event.

Faults (`Faults`), decided per request in arrival order, so a test knows exactly what it asked for:
- `fail_first`: the first N attempts of each distinct prompt answer 503 (retried by the adapter);
- `fail_marker`: a prompt containing this text answers HTTP 500 every time (a request that can never
  succeed), unless it asks for a single token (the sweep's one-token probe);
- `api_key`: every route but /health (and `open_paths`) requires `Authorization: Bearer <key>` (else
  `auth_status`, 401 by default; 403 as a proxy may answer); `open_paths=("/v1/models",)` is llama-server's
  way, which lists its models to anyone and refuses the rest;
- `echo_auth`: error bodies quote the request's Authorization header (a leaky server: what a client
  records from an error must still never hold the key);
- `no_models`: GET /v1/models lists no model (an endpoint that must be told model=);
- `empty`: every completion ends at once with no token (finish_reason "stop", usage 0 completion tokens): an
  endpoint that answers 200 and generates nothing;
- `drop_idle`: close every connection right after its response without saying so (a server whose
  keep-alive timeout beat the client's next request: the client must reconnect, not fail).
`FakeEndpoint.state.connections` counts the connections accepted.
`hold_from=N`: a generation that asks for N tokens or more sends nothing until `release()` (probes and one-token
requests, which ask fewer, pass); `held` (a threading.Event) is set when the first one arrives, so a test can
signal a client in the middle of its work by waiting for that event, not for a clock.
Every request's path and headers are kept in `FakeEndpoint.seen` (tests check what the client sent).
`spec_k=K` makes it a speculating server as seen from outside: every streamed chunk of n tokens counts as
one verify step of K drafts with n - 1 accepted, published as vLLM's `vllm:spec_decode_*` counters on
GET /metrics (server-wide, cumulative; no per-request figures in the responses).

`token_id=T` makes it report output token ids where a request asks for them (`return_token_ids`): every
generated token is id T, in each choice's `token_ids` (streamed and not); never `prompt_token_ids` nor
logprobs (an endpoint that gives a gate some of what it needs: tests/test_chat_gates.py).
`FakeEndpoint(...)` runs in a thread of this process (`with FakeEndpoint() as ep: ep.url`);
`python -m specbench.harness.fake_endpoint --port P` runs it as its own process (the client benchmark,
so the server never shares the client's interpreter).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Faults:
    fail_first: int = 0
    fail_marker: str | None = None
    api_key: str | None = None
    auth_status: int = 401
    open_paths: tuple[str, ...] = ()
    echo_auth: bool = False
    drop_idle: bool = False
    empty: bool = False
    no_models: bool = False


@dataclass
class _State:
    model: str = "fake-model"
    tokens_per_chunk: int = 1
    chunk_interval: float = 0.0
    max_tokens: int = 16
    faults: Faults = field(default_factory=Faults)
    attempts: dict[str, int] = field(default_factory=dict)
    seen: list[dict] = field(default_factory=list)
    keep_seen: bool = True
    connections: int = 0
    spec_k: int = 0
    drafts: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    token_id: int | None = None  # report every output token as this id (with return_token_ids)
    hold_from: int | None = None  # generations asking >= this many tokens wait for `release` (FakeEndpoint)
    held: threading.Event = field(default_factory=threading.Event)
    release: asyncio.Event | None = None  # made on the server's loop

    def metrics(self) -> str:
        m = f'model_name="{self.model}"'
        lines = [f"vllm:spec_decode_num_drafts_total{{{m}}} {self.drafts}",
                 f"vllm:spec_decode_num_draft_tokens_total{{{m}}} {self.drafts * self.spec_k}",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{m}}} {self.accepted}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{m},position="{i}"}} {v}'
                  for i, v in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"


def _head(status: int, ctype: str, length: int | None = None) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
              500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Status")
    h = f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
    h += f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
    return (h + "\r\n").encode()


def _json_response(status: int, obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return _head(status, "application/json", len(body)) + body


def _error(status: int, msg: str) -> bytes:
    return _json_response(status, {"error": {"message": msg, "type": "fake", "code": status}})


class _Handler:
    def __init__(self, st: _State) -> None:
        self.st = st

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.st.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                n = int(headers.get("content-length") or 0)
                body = await reader.readexactly(n) if n else b""
                await self.route(method, path, headers, body, writer)
                if self.st.faults.drop_idle:
                    await writer.drain()
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    async def route(self, method: str, path: str, headers: dict, body: bytes, w: asyncio.StreamWriter) -> None:
        st = self.st
        if st.keep_seen:
            st.seen.append({"method": method, "path": path, "headers": headers})
        key = st.faults.api_key
        if key is not None and path != "/health" and path not in st.faults.open_paths \
                and headers.get("authorization") != f"Bearer {key}":
            w.write(_error(st.faults.auth_status, "missing or wrong API key"))
            return
        if method == "GET" and path == "/metrics" and st.spec_k:
            body = st.metrics().encode()
            w.write(_head(200, "text/plain; version=0.0.4", len(body)) + body)
            return
        if method == "GET" and path == "/v1/models":
            models = [] if st.faults.no_models else [{"id": st.model, "object": "model", "owned_by": "fake"}]
            w.write(_json_response(200, {"object": "list", "data": models}))
            return
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                w.write(_error(400, "body is not JSON"))
                return
            await self.generate(req, path.endswith("chat/completions"), w, headers)
            return
        w.write(_error(404, f"no route {method} {path}"))

    async def generate(self, req: dict, chat: bool, w: asyncio.StreamWriter, headers: dict) -> None:
        st, f = self.st, self.st.faults
        prompt = req.get("messages") if chat else req.get("prompt")
        ptext = json.dumps(prompt)
        n_prompt = len(prompt) if isinstance(prompt, list) and not chat else max(1, len(ptext.split()))
        max_tokens = 0 if f.empty else int(req.get("max_tokens") or req.get("max_completion_tokens") or st.max_tokens)
        if f.fail_marker and f.fail_marker in ptext and max_tokens > 1:
            leak = f" (you sent Authorization: {headers.get('authorization')})" if f.echo_auth else ""
            w.write(_error(500, "injected failure (fail_marker)" + leak))
            return
        if st.hold_from is not None and max_tokens >= st.hold_from:
            st.held.set()
            st.release = st.release or asyncio.Event()
            await st.release.wait()
        if f.fail_first:
            seen = st.attempts.get(ptext, 0) + 1
            st.attempts[ptext] = seen
            if seen <= f.fail_first:
                w.write(_error(503, f"injected overload (attempt {seen} of this prompt)"))
                return
        obj = "chat.completion.chunk" if chat else "text_completion"
        ids = st.token_id is not None and bool(req.get("return_token_ids"))
        opts = req.get("stream_options") or {}
        cont = bool(opts.get("continuous_usage_stats"))
        if not req.get("stream"):
            text = "t " * max_tokens
            said = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if f.empty else "length", **said}
            if ids:
                choice["token_ids"] = [st.token_id] * max_tokens
            w.write(_json_response(200, {"id": "fake-1", "object": obj.replace(".chunk", ""), "model": st.model,
                                         "choices": [choice], "usage": _usage(n_prompt, max_tokens)}))
            return
        w.write(_head(200, "text/event-stream"))
        done = 0
        while done < max_tokens:
            k = min(st.tokens_per_chunk, max_tokens - done)
            done += k
            if st.spec_k:  # one verify step: K drafts, k - 1 of them accepted, then the bonus token
                st.drafts += 1
                acc = min(k - 1, st.spec_k)
                st.accepted += acc
                st.per_pos = st.per_pos or [0] * st.spec_k
                for i in range(acc):
                    st.per_pos[i] += 1
            text = "t " * k
            choice = {"index": 0, "finish_reason": "length" if done == max_tokens else None}
            if chat:
                choice["delta"] = {"content": text} if done > k else {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if ids:
                choice["token_ids"] = [st.token_id] * k
            ev: dict[str, Any] = {"id": "fake-1", "object": obj, "model": st.model, "choices": [choice]}
            if cont:
                ev["usage"] = _usage(n_prompt, done)
            _chunk(w, ev)
            if st.chunk_interval > 0:
                await asyncio.sleep(st.chunk_interval)
            elif done % 64 == 0:
                await w.drain()
        if f.empty:  # one event that ends the choice with no text
            end: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            end.update({"delta": {"role": "assistant", "content": ""}} if chat else {"text": ""})
            _chunk(w, {"id": "fake-1", "object": obj, "model": st.model, "choices": [end],
                       **({"usage": _usage(n_prompt, 0)} if cont else {})})
        if opts.get("include_usage"):
            _chunk(w, {"id": "fake-1", "object": obj, "model": st.model, "choices": [],
                       "usage": _usage(n_prompt, max_tokens)})
        data = b"data: [DONE]\n\n"
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        await w.drain()


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chunk(w: asyncio.StreamWriter, ev: dict) -> None:
    data = b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"
    w.write(b"%x\r\n%s\r\n" % (len(data), data))


class FakeEndpoint:
    """The fake endpoint on 127.0.0.1 in a daemon thread; `url` is its root (http://127.0.0.1:PORT)."""

    def __init__(self, tokens_per_chunk: int = 1, chunk_interval: float = 0.0, max_tokens: int = 16,
                 faults: Faults | None = None, model: str = "fake-model", port: int = 0, keep_seen: bool = True,
                 spec_k: int = 0, token_id: int | None = None, hold_from: int | None = None) -> None:
        self.state = _State(model=model, tokens_per_chunk=tokens_per_chunk, chunk_interval=chunk_interval,
                            max_tokens=max_tokens, faults=faults or Faults(), keep_seen=keep_seen, spec_k=spec_k,
                            token_id=token_id, hold_from=hold_from)
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def seen(self) -> list[dict]:
        return self.state.seen

    @property
    def held(self) -> threading.Event:
        return self.state.held

    def release(self) -> None:
        """Let the held generations (hold_from) go on."""
        def go() -> None:
            self.state.release = self.state.release or asyncio.Event()
            self.state.release.set()

        if self._loop is not None:
            self._loop.call_soon_threadsafe(go)

    def __enter__(self) -> FakeEndpoint:
        self._thread = threading.Thread(target=self._run, name="fake-endpoint", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake endpoint did not start within 10 s")
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(asyncio.start_server(_Handler(self.state).serve, "127.0.0.1", self.port))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        self._server.close()
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:  # open keep-alive connections: end their handlers before the loop closes
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


async def serve(port: int, tokens_per_chunk: int, chunk_interval: float, max_tokens: int) -> None:
    st = _State(tokens_per_chunk=tokens_per_chunk, chunk_interval=chunk_interval, max_tokens=max_tokens,
                keep_seen=False)
    server = await asyncio.start_server(_Handler(st).serve, "127.0.0.1", port, backlog=4096)
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A fast fake OpenAI-compatible endpoint (see the module docstring).")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--chunk-interval", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    try:
        asyncio.run(serve(a.port, a.tokens_per_chunk, a.chunk_interval, a.max_tokens))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
