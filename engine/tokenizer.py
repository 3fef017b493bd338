"""Tokenizer wrapper over a HF `tokenizer.json` (the `tokenizers` library) plus the chat template.

Contract: encode(text) -> ids without special-token insertion beyond what the tokenizer's post-processor
adds; decode(ids) tolerates ids beyond the tokenizer's vocabulary (random-weight models with a padded
vocab emit them) by rendering them as empty strings, so a server never crashes on them.
Incremental detokenization: `decode_prefix_safe` returns text for ids, dropping a trailing incomplete
UTF-8 sequence so streamed text never carries a replacement character that later resolves.
Chat templates come with the model directory, i.e. from whoever published it, so they are rendered in
jinja2's `ImmutableSandboxedEnvironment` (engine/chat_template.py, compiled once): a template that reaches for
Python internals (`__class__`, `__globals__`, mutating a list, ...) raises `jinja2.exceptions.SecurityError`
instead of running code in the process; `raise_exception(msg)` (the HF convention) raises `TemplateError(msg)`.
This render is unbounded in time and memory: the server renders through engine/chat_template.py's
`BoundedRenderer` instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTok

from .chat_template import compile_template, render
from .config import ConfigError


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        f = d / "tokenizer.json"
        if not f.is_file():
            raise ConfigError(f"{f}: missing; the model directory needs tokenizer.json")
        try:
            self._tok = _HFTok.from_file(str(f))
        except Exception as e:  # the library raises plain Exceptions on malformed files
            raise ConfigError(f"{f}: cannot be read as a tokenizers file ({e})") from e
        cfg_path = d / "tokenizer_config.json"
        self.config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token: str | None = _tok_str(self.config.get("eos_token"))
        self.eos_token_id: int | None = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.name = str(d)
        self._compiled: Any = None

    @property
    def backend(self) -> _HFTok:
        """The tokenizers library object (engine/detok.py streams through it)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: the library's encode holds the GIL for the whole call, so one long
        # prompt tokenized on a server's worker thread stalled its event loop (/health 1.5-2.4 s behind a
        # 500k-character prompt); encode_batch releases it and returns the same ids
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def token_to_id(self, tok: str) -> int | None:
        return self._tok.token_to_id(tok)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ok = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(ok, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        t = self._tok.id_to_token(i) if 0 <= i < self.vocab_size else None
        return t if t is not None else f"<|id_{i}|>"

    def decode_prefix_safe(self, ids: list[int]) -> str:
        text = self.decode(ids)
        return text[:-1] if text.endswith("\ufffd") else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            # A plain fallback that is at least unambiguous.
            body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return body + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        return render(self._template(), messages, add_generation_prompt, self.eos_token or "")

    def _template(self) -> Any:
        src = self.chat_template or ""
        if self._compiled is None or self._compiled[0] != src:  # compiled once per template text
            self._compiled = (src, compile_template(src))
        return self._compiled[1]


def _tok_str(v: object) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None
