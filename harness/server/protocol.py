"""Request validation for the OpenAI-compatible endpoints: a JSON body -> a typed, checked request.

Contract: `parse_completion` / `parse_chat` either return a fully validated dataclass or raise
`APIError(400, param=<field>)` whose message names the field, the value and what would be accepted.
Booleans are never accepted where numbers belong. Unknown fields are ignored (as vLLM does), but
options this server cannot honour (n > 1, best_of, suffix) are refused rather
than silently dropped. Range checks against the model (token ids in the prompt, stop_token_ids and logit_bias,
the context length) happen when the request is admitted by the engine. `stop` is bounded by the server's options
(`ServerOptions.max_stop_strings` / `max_stop_length`): past them a 400 naming `stop`, the limit and the option.
A message's `content` may be null (or absent) only for an assistant message with `tool_calls` (OpenAI's rule).
"""

from __future__ import annotations

import json
import json.scanner
import math
from dataclasses import dataclass, field
from typing import Any

from specbench import env
from specbench.engine.config import ConfigError, bias_pairs

from .errors import APIError
from .options import ServerOptions

MAX_LOGPROBS = 20
MAX_PROMPTS = 1024
# The JSON parse holds the GIL for the whole call (the C decoder never lets go), so a body of millions of small
# values stalls the event loop and /health however far off the loop it runs: on the 2-core box 1M six-digit ids
# parse in 65 ms and 1M two-key objects in 210 ms. Bodies are refused before the parse above this many ',' and
# ':' (an upper bound on the values of its arrays and objects; a count costs ~1 ms per MB): a prompt, a batch
# of prompts or a message list that large cannot fit any context this server runs. At the bound the parse
# stays near 20 ms. SPECBENCH_MAX_JSON_VALUES moves it (0 = no bound).
# Under the bound the C parse of 250,000 short strings (a 3.3 MB stop list) still held the GIL 35-50 ms on the loaded
# 2-core box, so a body with more than YIELD_VALUES separators is parsed by the stdlib's pure-Python scanner: about 6x
# the CPU (on a worker thread), but Python code, which hands the GIL to the event loop every switch interval. The
# separators are counted in slices for the same reason (one count over 3.7 MB held it 7-13 ms).
YIELD_VALUES = 8_192
_COUNT_SLICE = 1 << 18


def _max_json_values() -> int:
    try:
        return int(env.get("SPECBENCH_MAX_JSON_VALUES"))
    except env.EnvError as e:
        raise SystemExit(str(e)) from None


MAX_JSON_VALUES = _max_json_values()
ROLES = ("system", "user", "assistant", "tool", "developer")


def parse_json(raw: bytes, max_values: int | None = None) -> dict:
    if not raw.strip():
        raise APIError("the request body is empty: expected a JSON object", param=None, code="invalid_json")
    bound = MAX_JSON_VALUES if max_values is None else max_values
    n = _separators(raw) if len(raw) > min(YIELD_VALUES, bound or YIELD_VALUES) else 0
    if bound and n > bound:
        raise APIError(f"the request body has {n} ',' and ':' separators: at most {bound} are accepted (a "
                       "prompt or message list that large cannot fit the context; SPECBENCH_MAX_JSON_VALUES "
                       "moves the bound)", 413, code="too_many_values")
    try:
        if n <= YIELD_VALUES:
            body = json.loads(raw)
        else:
            body = _YieldingDecoder().decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})", code="invalid_json") from e
    except RecursionError as e:
        raise APIError("the request body is nested too deeply: expected a JSON object a few levels deep",
                       code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _separators(raw: bytes) -> int:
    return sum(raw.count(b",", i, i + _COUNT_SLICE) + raw.count(b":", i, i + _COUNT_SLICE)
               for i in range(0, len(raw), _COUNT_SLICE))


class _YieldingDecoder(json.JSONDecoder):
    """json's decoder over its pure-Python scanner (the C one is a single GIL-holding call); same results."""

    def __init__(self) -> None:
        super().__init__()
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]


