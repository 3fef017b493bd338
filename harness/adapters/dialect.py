"""Endpoint dialects: what an OpenAI-compatible server is and can do, probed once and recorded.

Contract:
- `probe_endpoint(client, root, api, model, ...)` sends a handful of small requests (models, version or
  props, /tokenize in both bodies, one token-id generation per route, one echo request, /metrics) and
  returns a `Capabilities`. It never raises: what could not be determined is None and the reason is in
  `errors` (`unreachable` says why when GET /v1/models could not connect at all; an exception raised by the
  client's own event hooks, the adapter's AuthRefused on a 401 / 403, passes through).
  `Capabilities.to_dict()` is the record that goes into `describe()["capabilities"]`, hence
  into every run record (`run.json` engines) and report.
- Dialects: "llamacpp" (llama.cpp's llama-server: `owned_by: llamacpp`, `/props` with `build_info`),
  "vllm", "sglang", "specbench" (`specbench serve`), "openai" (anything else OpenAI-compatible). A
  dialect decides routes, never verdicts: every route is also probed, so a server that changed is
  recorded as it is.
- llama.cpp facts used here (vendored source, tools/server): `/tokenize` takes `{"content"}` (a
  `{"prompt"}` body answers HTTP 200 `{"tokens": []}`); `/v1/completions` ignores `return_token_ids` and
  `echo` (one logprob position for a whole prompt); the native `/completion` takes token-id prompts,
  streams one token per event with `tokens: [id]`, returns `tokens` with `return_tokens: true` when not
  streaming, logprobs as `completion_probabilities: [{id, token, logprob, top_logprobs: [{id, token,
  logprob}]}]` for `n_probs > 0`; under speculation every token a verify step emits (the accepted drafts
  and the target's own token after them) carries no logprobs (`0.0` with an empty list, or no entry at
  all when streaming): only tokens sampled outside a verify step, position 0 at least, have them;
  `timings.draft_n` / `draft_n_accepted` per request (only when it drafted);
  usage only on the final stream event; `cache_prompt` defaults to on; sampler defaults top_k 40,
  min_p 0.05, top_p 0.95 unless sent; counters under `llamacpp:spec_decode_*`; `/version` is 404.
- `missing_positions(logprobs)` lists output positions whose logprobs are missing or fake (None logprob
  and empty top-k: the parsers normalise llama.cpp's `0.0` + empty list to that), which no gate may use
  as a distribution.
- `LocalTokenizer(dir)` tokenizes with the model's own `tokenizer.json` (the `tokenizers` library) for
  endpoints that cannot; every text is checked to round-trip (decode(encode(text)) == text) and the
  probe compares its ids with the endpoint's own prompt token count where it can.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .base import PosLogprobs

DIALECTS = ("llamacpp", "vllm", "sglang", "specbench", "openai")
PROBE_TEXT = "Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:"
PROBE_TOP_K = 20


@dataclass
class Capabilities:
    """What one endpoint can do (None = could not be determined; see `errors`)."""

    dialect: str = "openai"
    server: dict = field(default_factory=dict)  # owned_by, version, build, model meta
    token_id_prompts: bool | None = None
    tokenize: str | None = None  # "prompt" (vLLM / specbench body) | "content" (llama.cpp) | "local" | None
    tokenizer: dict | None = None  # the local tokenizer: dir, round trip, agreement with the endpoint
    generate_route: str = "/v1/completions"  # "/completion" = llama.cpp's native route
    output_ids: str | None = None  # "token_ids" (return_token_ids) | "tokens" (native) | "logprob_ids" | None
    logprobs: str | None = None  # "legacy" {tokens, token_logprobs, top_logprobs} | "chat" content[] | "native"
    top_logprobs: int | None = None  # top-k depth the endpoint returned when asked for PROBE_TOP_K
    prompt_logprobs: bool | None = None  # echo + logprobs (teacher-forced scoring of a continuation)
    scoring: str | None = None  # "echo" | "generation" (one 1-token generation per position) | None
    usage: str | None = None  # "per_chunk" | "final" | "none" (streaming)
    metrics_prefix: str | None = None  # "vllm:" | "llamacpp:" | "sglang:" | None
    spec_counters: bool | None = None  # cumulative draft counters on /metrics
    per_request_spec: str | None = None  # "spec_decode" (vLLM-style per request) | "timings" (llama.cpp) | None
    prompt_cache: str | None = None  # request field that keeps a request off the prompt cache ("cache_prompt",
    # llama.cpp; "cache_salt", vLLM: a fresh salt per request)
    sampler_defaults: dict | None = None  # server-side defaults applied unless a request sends its own
    speculated_logprobs: str | None = None  # "reported" | "missing" (llama.cpp: no token of a verify step has any)
    unreachable: str | None = None  # why GET /v1/models could not even connect (nothing else was probed)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def missing(self) -> list[str]:
        """The capabilities a gate may need that this endpoint lacks, by name."""
        out = []
        if self.token_id_prompts is False:
            out.append("token-id prompts")
        if self.tokenize is None:
            out.append("tokenize")
        if self.output_ids is None:
            out.append("output token ids")
        if self.logprobs is None:
            out.append("logprobs")
        if not self.prompt_logprobs and self.scoring is None:
            out.append("teacher-forced scoring")
        if not self.spec_counters:
            out.append("spec counters")
        return out  # speculated_logprobs == "missing" is a dialect fact: positions are flagged where it bites

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["unreachable"] is None:
            del d["unreachable"]
        d["missing"] = self.missing()
        return d


# ---- parsing ---------------------------------------------------------------------------------------
def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def entry_position(e: dict, k: int | None, requested: bool = True) -> PosLogprobs:
    """One chat-shaped / native logprob entry {id?, token, logprob, top_logprobs: [{id?, token, logprob}]}.

    A position with an empty top list and logprob 0.0 while top-k was requested is llama.cpp's
    placeholder for a token accepted from a draft: it is returned as missing (logprob None, top {})."""
    from .openai_stream import token_id

    alts = list(e.get("top_logprobs") or e.get("top_probs") or [])
    tid = _int(e.get("id"))
    if tid is None:
        tid = token_id(e.get("token"))
    lp = e.get("logprob")
    if requested and k and not alts and (lp is None or lp == 0.0):
        return PosLogprobs(token_id=tid, logprob=None, top={}, token=e.get("token"))
    alts = alts[: k if k is not None else None]
    ids: dict[int | None, float] = {}
    for a in alts:
        aid = _int(a.get("id"))
        ids[aid if aid is not None else token_id(a.get("token"))] = a.get("logprob")
    as_ids = bool(ids) and all(x is not None for x in ids)
    return PosLogprobs(token_id=tid, logprob=lp if isinstance(lp, (int, float)) else None,
                       top={x: v for x, v in ids.items() if x is not None and v is not None} if as_ids else {},
                       token=e.get("token"),
                       top_text=None if as_ids or not alts else {a.get("token"): a.get("logprob") for a in alts})


def missing_positions(logprobs: list[PosLogprobs] | None) -> list[int]:
    """Output positions whose logprobs are missing or fake (no logprob, no top-k)."""
    return [i for i, p in enumerate(logprobs or []) if p.logprob is None and not p.top and not p.top_text]


def llamacpp_spec(timings: dict | None) -> dict | None:
    """Per-request draft counts from llama.cpp's `timings` (draft_n / draft_n_accepted, absent = 0).

    llama.cpp reports no per-request verify-step count, so `num_drafts` is left out: consumers that need
    it (mean accepted length) fall back to the server-wide counters."""
    if not isinstance(timings, dict):
        return None
    return {"num_draft_tokens": int(timings.get("draft_n") or 0),
            "num_accepted_tokens": int(timings.get("draft_n_accepted") or 0), "source": "timings"}


# ---- the local tokenizer ---------------------------------------------------------------------------
class TokenizerError(ValueError):
    """A --tokenizer directory that cannot be used (missing tokenizer.json, a failed round trip)."""


class LocalTokenizer:
    """The model's own tokenizer.json, for an endpoint that cannot tokenize."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise TokenizerError(f"--tokenizer {path}: no tokenizer.json there (give the model directory)")
        from tokenizers import Tokenizer

        self.path = str(p)
        self.tok = Tokenizer.from_file(str(f))
        if not self.round_trips(PROBE_TEXT):
            raise TokenizerError(f"--tokenizer {path}: decode(encode(text)) != text on the probe text")

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def round_trips(self, text: str) -> bool:
        return self.decode(self.encode(text)) == text

    def tokenize(self, text: str) -> list[int] | None:
        """Ids of `text`, or None when the text does not survive the round trip (never a lossy prompt)."""
        ids = self.encode(text)
        if text and not ids:
            return None
        return ids if self.decode(ids) == text else None


