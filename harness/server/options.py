"""`ServerOptions`: what an operator sets on a running server (auth, CORS, request ids, shutdown, limits).

Contract: a frozen dataclass validated at construction; a bad value raises `ValueError` naming the
option (as the command line spells it), the value and what would be accepted, so `specbench serve`
refuses it in one line before loading anything. `api_key=None` (and no `SPECBENCH_API_KEY` in the
environment, read by `from_env`) leaves every route open; with a key every route but `/health` (and
`/metrics` unless `metrics_need_key`) answers 401 without `Authorization: Bearer <key>`.
`allowed_origins` empty = no CORS headers at all (browsers refuse cross-origin calls); `("*",)` = any.
Request limits (docs/server.md, "Limits"): `max_stop_strings` stop strings of at most `max_stop_length` characters
each (OpenAI accepts 4 stop sequences, TGI 4 by default, vLLM any number: these defaults are far past what a
client sends, and bound the stop automaton a request builds, engine/stops.py); a chat template render gets
`chat_template_timeout` seconds in its own process (engine/chat_template.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from specbench import env

API_KEY_ENV = "SPECBENCH_API_KEY"
COALESCE_ENV = "SPECBENCH_COALESCE"
_ORIGIN = re.compile(r"^(\*|https?://[^\s/]+)$")


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None
    metrics_need_key: bool = False
    allowed_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    prep_threads: int = 8  # worker threads that parse, tokenize, render templates and admit requests
    max_stop_strings: int = 64
    max_stop_length: int = 256  # characters
    chat_template_timeout: float = 5.0  # seconds one render may take
    # SPECBENCH_COALESCE=1: a stream's outputs queued while its consumer was busy go out as one event (serving.py
    # `deltas`); off by default: one event per engine step, so a stream's chunking does not depend on timing
    coalesce: bool = field(default_factory=lambda: env.flag(COALESCE_ENV))

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key.strip() or any(c.isspace() for c in self.api_key)):
            raise ValueError(f"--api-key={self.api_key!r} is invalid: expected a non-empty key without spaces")
        for o in self.allowed_origins:
            if not _ORIGIN.match(o):
                raise ValueError(f"--allowed-origins entry {o!r} is invalid: expected '*' or an origin such as "
                                 "'https://example.com' or 'http://localhost:3000' (scheme://host[:port], no path)")
        if not (isinstance(self.shutdown_timeout, int | float) and 0 <= self.shutdown_timeout <= 3600):
            raise ValueError(f"--shutdown-timeout={self.shutdown_timeout!r} is invalid: expected seconds in 0..3600")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} is invalid: expected >= 1024")
        if self.prep_threads < 1:
            raise ValueError(f"prep_threads={self.prep_threads} is invalid: expected >= 1")
        for flag, v, hi in (("--max-stop-strings", self.max_stop_strings, 65_536),
                            ("--max-stop-length", self.max_stop_length, 65_536)):
            if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi):
                raise ValueError(f"{flag}={v!r} is invalid: expected an integer in 1..{hi}")
        t = self.chat_template_timeout
        if not (isinstance(t, int | float) and not isinstance(t, bool) and 0.01 <= t <= 600):
            raise ValueError(f"--chat-template-timeout={t!r} is invalid: expected seconds in 0.01..600")

    @classmethod
    def from_env(cls, api_key: str | None = None, **kw: object) -> ServerOptions:
        """`api_key` or else `$SPECBENCH_API_KEY` (an empty variable counts as unset)."""
        key = api_key if api_key is not None else env.get(API_KEY_ENV)
        return cls(api_key=key, **kw)  # type: ignore[arg-type]


def parse_origins(value: str | None) -> tuple[str, ...]:
    """`--allowed-origins`: a comma-separated list or a JSON list (vLLM's spelling); '' or None = none."""
    if value is None or not value.strip():
        return ()
    v = value.strip()
    if v.startswith("["):
        try:
            items = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"--allowed-origins={value!r} is invalid: not a JSON list ({e})") from e
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"--allowed-origins={value!r} is invalid: expected a JSON list of strings")
        return tuple(x.strip().rstrip("/") for x in items)
    return tuple(x.strip().rstrip("/") for x in v.split(",") if x.strip())
