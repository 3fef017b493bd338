"""In-process HTTP test doubles of two endpoint dialects: llama.cpp's llama-server and vLLM.

Both serve one tiny deterministic "language model" (tests/lossless_fakes.py's: after context ids the greedy
token is (3 * ids[-1] + 1) % V), through FastAPI under uvicorn on a free loopback port, so every client
path (the sync probe, the async adapter, the CLI through engine strings) talks real HTTP.

What each double reproduces (the facts in harness/adapters/dialect.py):
- llama.cpp: /v1/models owned_by "llamacpp"; /version 404, /props with build_info and sampler defaults;
  /tokenize answers `{"content"}` bodies and gives `{"tokens": []}` for a `{"prompt"}` body; native
  /completion (token-id or text prompts, `tokens`, `completion_probabilities`, `timings.draft_n`, one token
  per streamed event); /v1/completions ignores return_token_ids, refuses echo, chat-shaped logprobs, usage
  only on the final event; under speculation (`spec=True`) every second token is "accepted from a draft"
  and carries no logprobs (0.0 + [] in a body, no entry when streaming); `llamacpp:` counters on /metrics;
  the server's top_k 40 / min_p 0.05 apply to a request that does not send its own (recorded in `seen`).
- vLLM: owned_by "vllm", /version, /tokenize with `{"prompt"}`, return_token_ids per chunk, legacy
  logprobs with "token_id:N" strings, echo + prompt logprobs, continuous usage, `vllm:` counters.
Knobs remove capabilities: `ids=False` (no output ids on any route), `tokenize=False` (404), `tokenize="empty"`
(200 `{"tokens": []}` for every body), `model="wrong"` (a different model: the broken pairing). `flip_at=i`
makes the server emit the runner-up at output position i of every generation longer than i (a flip;
`gap` is the runner-up's distance from the top token in nat, 3.0 by default: 0.1 makes it a near-tie).
`prefix_cache=True` (vLLM) reproduces the prefix-cache tie flip of reports/h200-vllm (finding 2): a
/v1/completions prompt already seen with the same `cache_salt` (none = the shared cache) is a cache hit and
emits the runner-up at output position 0; a request with a salt of its own is always cold.
`empty=True` (vLLM) yields no token but claims token ids and logprobs: every answer carries `token_ids: []`
and empty logprobs, finish_reason "stop", usage completion_tokens 0 (no evidence of anything: CANNOT TEST).
`steps=True` (vLLM, with spec=True) streams each step as one chunk, as vLLM does: a token "accepted from a draft"
travels with the token before it, so a speculating server shows chunks of two tokens even with `metrics=False`.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

V = 32


def dist(ids: list[int], model: str = "target", gap: float = 3.0) -> dict[int, float]:
    last = ids[-1] if ids else 0
    nxt = (3 * last + 1) % V if model == "target" else (5 * last + 2) % V
    out = {t: -9.0 for t in range(V)}
    out[nxt], out[(nxt + 1) % V], out[(nxt + 2) % V] = -0.05, -0.05 - gap, -4.0
    return out


def piece(t: int) -> str:
    return chr(ord("a") + t % 26) if t < 26 else " "


def encode(text: str) -> list[int]:
    return [ord(c) % V for c in text]


def sample(d: dict[int, float], temperature: float, top_k: int, rng: np.random.Generator) -> int:
    ranked = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))
    if temperature <= 0:
        return ranked[0][0]
    if top_k and top_k > 0:
        ranked = ranked[:top_k]
    lp = np.array([v / temperature for _, v in ranked])
    p = np.exp(lp - lp.max())
    p /= p.sum()
    return int(ranked[int(rng.choice(len(ranked), p=p))][0])


@dataclass
class FakeServer:
    dialect: str = "llamacpp"  # or "vllm"
    spec: bool = False  # speculating: drafts every second token
    model: str = "target"
    ids: bool = True
    tokenize: bool | str = True
    metrics: bool = True
    flip_at: int | None = None
    gap: float = 3.0
    tokenizer_json: str | None = None  # tokenize with this tokenizer.json instead of one id per character
    empty: bool = False  # vLLM: no token, but `token_ids: []` and empty logprobs (finish "stop")
    steps: bool = False  # vLLM with spec=True: stream each step as one chunk (a drafted token beside the one before)
    prefix_cache: bool = False  # vLLM: a prompt seen before under the same cache_salt flips output position 0
    cached: set = field(default_factory=set)  # (cache_salt, prompt ids) the fake prefix cache holds
    seen: list[dict] = field(default_factory=list)  # request bodies, by route
    counters: dict = field(default_factory=lambda: {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0]})

    # ---- the model -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer_json:
            from tokenizers import Tokenizer

            return list(Tokenizer.from_file(self.tokenizer_json).encode(text, add_special_tokens=False).ids)
        return encode(text)

    def run(self, prompt: list[int] | str, n: int, temperature: float, top_k: int, seed: int | None,
            n_probs: int, flip_at: int | None = None) -> tuple[list[int], list[dict | None], dict]:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rng = np.random.default_rng(seed if seed is not None else 0)
        out: list[int] = []
        probs: list[dict | None] = []
        drafted = accepted = 0
        for i in range(0 if self.empty else max(n, 1)):
            d = dist(ids + out, self.model, self.gap)
            t = sample(d, temperature, top_k, rng)
            if (self.flip_at == i or flip_at == i) and n > i:
                t = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[1][0]
            from_draft = self.spec and i % 2 == 1
            if from_draft:
                drafted += 1
                accepted += 1
            out.append(t)
            if n_probs and not (from_draft and self.dialect == "llamacpp"):
                ranked = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:n_probs]
                probs.append({"id": t, "token": piece(t), "logprob": d[t],
                              "top_logprobs": [{"id": a, "token": piece(a), "logprob": v} for a, v in ranked]})
            else:
                probs.append(None)
        if self.spec and drafted:
            c = self.counters
            c["drafts"] += drafted
            c["draft_tokens"] += 2 * drafted
            c["accepted"] += accepted
            c["per_pos"][0] += accepted
        timings = {"predicted_n": len(out)}
        if self.spec and drafted:
            timings.update(draft_n=2 * drafted, draft_n_accepted=accepted)
        return out, probs, timings

    def metrics_text(self) -> str:
        c = self.counters
        p = "llamacpp:" if self.dialect == "llamacpp" else "vllm:"
        lines = [f"{p}prompt_tokens_total 10", f"{p}spec_decode_num_drafts_total {c['drafts']}",
                 f"{p}spec_decode_num_draft_tokens_total {c['draft_tokens']}",
                 f"{p}spec_decode_num_accepted_tokens_total {c['accepted']}"]
        lines += [f'{p}spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
                  for i, v in enumerate(c["per_pos"])]
        return "\n".join(lines) + "\n"

    # ---- the app ---------------------------------------------------------------------------------
    def app(self):
        app = FastAPI()
        srv = self
        llama = self.dialect == "llamacpp"

        def err(status: int, msg: str) -> JSONResponse:
            return JSONResponse({"error": {"code": status, "message": msg, "type": "invalid_request_error"}},
                                status_code=status)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "tiny", "object": "model",
                                                "owned_by": "llamacpp" if llama else "vllm",
                                                **({"meta": {"n_vocab": V}} if llama else {})}]}

        @app.get("/version")
        async def version():
            if llama:
                return JSONResponse({"error": {"code": 404, "message": "File Not Found"}}, status_code=404)
            return {"version": "0.0.0-fake"}

        @app.get("/props")
        async def props():
            if not llama:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"build_info": "b0000-fake", "default_generation_settings": {
                "params": {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8}}}

        @app.get("/metrics")
        async def metrics():
            if not srv.metrics:
                return PlainTextResponse("not found", status_code=404)
            return PlainTextResponse(srv.metrics_text())

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            srv.seen.append({"route": "/tokenize", **body})
            if srv.tokenize is False:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            if srv.tokenize == "empty":
                return {"tokens": []}
            if llama:
                return {"tokens": srv.encode(body["content"]) if "content" in body else []}
            return {"tokens": srv.encode(body.get("prompt") or ""), "count": 0}

        def samplers(body: dict) -> tuple[float, int]:
            t = float(body.get("temperature", 0.8 if llama else 1.0))
            k = int(body.get("top_k", 40 if llama else -1))
            return t, k

        @app.post("/completion")
        async def native(request: Request):
            if not llama:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            body = await request.json()
            srv.seen.append({"route": "/completion", **body})
            prompt = body.get("prompt")
            if prompt in ("", [], None):
                return err(400, '"prompt" must not be empty')
            t, k = samplers(body)
            n_probs = int(body.get("n_probs", 0))
            out, probs, timings = srv.run(prompt, int(body.get("n_predict", 16)), t, k, body.get("seed"), n_probs)
            n_prompt = len(prompt) if isinstance(prompt, list) else len(srv.encode(prompt))
            final = {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": len(out),
                     "tokens_evaluated": n_prompt, "timings": timings}
            if not body.get("stream"):
                final["content"] = "".join(piece(x) for x in out)
                final["tokens"] = out if (body.get("return_tokens") and srv.ids) else []
                if n_probs:
                    final["completion_probabilities"] = [
                        p if p is not None else {"id": x, "token": piece(x), "logprob": 0.0, "top_logprobs": []}
                        for x, p in zip(out, probs, strict=True)]
                return final

            def events() -> Iterator[bytes]:
                for x, p in zip(out, probs, strict=True):
                    ev: dict = {"content": piece(x), "tokens": [x] if srv.ids else [], "stop": False}
                    if p is not None:
                        ev["completion_probabilities"] = [p]
                    yield f"data: {json.dumps(ev)}\n\n".encode()
                yield f"data: {json.dumps(final)}\n\n".encode()

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            srv.seen.append({"route": "/v1/completions", **body})
            prompt = body.get("prompt")
            if prompt in ("", [], None):
                return err(400, '"prompt" must not be empty')
            if body.get("echo") and llama:
                return err(500, "Only no echo is supported")
            t, k = samplers(body)
            n_probs = int(body.get("logprobs") or 0)
            n = int(body.get("max_tokens", 16))
            p_ids = prompt if isinstance(prompt, list) else srv.encode(prompt)
            hit = None
            if srv.prefix_cache and not llama:
                key = (body.get("cache_salt"), tuple(p_ids))
                hit = 0 if key in srv.cached else None
                srv.cached.add(key)
            out, probs, timings = srv.run(prompt, n, t, k, body.get("seed"), n_probs, flip_at=hit)
            usage = {"prompt_tokens": len(p_ids), "completion_tokens": len(out), "total_tokens": len(p_ids) + len(out)}
            want_ids = body.get("return_token_ids") and srv.ids and not llama
            as_ids = body.get("return_tokens_as_token_ids") and srv.ids and not llama

            def lp_of(xs: list[int], ps: list[dict | None]) -> dict | None:
                if not n_probs:
                    return None
                if llama:
                    return {"content": [p if p is not None else {"id": x, "token": piece(x), "logprob": 0.0,
                                                                 "top_logprobs": []} for x, p in zip(xs, ps, strict=True)]}
                name = (lambda a: f"token_id:{a}") if as_ids else piece
                return {"tokens": [name(x) for x in xs], "token_logprobs": [p["logprob"] for p in ps],
                        "top_logprobs": [{name(a["id"]): a["logprob"] for a in p["top_logprobs"]} for p in ps]}

            if body.get("echo"):  # vLLM: prompt logprobs first (position 0 None), then the generated tokens
                pd = [None] + [dist(p_ids[:i], srv.model, srv.gap) for i in range(1, len(p_ids))]
                ptoks = [f"token_id:{a}" if as_ids else piece(a) for a in p_ids]
                lp = lp_of(out, probs) or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
                tops = [None] + [{(f"token_id:{a}" if as_ids else piece(a)): v for a, v in
                                  sorted(d.items(), key=lambda kv: -kv[1])[:n_probs]} for d in pd[1:]]
                lp = {"tokens": ptoks + lp["tokens"],
                      "token_logprobs": [None] + [pd[i][p_ids[i]] for i in range(1, len(p_ids))] + lp["token_logprobs"],
                      "top_logprobs": tops + lp["top_logprobs"]}
                return {"choices": [{"index": 0, "text": "", "logprobs": lp, "finish_reason": "length"}], "usage": usage}
            if not body.get("stream"):
                ch: dict = {"index": 0, "text": "".join(piece(x) for x in out), "logprobs": lp_of(out, probs),
                            "finish_reason": "stop" if srv.empty else "length"}
                if want_ids:
                    ch["token_ids"] = out
                res: dict = {"choices": [ch], "usage": usage}
                if llama:
                    res["timings"] = timings
                return res
            cont = (body.get("stream_options") or {}).get("continuous_usage_stats") and not llama

            def events() -> Iterator[bytes]:
                steps: list[list[int]] = []  # output positions per streamed chunk
                for i in range(len(out)):
                    if srv.steps and srv.spec and not llama and i % 2 == 1 and steps:
                        steps[-1].append(i)  # a token accepted from a draft: the same step, the same chunk
                    else:
                        steps.append([i])
                for st in steps:
                    xs, ps = [out[i] for i in st], [probs[i] for i in st]
                    c: dict = {"index": 0, "text": "".join(piece(x) for x in xs), "finish_reason": None}
                    if n_probs:
                        c["logprobs"] = None if (llama and ps[0] is None) else lp_of(xs, ps)
                    if want_ids:
                        c["token_ids"] = xs
                    ev: dict = {"choices": [c]}
                    if cont:
                        ev["usage"] = {"prompt_tokens": len(p_ids), "completion_tokens": st[-1] + 1}
                    yield f"data: {json.dumps(ev)}\n\n".encode()
                last: dict = {"choices": [{"index": 0, "text": "", "finish_reason": "stop" if srv.empty else "length"}]}
                if srv.empty:  # the claim without the tokens: ids and logprobs, both empty
                    last["choices"][0].update(token_ids=[] if want_ids else None,
                                              logprobs=lp_of([], []) if n_probs else None)
                if llama:
                    last["timings"] = timings
                yield f"data: {json.dumps(last)}\n\n".encode()
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proxy_app(upstream: str, blocked: tuple[str, ...] = ()) -> FastAPI:
    """A pass-through to a real server with some routes removed (404): a capability taken away."""
    import httpx

    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        if "/" + path in blocked:
            return JSONResponse({"error": {"code": 404, "message": "File Not Found"}}, status_code=404)
        body = await request.body()
        async with httpx.AsyncClient(timeout=600) as c:
            r = await c.request(request.method, f"{upstream}/{path}", content=body,
                                headers={"content-type": request.headers.get("content-type", "application/json")})
        return StreamingResponse(iter([r.content]), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"))

    return app


@contextlib.contextmanager
def serving(fake: FakeServer | FastAPI) -> Iterator[str]:
    """Run the fake (or any ASGI app) under uvicorn in a thread; yields its base URL (http://127.0.0.1:PORT)."""
    import uvicorn

    port = _free_port()
    app = fake.app() if isinstance(fake, FakeServer) else fake
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t_end = time.monotonic() + 10
    while not server.started and time.monotonic() < t_end:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(timeout=5)


def logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