# ---- the probe -------------------------------------------------------------------------------------
def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _err(r: httpx.Response) -> str:
    return f"HTTP {r.status_code}: {r.text[:160]}"


def _dialect_of(models: list[dict], version: Any, props: Any, metrics: str | None) -> str:
    owners = {str(m.get("owned_by") or "").lower() for m in models if isinstance(m, dict)}
    if "llamacpp" in owners or (isinstance(props, dict) and "build_info" in props) or \
            (metrics and "llamacpp:" in metrics):
        return "llamacpp"
    if "sglang" in owners or (metrics and "sglang:" in metrics):
        return "sglang"
    if "specbench" in owners:
        return "specbench"
    if "vllm" in owners or (metrics and "vllm:" in metrics):
        return "vllm"
    return "openai"


def _metrics_prefix(text: str | None) -> tuple[str | None, bool]:
    if not text:
        return None, False
    for p in ("llamacpp:", "vllm:", "sglang:"):
        if any(line.startswith(p) for line in text.splitlines()):
            spec = any(line.startswith(p + "spec_decode_num_draft") or line.startswith(p + "spec_")
                       for line in text.splitlines())
            return p, spec
    return None, False


def probe_endpoint(client: httpx.Client, root: str, api: str, model: str | None, *, extras: bool = True,
                   tokenizer: LocalTokenizer | None = None, dialect: str | None = None,
                   generate: bool = True) -> Capabilities:
    """Probe one endpoint (see the module contract). `dialect` forces the dialect instead of detecting it."""
    caps = Capabilities()
    models: list[dict] = []
    version = props = metrics = None
    try:
        r = client.get(api + "/models")
        models = (_json(r) or {}).get("data") or [] if r.status_code == 200 else []
        if r.status_code != 200:
            caps.errors.append(f"/v1/models: {_err(r)}")
    except httpx.HTTPError as e:
        caps.errors.append(f"/v1/models: {type(e).__name__}: {e}")
        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            caps.unreachable = f"GET {api}/models: {type(e).__name__}: {e}"
        return caps  # nothing answers: every capability stays unknown
    if model is None and models:
        model = models[0].get("id")
    m0 = next((m for m in models if m.get("id") == model), models[0] if models else {})
    caps.server = {"owned_by": m0.get("owned_by"), "model": model}
    if isinstance(m0.get("meta"), dict):
        caps.server["meta"] = m0["meta"]
    try:
        r = client.get(root + "/version")
        if r.status_code == 200:
            version = (_json(r) or {}).get("version")
            caps.server["version"] = version
        else:
            caps.notes.append(f"/version: HTTP {r.status_code}")
            rp = client.get(root + "/props")
            if rp.status_code == 200 and isinstance(_json(rp), dict):
                props = _json(rp)
                caps.server["build"] = props.get("build_info")
                caps.server["version"] = props.get("build_info")
                dgs = props.get("default_generation_settings") or {}
                params = dgs.get("params")
                dp = params if isinstance(params, dict) else dgs
                sd = {k: dp.get(k) for k in ("top_k", "top_p", "min_p", "temperature") if k in dp}
                caps.sampler_defaults = sd or None
    except httpx.HTTPError as e:
        caps.errors.append(f"/version: {type(e).__name__}: {e}")
    try:
        r = client.get(root + "/metrics")
        metrics = r.text if r.status_code == 200 else None
        if r.status_code != 200:
            caps.notes.append(f"/metrics: HTTP {r.status_code}")
    except httpx.HTTPError as e:
        caps.errors.append(f"/metrics: {type(e).__name__}: {e}")
    caps.metrics_prefix, caps.spec_counters = _metrics_prefix(metrics)
    caps.dialect = dialect or _dialect_of(models, version, props, metrics)
    llama = caps.dialect == "llamacpp"
    if llama:
        caps.prompt_cache = "cache_prompt"
        if caps.sampler_defaults is None:
            caps.sampler_defaults = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}
        caps.notes.append("every request sends its own top_k / top_p / min_p (the server's defaults would "
                          f"apply otherwise: {caps.sampler_defaults})")
    elif caps.dialect in ("vllm", "specbench"):  # specbench serve takes vLLM's cache_salt (docs/prefix-cache.md)
        caps.prompt_cache = "cache_salt"
        caps.notes.append("prompt_cache=False requests carry a fresh cache_salt each (vLLM >= 0.9): no prefix-cache "
                          "hit, so a gate's request is computed cold")

    # /tokenize: which body answers with tokens for a non-empty text
    ids: list[int] | None = None
    bodies = [("content", {"content": PROBE_TEXT, "add_special": False}),
              ("prompt", {"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False})]
    for name, body in (bodies if llama else bodies[::-1]):
        try:
            r = client.post(root + "/tokenize", json=body)
        except httpx.HTTPError as e:
            caps.errors.append(f"/tokenize ({name}): {type(e).__name__}: {e}")
            break
        toks = (_json(r) or {}).get("tokens") if r.status_code == 200 and isinstance(_json(r), dict) else None
        if isinstance(toks, list) and toks and all(_int(t) is not None for t in toks):
            caps.tokenize, ids = name, [int(t) for t in toks]
            break
        if r.status_code == 200:
            caps.notes.append(f"/tokenize with a {{{name!r}}} body answered {str(toks)[:40]} for a non-empty text: "
                              "not this body")
        elif r.status_code == 404:
            break
    if tokenizer is not None:
        local = tokenizer.tokenize(PROBE_TEXT)
        caps.tokenizer = {"dir": tokenizer.path, "round_trip": local is not None}
        if ids is not None:
            caps.tokenizer["agrees_with_endpoint"] = local == ids
        if caps.tokenize is None and local:
            caps.tokenize, ids = "local", local
    if not generate:
        return caps

    # generation: token-id prompts, output ids, logprobs shape and depth, per-request spec counts
    prompt: Any = ids if ids else PROBE_TEXT
    if llama:
        _probe_native(client, root, prompt, caps)
    _probe_completions(client, api, model, prompt, caps, extras, llama)
    if caps.tokenize == "local" and caps.tokenizer is not None and ids:
        _probe_local_agreement(client, api, model, ids, caps)
    _probe_echo(client, api, model, ids, caps, extras)
    if llama:
        caps.speculated_logprobs = "missing"
        caps.notes.append("tokens emitted by a verify step (accepted drafts and the token after them) carry no "
                          "logprobs (0.0 with an empty top list, none when streaming): such positions are flagged, "
                          "never used as a distribution")
        if caps.scoring is None and caps.token_id_prompts and caps.logprobs:
            caps.scoring = "generation"
    elif caps.prompt_logprobs:
        caps.speculated_logprobs = "reported"
    return caps


def _probe_native(client: httpx.Client, root: str, prompt: Any, caps: Capabilities) -> None:
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "n_probs": PROBE_TOP_K, "return_tokens": True, "cache_prompt": False, "stream": False}
    try:
        r = client.post(root + "/completion", json=body)
    except httpx.HTTPError as e:
        caps.errors.append(f"/completion: {type(e).__name__}: {e}")
        return
    obj = _json(r)
    if r.status_code != 200 or not isinstance(obj, dict):
        caps.errors.append(f"/completion: {_err(r)}")
        return
    caps.generate_route = "/completion"
    if isinstance(prompt, list):
        caps.token_id_prompts = True
    toks = obj.get("tokens")
    if isinstance(toks, list) and toks:
        caps.output_ids = "tokens"
    cp = obj.get("completion_probabilities")
    if isinstance(cp, list) and cp:
        caps.logprobs = "native"
        caps.top_logprobs = max(len(e.get("top_logprobs") or []) for e in cp)
    if isinstance(obj.get("timings"), dict):
        caps.per_request_spec = "timings"
    caps.usage = "final"


def _probe_completions(client: httpx.Client, api: str, model: str | None, prompt: Any, caps: Capabilities,
                       extras: bool, llama: bool) -> None:
    """One streamed /v1/completions request: ids, logprobs shape, usage per chunk, per-request spec."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0.0,
                            "logprobs": PROBE_TOP_K, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if extras:
        body.update(return_token_ids=True, return_tokens_as_token_ids=True)
    if llama:
        body.update(cache_prompt=False, top_k=0, min_p=0.0, top_p=1.0)
    try:
        events: list[dict] = []
        with client.stream("POST", api + "/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                if isinstance(prompt, list) and caps.token_id_prompts is None and r.status_code in (400, 422):
                    caps.token_id_prompts = False
                caps.errors.append(f"/v1/completions: {_err(r)}")
                return
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    try:
                        events.append(json.loads(line[5:].strip()))
                    except ValueError:
                        pass
    except httpx.HTTPError as e:
        caps.errors.append(f"/v1/completions: {type(e).__name__}: {e}")
        return
    if isinstance(prompt, list) and caps.token_id_prompts is None:
        caps.token_id_prompts = True
    content = [ev for ev in events if any((c.get("text") or c.get("token_ids")) for c in ev.get("choices") or [])]
    if caps.output_ids is None:
        if content and all(c.get("token_ids") is not None for ev in content for c in ev.get("choices") or []):
            caps.output_ids = "token_ids"
    shapes = set()
    depth = 0
    for ev in content:
        for c in ev.get("choices") or []:
            lp = c.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                shapes.add("chat")
                depth = max([depth] + [len(x.get("top_logprobs") or []) for x in lp["content"]])
                if caps.output_ids is None and lp["content"] and all(_int(x.get("id")) is not None
                                                                     for x in lp["content"]):
                    caps.notes.append("/v1/completions reports ids only inside logprobs (chat-shaped `id`)")
            elif isinstance(lp, dict) and "tokens" in lp:
                shapes.add("legacy")
                depth = max([depth] + [len(x or {}) for x in lp.get("top_logprobs") or []])
                toks = lp.get("tokens") or []
                if caps.output_ids is None and toks and all(str(t).startswith("token_id:") for t in toks):
                    caps.output_ids = "logprob_ids"
    if caps.logprobs is None and shapes:
        caps.logprobs = "legacy" if "legacy" in shapes else "chat"
        caps.top_logprobs = depth or None
    elif shapes and caps.logprobs == "native":
        caps.notes.append(f"/v1/completions logprobs come {'legacy' if 'legacy' in shapes else 'chat'}-shaped")
    if content:
        per_chunk = all(isinstance(e.get("usage"), dict) for e in content)
        final = any(isinstance(e.get("usage"), dict) for e in events)
        if caps.usage is None or caps.generate_route == "/v1/completions":
            caps.usage = "per_chunk" if per_chunk else ("final" if final else "none")
        if not per_chunk and final:
            caps.notes.append("streamed usage only on the final event: per-chunk token counts come from ids, "
                              "logprobs or a character-proportional estimate, never all on the last chunk")
    if any(e.get("spec_decode") is not None or any(c.get("spec_decode") is not None for c in e.get("choices") or [])
           for e in events):
        caps.per_request_spec = "spec_decode"
    elif caps.per_request_spec is None and any(isinstance(e.get("timings"), dict) for e in events):
        caps.per_request_spec = "timings"


def _probe_local_agreement(client: httpx.Client, api: str, model: str | None, ids: list[int],
                           caps: Capabilities) -> None:
    """Does the endpoint count as many prompt tokens for the text as the local tokenizer gives?"""
    try:
        r = client.post(api + "/completions", json={"model": model, "prompt": PROBE_TEXT, "max_tokens": 1,
                                                    "temperature": 0.0})
        n = ((_json(r) or {}).get("usage") or {}).get("prompt_tokens") if r.status_code == 200 else None
    except (httpx.HTTPError, AttributeError):
        n = None
    assert caps.tokenizer is not None
    caps.tokenizer["endpoint_prompt_tokens"] = n
    caps.tokenizer["local_prompt_tokens"] = len(ids)
    if n is not None and n == len(ids):
        caps.tokenizer["agrees_with_endpoint"] = True
    if n is not None and n != len(ids):
        caps.tokenizer["agrees_with_endpoint"] = False
        caps.tokenize = None
        caps.errors.append(f"--tokenizer {caps.tokenizer['dir']}: {len(ids)} tokens for the probe text, the "
                           f"endpoint counts {n}: not this model's tokenizer")


def _probe_echo(client: httpx.Client, api: str, model: str | None, ids: list[int] | None, caps: Capabilities,
                extras: bool) -> None:
    if not ids or caps.token_id_prompts is False:
        return
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1,
                            "temperature": 0.0}
    if extras:
        body["return_tokens_as_token_ids"] = True
    if caps.dialect == "llamacpp":
        body["cache_prompt"] = False
    try:
        r = client.post(api + "/completions", json=body)
    except httpx.HTTPError as e:
        caps.errors.append(f"echo: {type(e).__name__}: {e}")
        return
    obj = _json(r)
    if r.status_code != 200 or not isinstance(obj, dict):
        caps.prompt_logprobs = False
        caps.notes.append(f"echo + logprobs refused ({_err(r)[:80]}): no teacher-forced scoring by echo")
        return
    lp = ((obj.get("choices") or [{}])[0] or {}).get("logprobs") or {}
    n = len(lp.get("tokens") or lp.get("content") or [])
    caps.prompt_logprobs = n >= len(ids)
    if caps.prompt_logprobs:
        caps.scoring = "echo"
    else:
        caps.notes.append(f"echo accepted but {n} logprob positions for a {len(ids)}-token prompt: no prompt logprobs")


def finite(x: float | None) -> bool:
    return x is not None and not math.isnan(x)


def with_tokenizer(specs: list, tokenizer: str | Path | None) -> list:
    """`--tokenizer DIR` on a command: every openai engine spec without a tokenizer= of its own gets it
    (local and hf engines tokenize in process). Checks that DIR has a usable tokenizer.json."""
    if tokenizer is None:
        return list(specs)
    LocalTokenizer(tokenizer)  # raises TokenizerError (a ValueError) naming what is wrong
    from specbench.harness.engines import EngineSpec

    out = []
    for s in specs:
        if s.kind == "openai" and "tokenizer" not in s.options:
            s = EngineSpec(s.kind, s.target, {**s.options, "tokenizer": str(tokenizer)}, s.raw + f",tokenizer={tokenizer}")
        out.append(s)
    return out