def _bad(name: str, value: Any, accepted: str) -> APIError:
    shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    return APIError(f"{name}={shown} is invalid: expected {accepted}", param=name, code="invalid_value")


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
        v = int(v)
    rng = f"an integer{f' >= {lo}' if lo is not None else ''}{f' and <= {hi}' if hi is not None else ''}"
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, v, rng)
    return v


def get_num(body: dict, name: str, default: float, lo: float, hi: float | None, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        raise _bad(name, v, f"a number {lo_s}" + (f" and <= {hi}" if hi is not None else ""))
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, v, "true or false")
    return v


def get_stop(body: dict, limits: ServerOptions | None = None) -> tuple[str, ...]:
    """`stop` as a tuple; past the server's limits a 400 naming the field, the limit and the option."""
    lim = limits or ServerOptions()
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and len(v) > lim.max_stop_strings:
        raise APIError(f"stop has {len(v)} strings: at most {lim.max_stop_strings} are accepted (--max-stop-strings)",
                       param="stop", code="too_many_stop_strings")
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _bad("stop", v, "a non-empty string or a list of non-empty strings")
    for i, s in enumerate(v):
        if len(s) > lim.max_stop_length:
            raise APIError(f"stop[{i}] has {len(s)} characters: at most {lim.max_stop_length} are accepted "
                           "(--max-stop-length)", param="stop", code="stop_string_too_long")
    return tuple(v)


def get_ids(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name) or []
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise _bad(name, v, "a list of non-negative token ids")
    return tuple(v)


@dataclass
class CommonParams:
    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    min_tokens: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    include_stop_str: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    tokens_as_ids: bool
    cache_salt: str | None = None  # vLLM's: requests share prefix-cache blocks only under equal salts


@dataclass
class CompletionRequest(CommonParams):
    prompts: list[str | list[int]] = field(default_factory=list)
    logprobs: int | None = None
    echo: bool = False


@dataclass
class ChatRequest(CommonParams):
    messages: list[dict] = field(default_factory=list)
    logprobs: int | None = None  # top_logprobs when logprobs=true, else None
    add_generation_prompt: bool = True


def _refuse_unsupported(body: dict) -> None:
    n = get_int(body, "n", 1, lo=1)
    if n != 1:
        raise _bad("n", n, "1 (this server returns one choice per prompt)")
    bo = body.get("best_of")
    if bo is not None and bo != 1:
        raise _bad("best_of", bo, "null or 1")
    if body.get("suffix"):
        raise _bad("suffix", body["suffix"], "null (suffix is not supported)")


def _common(body: dict, max_tokens_default: int | None, max_tokens_key: str = "max_tokens",
            limits: ServerOptions | None = None) -> dict:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", model, "a string")
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options", so, "an object such as {\"include_usage\": true}")
    so = so or {}
    return dict(
        model=model,
        max_tokens=get_int(body, max_tokens_key, max_tokens_default, lo=0),
        temperature=get_num(body, "temperature", 1.0, 0.0, None),  # the OpenAI default
        top_p=get_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=get_int(body, "top_k", 0, lo=-1) or 0,
        min_p=get_num(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=get_num(body, "repetition_penalty", 1.0, 0.0, None, lo_open=True),
        presence_penalty=get_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body),
        min_tokens=get_int(body, "min_tokens", 0, lo=0) or 0,
        seed=get_int(body, "seed", None, lo=-(2**63), hi=2**63 - 1),  # int64, as vLLM (torch refuses more)
        stop=get_stop(body, limits),
        stop_token_ids=get_ids(body, "stop_token_ids"),
        ignore_eos=get_bool(body, "ignore_eos", False),
        include_stop_str=get_bool(body, "include_stop_str_in_output", False),
        stream=stream,
        include_usage=stream and get_bool(so, "include_usage", False),
        continuous_usage=stream and get_bool(so, "continuous_usage_stats", False),
        return_token_ids=get_bool(body, "return_token_ids", False),
        tokens_as_ids=get_bool(body, "return_tokens_as_token_ids", False),
        cache_salt=_cache_salt(body),
    )


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (null or {} = none); ids past the vocabulary are
    refused when the engine admits the request."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad("logit_bias", v, "an object of token id -> number in [-100, 100]")
    try:
        return bias_pairs(v)
    except ConfigError as e:
        raise APIError(str(e), param="logit_bias", code="invalid_value") from e


