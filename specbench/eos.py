"""A model's end-of-sequence ids, read from its directory: the one rule the engine stops on (engine/output.py
`eos_ids`) and the lossless suite's after-EOS check reads (suites/lossless/checks.py `eos_ids_of`).

Contract: `eos_ids(model_dir, token_to_id)` is the union of
- config.json's `eos_token_id` and generation_config.json's `eos_token_id`, each an int or a list of ints
  (`id_set`; vLLM and transformers stop on either), and
- the tokenizer's EOS: tokenizer_config.json's `eos_token` (a string, or an added-token object's `content`) as
  `token_to_id` maps it; without `token_to_id`, the directory's tokenizer.json read with the tokenizers library.
A missing or unreadable file, a file that is not a JSON object, or a value of another type adds nothing (the
engine has already refused a bad config.json when it reads the checkpoint). Imports nothing of ours and no
torch, so the engine and the suites both may import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def id_set(value: object) -> set[int]:
    """The ids of an `eos_token_id` field: an int, or a list of ints (anything else in it is no id)."""
    items = value if isinstance(value, list) else [value]
    return {v for v in items if isinstance(v, int) and not isinstance(v, bool)}


def _json_object(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def tokenizer_eos_token(model_dir: str | Path) -> str | None:
    """tokenizer_config.json's `eos_token`: a string, or an added-token object's `content`; None if absent."""
    v = _json_object(Path(model_dir) / "tokenizer_config.json").get("eos_token")
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _tokenizer_lookup(model_dir: Path) -> Callable[[str], int | None]:
    from tokenizers import Tokenizer  # noqa: PLC0415 (only where no loaded tokenizer was handed in)

    f = model_dir / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception:  # the library raises plain Exceptions for a missing or malformed file: no tokenizer EOS
        return lambda _: None
    return tok.token_to_id


def eos_ids(model_dir: str | Path, token_to_id: Callable[[str], int | None] | None = None) -> set[int]:
    """Every id that ends a generation of the model in `model_dir` (see the module docstring)."""
    d = Path(model_dir)
    ids = id_set(_json_object(d / "config.json").get("eos_token_id"))
    ids |= id_set(_json_object(d / "generation_config.json").get("eos_token_id"))
    eos = tokenizer_eos_token(d)
    if eos:
        tid = (token_to_id or _tokenizer_lookup(d))(eos)
        if tid is not None:
            ids.add(tid)
    return ids
