"""Secrets out of every artifact: API keys never reach a results file, a log line or a report.

- `scrub(text, secrets)`: every occurrence of each known secret (4 characters or more) -> `MASK`.
- `redact_text(text)`: what looks like a secret without knowing it: an engine string's `api_key=...`
  option, a `--api-key VALUE` / `--api-key=VALUE` flag, and the token of an `Authorization: [Bearer]
  ...` header or a `Bearer ...` value when it looks like a key (8+ characters with a digit: "bearer bonds"
  is left alone). For configuration, argv and error texts; generated text is only `scrub`bed.
- `redact_argv(argv)`: a command line with the value after `--api-key` and every `api_key=` masked
  (what provenance records as argv).
- `redact(obj, secrets)`: the same over a JSON-like object (strings inside dicts and lists, keys too).
The results store (harness/results.py `open_run(secrets=...)`) applies `scrub` to every record line and
`redact_text` to run.json and side files, so a record that carries a known key by accident is masked on its
way to disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

MASK = "***"
SECRET_FLAGS = ("--api-key",)
_TOKEN = r"(?!\*\*\*)(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,}"  # key-like: 8+ characters, a digit
_PATTERNS = (
    (re.compile(r"(api_key=)(?!\*\*\*)[^,;\s\"']+"), r"\1" + MASK),
    (re.compile(r"(--api-key[= ])(?!\*\*\*)[^\s\"',;]+"), r"\1" + MASK),
    (re.compile(r"((?i:authorization)[\"']?\s*[:=]\s*[\"']?(?:(?i:bearer|basic)\s+)?)" + _TOKEN), r"\1" + MASK),
    (re.compile(r"((?i:bearer)\s+)" + _TOKEN), r"\1" + MASK),
)


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    for s in secrets:
        if s and len(s) >= 4 and s in text:
            text = text.replace(s, MASK)
    return text


def redact_text(text: str, secrets: Iterable[str | None] = ()) -> str:
    text = scrub(text, secrets)
    for pat, rep in _PATTERNS:
        text = pat.sub(rep, text)
    return text


def redact_argv(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    hide = False
    for a in argv:
        if hide:
            out.append(MASK)
            hide = False
            continue
        if a in SECRET_FLAGS:
            hide = True
            out.append(a)
            continue
        out.append(redact_text(a))
    return out


def redact(obj: Any, secrets: Iterable[str | None] = ()) -> Any:
    secrets = list(secrets)
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    if isinstance(obj, dict):
        return {redact(k, secrets) if isinstance(k, str) else k: redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v, secrets) for v in obj]
    return obj