def _cache_salt(body: dict) -> str | None:
    v = body.get("cache_salt")
    if v is not None and (not isinstance(v, str) or not v):
        raise APIError(f"cache_salt={v!r:.80} is invalid: expected a non-empty string", param="cache_salt")
    return v


def _prompts(v: Any) -> list[str | list[int]]:
    accepted = "a non-empty string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(v, str):
        if not v:
            raise APIError("prompt is empty: at least one token is required", param="prompt", code="empty_prompt")
        return [v]
    if not isinstance(v, list) or not v:
        raise _bad("prompt", v, accepted)
    if all(is_int(t) for t in v):
        if any(t < 0 for t in v):
            raise _bad("prompt", v, "token ids >= 0")
        return [list(v)]
    if len(v) > MAX_PROMPTS:
        raise APIError(f"prompt has {len(v)} entries: at most {MAX_PROMPTS} per request", param="prompt")
    out: list[str | list[int]] = []
    for i, p in enumerate(v):
        if isinstance(p, str) and p:
            out.append(p)
        elif isinstance(p, list) and p and all(is_int(t) and t >= 0 for t in p):
            out.append(list(p))
        elif p == "" or p == []:
            raise APIError(f"prompt[{i}] is empty: at least one token is required", param="prompt",
                           code="empty_prompt")
        else:
            raise _bad(f"prompt[{i}]", p, "a non-empty string or a list of token ids")
    return out


def parse_completion(body: dict, limits: ServerOptions | None = None) -> CompletionRequest:
    if "prompt" not in body:
        raise APIError("prompt is required", param="prompt", code="missing_field")
    prompts = _prompts(body["prompt"])
    common = _common(body, 16, limits=limits)
    lp = body.get("logprobs")
    if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise _bad("logprobs", lp, f"null or an integer in [0, {MAX_LOGPROBS}]")
    echo = get_bool(body, "echo", False)
    if common["max_tokens"] == 0 and not echo:
        raise _bad("max_tokens", 0, "an integer >= 1 (0 is allowed only with echo=true, for scoring)")
    return CompletionRequest(prompts=prompts, logprobs=lp, echo=echo, **common)


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise _bad("messages", v, "a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", m, f"an object with role in {', '.join(ROLES)}")
        c = m.get("content")
        if isinstance(c, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise _bad(f"messages[{i}].content", c, "a string or a list of {\"type\": \"text\", \"text\"} parts")
            c = "".join(p["text"] for p in c)
        elif c is None:  # OpenAI: content is required, except on an assistant message that carries tool_calls
            if m["role"] != "assistant" or not (m.get("tool_calls") or m.get("function_call")):
                raise APIError(f"messages[{i}].content is {'null' if 'content' in m else 'missing'}: a {m['role']} "
                               "message needs a string or a list of text parts (only an assistant message with "
                               "tool_calls may leave it null)", param=f"messages[{i}].content", code="invalid_value")
            c = ""
        elif not isinstance(c, str):
            raise _bad(f"messages[{i}].content", c, "a string or a list of text parts")
        out.append({"role": m["role"], "content": c})
    return out


def parse_chat(body: dict, limits: ServerOptions | None = None) -> ChatRequest:
    messages = _messages(body.get("messages"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    common = _common(body, None, key, limits)
    if common["max_tokens"] == 0:
        raise _bad(key, 0, "an integer >= 1")
    want = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise _bad("top_logprobs", top, "null unless logprobs=true")
    return ChatRequest(messages=messages, logprobs=(top or 0) if want else None,
                       add_generation_prompt=get_bool(body, "add_generation_prompt", True), **common)
